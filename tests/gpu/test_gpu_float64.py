"""float64 on the GPU: the FP64 tensor-core kernels (mma.m8n8k4.f64, float64 softmax and accumulation)
against the float64 reference, every result within 1e-12 of the reference's largest magnitude.

Inputs are float64 standard normals with all 53 bits of mantissa (not float32 values widened), outputs and
workspaces are allocated filled with NaN (helpers.gpu.nan_filled_allocations), and every option the float32
kernels take is covered: causal, awkward sizes, every head dim, grouped heads, each score modifier with
dbias, dropout, packed variable-length batches and attention_probs.
"""

import numpy as np
import pytest
from helpers.gpu import nan_filled_allocations
from helpers.modifiers import alibi_slopes, block_grid

import cupyflash
from cupyflash import reference

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

RTOL = 1e-12
HEAD_DIMS = (16, 40, 64, 96, 128, 160, 192, 256)
SIZES = (((2, 3), 1, 1), ((2, 3), 113, 203), ((2, 3), 203, 113), ((1, 2), 1023, 1024))


def _normal(rng, shape):
    return cupy.asarray(rng.standard_normal(shape))


def _problem(rng, batch, nq, nk, d, dv=None, kv_batch=None):
    kv_batch = batch if kv_batch is None else kv_batch
    dv = d if dv is None else dv
    out_batch = np.broadcast_shapes(batch, kv_batch)
    return (
        _normal(rng, batch + (nq, d)),
        _normal(rng, kv_batch + (nk, d)),
        _normal(rng, kv_batch + (nk, dv)),
        _normal(rng, out_batch + (nq, dv)),
    )


def _assert_close(name, x, ref):
    assert x.dtype == np.float64, f"{name} has dtype {x.dtype}, expected float64"
    x = cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x
    assert x.shape == ref.shape, f"{name}: shape {x.shape}, expected {ref.shape}"
    assert not np.isnan(x).any(), f"{name} has NaN (an element never written, or a 0/0)"
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(x), finite), f"{name}: infinite elements differ from the reference"
    size = float(np.max(np.abs(ref[finite]), initial=0.0))
    error = float(np.max(np.abs(x[finite] - ref[finite]), initial=0.0))
    bound = RTOL * max(size, 1.0 if name == "lse" else size) if size > 0 else 1e-14
    assert error <= bound, (
        f"{name}: max error {error:.3g} > {bound:.3g} (max|ref| {size:.3g}, relative {error / max(size, 1e-300):.3g})"
    )


def _forward_backward(q, k, v, dout, **options):
    with nan_filled_allocations():
        out, lse = cupyflash.attention_forward(q, k, v, **options)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **options)
    return out, lse, grads


def _check(q, k, v, dout, results, **options):
    out, lse, grads = results
    host = [cupy.asnumpy(x) for x in (q, k, v, dout)]
    ref_options = {name: cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x for name, x in options.items()}
    ref_out, ref_lse = reference.attention(*host[:3], return_lse=True, **ref_options)
    ref_grads = reference.attention_backward(host[3], *host[:3], **ref_options)
    _assert_close("out", out, ref_out)
    _assert_close("lse", lse, ref_lse)
    for name, x, ref in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        _assert_close(name, x, ref)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("batch, nq, nk", SIZES, ids=lambda x: str(x))
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_matches_reference(rng, d, batch, nq, nk, causal):
    q, k, v, dout = _problem(rng, batch, nq, nk, d)
    _check(q, k, v, dout, _forward_backward(q, k, v, dout, causal=causal), causal=causal)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_grouped_heads_and_other_value_dim(rng, causal):
    """k, v broadcast over 3 query heads each (stride 0, dk and dv summed), Dv != D, a custom scale."""
    q, k, v, dout = _problem(rng, (2, 2, 3), 77, 190, 64, dv=40, kv_batch=(2, 2, 1))
    options = dict(causal=causal, scale=0.3)
    _check(q, k, v, dout, _forward_backward(q, k, v, dout, **options), **options)


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_every_modifier_with_dropout(rng, d, causal):
    """window + softcap + ALiBi + bias (with dbias) + mask + block_mask + dropout, together."""
    batch, nq, nk = (2, 3), 300, 333
    q, k, v, dout = _problem(rng, batch, nq, nk, d)
    options = dict(
        causal=causal,
        window=(150, 40),
        softcap=2.0,
        alibi_slopes=cupy.asarray(alibi_slopes(3)),
        bias=_normal(rng, batch + (nq, nk)),
        mask=cupy.asarray(rng.random(batch + (nq, nk)) < 0.8),
        block_mask=cupy.asarray(rng.random(batch + block_grid(nq, nk)) < 0.7),
        dropout_p=0.15,
        dropout_seed=int(rng.integers(2**63)),
    )
    _check(q, k, v, dout, _forward_backward(q, k, v, dout, **options), **options)


@pytest.mark.parametrize(
    "bias_shape", ((1, 1, 200, 256), (2, 1, 1, 256), (2, 3, 200, 256)), ids=("shared", "per-key", "full")
)
def test_bias_gradient(rng, bias_shape):
    """dbias summed in float64 over broadcast dims (atomic adds), or stored in pairs (a full bias)."""
    q, k, v, dout = _problem(rng, (2, 3), 200, 256, 32)
    options = dict(bias=_normal(rng, bias_shape))
    _check(q, k, v, dout, _forward_backward(q, k, v, dout, **options), **options)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_dropout(rng, causal):
    q, k, v, dout = _problem(rng, (2, 2), 257, 300, 128)
    options = dict(causal=causal, dropout_p=0.3, dropout_seed=12345)
    _check(q, k, v, dout, _forward_backward(q, k, v, dout, **options), **options)


def test_probs(rng):
    q, k, _, _ = _problem(rng, (2, 2), 150, 170, 64)
    options = dict(causal=True, softcap=3.0, alibi_slopes=cupy.asarray(alibi_slopes(2)))
    p = cupyflash.attention_probs(q, k, k, **options)
    host_options = {n: cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x for n, x in options.items()}
    ref = reference.attention_probs(q.get(), k.get(), k.get(), **host_options)
    _assert_close("probs", p, ref)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_varlen(rng, causal):
    """A packed batch with an empty sequence, grouped heads and dropout."""
    lengths_q, lengths_k = np.array([37, 0, 300, 129]), np.array([50, 20, 260, 129])
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q, k, v = (_normal(rng, (int(n), h, 64)) for n, h in ((cu_q[-1], 4), (cu_k[-1], 2), (cu_k[-1], 2)))
    dout = _normal(rng, q.shape)
    options = dict(causal=causal, dropout_p=0.1, dropout_seed=7)
    with nan_filled_allocations():
        out, lse = cupyflash.attention_varlen_forward(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), **options)
        grads = cupyflash.attention_varlen_backward(
            dout, q, k, v, out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k), **options
        )
    host = [x.get() for x in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention_varlen(*host[:3], cu_q, cu_k, return_lse=True, **options)
    ref_grads = reference.attention_varlen_backward(host[3], *host[:3], cu_q, cu_k, **options)
    _assert_close("out", out, ref_out)
    _assert_close("lse", lse, ref_lse)
    for name, x, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(name, x, ref)


def test_attention_one_call(rng):
    """The NumPy-like entry point: float64 in, float64 out, no lse."""
    q, k, v, _ = _problem(rng, (3,), 100, 120, 96)
    out = cupyflash.attention(q, k, v, causal=True)
    _assert_close("out", out, reference.attention(q.get(), k.get(), v.get(), causal=True))
