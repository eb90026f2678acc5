#!/usr/bin/env python3
"""Experiment 02: the forward's fixed cost per CTA, measured with rows that see few key tiles.

Plain non-causal float16, D = 128, B = 2, H = 16, Nq = 8192 and Nk from 128 to 8192: time grows by one
key tile's work per 128 keys; what a line through the times leaves at Nk = 0 is the per-CTA cost of the
prologue (Q and the first K/V tile), the epilogue (out and lse) and the launch. torch SDPA's `flash`
backend (FlashAttention-2) runs the same inputs (shared through DLPack) when torch is importable.

What it taught (H200, the first kernels): a line through the times left about 0.19 ms of fixed cost
against FlashAttention-2's 0.05 ms. Most of that "fixed cost" turned out to be host time counted by the
events (the call issued after the L2 flush's head start), not the kernels' prologue and epilogue: the
benchmarks' --timing gpu separates the two since (docs/design/host_time.md).

    python bench/exp/02_short_rows.py
"""

import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupyflash  # noqa: E402
from cupyflash._timing import median_ms  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # torch is optional
    torch = None

B, H, NQ, D = 2, 16, 8192, 128
KEYS = (128, 384, 1024, 4096, 8192)


def main():
    print(f"{'Nk':>6} {'ours ms':>8} {'flash ms':>9} {'ours TF/s':>10} {'flash TF/s':>11}")
    rows = []
    for nk in KEYS:
        q, k, v = (
            cupy.random.standard_normal((B, H, n, D), dtype=cupy.float32).astype(cupy.float16) for n in (NQ, nk, nk)
        )
        ours = median_ms(lambda: cupyflash.attention(q, k, v), warmup=5, repeats=30)
        flash = float("nan")
        if torch is not None:
            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                flash = median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv), warmup=5, repeats=30)
        flops = 4 * B * H * NQ * nk * D
        rows.append((nk, ours, flash))
        print(f"{nk:6d} {ours:8.3f} {flash:9.3f} {flops / ours / 1e9:10.1f} {flops / flash / 1e9:11.1f}")
    (n0, t0, f0), (n1, t1, f1) = rows[0], rows[1]
    per_tile = (t1 - t0) / ((n1 - n0) / 128)
    print(f"ours: fixed {t0 - per_tile * n0 / 128:.3f} ms + {per_tile:.3f} ms per 128-key tile")
    if torch is not None:
        per_tile_f = (f1 - f0) / ((n1 - n0) / 128)
        print(f"flash: fixed {f0 - per_tile_f * n0 / 128:.3f} ms + {per_tile_f:.3f} ms per 128-key tile")


if __name__ == "__main__":
    main()
