"""``python -m cupyflash``: a quick check of an install: versions, a self-check against the float64
reference, and a short report.

With a GPU: forward and backward of our kernels on a few awkward shapes in float16, bfloat16, float32 and
float64, causal and not, against :mod:`cupyflash.reference`; then a short timing table of
``cupyflash.attention`` against a hand-written CuPy attention (matmul -> softmax -> matmul).
Without a GPU (or without CuPy): the CPU path (NumPy inputs) against the reference, in seconds.

``--compile-report`` also compiles every shipped kernel variant through NVRTC for sm_80 and sm_90(a), no GPU
needed (minutes, with progress), and checks ptxas' report of each: no register spills, no stack frame, no
warpgroup products (wgmma) serialized (notes C7510-C7519). CI runs it.

Exits with status 1 if any check fails.
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import reference
from cupyflash._arrays import lse_dtype, to_float
from cupyflash._cuda import ptxas_report
from cupyflash._timing import median_ms

# Relative max-norm error, max|x - x_ref| / max|x_ref|, allowed against the float64 reference. The
# gradients pass through two more rounded products (P and dS are rounded to the input dtype), so they get
# GRAD_TOLERANCE_FACTOR times more.
TOLERANCES = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}
GRAD_TOLERANCE_FACTOR = 2
DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
ARCHES = ("sm_80", "sm_90")
MIB = 1024 * 1024


def _identity(x):
    return x


def _bnhd_to_bhnd(x):
    return x.transpose(0, 2, 1, 3)


class Case:
    """One check: the physical (allocated) shapes of q, k, v and a view that makes them (..., N, D);
    ``modifiers``: also every score modifier at once (window, softcap, ALiBi, bias, mask, block mask), or
    "scalars": window, softcap, ALiBi and block mask alone (the backward's kernels compiled without the
    modifiers' arrays; the forward with a block mask runs the full ones, or on Hopper at 16 bits and
    head dims 33-128 the warp-specialized forward's block-mask walk), or "softcap": the softcap alone
    (on Hopper its backward's Mods::softcap passes, causal included), or "window": the window alone (on
    Hopper the Mods::window forward and backward)."""

    def __init__(self, name, q, k, v, view=_identity, modifiers=False):
        self.name, self.shapes, self.view, self.modifiers = name, (q, k, v), view, modifiers


# Awkward on purpose: odd lengths, Nq != Nk, rows that see no key (causal with Nq > Nk), D != Dv, a head
# dim that is not a multiple of 8, GQA by broadcasting, and FlashAttention's (B, N, H, D) layout as a view.
GPU_CASES = [
    Case("B2 H3 N128 D64", (2, 3, 128, 64), (2, 3, 128, 64), (2, 3, 128, 64)),
    Case("Nq77 Nk133 D40", (1, 2, 77, 40), (1, 2, 133, 40), (1, 2, 133, 40)),
    Case("Nq130 Nk65 D128", (2, 1, 130, 128), (2, 1, 65, 128), (2, 1, 65, 128)),
    Case("N64 D256", (1, 2, 64, 256), (1, 2, 64, 256), (1, 2, 64, 256)),
    Case("N50 D20 Dv36", (1, 2, 50, 20), (1, 2, 50, 20), (1, 2, 50, 36)),
    Case("GQA Hk2 G3 N96 D64", (1, 2, 3, 96, 64), (1, 2, 1, 96, 64), (1, 2, 1, 96, 64)),
    Case("BNHD view B2 N100 H4 D32", (2, 100, 4, 32), (2, 100, 4, 32), (2, 100, 4, 32), _bnhd_to_bhnd),
    Case("modifiers Nq150 Nk170 D64", (2, 3, 150, 64), (2, 3, 170, 64), (2, 3, 170, 64), modifiers=True),
    Case(
        "window softcap ALiBi block mask Nq150 Nk170 D128",
        (2, 3, 150, 128),
        (2, 3, 170, 128),
        (2, 3, 170, 128),
        modifiers="scalars",
    ),
    Case("softcap alone Nq150 Nk130 D96", (2, 3, 150, 96), (2, 3, 130, 96), (2, 3, 130, 96), modifiers="softcap"),
    Case("window alone Nq170 Nk150 D128", (2, 3, 170, 128), (2, 3, 150, 128), (2, 3, 150, 128), modifiers="window"),
]
CPU_CASES = [
    Case("B2 H2 N64 D32", (2, 2, 64, 32), (2, 2, 64, 32), (2, 2, 64, 32)),
    Case("Nq33 Nk70 D24", (1, 2, 33, 24), (1, 2, 70, 24), (1, 2, 70, 24)),
    Case("Nq50 Nk20 D16 Dv8", (1, 1, 50, 16), (1, 1, 20, 16), (1, 1, 20, 8)),
    Case("GQA Hk2 G2 N40 D16", (1, 2, 2, 40, 16), (1, 2, 1, 40, 16), (1, 2, 1, 40, 16)),
    Case("BNHD view B2 N30 H2 D8", (2, 30, 2, 8), (2, 30, 2, 8), (2, 30, 2, 8), _bnhd_to_bhnd),
    Case("modifiers Nq40 Nk50 D16", (1, 2, 40, 16), (1, 2, 50, 16), (1, 2, 50, 16), modifiers=True),
]
# Timing: FlashAttention's benchmark convention, 16384 tokens in all (batch = 16384 // N), hidden 2048.
TIMING_CASES = [
    ("float16", 64, 1024, False),
    ("float16", 128, 2048, False),
    ("bfloat16", 128, 2048, False),
    ("bfloat16", 128, 2048, True),
    ("float16", 128, 4096, True),
    ("float32", 64, 1024, False),
]
TOTAL_TOKENS, HIDDEN = 16384, 2048


def main(argv=None):
    args = _parse_args(argv)
    if args.docs is not None:
        return show_docs(args.docs)
    cupy, why_no_gpu = _find_gpu()
    report = Report()
    _print_versions(cupy)
    if cupy is None:
        print(f"\n{why_no_gpu}: checking the CPU path (NumPy inputs) instead.")
    if args.check:
        _section("self-check against cupyflash.reference (float64)")
        if cupy is not None:
            _check_all(report, GPU_CASES, xp=cupy, seed=args.seed)
        else:
            _check_all(report, CPU_CASES, xp=np, seed=args.seed)
    if cupy is not None and args.bench:
        _section("forward TFLOP/s: cupyflash.attention vs hand-written CuPy (matmul -> softmax -> matmul)")
        _timing_table(cupy)
    if args.compile_report:
        _section(f"kernel variants compiled by NVRTC for {', '.join(args.arch)} (no GPU needed)")
        _compile_table(report, args.arch, verbose=args.verbose)
    return report.finish()


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m cupyflash",
        description="Print versions, check cupyflash against its float64 reference (on the GPU, or the "
        "CPU path without one) and time it (GPU); with --compile-report also compile every "
        "kernel variant and check ptxas' report of each. Exits 1 if anything fails.",
    )
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the self-check")
    parser.add_argument("--no-bench", dest="bench", action="store_false", help="skip the timing table (GPU only)")
    parser.add_argument(
        "--compile-report",
        action="store_true",
        help="also compile every kernel variant with NVRTC (no GPU needed; minutes) and fail on "
        "register spills, stack frames or serialized warpgroup products",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="with --compile-report: a table of every kernel's registers, shared memory, spills and stack",
    )
    parser.add_argument(
        "--arch",
        nargs="+",
        default=list(ARCHES),
        choices=ARCHES,
        metavar="SM",
        help="architectures for the compile report (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument(
        "--docs",
        nargs="?",
        const="",
        metavar="PAGE",
        help="print a page of the documentation (e.g. fp8, api, distributed) and exit; without PAGE, list the pages",
    )
    return parser.parse_args(argv)


def docs_dir() -> Path | None:
    """The user's documentation: docs/ inside the package (a wheel) or beside it (the source tree, editable
    installs); None where neither is there."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "docs", here.parent / "docs"):
        if (candidate / "api.md").is_file():
            return candidate
    return None


