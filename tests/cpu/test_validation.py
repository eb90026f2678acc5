"""Every input error of the public API, with NumPy arrays: the message names the argument and the value.

The CPU and GPU paths share these checks (cupyflash._checks, called from cupyflash._api), so NumPy inputs
test both; the checks that need CuPy arrays (mixing them with NumPy ones, the wrong device) are in
tests/gpu/test_gpu.py.
"""

import re

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash._arrays import lse_dtype

B, H, NQ, NK, D, DV = 2, 3, 5, 7, 8, 6
SHAPES = dict(
    dout=(B, H, NQ, DV), q=(B, H, NQ, D), k=(B, H, NK, D), v=(B, H, NK, DV), out=(B, H, NQ, DV), lse=(B, H, NQ)
)


def _arrays(dtype=np.float16, **overrides):
    """Zero dout, q, k, v, out, lse of consistent shapes (lse float32, float64 for float64); overrides give a
    shape or an array."""
    arrays = {}
    for name, shape in {**SHAPES, **overrides}.items():
        if isinstance(shape, tuple):
            arrays[name] = np.zeros(shape, dtype=lse_dtype(dtype) if name == "lse" else dtype)
        else:
            arrays[name] = shape
    return arrays


def _backward(arrays):
    a = arrays
    return cupyflash.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"])


def _public_calls(a, **kwargs):
    """Each public function called on the same q, k, v (and dout, out, lse)."""
    return [
        lambda: cupyflash.attention(a["q"], a["k"], a["v"], **kwargs),
        lambda: cupyflash.attention_forward(a["q"], a["k"], a["v"], **kwargs),
        lambda: cupyflash.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kwargs),
    ]


def _all_raise(error, match, arrays=None, **kwargs):
    for call in _public_calls(arrays or _arrays(), **kwargs):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_array_input(name):
    arrays = _arrays()
    arrays[name] = arrays[name].tolist()
    _all_raise(TypeError, f"{name} must be a numpy.ndarray or a cupy.ndarray, got builtins.list", arrays)


def test_float64_is_supported():
    """float64 q, k, v (dout, out) with a float64 lse pass validation in every public function."""
    for call in _public_calls(_arrays(np.float64)):
        call()


@pytest.mark.parametrize("other, dtype", [(np.float32, np.float64), (np.float64, np.float32)])
@pytest.mark.parametrize("name", ["q", "k", "v", "dout", "out"])
def test_float64_mixed_with_float32(name, dtype, other):
    """float64 is not a wider float32: one array of the other dtype is an error naming both dtypes."""
    arrays = _arrays(dtype)
    arrays[name] = arrays[name].astype(other)
    calls = _public_calls(arrays)
    for call in calls[2:] if name in ("dout", "out") else calls:  # the forward never sees dout, out
        with pytest.raises(TypeError, match="must share one dtype") as excinfo:
            call()
        message = str(excinfo.value)
        assert f"{name} has dtype {np.dtype(other)}" in message and f"has dtype {np.dtype(dtype)}" in message


def test_lse_must_be_float64_for_float64_inputs():
    """The forward returns a float64 lse for float64 inputs; a float32 one is refused, naming the expected dtype."""
    arrays = _arrays(np.float64, lse=np.zeros(SHAPES["lse"], dtype=np.float32))
    expected = "lse must be float64 for float64 inputs (as attention_forward returns it), got float32"
    with pytest.raises(TypeError, match=re.escape(expected)):
        _backward(arrays)


def test_lse_must_be_float32_for_float32_inputs():
    arrays = _arrays(np.float32, lse=np.zeros(SHAPES["lse"], dtype=np.float64))
    expected = "lse must be float32 for float32 inputs (as attention_forward returns it), got float64"
    with pytest.raises(TypeError, match=re.escape(expected)):
        _backward(arrays)


