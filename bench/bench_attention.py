#!/usr/bin/env python3
"""Benchmark cupyflash against a hand-written CuPy attention and, when torch is importable, torch's SDPA
backends ``flash`` (FlashAttention-2), ``cudnn`` and ``efficient`` on the same inputs (shared through
DLPack, no copy). ``--backends ... ours-unordered`` adds ours with ``attention_backward(deterministic=False)``.

    python bench/bench_attention.py                          # every case (split by --cases on a 10-min budget)
    python bench/bench_attention.py --quick                  # 8 bf16 cases
    python bench/bench_attention.py --cases 'bf16-d128-.*-n8k' --json results.json
    python bench/bench_attention.py --head-dims 80 96 192 --cases '^bf16-'   # other head dims
    python bench/bench_attention.py --cold-start --memory --no-speed
    python bench/bench_attention.py --quick --memory --json results.json --plot   # PNGs next to the JSON

Shapes follow FlashAttention's benchmark: 16384 tokens in all (batch B = 16384 // N) and hidden 2048
(heads H = 2048 // D), N in 512 ... 16k, D in 64, 128, 256 (--head-dims), causal and not, bf16, fp16, fp32. Case names
read ``bf16-d128-causal-n8k``. FLOPs: forward 4·B·H·N²·D (halved for causal); backward 2.5 × forward.

Every backend is validated once per case before it is timed: its forward on the timed inputs (the last
rows of two heads, against the float64 reference), and its backward on a reduced problem of the same kind
(one batch, two heads, N <= 512). A backend that fails validation is reported as "bad", never timed.
Timing: CUDA events around each call on the current (legacy default) stream, which torch shares; warm-up,
then the median of --repeats (>= 20) calls, with L2 flushed (a 256 MiB memset) before every call.
--timing call (the default) counts the host's time to issue a call wherever it exceeds the flush's ~0.1 ms
head start, as a user's GPU waits for it too; --timing gpu also queues a one-thread spin kernel of
HOST_COVER_MS after the flush, so that the whole call is issued before its start event fires and the events
time the GPU's work alone, without host gaps between a call's kernels (what a CUDA graph replay shows). The
lent machines' host time per call varies several-fold from minute to minute (docs/design/host_time.md), so rows
under ~1 ms compare kernels only with --timing gpu. Every backend is timed the same way.
Torch backward is timed alone: the forward runs once outside the timed region and autograd replays
the backward with retain_graph=True. fp32 is compared with TF32 off in torch (CuPy never uses TF32 unless
CUPY_TF32=1).

--dropout P: every backend runs with dropout probability P (ours with a fixed seed; torch draws its own
mask, so torch's results cannot be compared with the reference: its validation runs with P = 0, ours with P
against the reference given the same seed, forward and backward on the reduced problem). The hand-written
CuPy attention has no dropout and is skipped.
--cold-start: time to first result for a variant not yet compiled, in a fresh process with an empty
CUPY_CACHE_DIR, then again in a fresh process with that (now warm) cache.
--memory: extra peak memory beyond the inputs (CuPy's pool, through a memory hook), N from 4k to 128k, ours
vs the hand-written CuPy attention (and torch flash when present).
--plot: after writing --json, draw it with bench/plot.py (needs matplotlib): TFLOP/s vs N per backend for
each (dtype, D, causal), and memory vs N, as PNGs next to the JSON.
"""

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np

try:
    import cupyflash
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cupyflash
import cupy

from cupyflash import _timing, reference

try:  # torch is optional, and never a dependency of cupyflash itself
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # ImportError, or a torch that cannot load
    torch = None

