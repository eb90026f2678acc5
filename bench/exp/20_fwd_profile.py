"""One forward for a profiler to catch: bfloat16 or FP8 (per-tensor descales), FlashAttention's shapes (16k
tokens over the batch, hidden 2048), three untimed calls first (compilation, caches), then the one to profile.
The warp-specialized forward's kernel is the fourth launch of `attention_fwd_ws_kernel`:

    ncu --kernel-name regex:attention_fwd_ws --launch-skip 3 --launch-count 1 --set full -o REP \\
        python bench/exp/20_fwd_profile.py --form fp8 --d 128 --n 16384

With --time (not under a profiler) it prints the call's TFLOP/s (L2 flushed, median of 10), so that the
profiled shape's speed sits beside its counters.

What it taught (H200, 2026-11-27, bench/log/2026-11-27-h200-fp8-ncu.txt): 15% of the FP8 loop's samples sat in
the division that found the next key block's descales (replaced by a multiply and a shift: 7-12% faster);
after it no unit of the FP8 loop is saturated, each warp's chain bounds it.
"""

import argparse

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing

parser = argparse.ArgumentParser()
parser.add_argument("--form", choices=["bf16", "fp8"], default="fp8")
parser.add_argument("--d", type=int, default=128)
parser.add_argument("--n", type=int, default=16384)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--time", action="store_true", help="also time the call (not under a profiler)")
args = parser.parse_args()

b, h = max(1, 16384 // args.n), 2048 // args.d
rng = cupy.random.default_rng(args.d + args.n)
q, k, v = (rng.standard_normal((b, h, args.n, args.d), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
if args.form == "fp8":
    q, k, v = (cupyflash.quantize_fp8(x) for x in (q, k, v))


def call():
    return cupyflash.attention_forward(q, k, v, causal=args.causal)


for _ in range(4):
    call()
cupy.cuda.runtime.deviceSynchronize()
if args.time:
    flush = cupy.empty(256 << 20, dtype=cupy.uint8)

    def before():
        flush.fill(0)
        _timing.spin(10)

    ms = _timing.median_ms(call, warmup=2, repeats=10, before_each=before)
    flops = 4 * b * h * args.n * args.n * args.d / (2 if args.causal else 1)
    print(f"{args.form} D={args.d} N={args.n} causal={args.causal}: {flops / ms / 1e9:.1f} TFLOP/s ({ms:.3f} ms)")
