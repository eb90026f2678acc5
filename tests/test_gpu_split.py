"""float32 on Hopper's 16-bit warpgroup products: inputs split into float16 pieces (cupyflash/_split.py,
cuda_src/split_f32.cu, pieces.cuh) and the forward and backward that run on them. Needs a GPU; the
accuracy tests hold on every GPU (elsewhere they check the mma.sync path), the variant test says which
path a Hopper GPU takes.

    PYTHONPATH=. python -m pytest -m gpu tests/test_gpu_split.py
"""

import math

import cupy
import numpy as np
import pytest

import cupyflash
from cupyflash import _kernels, _split, reference

pytestmark = pytest.mark.gpu

FP32_RTOL = 1e-5


def _random(rng, shape, dtype=np.float32):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def _is_hopper():
    return int(cupy.cuda.Device().compute_capability) == 90


def test_pieces_hold_each_element_to_22_bits(rng):
    # Three slices of very different magnitudes, one all zero; 60 columns padded to 64 per piece.
    x = _random(rng, (4, 37, 60))
    x[1] *= 3e-7
    x[2] *= 5e5
    x[3] = 0
    (pieces,), exponents = _split.split([x], 64, (4,))
    assert pieces.shape == (4, 37, 128) and pieces.dtype == np.float16
    assert exponents.shape == (4, 4) and exponents.dtype == np.int32
    p = cupy.asnumpy(pieces).astype(np.float64)
    e = cupy.asnumpy(exponents)[:, 0]
    assert not cupy.asnumpy(exponents)[:, 1:].any(), "only one input: the other columns stay 0"
    xs = cupy.asnumpy(x).astype(np.float64)
    assert np.all(p[..., 60:64] == 0) and np.all(p[..., 124:] == 0), "padding columns must be zero"
    for s in range(3):
        largest = np.abs(xs[s]).max() * 2.0 ** e[s]
        assert 2**14 <= largest < 2**15, f"slice {s}: largest scaled magnitude {largest}"
        scaled = xs[s] * 2.0 ** e[s]
        rebuilt = p[s, :, :60] + p[s, :, 64:124]
        # 22 significant bits for elements down to 2^-3 of float16's normal range; an absolute floor below.
        bound = np.maximum(np.abs(scaled) * 2.0**-22, 2.0**-24)
        assert np.all(np.abs(rebuilt - scaled) <= bound), f"slice {s}: pieces do not rebuild x * 2^e"
    assert e[3] == 0 and np.all(p[3] == 0), "an all-zero slice splits into zeros with exponent 0"


def test_pieces_keep_broadcast_dims_unmaterialized(rng):
    """Grouped heads: k shared by 6 query heads is split once; its exponents reach all 12 batch entries."""
    q = _random(rng, (2, 6, 40, 64))
    base = _random(rng, (2, 1, 50, 64))
    base[1] *= 1e4
    k = cupy.broadcast_to(base, (2, 6, 50, 64))
    (q_pieces, k_pieces), exponents = _split.split([q, k], 64, (2, 6))
    assert q_pieces.shape == (2, 6, 40, 128) and k_pieces.shape == (2, 6, 50, 128) and k_pieces.strides[1] == 0
    e = cupy.asnumpy(exponents).reshape(2, 6, 4)
    assert np.all(e[0, :, 1] == e[0, 0, 1]) and np.all(e[1, :, 1] == e[1, 0, 1]) and e[0, 0, 1] > e[1, 0, 1]
    largest = np.abs(cupy.asnumpy(q)).max(axis=(-2, -1))
    assert np.all((2.0**14 <= largest * 2.0 ** e[..., 0]) & (largest * 2.0 ** e[..., 0] < 2.0**15))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [40, 64, 100, 128])
