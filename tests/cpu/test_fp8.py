"""The FP8 forward on NumPy: the e4m3fn encoder against ml_dtypes, quantize_fp8 and FP8Tensor, hadamard_rotate,
the CPU path against a naive dense implementation of the same numerics (ml_dtypes rounding) and against the
float64 reference on the dequantized inputs, the argument errors, and FlashAttention-3's outlier experiment.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from helpers.problems import random_array

import cupyflash
from cupyflash import FP8Tensor, hadamard_rotate, quantize_fp8, reference
from cupyflash._fp8.api import check_compute_capability
from cupyflash._fp8.hadamard import random_signs
from cupyflash._fp8.tensor import DECODE_TABLE, E4M3_MAX, decode_e4m3, encode_e4m3

F8 = ml_dtypes.float8_e4m3fn
BF16 = np.dtype(ml_dtypes.bfloat16)
INPUT_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
DTYPES = dict(INPUT_DTYPES, float64=np.float64)
VALUES = np.arange(0x7F, dtype=np.uint8).view(F8).astype(np.float64)  # the 127 non-negative finite values
MIDPOINTS = (VALUES[:-1] + VALUES[1:]) / 2
# A unit in the last place of out's dtype, relative (the CPU path and the naive round out once each).
OUT_ULP = {np.dtype(ml_dtypes.bfloat16): 2.0**-7, np.dtype(np.float16): 2.0**-10}


def ml_dtypes_codes(y):
    return y.astype(F8).view(np.uint8)


# ------------------------------------------------------------------------------------------ the encoder
def _candidates(dtype):
    """Every e4m3 value and midpoint, each one unit in the last place of ``dtype`` either side, +-."""
    points = np.concatenate([VALUES, MIDPOINTS]).astype(dtype)
    y = np.concatenate([points, np.nextafter(points, dtype(-np.inf)), np.nextafter(points, dtype(np.inf))])
    y = y[np.abs(y) <= E4M3_MAX]
    return np.concatenate([y, -y])


def test_encoder_is_ml_dtypes_on_values_midpoints_and_their_neighbours():
    y = _candidates(np.float32)
    assert (encode_e4m3(y) == ml_dtypes_codes(y)).all()


def test_encoder_is_ml_dtypes_on_random_magnitudes_and_subnormals(rng):
    y = (np.exp2(rng.uniform(-14, np.log2(E4M3_MAX), 200_000)) * rng.choice([-1, 1], 200_000)).astype(np.float32)
    subnormals = np.linspace(-(2.0**-6), 2.0**-6, 4097, dtype=np.float32)  # spacing 2^-9 / 16 around 0
    y = np.concatenate([y, subnormals, np.float32([2.0**-10, 2.0**-10 + 2.0**-30, 3 * 2.0**-10])])
    assert (encode_e4m3(y) == ml_dtypes_codes(y)).all()


def test_encoder_in_float64_rounds_the_float64_value():
    """The CPU path rounds P in float64: below a midpoint down, above it up, on it to the even code."""
    codes = np.arange(126)
    cases = [
        (np.nextafter(MIDPOINTS, -np.inf), codes),
        (np.nextafter(MIDPOINTS, np.inf), codes + 1),
        (MIDPOINTS, codes + (codes & 1)),
    ]
    for y, expected in cases:
        assert (encode_e4m3(y) == expected).all()
        assert (encode_e4m3(-y) == expected + 0x80).all()
    assert (encode_e4m3(VALUES) == np.arange(0x7F)).all()


def test_encoder_saturates_and_keeps_the_sign():
    big = np.float32([448, 448.5, 464, 480, 1e4, 3.4e38])
    assert (encode_e4m3(big) == 0x7E).all() and (encode_e4m3(-big) == 0xFE).all()
    assert encode_e4m3(np.float32([0.0]))[0] == 0x00 and encode_e4m3(np.float32([-0.0]))[0] == 0x80
    tiny = np.float32([2.0**-11, -(2.0**-11)])  # half the smallest subnormal: a tie, to 0 (even)
    assert list(encode_e4m3(tiny)) == [0x00, 0x80] == list(ml_dtypes_codes(tiny))


def test_decode_table():
    codes = np.arange(256, dtype=np.uint8)
    assert np.isnan(DECODE_TABLE[[0x7F, 0xFF]]).all()
    finite = np.isfinite(DECODE_TABLE)
    assert finite.sum() == 254
    assert (DECODE_TABLE[finite] == codes[finite].view(F8).astype(np.float32)).all()
    assert DECODE_TABLE[0x7E] == E4M3_MAX == -DECODE_TABLE[0xFE]
    assert (decode_e4m3(codes, np.float64)[finite] == DECODE_TABLE[finite]).all()


# ------------------------------------------------------------------------------------------ quantize_fp8
def _row_groups(x, block):
    """x (..., N, D) float64 as (..., nb, block * D) groups of rows, padded with zeros."""
    n = x.shape[-2]
    nb = math.ceil(n / block)
    padded = np.zeros(x.shape[:-2] + (nb * block, x.shape[-1]))
    padded[..., :n, :] = x
    return padded.reshape(x.shape[:-2] + (nb, block * x.shape[-1]))


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 77, 40), (3, 300, 64), (2, 1, 128, 96), (256, 1)])
@pytest.mark.parametrize("block", [None, "tensor", 128, 256])
def test_quantize_scales_and_rounding(rng, dtype, shape, block):
    # Rows of very different magnitudes, so that the scales of the blocks differ.
    x = random_array(rng, shape, INPUT_DTYPES[dtype]) * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,)))
    x = x.astype(INPUT_DTYPES[dtype])
    x8 = quantize_fp8(x, block=block)
    *lead, n, d = shape
    lead = tuple(lead)
    rows = {None: n, "tensor": n}.get(block, block)
    nb = math.ceil(n / rows)
    assert x8.block == rows and x8.shape == x.shape and x8.data.dtype == np.uint8 and x8.scale.dtype == np.float32
    assert x8.scale.shape == ((1,) * len(lead) + (1,) if block == "tensor" else lead + (nb,))
    assert x8.data.flags.c_contiguous and x8.scale.flags.c_contiguous
    x32 = x.astype(np.float32)
    amax = np.abs(_row_groups(x32.astype(np.float64), rows)).max(axis=-1)  # (*lead, nb)
    if block == "tensor":
        amax = np.full((1,) * len(lead) + (1,), np.abs(x32).max())
    assert (x8.scale == np.where(amax == 0, 1, (amax.astype(np.float32) / np.float32(448)))).all()
    # The codes are ml_dtypes' rounding of x / scale (float32), and each group's amax lands on +-448.
    y = x32 / np.repeat(x8.scale, rows, axis=-1)[..., :n, None]
    assert (x8.data == ml_dtypes_codes(y)).all()
    group_max = _row_groups((x8.data & 0x7F).astype(np.float64), rows).max(axis=-1)
    assert (group_max.max() if block == "tensor" else group_max == 0x7E).all()
    # Dequantized, every element is within half an e4m3 unit in the last place (2^-4 relative, or half
    # the subnormal spacing 2^-10 times the scale), plus float32 rounding.
    deq = x8.dequantize(np.float64)
    scales = np.repeat(x8.scale.astype(np.float64), rows, axis=-1)[..., :n, None]
    bound = np.maximum(2.0**-4 * np.abs(x32), 2.0**-10 * scales) * (1 + 1e-6)
    assert (np.abs(deq - x32) <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_dtypes(rng, dtype):
    x8 = quantize_fp8(rng.standard_normal((2, 300, 40), dtype=np.float32), block=128)
    exact = DECODE_TABLE.astype(np.float64)[x8.data] * np.repeat(x8.scale.astype(np.float64), 128, -1)[:, :300, None]
    out = x8.dequantize(DTYPES[dtype])
    assert out.dtype == np.dtype(DTYPES[dtype]) and out.shape == x8.shape
    if dtype == "float64":
        assert (out == exact).all()
    else:  # float32 products, rounded once
        assert (out == exact.astype(np.float32).astype(DTYPES[dtype])).all()


def test_quantize_zero_groups_and_empty():
    x = np.zeros((2, 300, 8), np.float32)
    x[1, 200:] = 1.0
    x8 = quantize_fp8(x, block=128)
    assert x8.scale.tolist() == [[1, 1, 1], [1, np.float32(1 / 448), np.float32(1 / 448)]]
    assert (x8.dequantize() == x).all()
    assert quantize_fp8(np.zeros((3, 0, 4), np.float32)).scale.shape == (3, 0)
    assert quantize_fp8(np.zeros((3, 0, 4), np.float32)).block == 1
    assert quantize_fp8(np.zeros((0, 5, 4), np.float32), block="tensor").scale.tolist() == [[1.0]]
    assert quantize_fp8(np.zeros((2, 5, 0), np.float32)).scale.tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize(
    "block, error",
    [(0, ValueError), (100, ValueError), (-128, ValueError), (1.5, TypeError), ("x", ValueError), (True, TypeError)],
)
def test_quantize_rejects_bad_blocks(block, error):
    with pytest.raises(error, match="block must be"):
        quantize_fp8(np.ones((4, 8), np.float32), block=block)


def test_quantize_rejects_bad_inputs():
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((2, 4, 8), np.float32)
        x[1, 2, 3] = bad
        with pytest.raises(ValueError, match="finite"):
            quantize_fp8(x)
    with pytest.raises(TypeError, match="dtype int32"):
        quantize_fp8(np.ones((4, 8), np.int32))
    with pytest.raises(TypeError, match="dtype float64"):
        quantize_fp8(np.ones((4, 8)))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_fp8(np.ones(8, np.float32))
    with pytest.raises(TypeError, match="numpy.ndarray or a cupy.ndarray"):
        quantize_fp8([[1.0]])


def test_fp8_tensor_holder(rng):
    x8 = quantize_fp8(rng.standard_normal((2, 3, 300, 16), dtype=np.float32), block=128)
    assert repr(x8) == "FP8Tensor(shape=(2, 3, 300, 16), scale=(2, 3, 3), block=128, numpy)"
    assert x8.ndim == 4 and x8.nbytes == 2 * 3 * 300 * 16 + 2 * 3 * 3 * 4 and x8.xp is np
    with pytest.raises(AttributeError, match="immutable"):
        x8.block = 256
    same = FP8Tensor(x8.data, x8.scale, np.int64(128))
    assert same.block == 128 and type(same.block) is int
    FP8Tensor(x8.data, np.ones((1, 1, 3), np.float32), 128)  # a per-tensor scale
    FP8Tensor(x8.data, np.ones((2, 3, 1), np.float32), 300)  # one scale per slice; more rows than N too:
    FP8Tensor(x8.data, np.ones((2, 3, 1), np.float32), 1000)
    wide = x8.broadcast_to((4, 2, 3))
    assert wide.shape == (4, 2, 3, 300, 16) and wide.scale.shape == (4, 2, 3, 3)
    assert (wide.dequantize()[1] == x8.dequantize()).all() and x8.broadcast_to((2, 3)) is x8


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((np.zeros((4, 8), np.int8), np.ones(1, np.float32), 4), TypeError, "data has dtype int8; expected uint8"),
        (
            (np.zeros((4, 8), np.uint8), np.ones(1, np.float64), 4),
            TypeError,
            "scale has dtype float64; expected float32",
        ),
        ((np.zeros(8, np.uint8), np.ones(1, np.float32), 4), ValueError, "at least 2 dims"),
        (
            (np.zeros((4, 8), np.uint8), np.ones(2, np.float32), 4),
            ValueError,
            r"scale has shape \(2,\); expected \(1,\)",
        ),
        ((np.zeros((2, 4, 8), np.uint8), np.ones((3, 1), np.float32), 4), ValueError, r"expected \(2, 1\)"),
        ((np.zeros((300, 8), np.uint8), np.ones(3, np.float32), 100), ValueError, "multiple of 128"),
        ((np.zeros((4, 8), np.uint8), np.ones(1, np.float32), 0), ValueError, "block must be a positive int"),
        ((np.zeros((4, 8), np.uint8), np.ones(1, np.float32), 4.0), TypeError, "block must be an int, got 4.0"),
        ((np.zeros((8, 4), np.uint8).T, np.ones(1, np.float32), 4), ValueError, "data must be C-contiguous"),
        ((np.zeros((4, 8), np.uint8), [1.0], 4), TypeError, "scale must be a numpy.ndarray"),
    ],
)
def test_fp8_tensor_rejects(args, error, match):
    with pytest.raises(error, match=match):
        FP8Tensor(*args)


def test_dequantize_rejects_other_dtypes():
    with pytest.raises(TypeError, match="dtype is int32"):
        quantize_fp8(np.ones((4, 8), np.float32)).dequantize(np.int32)


# ------------------------------------------------------------------------------------------ hadamard_rotate
def _hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _rotation_matrix(d, seed):
    """M = diag(signs) . blockdiag(H_n / sqrt(n)) over D's binary powers of two, largest first."""
    m, start = np.zeros((d, d)), 0
    for bit in reversed(range(d.bit_length())):
        if d >> bit & 1:
            n = 1 << bit
            m[start : start + n, start : start + n] = _hadamard(n) / np.sqrt(n)
            start += n
    return random_signs(d, seed)[:, None] * m


