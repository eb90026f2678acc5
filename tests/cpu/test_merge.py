"""merge_attention_states and merge_attention_states_stacked with NumPy arrays: attention over disjoint key
sets merged equals attention over their union; rows that a part did not see are exact; argument errors.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import max_abs
from helpers.problems import random_array

import cupyflash
from cupyflash import reference

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
# The merge adds at most one rounding of out to the dtype (a unit in the last place, relative to max|out|)
# and float32 (float64) arithmetic on lse to what the parts already carry.
OUT_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 1e-6, "float64": 1e-14}
LSE_RTOL = {"float16": 1e-6, "bfloat16": 1e-6, "float32": 1e-6, "float64": 1e-14}
B, H, N, NK, D, DV = 2, 3, 17, 50, 16, 24


def _lse_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _parts(rng, dtype, splits, causal=False):
    """q, k, v of one problem and the (out, lse) of cupyflash.attention_forward over each key range of
    ``splits`` (boundaries 0 < ... < NK). Causal parts are bottom-right aligned to the whole key range."""
    q = random_array(rng, (B, H, N, D), dtype)
    k, v = random_array(rng, (B, H, NK, D), dtype), random_array(rng, (B, H, NK, DV), dtype)
    bounds = [0, *splits, NK]
    parts = []
    for j0, j1 in zip(bounds[:-1], bounds[1:]):
        parts.append(cupyflash.attention_forward(q, k[..., j0:j1, :], v[..., j0:j1, :], window=_window(j1, causal)))
    return q, k, v, parts


def _window(j1, causal):
    """The whole problem's causal mask (query i sees key j <= i + NK - N) as the window of the part that
    ends at key j1: that part's own diagonal sits NK - j1 keys to the left of the whole's."""
    return (-1, NK - j1) if causal else None


def _assert_close(name, x, ref, rtol):
    seen = np.isfinite(ref)
    np.testing.assert_array_equal(np.isneginf(x), np.isneginf(ref), err_msg=f"{name}: -inf in other rows")
    error, size = max_abs(x.astype(np.float64)[seen] - ref[seen]), max(1.0, max_abs(ref[seen]))
    assert error <= rtol * size, f"{name}: max error {error:.3g} > {rtol * size:.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_two_halves_make_the_whole(rng, dtype, causal):
    """Attention over keys 0..39 and 40..49 merged is attention over all 50: within what the parts' own
    errors (against the float64 reference) and one rounding allow. Causal: the first rows see no key of the
    second part (lse -inf there)."""
    q, k, v, ((out_a, lse_a), (out_b, lse_b)) = _parts(rng, dtype, [40], causal)
    out, lse = cupyflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert (out.dtype, lse.dtype, out.shape, lse.shape) == (dtype, _lse_dtype(dtype), out_a.shape, lse_a.shape)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    if causal:
        assert np.isneginf(lse_b).any() and not np.isneginf(lse).any()
    part_error = max(
        max_abs(o.astype(np.float64) - r) for o, r in zip((out_a, out_b), _reference_parts(q, k, v, [40], causal))
    )
    _assert_close("out", out, ref_out, OUT_RTOL[np.dtype(dtype).name] + part_error / max_abs(ref_out))
    _assert_close("lse", lse, ref_lse, LSE_RTOL[np.dtype(dtype).name])


def _reference_parts(q, k, v, splits, causal):
    """The float64 reference's out over each key range (0 where a row sees none of it)."""
    bounds = [0, *splits, NK]
    outs = []
    for j0, j1 in zip(bounds[:-1], bounds[1:]):
        outs.append(reference.attention(q, k[..., j0:j1, :], v[..., j0:j1, :], window=_window(j1, causal)))
    return outs


def test_float64_reference_parts_merge_to_the_reference(rng):
    """float64 end to end: the merge of the reference's parts is the reference, to float64 rounding."""
    q, k, v = (rng.standard_normal((B, H, n, d)) for n, d in ((N, D), (NK, D), (NK, DV)))
    (out_a, lse_a), (out_b, lse_b) = (
        reference.attention(q, k[..., s, :], v[..., s, :], return_lse=True) for s in (slice(0, 33), slice(33, NK))
    )
    out, lse = cupyflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    _assert_close("out", out, ref_out, 1e-14)
    _assert_close("lse", lse, ref_lse, 1e-14)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_side_that_saw_no_key_is_exact(rng, dtype):
    """Where one lse is -inf, out and lse are the other side's bit for bit, whatever that side's out holds
    (NaN, infinities, garbage); where both are -inf, out 0 and lse -inf."""
    out_a, out_b = random_array(rng, (B, H, N, DV), dtype), random_array(rng, (B, H, N, DV), dtype)
    lse_a, lse_b = (rng.standard_normal((B, H, N)).astype(_lse_dtype(dtype)) for _ in range(2))
    a_blind, b_blind = rng.random((B, H, N)) < 0.3, rng.random((B, H, N)) < 0.3
    for out, lse, blind in ((out_a, lse_a, a_blind), (out_b, lse_b, b_blind)):
        lse[blind] = -np.inf
        out[blind] = np.array([np.nan, np.inf, -np.inf, 7.0] * (DV // 4), dtype=dtype)
    for first, second in (((out_a, lse_a), (out_b, lse_b)), ((out_b, lse_b), (out_a, lse_a))):
        out, lse = cupyflash.merge_attention_states(*first, *second)
        only_first = np.isneginf(second[1]) & ~np.isneginf(first[1])
        np.testing.assert_array_equal(out[only_first].view(np.uint8), first[0][only_first].view(np.uint8))
        np.testing.assert_array_equal(lse[only_first], first[1][only_first])
        neither = a_blind & b_blind
        assert neither.any() and not out[neither].any() and np.isneginf(lse[neither]).all()
        assert np.isfinite(out[~neither].astype(np.float64)).all() and np.isfinite(lse[~neither]).all()


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_an_infinite_or_nan_lse_makes_the_row_nan(rng, bad):
    out_a, out_b = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal(4).astype(np.float32) for _ in range(2))
    lse_a[1], lse_b[2], lse_b[3] = bad, bad, -np.inf
    with np.errstate(invalid="ignore"):  # inf - inf: the very NaN this test asks for
        out, lse = cupyflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert np.isnan(out[1:3]).all() and np.isnan(lse[1:3]).all()
    np.testing.assert_array_equal(out[3], out_a[3])
    assert np.isfinite(out[[0, 3]]).all() and np.isfinite(lse[[0, 3]]).all()
    bad_a = lse_a.copy()
    bad_a[3] = bad  # against the -inf of b: still NaN, not the -inf side's "exact" rule
    with np.errstate(invalid="ignore"):
        out, lse = cupyflash.merge_attention_states(out_a, bad_a, out_b, lse_b)
    assert np.isnan(out[3]).all() and np.isnan(lse[3])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["float16", "float32", "float64"])
