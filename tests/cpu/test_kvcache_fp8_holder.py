"""FP8 key/value caches themselves: FP8KVCache and quantize_kvcache for each scale layout, dequantize, the append
rule (saturation beyond a scale, a block's scale set by the call that writes its first position) on the CPU path
and in the reference alike, the reference's reading and rounding of e4m3, and the errors for bad holders and
calls (their messages checked).
"""

import re

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash._fp8.tensor import encode_e4m3
from cupyflash._kvcache.reference import _e4m3_codes

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
HEADROOM_DIVISOR = np.float32(28)  # 448 / 16
E4M3 = ml_dtypes.float8_e4m3fn


def _values(codes):
    return codes.view(E4M3).astype(np.float64)


def _expected_scales(x, scaling):
    """amax / 28 per group, written out group by group (1 for a group of zeros)."""
    dim0, hk, n, _ = x.shape
    a = np.abs(x.astype(np.float32))
    if scaling == "tensor":
        amax = np.full((1, 1, 1), a.max())
    elif scaling == "head":
        amax = a.max(axis=(0, 2, 3)).reshape(1, hk, 1)
    else:
        blocks = [a[:, :, i : i + 128].max(axis=(2, 3)) for i in range(0, n, 128)]
        amax = np.stack(blocks, axis=2)
    return np.where(amax == 0, np.float32(1), amax.astype(np.float32) / HEADROOM_DIVISOR).astype(np.float32)