TOTAL_TOKENS, HIDDEN = 16384, 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
BACKENDS = ("ours", "flash", "cudnn", "efficient", "naive")
UNORDERED = "ours-unordered"  # ours with attention_backward(deterministic=False); on request (--backends)
TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
QUICK = dict(dtypes=("bf16",), head_dims=(64, 128), seqlens=(2048, 8192))
BWD_FLOPS_FACTOR = 2.5
# Sanity bounds (relative max-norm vs float64) that every backend must meet to be timed: they catch wrong
# results, not small accuracy differences (tests/ and `python -m cupyflash` check accuracy).
TOLERANCES = {"bf16": 5e-2, "fp16": 1e-2, "fp32": 1e-4}
GRAD_TOLERANCE_FACTOR = 2
VALIDATION_ROWS, VALIDATION_HEADS, VALIDATION_BWD_N = 256, 2, 512
L2_FLUSH_BYTES = 256 * 1024 * 1024
TIMINGS = ("call", "gpu")
HOST_COVER_MS = (
    20.0  # --timing gpu: the spin before each timed call (a full-bias backward took the host 5.7 ms to issue)
)
MIB = 1024 * 1024
MEMORY_SEQLENS = (4096, 8192, 16384, 32768, 65536, 131072)
# fp16, not bf16, so that the hand-written CuPy attention runs in the inputs' dtype (no bf16 matmul in CuPy).
MEMORY_CASE = dict(dtype="fp16", heads=16, head_dim=128, causal=True)
COLD_START_CASE = dict(dtype="bf16", heads=8, seqlen=1024, head_dim=96, causal=True)
DROPOUT_SEED = 20261122


class Case:
    def __init__(self, dtype, d, n, causal):
        self.dtype, self.d, self.n, self.causal = dtype, d, n, causal
        self.b, self.h = TOTAL_TOKENS // n, HIDDEN // d
        self.name = (
            f"{dtype}-d{d}-{'causal' if causal else 'full'}-n{n // 1024}k"
            if n >= 1024
            else f"{dtype}-d{d}-{'causal' if causal else 'full'}-n{n}"
        )
        self.flops_fwd = 4 * self.b * self.h * n * n * d / (2 if causal else 1)
        self.flops_bwd = BWD_FLOPS_FACTOR * self.flops_fwd


