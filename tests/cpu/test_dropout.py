"""Dropout without a GPU: the generator against Random123's known answers, the mask's properties, the
reference's gradient against finite differences, the CPU path against the reference, and the validation.
The kernels' side is tests/gpu/test_gpu_dropout.py.
"""

import math

import numpy as np
import pytest
from helpers.checks import assert_matches_reference
from helpers.modifiers import random_options, run
from helpers.problems import random_problem

import cupyflash
from cupyflash import _dropout, reference

# Random123's kat_vectors, "philox4x32 10" lines: counter words, key words, expected output words.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in _dropout.philox4x32_10(counter, key)) == expected


def test_mask_is_a_pure_function_of_seed_batch_row_and_column():
    shape = (2, 3, 70, 150)
    keep = reference.dropout_mask(0.3, 2**40 + 17, shape)
    assert keep.shape == shape and keep.dtype == np.bool_
    assert np.array_equal(keep, reference.dropout_mask(0.3, 2**40 + 17, shape))
    # Any window of rows and columns is the same window of a bigger mask: nothing depends on tiles.
    bigger = reference.dropout_mask(0.3, 2**40 + 17, (2, 3, 200, 300))
    assert np.array_equal(keep, bigger[..., :70, :150])
    part = _dropout.keep_mask(_dropout.Dropout(0.3, 2**40 + 17), (2, 3), np.arange(33, 70), np.arange(17, 150))
    assert np.array_equal(part, keep[..., 33:70, 17:150])
    # The batch entries and the seeds give different masks (each pair agrees on ~p^2 + (1-p)^2 = 58%).
    flat = keep.reshape(6, 70, 150)
    for a in range(6):
        for b in range(a):
            assert 0.5 < np.mean(flat[a] == flat[b]) < 0.66
    other = reference.dropout_mask(0.3, 2**40 + 18, shape)
    assert 0.5 < np.mean(keep == other) < 0.66


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_kept_fraction(p):
    keep = reference.dropout_mask(p, 7, (4, 512, 512))
    n = keep.size
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) <= 4 * sigma, (keep.mean(), 1 - p, sigma)
    # Rows and columns are uniform too: no position is favoured (checked on the 16-bit slots' layout).
    by_slot = keep.reshape(4, 32, 2, 8, 32, 2, 8).mean(axis=(0, 1, 3, 4, 6))
    assert np.all(np.abs(by_slot - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / (n / 4)))


def test_keep_probability_resolution():
    """1 - p is rounded to a multiple of 2^-16; the scale is exactly 1 / (1 - p)."""
    for p in (1e-9, 0.1, 1 / 3, 0.999):
        d = _dropout.Dropout(p, 0)
        assert abs(d.threshold / 65536 - (1 - p)) <= 2**-17
        assert d.scale == 1 / (1 - p)


def _loss(q, k, v, dout, **kw):
    return float(np.sum(reference.attention(q, k, v, **kw) * dout))


@pytest.mark.parametrize("causal", [False, True])
def test_reference_gradient_against_finite_differences(rng, causal):
    """The reference's dropout backward is the derivative of its forward (float64, central differences)."""
    q, k, v = (rng.standard_normal(shape) for shape in ((1, 2, 9, 5), (1, 2, 11, 5), (1, 2, 11, 4)))
    dout = rng.standard_normal((1, 2, 9, 4))
    kw = dict(causal=causal, dropout_p=0.4, dropout_seed=5)
    grads = reference.attention_backward(dout, q, k, v, **kw)
    eps = 1e-6
    for name, x, g in zip("qkv", (q, k, v), grads):
        for index in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(6)]:
            plus, minus = x.copy(), x.copy()
            plus[index] += eps
            minus[index] -= eps
            args = {"q": q, "k": k, "v": v, name: None}
            numeric = (
                _loss(**{**args, name: plus}, dout=dout, **kw) - _loss(**{**args, name: minus}, dout=dout, **kw)
            ) / (2 * eps)
            assert abs(numeric - g[index]) <= 1e-6 * max(1.0, abs(numeric)), (name, index, numeric, g[index])


def test_dropout_changes_the_output_as_the_mask_says(rng):
    q, k, v = (rng.standard_normal((2, 40, 8)) for _ in range(3))
    plain, lse = reference.attention(q, k, v, return_lse=True)
    probs = reference.attention_probs(q, k, v)
    keep = reference.dropout_mask(0.25, 3, probs.shape)
    out, lse_dropped = reference.attention(q, k, v, dropout_p=0.25, dropout_seed=3, return_lse=True)
    np.testing.assert_allclose(out, (probs * keep / 0.75) @ v, rtol=1e-12, atol=1e-12)
    assert np.array_equal(lse, lse_dropped), "dropout never changes lse"
    assert not np.allclose(out, plain)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "which", [[], ["window", "softcap", "alibi_slopes", "bias", "mask", "block_mask"]], ids=["plain", "every-modifier"]
)
def test_cpu_path_matches_reference(rng, causal, which):
    """NumPy inputs (the CPU path, tile by tile) against the reference, GQA-broadcast k and v."""
    batch = (2, 3)
    q, k, v, dout = random_problem(rng, batch + (77, 40), (2, 1, 150, 40), (2, 1, 150, 24), np.float32)
    options = random_options(rng, which, batch, 77, 150, np.float32)
    options.update(dropout_p=0.2, dropout_seed=123456789)
    results = run(q, k, v, dout, causal=causal, **options)
    assert_matches_reference(q, k, v, dout, results, causal=causal, **options)


def test_p_zero_is_the_plain_path(rng):
    q, k, v, dout = random_problem(rng, (2, 50, 16), (2, 60, 16), (2, 60, 16), np.float32)
    plain = run(q, k, v, dout, causal=True)
    for seed in (None, 4):
        zero = run(q, k, v, dout, causal=True, dropout_p=0.0, dropout_seed=seed)
        assert all(np.array_equal(a, b) for a, b in zip(plain, zero))


def test_attention_draws_a_seed_from_numpy_random(rng):
    q, k, v = (rng.standard_normal((1, 64, 16)).astype(np.float32) for _ in range(3))
    np.random.seed(11)
    first = cupyflash.attention(q, k, v, dropout_p=0.5)
    np.random.seed(11)
    again = cupyflash.attention(q, k, v, dropout_p=0.5)
    other = cupyflash.attention(q, k, v, dropout_p=0.5)
    assert np.array_equal(first, again) and not np.array_equal(first, other)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=-0.1, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p must be a real number"),
        (dict(dropout_p=True, dropout_seed=1), TypeError, "dropout_p must be a real number"),
        (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an integer"),
        (dict(dropout_p=0.1, dropout_seed="7"), TypeError, "dropout_seed must be an integer"),
        (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
        (dict(dropout_p=0.1, dropout_seed=2**64), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
        (dict(dropout_p=0.1), ValueError, "needs an integer dropout_seed"),
    ],
)
def test_bad_dropout_arguments(rng, kwargs, error, text):
    q, k, v, dout = random_problem(rng, (1, 20, 8), (1, 20, 8), (1, 20, 8), np.float32)
    with pytest.raises(error, match=text):
        cupyflash.attention_forward(q, k, v, **kwargs)
    out, lse = cupyflash.attention_forward(q, k, v)
    with pytest.raises(error, match=text):
        cupyflash.attention_backward(dout, q, k, v, out, lse, **kwargs)
    if "dropout_seed" in kwargs:  # attention draws a missing seed itself
        with pytest.raises(error, match=text):
            cupyflash.attention(q, k, v, **kwargs)