def show_docs(page: str) -> int:
    """Print docs/<page>.md, or list the pages (page ""); 2 where there is no such page."""
    folder = docs_dir()
    if folder is None:
        print("cupyflash: the documentation is not installed beside the package", file=sys.stderr)
        return 2
    pages = sorted(p.stem for p in folder.glob("*.md"))
    name = page[:-3] if page.endswith(".md") else page
    if name in pages:
        print((folder / f"{name}.md").read_text())
        return 0
    if page:
        print(f"cupyflash: no documentation page {page!r}", file=sys.stderr)
    print("pages (python -m cupyflash --docs PAGE): " + ", ".join(pages), file=sys.stderr if page else sys.stdout)
    return 2 if page else 0


class Report:
    """Counts checks and failures; ``finish`` prints the verdict and returns the exit status."""

    def __init__(self):
        self.checks, self.failures = 0, []

    def record(self, ok, what):
        self.checks += 1
        if not ok:
            self.failures.append(what)

    def finish(self):
        _section("verdict")
        if self.failures:
            print(f"self-check FAILED: {len(self.failures)} of {self.checks} checks")
            for what in self.failures:
                print(f"  - {what}")
            return 1
        print(f"self-check OK: all {self.checks} checks" if self.checks else "nothing was checked")
        return 0