def test_heads_of_very_different_magnitudes_keep_float32_accuracy(rng, head_dim, causal):
    """Each (N, D) matrix gets its own power of two, so every head keeps float32 accuracy relative to
    its own output, not only to the largest head's."""
    q, k, v = (_random(rng, (2, 3, n, head_dim)) for n in (211, 300, 300))
    q[1, 2] *= 1e-5
    k[0, 1] *= 30.0
    v[1, 0] *= 1e-7
    v[0, 2] *= 1e6
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    ref_out, ref_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=causal, return_lse=True)
    out = cupy.asnumpy(out)
    for b in range(2):
        for h in range(3):
            size = np.abs(ref_out[b, h]).max()
            error = np.abs(out[b, h] - ref_out[b, h]).max()
            assert error <= FP32_RTOL * size, f"head ({b}, {h}): relative error {error / size:.3g}"
    seen = np.isfinite(ref_lse)
    assert np.abs(cupy.asnumpy(lse)[seen] - ref_lse[seen]).max() <= FP32_RTOL * np.abs(ref_lse[seen]).max()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_sequences_keep_float32_accuracy(rng, head_dim, causal):
    """8192 keys: the output's sum over key blocks must not drift (the tensor cores truncate each
    accumulation step, so the forward adds each block's P V in registers). Reference in float64 on the GPU."""
    n = 8192
    q, k, v = (_random(rng, (1, 2, n, head_dim)) for _ in range(3))
    v += 0.5  # a non-zero mean: a drift in the sum shows in every output element
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    q64, k64, v64 = (x.astype(cupy.float64) for x in (q, k, v))
    s = cupy.einsum("bhnd,bhmd->bhnm", q64, k64) / math.sqrt(head_dim)
    if causal:
        s = cupy.where(cupy.tri(n, dtype=bool), s, -cupy.inf)
    m = s.max(-1, keepdims=True)
    p = cupy.exp(s - m)
    l = p.sum(-1, keepdims=True)
    ref_out = cupy.einsum("bhnm,bhmd->bhnd", p / l, v64)
    ref_lse = (m + cupy.log(l))[..., 0]
    error = float(cupy.abs(out - ref_out).max() / cupy.abs(ref_out).max())
    assert error <= FP32_RTOL, f"relative error {error:.3g}"
    assert float(cupy.abs(lse - ref_lse).max()) <= FP32_RTOL * float(cupy.abs(ref_lse).max())


def _reference_gradients(q, k, v, dout, causal):
    """dq, dk, dv in float64 on the GPU (rows that see no key: zero gradients)."""
    q, k, v, dout = (x.astype(cupy.float64) for x in (q, k, v, dout))
    nq, nk = q.shape[-2], k.shape[-2]
    s = cupy.einsum("bhnd,bhmd->bhnm", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = cupy.where(cupy.arange(nk)[None, :] <= cupy.arange(nq)[:, None] + nk - nq, s, -cupy.inf)
    m = s.max(-1, keepdims=True)
    p = cupy.exp(s - cupy.where(cupy.isfinite(m), m, 0))
    l = p.sum(-1, keepdims=True)
    p /= cupy.where(l > 0, l, 1)
    out = cupy.einsum("bhnm,bhmd->bhnd", p, v)
    dp = cupy.einsum("bhnd,bhmd->bhnm", dout, v)
    ds = p * (dp - (dout * out).sum(-1, keepdims=True)) / math.sqrt(q.shape[-1])
    return (cupy.einsum("bhnm,bhmd->bhnd", ds, k), cupy.einsum("bhnm,bhnd->bhmd", ds, q),
            cupy.einsum("bhnm,bhnd->bhmd", p, dout))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [40, 64, 100, 128])
def test_backward_of_heads_of_very_different_magnitudes(rng, head_dim, causal):
    """Gradients per head against float64, with q, k, v and dout heads scaled by up to 1e+-9: each (N, D)
    matrix and each row of P and dS in registers gets its own power of two. Per head, float32's own
    rounding (of dS = P (dP - delta) in particular) reaches ~1e-5 of a head's largest gradient in either
    tensor-core path, so the bound here is 3e-5 per head (the suite's 1e-5 holds against each result's
    largest magnitude)."""
    q, k, v, dout = (_random(rng, (2, 3, n, head_dim)) for n in (257, 300, 300, 257))
    q[1, 2] *= 1e-5
    k[0, 1] *= 30.0
    v[1, 0] *= 1e-7
    dout[0, 2] *= 1e6
    dout[1, 1] *= 1e-9
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    for name, x, ref in zip(("dq", "dk", "dv"), grads, _reference_gradients(q, k, v, dout, causal)):
        for b in range(2):
            for h in range(3):
                size = float(cupy.abs(ref[b, h]).max())
                error = float(cupy.abs(x[b, h] - ref[b, h]).max())
                assert error <= 3 * FP32_RTOL * size, f"{name} head ({b}, {h}): relative error {error / size:.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_backward_keeps_float32_accuracy(rng, head_dim, causal):
    n = 4096
    q, k, v, dout = (_random(rng, (1, 2, n, head_dim)) for _ in range(4))
    v += 0.5
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    for name, x, ref in zip(("dq", "dk", "dv"), grads, _reference_gradients(q, k, v, dout, causal)):
        error = float(cupy.abs(x - ref).max() / cupy.abs(ref).max())
        assert error <= FP32_RTOL, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_runs_float32_on_float16_pieces(head_dim, monkeypatch):
    for direction in ("fwd", "bwd"):
        assert _kernels._variant(direction, np.float32, head_dim, head_dim, False).wgmma == _is_hopper()
        assert not _kernels._variant(direction, np.float32, head_dim, head_dim, False, dropout=object()).wgmma, \
            "float32 with dropout: mma.sync"
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    assert not _kernels._variant("fwd", np.float32, head_dim, head_dim, False).wgmma
