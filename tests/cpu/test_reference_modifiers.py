"""The float64 reference's score modifiers against first principles, finite differences and each other;
cupyflash._modifiers' validation and block_mask_from_dense."""

import math

import numpy as np
import pytest
from helpers.checks import hidden_keys, numerical_gradient
from helpers.modifiers import OPTIONS, alibi_slopes, block_grid, random_options
from scipy.special import logsumexp, softmax

from cupyflash import _modifiers, reference
from cupyflash._modifiers import BLOCK_MASK_TILE, block_mask_from_dense

FD_ATOL = 1e-7  # central differences in float64: truncation ~ step^2, rounding ~ 1e-16 / step
EXACT = dict(rtol=1e-12, atol=1e-14)


def _random(rng, shape):
    return rng.standard_normal(shape)


def _problem(rng, batch, nq, nk, d=4, dv=3):
    return _random(rng, batch + (nq, d)), _random(rng, batch + (nk, d)), _random(rng, batch + (nk, dv))


# ---------------------------------------------------------------------------------------------------
# First principles: one score at a time, straight from the _modifiers docstring
# ---------------------------------------------------------------------------------------------------


def _score(q, k, i, j, scale, causal, options):
    """s_ij of 2-D q, k by the docstring's steps, or None when key j is hidden from query i."""
    nq, nk = q.shape[0], k.shape[0]
    off = nk - nq
    left, right = options.get("window") or (-1, -1)
    mask, block_mask = options.get("mask"), options.get("block_mask")
    if causal and j > i + off:
        return None
    if (left != -1 and j < i + off - left) or (right != -1 and j > i + off + right):
        return None
    if (mask is not None and not mask[i, j]) or (
        block_mask is not None and not block_mask[i // BLOCK_MASK_TILE, j // BLOCK_MASK_TILE]
    ):
        return None
    s = scale * float(q[i] @ k[j])
    if options.get("softcap"):
        s = options["softcap"] * math.tanh(s / options["softcap"])
    if options.get("alibi_slopes") is not None:
        s -= float(options["alibi_slopes"]) * abs(i + off - j)
    if options.get("bias") is not None:
        s += options["bias"][i, j]
    return s


def _row_by_row(q, k, v, causal, scale, options):
    """Attention for 2-D q, k, v one query at a time over the keys it sees: (out, lse)."""
    nq, nk = q.shape[0], k.shape[0]
    out, lse = np.zeros((nq, v.shape[1])), np.full(nq, -np.inf)
    for i in range(nq):
        scores = {j: _score(q, k, i, j, scale, causal, options) for j in range(nk)}
        seen = [j for j, s in scores.items() if s is not None]
        if seen:
            s = np.array([scores[j] for j in seen])
            out[i], lse[i] = softmax(s) @ v[seen], logsumexp(s)
    return out, lse


def _options_2d(rng, which, nq, nk):
    options = random_options(rng, which, (), nq, nk, np.float64)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = np.array(0.3, np.float32)  # batch () has a 0-d slope
    return options


OPTION_SETS = [[name] for name in OPTIONS] + [list(OPTIONS)]
OPTION_IDS = [name for name in OPTIONS] + ["all"]


# Sizes past one 128 x 128 block_mask tile only where there is a block_mask: the loops are slow.
SCORE_BY_SCORE_CASES = [(which, nq, nk) for which in OPTION_SETS for nq, nk in ((1, 1), (5, 9), (9, 5))]
SCORE_BY_SCORE_CASES += [(["block_mask"], 130, 140), (list(OPTIONS), 140, 130)]
SCORE_BY_SCORE_IDS = [f"{w[0] if len(w) == 1 else 'all'}-{nq}-{nk}" for w, nq, nk in SCORE_BY_SCORE_CASES]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which, nq, nk", SCORE_BY_SCORE_CASES, ids=SCORE_BY_SCORE_IDS)
def test_forward_matches_score_by_score(rng, which, nq, nk, causal):
    q, k, v = _problem(rng, (), nq, nk)
    options = _options_2d(rng, which, nq, nk)
    out, lse = reference.attention(q, k, v, causal=causal, scale=0.6, return_lse=True, **options)
    expected_out, expected_lse = _row_by_row(q, k, v, causal, 0.6, options)
    np.testing.assert_allclose(out, expected_out, **EXACT)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Gradients against central differences (dbias and the softcap's tanh included)
# ---------------------------------------------------------------------------------------------------


def _check_gradients(rng, q, k, v, causal, scale, options):
    """Reference gradients of loss = sum(out * dout) against central differences; returns them."""
    dout = _random(rng, reference.attention(q, k, v, causal=causal, scale=scale, **options).shape)

    def loss():
        return np.sum(reference.attention(q, k, v, causal=causal, scale=scale, **options) * dout)

    grads = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale, **options)
    inputs = dict(q=q, k=k, v=v, **({"bias": options["bias"]} if options.get("bias") is not None else {}))
    assert len(grads) == len(inputs)
    for (name, x), grad in zip(inputs.items(), grads):
        assert (grad.shape, grad.dtype) == (x.shape, np.float64), f"d{name}"
        np.testing.assert_allclose(grad, numerical_gradient(loss, x), atol=FD_ATOL, err_msg=f"d{name}")
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(4, 5), (5, 3)])
@pytest.mark.parametrize("which", OPTION_SETS, ids=OPTION_IDS)
def test_backward_matches_finite_differences(rng, which, nq, nk, causal):
    q, k, v = _problem(rng, (2,), nq, nk, d=3, dv=2)
    options = random_options(rng, which, (2,), nq, nk, np.float64)
    if "window" in options:
        options["window"] = (2, 1)
    _check_gradients(rng, q, k, v, causal, 0.7, options)