def _section(title):
    print(f"\n== {title}")


def _find_gpu():
    """(cupy, None) when a CUDA device is usable, else (None, why not, in words)."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed (the cuda12 or cuda13 extra brings it)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device, or CuPy's CUDA libraries missing
        # cudaErrorInsufficientDriver and cudaErrorNoDevice are what a machine without a GPU answers.
        if getattr(exc, "status", None) in (35, 100):
            return None, "No CUDA GPU found"
        return None, f"No usable CUDA GPU ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "No CUDA GPU found"
    return cupy, None


def _cuda_version(v):
    return f"{v // 1000}.{v % 1000 // 10}"


def _print_versions(cupy):
    print(f"cupyflash  {cupyflash.__version__} ({os.path.dirname(cupyflash.__file__)})")
    print(f"Python     {platform.python_version()} ({sys.executable})")
    print(f"NumPy      {np.__version__}")
    print(f"ml_dtypes  {ml_dtypes.__version__}")
    try:
        import cupy as cupy_module

        print(f"CuPy       {cupy_module.__version__}")
    except Exception as exc:
        print(f"CuPy       unavailable ({type(exc).__name__}: {exc})")
    try:
        major, minor = ptxas_report.nvrtc_version()
        print(f"NVRTC      {major}.{minor}")
    except Exception as exc:
        print(f"NVRTC      unavailable ({type(exc).__name__}: {exc})")
    if cupy is None:
        return
    runtime = cupy.cuda.runtime
    print(
        f"CUDA       driver {_cuda_version(runtime.driverGetVersion())}, "
        f"runtime {_cuda_version(runtime.runtimeGetVersion())}"
    )
    device = cupy.cuda.Device()
    props = runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(
        f"GPU        {device.id}: {name}, compute capability {props['major']}.{props['minor']}, "
        f"{props['multiProcessorCount']} SMs, {props['totalGlobalMem'] // MIB} MiB"
    )


# ---------------------------------------------------------------------------------------------------------
# Self-check


def _check_all(report, cases, *, xp, seed):
    rng = np.random.default_rng(seed)
    for case in cases:
        for dtype_name in DTYPES:
            for causal in (False, True):
                ok, line = _check_one(case, dtype_name, causal, xp, rng)
                print(line)
                report.record(ok, line.strip())


def _check_one(case, dtype_name, causal, xp, rng):
    dtype = DTYPES[dtype_name]
    label = f"{dtype_name:8} {'causal' if causal else 'full':6} {case.name:26}"
    physical = [rng.standard_normal(s, dtype=np.float32).astype(dtype) for s in case.shapes]
    q, k, v = (case.view(x) for x in physical)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    dout = rng.standard_normal(batch + (q.shape[-2], v.shape[-1]), dtype=np.float32).astype(dtype)
    options = _modifier_options(rng, batch, q.shape[-2], k.shape[-2], dtype) if case.modifiers else {}
    if case.modifiers in ("scalars", "softcap", "window"):
        kept = {
            "scalars": ("window", "softcap", "alibi_slopes", "block_mask"),
            "softcap": ("softcap",),
            "window": ("window",),
        }[case.modifiers]
        options = {name: options[name] for name in kept}
    try:
        if xp is np:
            dev, dev_options = [q, k, v, dout], options
        else:  # upload the physical arrays, then take the same view on the device
            dev = [case.view(xp.asarray(x)) for x in physical] + [xp.asarray(dout)]
            dev_options = {name: xp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
        out, lse = cupyflash.attention_forward(*dev[:3], causal=causal, **dev_options)
        grads = cupyflash.attention_backward(dev[3], *dev[:3], out, lse, causal=causal, **dev_options)
        out, lse, *grads = (_to_numpy(x) for x in (out, lse, *grads))
    except Exception as exc:
        return False, f"FAIL {label} raised {type(exc).__name__}: {exc}"

    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, causal=causal, **options)
    names = ("out", "lse", "dq", "dk", "dv", "dbias")[: 2 + len(ref_grads)]
    problems = []
    expected = [(out, ref_out, dtype), (lse, ref_lse, lse_dtype(dtype))]
    expected += [(g, r, dtype) for g, r in zip(grads, ref_grads)]
    if len(grads) != len(ref_grads):
        problems.append(f"{len(grads)} gradients returned, expected {len(ref_grads)}")
    for name, (x, ref, want_dtype) in zip(names, expected):
        if x.shape != ref.shape or x.dtype != want_dtype:
            problems.append(f"{name} is {x.dtype}{list(x.shape)}, expected {want_dtype}{list(ref.shape)}")
    tol = TOLERANCES[dtype_name]
    errors = {"out": _rel_err(out, ref_out), "lse": _lse_err(lse, ref_lse)}
    errors.update({n: _rel_err(g, r) for n, g, r in zip(names[2:], grads, ref_grads)})
    for name, err in errors.items():
        limit = tol if name in ("out", "lse") else tol * GRAD_TOLERANCE_FACTOR
        if not err <= limit:  # also catches NaN
            problems.append(f"{name} error {err:.1e} > {limit:.0e}")
    text = " ".join(f"{n} {e:.1e}" for n, e in errors.items())
    verdict = "ok  " if not problems else "FAIL"
    return not problems, f"{verdict} {label} {text}" + (f"  <- {'; '.join(problems)}" if problems else "")


def _modifier_options(rng, batch, nq, nk, dtype):
    """Every score modifier at once, for a (*batch, Nq, Nk) problem (NumPy arrays)."""
    heads = batch[-1]
    return dict(
        window=(nk // 3, 7),
        softcap=5.0,
        alibi_slopes=(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32),
        bias=rng.standard_normal((1, heads, nq, nk), dtype=np.float32).astype(dtype),
        mask=rng.random(batch + (nq, nk)) < 0.9,
        block_mask=rng.random(batch + (-(-nq // cupyflash.BLOCK_MASK_TILE), -(-nk // cupyflash.BLOCK_MASK_TILE))) < 0.9,
    )


def _to_numpy(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _rel_err(x, ref):
    """max|x - ref| / max|ref|, in float64 (0 when both are all zero)."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        return float("nan")
    if x.size == 0:
        return 0.0
    scale = np.abs(ref).max()
    diff = np.abs(x - ref).max()
    return float(diff / scale) if scale > 0 else float(diff)