@pytest.mark.parametrize("d", [1, 3, 40, 96, 128, 200, 256])
def test_hadamard_rotate_is_x_times_m(rng, d):
    x = rng.standard_normal((2, 5, d))
    m = _rotation_matrix(d, seed=11)
    assert np.allclose(m @ m.T, np.eye(d), atol=1e-12)
    assert np.allclose(hadamard_rotate(x, seed=11), x @ m, rtol=1e-12, atol=1e-12)
    assert np.allclose(hadamard_rotate(np.eye(d), seed=11), m, atol=1e-15)
    if d == 96:  # 64 + 32: two blocks
        assert (m[:64, 64:] == 0).all() and (m[64:, :64] == 0).all()


@pytest.mark.parametrize("d", [1, 3, 96, 128, 256])
def test_hadamard_rotate_keeps_norms_and_scores(rng, d):
    q, k = rng.standard_normal((3, 50, d), dtype=np.float32), rng.standard_normal((3, 70, d), dtype=np.float32)
    qr, kr = hadamard_rotate(q, seed=5), hadamard_rotate(k, seed=5)
    assert qr.dtype == np.float32
    scores = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)
    atol = 1e-5 * np.sqrt(d) * np.abs(q).max() * np.abs(k).max()
    assert np.abs(qr.astype(np.float64) @ kr.astype(np.float64).swapaxes(-1, -2) - scores).max() <= atol
    norms = np.linalg.norm(q.astype(np.float64), axis=-1)
    assert np.allclose(np.linalg.norm(qr.astype(np.float64), axis=-1), norms, rtol=1e-5)


