"""float64 NumPy inputs on the CPU path against the float64 reference: float64 arithmetic throughout.

The CPU path computes in float64 for float64 inputs (``cupyflash._arrays.lse_dtype``): out, lse, the
gradients, dbias and P come back float64 and agree with the reference to float64 rounding, far below
what any float32 step would leave (~1e-7). Sizes are awkward: not multiples of the 64-wide CPU tiles, nor
of the 128-wide block_mask tiles.
"""

import math

import numpy as np
import pytest
from helpers.modifiers import OPTIONS, alibi_slopes, block_grid

import cupyflash
from cupyflash import _cpu, _dropout, reference

# max|x - ref| / max|ref| against the reference (float32 arithmetic anywhere would give ~1e-7)
RTOL = 1e-12
# (Nq, Nk, D): one tile; several tiles and block_mask tiles, either way round
SIZES = ((37, 53, 40), (130, 201, 24), (201, 130, 40))
B, H = 2, 3
DROPOUT = dict(dropout_p=0.2, dropout_seed=2**40 + 7)


def _random(rng, shape):
    """Standard-normal float64 values: all 53 bits random, not float32 values widened."""
    return rng.standard_normal(shape)


def _problem(rng, q_shape, k_shape, v_shape):
    q, k, v = (_random(rng, shape) for shape in (q_shape, k_shape, v_shape))
    batch = np.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2])
    return q, k, v, _random(rng, batch + (q_shape[-2], v_shape[-1]))


def _options(rng, which, batch, nq, nk, bias_dtype=np.float64):
    """The options named in ``which`` (OPTIONS, plus "dropout") for a (*batch, Nq, Nk) problem."""
    makers = dict(
        window=lambda: dict(window=(max(1, nk // 4), nk // 10)),
        softcap=lambda: dict(softcap=2.0),
        alibi_slopes=lambda: dict(alibi_slopes=alibi_slopes(batch[-1])),
        bias=lambda: dict(bias=_random(rng, tuple(batch) + (nq, nk)).astype(bias_dtype)),
        mask=lambda: dict(mask=rng.random(tuple(batch) + (nq, nk)) < 0.8),
        block_mask=lambda: dict(block_mask=rng.random(tuple(batch) + block_grid(nq, nk)) < 0.7),
        dropout=lambda: dict(DROPOUT),
    )
    options = {}
    for name in which:
        options.update(makers[name]())
    return options


def _run(q, k, v, dout, *, causal, **options):
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, **options)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **options)
    return (out, lse, *grads)


def _assert_close(name, x, ref):
    assert x.dtype == np.float64, f"{name} is {x.dtype}, expected float64"
    assert x.shape == ref.shape, f"{name}: shape {x.shape}, expected {ref.shape}"
    assert not np.isnan(x).any(), f"{name} has NaN"
    size = float(np.max(np.abs(ref), initial=0))
    error = float(np.max(np.abs(x - ref), initial=0))
    if size == 0:
        assert error == 0, f"{name}: max error {error:.3g} where the exact result is 0"
        return
    assert error <= RTOL * size, f"{name}: relative error {error / size:.3g} > {RTOL:g} (max|ref| {size:.3g})"


def _assert_lse_close(lse, ref):
    assert (lse.shape, lse.dtype) == (ref.shape, np.float64), f"lse: {lse.shape} {lse.dtype}"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref), err_msg="lse -inf rows")
    seen = np.isfinite(ref)
    if seen.any():
        _assert_close("lse", lse[seen], ref[seen])


def _check(q, k, v, dout, results, *, causal, **options):
    """results = (out, lse, dq, dk, dv[, dbias]) against the reference; dbias in the bias's dtype."""
    out, lse, dq, dk, dv, *rest = results
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, causal=causal, **options)
    _assert_lse_close(lse, ref_lse)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        _assert_close(name, x, ref)
    bias = options.get("bias")
    assert len(rest) == (bias is not None)
    if bias is not None:
        (dbias,) = rest
        assert (dbias.shape, dbias.dtype) == (bias.shape, bias.dtype), f"dbias: {dbias.shape} {dbias.dtype}"
        if bias.dtype == np.float64:
            _assert_close("dbias", dbias, ref_grads[3])
        else:  # summed in float64, rounded once to the bias's float32
            rounding = float(np.max(np.abs(ref_grads[3].astype(bias.dtype) - ref_grads[3]), initial=0))
            error = float(np.max(np.abs(dbias - ref_grads[3]), initial=0))
            assert error <= rounding + RTOL * float(np.max(np.abs(ref_grads[3]))), f"dbias: error {error:.3g}"


