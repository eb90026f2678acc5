#!/usr/bin/env python3
"""Benchmark float64 attention: our fused FP64 tensor-core kernels against torch
SDPA's ``math`` backend in float64 (the only torch backend that takes float64; it materializes N x N).

    python bench/bench_float64.py                       # N = 4k (B = 4, H = 16, D = 128), full and causal,
                                                        # then N = 64k (B = 1, H = 16, full), where math runs out
    python bench/bench_float64.py --long 0              # skip the 64k rows

Shapes follow bench_attention.py: 16,384 tokens (B = 16384 // N), hidden 2048 (H = 2048 // D); FLOPs
4·B·H·N²·D (half for causal), backward 2.5× forward. Every backend is validated first on a small problem
against the float64 reference (relative max-norm <= 1e-12 for ours, out and gradients). Timing: CUDA
events, warm-up, L2 flushed before each call, median of --repeats (the 64k row, seconds per call, one
warm-up and --long-repeats). Both run in this one process on the same GPU, so the ratio is a same-run ratio.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402  (also finds cupyflash in a checkout that is not installed)
import cupy  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import reference  # noqa: E402

OURS_RTOL = 1e-12


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--long", type=int, default=65536, help="sequence length of the long rows (0: none)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--long-repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error("--repeats must be >= 20")
    return args


class Ours:
    def __init__(self, q, k, v, dout, causal):
        self.q, self.k, self.v, self.dout, self.causal = q, k, v, dout, causal

    def forward(self):
        return cupyflash.attention_forward(self.q, self.k, self.v, causal=self.causal)

    def prepare_backward(self):
        self.saved = self.forward()

    def backward(self):
        return cupyflash.attention_backward(self.dout, self.q, self.k, self.v, *self.saved, causal=self.causal)


class TorchMath:
    def __init__(self, q, k, v, dout, causal):
        self.q, self.k, self.v, self.dout = (ba.torch.from_dlpack(x) for x in (q, k, v, dout))
        self.causal = causal

    def _sdpa(self, q, k, v):
        with ba.sdpa_kernel([ba.SDPBackend.MATH]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ba.F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def forward(self):
        with ba.torch.no_grad():
            return self._sdpa(self.q, self.k, self.v)

    def prepare_backward(self):
        self.leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
        self.out = self._sdpa(*self.leaves)

    def backward(self):
        return ba.torch.autograd.grad(self.out, self.leaves, self.dout, retain_graph=True)

    def release(self):
        self.out = self.leaves = None


def _normal(rng, shape):
    return cupy.asarray(rng.standard_normal(shape))


def validate(name, make, causal, rng):
    """The backend's out and gradients on a small problem against the float64 reference."""
    q, k, v, dout = (_normal(rng, (1, 2, 300, 128)) for _ in range(4))
    backend = make(q, k, v, dout, causal)
    out = backend.forward()
    out = out[0] if isinstance(out, tuple) else out
    backend.prepare_backward()
    grads = backend.backward()
    host = [x.get() for x in (q, k, v, dout)]
    refs = (
        reference.attention(*host[:3], causal=causal),
        *reference.attention_backward(host[3], *host[:3], causal=causal),
    )
    errors = [ba.rel_err(cupy.asnumpy(cupy.from_dlpack(x)), ref) for x, ref in zip((out, *grads), refs)]
    bound = OURS_RTOL if name == "ours" else 1e-10
    if max(errors) > bound:
        raise SystemExit(f"{name} ({'causal' if causal else 'full'}) is off: relative errors {errors}")
    return max(errors)


def time_backend(name, make, arrays, causal, repeats, warmup, flush):
    """(forward ms, backward ms), None for a phase that ran out of memory."""
    result = []
    backend = None
    try:
        backend = make(*arrays, causal)
        result.append(ba._timing.median_ms(backend.forward, warmup=warmup, repeats=repeats, before_each=flush))
    except Exception as exc:  # noqa: BLE001 - OOM is a result; anything else is re-raised
        if not ba.is_oom(exc):
            raise
        result.append(None)
    ba.release_memory()
    try:
        backend.prepare_backward()
        result.append(ba._timing.median_ms(backend.backward, warmup=warmup, repeats=repeats, before_each=flush))
    except Exception as exc:  # noqa: BLE001
        if not ba.is_oom(exc):
            raise
        result.append(None)
    if hasattr(backend, "release"):
        backend.release()
    del backend
    ba.release_memory()
    return result


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    print(ba.environment())
    makers = {"ours": Ours}
    if ba.torch is not None:
        makers["math"] = TorchMath
    flush = ba.L2Flush()
    rows = []
    shapes = [(args.n, False), (args.n, True)] + ([(args.long, False)] if args.long else [])
    for n, causal in shapes:
        d = args.head_dim
        b, h = max(1, ba.TOTAL_TOKENS // n), ba.HIDDEN // d
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        arrays = [_normal(rng, (b, h, n, d)) for _ in range(4)]
        row = {"n": n, "b": b, "h": h, "d": d, "causal": causal, "flops_fwd": flops}
        repeats, warmup = (args.repeats, args.warmup) if n == args.n else (args.long_repeats, 1)
        for name, make in makers.items():
            row[f"{name}_validation_error"] = validate(name, make, causal, rng)
            fwd, bwd = time_backend(name, make, arrays, causal, repeats, warmup, flush)
            row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = fwd, bwd
            print(f"n={n} {'causal' if causal else 'full'} {name}: fwd {fwd} ms, bwd {bwd} ms", flush=True)
        rows.append(row)
        del arrays
        ba.release_memory()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def print_table(rows):
    print("\nfloat64, TFLOP/s (backward counted as 2.5x forward); ratio = ours / math (target >= 2.0)")
    print(
        f"{'N':>6} {'mask':6} | {'phase':5} | {'ours':>7} | {'math':>7} | {'ratio':>6} | "
        f"{'ours ms':>9} | {'math ms':>9}"
    )
    for row in rows:
        for phase, factor in (("fwd", 1.0), ("bwd", ba.BWD_FLOPS_FACTOR)):
            flops = factor * row["flops_fwd"]
            ours, math = row.get(f"ours_{phase}_ms"), row.get(f"math_{phase}_ms")
            tf = [None if ms is None else flops / ms / 1e9 for ms in (ours, math)]
            cells = ["OOM" if x is None else f"{x:.1f}" for x in tf]
            ratio = f"{tf[0] / tf[1]:.2f}" if None not in tf else "-"
            ms_cells = ["OOM" if x is None else f"{x:.2f}" for x in (ours, math)]
            if f"math_{phase}_ms" not in row:
                cells[1], ms_cells[1], ratio = "n/a", "n/a", "-"
            print(
                f"{row['n']:6} {'causal' if row['causal'] else 'full':6} | {phase:5} | {cells[0]:>7} | {cells[1]:>7} | "
                f"{ratio:>6} | {ms_cells[0]:>9} | {ms_cells[1]:>9}"
            )


if __name__ == "__main__":
    main()