def test_hadamard_rotate_seeds(rng):
    x = rng.standard_normal((4, 64), dtype=np.float32)
    assert (hadamard_rotate(x, seed=3) == hadamard_rotate(x, seed=np.int64(3))).all()
    assert (hadamard_rotate(x) == hadamard_rotate(x, seed=0)).all()
    assert not np.allclose(hadamard_rotate(x, seed=3), hadamard_rotate(x, seed=4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_rotate_dtypes(rng, dtype):
    x = random_array(rng, (2, 3, 10, 96), DTYPES[dtype])
    out = hadamard_rotate(x, seed=1)
    assert out.dtype == np.dtype(DTYPES[dtype]) and out.shape == x.shape
    exact = x.astype(np.float64) @ _rotation_matrix(96, 1)
    ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}[dtype]
    # One rounding to the dtype, plus float32 arithmetic over log2(64) = 6 butterfly passes.
    atol = (ulp + 8 * 2.0**-24) * np.abs(exact).max() * 2
    assert np.abs(out.astype(np.float64) - exact).max() <= atol
    assert hadamard_rotate(x[..., :0]).shape == x[..., :0].shape


def test_hadamard_rotate_rejects():
    with pytest.raises(TypeError, match="dtype int64"):
        hadamard_rotate(np.ones((2, 4), np.int64))
    with pytest.raises(ValueError, match="at least 1 dim"):
        hadamard_rotate(np.ones((), np.float32))
    for seed in (1.5, "a", True, None):
        with pytest.raises(TypeError, match="seed must be an int"):
            hadamard_rotate(np.ones((2, 4), np.float32), seed=seed)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        hadamard_rotate([1.0, 2.0])


# ------------------------------------------------------------------------------------------ attention
def naive_fp8_attention(q8, k8, v8, *, causal, scale=None, out_dtype=BF16):
    """The FP8 forward's numerics written out densely (whole rows at once, float64), rounding P with
    ml_dtypes: the test's independent implementation. Lead dims broadcast by NumPy."""
    d, nq, nk = q8.shape[-1], q8.shape[-2], k8.shape[-2]
    scale = 1 / np.sqrt(d) if scale is None else scale

    def parts(x8):
        values = x8.data.view(F8).astype(np.float64)
        rows = np.repeat(x8.scale.astype(np.float64), x8.block, axis=-1)[..., : x8.shape[-2]]
        return values, rows

    (qd, sq), (kd, sk), (vd, sv) = (parts(x) for x in (q8, k8, v8))
    s = scale * (qd @ kd.swapaxes(-1, -2)) * sq[..., :, None] * sk[..., None, :]
    if causal:
        s = np.where(np.tri(nq, nk, nk - nq, dtype=bool), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0))
    row_sum = p.sum(axis=-1, keepdims=True)
    p8 = (p * 256).astype(F8).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(seen, (p8 @ (vd * sv[..., :, None])) / (256 * row_sum), 0)
        lse = np.where(seen, m + np.log(row_sum), -np.inf)[..., 0]
    return out.astype(out_dtype), lse.astype(np.float32)