def main(argv=None):
    args = parse_args(argv)
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = {"environment": environment()}
    for key, value in results["environment"].items():
        print(f"{key:10} {value}")
    if args.speed:
        cases = select_cases(args)
        print(
            f"\n{len(cases)} cases, backends {', '.join(args.backends)}, {args.repeats} repeats, timing {args.timing}"
        )
        results["timing"] = args.timing
        results["cases"] = [run_case(case, args) for case in cases]
        print_speed_tables(results["cases"], args.backends)
    if args.cold_start:
        results["cold_start"] = cold_start()
    if args.memory:
        results["memory"] = memory_table(args)
        results["memory_case"] = MEMORY_CASE
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.json}")
    if args.plot:
        draw_plots(args.json)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bf16, D in 64 and 128, N in 2k and 8k")
    parser.add_argument("--cases", metavar="REGEX", help="only cases whose name matches (re.search)")
    parser.add_argument(
        "--head-dims",
        type=int,
        nargs="+",
        default=list(HEAD_DIMS),
        metavar="D",
        help="head dims of the grid (default %(default)s; heads H = 2048 // D)",
    )
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS + (UNORDERED,))
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (>= 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default="call",
        help="call: the host's time to issue a call counts where it exceeds the L2 flush; "
        "gpu: the GPU's work alone (a spin covers the host; module docstring)",
    )
    parser.add_argument(
        "--naive-max-n",
        type=int,
        default=4096,
        help="time the hand-written CuPy attention only up to this N (it is slow and "
        "materializes N x N; default %(default)s)",
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="dropout probability for every backend (default 0: none)",
    )
    parser.add_argument("--no-speed", dest="speed", action="store_false", help="skip the speed tables")
    parser.add_argument("--cold-start", action="store_true", help="measure time to first result")
    parser.add_argument("--memory", action="store_true", help="measure extra peak memory, N 4k..128k")
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    parser.add_argument(
        "--plot",
        action="store_true",
        help="after writing --json, draw PNGs of it next to it (bench/plot.py; needs matplotlib)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error("--repeats must be >= 20")
    if any(not 1 <= d <= 256 for d in args.head_dims):
        parser.error(f"--head-dims must lie in 1..256, got {args.head_dims}")
    if args.plot and not args.json:
        parser.error("--plot draws the --json file: give --json PATH too")
    return args


def draw_plots(json_path):
    """bench/plot.py on the JSON just written; one line, not a failure, when matplotlib is missing."""
    # Loaded by path: bench/ is no package, and a module named "plot" elsewhere must not stand in for it.
    spec = importlib.util.spec_from_file_location("bench_plot", Path(__file__).with_name("plot.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    try:
        paths = plot.plot(json_path)
    except ImportError as exc:
        print(f"--plot skipped: {exc}")
        return
    for path in paths:
        print(f"wrote {path}")
    if not paths:
        print("--plot: nothing to plot (no timed cases and no memory table)")


def environment():
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {
        "device": f"{name} (compute capability {props['major']}.{props['minor']}, {props['multiProcessorCount']} SMs)",
        "cupyflash": cupyflash.__version__,
        "cupy": cupy.__version__,
        "cuda": f"runtime {_cuda_version(cupy.cuda.runtime.runtimeGetVersion())}, "
        f"driver {_cuda_version(cupy.cuda.runtime.driverGetVersion())}",
        "torch": torch.__version__ if torch is not None else "not importable",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _cuda_version(v):
    return f"{v // 1000}.{v % 1000 // 10}"


def select_cases(args):
    grid = QUICK if args.quick else dict(dtypes=tuple(DTYPES), head_dims=tuple(args.head_dims), seqlens=SEQLENS)
    cases = [
        Case(dt, d, n, causal)
        for dt in grid["dtypes"]
        for d in grid["head_dims"]
        for causal in (False, True)
        for n in grid["seqlens"]
    ]
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.name)]
    return cases


# ---------------------------------------------------------------------------------------------------------
# Backends: each is set up on (q, k, v, dout) and offers forward(), prepare_backward() (untimed: the
# forward whose results the backward needs) and backward(). Results come back as NumPy float64.


class Ours:
    def __init__(self, q, k, v, dout, causal, scale, dropout=0.0):
        self.q, self.k, self.v, self.dout, self.causal, self.scale = q, k, v, dout, causal, scale
        self.options = dict(causal=causal, scale=scale)
        if dropout:
            self.options.update(dropout_p=dropout, dropout_seed=DROPOUT_SEED)

    def forward(self):
        return cupyflash.attention_forward(self.q, self.k, self.v, **self.options)[0]

    def prepare_backward(self):
        self.saved = cupyflash.attention_forward(self.q, self.k, self.v, **self.options)

    def backward(self):
        return cupyflash.attention_backward(self.dout, self.q, self.k, self.v, *self.saved, **self.options)


class OursUnordered(Ours):
    """Ours, the backward allowed to add dq in any order (deterministic=False)."""

    def backward(self):
        return cupyflash.attention_backward(
            self.dout, self.q, self.k, self.v, *self.saved, **self.options, deterministic=False
        )


class Naive:
    """matmul -> softmax (float32) -> matmul in CuPy, materializing the N x N scores; backward by hand.

    CuPy has no bfloat16 matmul: for bf16 inputs the naive works on float32 copies made at set-up.
    """

    def __init__(self, q, k, v, dout, causal, scale):
        q, k, v, dout = (float32_if_bf16(x) for x in (q, k, v, dout))
        self.q, self.k, self.v, self.dout, self.causal, self.scale = q, k, v, dout, causal, scale

    def _probabilities(self):
        s = cupy.matmul(self.q, self.k.swapaxes(-1, -2)).astype(cupy.float32)
        s *= self.scale
        if self.causal:  # bottom-right aligned: query i sees key j iff j <= i + Nk - Nq
            nq, nk = s.shape[-2:]
            s = cupy.where(cupy.tri(nq, nk, k=nk - nq, dtype=bool), s, -cupy.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = cupy.exp(s, out=s)
        p /= p.sum(axis=-1, keepdims=True)
        return p

    def forward(self):
        return cupy.matmul(self._probabilities().astype(self.q.dtype), self.v)

    def prepare_backward(self):
        self.p = self._probabilities()

    def backward(self):
        q, k, v, dout, p, dtype = self.q, self.k, self.v, self.dout, self.p, self.q.dtype
        dv = cupy.matmul(p.astype(dtype).swapaxes(-1, -2), dout)
        dp = cupy.matmul(dout, v.swapaxes(-1, -2)).astype(cupy.float32)
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))  # dS = P ∘ (dP − rowsum(P ∘ dP))
        ds = (ds * self.scale).astype(dtype)
        return cupy.matmul(ds, k), cupy.matmul(ds.swapaxes(-1, -2), q), dv


def float32_if_bf16(x):
    """bfloat16 -> float32 by bits (CuPy's own casts do not know bfloat16); other dtypes unchanged."""
    if x.dtype != DTYPES["bf16"]:
        return x
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


class TorchSDPA:
    def __init__(self, backend, q, k, v, dout, causal, scale, dropout=0.0):
        self.backend = getattr(SDPBackend, TORCH_BACKENDS[backend])
        self.q, self.k, self.v, self.dout = (torch.from_dlpack(x) for x in (q, k, v, dout))
        self.causal, self.scale, self.dropout = causal, scale, dropout

    def _sdpa(self, q, k, v):
        with sdpa_kernel([self.backend]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about every backend it cannot use
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, scale=self.scale, dropout_p=self.dropout
            )

    def forward(self):
        # Under no_grad torch skips dropout only in nn.Module's eval mode, not in the functional call.
        with torch.no_grad():
            return self._sdpa(self.q, self.k, self.v)

    def prepare_backward(self):
        self.leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
        self.out = self._sdpa(*self.leaves)

    def backward(self):
        return torch.autograd.grad(self.out, self.leaves, self.dout, retain_graph=True)


def make_backend(name, *arrays, causal, scale, dropout=0.0):
    if name in ("ours", UNORDERED):
        return (Ours if name == "ours" else OursUnordered)(*arrays, causal, scale, dropout)
    if name == "naive":
        if dropout:
            raise RuntimeError("the hand-written CuPy attention has no dropout")
        return Naive(*arrays, causal, scale)
    if torch is None:
        raise RuntimeError("torch is not importable")
    return TorchSDPA(name, *arrays, causal, scale, dropout)


def to_float64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return cupy.asnumpy(x).astype(np.float64)


# ---------------------------------------------------------------------------------------------------------
# Speed


_INPUTS = {}


def inputs_for(case):
    """q, k, v, dout of shape (B, H, N, D): views of (the start of) 4 buffers of 16384 x 2048 per dtype, made once."""
    if case.dtype not in _INPUTS:
        _INPUTS.clear()
        cupy.get_default_memory_pool().free_all_blocks()
        rng = np.random.default_rng(0)
        _INPUTS[case.dtype] = [
            cupy.asarray(rng.standard_normal(TOTAL_TOKENS * HIDDEN, dtype=np.float32).astype(DTYPES[case.dtype]))
            for _ in range(4)
        ]
    size = case.b * case.h * case.n * case.d  # below 16384 x 2048 where D does not divide 2048
    return [x[:size].reshape(case.b, case.h, case.n, case.d) for x in _INPUTS[case.dtype]]


def small_problem(case, rng):
    n = min(case.n, VALIDATION_BWD_N)
    shape = (1, VALIDATION_HEADS, n, case.d)
    return [rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[case.dtype]) for _ in range(4)]


