"""Host time per call of every planned family (dense forward and backward, decoding, FP8), bf16, at
FlashAttention's benchmark shapes (16k tokens, hidden 2048) and a decode step: the host microseconds per call with
the GPU held behind a spin (cupyflash._timing.host_us), the median of ``--rounds`` rounds. Only public functions
are called, so the same script times any tree (PYTHONPATH=that tree): run it on the tree before a change and after,
in one session, and compare row by row.

``--breakdown`` (this tree only) also times, in place, each statement of the fused backward's launch (the
allocation, the memset, the tensor maps, the three launches), to find where a backward's host time goes.

    PYTHONPATH=. python bench/exp/24_host_time_families.py [--rounds 5] [--breakdown] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing

BF16 = np.dtype(ml_dtypes.bfloat16)
DENSE = {  # name: (D, causal, N); B = 16k / N, H = 2048 / D
    "d128-full-2k": (128, False, 2048),
    "d128-causal-2k": (128, True, 2048),
    "d128-full-8k": (128, False, 8192),
    "d64-causal-2k": (64, True, 2048),
}


def _dense_cases(rng):
    for name, (d, causal, n) in DENSE.items():
        b, h = 16384 // n, 2048 // d
        q, k, v, dout = (rng.standard_normal((b, h, n, d), dtype=np.float32).astype(BF16) for _ in range(4))
        out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
        yield f"fwd {name}", lambda q=q, k=k, v=v, c=causal: cupyflash.attention_forward(q, k, v, causal=c)
        yield (
            f"bwd {name}",
            lambda q=q, k=k, v=v, o=out, s=lse, g=dout, c=causal: cupyflash.attention_backward(
                g, q, k, v, o, s, causal=c
            ),
        )


def _decode_case(rng):
    b, hq, hk, nk, d = 8, 32, 8, 8192, 128
    q = rng.standard_normal((b, hq, 1, d), dtype=np.float32).astype(BF16)
    k_cache, v_cache = (rng.standard_normal((b, hk, nk, d), dtype=np.float32).astype(BF16) for _ in range(2))
    seqlens = cupy.full((b,), nk - 1, dtype=cupy.int32)
    yield (
        "decode B8 Nk8k D128 32/8",
        lambda: cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
    )


def _fp8_case(rng):
    q, k, v = (rng.standard_normal((8, 16, 2048, 128), dtype=np.float32) for _ in range(3))
    q8, k8, v8 = (cupyflash.quantize_fp8(x) for x in (q, k, v))
    yield "fp8 fwd d128-full-2k", lambda: cupyflash.attention_forward(q8, k8, v8)


def _breakdown(rounds: int) -> dict:
    """µs per statement of FusedBackwardPlan._launch_locked, in place, for the dense backward cases."""
    from cupyflash._cuda import fused_backward
    from cupyflash._cuda.launch import launch_kernel

    marks: dict[str, list] = {}

    def timed(self, map_addresses) -> None:  # FusedBackwardPlan._launch_locked, statement by statement
        t = [time.perf_counter_ns()]
        words = self._slots
        maps = self._fused_maps.encode({name: words[w] for name, w in zip(fused_backward.MAPPED, self._address_words)})
        if maps is not self._maps:
            self._maps = maps
            self.argv[1] = maps.ctypes.data
        t.append(time.perf_counter_ns())
        workspace = cupy.cuda.alloc(self._workspace * 4)
        stream = cupy.cuda.get_current_stream().ptr
        t.append(time.perf_counter_ns())
        start, nbytes = self._zeroed
        cupy.cuda.runtime.memsetAsync(workspace.ptr + start, 0, nbytes, stream)
        t.append(time.perf_counter_ns())
        values = self.values
        values[0] = workspace.ptr
        values[1] = workspace.ptr + self._counters_at
        (pre, bwd, convert), argv = self.direct, self._argv
        launch_kernel(*pre, stream, argv, 0)
        t.append(time.perf_counter_ns())
        launch_kernel(*bwd, stream, argv, 0)
        t.append(time.perf_counter_ns())
        launch_kernel(*convert, stream, self._convert_argv, 0)
        t.append(time.perf_counter_ns())
        for name, a, b in zip(("maps", "alloc", "memset", "preprocess", "bwd", "convert"), t, t[1:]):
            marks.setdefault(name, []).append((b - a) / 1e3)

    original = fused_backward.FusedBackwardPlan._launch_locked
    fused_backward.FusedBackwardPlan._launch_locked = timed
    rows = {}
    try:
        rng = cupy.random.default_rng(1)
        for name, fn in _dense_cases(rng):
            if not name.startswith("bwd"):
                continue
            fn()
            marks.clear()
            for _ in range(rounds):
                _timing.spin(60)
                for _ in range(20):
                    fn()
                cupy.cuda.Device().synchronize()
            rows[name] = {piece: statistics.median(values) for piece, values in marks.items()}
    finally:
        fused_backward.FusedBackwardPlan._launch_locked = original
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rng = cupy.random.default_rng(0)
    results = {}
    for cases in (_dense_cases(rng), _decode_case(rng), _fp8_case(rng)):
        for name, fn in cases:
            fn()
            fn()
            times = [_timing.host_us(fn, calls=20, repeats=5, spin_ms=60) for _ in range(args.rounds)]
            results[name] = statistics.median(times)
            print(f"| {name} | {results[name]:.1f} | {min(times):.1f}-{max(times):.1f} |", flush=True)
    report = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "host_us": results}
    if args.breakdown:
        report["fused_backward_us"] = _breakdown(args.rounds)
        for name, pieces in report["fused_backward_us"].items():
            print(f"| {name} | " + " | ".join(f"{piece} {us:.1f}" for piece, us in pieces.items()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