def test_float64_forward_returns_float64_lse():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(SHAPES[n]) for n in "qkv")
    out, lse = cupyflash.attention_forward(q, k, v)
    assert (out.dtype, lse.dtype) == (np.float64, np.float64)
    for dq in cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse):
        assert dq.dtype == np.float64


# The backward names dout, its first argument; the forward names q.


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, ml_dtypes.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    expected = f"has dtype {np.dtype(dtype)}; expected float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64"
    _all_raise(TypeError, "(q|dout) " + re.escape(expected), _arrays(dtype))


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    arrays = _arrays(np.float16, **{name: np.zeros(SHAPES[name], dtype=ml_dtypes.bfloat16)})
    expected = f"q has dtype float16 but {name} has dtype bfloat16; q, k, v must share one dtype"
    with pytest.raises(TypeError, match=expected):
        cupyflash.attention(arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("name", ["dout", "out"])
def test_backward_mixed_dtypes(name):
    """The message names the odd one out with its dtype, and one of the others with theirs."""
    arrays = _arrays(ml_dtypes.bfloat16)
    arrays[name] = arrays[name].astype(np.float32)
    with pytest.raises(TypeError, match="dout, q, k, v, out must share one dtype") as excinfo:
        _backward(arrays)
    assert f"{name} has dtype float32" in str(excinfo.value) and "has dtype bfloat16" in str(excinfo.value)


def test_lse_must_be_float32():
    with pytest.raises(TypeError, match="lse must be float32 .* got float16"):
        _backward(_arrays(lse=np.zeros(SHAPES["lse"], dtype=np.float16)))


@pytest.mark.parametrize("name, shape", [("q", (D,)), ("k", (D,)), ("v", ())])
def test_rank_below_two(name, shape):
    expected = f"{name} must have at least 2 dims (..., N, D), got shape {shape}"
    _all_raise(ValueError, re.escape(expected), _arrays(**{name: shape}))


def test_head_dim_mismatch_between_q_and_k():
    k = (B, H, NK, D + 1)
    expected = f"q and k must have the same head dim D (last dim), got q {SHAPES['q']} and k {k}"
    _all_raise(ValueError, re.escape(expected), _arrays(k=k))


def test_key_count_mismatch_between_k_and_v():
    v = (B, H, NK + 1, DV)
    expected = f"k and v must have the same number of keys Nk (dim -2), got k {SHAPES['k']} and v {v}"
    _all_raise(ValueError, re.escape(expected), _arrays(v=v))


def test_leading_dims_that_do_not_broadcast():
    k, v = (B, 2, NK, D), (B, 2, NK, DV)
    expected = f"the leading (batch) dims of q {SHAPES['q']}, k {k} and v {v} do not broadcast"
    _all_raise(ValueError, re.escape(expected), _arrays(k=k, v=v))


@pytest.mark.parametrize(
    "d, dv, what, value", [(257, DV, "D", 257), (D, 300, "Dv", 300), (0, DV, "D", 0), (D, 0, "Dv", 0)]
)
def test_head_dim_out_of_range(d, dv, what, value):
    arrays = _arrays(q=(B, H, NQ, d), k=(B, H, NK, d), v=(B, H, NK, dv), out=(B, H, NQ, dv), dout=(B, H, NQ, dv))
    _all_raise(ValueError, rf"head dim {what} \(.*\) is {value}; supported head dims are 1 to 256", arrays)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("dout", (B, H, NQ, DV + 1)),
        ("out", (B, H, NQ + 1, DV)),
        ("out", (H, NQ, DV)),
        ("lse", (B, H, NQ, 1)),
        ("lse", (B, 1, NQ)),
    ],
)
def test_backward_tensors_must_have_forward_shapes(name, shape):
    with pytest.raises(ValueError, match=re.escape(f"{name} has shape {shape}; expected {SHAPES[name]}")):
        _backward(_arrays(**{name: shape}))