def test_stacked_is_pairwise_merging(rng, dtype):
    """S = 3 parts at once: the pairwise merges of the same parts, and attention over all keys."""
    q, k, v, parts = _parts(rng, dtype, [10, 40], causal=True)
    out, lse = cupyflash.merge_attention_states_stacked(
        np.stack([o for o, _ in parts]), np.stack([s for _, s in parts])
    )
    pairwise_out, pairwise_lse = cupyflash.merge_attention_states(
        *cupyflash.merge_attention_states(*parts[0], *parts[1]), *parts[2]
    )
    rtol = OUT_RTOL[np.dtype(dtype).name]
    _assert_close("out", out, pairwise_out.astype(np.float64), 2 * rtol)  # the pairwise rounds out twice
    _assert_close("lse", lse, pairwise_lse.astype(np.float64), LSE_RTOL[np.dtype(dtype).name])
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    part_error = max(
        max_abs(o.astype(np.float64) - r) for (o, _), r in zip(parts, _reference_parts(q, k, v, [10, 40], True))
    )
    _assert_close("out", out, ref_out, rtol + part_error / max_abs(ref_out))
    _assert_close("lse", lse, ref_lse, LSE_RTOL[np.dtype(dtype).name])


def test_stacked_with_one_or_no_part(rng):
    out = rng.standard_normal((1, 2, 5, 3)).astype(np.float16)
    lse = rng.standard_normal((1, 2, 5)).astype(np.float32)
    merged, merged_lse = cupyflash.merge_attention_states_stacked(out, lse)
    np.testing.assert_array_equal(merged, out[0])
    np.testing.assert_array_equal(merged_lse, lse[0])
    merged, merged_lse = cupyflash.merge_attention_states_stacked(out[:0], lse[:0])
    assert merged.shape == (2, 5, 3) and not merged.any() and np.isneginf(merged_lse).all()


def _pair(**changes):
    arrays = dict(
        out_a=np.zeros((2, 5, 4), np.float16),
        lse_a=np.zeros((2, 5), np.float32),
        out_b=np.zeros((2, 5, 4), np.float16),
        lse_b=np.zeros((2, 5), np.float32),
    )
    arrays.update(changes)
    return arrays


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(out_b=np.zeros((2, 6, 4), np.float16)), ValueError, r"out_b has shape \(2, 6, 4\) but out_a has shape"),
        (
            dict(lse_b=np.zeros((2, 4), np.float32)),
            ValueError,
            r"lse_b has shape \(2, 4\); expected out_a.shape\[:-1\]",
        ),
        (dict(lse_a=np.zeros((2, 5, 4), np.float32)), ValueError, r"lse_a has shape \(2, 5, 4\)"),
        (
            dict(out_b=np.zeros((2, 5, 4), np.float32)),
            TypeError,
            r"out_b has dtype float32 but out_a has dtype float16",
        ),
        (dict(lse_a=np.zeros((2, 5), np.float16)), TypeError, r"lse_a must be float32 for float16 outs"),
        (dict(out_a=np.zeros((2, 5, 4)), out_b=np.zeros((2, 5, 4))), TypeError, r"lse_a must be float64 for float64"),
        (dict(out_a=np.zeros((2, 5, 4), np.int32)), TypeError, r"out_a has dtype int32; expected float16"),
        (dict(out_a=np.zeros(4, np.float16)), ValueError, r"out_a must have at least 2 dims"),
        (dict(lse_b=[0.0] * 5), TypeError, r"lse_b must be a numpy.ndarray or a cupy.ndarray"),
    ],
)
def test_pair_errors_name_the_argument(changes, error, message):
    with pytest.raises(error, match=message):
        cupyflash.merge_attention_states(**_pair(**changes))


@pytest.mark.parametrize(
    "out, lse, message",
    [
        (np.zeros((5, 4), np.float32), np.zeros(5, np.float32), r"out must have at least 3 dims \(S, ..., N, Dv\)"),
        (np.zeros((3, 5, 4), np.float32), np.zeros((3, 4), np.float32), r"lse has shape \(3, 4\); expected out"),
    ],
)
def test_stacked_errors_name_the_argument(out, lse, message):
    with pytest.raises(ValueError, match=message):
        cupyflash.merge_attention_states_stacked(out, lse)
