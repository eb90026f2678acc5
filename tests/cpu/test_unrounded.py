"""Unrounded results on the CPU path: ``attention_forward(out_dtype=...)``, ``attention_backward(grad_dtype=...)`` and
the packed functions' return out, dq, dk, dv in the accumulator's dtype (float32; float64 for float64 inputs) when
asked: their dtypes, their values against the float64 reference (the rounded results are theirs rounded), and
the errors for other values. The kernels' side: tests/gpu/test_gpu_unrounded.py."""

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import max_abs
from helpers.problems import random_array, random_problem

import cupyflash
from cupyflash import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32), "float64": np.float64}
HALVES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
ACCUMULATOR = {np.dtype(np.float16): np.float32, BF16: np.float32, np.dtype(np.float32): np.float32}
# Options that take each of the CPU path's routes: plain and causal, every score modifier, dropout.
OPTIONS = {
    "plain": dict(causal=False),
    "causal": dict(causal=True),
    "modifiers": dict(causal=True, window=(30, 5), softcap=20.0, alibi_slopes=np.array([0.3, 0.1, 0.05], np.float32)),
    "bias_mask": dict(
        causal=False, bias=np.linspace(-1, 1, 70 * 90, dtype=np.float32).reshape(70, 90), mask=np.tri(70, 90, 40) > 0
    ),
    "dropout": dict(causal=True, dropout_p=0.2, dropout_seed=11),
}


def _accumulator(dtype):
    return np.dtype(ACCUMULATOR.get(np.dtype(dtype), np.float64))


def _run(q, k, v, dout, results, **options):
    """(out, lse, dq, dk, dv) with results in ``results`` (None: the inputs' dtype); the backward gets out rounded
    to the inputs' dtype, as one call's forward returns it."""
    out, lse = cupyflash.attention_forward(q, k, v, out_dtype=results, **options)
    rounded = out.astype(q.dtype)
    grads = cupyflash.attention_backward(dout, q, k, v, rounded, lse, grad_dtype=results, **options)
    return (out, lse, *grads[:3])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_results_come_in_the_dtype_asked_for(rng, dtype):
    """None and the inputs' dtype give the inputs' dtype; the accumulator's (by type, name or dtype) gives it;
    lse is the accumulator's either way, and dbias keeps the bias's dtype."""
    accumulator = _accumulator(dtype)
    q, k, v, dout = random_problem(rng, (2, 40, 16), (2, 50, 16), (2, 50, 8), dtype)
    bias = random_array(rng, (40, 50), dtype)
    for asked, expected in ((None, dtype), (dtype, dtype), (accumulator, accumulator), (accumulator.name, accumulator)):
        out, lse = cupyflash.attention_forward(q, k, v, causal=True, out_dtype=asked)
        assert out.dtype == expected and lse.dtype == accumulator and out.shape == (2, 40, 8)
        assert cupyflash.attention(q, k, v, out_dtype=asked).dtype == expected
        rounded = out.astype(dtype)
        *grads, dbias = cupyflash.attention_backward(dout, q, k, v, rounded, lse, bias=bias, grad_dtype=asked)
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, expected) for x in (q, k, v)]
        assert dbias.dtype == bias.dtype


@pytest.mark.parametrize("option", OPTIONS, ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", HALVES.values(), ids=HALVES.keys())
def test_the_rounded_results_are_the_unrounded_ones_rounded(rng, dtype, option):
    """float16 and bfloat16 on the CPU path: the float32 results, rounded to the inputs' dtype, are the rounded
    results bit for bit (both come from the same float32 sums)."""
    q, k, v, dout = random_problem(rng, (3, 70, 24), (3, 90, 24), (3, 90, 40), dtype)
    wide = _run(q, k, v, dout, np.float32, **OPTIONS[option])
    rounded = _run(q, k, v, dout, None, **OPTIONS[option])
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), wide, rounded):
        assert x.dtype == np.float32 and y.dtype == (np.float32 if name == "lse" else dtype), name
        assert np.array_equal(x.astype(y.dtype), y, equal_nan=True), name