@pytest.mark.parametrize("nq, nk, d", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_plain_matches_reference(rng, causal, nq, nk, d):
    q, k, v, dout = _problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
    _check(q, k, v, dout, _run(q, k, v, dout, causal=causal), causal=causal)


@pytest.mark.parametrize("d, dv", [(1, 1), (40, 17), (17, 40), (256, 8)])
def test_odd_and_unequal_head_dims(rng, d, dv):
    q, k, v, dout = _problem(rng, (B, 37, d), (B, 53, d), (B, 53, dv))
    _check(q, k, v, dout, _run(q, k, v, dout, causal=True), causal=True)


def test_explicit_scale(rng):
    q, k, v, dout = _problem(rng, (B, 37, 40), (B, 53, 40), (B, 53, 40))
    _check(q, k, v, dout, _run(q, k, v, dout, causal=False, scale=0.3), causal=False, scale=0.3)


@pytest.mark.parametrize("nq, nk, d", SIZES[:2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", OPTIONS + ("dropout",))
def test_each_option_matches_reference(rng, option, causal, nq, nk, d):
    options = _options(rng, [option], (B, H), nq, nk)
    q, k, v, dout = _problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
    _check(q, k, v, dout, _run(q, k, v, dout, causal=causal, **options), causal=causal, **options)


@pytest.mark.parametrize("nq, nk, d", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_all_options_together_match_reference(rng, causal, nq, nk, d):
    options = _options(rng, OPTIONS + ("dropout",), (B, H), nq, nk)
    q, k, v, dout = _problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
    _check(q, k, v, dout, _run(q, k, v, dout, causal=causal, **options), causal=causal, **options)


@pytest.mark.parametrize("bias_dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bias_shape", [(1, 1, 37, 53), (B, 1, 1, 53), (37, 53), (53,)])
def test_broadcast_bias_gives_dbias_of_its_shape_and_dtype(rng, bias_shape, bias_dtype):
    """A float64 or float32 bias on float64 inputs: dbias is summed over its broadcast dims in float64."""
    q, k, v, dout = _problem(rng, (B, H, 37, 40), (B, H, 53, 40), (B, H, 53, 40))
    options = dict(bias=_random(rng, bias_shape).astype(bias_dtype), softcap=3.0, **DROPOUT)
    results = _run(q, k, v, dout, causal=True, **options)
    assert (results[-1].shape, results[-1].dtype) == (bias_shape, np.dtype(bias_dtype))
    _check(q, k, v, dout, results, causal=True, **options)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_with_every_option(rng, causal):
    """q (B, Hk, G, N, D) with k, v (B, Hk, 1, N, D): dk, dv summed over the G query heads in float64."""
    kv_heads, groups, nq, nk, d = 2, 3, 37, 53, 40
    q, k, v, dout = _problem(rng, (B, kv_heads, groups, nq, d), (B, kv_heads, 1, nk, d), (B, kv_heads, 1, nk, d))
    options = dict(
        window=(20, 5),
        softcap=3.0,
        alibi_slopes=alibi_slopes(kv_heads * groups).reshape(kv_heads, groups),
        bias=_random(rng, (B, kv_heads, 1, nq, nk)),
        mask=rng.random((nq, nk)) < 0.9,
        **DROPOUT,
    )
    results = _run(q, k, v, dout, causal=causal, **options)
    assert results[3].shape == k.shape and results[5].shape == (B, kv_heads, 1, nq, nk)
    _check(q, k, v, dout, results, causal=causal, **options)


def test_rows_that_see_no_key(rng):
    """Causal with Nq > Nk, a masked-out row, a -inf bias row: out 0, lse -inf (float64), dq 0, no NaN."""
    nq, nk, d = 53, 37, 40
    mask = np.ones((B, H, nq, nk), dtype=bool)
    mask[:, :, 20:25] = False
    bias = _random(rng, (B, H, nq, nk))
    bias[0, :, 30:33] = -np.inf
    q, k, v, dout = _problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
    options = dict(mask=mask, bias=bias)
    out, lse, dq, dk, dv, dbias = results = _run(q, k, v, dout, causal=True, **options)
    blind = np.zeros((B, H, nq), dtype=bool)
    blind[:, :, : nq - nk] = blind[:, :, 20:25] = blind[0, :, 30:33] = True
    assert not out[blind].any() and np.isneginf(lse[blind]).all() and not dq[blind].any()
    assert np.isfinite(lse[~blind]).all()
    _check(q, k, v, dout, results, causal=True, **options)


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (7, 5), (16, 64)])
def test_any_tiling_gives_the_same_attention(rng, monkeypatch, block_q, block_k):
    monkeypatch.setattr(_cpu, "BLOCK_Q", block_q)
    monkeypatch.setattr(_cpu, "BLOCK_K", block_k)
    options = _options(rng, ("window", "softcap", "alibi_slopes", "bias", "mask", "dropout"), (B,), 23, 31)
    q, k, v, dout = _problem(rng, (B, 23, 8), (B, 31, 8), (B, 31, 8))
    _check(q, k, v, dout, _run(q, k, v, dout, causal=True, **options), causal=True, **options)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_probs(rng, causal):
    """P is float64 and the reference's to float64 rounding; P @ v is the output."""
    nq, nk, d = 130, 201, 24
    options = _options(rng, OPTIONS, (B, H), nq, nk)
    q, k, v, _ = _problem(rng, (B, H, nq, d), (B, H, nk, d), (B, H, nk, d))
    p = cupyflash.attention_probs(q, k, v, causal=causal, **options)
    assert (p.shape, p.dtype) == ((B, H, nq, nk), np.float64)
    _assert_close("p", p, reference.attention_probs(q, k, v, causal=causal, **options))
    _assert_close("p @ v", p @ v, cupyflash.attention(q, k, v, causal=causal, **options))


def test_dropout_scale_is_exact_in_float64(rng):
    """The kept probabilities are scaled by 1 / (1 - p) in float64 (float32 inputs round it to float32)."""
    p = 0.3  # 1 / 0.7 is not a float32
    dropout = _dropout.resolve(p, 5, caller="test")
    tiles64 = _cpu._ScoreTiles(4, 4, 1.0, False, None, dropout, (1,), np.float64, ())
    tiles32 = _cpu._ScoreTiles(4, 4, 1.0, False, None, dropout, (1,), np.float32, ())
    assert tiles64.keep_scale.dtype == np.float64 and tiles64.keep_scale == 1 / (1 - p)
    assert tiles32.keep_scale.dtype == np.float32 and tiles32.keep_scale == np.float32(1 / (1 - p))
    q, k, v, dout = _problem(rng, (1, 2, 37, 40), (1, 2, 53, 40), (1, 2, 53, 40))
    options = dict(dropout_p=p, dropout_seed=5)
    _check(q, k, v, dout, _run(q, k, v, dout, causal=False, **options), causal=False, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["plain", "options"])
def test_varlen_matches_reference(rng, causal, which):
    """Packed sequences (one with no query, one with no key), grouped heads, float64 throughout."""
    lengths_q, lengths_k = [5, 0, 37, 70, 1, 20], [9, 3, 53, 2, 0, 64]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    heads, kv_heads, d, dv = 6, 3, 40, 24
    q, k, v = (
        _random(rng, (int(cu[-1]), h, width))
        for cu, h, width in ((cu_q, heads, d), (cu_k, kv_heads, d), (cu_k, kv_heads, dv))
    )
    dout = _random(rng, (int(cu_q[-1]), heads, dv))
    options = (
        {}
        if which == "plain"
        else dict(window=(20, 3), softcap=2.0, alibi_slopes=np.linspace(0.05, 0.5, heads, dtype=np.float32), **DROPOUT)
    )
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **options)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, **options)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **options)
    ref_grads = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal, **options)
    _assert_lse_close(lse, ref_lse)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        _assert_close(name, x, ref)
    out_only = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, **options)
    np.testing.assert_array_equal(out_only, out)