def validate(name, case, arrays, scale, dropout=0.0):
    """(forward error, backward error), or raises; the errors are relative max-norm vs float64.

    With dropout, ours is checked with it on the reduced problem (the mask depends on the row index, so the
    last rows alone would not do) and torch without it (its mask is its own)."""
    q, k, v, dout = arrays
    small = small_problem(case, np.random.default_rng(1))
    options = dict(causal=case.causal, scale=scale)
    if dropout and name in ("ours", UNORDERED):
        options.update(dropout_p=dropout, dropout_seed=DROPOUT_SEED)
        backend = make_backend(
            name, *(cupy.asarray(x) for x in small), causal=case.causal, scale=scale, dropout=dropout
        )
        fwd_err = rel_err(to_float64(backend.forward()), reference.attention(*small[:3], **options))
    else:
        rows, heads = min(VALIDATION_ROWS, case.n), VALIDATION_HEADS
        out = make_backend(name, *arrays, causal=case.causal, scale=scale).forward()
        got = to_float64(out[0, :heads, -rows:])
        del out
        host = [cupy.asnumpy(x[0, :heads]) for x in (q, k, v)]
        want = reference.attention(host[0][:, -rows:], host[1], host[2], causal=case.causal, scale=scale)
        fwd_err = rel_err(got, want)
        backend = make_backend(name, *(cupy.asarray(x) for x in small), causal=case.causal, scale=scale)
    backend.prepare_backward()
    grads = [to_float64(g) for g in backend.backward()]
    want = reference.attention_backward(small[3], *small[:3], **options)
    bwd_err = max(rel_err(g, w) for g, w in zip(grads, want))
    return fwd_err, bwd_err


