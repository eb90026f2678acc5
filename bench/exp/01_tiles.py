"""Experiment 01: tile shapes for fp16/bf16 on the mma.sync path, from the one table (cupyflash/_cuda/tiles.py).

Swaps one kernel's entry of the table at a time (forward, dK/dV pass or dQ pass), checks the result
against the float64 reference on a small awkward problem, then times that kernel's direction on the
FlashAttention benchmark shape (bf16, 16k tokens, hidden 2048, N = 4k, causal and not). Needs a GPU.

    PYTHONPATH=.:bench python bench/exp/01_tiles.py

Results and the choice made from them: docs/design/tiles.md (the lab notebook, bench/log/NOTES.md, has the
full tables, "Experiment 01").
"""

import dataclasses
import math
from types import SimpleNamespace

import cupy
import ml_dtypes
import numpy as np
from bench_attention import L2Flush, median_ms  # the benchmark's timing (PYTHONPATH holds bench/)

import cupyflash
from cupyflash import reference
from cupyflash._cuda import compile, dense, plans, tiles

TIMING = SimpleNamespace(warmup=5, repeats=30)

BF16 = np.dtype(ml_dtypes.bfloat16)
# (HEAD_DIM, kernel): candidate tiles; the first is the table's entry when this ran
CANDIDATES = {
    (64, "fwd"): [(4, 128, 64), (8, 128, 64), (8, 64, 64)],
    (64, "dkdv"): [(4, 64, 64), (8, 64, 64), (8, 32, 64)],
    (64, "dq"): [(4, 64, 64), (8, 64, 64), (8, 32, 64)],
    (128, "fwd"): [(4, 64, 128), (8, 64, 128), (4, 128, 128), (8, 128, 128)],
    (128, "dkdv"): [(4, 32, 128), (8, 32, 128)],
    (128, "dq"): [(4, 32, 128), (8, 32, 128), (4, 64, 128), (8, 64, 128)],
    (256, "fwd"): [(8, 64, 256), (8, 32, 256), (4, 64, 256)],
}


def set_tiles(path, head_dim, kernel, shape):
    """The plain (and causal) 16-bit cell of ``kernel`` on ``path`` becomes (warps, block, d_chunk) ``shape``,
    its flags kept; returns the cell it replaced."""
    key = (path, 2, head_dim, kernel, "plain")
    original = tiles.CELLS[key]
    warps, block, d_chunk = shape
    tiles.CELLS[key] = dataclasses.replace(original, num_warps=warps, block=block, d_chunk=d_chunk)
    compile.modules.clear()  # modules and plans are memoized per variant, not per tile shape
    plans.clear()
    return original


def restore_tiles(path, head_dim, kernel, original):
    tiles.CELLS[path, 2, head_dim, kernel, "plain"] = original
    compile.modules.clear()
    plans.clear()


def max_rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def check(head_dim, rng):
    """Forward and backward on a small awkward problem against float64; returns the worst error."""
    q, k, v, dout = (
        rng.standard_normal(s).astype(BF16)
        for s in ((2, 3, 203, head_dim), (2, 3, 311, head_dim), (2, 3, 311, head_dim), (2, 3, 203, head_dim))
    )
    worst = 0.0
    for causal in (False, True):
        gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, dout))
        out, lse = cupyflash.attention_forward(gq, gk, gv, causal=causal)
        grads = cupyflash.attention_backward(gdo, gq, gk, gv, out, lse, causal=causal)
        ref_out = reference.attention(q, k, v, causal=causal)
        ref_grads = reference.attention_backward(dout, q, k, v, causal=causal)
        for got, want in zip((out, *grads), (ref_out, *ref_grads)):
            worst = max(worst, max_rel_error(cupy.asnumpy(got).astype(np.float64), want))
    return worst


def time_direction(head_dim, kernel, causal, n=4096):
    batch, heads = 16384 // n, 2048 // head_dim
    q, k, v, dout = (
        cupy.random.standard_normal((batch, heads, n, head_dim), dtype=cupy.float32).astype(BF16) for _ in range(4)
    )
    scale = 1 / math.sqrt(head_dim)
    flops = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    if kernel == "fwd":
        ms = median_ms(lambda: dense.attention_forward(q, k, v, scale=scale, causal=causal), TIMING, L2Flush())
        return flops / ms / 1e9
    out, lse = dense.attention_forward(q, k, v, scale=scale, causal=causal)
    ms = median_ms(
        lambda: dense.attention_backward(dout, q, k, v, out, lse, scale=scale, causal=causal), TIMING, L2Flush()
    )
    return 2.5 * flops / ms / 1e9


def main():
    rng = np.random.default_rng(1)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'HEAD_DIM':>8} {'kernel':>6} {'tiles':>16} {'smem':>7} {'err':>8} {'TFLOP/s full':>13} {'causal':>8}")
    for (head_dim, kernel), candidates in CANDIDATES.items():
        for shape in candidates:
            original = set_tiles("mma", head_dim, kernel, shape)
            smem = tiles.smem_bytes("mma", 2, head_dim, kernel, tiles.CELLS["mma", 2, head_dim, kernel, "plain"])
            if smem > tiles.SM80_SMEM_BYTES:
                print(f"{head_dim:>8} {kernel:>6} {str(shape):>16} {smem:>7} skipped: over the sm_80 limit")
            else:
                error = check(head_dim, rng)
                full, causal = (time_direction(head_dim, kernel, c) for c in (False, True))
                print(f"{head_dim:>8} {kernel:>6} {str(shape):>16} {smem:>7} {error:8.1e} {full:13.1f} {causal:8.1f}")
            restore_tiles("mma", head_dim, kernel, original)


if __name__ == "__main__":
    main()
