"""attention_with_kvcache on FP8 caches (FP8KVCache) on the CPU path, against the float64 reference: every scale
layout on contiguous and paged caches (pages in random order, of 1 to 160 positions), appends across block and
page boundaries, rotary embeddings, grouped heads, window, softcap, ALiBi, num_splits, return_lse and merging.

Every call is checked by helpers/fp8_kvcache.py's ``check_fp8``: the caches after the append against the
reference's own append (codes and scales bit for bit, rotated keys within one e4m3 step), and out and lse against
the reference on the values the caches hold after the call, to one rounding of out plus float32 arithmetic.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.fp8_kvcache import SCALINGS, check_fp8, make_fp8_problem, snapshot
from helpers.kvcache import DV, D, Problem, run
from helpers.modifiers import alibi_slopes

import cupyflash
from cupyflash import reference

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
# (page_size or None, capacity, first block boundary): blocks of 128 positions in a contiguous cache and in pages
# of more than 128, one per page otherwise.
LAYOUTS = {
    "contiguous": (None, 300, 128),
    "pages of 1": (1, 40, 1),
    "pages of 5": (5, 48, 5),
    "pages of 16": (16, 48, 16),
    "pages of 160": (160, 320, 128),
}


def _seqlens(capacity, boundary, nnew):
    """L_b of 0 or nnew; an append ending just past the first block boundary; one starting on the second; the
    capacity."""
    return [0, boundary - 1, min(2 * boundary, capacity - nnew), capacity - nnew]


# ------------------------------------------------------------------------------------ layouts and lengths
@pytest.mark.parametrize("nnew", [0, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, dtype, scaling, layout, nnew):
    """Grouped heads (8 over 2), D = 40 and Dv = 24, causal, Nq = 4 (Nq = 2 without an append)."""
    page_size, capacity, boundary = LAYOUTS[layout]
    seqlens = _seqlens(capacity, boundary, nnew)
    p = make_fp8_problem(
        rng, dtype, seqlens, scaling=scaling, nq=4 if nnew else 2, nnew=nnew, page_size=page_size,
        capacity=capacity, causal=True,
    )  # fmt: skip
    check_fp8(p)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("page_size", [None, 7])
def test_outlier_channels(rng, page_size, scaling):
    """Two key dims 10x larger, in the cache and in the appended keys."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [5, 131, 260], scaling=scaling, nq=3, nnew=9, page_size=page_size, capacity=280,
        outliers=10.0, causal=True,
    )  # fmt: skip
    check_fp8(p)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("page_size", [None, 16])
def test_data_with_a_mean_and_outliers(rng, page_size, scaling):
    """Keys and values centred on 3 (a block's scale then follows the mean, and its codes hold the spread with
    fewer bits), two key dims 10x larger, appended across a block boundary."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [40, 120, 250], scaling=scaling, nq=2, nnew=12, page_size=page_size, capacity=272,
        outliers=10.0, mean=3.0, causal=True,
    )  # fmt: skip
    check_fp8(p)


@pytest.mark.parametrize("nq", [1, 6])
@pytest.mark.parametrize("page_size", [None, 4])
def test_prefill_then_decode(rng, page_size, nq):
    """A whole prompt appended into an empty block-scaled cache (Nnew = 140, across two blocks and many pages),
    then decoding steps one position at a time."""
    capacity = 200
    p = make_fp8_problem(
        rng, np.float32, [0, 0], scaling="block", nq=nq, nnew=140 - nq, page_size=page_size, capacity=capacity,
        causal=True, rotary_dim=D,
    )  # fmt: skip
    check_fp8(p)
    for step in range(3):
        q, k, v = (rng.standard_normal(x.shape[:2] + (1, x.shape[3]), dtype=np.float32) for x in (p.q, p.k, p.v))
        p = Problem(q, p.k_cache, p.v_cache, k, v, dict(p.options, cache_seqlens=p.seqlens() + p.nnew))
        check_fp8(p)


def test_sequences_without_keys_give_zeros(rng):
    p = make_fp8_problem(rng, np.float16, [0, 7, 0], scaling="block", nq=3, nnew=0, page_size=4)
    out, lse = check_fp8(p)
    assert not out[[0, 2]].any() and np.isneginf(lse[[0, 2]]).all() and np.isfinite(out).all()


@pytest.mark.parametrize("scaling", SCALINGS)
def test_append_without_queries(rng, scaling):
    """Nq = 0: nothing attended, the new keys and values still quantized into the caches."""
    p = make_fp8_problem(rng, ml_dtypes.bfloat16, [0, 126, 40], scaling=scaling, nq=0, nnew=5, capacity=200)
    out, lse = check_fp8(p)
    assert out.shape == (3, 8, 0, DV) and lse.shape == (3, 8, 0)


@pytest.mark.parametrize("page_size", [None, 6])
def test_flash_attention_layout(rng, page_size):
    """Holders over (B, S, Hk, D) storage (paged: (num_pages, page_size, Hk, D)) seen through .transpose(0, 2, 1,
    3) views: the results of contiguous codes, and the appends land in the caller's storage."""
    p = make_fp8_problem(rng, np.float16, [3, 20, 31], scaling="block", nq=2, nnew=3, page_size=page_size)
    contiguous = snapshot(p)
    storages = []
    for name in ("k_cache", "v_cache"):
        holder = getattr(p, name)
        storage = np.ascontiguousarray(holder.data.transpose(0, 2, 1, 3))
        setattr(p, name, cupyflash.FP8KVCache(storage.transpose(0, 2, 1, 3), holder.scale, holder.scaling))
        storages.append(storage)
    for x, y in zip(check_fp8(p), run(contiguous)):
        np.testing.assert_array_equal(x, y)
    for storage, holder in zip(storages, (contiguous.k_cache, contiguous.v_cache)):
        np.testing.assert_array_equal(storage, holder.data.transpose(0, 2, 1, 3))