@pytest.mark.parametrize("softcap", [0.3, 1.0, 20.0])
def test_softcap_backward_matches_finite_differences(rng, softcap):
    """Large scores against a small cap: tanh saturates, and dq, dk carry its derivative 1 - tanh^2."""
    q, k, v = _problem(rng, (2,), 4, 5, d=3, dv=2)
    _check_gradients(rng, q, k, v, True, 1.5, dict(softcap=softcap))


@pytest.mark.parametrize("bias_shape", [(2, 3, 4, 5), (1, 1, 4, 5), (2, 1, 1, 5), (4, 5), (5,), (3, 4, 1)])
def test_dbias_of_broadcast_bias_matches_finite_differences(rng, bias_shape):
    """dbias sums dS over the dims along which the bias was broadcast: what perturbing it measures."""
    q, k, v = _problem(rng, (2, 3), 4, 5, d=3, dv=2)
    options = dict(bias=_random(rng, bias_shape), mask=rng.random((4, 5)) < 0.8, softcap=2.0)
    dbias = _check_gradients(rng, q, k, v, False, None, options)[3]
    assert dbias.shape == bias_shape


def test_bias_constant_along_keys_changes_nothing(rng):
    """A bias (..., Nq, 1) shifts every score of a row alike: same out, and dbias = rowsum(dS) = 0."""
    q, k, v = _problem(rng, (2, 3), 6, 7)
    dout = _random(rng, (2, 3, 6, 3))
    bias = _random(rng, (3, 6, 1))
    np.testing.assert_allclose(reference.attention(q, k, v, bias=bias), reference.attention(q, k, v), **EXACT)
    dbias = reference.attention_backward(dout, q, k, v, bias=bias)[3]
    np.testing.assert_allclose(dbias, 0, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# The options against each other
# ---------------------------------------------------------------------------------------------------


def _everything(q, k, v, dout, causal=False, **options):
    """out, lse, dq, dk, dv (and dbias) of the reference."""
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    return (out, lse, *reference.attention_backward(dout, q, k, v, causal=causal, **options))


def _assert_all_close(xs, ys, names=("out", "lse", "dq", "dk", "dv")):
    for name, x, y in zip(names, xs, ys):
        np.testing.assert_allclose(x, y, **EXACT, err_msg=name)


@pytest.mark.parametrize("nq, nk", [(6, 9), (9, 6), (140, 131)])
def test_window_and_causal(rng, nq, nk):
    """window (-1, 0) is causal; causal folds in as right = min(right, 0); (-1, -1) is no window."""
    q, k, v = _problem(rng, (2,), nq, nk)
    dout = _random(rng, (2, nq, 3))
    causal = _everything(q, k, v, dout, causal=True)
    _assert_all_close(_everything(q, k, v, dout, window=(-1, 0)), causal)
    _assert_all_close(_everything(q, k, v, dout, causal=True, window=(-1, -1)), causal)
    _assert_all_close(_everything(q, k, v, dout, window=(-1, -1)), _everything(q, k, v, dout))
    for left, right in ((3, 2), (0, 5), (4, -1), (2, 0)):
        _assert_all_close(
            _everything(q, k, v, dout, causal=True, window=(left, right)), _everything(q, k, v, dout, window=(left, 0))
        )


def test_window_of_width_one_picks_the_diagonal_key(rng):
    """window (0, 0): query i sees only key i + Nk - Nq, so out is that key's value and lse its score."""
    q, k, v = _problem(rng, (), 4, 7)
    out, lse = reference.attention(q, k, v, scale=0.5, window=(0, 0), return_lse=True)
    np.testing.assert_allclose(out, v[3:], **EXACT)
    np.testing.assert_allclose(lse, 0.5 * np.sum(q * k[3:], axis=-1), **EXACT)


def test_all_true_masks_change_nothing(rng):
    q, k, v = _problem(rng, (2, 3), 130, 200)
    dout = _random(rng, (2, 3, 130, 3))
    masks = dict(mask=np.ones((130, 200), bool), block_mask=np.ones(block_grid(130, 200), bool))
    plain = _everything(q, k, v, dout, causal=True)
    for name, mask in masks.items():
        _assert_all_close(_everything(q, k, v, dout, causal=True, **{name: mask}), plain)


@pytest.mark.parametrize("causal", [False, True])
def test_minus_infinity_bias_is_the_boolean_mask(rng, causal):
    """bias = log(mask) (0 or -inf) gives what mask gives, and dbias is 0 where the mask hides."""
    q, k, v = _problem(rng, (2, 3), 20, 30)
    dout = _random(rng, (2, 3, 20, 3))
    mask = rng.random((3, 20, 30)) < 0.5
    mask[1, 4] = False  # a row that sees no key
    bias = np.where(mask, 0.0, -np.inf)
    with_bias = _everything(q, k, v, dout, causal=causal, bias=bias)
    _assert_all_close(with_bias, _everything(q, k, v, dout, causal=causal, mask=mask))
    dbias = with_bias[5]
    assert np.isfinite(dbias).all() and not dbias[~mask].any()


def test_block_mask_from_dense_with_its_mask_is_the_mask(rng):
    """A mask with empty 128 x 128 tiles: adding its block mask skips them and changes nothing."""
    nq, nk = 300, 270
    mask = rng.random((2, nq, nk)) < 0.7
    mask[0, :128, 128:256] = False
    mask[1, 256:, :] = False
    block_mask = block_mask_from_dense(mask)
    assert not block_mask[0, 0, 1] and not block_mask[1, 2].any() and block_mask.sum() == 2 * 9 - 1 - 3
    q, k, v = _problem(rng, (2,), nq, nk)
    dout = _random(rng, (2, nq, 3))
    _assert_all_close(
        _everything(q, k, v, dout, mask=mask, block_mask=block_mask), _everything(q, k, v, dout, mask=mask)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_probs_are_the_softmax_of_the_scores(rng, causal):
    """attention_probs: rows sum to 1 (0 where no key is seen), P = 0 exactly on the hidden keys
    (written afresh in helpers.checks.hidden_keys), P @ v = out, and log P = s - lse."""
    nq, nk = 140, 150
    q, k, v = _problem(rng, (2, 3), nq, nk)
    options = random_options(rng, OPTIONS, (2, 3), nq, nk, np.float64)
    options["mask"][0, 1, 7] = False
    p = reference.attention_probs(q, k, v, causal=causal, **options)
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    assert (p.shape, p.dtype) == ((2, 3, nq, nk), np.float64)
    hidden = hidden_keys((2, 3), nq, nk, causal, **options)
    assert not p[hidden].any() and (p[~hidden] > 0).all()
    np.testing.assert_allclose(p.sum(axis=-1), np.where(np.isneginf(lse), 0.0, 1.0), **EXACT)
    np.testing.assert_allclose(p @ v, out, **EXACT)


def test_alibi_penalizes_distance_from_the_diagonal(rng):
    """With q = 0 every score is -slope * |i + Nk - Nq - j|: P_ij is proportional to exp of that."""
    nq, nk, heads = 5, 8, 3
    q, k, v = np.zeros((heads, nq, 4)), _random(rng, (heads, nk, 4)), np.eye(nk)
    slopes = alibi_slopes(heads)
    p = reference.attention(q, k, v, alibi_slopes=slopes)
    distance = np.abs(np.arange(nk)[None, :] - np.arange(nq)[:, None] - (nk - nq))
    expected = softmax(-slopes.astype(np.float64)[:, None, None] * distance, axis=-1)
    np.testing.assert_allclose(p, expected, **EXACT)


def test_alibi_slopes_are_used_as_float32(rng):
    q, k, v = _problem(rng, (3,), 6, 7)
    slopes = rng.random(3)
    np.testing.assert_array_equal(
        reference.attention(q, k, v, alibi_slopes=slopes),
        reference.attention(q, k, v, alibi_slopes=slopes.astype(np.float32)),
    )


def test_huge_softcap_changes_almost_nothing(rng):
    """softcap c: c tanh(s / c) = s - s^3 / (3 c^2) + ...: with c = 1e4 and |s| < 5, scores move < 1e-7."""
    q, k, v = _problem(rng, (2,), 6, 7)
    np.testing.assert_allclose(
        reference.attention(q, k, v, softcap=1e4), reference.attention(q, k, v), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("bias_dtype", [np.float16, np.float32, np.float64])
def test_bias_of_any_float_dtype(rng, bias_dtype):
    """The reference takes any floating-point bias; dbias is float64 of the bias's shape."""
    q, k, v = _problem(rng, (2,), 6, 7)
    bias = _random(rng, (6, 7)).astype(bias_dtype)
    out = reference.attention(q, k, v, bias=bias)
    np.testing.assert_allclose(out, reference.attention(q, k, v, bias=bias.astype(np.float64)), **EXACT)
    dbias = reference.attention_backward(_random(rng, out.shape), q, k, v, bias=bias)[3]
    assert (dbias.shape, dbias.dtype) == ((6, 7), np.float64)


# ---------------------------------------------------------------------------------------------------
# Rows that see no key
# ---------------------------------------------------------------------------------------------------


def test_rows_that_see_no_key(rng):
    """Rows hidden by mask, window, block_mask or causal: out 0, lse -inf, zero dq and dbias, no NaN."""
    nq, nk = 300, 140
    q, k, v = _problem(rng, (2,), nq, nk)
    dout = _random(rng, (2, nq, 3))
    mask = np.ones((2, nq, nk), bool)
    mask[0, 200:210] = False
    block_mask = np.ones((2,) + block_grid(nq, nk), bool)
    block_mask[1, 1] = False  # queries 128..255 of batch entry 1
    options = dict(mask=mask, block_mask=block_mask, window=(30, 5), bias=_random(rng, (nq, nk)), softcap=3.0)
    out, lse, dq, dk, dv, dbias = _everything(q, k, v, dout, causal=True, **options)
    blind = np.zeros((2, nq), bool)
    blind[:, : nq - nk] = blind[0, 200:210] = blind[1, 128:256] = True  # causal with Nq > Nk: the first rows
    assert not out[blind].any() and np.isneginf(lse[blind]).all() and not dq[blind].any()
    assert np.isfinite(lse[~blind]).all()
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv, dbias))
    assert not dbias[blind[0] & blind[1]].any()  # the bias (Nq, Nk) is shared by the two batch entries


@pytest.mark.parametrize("nq, nk", [(0, 3), (3, 0), (0, 0)])
def test_empty_sequences(nq, nk):
    q, k, v = np.zeros((2, nq, 4)), np.zeros((2, nk, 4)), np.zeros((2, nk, 3))
    options = dict(
        window=(1, 1),
        softcap=2.0,
        alibi_slopes=np.ones(2, np.float32),
        bias=np.zeros((nq, nk)),
        mask=np.ones((nq, nk), bool),
        block_mask=np.ones(block_grid(nq, nk), bool),
    )
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    assert (out.shape, lse.shape) == ((2, nq, 3), (2, nq)) and not out.any() and np.isneginf(lse).all()
    grads = reference.attention_backward(np.ones((2, nq, 3)), q, k, v, **options)
    assert all(g.shape == x.shape and not g.any() for g, x in zip(grads, (q, k, v, options["bias"])))


# ---------------------------------------------------------------------------------------------------
# Validation (cupyflash._modifiers.resolve, through the reference and directly) and block_mask_from_dense
# ---------------------------------------------------------------------------------------------------

NQ, NK = 130, 260  # a block_mask grid of 2 x 3
BAD_OPTIONS = [
    (dict(mask=np.ones((NQ, NK), np.int8)), TypeError, "mask must be a boolean array"),
    (dict(mask=np.ones((NQ, NK), np.float32)), TypeError, "mask must be a boolean array"),
    (dict(mask=[[True] * NK] * NQ), TypeError, "mask must be a numpy.ndarray"),
    (dict(mask=np.ones((NQ + 1, NK), bool)), ValueError, "mask has shape"),
    (dict(bias=np.ones((NQ, NK + 1))), ValueError, r"bias has shape \(130, 261\)"),
    (dict(bias=np.ones((4, 1, NQ, NK))), ValueError, "bias has shape"),
    (dict(bias=np.ones((NQ, NK), np.int32)), TypeError, "bias must be a floating-point array"),
    (dict(window=(-2, 0)), ValueError, "window left must be >= -1"),
    (dict(window=(0, -5)), ValueError, "window right must be >= -1"),
    (dict(window=(0, 1.5)), TypeError, "window right must be an integer"),
    (dict(window=(True, 0)), TypeError, "window left must be an integer"),
    (dict(window=(1, 2, 3)), TypeError, "window must be a pair"),
    (dict(window=4), TypeError, "window must be a pair"),
    (dict(window="ab"), TypeError, "window must be a pair"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=True), TypeError, "softcap must be a real number"),
    (dict(softcap="30"), TypeError, "softcap must be a real number"),
    (dict(block_mask=np.ones((3, 3), bool)), ValueError, r"block_mask has shape \(3, 3\)"),
    (dict(block_mask=np.ones((NQ, NK), bool)), ValueError, "block_mask has shape"),
    (dict(block_mask=np.ones((2, 3), np.uint8)), TypeError, "block_mask must be a boolean array"),
    (dict(alibi_slopes=np.ones(4, np.float32)), ValueError, r"alibi_slopes has shape \(4,\)"),
    (dict(alibi_slopes=np.ones((3, 1), np.float32)), ValueError, "alibi_slopes has shape"),
    (dict(alibi_slopes=np.ones(3, np.int32)), TypeError, "alibi_slopes must be a floating-point array"),
    (dict(alibi_slopes=[0.5, 0.25, 0.125]), TypeError, "alibi_slopes must be a numpy.ndarray"),
]