def rel_err(x, ref):
    scale = np.abs(ref).max()
    return float(np.abs(x - ref).max() / scale) if scale > 0 else float(np.abs(x).max())


class L2Flush:
    """What runs before every timed call: a memset that evicts L2, and with ``timing="gpu"`` a spin kernel
    after it that keeps the GPU busy for HOST_COVER_MS while the host issues the call (module docstring)."""

    def __init__(self, timing="call"):
        if timing not in TIMINGS:
            raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
        self.timing = timing
        self.buffer = cupy.empty(L2_FLUSH_BYTES, dtype=cupy.uint8)
        self.spin_cycles = 0
        if timing == "gpu":
            # clock64 counts SM cycles; at most the peak clock (the attribute, in kHz) per second.
            self.spin_cycles = int(HOST_COVER_MS * cupy.cuda.Device().attributes["ClockRate"])
            self.spin = cupy.RawKernel(
                'extern "C" __global__ void spin(long long cycles) {'
                "  const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }",
                "spin",
            )

    def __call__(self):
        self.buffer.fill(0)
        if self.spin_cycles:
            self.spin((1,), (1,), (np.int64(self.spin_cycles),))


def median_ms(fn, args, flush):
    """The bench's timing of ``fn`` after ``flush`` (an L2Flush). With --timing gpu a call that took the
    host longer to issue than the spin covers would count host time again: that raises."""
    max_host_ms = HOST_COVER_MS if flush.timing == "gpu" else None
    return _timing.median_ms(fn, warmup=args.warmup, repeats=args.repeats, before_each=flush, max_host_ms=max_host_ms)


def is_oom(exc):
    return isinstance(exc, cupy.cuda.memory.OutOfMemoryError) or (
        torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)
    )


def release_memory():
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def run_case(case, args):
    arrays = inputs_for(case)
    scale = case.d**-0.5
    flush = L2Flush(args.timing)
    tol = TOLERANCES[case.dtype]
    result = {
        "case": case.name,
        "dtype": case.dtype,
        "d": case.d,
        "n": case.n,
        "causal": case.causal,
        "b": case.b,
        "h": case.h,
        "flops_fwd": case.flops_fwd,
        "flops_bwd": case.flops_bwd,
        "dropout": args.dropout,
        "fwd": {},
        "bwd": {},
    }
    for name in args.backends:
        if name == "naive" and (case.n > args.naive_max_n or args.dropout):
            result["fwd"][name] = result["bwd"][name] = {"status": "skip"}
            continue
        try:
            fwd_err, bwd_err = validate(name, case, arrays, scale, args.dropout)
        except Exception as exc:
            status = "OOM" if is_oom(exc) else "n/a"
            result["fwd"][name] = result["bwd"][name] = {"status": status, "error": f"{type(exc).__name__}: {exc}"}
            release_memory()
            continue
        for phase, err, limit in (("fwd", fwd_err, tol), ("bwd", bwd_err, tol * GRAD_TOLERANCE_FACTOR)):
            entry = result[phase][name] = {"error_vs_fp64": err}
            if not err <= limit:
                entry["status"] = "bad"
                continue
            try:
                backend = make_backend(name, *arrays, causal=case.causal, scale=scale, dropout=args.dropout)
                if phase == "fwd":
                    ms = median_ms(backend.forward, args, flush)
                else:
                    backend.prepare_backward()
                    ms = median_ms(backend.backward, args, flush)
                flops = case.flops_fwd if phase == "fwd" else case.flops_bwd
                entry.update(status="ok", ms=ms, tflops=flops / ms / 1e9)
            except Exception as exc:
                entry.update(status="OOM" if is_oom(exc) else "n/a", error=f"{type(exc).__name__}: {exc}")
            finally:
                backend = None
                release_memory()
    line = "  ".join(f"{n} {_cell(result['fwd'][n])}/{_cell(result['bwd'][n])}" for n in args.backends)
    print(f"{case.name:24} fwd/bwd TFLOP/s: {line}", flush=True)
    return result