# ------------------------------------------------------------------------------------ quantize_kvcache
@pytest.mark.parametrize("shape", [(2, 3, 300, 40), (5, 1, 128, 3), (1, 2, 129, 1), (4, 2, 1, 16)], ids=str)
@pytest.mark.parametrize("scaling", ["tensor", "head", "block"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_quantize_each_layout(rng, dtype, scaling, shape):
    """Scales of amax / 28 per group; codes the nearest e4m3 of x / scale (float32 division), by the reference's
    own rounding; dequantize within half an e4m3 step."""
    x = (rng.standard_normal(shape, dtype=np.float32) * np.exp(rng.uniform(-3, 3, shape[:3] + (1,)))).astype(dtype)
    x8 = cupyflash.quantize_kvcache(x, scaling)
    scale = _expected_scales(x, scaling)
    assert x8.scaling == scaling and x8.data.dtype == np.uint8 and x8.shape == shape
    np.testing.assert_array_equal(x8.scale, scale)
    per_position = np.repeat(scale, 128, axis=2)[:, :, : shape[2], None] if scaling == "block" else scale[..., None]
    np.testing.assert_array_equal(x8.data, _e4m3_codes(x.astype(np.float32) / per_position))
    values, x64 = x8.dequantize(np.float64), x.astype(np.float64)
    assert (np.abs(values - x64) <= 2.0**-4 * np.abs(x64) + 2.0**-10 * per_position).all()
    assert np.abs(values).max() <= 28 * scale.max() * (1 + 2.0**-4)  # the headroom: nothing near 448


def test_quantize_keeps_the_memory_order(rng):
    """A FlashAttention (B, S, Hk, D) storage seen as (B, Hk, S, D) gives codes in the storage's order."""
    storage = rng.standard_normal((2, 200, 3, 16), dtype=np.float32)
    x8 = cupyflash.quantize_kvcache(storage.transpose(0, 2, 1, 3))
    assert x8.data.transpose(0, 2, 1, 3).flags.c_contiguous
    np.testing.assert_array_equal(
        x8.dequantize(), cupyflash.quantize_kvcache(storage.transpose(0, 2, 1, 3).copy()).dequantize()
    )


def test_quantize_zeros_and_empty():
    x8 = cupyflash.quantize_kvcache(np.zeros((2, 2, 130, 8), np.float16))
    assert (x8.scale == 1).all() and not x8.data.any()
    empty = cupyflash.quantize_kvcache(np.zeros((2, 2, 0, 8), np.float32), "head")
    assert empty.scale.shape == (1, 2, 1) and empty.dequantize().shape == (2, 2, 0, 8)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_dequantize(rng, dtype):
    """e4m3(code) * scale: exact in float64, rounded once (from the float32 product) to the others."""
    x8 = cupyflash.quantize_kvcache(rng.standard_normal((3, 2, 260, 24), dtype=np.float32), "block")
    exact = _values(x8.data) * np.repeat(x8.scale.astype(np.float64), 128, axis=2)[:, :, :260, None]
    got = x8.dequantize(np.dtype(dtype) if dtype != "bfloat16" else ml_dtypes.bfloat16)
    assert got.dtype.name == dtype
    rounded = exact if dtype == "float64" else exact.astype(np.float32).astype(got.dtype)
    np.testing.assert_array_equal(got, rounded)
    with pytest.raises(TypeError, match="dtype is int32; expected float16, bfloat16"):
        x8.dequantize(np.int32)


# ------------------------------------------------------------------------------------ holder errors
def _holder(shape=(4, 2, 300, 8), scale_shape=(4, 2, 3), scaling="block", data_dtype=np.uint8, scale_dtype=np.float32):
    return np.zeros(shape, data_dtype), np.ones(scale_shape, scale_dtype), scaling


SHAPE_BLOCK = "scale has shape (4, 2, 2); expected (4, 2, 3) or (4, 2, 1) for scaling='block' (one per head and block"
HOLDER_ERRORS = {
    "data dtype": (_holder(data_dtype=np.float16), TypeError, "data has dtype float16; expected uint8 (the bytes of"),
    "scale dtype": (_holder(scale_dtype=np.float16), TypeError, "scale has dtype float16; expected float32"),
    "data dims": (_holder(shape=(4, 300, 8)), ValueError, "data must have 4 dims (B, Hk, Ncache, D) or (num_pages,"),
    "scaling": (_holder(scaling="page"), ValueError, "scaling must be one of 'tensor', 'head', 'block', got 'page'"),
    "block scale shape": (_holder(scale_shape=(4, 2, 2)), ValueError, SHAPE_BLOCK),
    "head scale shape": (
        _holder(scale_shape=(4, 2, 1), scaling="head"),
        ValueError,
        "scale has shape (4, 2, 1); expected (1, 2, 1) for scaling='head' (one per key/value head)",
    ),
    "tensor scale shape": (
        _holder(scale_shape=(1, 2, 1), scaling="tensor"),
        ValueError,
        "expected (1, 1, 1) for scaling='tensor' (one scale for the whole cache) with data of shape (4, 2, 300, 8)",
    ),
    "scale strides": (
        (np.zeros((4, 2, 300, 8), np.uint8), np.ones((4, 3, 2), np.float32).transpose(0, 2, 1), "block"),
        ValueError,
        "scale must be C-contiguous",
    ),
    "data strides": (
        (np.zeros((4, 2, 300, 16), np.uint8)[..., ::2], np.ones((4, 2, 3), np.float32), "block"),
        ValueError,
        "data must have a contiguous last dim (stride 1 byte)",
    ),
    "scale type": (
        (np.zeros((4, 2, 300, 8), np.uint8), [1.0], "tensor"),
        TypeError,
        "scale must be a numpy.ndarray or a cupy.ndarray, got builtins.list",
    ),
}


@pytest.mark.parametrize("case", HOLDER_ERRORS)
def test_holder_errors(case):
    arguments, error, message = HOLDER_ERRORS[case]
    with pytest.raises(error, match=re.escape(message)):
        cupyflash.FP8KVCache(*arguments)


def test_holder_is_not_rebound():
    x8 = cupyflash.FP8KVCache(*_holder())
    with pytest.raises(AttributeError, match="cannot set scale"):
        x8.scale = np.ones((4, 2, 3), np.float32)
    assert x8.block == 128 and cupyflash.FP8KVCache(*_holder(scale_shape=(4, 2, 1))).block == 300


@pytest.mark.parametrize(
    "x, scaling, error, message",
    [
        (np.zeros((2, 2, 8, 4)), "block", TypeError, "cache has dtype float64; expected float16, bfloat16"),
        (np.zeros((2, 8, 4), np.float32), "block", ValueError, r"cache must have 4 dims"),
        (np.full((2, 2, 8, 4), np.nan, np.float32), "block", ValueError, "cache holds NaN or infinite values"),
        (np.zeros((2, 2, 8, 4), np.float32), "channel", ValueError, "scaling must be one of 'tensor', 'head', 'block'"),
    ],
    ids=["dtype", "dims", "nan", "scaling"],
)
def test_quantize_errors(x, scaling, error, message):
    with pytest.raises(error, match=message):
        cupyflash.quantize_kvcache(x, scaling)


# ------------------------------------------------------------------------------------ the append rule
def _empty(shape, scaling, scale=1.0):
    """An empty holder: zero codes, every scale ``scale``."""
    dim0, hk, n, _ = shape
    scale_shape = {"tensor": (1, 1, 1), "head": (1, hk, 1), "block": (dim0, hk, -(-n // 128))}[scaling]
    return cupyflash.FP8KVCache(np.zeros(shape, np.uint8), np.full(scale_shape, scale, np.float32), scaling)


def _append(k_cache, v_cache, k, v, seqlens, **options):
    """Append k, v with attention_with_kvcache (in place), after the reference appended them to copies: the two
    must agree bit for bit, codes and scales. Returns the caches."""
    copies = [cupyflash.FP8KVCache(x.data.copy(), x.scale.copy(), x.scaling) for x in (k_cache, v_cache)]
    q = np.zeros((k.shape[0], k.shape[1], 1, k.shape[3]), k.dtype)
    *_, ref_k, ref_v = reference.attention_with_kvcache(
        q, *copies, k, v, cache_seqlens=seqlens, return_caches=True, **options
    )
    cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **options)
    for ours, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        np.testing.assert_array_equal(ours.scale, ref.scale)
        np.testing.assert_array_equal(ours.data, ref.data)
    return k_cache, v_cache


@pytest.mark.parametrize("scaling", ["tensor", "head"])
def test_shared_scales_saturate(rng, scaling):
    """Shared scales ("tensor", "head") never change: values beyond 448 scale are stored as +-448 scale, the
    rest rounded as usual."""
    shape = (2, 2, 10, 8)
    k_cache, v_cache = _empty(shape, scaling, 0.01), _empty(shape, scaling, 0.01)
    k = rng.standard_normal((2, 2, 3, 8), dtype=np.float32)
    k[0, 1, 2, 5], k[1, 0, 0, 0] = 1000 * 0.01, -5.0  # 1000 and -500 units of the scale
    _append(k_cache, v_cache, k, k, [4, 0])
    assert (k_cache.scale == np.float32(0.01)).all()
    stored = k_cache.dequantize(np.float64)
    assert stored[0, 1, 6, 5] == 448 * np.float64(np.float32(0.01)) and k_cache.data[0, 1, 6, 5] == 0x7E
    assert stored[1, 0, 0, 0] == -448 * np.float64(np.float32(0.01)) and k_cache.data[1, 0, 0, 0] == 0xFE
    inside = np.abs(k) < 4
    assert (np.abs(stored[0, :, 4:7] - k[0])[inside[0]] <= 2.0**-4 * np.abs(k[0][inside[0]]) + 1e-5).all()


def test_first_position_sets_a_block_scale_later_ones_saturate(rng):
    """A block's scale comes from the rows of the call that writes its first position, per head; a later call
    writing into the block keeps that scale and saturates beyond it."""
    shape = (1, 2, 300, 8)
    k_cache, v_cache = _empty(shape, "block", 7.0), _empty(shape, "block", 7.0)
    first = rng.standard_normal((1, 2, 2, 8), dtype=np.float32)
    _append(k_cache, v_cache, first, first, [128])  # positions 128, 129: block 1's first position
    amax = np.abs(first[0]).max(axis=(1, 2))
    np.testing.assert_array_equal(k_cache.scale[0, :, 1], amax / HEADROOM_DIVISOR)
    np.testing.assert_array_equal(k_cache.scale[0, :, [0, 2]], 7.0)  # the other blocks untouched
    assert np.abs(k_cache.data[0, :, 128:130].view(E4M3).astype(np.float32)).max() == 28  # amax at 28 units
    later = np.full((1, 2, 1, 8), 20.0, np.float32) * amax[None, :, None, None]  # 20x the amax: 560 units
    _append(k_cache, v_cache, later, later, [130])
    np.testing.assert_array_equal(k_cache.scale[0, :, 1], amax / HEADROOM_DIVISOR)
    np.testing.assert_array_equal(k_cache.data[0, :, 130], 0x7E)  # 448 units: saturated


def test_an_append_across_a_block_boundary(rng):
    """Positions 126 .. 129 in one call: 126 and 127 with block 0's scale as it was (saturating), block 1's scale
    from rows 128 and 129 only."""
    shape = (2, 1, 256, 4)
    k_cache, v_cache = _empty(shape, "block", 0.001), _empty(shape, "block", 0.001)
    k = rng.standard_normal((2, 1, 4, 4), dtype=np.float32)
    k[:, :, 2:] *= 0.01  # block 1's rows small: its scale must not see rows 126, 127
    _append(k_cache, v_cache, k, k, [126, 0])
    np.testing.assert_array_equal(
        k_cache.scale[0, 0], [np.float32(0.001), np.abs(k[0, 0, 2:]).max() / HEADROOM_DIVISOR]
    )
    assert (np.abs(_values(k_cache.data[0, 0, 126:128])) == 448)[np.abs(k[0, 0, :2]) > 0.449].all()
    np.testing.assert_array_equal(k_cache.scale[1, 0], [np.abs(k[1]).max() / HEADROOM_DIVISOR, np.float32(0.001)])


def test_a_call_that_misses_a_block_start_keeps_its_scale(rng):
    """Slots 1 .. 127 written, slot 0 not: the block keeps its scale (only writing the first position sets it)."""
    shape = (1, 1, 128, 4)
    k_cache, v_cache = _empty(shape, "block", 0.5), _empty(shape, "block", 0.5)
    k = rng.standard_normal((1, 1, 127, 4), dtype=np.float32)
    _append(k_cache, v_cache, k, k, [1])
    assert (k_cache.scale == 0.5).all()


@pytest.mark.parametrize("page_size", [16, 200])
def test_paged_blocks(rng, page_size):
    """Pages of up to 128 positions have a scale each, set when their slot 0 is written; a holder with one scale
    per page of 200 sets it at slot 0 too, and a page of 200 with one per 128 at slots 0 and 128."""
    num_pages, hk, d = 6, 2, 8
    table = np.array([[4, 1, 3]], np.int32)
    per_page = cupyflash.FP8KVCache(
        np.zeros((num_pages, hk, page_size, d), np.uint8), np.full((num_pages, hk, 1), 3.0, np.float32), "block"
    )
    caches = [per_page, _empty((num_pages, hk, page_size, d), "block", 3.0)]
    k = rng.standard_normal((1, hk, page_size + 3, d), dtype=np.float32)
    for k_cache in caches:
        v_cache = cupyflash.FP8KVCache(k_cache.data.copy(), k_cache.scale.copy(), "block")
        _append(k_cache, v_cache, k, k, [page_size - 1], block_table=table)
        # Page table[0, 0] (slot page_size - 1) keeps its scale; page table[0, 1] gets one from slots 0 ..
        np.testing.assert_array_equal(k_cache.scale[4], 3.0)
        for blk in range(k_cache.scale.shape[2]):  # page table[0, 1] is written whole (k's rows 1 .. page_size)
            rows = k[0, :, 1 + blk * k_cache.block : 1 + min(page_size, (blk + 1) * k_cache.block)]
            np.testing.assert_array_equal(k_cache.scale[1, :, blk], np.abs(rows).max(axis=(1, 2)) / HEADROOM_DIVISOR)
        # Page table[0, 2] (slots 0 and 1): its first block's scale from the last two rows, any other untouched.
        np.testing.assert_array_equal(k_cache.scale[3, :, 0], np.abs(k[0, :, -2:]).max(axis=(1, 2)) / HEADROOM_DIVISOR)
        np.testing.assert_array_equal(k_cache.scale[3, :, 1:], 3.0)


@pytest.mark.parametrize("page_size", [None, 7])
def test_a_prompt_appended_is_the_prompt_quantized(rng, page_size):
    """A prompt appended from position 0 into an empty block-scaled cache holds what quantize_kvcache of the
    prompt gives (contiguous: the same blocks; pages of 7: a scale per page either way)."""
    n, hk, d = 300, 2, 16
    prompt = rng.standard_normal((1, hk, n, d), dtype=np.float32)
    if page_size is None:
        shape, table, options = (1, hk, 384, d), None, {}
    else:
        pages = -(-n // page_size)
        table = rng.permutation(pages).reshape(1, pages).astype(np.int32)
        shape, options = (pages, hk, page_size, d), dict(block_table=table)
    k_cache, v_cache = _empty(shape, "block"), _empty(shape, "block")
    _append(k_cache, v_cache, prompt, prompt, [0], **options)
    if page_size is None:
        expected = cupyflash.quantize_kvcache(np.pad(prompt, ((0, 0), (0, 0), (0, 384 - n), (0, 0))))
    else:  # the prompt laid out in its pages, zeros past its end
        padded = np.pad(prompt, ((0, 0), (0, 0), (0, pages * page_size - n), (0, 0)))
        laid_out = np.zeros(shape, np.float32)
        laid_out[table[0]] = padded[0].reshape(hk, pages, page_size, d).transpose(1, 0, 2, 3)
        expected = cupyflash.quantize_kvcache(laid_out)
    np.testing.assert_array_equal(k_cache.data, expected.data)
    np.testing.assert_array_equal(k_cache.scale[..., : -(-n // 128)], expected.scale[..., : -(-n // 128)])


def test_a_fresh_block_of_zeros_gets_scale_one():
    shape = (1, 1, 256, 4)
    k_cache, v_cache = _empty(shape, "block", 0.25), _empty(shape, "block", 0.25)
    _append(k_cache, v_cache, np.zeros((1, 1, 1, 4), np.float16), np.zeros((1, 1, 1, 4), np.float16), [128])
    np.testing.assert_array_equal(k_cache.scale[0, 0], [0.25, 1.0])


# ------------------------------------------------------------------------------------ the reference's e4m3
def test_reference_rounding_is_e4m3_round_to_nearest_even(rng):
    """The reference's own rounding (by the binade's spacing) against ml_dtypes' float32 cast and the library's
    encoder, on random magnitudes, every midpoint between neighbours and values past 448."""
    y = rng.standard_normal(200_000) * np.exp(rng.uniform(-15, 7, 200_000))
    values = np.arange(127, dtype=np.uint8).view(E4M3).astype(np.float64)
    midpoints = (values[:-1] + values[1:]) / 2
    y = np.concatenate([y, midpoints, -midpoints, [0.0, -0.0, 448.0, 463.9, 464.0, 1e6, -1e6]])
    for x in (y.astype(np.float32), y):
        codes = _e4m3_codes(x)
        np.testing.assert_array_equal(codes, encode_e4m3(x))
        inside = np.abs(x) <= 448
        np.testing.assert_array_equal(codes[inside], x[inside].astype(np.float32).astype(E4M3).view(np.uint8))


@pytest.mark.parametrize("page_size", [None, 5])
def test_reference_reads_holders_as_their_values(rng, page_size):
    """The reference on FP8KVCaches (no append) is the reference on their dequantized float64 values, exactly."""
    shape = (3, 2, 140, 16) if page_size is None else (30, 2, page_size, 16)
    k8, v8 = (cupyflash.quantize_kvcache(rng.standard_normal(shape, dtype=np.float32), s) for s in ("block", "head"))
    options = dict(cache_seqlens=[0, 70, 139], causal=True, window=(50, 0), return_lse=True)
    if page_size:  # 9 pages of 5 per sequence
        options["block_table"] = rng.permutation(30)[:27].reshape(3, 9)
        options["cache_seqlens"] = [0, 23, 45]
    q = rng.standard_normal((3, 4, 2, 16))
    for x, y in zip(
        reference.attention_with_kvcache(q, k8, v8, **options),
        reference.attention_with_kvcache(q, k8.dequantize(np.float64), v8.dequantize(np.float64), **options),
    ):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------------------------ call errors
def _call_arrays(rng, scaling="block"):
    q = rng.standard_normal((2, 4, 1, 8), dtype=np.float32)
    k_cache = cupyflash.quantize_kvcache(rng.standard_normal((2, 2, 140, 8), dtype=np.float32), scaling)
    v_cache = cupyflash.quantize_kvcache(rng.standard_normal((2, 2, 140, 8), dtype=np.float32), scaling)
    k, v = (rng.standard_normal((2, 2, 1, 8), dtype=np.float32) for _ in range(2))
    return q, k_cache, v_cache, k, v


def test_fp8tensor_is_not_a_cache(rng):
    q, k_cache, v_cache, k, v = _call_arrays(rng)
    x8 = cupyflash.quantize_fp8(rng.standard_normal((2, 2, 140, 8), dtype=np.float32))
    with pytest.raises(
        TypeError, match="k_cache is an FP8Tensor, the FP8 forward's holder; an FP8 cache is an FP8KVCache"
    ):
        cupyflash.attention_with_kvcache(q, x8, v_cache, cache_seqlens=3)


def test_one_fp8_cache_and_one_array(rng):
    q, k_cache, v_cache, k, v = _call_arrays(rng)
    with pytest.raises(TypeError, match="v_cache is an FP8KVCache but k_cache is not; pass both caches"):
        cupyflash.attention_with_kvcache(q, k_cache.dequantize(), v_cache, cache_seqlens=3)
    with pytest.raises(TypeError, match="k_cache and v_cache must both be FP8KVCache holders or neither"):
        reference.attention_with_kvcache(q, k_cache.dequantize(), v_cache, cache_seqlens=3)


@pytest.mark.parametrize("which", ["data", "scale"])
def test_read_only_holders(rng, which):
    """An append writes codes (and a block holder's scales): read-only ones are refused, by name; without an
    append, or with shared scales, read-only is fine."""
    q, k_cache, v_cache, k, v = _call_arrays(rng)
    getattr(k_cache, which).flags.writeable = False
    cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3)
    with pytest.raises(ValueError, match=f"k_cache.{which} is read-only; k and v are appended to it in place"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    q, k_cache, v_cache, k, v = _call_arrays(rng, "head")
    k_cache.scale.flags.writeable = False
    cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)


def test_non_finite_new_values(rng):
    q, k_cache, v_cache, k, v = _call_arrays(rng)
    v[1, 0, 0, 3] = np.inf
    with pytest.raises(ValueError, match="v holds NaN or infinite values; FP8 caches store finite values only"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)


def test_shapes_and_dtypes_are_checked_as_for_arrays(rng):
    q, k_cache, v_cache, k, v = _call_arrays(rng)
    with pytest.raises(ValueError, match="k_cache has head dim 8; expected q's head dim D = 4"):
        cupyflash.attention_with_kvcache(q[..., :4], k_cache, v_cache, cache_seqlens=3)
    with pytest.raises(TypeError, match="q has dtype int32; expected float16, bfloat16"):
        cupyflash.attention_with_kvcache(q.astype(np.int32), k_cache, v_cache, cache_seqlens=3)
    with pytest.raises(TypeError, match="q has dtype float32 but k has dtype float16"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, k.astype(np.float16), v, cache_seqlens=3)
    with pytest.raises(ValueError, match="cache_seqlens\\[0\\] = 140 is out of range"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=140)