@pytest.mark.parametrize("options, error, match", BAD_OPTIONS)
def test_bad_options_raise_naming_the_argument(options, error, match):
    q, k, v = np.zeros((2, 3, NQ, 4)), np.zeros((2, 3, NK, 4)), np.zeros((2, 3, NK, 4))
    with pytest.raises(error, match=match):
        reference.attention(q, k, v, **options)
    with pytest.raises(error, match=match):
        reference.attention_backward(np.zeros((2, 3, NQ, 4)), q, k, v, **options)
    if "bias" not in options or options["bias"].dtype.kind == "f":
        with pytest.raises(error, match=match):
            _modifiers.resolve(np, np.float64, (2, 3), NQ, NK, **options)


def test_resolve_bias_dtype_is_the_inputs_or_float32():
    for dtype in (np.float16, np.float32):
        assert _modifiers.resolve(np, np.float16, (), 3, 4, bias=np.zeros((3, 4), dtype)).bias.dtype == dtype
    with pytest.raises(TypeError, match="bias has dtype float64; expected the inputs' dtype float16"):
        _modifiers.resolve(np, np.float16, (), 3, 4, bias=np.zeros((3, 4)))


def test_resolve_is_none_when_every_option_is_off():
    assert _modifiers.resolve(np, np.float16, (2,), 3, 4) is None
    assert _modifiers.resolve(np, np.float16, (2,), 3, 4, window=(-1, -1), softcap=0) is None
    assert _modifiers.resolve(np, np.float16, (2,), 3, 4, window=(-1, 0)) is not None


