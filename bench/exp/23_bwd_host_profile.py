"""Where a dense backward's host time goes at FlashAttention's benchmark shapes (16k tokens, hidden 2048), bf16:
the host microseconds per call with the GPU held behind a spin (cupyflash._timing.host_us), against the forward's
and a tiny backward's, then cProfile of 20 backward calls behind a spin (the 30 functions with the most time in
them, callees included). Prints one table per case.

    PYTHONPATH=. python bench/exp/23_bwd_host_profile.py [--cases d128-full-2k,...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing

BF16 = np.dtype(ml_dtypes.bfloat16)
CASES = {
    "d128-full-2k": (128, False, 2048),
    "d128-causal-2k": (128, True, 2048),
    "d128-full-8k": (128, False, 8192),
    "d64-causal-2k": (64, True, 2048),
    "d128-full-tiny": (128, False, 128),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    for name in args.cases.split(","):
        d, causal, n = CASES[name]
        b, h = (16384 // n, 2048 // d) if n >= 1024 else (1, 2)
        rng = cupy.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((b, h, n, d), dtype=np.float32).astype(BF16) for _ in range(4))
        out, lse = cupyflash.attention_forward(q, k, v, causal=causal)

        def forward():
            return cupyflash.attention_forward(q, k, v, causal=causal)

        def backward():
            return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

        fwd = _timing.host_us(forward, calls=20, repeats=5, spin_ms=60)
        bwd = _timing.host_us(backward, calls=20, repeats=5, spin_ms=60)
        print(f"## {name} (B={b} H={h}): host µs per call, forward {fwd:.1f}, backward {bwd:.1f}", flush=True)
        profile = cProfile.Profile()
        _timing.spin(60)
        profile.enable()
        for _ in range(20):
            backward()
        profile.disable()
        cupy.cuda.Device().synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
        print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()), flush=True)
        q = k = v = dout = out = lse = None
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