def test_backward_shapes_follow_broadcasting():
    """With k, v shared over heads, out is still (B, H, Nq, Dv): a (B, 1, Nq, Dv) out is rejected."""
    arrays = _arrays(k=(B, 1, NK, D), v=(B, 1, NK, DV), out=(B, 1, NQ, DV))
    expected = f"out has shape {(B, 1, NQ, DV)}; expected {SHAPES['out']}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        _backward(arrays)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), -np.inf])
def test_scale_must_be_finite_and_positive(scale):
    _all_raise(ValueError, re.escape(f"scale must be finite and > 0, got {scale!r}"), scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, 1j, [0.5]])
def test_scale_must_be_a_real_number(scale):
    _all_raise(TypeError, re.escape(f"scale must be a real number or None, got {scale!r}"), scale=scale)


def test_scale_accepts_numpy_and_integer_scalars():
    for scale in (np.float32(0.5), np.float64(0.5), 1):
        for call in _public_calls(_arrays(np.float32), scale=scale):
            call()


@pytest.mark.parametrize("causal", [1, 0, "yes", None, np.array([True])])
def test_causal_must_be_a_bool(causal):
    _all_raise(TypeError, re.escape(f"causal must be a bool, got {causal!r}"), causal=causal)


def test_causal_accepts_numpy_bool():
    q, k, v = (np.random.default_rng(0).standard_normal(SHAPES[n], dtype=np.float32) for n in "qkv")
    np.testing.assert_array_equal(
        cupyflash.attention(q, k, v, causal=np.bool_(True)), cupyflash.attention(q, k, v, causal=True)
    )


def test_empty_inputs_are_validated_too():
    """Validation runs before the empty-input shortcut: an empty int32 batch is still an error."""
    arrays = _arrays(np.int32, q=(0, H, NQ, D), k=(0, H, NK, D), v=(0, H, NK, DV))
    with pytest.raises(TypeError, match="q has dtype int32; expected"):
        cupyflash.attention(arrays["q"], arrays["k"], arrays["v"])


def test_reference_takes_numpy_arrays_only():
    q = np.zeros((NQ, D))
    with pytest.raises(TypeError, match="k must be a numpy.ndarray, got list"):
        reference.attention(q, q.tolist(), q)


def test_reference_validates_shapes():
    q, k, v = np.zeros((NQ, D)), np.zeros((NK, D)), np.zeros((NK, DV))
    with pytest.raises(ValueError, match="q and k must have the same head dim"):
        reference.attention(q, np.zeros((NK, D + 1)), v)
    with pytest.raises(ValueError, match=re.escape(f"dout has shape {(NQ, 1)}")):
        reference.attention_backward(np.zeros((NQ, 1)), q, k, v)


@pytest.mark.parametrize("deterministic", [1, "no", None, np.array([False])])
def test_deterministic_must_be_a_bool(deterministic):
    arrays = _arrays()
    out, lse = cupyflash.attention_forward(arrays["q"], arrays["k"], arrays["v"])
    with pytest.raises(TypeError, match=re.escape(f"deterministic must be a bool, got {deterministic!r}")):
        cupyflash.attention_backward(
            arrays["dout"], arrays["q"], arrays["k"], arrays["v"], out, lse, deterministic=deterministic
        )


def test_the_cpu_backward_is_the_same_either_way():
    """deterministic=False changes nothing on the CPU: NumPy's sums run in one order."""
    rng = np.random.default_rng()
    q, k, v, dout = (rng.standard_normal(SHAPES[name], dtype=np.float32) for name in ("q", "k", "v", "dout"))
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    for a, b in zip(
        cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True),
        cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=np.bool_(False)),
    ):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------ arrays NumPy would read
