"""The NumPy (CPU) path against the float64 reference: dtypes, head dims, masks, sizes, layouts, empties."""

import functools
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_rows_without_keys_are_zero
from helpers.problems import check_bhnd, random_array, random_problem

import cupyflash
from cupyflash import _cpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
HEAD_DIMS = (16, 32, 40, 64, 80, 96, 128, 160, 192, 256)
SHORT_SIZES = ((1, 1), (1, 300), (113, 203), (203, 113))
LONG_SIZE_HEAD_DIMS = (40, 128, 256)  # (512, 512) at every head dim would triple this file's runtime


def _run(q, k, v, dout, *, causal, scale=None):
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, scale=scale)
    return (out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale))


_random = functools.partial(random_array, xp=np)
_random_problem = functools.partial(random_problem, xp=np)
_check_bhnd = functools.partial(check_bhnd, run=_run, xp=np)


@pytest.mark.parametrize("nq, nk", SHORT_SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, assert_matches_reference, dtype, head_dim, causal, nq, nk):
    _check_bhnd(rng, assert_matches_reference, dtype, (2, 3), nq, nk, head_dim, head_dim, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", LONG_SIZE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_long_sequences_match_reference(rng, assert_matches_reference, dtype, head_dim, causal):
    _check_bhnd(rng, assert_matches_reference, dtype, (1, 2), 512, 512, head_dim, head_dim, causal)


@pytest.mark.parametrize("d, dv", [(1, 1), (3, 5), (33, 17), (17, 33), (64, 24), (1, 256), (256, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_odd_and_unequal_head_dims(rng, assert_matches_reference, dtype, causal, d, dv):
    _check_bhnd(rng, assert_matches_reference, dtype, (2, 1), 37, 45, d, dv, causal)


@pytest.mark.parametrize("scale", [0.01, 0.3, 2.0])
def test_explicit_scale(rng, assert_matches_reference, scale):
    _check_bhnd(rng, assert_matches_reference, np.float32, (2,), 50, 70, 32, 32, True, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_query_attention(rng, assert_matches_reference, dtype, causal):
    """GQA: q (B, Hk, G, N, D) attends to k, v (B, Hk, N, D) through k[:, :, None]; dk sums the G groups."""
    batch, kv_heads, groups = 2, 2, 3
    q_shape = (batch, kv_heads, groups, 77, 32)
    k_shape, v_shape = (batch, kv_heads, 1, 90, 32), (batch, kv_heads, 1, 90, 48)
    q, k, v, dout = _random_problem(rng, q_shape, k_shape, v_shape, dtype)
    results = _run(q, k, v, dout, causal=causal)
    assert results[3].shape == (batch, kv_heads, 1, 90, 32)
    assert_matches_reference(q, k, v, dout, results, causal=causal)


def test_keys_shared_by_every_batch_and_head(rng, assert_matches_reference):
    """k and v with no leading dims at all broadcast over q's (B, H); their gradients sum over both."""
    q, k, v, dout = _random_problem(rng, (3, 4, 65, 16), (80, 16), (80, 16), np.float16)
    assert_matches_reference(q, k, v, dout, _run(q, k, v, dout, causal=True), causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_strided_flash_attention_layout(rng, assert_matches_reference, causal):
    """(B, N, H, D) tensors viewed as (B, H, N, D) give the same bits as contiguous copies."""
    batch, heads, nq, nk, d = 2, 3, 70, 90, 40
    qkv = _random(rng, (batch, nk, 3, heads, d), np.float16)  # packed q, k, v, as one projection gives
    q = _random(rng, (batch, nq, heads, d), np.float16).transpose(0, 2, 1, 3)
    k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in (1, 2))
    dout = _random(rng, (batch, nq, heads, d), np.float16).transpose(0, 2, 1, 3)
    strided = _run(q, k, v, dout, causal=causal)
    contiguous = _run(*map(np.ascontiguousarray, (q, k, v, dout)), causal=causal)
    for x, y in zip(strided, contiguous):
        np.testing.assert_array_equal(x, y)
    assert_matches_reference(q, k, v, dout, strided, causal=causal)


def test_rows_that_see_no_key_are_zero(rng):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key: out 0, lse -inf, dq 0, never NaN."""
    nq, nk = 70, 20
    q, k, v, dout = _random_problem(rng, (2, nq, 8), (2, nk, 8), (2, nk, 8), np.float32)
    out, lse, dq, dk, dv = _run(q, k, v, dout, causal=True)
    assert_rows_without_keys_are_zero(out, lse, dq, dk, dv, nq - nk)


@pytest.mark.parametrize(
    "nq, nk, mask", [(2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])]
)
def test_causal_mask_is_bottom_right_aligned(rng, nq, nk, mask):
    """With v = identity, out is the attention matrix P: its support is the mask drawn in the docstring."""
    q, k = _random(rng, (nq, 4), np.float32), _random(rng, (nk, 4), np.float32)
    out = cupyflash.attention(q, k, np.eye(nk, dtype=np.float32), causal=True)
    np.testing.assert_array_equal(out > 0, np.array(mask, dtype=bool))


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (7, 5), (16, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_any_tiling_gives_the_same_attention(rng, monkeypatch, assert_matches_reference, block_q, block_k, causal):
    """Tiles smaller than, and not dividing, the sequences: partial tiles and skipped causal tiles."""
    monkeypatch.setattr(_cpu, "BLOCK_Q", block_q)
    monkeypatch.setattr(_cpu, "BLOCK_K", block_k)
    for nq, nk in ((23, 31), (31, 23)):
        _check_bhnd(rng, assert_matches_reference, np.float32, (2,), nq, nk, 8, 8, causal)


def test_memory_stays_linear_in_sequence_length(rng):
    """No Nq x Nk score matrix: peak memory of forward and backward is far below one such matrix."""
    n, d = 2048, 16
    q, k, v, dout = _random_problem(rng, (n, d), (n, d), (n, d), np.float32)
    tracemalloc.start()  # NumPy reports its data allocations to tracemalloc
    try:
        _run(q, k, v, dout, causal=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    score_matrix_bytes = n * n * 4
    assert peak < score_matrix_bytes / 8, f"peak {peak} bytes; one score matrix is {score_matrix_bytes}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch, nq, nk", [((2, 3), 0, 5), ((2, 3), 4, 0), ((0, 3), 4, 5), ((2, 0), 4, 5), ((2, 3), 0, 0)]
)
def test_empty_problems(rng, batch, nq, nk, causal):
    """Empty batch or sequences: correctly shaped zeros (lse -inf where Nk == 0), nothing computed."""
    q, k, v, dout = _random_problem(rng, batch + (nq, 8), batch + (nk, 8), batch + (nk, 6), np.float16)
    out, lse, dq, dk, dv = _run(q, k, v, dout, causal=causal)
    assert (out.shape, out.dtype) == (batch + (nq, 6), np.float16)
    assert (lse.shape, lse.dtype) == (batch + (nq,), np.float32)
    assert not out.any() and np.all(np.isneginf(lse))
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert (g.shape, g.dtype) == (x.shape, x.dtype) and not g.any()


def test_numpy_inputs_never_touch_the_gpu_back_end(rng, monkeypatch):
    """The CPU path needs no GPU: NumPy inputs compile nothing, ask CUDA for no device and plan no launch."""
    from cupyflash._arrays import cupy
    from cupyflash._cuda import compile as compile_
    from cupyflash._cuda import dense, plans

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU path reached CUDA")

    if cupy is not None:
        monkeypatch.setattr(cupy, "RawModule", refuse)
        monkeypatch.setattr(cupy.cuda, "Device", refuse)
    for module in (compile_, dense):
        monkeypatch.setattr(module, "functions", refuse)
        monkeypatch.setattr(module, "current_device", refuse)
    kept = plans.entries()
    q, k, v, dout = _random_problem(rng, (2, 30, 8), (2, 40, 8), (2, 40, 8), np.float16)
    for options in ({}, dict(window=(5, 1), softcap=3.0)):
        out, lse = cupyflash.attention_forward(q, k, v, causal=True, **options)
        cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, **options)
        cupyflash.attention_probs(q, k, v, **options)
    assert plans.entries() == kept