def _holders(rng, shapes, blocks, dtype=np.float32):
    """FP8Tensors of standard normal data (times a random magnitude per row) of the given shapes."""
    held = []
    for shape, block in zip(shapes, blocks):
        x = rng.standard_normal(shape, dtype=np.float32) * np.exp(rng.uniform(-1, 1, shape[:-1] + (1,)))
        held.append(quantize_fp8(x.astype(np.float32).astype(dtype), block=block))
    return held


def _rms(x):
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def _check_against_naive_and_reference(q8, k8, v8, *, causal, scale=None, out_dtype=None):
    out, lse = cupyflash.attention_forward(q8, k8, v8, causal=causal, scale=scale, out_dtype=out_dtype)
    out_dtype = np.dtype(BF16 if out_dtype is None else out_dtype)
    naive_out, naive_lse = naive_fp8_attention(q8, k8, v8, causal=causal, scale=scale, out_dtype=out_dtype)
    assert out.dtype == out_dtype and lse.dtype == np.float32 and out.shape == naive_out.shape
    out64, naive64 = out.astype(np.float64), naive_out.astype(np.float64)
    # The same numerics: out within a unit in the last place (each is rounded once), lse to float32.
    assert np.abs(out64 - naive64).max(initial=0) <= OUT_ULP[out_dtype] * np.abs(naive64).max(initial=0) + 1e-30
    assert np.array_equal(np.isneginf(lse), np.isneginf(naive_lse))
    assert np.allclose(lse, naive_lse, rtol=1e-6, atol=1e-6)
    # Against float64 attention on the dequantized inputs: only the rounding of P (and of out) is left. P
    # keeps 3 mantissa bits, up to 2^-4 relative per probability: these cases measure 0.1% to 2.3% RMSE.
    ref, ref_lse = reference.attention(
        *(x.dequantize(np.float64) for x in (q8, k8, v8)), causal=causal, scale=scale, return_lse=True
    )
    error, naive_error = _rms(out64 - ref), _rms(naive64 - ref)
    assert error <= 5e-2 * _rms(ref)
    assert error <= 2 * naive_error + OUT_ULP[out_dtype] * _rms(ref)
    assert np.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    return out, lse