# ------------------------------------------------------------------------------------ rotary embeddings
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_rotary_before_quantization(rng, dtype, scaling, interleaved):
    """The new keys are rotated, then quantized (the cache holds rotated keys): each appended key's value is
    the rotated key to within e4m3's rounding, and the rest of the call matches the reference."""
    p = make_fp8_problem(
        rng, dtype, [0, 126, 33], scaling=scaling, nq=4, nnew=4, page_size=None, capacity=160, rotary_dim=24,
        rotary_interleaved=interleaved, causal=True,
    )  # fmt: skip
    k = p.k.copy()
    check_fp8(p)
    values = p.k_cache.dequantize(np.float64)
    for b, start in enumerate(p.seqlens()):
        positions = start + np.arange(4)
        rotated = reference.rotary(k[b], p.options["rotary_cos"], p.options["rotary_sin"], positions, interleaved)
        stored = values[b, :, positions].transpose(1, 0, 2)
        scales = p.k_cache.position_scales(np.float64)[min(b, p.k_cache.scale.shape[0] - 1), :, positions].T
        # Half an e4m3 step (subnormals: 2^-10 of the scale), and the float32 rotation's own rounding.
        bound = (2.0**-4 + 1e-6) * np.abs(rotated) + 2.0**-10 * scales[..., None] + 1e-6
        assert (np.abs(stored - rotated) <= bound).all(), "a stored key is not its rotation, quantized"
        assert np.abs(stored - k[b]).max() > 0.1, "the stored keys are not rotated"


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_rotary_16_bit_queries(rng, dtype):
    """16-bit q and new keys with rotary tables: the keys are quantized from their float32 rotation (not
    rounded to q's dtype first)."""
    p = make_fp8_problem(
        rng, dtype, [0, 17, 130], scaling="block", nq=2, nnew=2, page_size=9, capacity=160, rotary_dim=D,
        causal=True,
    )  # fmt: skip
    check_fp8(p)


