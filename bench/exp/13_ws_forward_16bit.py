"""The warp-specialized forward at 16-bit head dims 64 and 256: each candidate cell of the tile table against
the forward that serves them today (the wgmma path) and cuDNN (torch SDPA) in the same run, on FlashAttention's
shapes (16k tokens, hidden 2048). Correctness first: each candidate's out on the last 256 rows of two heads
against a float64 reference (max error, beside the wgmma forward's). L2 flushed and a spin before every call
(GPU work only), median of 15. Writes $OUT/ws16_exp.json.

    PYTHONPATH=. python bench/exp/13_ws_forward_16bit.py [--dims 64,256] [--seqlens 512,1k,2k,8k,16k]
        [--cells 256=12.64.256/r2w,12.64.256/r2wo]
"""

import argparse
import functools
import json
import os

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing
from cupyflash._cuda import compile as C
from cupyflash._cuda import plans, tiles
from cupyflash._cuda.variants import Variant

BF16 = np.dtype(ml_dtypes.bfloat16)
CONFIGS = {
    64: ["12.128.64/r4w", "12.128.64/r2w", "12.64.64/r4w", "12.192.64/r3w"],
    256: ["12.64.256/r2w", "12.64.256/r2", "12.32.256/r4w"],
}
parser = argparse.ArgumentParser()
parser.add_argument("--dims", default="64,256")
parser.add_argument("--seqlens", default="512,1k,2k,8k,16k")
parser.add_argument("--precompile-only", action="store_true")
parser.add_argument(
    "--cells",
    action="append",
    default=[],
    metavar="D=CELL,CELL",
    help="candidate cells for head dim D instead of the built-in list",
)
args = parser.parse_args()
dims = [int(x) for x in args.dims.split(",")]
for spec in args.cells:
    d, cells = spec.split("=")
    CONFIGS[int(d)] = cells.split(",")
seqlens = [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in args.seqlens.split(",")]

flush = cupy.empty(256 << 20, dtype=cupy.uint8)


def ms(fn):
    def before():
        flush.fill(0)
        _timing.spin(10)

    return _timing.median_ms(fn, warmup=3, repeats=15, before_each=before)


def set_cell(d, cell):
    key = ("ws", 2, d, "fwd", "plain")
    if cell is None:
        tiles.CELLS.pop(key, None)
    else:
        tiles.CELLS[key] = tiles._parse_cell(cell, "ws")
    C.modules.clear()
    plans.clear()


def precompile():
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for d in dims:
        for cell in CONFIGS[d]:
            set_cell(d, cell)
            for causal in (False, True):
                v = Variant("fwd", "bfloat16", d, "ws", causal=causal)
                jobs.append((v.code(("fwd",)), v.options, v.name_expression("fwd")))

    def build(job):
        code, options, name = job
        cupy.RawModule(code=code, options=options, name_expressions=[name]).get_function(name)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, jobs))
    print("precompiled", len(jobs), flush=True)


try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    torch = None


def reference_rows(q, k, v, causal, rows=256):
    """float64 out of the last `rows` rows of heads (0, 0) and (-1, -1)."""
    outs = []
    for b, h in ((0, 0), (-1, -1)):
        qq = q[b, h, -rows:].astype(np.float64)
        kk = k[b, h].astype(np.float64)
        vv = v[b, h].astype(np.float64)
        s = qq @ kk.T * q.shape[-1] ** -0.5
        if causal:
            n = k.shape[2]
            i = cupy.arange(n - rows, n)[:, None]
            j = cupy.arange(n)[None, :]
            s = cupy.where(j <= i, s, -cupy.inf)
        s = cupy.exp(s - s.max(1, keepdims=True))
        outs.append((s / s.sum(1, keepdims=True)) @ vv)
    return outs


def max_err(out, ref, rows=256):
    return max(
        float(cupy.abs(out[b, h, -rows:].astype(np.float64) - r).max()) for (b, h), r in zip(((0, 0), (-1, -1)), ref)
    )


precompile()
if args.precompile_only:
    raise SystemExit(0)
results = []
for d in dims:
    for n in seqlens:
        for causal in (False, True):
            b, h = max(1, 16384 // n), 2048 // d
            rng = cupy.random.default_rng(n + d)
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=np.float32).astype(BF16) for _ in range(3))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            ref = reference_rows(q, k, v, causal)
            row = dict(d=d, n=n, causal=causal)
            set_cell(d, None)
            out = cupyflash.attention_forward(q, k, v, causal=causal)[0]
            row["wgmma_err"] = max_err(out, ref)
            row["wgmma"] = flops / ms(lambda: cupyflash.attention_forward(q, k, v, causal=causal)) / 1e9
            if torch is not None:
                tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    sdpa = functools.partial(
                        torch.nn.functional.scaled_dot_product_attention, tq, tk, tv, is_causal=causal
                    )
                    row["cudnn"] = flops / ms(sdpa) / 1e9
            line = (
                f"D={d:3d} N={n:5d} {'causal' if causal else 'full  '}: wgmma {row['wgmma']:5.0f} "
                f"cudnn {row.get('cudnn', 0):5.0f} |"
            )
            for cell in CONFIGS[d]:
                set_cell(d, cell)
                out = cupyflash.attention_forward(q, k, v, causal=causal)[0]
                err = max_err(out, ref)
                used = {plan.variant.path for plan in plans.entries("plan").values()}
                assert used == {"ws"}, used
                t = flops / ms(lambda: cupyflash.attention_forward(q, k, v, causal=causal)) / 1e9
                row[cell] = t
                row[cell + " err"] = err
                bad = "" if err <= 2 * row["wgmma_err"] + 1e-3 else " BAD"
                line += f" {cell} {t:5.0f}{bad}"
            print(line + f"  err wgmma {row['wgmma_err']:.1e}", flush=True)
            results.append(row)
            set_cell(d, None)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "ws16_exp.json"), "w") as f:
        json.dump(results, f, indent=1)
