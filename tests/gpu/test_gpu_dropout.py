"""Dropout in the CUDA kernels. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_dropout.py

The kernels' mask is read back exactly (``_gpu_mask``) and compared bit for bit with
``reference.dropout_mask``; forward and backward are held to the accuracy rule (tests/helpers/checks.py)
against the float64 reference run with the same seed, the naive same-dtype implementation applying the
same mask. Every allocation is poisoned with NaN, as in test_gpu.py.
"""

import functools
import math

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_matches_reference, same_bits
from helpers.gpu import nan_filled_allocations
from helpers.modifiers import OPTIONS, random_options, run
from helpers.problems import random_problem

import cupyflash
from cupyflash import reference

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_random_problem = functools.partial(random_problem, xp=cupy)
# Keys decoded per output column by _gpu_mask: weights 1, 2, 4, 8 for keys c, c + Dv, c + 2 Dv, c + 3 Dv.
_KEY_GROUPS = 4


def _run(q, k, v, dout, *, causal, **options):
    with nan_filled_allocations():
        return run(q, k, v, dout, causal=causal, **options)


def _check(rng, dtype, batch, nq, nk, d, causal, *, dv=None, p=0.17, seed=2024, which=(), k_batch=None):
    dv = d if dv is None else dv
    k_batch = batch if k_batch is None else k_batch
    q, k, v, dout = _random_problem(rng, batch + (nq, d), k_batch + (nk, d), k_batch + (nk, dv), dtype)
    options = random_options(rng, which, batch, nq, nk, dtype, xp=cupy)
    options.update(dropout_p=p, dropout_seed=seed)
    results = _run(q, k, v, dout, causal=causal, **options)
    assert_matches_reference(q, k, v, dout, results, causal=causal, **options)


def _gpu_mask(p, seed, batch, nq, nk, dtype=np.float32, **env):
    """The keep mask the forward kernel applied, read back exactly: q = 0 makes every P_ij = 1 / Nk, and v
    holds weight 2^g in column c for key j = c + g * Dv, so out[i, c] * Nk * (1 - p) is the integer
    sum_g 2^g Z[i, c + g * Dv]."""
    dv = math.ceil(nk / _KEY_GROUPS)
    assert dv <= 256
    j = np.arange(nk)
    v_host = np.zeros((nk, dv), dtype=np.float32)
    v_host[j, j % dv] = 2.0 ** (j // dv)
    q = cupy.zeros(batch + (nq, 16), dtype=dtype)
    k = cupy.zeros((nk, 16), dtype=dtype)
    v = cupy.asarray(v_host.astype(dtype))
    out = cupyflash.attention(q, k, v, dropout_p=p, dropout_seed=seed)
    codes = cupy.rint(out.astype(cupy.float64) * nk * (1 - p)).astype(cupy.uint8).get()
    groups = (codes[..., None] >> np.arange(_KEY_GROUPS, dtype=np.uint8)) & 1  # (..., nq, dv, group)
    keep = np.swapaxes(groups, -1, -2).reshape(batch + (nq, _KEY_GROUPS * dv))
    return keep[..., :nk].astype(bool)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_kernel_mask_is_the_reference_mask(dtype):
    """Bit for bit, past several tiles in both directions, with a seed using both key words."""
    batch, nq, nk, p, seed = (2, 3), 333, 1000, 0.3, 2**63 + 12345
    assert np.array_equal(_gpu_mask(p, seed, batch, nq, nk, dtype), reference.dropout_mask(p, seed, batch + (nq, nk)))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_mma_sync_kernel_mask_is_the_reference_mask(monkeypatch, dtype):
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    batch, nq, nk, p, seed = (2,), 260, 520, 0.5, 99
    assert np.array_equal(_gpu_mask(p, seed, batch, nq, nk, dtype), reference.dropout_mask(p, seed, batch + (nq, nk)))


@pytest.mark.parametrize("p", [0.1, 0.6])
def test_kept_fraction_within_four_sigma(p):
    batch, nq, nk = (16,), 2048, 1024
    keep = _gpu_mask(p, 31337, batch, nq, nk, np.float16)
    sigma = math.sqrt(p * (1 - p) / keep.size)
    assert abs(keep.mean() - (1 - p)) <= 4 * sigma, (keep.mean(), 1 - p, sigma)


def test_seeds_give_different_masks_and_a_seed_the_same_one(rng):
    a = _gpu_mask(0.2, 1, (4,), 128, 256)
    b = _gpu_mask(0.2, 2, (4,), 128, 256)
    assert np.array_equal(a, _gpu_mask(0.2, 1, (4,), 128, 256))
    assert 0.6 < np.mean(a == b) < 0.75  # independent masks agree on p^2 + (1-p)^2 = 68% of elements
    q, k, v, dout = _random_problem(rng, (2, 3, 200, 64), (2, 3, 200, 64), (2, 3, 200, 64), np.float16)
    first = run(q, k, v, dout, causal=True, dropout_p=0.2, dropout_seed=8)
    again = run(q, k, v, dout, causal=True, dropout_p=0.2, dropout_seed=8)
    assert all(same_bits(x, y) for x, y in zip(first, again))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_p_zero_is_bitwise_the_plain_path(rng, dtype):
    q, k, v, dout = _random_problem(rng, (2, 2, 150, 64), (2, 2, 170, 64), (2, 2, 170, 64), dtype)
    plain = run(q, k, v, dout, causal=True)
    zero = run(q, k, v, dout, causal=True, dropout_p=0.0, dropout_seed=5)
    assert all(same_bits(x, y) for x, y in zip(plain, zero))


@pytest.mark.parametrize("batch, nq, nk", [((2, 3), 113, 203), ((2, 3), 203, 113), ((1, 2), 1023, 1024)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", (16, 40, 64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, dtype, head_dim, causal, batch, nq, nk):
    _check(rng, dtype, batch, nq, nk, head_dim, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", (64, 96, 128))
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_mma_sync_path_matches_reference(rng, monkeypatch, dtype, head_dim, causal):
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    _check(rng, dtype, (1, 2), 300, 333, head_dim, causal)


@pytest.mark.parametrize("p", [0.01, 0.5, 0.9])
def test_other_probabilities(rng, p):
    _check(rng, ml_dtypes.bfloat16, (2, 2), 257, 300, 128, True, p=p)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_query_attention(rng, dtype, causal):
    """k, v shared by 3 query heads: each query head still gets its own mask (flat batch index)."""
    _check(rng, dtype, (2, 2, 3), 177, 190, 64, causal, k_batch=(2, 2, 1))


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_with_each_modifier(rng, dtype, option):
    _check(rng, dtype, (2, 3), 203, 290, 64, True, which=[option])


@pytest.mark.parametrize("head_dim", (40, 128, 160, 256))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_with_every_modifier(rng, dtype, head_dim):
    _check(rng, dtype, (2, 2), 290, 333, head_dim, True, which=OPTIONS)