# (lead q, lead k/v, Nq, Nk, D, Dv, causal, blocks of q, k, v)
CASES = [
    ((1,), (1,), 1, 1, 1, 1, False, (None, None, None)),
    ((2, 3), (2, 3), 77, 77, 40, 40, True, (None, None, None)),
    ((2, 3), (2, 3), 77, 300, 64, 64, False, ("tensor", "tensor", "tensor")),
    ((1, 2), (1, 2), 300, 77, 96, 64, True, (128, None, "tensor")),  # rows 0..222 see no key
    ((1, 2), (1, 2), 300, 300, 128, 128, True, (128, 128, 128)),
    ((2,), (2,), 77, 300, 128, 40, True, (None, 256, 128)),
    ((1, 1), (1, 1), 513, 700, 64, 64, False, (256, 128, 256)),
    ((2, 2, 3), (2, 2, 1), 77, 77, 64, 64, True, (None, None, None)),  # GQA by broadcasting
    ((2, 2, 3), (2, 2, 1), 150, 300, 40, 40, False, (128, "tensor", 128)),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}x{c[3]}-D{c[4]}-Dv{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}"
)
def test_attention_fp8_matches_naive_and_reference(rng, case):
    lead_q, lead_kv, nq, nk, d, dv, causal, blocks = case
    q8, k8, v8 = _holders(rng, [lead_q + (nq, d), lead_kv + (nk, d), lead_kv + (nk, dv)], blocks)
    out, lse = _check_against_naive_and_reference(q8, k8, v8, causal=causal)
    if causal and nq > nk:  # rows that see no key
        blind = nq - nk
        assert (out[..., :blind, :].astype(np.float32) == 0).all() and np.isneginf(lse[..., :blind]).all()
        assert np.isfinite(lse[..., blind:]).all()


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize(
    "out_dtype",
    [np.float16, ml_dtypes.bfloat16, "float16", "bfloat16"],
    ids=["float16", "bfloat16", "'float16'", "'bfloat16'"],
)
def test_attention_fp8_dtypes_and_scale(rng, dtype, out_dtype):
    q8, k8, v8 = _holders(rng, [(2, 200, 64), (2, 300, 64), (2, 300, 32)], (None, 128, 256), INPUT_DTYPES[dtype])
    out, _ = _check_against_naive_and_reference(q8, k8, v8, causal=True, scale=0.3, out_dtype=out_dtype)
    default = cupyflash.attention(q8, k8, v8, causal=True, out_dtype=out_dtype)
    explicit = cupyflash.attention(q8, k8, v8, causal=True, scale=1 / 8, out_dtype=out_dtype)
    assert np.array_equal(default.view(np.uint16), explicit.view(np.uint16))
    assert not np.array_equal(out.view(np.uint16), default.view(np.uint16))


