"""Would a rule on the relative Frobenius error have caught the ring's old flaw (each block's results rounded to
16 bits before the float32 sums)? The ring of 2 ranks, contiguous, emulated block by block through the public
calls on one GPU: once with each block's out and gradients rounded to the input dtype (the old ring), once
unrounded (out_dtype=float32, grad_dtype=float32; the ring as it is), against one GPU's call; per result, the
max-error ratio and the relative-Frobenius-error ratio. N = 8192, 8 key/value heads x 4, D = 128; the
long-shard test's draws under its name when this ran (bench/exp/29) and fresh ones, causal and not."""

import sys
import zlib

sys.path.insert(0, "tests")
sys.path.insert(0, "bench/exp")
import cupy
import ml_dtypes
import numpy as np
from ring_exactness import draw, errors, one_gpu, reference, without_lse

import cupyflash

NAMES = ("out", "dq", "dk", "dv")
TEST = "tests/gpu/test_gpu_distributed.py::test_ring_of_long_16_bit_shards_within_a_quarter_of_one_gpu[{}]"


def emulated_ring(q, k, v, dout, causal, rounded):
    """Rank r holds rows and keys [r c, (r + 1) c); its query block meets key block j (j <= r when causal, the
    diagonal block with the mask). Block results in the dtype (rounded) or float32, summed in float32."""
    dtype = q.dtype
    wide = None if rounded else np.float32
    c = q.shape[-2] // 2
    part = [lambda x, i=i: x[..., i * c : (i + 1) * c, :] for i in range(2)]
    pairs = [(r, j) for r in range(2) for j in range(2) if not causal or j <= r]
    blocks = {}
    for r, j in pairs:
        o, lse = cupyflash.attention_forward(
            part[r](q), part[j](k), part[j](v), causal=causal and j == r, out_dtype=wide
        )
        blocks[r, j] = (o.astype(np.float32), lse)
    outs, lses = [], []
    for r in range(2):
        mine = [blocks[r, j] for j in range(2) if (r, j) in blocks]
        lse = mine[0][1]
        for _, b in mine[1:]:
            lse = cupy.logaddexp(lse, b)
        o = sum(cupy.exp(b - lse)[..., None] * x for x, b in mine)
        outs.append(o.astype(dtype))
        lses.append(lse)
    dq = [cupy.zeros(part[r](q).shape, np.float32) for r in range(2)]
    dk = [cupy.zeros(part[r](k).shape, np.float32) for r in range(2)]
    dv = [cupy.zeros(part[r](v).shape, np.float32) for r in range(2)]
    for r, j in pairs:
        g = cupyflash.attention_backward(
            part[r](dout),
            part[r](q),
            part[j](k),
            part[j](v),
            outs[r],
            lses[r],
            causal=causal and j == r,
            grad_dtype=wide,
        )
        dq[r] += g[0].astype(np.float32)
        dk[j] += g[1].astype(np.float32)
        dv[j] += g[2].astype(np.float32)
    return [cupy.concatenate(x, axis=-2).astype(dtype) for x in (outs, dq, dk, dv)]


for dtype, dname in ((np.float16, "float16"), (ml_dtypes.bfloat16, "bfloat16")):
    for causal in (False, True):
        fixed = zlib.crc32(TEST.format(f"{'causal' if causal else 'full'}-{dname}").encode())
        for label, seed in [("test draw", fixed), ("seed 2000", 2000), ("seed 2001", 2001)]:
            problem = draw(seed, dtype, cupy)
            refs = without_lse(reference(*problem, causal=causal))
            base = errors(without_lse(one_gpu(*problem, causal=causal)), refs)
            for what, rounded in (("blocks rounded", True), ("blocks unrounded", False)):
                row = errors(emulated_ring(*problem, causal, rounded), refs)
                ratios = " ".join(f"{nm} {e[0] / b[0]:.2f}/{e[1] / b[1]:.3f}" for nm, e, b in zip(NAMES, row, base))
                print(f"{dname:8} causal={causal!s:5} {label:9} {what:16} max/frob ratio: {ratios}", flush=True)