def _cell(entry):
    return f"{entry['tflops']:.1f}" if entry.get("status") == "ok" else entry.get("status", "?")


def _ratio(a, b):
    if a.get("status") == "ok" and b.get("status") == "ok":
        return f"{a['tflops'] / b['tflops']:.2f}"
    return "-"


def print_speed_tables(results, backends):
    for phase, title in (("fwd", "forward"), ("bwd", "backward")):
        print(f"\n{title}, TFLOP/s (ratios > 1: ours is faster)")
        unordered = [UNORDERED] if UNORDERED in backends else []
        cols = list(backends) + ["ours/flash", "ours/cudnn"] + ["unord/cudnn"] * len(unordered)
        header = f"{'case':24} | " + " | ".join(f"{c:>10}" for c in cols)
        print(header)
        print("-" * len(header))
        missing = {"status": "-"}
        for r in results:
            row = r[phase]
            cells = [_cell(row.get(b, missing)) for b in backends]
            cells += [_ratio(row.get("ours", missing), row.get(peer, missing)) for peer in ("flash", "cudnn")]
            cells += [_ratio(row.get(name, missing), row.get("cudnn", missing)) for name in unordered]
            print(f"{r['case']:24} | " + " | ".join(f"{c:>10}" for c in cells))


# ---------------------------------------------------------------------------------------------------------
# Cold start


COLD_START_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy, ml_dtypes, numpy as np
import cupyflash
t_import = time.perf_counter() - t0
dtype, h, n, d, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
np_dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[dtype]
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((1, h, n, d), dtype=np.float32).astype(np_dtype)) for _ in range(3))
cupy.cuda.runtime.deviceSynchronize()
t1 = time.perf_counter()
out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
cupy.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
grads = cupyflash.attention_backward(out, q, k, v, out, lse, causal=causal)
cupy.cuda.runtime.deviceSynchronize()
t3 = time.perf_counter()
cupyflash.attention_forward(q, k, v, causal=causal)
cupy.cuda.runtime.deviceSynchronize()
t4 = time.perf_counter()
print(json.dumps(dict(import_s=t_import, first_forward_s=t2 - t1, first_backward_s=t3 - t2,
                      second_forward_s=t4 - t3)))
"""


def cold_start():
    c = COLD_START_CASE
    print(
        f"\ncold start: {c['dtype']}, H={c['heads']}, N={c['seqlen']}, D={c['head_dim']}, "
        f"causal={c['causal']}, fresh process each time"
    )
    results = {"case": c}
    repo = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="cupyflash-cold-") as cache:
        env = dict(
            os.environ,
            CUPY_CACHE_DIR=cache,
            PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        )
        argv = [
            sys.executable,
            "-c",
            COLD_START_SCRIPT,
            c["dtype"],
            str(c["heads"]),
            str(c["seqlen"]),
            str(c["head_dim"]),
            "1" if c["causal"] else "0",
        ]
        for label in ("cold cache", "warm cache"):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                print(f"{label}: failed\n{proc.stderr[-2000:]}")
                results[label] = {"error": proc.stderr[-2000:]}
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["process_wall_s"] = wall
            r["cache_files"] = sum(len(files) for _, _, files in os.walk(cache))
            results[label] = r
    print(f"{'':12} | {'import':>8} | {'1st fwd':>8} | {'1st bwd':>8} | {'2nd fwd':>8} | {'process':>8} | files")
    for label in ("cold cache", "warm cache"):
        r = results.get(label, {})
        if "import_s" in r:
            print(
                f"{label:12} | "
                + " | ".join(
                    f"{r[k]:7.2f}s"
                    for k in ("import_s", "first_forward_s", "first_backward_s", "second_forward_s", "process_wall_s")
                )
                + f" | {r['cache_files']}"
            )
    return results


# ---------------------------------------------------------------------------------------------------------
# Memory


class PeakMemory(cupy.cuda.memory_hook.MemoryHook):
    """Bytes taken from CuPy's memory pool while the hook is active: live now, and the peak."""

    name = "PeakMemory"

    def __init__(self):
        self.live = self.peak = 0

    def malloc_postprocess(self, **kw):
        if kw["mem_ptr"]:
            self.live += kw["mem_size"]
            self.peak = max(self.peak, self.live)

    def free_postprocess(self, **kw):
        self.live -= kw["mem_size"]


