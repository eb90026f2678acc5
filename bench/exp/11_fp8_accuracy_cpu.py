"""FlashAttention-3's FP8 outlier experiment on the NumPy path (the same numerics as the GPU kernel, which the
tests hold to it): q, k, v ~ N(0, 1) + N(0, 100) * Bernoulli(0.001), B = 1, 4 of 16 heads drawn, N = 8k,
D = 128; RMSE of out against float64 attention on the unquantized inputs, for block scales on q and k after
hadamard_rotate with v in blocks or per slice, per-slice scales, per-tensor scales, and bfloat16.

    python bench/exp/11_fp8_accuracy_cpu.py        # about 1.5 min on 2 cores
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import time  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402

rng = np.random.default_rng(0)
b, h, n, d = 1, 16, 8192, 128


def draw():
    x = rng.standard_normal((b, h, n, d), dtype=np.float32)
    return x + 10 * rng.standard_normal((b, h, n, d), dtype=np.float32) * (rng.random((b, h, n, d)) < 1e-3)


q, k, v = draw(), draw(), draw()
H = 4  # heads used (time)
q, k, v = q[:, :H], k[:, :H], v[:, :H]
t = time.time()
ref = cupyflash.attention(*(x.astype(np.float64) for x in (q, k, v)))
print("ref", time.time() - t, flush=True)


def rmse(o):
    return float(np.sqrt(np.mean((o.astype(np.float64) - ref) ** 2)))


qr, kr = cupyflash.hadamard_rotate(q, seed=1), cupyflash.hadamard_rotate(k, seed=1)
Q = cupyflash.quantize_fp8
for name, args in [
    ("q,k blocks 128 + rotation, v blocks 128", (Q(qr, block=128), Q(kr, block=128), Q(v, block=128))),
    ("q,k blocks 128 + rotation, v per slice", (Q(qr, block=128), Q(kr, block=128), Q(v))),
    ("q,k per slice + rotation, v per slice", (Q(qr), Q(kr), Q(v))),
    ("per tensor", (Q(q, block="tensor"), Q(k, block="tensor"), Q(v, block="tensor"))),
    ("bfloat16", tuple(x.astype(ml_dtypes.bfloat16) for x in (q, k, v))),
]:
    t = time.time()
    print(f"{name:45} RMSE {rmse(cupyflash.attention(*args)):.3e}  ({time.time() - t:.0f} s)", flush=True)
