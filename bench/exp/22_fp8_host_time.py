"""The host's time per FP8 forward call against a bfloat16 call of the same shape, same run: FlashAttention's
benchmark shapes (16k tokens, hidden 2048) at N = 2k, 8k and 16k, causal. Calls are queued behind a spin
(cupyflash._timing.host_us), bf16 and FP8 alternating over --rounds rounds; the medians of the rounds are printed.

- ``fp8``: the same holders on every call (their plan and kept arrays, V^T among them, are reused);
- ``fp8 new v``: a new v holder on every call, of the same layout (the plan is reused; V^T is written each call,
  as for a key/value cache quantized anew per step). Its holder is made before the timed loop.

    PYTHONPATH=. python bench/exp/22_fp8_host_time.py [--rounds 7] [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing

BF16 = np.dtype(ml_dtypes.bfloat16)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args(argv)
    print("| D | N | bf16 µs | fp8 µs | fp8 / bf16 | fp8 new v µs |")
    print("|---|---|---|---|---|---|")
    for d in (64, 128, 256):
        for n in (2048, 8192, 16384):
            b, h = 16384 // n, 2048 // d
            rng = cupy.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=np.float32).astype(BF16) for _ in range(3))
            q8, k8, v8 = (cupyflash.quantize_fp8(x) for x in (q, k, v))
            fresh = [cupyflash.FP8Tensor(v8.data, v8.scale, v8.block) for _ in range(args.rounds * (args.calls + 1))]
            times = {"bf16": [], "fp8": [], "fp8 new v": []}
            calls = {
                "bf16": lambda: cupyflash.attention_forward(q, k, v, causal=True),
                "fp8": lambda: cupyflash.attention_forward(q8, k8, v8, causal=True),
                "fp8 new v": lambda: cupyflash.attention_forward(q8, k8, fresh.pop(), causal=True),
            }
            for _ in range(args.rounds):
                for name, call in calls.items():
                    times[name].append(_timing.host_us(call, calls=args.calls, repeats=1, spin_ms=30))
            med = {name: statistics.median(t) for name, t in times.items()}
            print(
                f"| {d} | {n // 1024}k | {med['bf16']:.1f} | {med['fp8']:.1f} | {med['fp8'] / med['bf16']:.2f} | "
                f"{med['fp8 new v']:.1f} |",
                flush=True,
            )
            q = k = v = q8 = k8 = v8 = None
            fresh.clear()
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