# differently: refused by name, with the fix
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_masked_arrays_and_matrices_are_refused_by_name(name):
    arrays = _arrays(np.float32)
    masked = dict(arrays, **{name: np.ma.masked_array(arrays[name])})
    with pytest.raises(TypeError, match=rf"^{name} is a numpy\.ma\.MaskedArray, whose mask cupyflash would ignore"):
        cupyflash.attention(masked["q"], masked["k"], masked["v"])
    two_d = {n: np.zeros((4, 8), np.float32) for n in ("q", "k", "v")}
    two_d[name] = np.asmatrix(two_d[name])
    with pytest.raises(TypeError, match=rf"^{name} is a numpy\.matrix; pass numpy\.asarray\({name}\)"):
        cupyflash.attention(two_d["q"], two_d["k"], two_d["v"])


def test_other_ndarray_subclasses_are_taken_as_arrays(tmp_path):
    """A memory-mapped array is an array: it runs like its copy."""
    q = np.lib.format.open_memmap(tmp_path / "q.npy", mode="w+", dtype=np.float32, shape=(2, 5, 8))
    q[...] = np.random.default_rng(0).standard_normal(q.shape)
    k = np.random.default_rng(1).standard_normal((2, 7, 8)).astype(np.float32)
    assert np.array_equal(cupyflash.attention(q, k, k), cupyflash.attention(np.array(q), k, k))


def test_big_endian_arrays_are_refused_with_the_fix():
    arrays = _arrays(np.float32)
    q = arrays["q"].astype(">f4")
    with pytest.raises(
        TypeError,
        match=r"^q has dtype >f4, not in this machine's byte order; pass "
        r"q\.astype\(q\.dtype\.newbyteorder\('='\)\)",
    ):
        cupyflash.attention(q, arrays["k"], arrays["v"])
    bias = np.zeros((NQ, NK), ">f4")
    with pytest.raises(TypeError, match=r"^bias has dtype >f4, not in this machine's byte order"):
        cupyflash.attention(arrays["q"], arrays["k"], arrays["v"], bias=bias)
    with pytest.raises(TypeError, match=r"^x has dtype >f4, not in this machine's byte order"):
        cupyflash.quantize_fp8(np.zeros((4, 16), ">f4"))


def test_bias_dtype_message_names_each_dtype_once():
    arrays = _arrays(np.float32)
    with pytest.raises(TypeError, match=r"^bias has dtype float64; expected float32$"):
        cupyflash.attention(arrays["q"], arrays["k"], arrays["v"], bias=np.zeros((NQ, NK)))
    arrays = _arrays(np.float16)
    with pytest.raises(TypeError, match=r"^bias has dtype float64; expected the inputs' dtype float16 or float32$"):
        cupyflash.attention(arrays["q"], arrays["k"], arrays["v"], bias=np.zeros((NQ, NK)))


def test_non_finite_inputs_raise_no_numpy_warnings():
    """NaN and inf in the inputs, and rows that see no key, give the documented NaN, inf and zeros without a
    RuntimeWarning from NumPy reaching the caller (they are errors here), on the CPU path and in the reference."""
    import warnings

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(3))
    k[..., 2, :] = np.inf
    v[..., 4, 0] = np.nan
    dout = np.ones_like(q)
    cache_k, cache_v = np.zeros((1, 2, 8, 8), np.float32), np.zeros((1, 2, 8, 8), np.float32)
    cache_k[..., 1, :] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cupyflash.attention_forward(q, k, v, window=(1, 0))
        cupyflash.attention_backward(dout, q, k, v, out, lse, window=(1, 0))
        reference.attention(q, k, v, window=(1, 0))
        reference.attention_backward(dout, q, k, v, window=(1, 0))
        cupyflash.attention(q, k, v, mask=np.zeros((6, 6), bool))  # no row sees a key: out 0, lse -inf
        cupyflash.merge_attention_states(out, lse, out, np.full_like(lse, -np.inf))
        cupyflash.attention_with_kvcache(q[..., :1, :], cache_k, cache_v, cache_seqlens=3)
    assert np.isnan(out).any() and np.isfinite(out[..., 0, :]).all()
