"""float32 on Hopper's 16-bit warpgroup products: inputs split into float16 pieces
(cupyflash/_cuda/f32_pieces.py, cuda_src/split_f32.cu, pieces.cuh) and the forward and backward that run on
them. Needs a GPU; the accuracy tests hold on every GPU (elsewhere they check the mma.sync path), the variant
test says which path a Hopper GPU takes (the selection itself: tests/cpu/test_variants.py).

    python -m pytest -m gpu tests/gpu/test_gpu_split.py
"""

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import _dropout, reference
from cupyflash._cuda import f32_pieces, tile_policy
from cupyflash._cuda.compile import current_device
from cupyflash._cuda.variants import Features

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

FP32_RTOL = 1e-5


def _random(rng, shape, dtype=np.float32):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def _is_hopper():
    return int(cupy.cuda.Device().compute_capability) == 90


def test_pieces_hold_each_element_to_22_bits(rng):
    """Each block of 128 rows gets its own power of two: slices of very different magnitudes, row blocks of
    different magnitudes within a slice, an all-zero slice and an all-zero block; 60 columns padded to 64."""
    x = _random(rng, (4, 300, 60))
    x[1] *= 3e-7
    x[2] *= 5e5
    x[0, 128:256] *= 1e-6
    x[1, 256:] = 0
    x[3] = 0
    (pieces,), exponents = f32_pieces.split([x], 64, (4,))
    assert pieces.shape == (4, 300, 128) and pieces.dtype == np.float16
    assert exponents.shape == (4, 3, 4) and exponents.dtype == np.int32
    p = cupy.asnumpy(pieces).astype(np.float64)
    e = cupy.asnumpy(exponents)[..., 0]
    xs = cupy.asnumpy(x).astype(np.float64)
    assert np.all(p[..., 60:64] == 0) and np.all(p[..., 124:] == 0), "padding columns must be zero"
    for s in range(4):
        for blk in range(3):
            rows = slice(128 * blk, 128 * (blk + 1))
            largest = np.abs(xs[s, rows]).max() * 2.0 ** e[s, blk]
            if largest == 0:
                assert e[s, blk] == 0 and np.all(p[s, rows] == 0), "an all-zero block splits into zeros, e = 0"
                continue
            assert 2**14 <= largest < 2**15, f"slice {s} block {blk}: largest scaled magnitude {largest}"
            scaled = xs[s, rows] * 2.0 ** e[s, blk]
            rebuilt = p[s, rows, :60] + p[s, rows, 64:124]
            # 22 significant bits for elements down to 2^-3 of float16's normal range; an absolute floor below.
            bound = np.maximum(np.abs(scaled) * 2.0**-22, 2.0**-24)
            assert np.all(np.abs(rebuilt - scaled) <= bound), f"slice {s} block {blk}: pieces do not rebuild x * 2^e"
    assert e[0, 1] > e[0, 0] + 15, "a block of small rows gets its own, larger power of two"


def test_pieces_keep_broadcast_dims_unmaterialized(rng):
    """Grouped heads: k shared by 6 query heads is split once; its exponents reach all 12 batch entries.
    A None input (the forward's q, split by the kernel itself) is skipped."""
    q = _random(rng, (2, 6, 40, 64))
    base = _random(rng, (2, 1, 150, 64))
    base[1] *= 1e4
    base[0, :, 128:] *= 1e-3
    k = cupy.broadcast_to(base, (2, 6, 150, 64))
    (q_pieces, k_pieces), exponents = f32_pieces.split([q, k], 64, (2, 6))
    assert q_pieces.shape == (2, 6, 40, 128) and k_pieces.shape == (2, 6, 150, 128) and k_pieces.strides[1] == 0
    e = cupy.asnumpy(exponents).reshape(2, 6, 2, 4)
    assert np.all(e[0, :, :, 1] == e[0, 0, :, 1]) and np.all(e[1, :, :, 1] == e[1, 0, :, 1])
    assert e[0, 0, 0, 1] > e[1, 0, 0, 1] and e[0, 0, 1, 1] > e[0, 0, 0, 1]
    largest = np.abs(cupy.asnumpy(q)).max(axis=(-2, -1))
    assert np.all((2.0**14 <= largest * 2.0 ** e[..., 0, 0]) & (largest * 2.0 ** e[..., 0, 0] < 2.0**15))
    (none, k_only), exponents = f32_pieces.split([None, k], 64, (2, 6), rows=300)
    assert none is None and cupy.array_equal(k_only, k_pieces)
    assert exponents.shape == (12, 3, 4), "blocks cover the rows asked for"
    assert np.array_equal(cupy.asnumpy(exponents).reshape(2, 6, 3, 4)[..., :2, 1], e[..., 1])
    with pytest.raises(ValueError, match="width"):
        f32_pieces.split([k], 96, (2, 6))
    with pytest.raises(ValueError, match="rows"):
        f32_pieces.split([k], 64, (2, 6), rows=100)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("nq, nk", [(389, 517), (517, 131)])
