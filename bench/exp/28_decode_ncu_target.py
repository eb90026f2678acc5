"""The decode step Nsight Compute profiles (bench/log/2026-11-28-h200-fp8-kvcache-ncu.txt,
2026-11-29-h200-fp8-keys-as-rows-ncu.txt): B = 8, Nk = 32k, bf16 q, D = 128, 32/8 heads, Nq = 1, causal, four calls;
MODE=fp8 on block-scaled e4m3 caches, otherwise on the 16-bit caches.

    MODE=fp8 ncu --kernel-name regex:attention_decode_fp8 --launch-skip 3 --launch-count 1 \\
        python bench/exp/28_decode_ncu_target.py
"""

import os
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import Problem, ours  # noqa: E402

import cupyflash  # noqa: E402


def main() -> None:
    p = Problem(np.random.default_rng(0), ml_dtypes.bfloat16, 8, 32, 8, 1, 32768, 128)
    s = p.sets[0]
    if os.environ.get("MODE") == "fp8":
        k8, v8 = cupyflash.quantize_kvcache(s["k"]), cupyflash.quantize_kvcache(s["v"])

        def run():
            return cupyflash.attention_with_kvcache(s["q"], k8, v8, cache_seqlens=p.seqlens, causal=True)
    else:
        step = ours(p)

        def run():
            return step(s)

    for _ in range(4):
        run()
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
