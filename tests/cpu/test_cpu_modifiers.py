"""The NumPy (CPU) path with score modifiers against the float64 reference.

Each option alone and all together in every dtype, broadcast biases and their dbias, GQA leading dims,
rows that see no key, tile skipping (keys no query sees are never read), any tiling, memory, probs.
"""

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_matches_reference
from helpers.modifiers import NO_OPTIONS, OPTIONS, alibi_slopes, block_grid, random_options, run
from helpers.problems import random_array, random_problem

import cupyflash
from cupyflash import _cpu, _modifiers, reference

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# (Nq, Nk, D): sizes that are not multiples of the 64-wide CPU tiles nor of the 128-wide block_mask tiles
SIZES = ((1, 1, 40), (37, 130, 256), (200, 257, 64), (257, 37, 128))
B, H = 2, 3


def _check(rng, dtype, batch, nq, nk, d, causal, options):
    q, k, v, dout = random_problem(rng, batch + (nq, d), batch + (nk, d), batch + (nk, d), dtype)
    results = run(q, k, v, dout, causal=causal, **options)
    assert_matches_reference(q, k, v, dout, results, causal=causal, **options)
    return results


@pytest.mark.parametrize("nq, nk, d", SIZES[1:3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_matches_reference(rng, option, dtype, causal, nq, nk, d):
    options = random_options(rng, [option], (B, H), nq, nk, dtype)
    _check(rng, dtype, (B, H), nq, nk, d, causal, options)


@pytest.mark.parametrize("nq, nk, d", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_all_options_together_match_reference(rng, dtype, causal, nq, nk, d):
    options = random_options(rng, OPTIONS, (B, H), nq, nk, dtype)
    _check(rng, dtype, (B, H), nq, nk, d, causal, options)


# Not (..., Nq, 1) nor (): a bias constant along the keys shifts no probability, its dbias is 0 (rounding).
@pytest.mark.parametrize("bias_shape", [(1, 1, 70, 150), (B, 1, 1, 150), (70, 150), (150,), (1, H, 1, 150)])
@pytest.mark.parametrize(
    "dtype, bias_dtype", [(np.float32, np.float32), (np.float16, np.float32), (ml_dtypes.bfloat16, ml_dtypes.bfloat16)]
)
def test_broadcast_bias_gives_dbias_of_its_shape(rng, dtype, bias_dtype, bias_shape):
    """dbias has the bias's own shape and dtype: dS summed over the dims along which it was broadcast."""
    options = random_options(rng, ["bias", "mask"], (B, H), 70, 150, bias_dtype, bias_shape=bias_shape)
    *_, dbias = _check(rng, dtype, (B, H), 70, 150, 32, True, options)
    assert (dbias.shape, dbias.dtype) == (bias_shape, np.dtype(bias_dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_query_attention_with_every_option(rng, dtype, causal):
    """q (B, Hk, G, N, D) with k, v (B, Hk, 1, N, D); slopes per (Hk, G), bias shared by the G groups."""
    kv_heads, groups, nq, nk, d = 2, 3, 77, 140, 40
    q, k, v, dout = random_problem(
        rng, (B, kv_heads, groups, nq, d), (B, kv_heads, 1, nk, d), (B, kv_heads, 1, nk, d), dtype
    )
    options = dict(
        window=(60, 5),
        softcap=3.0,
        alibi_slopes=alibi_slopes(kv_heads * groups).reshape(kv_heads, groups),
        bias=random_array(rng, (B, kv_heads, 1, nq, nk), dtype),
        mask=rng.random((nq, nk)) < 0.9,
        block_mask=rng.random((kv_heads, 1) + block_grid(nq, nk)) < 0.7,
    )
    results = run(q, k, v, dout, causal=causal, **options)
    assert results[3].shape == k.shape and results[5].shape == (B, kv_heads, 1, nq, nk)
    assert_matches_reference(q, k, v, dout, results, causal=causal, **options)


def test_rows_that_see_no_key(rng):
    """Rows hidden by the mask, by a -inf bias, or by causal with Nq > Nk: out 0, lse -inf, zero dq and
    dbias rows, never NaN; the rest matches the reference."""
    nq, nk, d = 150, 100, 16
    mask = np.ones((B, H, nq, nk), dtype=bool)
    mask[:, :, 60:70] = False
    bias = random_array(rng, (B, H, nq, nk), np.float32)
    bias[0, :, 80:90] = -np.inf
    q, k, v, dout = random_problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d), np.float32)
    options = dict(mask=mask, bias=bias, softcap=5.0)
    out, lse, dq, dk, dv, dbias = results = run(q, k, v, dout, causal=True, **options)
    blind = np.zeros((B, H, nq), dtype=bool)
    blind[:, :, : nq - nk] = blind[:, :, 60:70] = blind[0, :, 80:90] = True
    assert not out[blind].any() and np.isneginf(lse[blind]).all() and not dq[blind].any()
    assert not dbias[blind].any() and np.isfinite(lse[~blind]).all()
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert np.isfinite(x).all(), f"{name} is not finite"
    assert_matches_reference(q, k, v, dout, results, causal=True, **options)


def test_block_mask_hiding_whole_query_tiles(rng):
    """A block_mask row of False hides 128 queries from every key: their out is 0 and lse -inf."""
    nq, nk, d = 300, 200, 32
    block_mask = np.ones((B, 1) + block_grid(nq, nk), dtype=bool)
    block_mask[:, :, 1] = False  # queries 128..255
    block_mask[1, :, 2, 0] = False  # and some single tiles
    q, k, v, dout = random_problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d), np.float16)
    out, lse, dq, dk, dv = results = run(q, k, v, dout, causal=False, block_mask=block_mask)
    hidden = slice(128, 256)
    assert not out[:, :, hidden].any() and np.isneginf(lse[:, :, hidden]).all()
    assert not dq[:, :, hidden].any() and np.isfinite(lse[:, :, 256:]).all()
    assert_matches_reference(q, k, v, dout, results, causal=False, block_mask=block_mask)


def _poison_unseen_keys(rng, nq, nk, unseen, options, dtype=np.float32):
    """k and v with NaN in the keys ``unseen`` (which no query may see): the results must be those of zeros
    there, with dk = dv = 0 for those keys, as those tiles are skipped, never read."""
    d = 24
    q, k, v, dout = random_problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d), dtype)
    k[..., unseen, :] = v[..., unseen, :] = 0
    clean = run(q, k, v, dout, causal=False, **options)
    k[..., unseen, :] = v[..., unseen, :] = np.nan
    poisoned = run(q, k, v, dout, causal=False, **options)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), poisoned, clean):
        np.testing.assert_array_equal(x, y, err_msg=f"{name}: NaN keys in skipped tiles were read")
    assert not poisoned[3][..., unseen, :].any() and not poisoned[4][..., unseen, :].any()


