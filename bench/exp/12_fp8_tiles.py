"""The FP8 forward's tiles on one GPU: for each candidate cell of the tile table (1-byte rows), the kernel alone
(a prepared plan, launched again), the whole call and the host-side preparation of a plan, against our
bfloat16 forward on the same shapes (FlashAttention's: 16k tokens, hidden 2048). L2 flushed and a spin before
every call (GPU work only), median of 10. Writes $OUT/fp8_exp.json.

    PYTHONPATH=. python bench/exp/12_fp8_tiles.py [--cells 64=12.128.64/r4w,16.128.64/r4w ...]

A cell of 16 warps runs three computing warpgroups (192-row tiles).
"""

import argparse
import json
import os

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing
from cupyflash._cuda import compile as C
from cupyflash._cuda import fp8 as F
from cupyflash._cuda import plans, tiles

BF16 = np.dtype(ml_dtypes.bfloat16)
CONFIGS = {
    64: ["12.128.64/r4w", "12.192.64/r4w", "12.192.64/r3w"],
    128: ["12.128.128/r3w", "12.128.128/r4w", "12.192.128/r3w"],
    256: ["12.64.256/r4w", "12.64.256/r3w"],
}
parser = argparse.ArgumentParser()
parser.add_argument(
    "--cells",
    action="append",
    default=[],
    metavar="D=CELL,CELL",
    help="candidate cells for head dim D instead of the built-in list (only the dims given run)",
)
args = parser.parse_args()
if args.cells:
    CONFIGS = {int(spec.split("=")[0]): spec.split("=")[1].split(",") for spec in args.cells}
flush = cupy.empty(256 << 20, dtype=cupy.uint8)


def ms(fn):
    def before():
        flush.fill(0)
        _timing.spin(15)

    return _timing.median_ms(fn, warmup=2, repeats=10, before_each=before)


def precompile():
    from concurrent.futures import ThreadPoolExecutor

    from cupyflash._cuda import tile_policy

    jobs = []
    for d, cells in CONFIGS.items():
        for cell in cells:
            tiles.CELLS[("ws", 1, d, "fwd", "plain")] = tiles._parse_cell(cell, "ws")
            for causal in (False, True):
                v = tile_policy.fp8(d, causal, "bfloat16")
                jobs.append((v.code(("fwd",)), v.options, v.name_expression("fwd")))

    def build(job):
        code, options, name = job
        m = cupy.RawModule(code=code, options=options, name_expressions=[name])
        m.get_function(name)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, jobs))
    print("precompiled", len(jobs), flush=True)


precompile()
rows = []
for d, cells in CONFIGS.items():
    for n in (2048, 16384):
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            rng = cupy.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=np.float32).astype(BF16) for _ in range(3))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            t_bf = ms(lambda: cupyflash.attention_forward(q, k, v, causal=causal))
            ob = cupyflash.attention_forward(q, k, v, causal=causal)[0][:2].astype(np.float32)
            fq, fk, fv = (cupyflash.quantize_fp8(x) for x in (q, k, v))
            line = f"D={d} N={n} causal={causal}: bf16 {flops / t_bf / 1e9:6.0f}"
            for cell in cells:
                tiles.CELLS[("ws", 1, d, "fwd", "plain")] = tiles._parse_cell(cell, "ws")
                C.modules.clear()
                plans.clear()  # the calls' kept plans are the previous cell's
                batch = fq.shape[:-2]
                try:
                    inputs = F.kernel_inputs(fq, fk, fv, batch)
                    plan, out, lse, dv = F.prepare(
                        fq, fk, fv, inputs, batch, scale=d**-0.5, causal=causal, out_dtype=BF16
                    )
                    t_k = ms(lambda: plan.launch(None, None))
                    of = cupyflash.attention_forward(fq, fk, fv, causal=causal)[0][:2].astype(np.float32)
                    err = float(cupy.abs(of - ob).max() / cupy.abs(ob).max())
                    t_c = ms(lambda: cupyflash.attention_forward(fq, fk, fv, causal=causal))
                    t_p = ms(lambda: F.prepare(fq, fk, fv, inputs, batch, scale=d**-0.5, causal=causal, out_dtype=BF16))
                    line += (
                        f" | {cell}: kernel {flops / t_k / 1e9:6.0f} call {flops / t_c / 1e9:6.0f} "
                        f"prep {t_p * 1e3:5.0f}us err {err:.1e}"
                    )
                    rows.append(
                        dict(
                            d=d,
                            n=n,
                            causal=causal,
                            cell=cell,
                            bf16_ms=t_bf,
                            kernel_ms=t_k,
                            call_ms=t_c,
                            prep_ms=t_p,
                            flops=flops,
                        )
                    )
                except Exception as e:
                    line += f" | {cell}: {type(e).__name__} {str(e)[:200]}"
                plan = None
            print(line, flush=True)
            q = k = v = fq = fk = fv = None
            cupy.get_default_memory_pool().free_all_blocks()
json.dump(rows, open(os.environ.get("OUT", ".") + "/fp8_exp.json", "w"), indent=1)
