"""Out divided by the sum of the rounded P against out divided by l, accuracy on one problem each, run once per tree
(the tree's forward decides which):

    PYTHONPATH=. python bench/exp/38_rounded_sum_forward_prototype.py TAG [HEAD_DIM]    # HEAD_DIM: 128 unless given

Prediction (bench/exp/37's emulation): on data with a mean and outlier channels the per-row error e_i falls by an
order of magnitude, D's error to the rounded-once level (0.06 from 0.16 in bf16), dq's error about 2.5x; on
standard-normal data little changes; lse is unchanged. Causal, 8192 keys, 2 x 16 heads without broadcasting (the
warp-specialized forward's shape; k and v broadcast over heads take the wgmma forward). Run with the first version
(P rounded a second time in the softmax), the operand-sum version, the tensor cores' sums, and the forward dividing
by l; log 2026-11-29-h200-row-sums-of-the-rounded-p.txt. Speed: bench_attention.py --cases
'bf16-d(64|128|256)-(causal|full)-n(8k|16k)$' --backends ours flash cudnn --timing gpu in each tree."""

import sys

sys.path.insert(0, "tests")
import cupy
import ml_dtypes
import numpy as np
from helpers.problems import random_problem, shifted_problem

import cupyflash

tag = sys.argv[1]


def rel(x, ref):
    return float(cupy.linalg.norm(x.astype(np.float64) - ref) / cupy.linalg.norm(ref))


for make in (shifted_problem, random_problem):
    for dtype, name in ((ml_dtypes.bfloat16, "bf16"), (np.float16, "fp16")):
        rng = np.random.default_rng(7000)
        shape = (2, 16, 8192, int(sys.argv[2]) if len(sys.argv) > 2 else 128)  # the benchmark's (no broadcast)
        q, k, v, dout = make(rng, shape, shape, shape, dtype, xp=cupy)
        wide = [x.astype(np.float64) for x in (q, k, v, dout)]
        ro, rl = cupyflash.attention_forward(*wide[:3], causal=True)
        rg = cupyflash.attention_backward(wide[3], *wide[:3], ro, rl, causal=True)
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
        out32 = cupyflash.attention_forward(q, k, v, causal=True, out_dtype=np.float32)[0].astype(np.float64)
        g3 = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        e = out32 - ro
        e_row = (e * ro).sum(-1) / (ro * ro).sum(-1)
        d_err = float(cupy.sqrt(cupy.mean(((wide[3] * out.astype(np.float64)).sum(-1) - (wide[3] * ro).sum(-1)) ** 2)))
        out_max = float(cupy.abs(out.astype(np.float64) - ro).max())
        e_rms = float(cupy.sqrt(cupy.mean(e_row**2)))
        lse_max = float(cupy.abs(lse.astype(np.float64) - rl).max())
        print(
            f"{tag} {make.__name__[:7]} {name}: out rel {rel(out, ro):.4g} max {out_max:.3g} | unrounded e_i rms "
            f"{e_rms:.3g} | lse max err {lse_max:.3g} | D err rms {d_err:.3g} | dq {rel(g3[0], rg[0]):.4g} "
            f"dk {rel(g3[1], rg[1]):.4g} dv {rel(g3[2], rg[2]):.4g}",
            flush=True,
        )
        np.save(f"/tmp/{tag}_{make.__name__[:7]}_{name}_lse.npy", lse.get())