def extra_peak_mib(fn):
    """Peak MiB that ``fn`` takes beyond what is already allocated, or 'OOM'."""
    if fn is None:
        return "n/a"
    release_memory()
    try:
        if torch is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            torch_base = torch.cuda.memory_allocated()
        with PeakMemory() as hook:
            result = fn()
            cupy.cuda.runtime.deviceSynchronize()
        torch_peak = torch.cuda.max_memory_allocated() - torch_base if torch is not None else 0
        del result
        return (hook.peak + torch_peak) / MIB
    except Exception as exc:
        if is_oom(exc):
            return "OOM"
        return f"n/a ({type(exc).__name__})"
    finally:
        release_memory()


def memory_table(args):
    c = MEMORY_CASE
    print(
        f"\nextra peak memory beyond the inputs, MiB: {c['dtype']}, B=1, H={c['heads']}, D={c['head_dim']}, "
        f"causal={c['causal']} (ours' minimum: out + lse forward, dq + dk + dv backward)"
    )
    names = [n for n in ("ours", "naive", "flash") if n in args.backends and (n != "flash" or torch is not None)]
    columns = ["min fwd", "min bwd"] + [f"{n} {p}" for n in names for p in ("fwd", "bwd")]
    header = f"{'N':>7} | " + " | ".join(f"{c:>11}" for c in columns)
    print(header)
    print("-" * len(header))
    rows = []
    dtype = DTYPES[c["dtype"]]
    for n in MEMORY_SEQLENS:
        shape = (1, c["heads"], n, c["head_dim"])
        tensor_mib = int(np.prod(shape)) * dtype.itemsize / MIB
        row = {"n": n, "min_fwd_mib": tensor_mib + c["heads"] * n * 4 / MIB, "min_bwd_mib": 3 * tensor_mib}
        try:
            arrays = [cupy.zeros(shape, dtype=dtype) for _ in range(4)]  # q, k, v, dout
        except Exception as exc:
            print(f"{n:>7} | inputs do not fit: {type(exc).__name__}")
            release_memory()
            break
        for name in names:
            backend = make_backend(name, *arrays, causal=c["causal"], scale=c["head_dim"] ** -0.5)
            row[f"{name}_fwd_mib"] = extra_peak_mib(backend.forward)
            try:
                backend.prepare_backward()
                bwd = backend.backward
            except Exception as exc:  # the forward the backward needs did not fit
                bwd = None
                row[f"{name}_bwd_mib"] = "OOM" if is_oom(exc) else "n/a"
            if bwd is not None:
                row[f"{name}_bwd_mib"] = extra_peak_mib(bwd)
            del backend
            release_memory()
        del arrays
        release_memory()
        rows.append(row)
        cells = [row["min_fwd_mib"], row["min_bwd_mib"]]
        cells += [row[f"{name}_{p}_mib"] for name in names for p in ("fwd", "bwd")]
        print(
            f"{n:>7} | " + " | ".join(f"{x:11.1f}" if isinstance(x, float) else f"{x[:11]:>11}" for x in cells),
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
