"""Where does the ring's dk error on shifted bf16 data come from (bench/exp/31: causal N = 65536, worst shard's
relative Frobenius error 1.80x one GPU's at W = 2, 2.11x at W = 4; fp16 and standard-normal data at or below
1.0x)? The ring's backward takes the ring forward's out and lse; one GPU's takes its own. Swapping them
separates the forward's outputs from the backward's schedule. Prediction: the forward's outputs carry it (the
blocks' lse, merged in float32, is 4x closer to float64 than one GPU's (exp/31's lse ratios 0.26), so P in the
backward is normalized differently from the P that made out, and D = rowsum(dout * out), about 190 on this data,
multiplies any such mismatch); then "one GPU backward on the ring's out, lse" is as far off as the ring.
(The premise was misread: exp/31's lse ratio is over a float32 floor of 1e-6 |lse|; the log shows the two lse
errors equal.)

Rows: dk's worst zigzag-shard norm ratio and max ratio over one GPU's own backward (A), for
  B ring backward on the ring's out, lse (what users get)
  C one GPU backward on the ring's out, lse
  D ring backward on one GPU's out, lse
  E one GPU backward on one GPU's out with the ring's lse
  F one GPU backward on the ring's out with one GPU's lse
and the signed mean and the rms of lse's error (against float64) for each forward. bf16 and fp16, causal
zigzag, W = 2, N = 65536, 2 x 2 heads of 128, exp/31's shifted draw."""

import sys
import zlib

sys.path.insert(0, "tests")
sys.path.insert(0, "bench/exp")
import cupy
import ml_dtypes
import numpy as np
from helpers.problems import shifted_problem
from ring_exactness import ring_backward, ring_forward, shard_norms

import cupyflash

N, HK, G, D, W = 65536, 2, 2, 128, 2


def one_backward(dout, q, k, v, out, lse):
    return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)[1]


def ring_backward_dk(dout, q, k, v, out, lse):
    return ring_backward(dout, q, k, v, out, lse, causal=True, world=W)[1]


def shard_errors(x, ref):
    """dk's relative Frobenius error in each zigzag shard of rows, and its max error."""
    return shard_norms(x, ref, 2 * W), float(cupy.abs(x.astype(cupy.float64) - ref).max())


for dtype, name in ((ml_dtypes.bfloat16, "bf16"), (np.float16, "fp16")):
    rng = np.random.default_rng(zlib.crc32(f"{N} shifted {name} True".encode()))
    q, k, v, dout = shifted_problem(rng, (1, HK, G, N, D), (1, HK, 1, N, D), (1, HK, 1, N, D), dtype, xp=cupy)
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = cupyflash.attention_forward(*wide[:3], causal=True)
    ref_dk = cupyflash.attention_backward(wide[3], *wide[:3], ref_out, ref_lse, causal=True)[1]
    del wide
    one_out, one_lse = cupyflash.attention_forward(q, k, v, causal=True)
    ring_out, ring_lse = ring_forward(q, k, v, causal=True, world=W)
    for label, lse in (("one GPU", one_lse), ("ring", ring_lse)):
        e = lse.astype(cupy.float64) - ref_lse
        print(
            f"{name} lse of {label:8}: signed mean {float(e.mean()):+.3e}, rms {float(cupy.sqrt((e * e).mean())):.3e}"
        )
    for label, out in (("one GPU", one_out), ("ring", ring_out)):
        e = out.astype(cupy.float64) - ref_out
        print(
            f"{name} out of {label:8}: signed mean {float(e.mean()):+.3e}, rms {float(cupy.sqrt((e * e).mean())):.3e}"
        )
    base_norms, base_max = shard_errors(one_backward(dout, q, k, v, one_out, one_lse), ref_dk)
    print(f"{name} A one GPU's dk: shard norms " + " ".join(f"{x:.2e}" for x in base_norms) + f", max {base_max:.3g}")
    rows = {
        "B ring bwd, ring out/lse": ring_backward_dk(dout, q, k, v, ring_out, ring_lse),
        "C one bwd, ring out/lse": one_backward(dout, q, k, v, ring_out, ring_lse),
        "D ring bwd, one out/lse": ring_backward_dk(dout, q, k, v, one_out, one_lse),
        "E one bwd, one out, ring lse": one_backward(dout, q, k, v, one_out, ring_lse),
        "F one bwd, ring out, one lse": one_backward(dout, q, k, v, ring_out, one_lse),
    }
    for label, dk in rows.items():
        norms, mx = shard_errors(dk, ref_dk)
        ratios = " ".join(f"{a / b:.3f}" for a, b in zip(norms, base_norms))
        print(f"{name} {label:30}: shard norm ratios {ratios}, max ratio {mx / base_max:.2f}", flush=True)
    del q, k, v, dout, ref_out, ref_lse, ref_dk
    cupy.get_default_memory_pool().free_all_blocks()