def test_row_blocks_of_very_different_magnitudes(rng, head_dim, causal, nq, nk):
    """Rows of q, k, v, dout whose magnitudes change by up to 1e6 from one block of 128 rows to the next
    (and within the forward's q tiles): forward and gradients against float64, relative to each output's
    largest magnitude. Every tile carries its own row block's power of two; with more queries than keys
    the exponents still cover every query block (max(Nq, Nk) rows per batch entry)."""
    q, k, v, dout = (_random(rng, (1, 2, n, head_dim)) for n in (nq, nk, nk, nq))
    for x, n in ((q, nq), (k, nk), (v, nk), (dout, nq)):
        scales = 10.0 ** rng.uniform(-3, 3, size=(1, 2, -(-n // 64), 1, 1))
        x *= cupy.asarray(np.repeat(scales, 64, axis=2)[:, :, :n].reshape(1, 2, n, 1).astype(np.float32))
    q *= 1.0 / float(cupy.abs(q).max())  # scores of order one: softmax not saturated
    k *= 4.0 / float(cupy.abs(k).max())
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    ref_out, ref_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=causal, return_lse=True)
    error = np.abs(cupy.asnumpy(out) - ref_out).max() / np.abs(ref_out).max()
    assert error <= FP32_RTOL, f"out: relative error {error:.3g}"
    seen = np.isfinite(ref_lse)
    assert np.abs(cupy.asnumpy(lse)[seen] - ref_lse[seen]).max() <= FP32_RTOL * np.abs(ref_lse[seen]).max()
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    for name, x, ref in zip(("dq", "dk", "dv"), grads, _reference_gradients(q, k, v, dout, causal)):
        error = float(cupy.abs(x - ref).max() / cupy.abs(ref).max())
        assert error <= FP32_RTOL, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [40, 64, 100, 128])
def test_heads_of_very_different_magnitudes_keep_float32_accuracy(rng, head_dim, causal):
    """Each head's row blocks get their own powers of two, so every head keeps float32 accuracy relative to
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
    row_sum = p.sum(-1, keepdims=True)
    ref_out = cupy.einsum("bhnm,bhmd->bhnd", p / row_sum, v64)
    ref_lse = (m + cupy.log(row_sum))[..., 0]
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
    row_sum = p.sum(-1, keepdims=True)
    p /= cupy.where(row_sum > 0, row_sum, 1)
    out = cupy.einsum("bhnm,bhmd->bhnd", p, v)
    dp = cupy.einsum("bhnd,bhmd->bhnm", dout, v)
    ds = p * (dp - (dout * out).sum(-1, keepdims=True)) / math.sqrt(q.shape[-1])
    return (
        cupy.einsum("bhnm,bhmd->bhnd", ds, k),
        cupy.einsum("bhnm,bhnd->bhmd", ds, q),
        cupy.einsum("bhnm,bhnd->bhmd", p, dout),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [40, 64, 100, 128])
def test_backward_of_heads_of_very_different_magnitudes(rng, head_dim, causal):
    """Gradients per head against float64, with q, k, v and dout heads scaled by up to 1e+-9: each block of
    128 rows of an input and each row of P and dS in registers gets its own power of two. Per head, float32's own
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
    def path(direction, dropout=None):
        features = Features.of(direction, np.dtype(np.float32), head_dim, head_dim, False, None, dropout)
        return tile_policy.dense(features, current_device()).path

    monkeypatch.delenv("CUPYFLASH_NO_WGMMA", raising=False)
    for direction in ("fwd", "bwd"):
        assert path(direction) == ("pieces" if _is_hopper() else "mma")
        assert path(direction, _dropout.Dropout(0.1, 1)) == "mma", "float32 with dropout: mma.sync"
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    assert path("fwd") == "mma"