def test_keys_in_block_masked_tiles_are_never_read(rng):
    nq, nk = 200, 300
    block_mask = np.ones(block_grid(nq, nk), dtype=bool)
    block_mask[:, 1] = False  # keys 128..255, for every query tile
    _poison_unseen_keys(rng, nq, nk, slice(128, 256), dict(block_mask=block_mask))


def test_keys_outside_every_window_are_never_read(rng):
    """Nq 64, Nk 300, window (10, 5): query i sees keys 236 + i - 10 ... 236 + i + 5; keys 0..127 none."""
    _poison_unseen_keys(rng, 64, 300, slice(0, 128), dict(window=(10, 5), softcap=4.0))


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (7, 5), (16, 64), (128, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_any_tiling_gives_the_same_attention(rng, monkeypatch, block_q, block_k, causal):
    """Tiles that do not divide the sequences, nor the 128-wide block_mask tiles: partial and straddling
    tiles, element-wise block masks, dbias accumulated by parts."""
    monkeypatch.setattr(_cpu, "BLOCK_Q", block_q)
    monkeypatch.setattr(_cpu, "BLOCK_K", block_k)
    for nq, nk in ((130, 141), (141, 130)):
        options = random_options(rng, OPTIONS, (2,), nq, nk, np.float32, bias_shape=(1, nk))
        options["window"] = (50, 20)
        _check(rng, np.float32, (2,), nq, nk, 8, causal, options)


def test_options_that_change_nothing_change_no_bit(rng):
    """An unbounded window, a zero bias and zero slopes, all-True masks: the same bits as no options."""
    nq, nk, d = 130, 200, 32
    q, k, v, dout = random_problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d), np.float16)
    neutral = dict(
        window=(-1, -1),
        alibi_slopes=np.zeros(H, np.float32),
        bias=np.zeros((nq, nk), np.float16),
        mask=np.ones((nq, nk), bool),
        block_mask=np.ones(block_grid(nq, nk), bool),
    )
    for causal in (False, True):
        plain = run(q, k, v, dout, causal=causal)
        *modified, dbias = run(q, k, v, dout, causal=causal, **neutral)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), modified, plain):
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_backend_contract(rng):
    """_cpu.attention_backward returns (dq, dk, dv, dbias): dbias None without a bias, else the bias's
    shape and dtype; mods=None is the plain path."""
    nq, nk, d = 40, 70, 8
    q, k, v, dout = random_problem(rng, (B, nq, d), (B, nk, d), (B, nk, d), np.float16)
    out, lse = _cpu.attention_forward(q, k, v, scale=0.3, causal=True)
    assert _cpu.attention_backward(dout, q, k, v, out, lse, scale=0.3, causal=True)[3] is None
    bias = random_array(rng, (1, nq, nk), np.float32)
    mods = _modifiers.resolve(np, q.dtype, (B,), nq, nk, bias=bias, softcap=1.5)
    out, lse = _cpu.attention_forward(q, k, v, scale=0.3, causal=True, mods=mods)
    *grads, dbias = _cpu.attention_backward(dout, q, k, v, out, lse, scale=0.3, causal=True, mods=mods)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.dtype == q.dtype for g in grads)
    assert (dbias.shape, dbias.dtype) == ((1, nq, nk), np.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_probs(rng, causal):
    """P matches the reference's; its rows sum to 1 (0 for rows that see no key); P @ v is the output."""
    nq, nk, d = 150, 140, 16
    options = random_options(rng, OPTIONS, (B, H), nq, nk, np.float32)
    options["mask"][:, :, 5] = False  # row 5 sees no key
    q, k, v, _ = random_problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d), np.float32)
    p = cupyflash.attention_probs(q, k, v, causal=causal, **options)
    assert (p.shape, p.dtype) == ((B, H, nq, nk), np.float32)
    ref = reference.attention_probs(q, k, v, causal=causal, **options)
    np.testing.assert_allclose(p, ref, rtol=0, atol=1e-6)
    seen = ref.sum(axis=-1) > 0.5
    assert not seen[:, :, 5].any()
    np.testing.assert_allclose(p.sum(axis=-1), seen.astype(np.float32), atol=1e-5)
    out = cupyflash.attention(q, k, v, causal=causal, **options)
    np.testing.assert_allclose(p @ v, out, atol=1e-5)