def _lse_err(lse, ref):
    """Like _rel_err over the rows that see a key; NaN unless the rows that see none are -inf in both."""
    lse, ref = np.asarray(lse, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if lse.shape != ref.shape or not np.array_equal(np.isneginf(lse), np.isneginf(ref)):
        return float("nan")
    seen = np.isfinite(ref)
    return _rel_err(lse[seen], ref[seen])


# ---------------------------------------------------------------------------------------------------------
# Timing (GPU)


def _timing_table(cupy, warmup=3, repeats=20):
    header = (
        f"{'dtype':8} {'D':>4} {'N':>6} {'causal':6} {'B':>3} {'H':>3} | {'ours ms':>8} "
        f"{'TFLOP/s':>8} | {'naive ms':>8} {'TFLOP/s':>8} | {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for dtype_name, d, n, causal in TIMING_CASES:
        b, h = TOTAL_TOKENS // n, HIDDEN // d
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        ours, naive = _time_case(cupy, dtype_name, (b, h, n, d), causal, warmup, repeats)
        ratio = f"{naive / ours:6.1f}x" if isinstance(ours, float) and isinstance(naive, float) else "n/a"
        print(
            f"{dtype_name:8} {d:>4} {n:>6} {'yes' if causal else 'no':6} {b:>3} {h:>3} | "
            f"{_fmt_ms(ours)} {_fmt_tflops(flops, ours)} | {_fmt_ms(naive)} {_fmt_tflops(flops, naive)} "
            f"| {ratio:>7}"
        )
        cupy.get_default_memory_pool().free_all_blocks()


def _time_case(cupy, dtype_name, shape, causal, warmup, repeats):
    """Median ms of (cupyflash.attention, naive_attention) on random (B, H, N, D) inputs."""
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype_name])) for _ in range(3))
    scale = shape[-1] ** -0.5
    ours = _median_ms(cupy, lambda: cupyflash.attention(q, k, v, causal=causal), warmup, repeats)
    naive = _median_ms(cupy, lambda: naive_attention(cupy, q, k, v, causal, scale), warmup, repeats)
    return ours, naive