def test_resolve_broadcasts_without_copying():
    bias, mask = np.zeros((1, 5), np.float32), np.ones((3, 1), bool)
    options = dict(
        bias=bias,
        mask=mask,
        softcap=3,
        alibi_slopes=np.ones(4),
        block_mask=np.ones((1, 1), bool),
        window=(np.int64(2), 0),
    )
    mods = _modifiers.resolve(np, np.float16, (2, 4), 3, 5, **options)
    assert mods.bias.shape == mods.mask.shape == (2, 4, 3, 5) and mods.bias_shape == (1, 5)
    assert mods.block_mask.shape == (2, 4, 1, 1) and mods.alibi_slopes.shape == (2, 4)
    assert mods.alibi_slopes.dtype == np.float32 and mods.softcap == 3.0 and mods.window == (2, 0)
    assert np.shares_memory(mods.bias, bias) and mods.bias.strides[:3] == (0, 0, 0)
    assert np.shares_memory(mods.mask, mask)


@pytest.mark.parametrize(
    "window, causal, expected",
    [
        ((-1, -1), False, (-1, -1)),
        ((-1, -1), True, (-1, 0)),
        ((5, 3), True, (5, 0)),
        ((5, -1), True, (5, 0)),
        ((5, 3), False, (5, 3)),
        ((0, 0), True, (0, 0)),
    ],
)
def test_window_with_causal(window, causal, expected):
    mods = _modifiers.resolve(np, np.float32, (), 4, 4, window=window, softcap=1.0)
    assert mods.window_with_causal(causal) == expected


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (130, 257), (256, 129), (2, 3, 129, 300)])
def test_block_mask_from_dense_is_any_per_tile(rng, shape):
    mask = rng.random(shape) < 0.001  # sparse: many empty tiles
    block_mask = block_mask_from_dense(mask)
    grid = block_grid(*shape[-2:])
    assert (block_mask.shape, block_mask.dtype) == (shape[:-2] + grid, np.bool_)
    for a, b in np.ndindex(grid):
        tile = mask[..., a * 128 : (a + 1) * 128, b * 128 : (b + 1) * 128]
        np.testing.assert_array_equal(block_mask[..., a, b], tile.any(axis=(-2, -1)))


@pytest.mark.parametrize(
    "mask, kwargs, error, match",
    [
        (np.ones((4, 4), np.int8), {}, TypeError, "mask must be a boolean array"),
        (np.ones(4, bool), {}, TypeError, r"mask must be a numpy or cupy array of shape \(..., Nq, Nk\)"),
        ([[True]], {}, TypeError, "mask must be a numpy or cupy array"),
        (np.ones((4, 4), bool), dict(block=64), ValueError, "block must be 128"),
    ],
)
def test_block_mask_from_dense_rejects(mask, kwargs, error, match):
    with pytest.raises(error, match=match):
        block_mask_from_dense(mask, **kwargs)