def test_softcap_bounds_the_scores(rng):
    """With a huge scale the capped scores stay in (-softcap, softcap): lse <= softcap + log(Nk)."""
    nq, nk, d, softcap = 50, 90, 16, 4.0
    q, k, v, dout = random_problem(rng, (B, nq, d), (B, nk, d), (B, nk, d), np.float32)
    out, lse, *grads = results = run(q, k, v, dout, causal=False, scale=100.0, softcap=softcap)
    assert (lse <= softcap + np.log(nk) + 1e-5).all()
    assert_matches_reference(q, k, v, dout, results, causal=False, scale=100.0, softcap=softcap)


def test_memory_stays_linear_in_sequence_length(rng):
    """Window, softcap, ALiBi, a per-key bias and a block mask: still no Nq x Nk array anywhere."""
    n, d = 2048, 16
    q, k, v, dout = random_problem(rng, (n, d), (n, d), (n, d), np.float32)
    options = dict(
        window=(256, 0),
        softcap=5.0,
        alibi_slopes=np.float32([0.1]).reshape(()),
        bias=random_array(rng, (n,), np.float32),
        block_mask=np.ones(block_grid(n, n), bool),
    )
    tracemalloc.start()  # NumPy reports its data allocations to tracemalloc
    try:
        run(q, k, v, dout, causal=True, **options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    score_matrix_bytes = n * n * 4
    assert peak < score_matrix_bytes / 8, f"peak {peak} bytes; one score matrix is {score_matrix_bytes}"


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_is_off_by_default(rng, option):
    """The public functions' defaults are the 'off' values: each of NO_OPTIONS gives plain attention."""
    q, k, v, dout = random_problem(rng, (2, 20, 8), (2, 30, 8), (2, 30, 8), np.float32)
    off = {option: NO_OPTIONS[option]}
    for x, y in zip(run(q, k, v, dout, causal=True, **off), run(q, k, v, dout, causal=True)):
        np.testing.assert_array_equal(x, y)
