"""examples/gpt on CuPy: the bfloat16 matrix products (matmul.py, cuBLAS gemmEx) against float64 NumPy on the
shapes and operand layouts the model uses, and short training runs in bfloat16 and float16 that learn and, in
bfloat16, stay near the float32 run. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_gpt_example.py

The CPU side (the NumPy path, and the cuBLAS path's index logic replayed on NumPy) is tests/cpu/test_gpt_example.py.
"""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

import matmul  # noqa: E402
import train  # noqa: E402

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def _bf16(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


def _rel_frobenius(found, expected):
    return np.linalg.norm(found - expected) / np.linalg.norm(expected)


def _bound(a, b, out_dtype):
    """The relative Frobenius error allowed for a @ b against the float64 product of the same bfloat16 values.

    The inputs are exact (the reference multiplies the very bfloat16 numbers cuBLAS gets), so two errors remain:
    rounding each output to bfloat16, at most 2^-8 of its value (8 significant bits, round to nearest), hence at
    most 2^-8 in Frobenius norm, and none for float32 outputs; and float32 accumulation over k products, at most
    k * 2^-23 of sum |a_i b_i| per element (the classic k u bound with u = 2^-23, not 2^-24, in case the tensor cores
    truncate rather than round their adds), taken relative to the product as ||(|a| |b|)||_F / ||a b||_F.
    """
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    growth = np.linalg.norm(np.abs(a64) @ np.abs(b64)) / np.linalg.norm(a64 @ b64)
    return (2.0**-8 if out_dtype == BF16 else 0.0) + a.shape[-1] * 2.0**-23 * growth


# (name, a and b as the model builds them from host arrays: functions of (xp, rng), out_dtype)
PRODUCTS = {
    "linear forward: x (3, 37, 64) @ w (64, 96)": (lambda xp, h: (xp.asarray(h[0]), xp.asarray(h[1])), BF16),
    "linear backward dx: dout (3, 37, 96) @ w.T": (lambda xp, h: (xp.asarray(h[2]), xp.asarray(h[1]).T), BF16),
    "linear backward dw in float32: flat_x.T (64, 111) @ flat_dout (111, 96)": (
        lambda xp, h: (xp.asarray(h[0]).reshape(-1, 64).T, xp.asarray(h[2]).reshape(-1, 96)),
        F32,
    ),
    "the tied head in float32: x[:, -1] (3, 64) @ wte.T (64, 119)": (
        lambda xp, h: (xp.asarray(h[0])[:, -1], xp.asarray(h[3]).T),
        F32,
    ),
    "the head's backward: dlogits (111, 119) @ wte (119, 64)": (
        lambda xp, h: (xp.asarray(h[4]), xp.asarray(h[3])),
        BF16,
    ),
    "an operand that must be copied first: x[..., ::2] (3, 37, 32) @ w[::2] (32, 96)": (
        lambda xp, h: (xp.asarray(h[0])[..., ::2], xp.asarray(h[1])[::2]),
        BF16,
    ),
    "k = 1: x[..., :1] @ w[:1]": (lambda xp, h: (xp.asarray(h[0])[..., :1], xp.asarray(h[1])[:1]), BF16),
}


def _host_operands(rng):
    return (
        _bf16(rng, (3, 37, 64)),  # x
        _bf16(rng, (64, 96)),  # w
        _bf16(rng, (3, 37, 96)),  # dout
        _bf16(rng, (119, 64)),  # wte
        _bf16(rng, (111, 119)),  # dlogits
    )


@pytest.mark.parametrize("name", PRODUCTS)
def test_bfloat16_products_against_float64(rng, name):
    build, out_dtype = PRODUCTS[name]
    host = _host_operands(rng)
    a_host, b_host = build(np, host)
    a, b = build(cupy, host)
    found = matmul.matmul(a, b, out_dtype)
    assert isinstance(found, cupy.ndarray) and found.dtype == out_dtype
    assert found.shape == a_host.shape[:-1] + (b_host.shape[1],)
    expected = a_host.astype(np.float64) @ b_host.astype(np.float64)
    error = _rel_frobenius(found.get().astype(np.float64), expected)
    assert error <= _bound(a_host, b_host, out_dtype), error


def test_bfloat16_product_of_gpt2_small_sizes(rng):
    """A (4, 256, 768) @ (768, 3072) product, the MLP's first in GPT-2 small: k large enough for the accumulation
    term of the bound to matter, and a size cuBLAS runs on its tensor-core kernels."""
    a_host, b_host = _bf16(rng, (4, 256, 768)), _bf16(rng, (768, 3072))
    for out_dtype in (BF16, F32):
        found = matmul.matmul(cupy.asarray(a_host), cupy.asarray(b_host), out_dtype)
        expected = a_host.astype(np.float64) @ b_host.astype(np.float64)
        error = _rel_frobenius(found.get().astype(np.float64), expected)
        assert error <= _bound(a_host, b_host, out_dtype), (out_dtype, error)


def test_cublas_constants_and_call_conventions(rng):
    """matmul.py's enum numbers are CuPy's; a product made while the handle is in device pointer mode and on a
    stream of its own is still right, and the handle's pointer mode is given back as found."""
    from cupy.cuda import cublas, runtime

    assert (matmul.CUBLAS_OP_N, matmul.CUBLAS_OP_T) == (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
    assert (matmul.CUDA_R_32F, matmul.CUDA_R_16BF) == (runtime.CUDA_R_32F, runtime.CUDA_R_16BF)
    assert matmul.CUBLAS_COMPUTE_32F == cublas.CUBLAS_COMPUTE_32F
    assert matmul.CUBLAS_GEMM_DEFAULT == cublas.CUBLAS_GEMM_DEFAULT
    assert matmul.CUBLAS_POINTER_MODE_HOST == cublas.CUBLAS_POINTER_MODE_HOST
    a_host, b_host = _bf16(rng, (5, 40)), _bf16(rng, (40, 24))
    expected = a_host.astype(np.float64) @ b_host.astype(np.float64)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_DEVICE)
    try:
        with cupy.cuda.Stream(non_blocking=True) as stream:
            found = matmul.matmul(cupy.asarray(a_host), cupy.asarray(b_host), F32)
            stream.synchronize()
        assert cublas.getPointerMode(handle) == cublas.CUBLAS_POINTER_MODE_DEVICE
    finally:
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    assert _rel_frobenius(found.get().astype(np.float64), expected) <= _bound(a_host, b_host, F32)


def test_mixed_bfloat16_products_are_refused():
    """cuBLAS gets two bfloat16 operands or none: a bfloat16 @ float32 product is an error, not a silent cast."""
    with pytest.raises(TypeError, match="both operands bfloat16"):
        matmul.matmul(cupy.ones((2, 3), BF16), cupy.ones((3, 4), F32))


def _train(dtype, steps, seed=0):
    argv = ["--device", "gpu", "--dtype", dtype, "--steps", str(steps), "--warmup", "5", "--seed", str(seed),
            "--eval-every", str(steps), "--checkpoint", "", "--sample", "0"]  # fmt: skip
    return np.array(train.main(argv)["history"]["train"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_twenty_steps_learn(dtype):
    """The default small model (2 layers, width 64, context 64, batch 16) for 20 steps: every loss finite, and
    the last five 0.5 below the first three on average (all three dtypes measured 1.1 lower on an H200)."""
    losses = _train(dtype, 20)
    assert np.isfinite(losses).all(), losses
    assert losses[-5:].mean() < losses[:3].mean() - 0.5, losses


# bfloat16 against float32 from the same seed (the same initial parameters and batches). The first loss differs
# only by the forward's roundings, which average out over the batch's 1024 tokens; the updates barely move apart
# because Adam's first steps are close to lr * sign(gradient), which a gradient's relative rounding error of
# 2^-8 rarely flips. Measured on an H200: at most 2e-4 apart over the 8 steps (and over 20), in which the loss
# falls from 4.8 to 4.0, about 0.1 a step. The bound, a tenth of one step's progress, leaves 50 times the measured
# gap for other cuBLAS kernels and accumulation orders.
BFLOAT16_LOSS_GAP = 0.01


def test_bfloat16_tracks_float32():
    """Eight steps in bfloat16 and in float32 from one seed: each step's loss within BFLOAT16_LOSS_GAP."""
    bf16, f32 = _train("bfloat16", 8), _train("float32", 8)
    assert np.isfinite(bf16).all() and np.abs(bf16 - f32).max() < BFLOAT16_LOSS_GAP, (bf16 - f32, f32)
