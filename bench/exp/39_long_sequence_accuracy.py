"""Accuracy where it breaks: 8k, 64k and 128k keys, causal, D = 128, GQA (q (1, 2, 2, N, D) over k, v
(1, 2, 1, N, D)), bf16 and fp16, on data with a mean and outlier channels and on standard-normal data. Ours (the
warp-specialized forward dividing by the rounded P's sums, the fused backward reading broadcast k, v) against a
float64 reference (cupyflash on float64 copies), beside torch SDPA's cudnn and flash backends on the same inputs.

    PYTHONPATH=. python bench/exp/39_long_sequence_accuracy.py [N ...] [seeds=3900,...] [only=shifted-bf16] [diag=1]

Prediction: out's relative error and the per-row e_i stay at their 8k values (e_i about 1e-5: the rounded-once
level, which does not depend on the row's length); lse's max error grows at most with log N (float32 sums of N
terms); dq's, dk's and dv's relative errors stay within 1.5x of their 8k values, and each of ours at or below the
peers' on the same inputs.
"""

import sys

sys.path.insert(0, "tests")
import cupy
import ml_dtypes
import numpy as np
from helpers.problems import random_problem, shifted_problem

import cupyflash

try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    torch = None


def rel(x, ref):
    return float(cupy.linalg.norm(x.astype(np.float64) - ref) / cupy.linalg.norm(ref))


def peer(backend, q, k, v, dout):
    """torch SDPA's out, dq, dk, dv (dk, dv per kv head) in float64 CuPy arrays, or None where it refuses."""
    b, hk, g, n, d = q.shape
    tq, tk, tv, tdo = (torch.from_dlpack(x.reshape(b, -1, n, d)) for x in (q, k, v, dout))
    tq, tk, tv = (t.detach().clone().requires_grad_(True) for t in (tq, tk, tv))
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
            out.backward(tdo)
    except RuntimeError as error:
        print(f"  {backend}: refused ({str(error).splitlines()[0][:80]})")
        return None
    wide = [cupy.from_dlpack(t.detach()).astype(np.float64) for t in (out, tq.grad, tk.grad, tv.grad)]
    return [wide[0].reshape(q.shape), wide[1].reshape(q.shape), wide[2].reshape(k.shape), wide[3].reshape(v.shape)]


options = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
sizes = [int(a) for a in sys.argv[1:] if "=" not in a] or [8192, 65536, 131072]
seeds = [int(s) for s in options.get("seeds", "3900").split(",")]
cases = [
    (make, dtype, name, seed)
    for make in (shifted_problem, random_problem)
    for dtype, name in ((ml_dtypes.bfloat16, "bf16"), (np.float16, "fp16"))
    for seed in seeds
    if options.get("only", f"{make.__name__[:7]}-{name}") == f"{make.__name__[:7]}-{name}"
]
for n in sizes:
    for make, dtype, name, seed in cases:
        case = f"N={n} seed {seed} {make.__name__[:7]} {name}"
        rng = np.random.default_rng(seed)
        q, k, v, dout = make(rng, (1, 2, 2, n, 128), (1, 2, 1, n, 128), (1, 2, 1, n, 128), dtype, xp=cupy)
        wide = [x.astype(np.float64) for x in (q, k, v, dout)]
        ro, rl = cupyflash.attention_forward(*wide[:3], causal=True)
        rg = cupyflash.attention_backward(wide[3], *wide[:3], ro, rl, causal=True)
        del wide
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
        out32 = cupyflash.attention_forward(q, k, v, causal=True, out_dtype=np.float32)[0].astype(np.float64)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        e_row = ((out32 - ro) * ro).sum(-1) / (ro * ro).sum(-1)
        e_rms = float(cupy.sqrt(cupy.mean(e_row**2)))
        lse_max = float(cupy.abs(lse.astype(np.float64) - rl).max())
        out_max = float(cupy.abs(out.astype(np.float64) - ro).max())
        print(
            f"{case} ours: out rel {rel(out, ro):.3g} max {out_max:.3g} | e_i rms "
            f"{e_rms:.3g} | lse max {lse_max:.3g} | dq {rel(grads[0], rg[0]):.3g} dk {rel(grads[1], rg[1]):.3g} "
            f"dv {rel(grads[2], rg[2]):.3g}",
            flush=True,
        )
        if "diag" in options:  # where dk's error comes from: the rounding of each head's part, out, the GQA path
            once = [g.astype(dtype) for g in cupyflash.attention_backward(
                dout, q, k, v, out, lse, causal=True, grad_dtype=np.float32)]  # fmt: skip
            best = cupyflash.attention_backward(dout, q, k, v, ro.astype(dtype), rl.astype(np.float32), causal=True)
            kx, vx = (cupy.ascontiguousarray(cupy.broadcast_to(x, q.shape)) for x in (k, v))
            mha = cupyflash.attention_backward(dout, q, kx, vx, out, lse, causal=True)
            summed = [g.astype(np.float32).sum(axis=2, keepdims=True).astype(dtype) for g in mha[1:]]
            same = all(bool(cupy.array_equal(a, b)) for a, b in zip(summed, grads[1:]))
            for label, g in (("rounded once", once), ("on the float64 out", best), ("k, v copied per head", mha)):
                dk, dv = (x.astype(np.float64).sum(axis=2, keepdims=True) for x in g[1:])
                print(
                    f"{case} ours, {label}: dq {rel(g[0], rg[0]):.3g} dk {rel(dk, rg[1]):.3g} dv {rel(dv, rg[2]):.3g}"
                )
            print(f"{case} ours: the GQA path's dk, dv equal the copied heads' summed in float32: {same}", flush=True)
            del once, best, kx, vx, mha, summed
        del out32, grads
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION") if torch is not None else ():
            found = peer(backend, q, k, v, dout)
            if found is not None:
                print(
                    f"{case} {backend[:5].lower()}: out rel {rel(found[0], ro):.3g} "
                    f"max {float(cupy.abs(found[0] - ro).max()):.3g} | dq {rel(found[1], rg[0]):.3g} "
                    f"dk {rel(found[2], rg[1]):.3g} dv {rel(found[3], rg[2]):.3g}",
                    flush=True,
                )
            del found
            torch.cuda.empty_cache()
        del ro, rl, rg
        cupy.get_default_memory_pool().free_all_blocks()