def test_attention_fp8_broadcast_equals_repeated_holders(rng):
    q8, k8, v8 = _holders(rng, [(2, 2, 3, 100, 64), (2, 2, 1, 130, 64), (1, 2, 1, 130, 64)], (None, 128, "tensor"))
    out, lse = cupyflash.attention_forward(q8, k8, v8, causal=True)
    lead = (2, 2, 3)
    k_full, v_full = (x.broadcast_to(lead) for x in (k8, v8))
    k_full, v_full = (
        FP8Tensor(np.ascontiguousarray(x.data), np.ascontiguousarray(x.scale), x.block) for x in (k_full, v_full)
    )
    out_full, lse_full = cupyflash.attention_forward(q8, k_full, v_full, causal=True)
    assert np.array_equal(out.view(np.uint16), out_full.view(np.uint16)) and np.array_equal(lse, lse_full)


@pytest.mark.parametrize(
    "shapes",
    [
        [(0, 3, 10, 8), (0, 3, 12, 8), (0, 3, 12, 16)],
        [(2, 0, 8), (2, 12, 8), (2, 12, 16)],
        [(2, 10, 8), (2, 0, 8), (2, 0, 16)],
    ],
)
def test_attention_fp8_empty(shapes):
    q8, k8, v8 = (quantize_fp8(np.ones(s, np.float32)) for s in shapes)
    out, lse = cupyflash.attention_forward(q8, k8, v8, out_dtype=np.float16)
    batch, nq = np.broadcast_shapes(shapes[0][:-2], shapes[1][:-2]), shapes[0][-2]
    assert out.shape == batch + (nq, 16) and out.dtype == np.float16 and (out == 0).all()
    assert lse.shape == batch + (nq,) and lse.dtype == np.float32 and np.isneginf(lse).all()