@pytest.mark.parametrize("dtype", HALVES.values(), ids=HALVES.keys())
def test_unrounded_results_are_closer_to_float64(rng, dtype):
    """Against the float64 reference: out and dv unrounded are far closer than rounded (their float32 sums of
    16-bit products keep nearly every bit); dq and dk, whose error comes mostly from delta = rowsum(dout * out)
    with the rounded out, are no farther than within one rounding."""
    q, k, v, dout = random_problem(rng, (2, 3, 130, 64), (2, 3, 150, 64), (2, 3, 150, 64), dtype)
    wide = _run(q, k, v, dout, np.float32, causal=True)
    rounded = _run(q, k, v, dout, None, causal=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    refs = (ref_out, ref_lse, *reference.attention_backward(dout, q, k, v, causal=True))
    half_ulp = float(np.finfo(np.float16).eps if dtype == np.float16 else 2.0**-7) / 2
    for name, x, y, ref in zip(("out", "lse", "dq", "dk", "dv"), wide, rounded, refs):
        wide_error = max_abs(x.astype(np.float64) - ref)
        rounded_error = max_abs(y.astype(np.float64) - ref)
        if name in ("out", "dv"):
            assert wide_error <= 0.01 * rounded_error, (name, wide_error, rounded_error)
        elif name != "lse":
            assert wide_error <= rounded_error + half_ulp * max_abs(ref), (name, wide_error, rounded_error)


def test_grouped_heads_sum_their_unrounded_gradients(rng):
    """GQA by broadcasting: dk and dv are summed over the query heads in float32 from unrounded terms, so the
    float32 sums are the float64 ones to float32 rounding; the rounded call rounds those sums once (bit for bit
    the float32 call's results rounded), not each head's part first."""
    q = random_array(rng, (1, 2, 3, 60, 32), BF16)
    k, v = (random_array(rng, (1, 2, 1, 60, 32), BF16) for _ in range(2))
    dout = random_array(rng, q.shape, BF16)
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, grad_dtype=np.float32)
    assert (dk.shape, dk.dtype, dv.shape, dv.dtype) == (k.shape, np.float32, v.shape, np.float32)
    dq16, dk16, dv16 = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for x, rounded in ((dq, dq16), (dk, dk16), (dv, dv16)):
        assert rounded.dtype == BF16 and np.array_equal(rounded, x.astype(BF16))
    wide = [x.astype(np.float64) for x in (q, k, v, dout, out)]
    _, dk64, dv64 = cupyflash.attention_backward(wide[3], *wide[:3], wide[4], lse.astype(np.float64), causal=True)
    for x, rounded, exact in ((dk, dk16, dk64), (dv, dv16, dv64)):
        assert max_abs(x - exact) <= 1e-5 * max_abs(exact)
        assert max_abs(rounded.astype(np.float64) - exact) > 10 * max_abs(x - exact)


@pytest.mark.parametrize("dtype", HALVES.values(), ids=HALVES.keys())
def test_packed_grouped_heads_round_their_sums_once(rng, dtype):
    """A packed batch with 3 query heads per key/value head: the rounded call's dk and dv are the float32 call's
    sums rounded once, bit for bit, and dq the float32 call's dq rounded."""
    lengths = [37, 5, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, dout = (random_array(rng, (int(cu[-1]), 6, 16), dtype) for _ in range(2))
    k, v = (random_array(rng, (int(cu[-1]), 2, 16), dtype) for _ in range(2))
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu, cu, causal=True)
    wide = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True, grad_dtype=np.float32)
    rounded = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True)
    for name, x, y in zip(("dq", "dk", "dv"), wide, rounded):
        assert x.dtype == np.float32 and y.dtype == dtype and np.array_equal(y, x.astype(dtype)), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_float32_and_float64_inputs_are_unchanged(rng, dtype):
    """Where the inputs' dtype is the accumulator's, asking for it changes nothing, bit for bit."""
    q, k, v, dout = random_problem(rng, (2, 45, 16), (2, 45, 16), (2, 45, 16), dtype)
    asked = _run(q, k, v, dout, dtype, causal=True)
    default = _run(q, k, v, dout, None, causal=True)
    for x, y in zip(asked, default):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("dtype", HALVES.values(), ids=HALVES.keys())
def test_packed_batches_take_the_options_too(rng, dtype):
    """attention_varlen_forward(out_dtype=), attention_varlen_backward(grad_dtype=) and attention_varlen: each
    sequence's unrounded rows are the dense call's on that sequence alone, and rounded they are the rounded
    call's (one key/value head per query head: nothing summed)."""
    lengths = [37, 0, 5, 64]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, dout = (random_array(rng, (int(cu[-1]), 2, 16), dtype) for _ in range(4))
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu, cu, causal=True, out_dtype=np.float32)
    assert out.dtype == np.float32
    assert cupyflash.attention_varlen(q, k, v, cu, cu, causal=True, out_dtype="float32").dtype == np.float32
    rounded_out, _ = cupyflash.attention_varlen_forward(q, k, v, cu, cu, causal=True)
    assert np.array_equal(out.astype(dtype), rounded_out)
    grads = cupyflash.attention_varlen_backward(
        dout, q, k, v, rounded_out, lse, cu, cu, causal=True, grad_dtype="float32"
    )
    rounded = cupyflash.attention_varlen_backward(dout, q, k, v, rounded_out, lse, cu, cu, causal=True)
    for g, r in zip(grads, rounded):
        assert g.dtype == np.float32 and np.array_equal(g.astype(dtype), r)
    s0, s1 = cu[3], cu[4]  # the last sequence alone, as a dense (H, n, D) problem
    dense = [x[s0:s1].transpose(1, 0, 2) for x in (q, k, v, dout)]
    alone, alone_lse = cupyflash.attention_forward(*dense[:3], causal=True, out_dtype=np.float32)
    assert np.allclose(out[s0:s1].transpose(1, 0, 2), alone, rtol=1e-6, atol=1e-6)
    alone_grads = cupyflash.attention_backward(
        dense[3], *dense[:3], alone.astype(dtype), alone_lse, causal=True, grad_dtype=np.float32
    )
    for g, a in zip(grads, alone_grads):
        assert np.allclose(g[s0:s1].transpose(1, 0, 2), a, rtol=1e-5, atol=1e-5)


