"""The float64 reference against first principles: per-row softmax loops and finite differences."""

import numpy as np
import pytest
from helpers.checks import numerical_gradient
from scipy.special import logsumexp, softmax

from cupyflash import reference

FD_ATOL = 1e-7  # central differences in float64: truncation ~ step^2, rounding ~ 1e-16 / step


def _random(rng, shape):
    return rng.standard_normal(shape)


def _row_by_row(q, k, v, causal, scale):
    """Attention for 2-D q, k, v one query at a time over the keys it sees: (out, lse)."""
    nq, nk = q.shape[0], k.shape[0]
    out, lse = np.zeros((nq, v.shape[1])), np.full(nq, -np.inf)
    for i in range(nq):
        seen = [j for j in range(nk) if not causal or j <= i + nk - nq]
        if seen:
            scores = scale * (k[seen] @ q[i])
            out[i], lse[i] = softmax(scores) @ v[seen], logsumexp(scores)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(1, 1), (3, 7), (7, 3), (6, 6)])
def test_forward_matches_row_by_row_softmax(rng, causal, nq, nk):
    q, k, v = _random(rng, (nq, 5)), _random(rng, (nk, 5)), _random(rng, (nk, 4))
    out, lse = reference.attention(q, k, v, causal=causal, scale=0.6, return_lse=True)
    expected_out, expected_lse = _row_by_row(q, k, v, causal, 0.6)
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(1, 1), (3, 4), (4, 3), (5, 2)])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_backward_matches_finite_differences(rng, causal, nq, nk, scale):
    q, k, v = _random(rng, (2, nq, 3)), _random(rng, (2, nk, 3)), _random(rng, (2, nk, 2))
    _check_gradients(rng, q, k, v, causal, scale)


@pytest.mark.parametrize("causal", [False, True])
def test_broadcast_gradients_match_finite_differences(rng, causal):
    """k is shared by 3 heads and v by 2 batches: their gradients sum over the broadcast dims."""
    q, k, v = _random(rng, (2, 3, 4, 3)), _random(rng, (2, 1, 5, 3)), _random(rng, (5, 2))
    dq, dk, dv = _check_gradients(rng, q, k, v, causal, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def _check_gradients(rng, q, k, v, causal, scale):
    """Reference gradients of loss = sum(out * dout) against central differences; returns them."""
    out = reference.attention(q, k, v, causal=causal, scale=scale)
    dout = _random(rng, out.shape)

    def loss():
        return np.sum(reference.attention(q, k, v, causal=causal, scale=scale) * dout)

    grads = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale)
    for name, x, grad in zip("qkv", (q, k, v), grads):
        np.testing.assert_allclose(grad, numerical_gradient(loss, x), atol=FD_ATOL, err_msg=f"d{name}")
    return grads


def test_rows_that_see_no_key(rng):
    """Causal with Nq > Nk: the first Nq - Nk rows see nothing: out 0, lse -inf, zero gradients, no NaN."""
    nq, nk = 6, 2
    q, k, v = _random(rng, (nq, 3)), _random(rng, (nk, 3)), _random(rng, (nk, 3))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = reference.attention_backward(_random(rng, out.shape), q, k, v, causal=True)
    blind = slice(0, nq - nk)
    assert np.all(out[blind] == 0) and np.all(np.isneginf(lse[blind])) and np.all(dq[blind] == 0)
    assert np.isfinite(lse[nq - nk :]).all()
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))


def test_rows_that_see_no_key_leave_key_gradients_alone(rng):
    """Blind rows add nothing to dk, dv: the same as dropping those queries."""
    nq, nk = 6, 2
    q, k, v = _random(rng, (nq, 3)), _random(rng, (nk, 3)), _random(rng, (nk, 3))
    dout = _random(rng, (nq, 3))
    _, dk, dv = reference.attention_backward(dout, q, k, v, causal=True)
    _, dk_seen, dv_seen = reference.attention_backward(dout[nq - nk :], q[nq - nk :], k, v, causal=True)
    np.testing.assert_allclose(dk, dk_seen, rtol=1e-13)
    np.testing.assert_allclose(dv, dv_seen, rtol=1e-13)


@pytest.mark.parametrize(
    "nq, nk, mask", [(2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])]
)
def test_causal_mask_is_bottom_right_aligned(rng, nq, nk, mask):
    """With v = identity, out is the attention matrix P: its support is the mask drawn in the docstring."""
    out = reference.attention(_random(rng, (nq, 4)), _random(rng, (nk, 4)), np.eye(nk), causal=True)
    np.testing.assert_array_equal(out > 0, np.array(mask, dtype=bool))


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = _random(rng, (4, 9)), _random(rng, (5, 9)), _random(rng, (5, 2))
    np.testing.assert_array_equal(reference.attention(q, k, v), reference.attention(q, k, v, scale=1 / 3))


@pytest.mark.parametrize("nq, nk", [(0, 3), (3, 0), (0, 0)])
def test_empty_sequences(nq, nk):
    q, k, v = np.zeros((2, nq, 4)), np.zeros((2, nk, 4)), np.zeros((2, nk, 3))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert (out.shape, lse.shape) == ((2, nq, 3), (2, nq)) and not out.any() and np.isneginf(lse).all()
    grads = reference.attention_backward(np.ones((2, nq, 3)), q, k, v)
    assert all(g.shape == x.shape and not g.any() for g, x in zip(grads, (q, k, v)))