# ------------------------------------------------------------------------------------------ API errors
def _three(rng):
    return _holders(rng, [(2, 10, 16), (2, 12, 16), (2, 12, 8)], (None, None, None))


def test_mixing_fp8_and_arrays_is_a_type_error(rng):
    q8, k8, v8 = _three(rng)
    k = k8.dequantize()
    with pytest.raises(TypeError, match="q, v are FP8Tensors but k is not"):
        cupyflash.attention_forward(q8, k, v8)
    with pytest.raises(TypeError, match="q is an FP8Tensor but k, v are not"):
        cupyflash.attention(q8, k, v8.dequantize())
    with pytest.raises(TypeError, match="k is an FP8Tensor but q, v are not"):
        cupyflash.attention(q8.dequantize(), k8, v8.dequantize())


@pytest.mark.parametrize(
    "option",
    [
        dict(window=(4, 0)),
        dict(softcap=30.0),
        dict(alibi_slopes=np.ones(2, np.float32)),
        dict(bias=np.zeros((10, 12), np.float32)),
        dict(mask=np.ones((10, 12), bool)),
        dict(block_mask=np.ones((1, 1), bool)),
        dict(dropout_p=0.1, dropout_seed=1),
    ],
)
def test_unsupported_options(rng, option):
    (name,) = [n for n in option if n != "dropout_seed"]
    for function in (cupyflash.attention, cupyflash.attention_forward):
        with pytest.raises(ValueError, match=f"^{name} is not supported with FP8 inputs$"):
            function(*_three(rng), **option)


def test_out_dtype_misuse(rng):
    q8, k8, v8 = _three(rng)
    for bad in (np.float32, "float64", "fp8", np.int8):
        with pytest.raises(ValueError, match="out_dtype must be bfloat16"):
            cupyflash.attention(q8, k8, v8, out_dtype=bad)
    q, k, v = (x.dequantize() for x in (q8, k8, v8))
    for function in (cupyflash.attention, cupyflash.attention_forward):  # other inputs: theirs or the accumulator's
        with pytest.raises(ValueError, match="out_dtype for float32 inputs must be None or float32"):
            function(q, k, v, out_dtype=np.float16)


def test_shape_and_option_checks(rng):
    q8, k8, v8 = _three(rng)
    with pytest.raises(ValueError, match="same head dim D"):
        cupyflash.attention(q8, quantize_fp8(np.ones((2, 12, 8), np.float32)), v8)
    with pytest.raises(ValueError, match="same number of keys Nk"):
        cupyflash.attention(q8, k8, quantize_fp8(np.ones((2, 11, 8), np.float32)))
    with pytest.raises(ValueError, match="do not broadcast"):
        cupyflash.attention(quantize_fp8(np.ones((3, 10, 16), np.float32)), k8, v8)
    with pytest.raises(ValueError, match="supported head dims are 1 to 256"):
        wide = quantize_fp8(np.ones((2, 12, 300), np.float32))
        cupyflash.attention(q8, k8, wide)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cupyflash.attention(q8, k8, v8, causal=1)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        cupyflash.attention(q8, k8, v8, scale=-1.0)


def test_backward_rejects_fp8(rng):
    q8, k8, v8 = _three(rng)
    out, lse = cupyflash.attention_forward(q8, k8, v8)
    q, k, v = (x.dequantize() for x in (q8, k8, v8))
    message = "attention_backward does not take FP8 inputs: the FP8 forward has no backward"
    for args in ((q8, k8, v8), (q, k8, v), (q, k, v8)):
        with pytest.raises(TypeError, match=message):
            cupyflash.attention_backward(out.astype(np.float32), *args, out.astype(np.float32), lse)