# ------------------------------------------------------------------------------------ heads and modifiers
@pytest.mark.parametrize("hq,hk", [(1, 1), (6, 3), (8, 1), (12, 4)])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_grouped_heads(rng, scaling, hq, hk):
    """Query head h reads key/value head h // (Hq // Hk), whose scales are its own ("head", "block")."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [3, 150], scaling=scaling, hq=hq, hk=hk, nq=3, nnew=2, page_size=16,
        capacity=160, causal=True,
    )  # fmt: skip
    check_fp8(p)


MODIFIERS = {
    "window": dict(window=(20, 0)),
    "window both sides": dict(window=(70, 3)),
    "softcap": dict(softcap=5.0),
    "window softcap": dict(window=(30, 0), softcap=2.5, causal=True),
    "alibi": dict(alibi_slopes=alibi_slopes(8)),
    "scale": dict(scale=0.7, causal=True),
}


@pytest.mark.parametrize("modifiers", MODIFIERS)
@pytest.mark.parametrize("page_size", [None, 11])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float64], ids=["bfloat16", "float64"])
def test_modifiers(rng, dtype, page_size, modifiers):
    p = make_fp8_problem(
        rng, dtype, [0, 60, 190], scaling="block", nq=5, nnew=3, page_size=page_size, capacity=200,
        **MODIFIERS[modifiers],
    )  # fmt: skip
    check_fp8(p)


def test_num_splits_changes_nothing_on_the_cpu(rng):
    """num_splits is accepted as for 16-bit caches and, on the CPU path, gives the same bits."""
    p = make_fp8_problem(rng, ml_dtypes.bfloat16, [40, 250], scaling="block", nq=2, nnew=1, capacity=260)
    results = []
    for num_splits in (None, 1, 5, 128):
        each = snapshot(p)
        results.append((*run(each, num_splits=num_splits), each.k_cache.data, each.k_cache.scale))
    for result in results[1:]:
        for x, y in zip(result, results[0]):
            np.testing.assert_array_equal(x, y)
    check_fp8(p, call=lambda p: run(p, num_splits=3))
    with pytest.raises(ValueError, match="num_splits must be None"):
        run(snapshot(p), num_splits=0)


# ------------------------------------------------------------------------------------ return_lse and merging
@pytest.mark.parametrize("scaling", SCALINGS)
def test_merge_a_prefix_and_own_keys(rng, scaling):
    """A prefix cache and each sequence's own cache, both FP8 (a prefix of 150 positions in one holder, the own
    keys appended to another): merge_attention_states of the two calls' (out, lse) is attention over the
    values of both, one after the other."""
    batch, hq, hk, prefix = 3, 8, 2, 150
    q = rng.standard_normal((batch, hq, 1, D), dtype=np.float32)
    k_prefix, v_prefix = (
        cupyflash.quantize_kvcache(rng.standard_normal((batch, hk, prefix, n), np.float32), scaling) for n in (D, DV)
    )
    own = make_fp8_problem(rng, np.float32, [10, 10, 10], scaling=scaling, nq=1, nnew=1, capacity=40)
    own.q = q
    out_p, lse_p = cupyflash.attention_with_kvcache(q, k_prefix, v_prefix, cache_seqlens=prefix, return_lse=True)
    out_s, lse_s = check_fp8(own)
    out, lse = cupyflash.merge_attention_states(out_p, lse_p, out_s, lse_s)
    both = [
        np.concatenate([prefix_cache.dequantize(np.float64), own_cache.dequantize(np.float64)], axis=2)
        for prefix_cache, own_cache in ((k_prefix, own.k_cache), (v_prefix, own.v_cache))
    ]
    expected, expected_lse = reference.attention_with_kvcache(q, *both, cache_seqlens=prefix + 11, return_lse=True)
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(lse - expected_lse).max() <= 1e-5 * np.abs(expected_lse).max()


def test_merge_shares_of_a_long_sequence(rng):
    """A sequence's keys in three shares of one paged FP8 cache, attended apart (each share's pages as a block
    table of its own) and merged with merge_attention_states_stacked: attention over the whole."""
    page_size, pages = 32, 12
    p = make_fp8_problem(rng, ml_dtypes.bfloat16, [0], scaling="block", nq=2, nnew=0, page_size=page_size,
                         capacity=page_size * pages)  # fmt: skip
    table = p.options["block_table"]
    shares = [table[:, :4], table[:, 4:9], table[:, 9:]]
    parts = [
        cupyflash.attention_with_kvcache(
            p.q, p.k_cache, p.v_cache, cache_seqlens=share.shape[1] * page_size, block_table=share, return_lse=True
        )
        for share in shares
    ]
    out, lse = cupyflash.merge_attention_states_stacked(
        np.stack([o.astype(np.float32) for o, _ in parts]), np.stack([x for _, x in parts])
    )
    expected, expected_lse = reference.attention_with_kvcache(
        p.q, p.k_cache, p.v_cache, cache_seqlens=page_size * pages, block_table=table, return_lse=True
    )
    assert np.abs(out - expected).max() <= 2.0**-7 * np.abs(expected).max()
    assert np.abs(lse - expected_lse).max() <= 1e-5 * np.abs(expected_lse).max()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_steps_of_few_rows_take_the_keys_as_rows_kernel(dtype):
    """An FP8 step of at most 8 packed query rows, in aligned rows, contiguous or in pages of a multiple of 16
    positions, runs attention_decode_fp8.cu (the keys as the products' rows); any other FP8 call the tiled kernel.
    Every variant so chosen ships, and fits an sm_80 CTA's shared memory."""
    from cupyflash._cuda import decode_tiles, tile_policy
    from cupyflash._cuda.tiles import SM80_SMEM_BYTES

    shipped = set(decode_tiles.shipped_variants())
    for d in (16, 40, 64, 96, 128, 200, 256):
        for packed in (1, 2, 4, 7, 8, 9, 16, 64):
            for page_size in (None, 5, 11, 16, 24, 64, 160):
                for aligned in (True, False):
                    variant = tile_policy.decode(dtype, d, d, packed, page_size, "e4m3", aligned)
                    expect = packed <= 8 and aligned and (page_size is None or page_size % 16 == 0)
                    assert variant.keys_as_rows == expect, (d, packed, page_size, aligned)
                    assert variant in shipped and variant.cache == "e4m3"
                    assert variant.head_dim >= d and variant.smem("decode") <= SM80_SMEM_BYTES
                    if expect:
                        assert variant.rows == 8 and variant.threads("decode") == 128
                        assert variant.name_expression("decode").startswith("attention_decode_fp8<")
    # 16-bit caches never take it
    assert not tile_policy.decode(dtype, 128, 128, 4).keys_as_rows