@pytest.mark.parametrize("batch, nq, nk", [((2, 3), 0, 5), ((2, 3), 4, 0), ((0, 3), 4, 5)])
def test_empty_problems(rng, batch, nq, nk):
    """Empty problems give float64 zeros, a float64 lse of -inf and float64 P."""
    q, k, v, dout = _problem(rng, batch + (nq, 8), batch + (nk, 8), batch + (nk, 6))
    out, lse, *grads = _run(q, k, v, dout, causal=True)
    assert (out.shape, out.dtype) == (batch + (nq, 6), np.float64) and not out.any()
    assert (lse.shape, lse.dtype) == (batch + (nq,), np.float64) and np.isneginf(lse).all()
    for g, x in zip(grads, (q, k, v)):
        assert (g.shape, g.dtype) == (x.shape, np.float64) and not g.any()
    p = cupyflash.attention_probs(q, k, v)
    assert (p.shape, p.dtype) == (batch + (nq, nk), np.float64)


def test_varlen_empty_batch_lse_is_float64(rng):
    q, k, v = (np.zeros((0, 2, 8)) for _ in range(3))
    cu = np.zeros(3, dtype=np.int32)
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu, cu)
    assert (out.dtype, lse.dtype, lse.shape) == (np.float64, np.float64, (2, 0))
    grads = cupyflash.attention_varlen_backward(q, q, k, v, out, lse, cu, cu)
    assert all(g.dtype == np.float64 for g in grads)


def test_float64_is_more_accurate_than_float32(rng):
    """The same problem in float32 is ~1e-7 off the reference; in float64 a million times closer."""
    q, k, v, dout = _problem(rng, (B, H, 37, 40), (B, H, 53, 40), (B, H, 53, 40))
    ref = reference.attention(q, k, v, causal=True)
    size = np.abs(ref).max()
    error64 = np.abs(cupyflash.attention(q, k, v, causal=True) - ref).max() / size
    error32 = np.abs(cupyflash.attention(*(x.astype(np.float32) for x in (q, k, v)), causal=True) - ref).max() / size
    assert error64 <= RTOL and error32 > 1e3 * error64 and math.isfinite(error32)