def naive_attention(cupy, q, k, v, causal, scale):
    """matmul -> softmax (float32) -> matmul, materializing the Nq x Nk scores.

    CuPy has no bfloat16 matmul: bfloat16 inputs are widened to float32 (by their bits) first.
    """
    if q.dtype == DTYPES["bfloat16"]:
        q, k, v = (to_float(x) for x in (q, k, v))
    s = cupy.matmul(q, k.swapaxes(-1, -2)).astype(cupy.float32)
    s *= scale
    if causal:  # bottom-right aligned: query i sees key j iff j <= i + Nk - Nq
        nq, nk = s.shape[-2:]
        s = cupy.where(cupy.tri(nq, nk, k=nk - nq, dtype=bool), s, -cupy.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = cupy.exp(s, out=s)
    p /= p.sum(axis=-1, keepdims=True)
    return cupy.matmul(p.astype(q.dtype), v)


def _median_ms(cupy, fn, warmup, repeats):
    """Median milliseconds of ``fn`` between CUDA events on the current stream, or an error word."""
    try:
        return median_ms(fn, warmup=warmup, repeats=repeats)
    except cupy.cuda.memory.OutOfMemoryError:
        return "OOM"
    except Exception as exc:
        return f"n/a ({type(exc).__name__})"
    finally:
        cupy.get_default_memory_pool().free_all_blocks()


def _fmt_ms(ms):
    return f"{ms:8.3f}" if isinstance(ms, float) else f"{ms.split()[0]:>8}"


def _fmt_tflops(flops, ms):
    return f"{flops / ms / 1e9:8.1f}" if isinstance(ms, float) else f"{'':>8}"


# ---------------------------------------------------------------------------------------------------------
# Compile report (no GPU needed)


def _compile_table(report, arches, *, verbose):
    try:
        ptxas_report.nvrtc_version()
    except Exception as exc:
        message = f"compile report: NVRTC unavailable ({type(exc).__name__}: {exc}); install the cuda12 or cuda13 extra"
        print(message)
        report.record(False, message)
        return
    by_arch = {}
    for arch in arches:
        t0 = time.perf_counter()
        total = len(ptxas_report.shipped_for(arch))

        def progress(done, total, arch=arch, t0=t0):
            if done == total or done % 50 == 0:
                print(f"  {arch}: {done}/{total} variants, {time.perf_counter() - t0:.0f} s", flush=True)

        try:
            by_arch[arch] = {r["kernel"]: r for r in ptxas_report.compile_report(arch, progress=progress)}
        except Exception as exc:
            print(f"{arch}: compile_report raised {type(exc).__name__}:\n{exc}")
            report.record(False, f"compile_report({arch!r}) raised {type(exc).__name__}")
            continue
        rows = by_arch[arch].values()
        print(
            f"{arch}: {total} variants, {len(rows)} distinct kernels compiled in {time.perf_counter() - t0:.1f} s; "
            f"registers {min(r['registers'] for r in rows)}-{max(r['registers'] for r in rows)}, "
            f"spilling {sum(r['spill_stores'] + r['spill_loads'] > 0 for r in rows)}, "
            f"with a stack frame {sum(r['stack_frame'] > 0 for r in rows)}, "
            f"serialized wgmma {sum(r['serialized_wgmma'] > 0 for r in rows)}"
        )
    # What each architecture must have: the kernels of the variants built for it (Hopper's paths, and the
    # float64 tiles that need Hopper's shared memory, are built for sm_90 alone).
    for arch, rows in by_arch.items():
        expected = {v.name_expression(k) for v in ptxas_report.shipped_for(arch) for k in v.kernels}
        for name in sorted(expected - set(rows)):
            report.record(False, f"{name}: not compiled for {arch}")
        for name, r in rows.items():
            report.record(
                r["spill_stores"] + r["spill_loads"] == 0 and r["stack_frame"] == 0,
                f"{name} on {arch}: spill stores {r['spill_stores']} B, spill loads "
                f"{r['spill_loads']} B, stack {r['stack_frame']} B",
            )
            report.record(
                r["serialized_wgmma"] == 0,
                f"{name} on {arch}: ptxas serialized its warpgroup products ({r['serialized_wgmma']} notes C751x)",
            )
    if verbose:
        _print_compile_table(by_arch)


def _print_compile_table(by_arch):
    kernels = list(dict.fromkeys(name for rows in by_arch.values() for name in rows))
    width = max(len("kernel"), *(len(k) for k in kernels))
    cell = "{:>4} {:>8} {:>6} {:>5}"
    print(f"\n{'':{width}} | " + " | ".join(f"{arch:^26}" for arch in by_arch))
    print(f"{'kernel':{width}} | " + " | ".join(cell.format("regs", "smem KiB", "spill", "stack") for _ in by_arch))
    for name in kernels:
        cells = []
        for rows in by_arch.values():
            r = rows.get(name)
            if r is None:  # a kernel built for sm_90 alone, on sm_80
                cells.append(cell.format("-", "-", "-", "-"))
                continue
            smem = (r["static_smem"] + r["dynamic_smem"]) / 1024
            cells.append(
                cell.format(r["registers"], f"{smem:.1f}", r["spill_stores"] + r["spill_loads"], r["stack_frame"])
            )
        print(f"{name:{width}} | " + " | ".join(cells))


def run(argv=None) -> int:
    """main(), ended quietly where the reader of its output goes away (``python -m cupyflash | head``): the
    exit code is then 141, a shell's for a pipe closed under it, with no traceback."""
    try:
        return main(argv)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at devnull so that the flush has nowhere to fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(run())