def test_compute_capability_check():
    """The GPU path's check, by itself (the GPU tests run it on a device)."""
    check_compute_capability("90")
    with pytest.raises(RuntimeError, match="this device is 10.0$"):  # sm_90a code runs on 9.0 alone
        check_compute_capability("100")
    with pytest.raises(
        RuntimeError,
        match=r"needs a Hopper GPU \(compute capability 9.0, FP8 wgmma\); "
        r"this device is 8.0$",
    ):
        check_compute_capability("80")
    with pytest.raises(RuntimeError, match="this device is 8.9$"):
        check_compute_capability("89")


# ------------------------------------------------------------------------------------------ outliers
def _with_outliers(rng, shape):
    """N(0, 1) plus, for 0.1% of the elements, N(0, 10^2): FlashAttention-3's outlier features."""
    outliers = rng.standard_normal(shape) * 10 * (rng.random(shape) < 0.001)
    return (rng.standard_normal(shape) + outliers).astype(np.float32)


def test_outliers_block_scales_and_rotation_beat_per_tensor_scales(rng):
    """FlashAttention-3's experiment at D = 128, N = 1024 (4 heads): block quantization (128 rows) of
    Hadamard-rotated q and k has a clearly smaller RMSE against float64 attention on the unquantized inputs
    than per-tensor scales without rotation (ratios of 0.57 to 0.73 over 20 seeds: docs/fp8.md)."""
    q, k, v = (_with_outliers(rng, (1, 4, 1024, 128)) for _ in range(3))
    ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
    plain = cupyflash.attention(*(quantize_fp8(x, block="tensor") for x in (q, k, v)))
    qr, kr = (hadamard_rotate(x, seed=7) for x in (q, k))
    rotated = cupyflash.attention(*(quantize_fp8(x, block=128) for x in (qr, kr, v)))
    plain_error, rotated_error = (_rms(x.astype(np.float64) - ref) for x in (plain, rotated))
    assert rotated_error < 0.8 * plain_error
    assert plain_error < 0.15 * _rms(ref)


def test_a_block_past_n_is_one_scale_per_slice(rng):
    """A block of any length at least N stands for one scale per slice: dequantize and the CPU path never
    spread the scale past N rows (2^40 rows would not fit in memory)."""
    x = rng.standard_normal((2, 3, 77, 16), dtype=np.float32)
    x8 = quantize_fp8(x)
    huge = FP8Tensor(x8.data, x8.scale, 2**40)
    assert np.array_equal(huge.dequantize(), x8.dequantize())
    assert np.array_equal(
        cupyflash.attention(huge, huge, huge, causal=True).view(np.uint16),
        cupyflash.attention(x8, x8, x8, causal=True).view(np.uint16),
    )


# ------------------------------------------------------------------------------------------ the descale's block
def test_division_magic_is_floor_division_below_2_to_the_31(rng):
    """The kernel finds a row's descale block as (row * magic) >> shift in 64 bits: exact for every divisor it
    can be given and every row below 2**31, the magic a 32-bit unsigned value and the product below 2**64."""
    from cupyflash._cuda.fp8 import division_magic

    divisors = np.concatenate(
        [
            np.arange(1, 1025),
            128 * np.arange(1, 513),
            2 ** np.arange(31) - 1,
            2 ** np.arange(31),
            rng.integers(1, 2**31, 200),
        ]
    )
    for d in (int(x) for x in divisors if 1 <= x < 2**31):
        magic, shift = division_magic(d)
        assert 0 < magic < 2**32 and shift < 64
        multiples = d * np.arange(0, 2**31 // d, max(1, 2**31 // d // 64))
        rows = np.concatenate([multiples, rng.integers(0, 2**31, 64)])
        rows = np.unique(np.concatenate([rows, rows - 1, rows + 1, [2**31 - 1]]))
        rows = rows[(rows >= 0) & (rows < 2**31)].astype(object)  # Python ints: the product is exact
        got = np.array([(int(r) * magic) >> shift for r in rows])
        assert np.array_equal(got, np.array([int(r) // d for r in rows])), d
        assert max(int(r) * magic for r in rows) < 2**64


def test_division_magic_refuses_divisors_outside_its_range():
    from cupyflash._cuda.fp8 import division_magic

    for d in (0, -3, 2**31):
        with pytest.raises(ValueError, match="divisor must be in"):
            division_magic(d)