def test_empty_problems_give_zeros_of_the_dtype_asked_for():
    q = np.zeros((2, 0, 8), BF16)
    k = np.zeros((2, 5, 8), BF16)
    out, lse = cupyflash.attention_forward(q, k, k, out_dtype=np.float32)
    assert (out.shape, out.dtype, lse.dtype) == ((2, 0, 8), np.float32, np.float32)
    grads = cupyflash.attention_backward(out.astype(BF16), q, k, k, out.astype(BF16), lse, grad_dtype=np.float32)
    assert [g.dtype for g in grads] == [np.float32] * 3
    cu = np.array([0, 0], np.int32)
    packed = np.zeros((0, 2, 8), BF16)
    out, lse = cupyflash.attention_varlen_forward(packed, packed, packed, cu, cu, out_dtype=np.float32)
    assert out.dtype == np.float32
    grads = cupyflash.attention_varlen_backward(
        packed, packed, packed, packed, packed, lse, cu, cu, grad_dtype="float32"
    )
    assert [g.dtype for g in grads] == [np.float32] * 3


BAD = [
    (BF16, np.float16, "out_dtype for bfloat16 inputs must be None, bfloat16 (the inputs' dtype) or float32"),
    (BF16, "float64", "out_dtype for bfloat16 inputs must be None, bfloat16"),
    (np.float16, "fp8", "out_dtype for float16 inputs must be None, float16 (the inputs' dtype) or float32"),
    (np.float16, np.int8, "out_dtype for float16 inputs"),
    (np.float16, [1], "out_dtype for float16 inputs"),
    (np.float32, np.float16, "out_dtype for float32 inputs must be None or float32 (the inputs' dtype, which is"),
    (np.float64, "float32", "out_dtype for float64 inputs must be None or float64"),
]


@pytest.mark.parametrize("dtype, value, message", BAD)
def test_other_values_raise_naming_the_argument(rng, dtype, value, message):
    q, k, v, dout = random_problem(rng, (1, 20, 8), (1, 20, 8), (1, 20, 8), dtype)
    out, lse = cupyflash.attention_forward(q, k, v)
    cu = np.array([0, 20], np.int32)
    packed = [x[0][:, None, :] for x in (q, k, v, dout, out)]
    _, packed_lse = cupyflash.attention_varlen_forward(*packed[:3], cu, cu)
    for call in (
        lambda: cupyflash.attention(q, k, v, out_dtype=value),
        lambda: cupyflash.attention_forward(q, k, v, out_dtype=value),
        lambda: cupyflash.attention_varlen(*packed[:3], cu, cu, out_dtype=value),
        lambda: cupyflash.attention_varlen_forward(*packed[:3], cu, cu, out_dtype=value),
    ):
        with pytest.raises(ValueError, match=f"^{_escaped(message)}.*got {_escaped(repr(value))}$"):
            call()
    grad_message = message.replace("out_dtype", "grad_dtype")
    for call in (
        lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, grad_dtype=value),
        lambda: cupyflash.attention_varlen_backward(
            packed[3], *packed[:3], packed[4], packed_lse, cu, cu, grad_dtype=value
        ),
    ):
        with pytest.raises(ValueError, match=f"^{_escaped(grad_message)}"):
            call()


def _escaped(text):
    import re

    return re.escape(text)


def test_an_unrounded_out_goes_back_rounded(rng):
    """The backward reads out in the inputs' dtype: a float32 out of bfloat16 inputs is a TypeError that says to
    round it."""
    q, k, v, dout = random_problem(rng, (1, 20, 8), (1, 20, 8), (1, 20, 8), BF16)
    out, lse = cupyflash.attention_forward(q, k, v, out_dtype=np.float32)
    with pytest.raises(TypeError, match=r"out has dtype float32.*out\.astype\(dout\.dtype\)"):
        cupyflash.attention_backward(dout, q, k, v, out, lse)
