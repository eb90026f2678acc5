"""attention_with_kvcache on the GPU (cupyflash/_cuda/decode.py; cuda_src/attention_decode.cu,
kvcache_append.cu) against the float64 reference. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_kvcache.py

Every call is held to the three checks of helpers/kvcache.py: out and lse by the accuracy rule, the
appended positions of the caches, and every other position untouched, bit for bit. Every allocation is
poisoned with NaN (helpers.gpu), so an output or workspace element the kernels never write fails; the test
of out-of-range values, whose rows must come back NaN, poisons with zeros instead.

Covered: a grid of dtypes x head dims (every HEAD bucket, and D = 1 for the element-wise loads) x
scenarios (page sizes, lengths 0, 1, page boundaries and the full capacity, grouped heads, Nq from 1 to 64,
every option, FlashAttention's cache layout); every page size against the one-page load path; the split
count; the kinds of cache_seqlens; return_lse=False; rotary's query positions; unaligned rows and views of
fused projections; the fast path of repeated layouts; out-of-range GPU-resident values; CUDA graph replay;
and merge_attention_states on CuPy arrays.
"""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import bits, max_abs, same_bits, to_host
from helpers.gpu import filled_allocations, nan_filled_allocations
from helpers.kvcache import (
    DTYPES,
    check,
    compare,
    counting_resolve,
    flash_layout,
    make_problem,
    on_host,
    reference_results,
    rope_tables,
    run,
    subset,
    to_device,
)
from helpers.modifiers import SOFTCAP, alibi_slopes
from helpers.problems import random_array

import cupyflash
from cupyflash._arrays import lse_dtype
from cupyflash._cuda import decode, tile_policy

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16


def _run(p, **changes):
    """run (helpers/kvcache.py) with every allocation poisoned with NaN."""
    with nan_filled_allocations():
        return run(p, **changes)


def _check(p, **changes):
    """check (helpers/kvcache.py) of the call with ``changes`` to its options, allocations poisoned."""
    return check(p, lambda p: _run(p, **changes))


def _device_problem(rng, dtype, seqlens, **options):
    return to_device(make_problem(rng, dtype, seqlens, **options))


def _rotary_dim(d, part):
    """An even rotary_dim for head dim d: all of it ("full") or about half ("part"); 0 where d < 2."""
    dim = d if part == "full" else d // 2
    return dim - dim % 2 if d >= 2 else 0


def _fill(dst, src):
    """Copy the host array src into the device array dst in place, bit for bit (any dtype, any strides)."""
    bits(dst)[...] = cupy.asarray(bits(np.ascontiguousarray(src)))


# ------------------------------------------------------------------------------------ the grid
HEAD_DIMS = [(1, 1), (40, 24), (64, 64), (96, 96), (128, 128), (200, 256), (256, 256)]
# Each scenario: the problem's sizes and options. cache_seqlens are before the append (L_b = cache_seqlens +
# Nnew); every scenario has L_b = 1 or 0, a page boundary and the full capacity.
SCENARIOS = {
    # A decode step: one query, one new key; pages of 16 in random order; the new key at the first and the
    # last position of a page; one long sequence (several splits, several tiles per split); the full cache.
    "decode-paged16": dict(
        hq=8, hk=2, nq=1, nnew=1, page_size=16, capacity=1024, seqlens=[0, 16, 31, 700, 1023], causal=True
    ),
    # Grouped heads 32 over 8 (12 packed rows), 3 queries and 3 new keys, contiguous caches, GPT-NeoX rotary on
    # all of D with causal: query i rotated at cache_seqlens + i.
    "gqa32-8-contiguous-rotary": dict(
        hq=32, hk=8, nq=3, nnew=3, capacity=640, seqlens=[0, 1, 200, 637], causal=True, rotary="full"
    ),
    # 16 queries x 4 heads: one 64-row tile; nothing appended (k = v = None; L_b = 0 for one sequence); pages
    # of 3; a window on both sides, a softcap and a scale of our own.
    "nq16-page3-window-softcap": dict(
        hq=8,
        hk=2,
        nq=16,
        nnew=0,
        page_size=3,
        capacity=300,
        seqlens=[0, 1, 120, 300],
        window=(50, 7),
        softcap=SOFTCAP,
        scale=0.3,
    ),
    # Hq = Hk, 40 queries on pages of 1; 5 new keys (L_b = 5 < Nq); GPT-J rotary on about half of D without
    # causal (every query rotated at cache_seqlens); per-sequence ALiBi slopes.
    "nq40-page1-alibi-per-sequence": dict(
        hq=4,
        hk=4,
        nq=40,
        nnew=5,
        page_size=1,
        capacity=160,
        seqlens=[0, 1, 60, 155],
        alibi="per-sequence",
        rotary="part",
        rotary_interleaved=True,
    ),
    # 64 queries x 4 heads: four 64-row tiles; a chunk of 64 new keys; FlashAttention's (B, S, H, D) caches
    # written in place, pages of 64; causal with a left window; ALiBi per head.
    "nq64-page64-flash-layout": dict(
        hq=8,
        hk=2,
        nq=64,
        nnew=64,
        page_size=64,
        capacity=512,
        seqlens=[0, 64, 100, 448],
        causal=True,
        window=(150, -1),
        alibi="per-head",
        flash_layout=True,
    ),
}


def _scenario_problem(rng, dtype, d, dv, scenario):
    options = dict(scenario)
    seqlens = options.pop("seqlens")
    rotary, alibi, flash = options.pop("rotary", None), options.pop("alibi", None), options.pop("flash_layout", False)
    if rotary:
        options["rotary_dim"] = _rotary_dim(d, rotary)
        if not options["rotary_dim"]:
            options.pop("rotary_interleaved", None)
    if alibi == "per-head":
        options["alibi_slopes"] = alibi_slopes(options["hq"])
    elif alibi == "per-sequence":
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, (len(seqlens), options["hq"])).astype(np.float32)
    host = make_problem(rng, dtype, seqlens, d=d, dv=dv, **options)
    if flash:
        flash_layout(host)
    return to_device(host)  # the same memory order: FlashAttention's layout stays transposed views


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("d, dv", HEAD_DIMS, ids=[f"d{d}-dv{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, dtype, d, dv, name):
    p = _scenario_problem(rng, dtype, d, dv, SCENARIOS[name])
    if SCENARIOS[name].get("flash_layout"):  # views of (B, S, H, D) storage, which check reads back
        assert all(x.transpose(0, 2, 1, 3).flags.c_contiguous for x in (p.k_cache, p.v_cache))
    _check(p)


# ------------------------------------------------------------------------------------ page sizes and load paths
PAGE_SIZES = [None, 1, 3, 16, 64, 128, 256]
# (dtype, D = Dv): the 16-row variants' BLOCK_N is 128 for 16-bit D = 64 and D = 128, 64 for 16-bit D = 32,
# float32 and float64. A whole tile inside one page (contiguous caches, pages of a multiple of BLOCK_N) takes
# the one-page load path; other pages the row-by-row path.
LOAD_VARIANTS = {
    "float16-d64": (np.float16, 64),
    "bfloat16-d128": (BF16, 128),
    "float16-d32": (np.float16, 32),
    "float32-d128": (np.float32, 128),
    "float64-d64": (np.float64, 64),
}
PAGED_CAPACITY = 768  # a multiple of every page size above


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=[f"page{s}" for s in PAGE_SIZES])
@pytest.mark.parametrize("variant", LOAD_VARIANTS)
def test_page_sizes(rng, variant, page_size):
    """Sequences from 1 key to the full capacity, one ending on two whole tiles, one on a page boundary."""
    dtype, d = LOAD_VARIANTS[variant]
    block_n = tile_policy.decode(np.dtype(dtype).name, d, d, 4).block_n
    page = page_size or 16
    seqlens = [0, page - 1, 2 * block_n - 1, 300, PAGED_CAPACITY - 1]
    p = _device_problem(
        rng, dtype, seqlens, nq=1, nnew=1, page_size=page_size, d=d, dv=d, capacity=PAGED_CAPACITY, causal=True
    )
    _check(p)


# ------------------------------------------------------------------------------------ splits
SPLITS = [1, 2, 3, 7, 16, 64, 128]
SPLIT_CASES = {
    # Key tiles of 128: 24 for the longest sequence (num_splits = 64 and 128 are more splits than tiles).
    "float16-d128-rotary": dict(
        dtype=np.float16,
        d=128,
        hq=8,
        hk=1,
        nq=1,
        nnew=1,
        page_size=256,
        capacity=3072,
        seqlens=[3071, 1500, 0, 77],
        rotary_dim=128,
        causal=True,
    ),
    "bfloat16-d64-nq16-window": dict(
        dtype=BF16,
        d=64,
        hq=4,
        hk=1,
        nq=16,
        nnew=0,
        page_size=16,
        capacity=2048,
        seqlens=[2048, 999, 1],
        window=(1200, 3),
    ),
    "float32-d96-nq40-alibi": dict(
        dtype=np.float32,
        d=96,
        hq=2,
        hk=2,
        nq=40,
        nnew=2,
        capacity=1500,
        seqlens=[1498, 700],
        causal=True,
        alibi_slopes=alibi_slopes(2),
    ),
    "float64-d256-softcap": dict(
        dtype=np.float64,
        d=256,
        hq=4,
        hk=2,
        nq=3,
        nnew=1,
        page_size=64,
        capacity=1024,
        seqlens=[1023, 400, 0],
        softcap=SOFTCAP,
    ),
}
# Tolerances between split counts. out: 16-bit inputs' probabilities are rounded to the dtype before P V (as
# FlashAttention does), each split at its own running max, so each term p_j v_j may be a rounding u apart
# (2 u of sum_j p_j |v_j| / sum_j p_j at most), plus SPLIT_ULPS of the accumulator for the reordered sums,
# plus one unit in the last place of the rounded out. lse: SPLIT_ULPS of the accumulator (of max(1, |lse|)).
P_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0, "float64": 0.0}
SPLIT_ULPS = 8  # measured on an H100: at most 2


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_num_splits(rng, case):
    """Every split count gives the reference's results, and those of num_splits = 1 within rounding
    (P_ROUNDING above)."""
    options = dict(SPLIT_CASES[case])
    dtype, d = options.pop("dtype"), options.pop("d")
    p = _device_problem(rng, dtype, options.pop("seqlens"), d=d, dv=d, **options)
    h = on_host(p)
    results = {s: tuple(to_host(x) for x in _check(p, num_splits=s)) for s in SPLITS}
    # sum_j p_j |v_j| / sum_j p_j: the attention of the same scores over |v|.
    magnitude = reference_results(replace(h, v_cache=np.abs(h.v_cache), v=None if h.v is None else np.abs(h.v)))[0]
    eps = np.finfo(lse_dtype(dtype)).eps
    out_1, lse_1 = results[1]
    for s, (out, lse) in results.items():
        last_place = np.spacing(np.maximum(np.abs(out), np.abs(out_1)).astype(dtype)).astype(np.float64)
        bound = (2 * P_ROUNDING[np.dtype(dtype).name] + SPLIT_ULPS * eps) * magnitude + last_place
        excess = np.abs(out - out_1) - bound
        assert np.max(excess, initial=-np.inf) <= 0, f"num_splits={s}: out differs from num_splits=1's beyond rounding"
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_1))
        seen = np.isfinite(lse_1)
        lse_error = np.abs(lse[seen] - lse_1[seen]) - SPLIT_ULPS * eps * np.maximum(1.0, np.abs(lse_1[seen]))
        assert np.max(lse_error, initial=-np.inf) <= 0, f"num_splits={s}: lse differs from num_splits=1"


# ------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_cache_seqlens_int_int32_int64(rng, dtype):
    """One int, an int32 CuPy array and an int64 CuPy array (cast on the way) give the same bits."""
    p = _device_problem(
        rng, dtype, [37, 37, 37], nq=2, nnew=2, page_size=16, capacity=256, d=64, dv=64, rotary_dim=32, causal=True
    )
    results = []
    for seqlens in (37, cupy.full(3, 37, dtype=cupy.int32), cupy.full(3, 37, dtype=cupy.int64)):
        each = replace(
            p, k_cache=p.k_cache.copy(), v_cache=p.v_cache.copy(), options=dict(p.options, cache_seqlens=seqlens)
        )
        results.append((*_check(each), each.k_cache, each.v_cache))
    for other in results[1:]:
        for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), results[0], other):
            assert same_bits(x, y), f"{name}: the kinds of cache_seqlens give different bits"


@pytest.mark.parametrize("num_splits", [1, 8])
def test_without_lse(rng, num_splits):
    """return_lse=False returns out alone, the bits of out with return_lse=True (a single split writes out
    directly, several merge without an lse to write)."""
    p = _device_problem(
        rng, BF16, [0, 500, 1999], nq=2, nnew=0, page_size=16, capacity=2000, hq=8, hk=2, d=128, dv=128, causal=True
    )
    out, _ = _check(p, num_splits=num_splits)
    with nan_filled_allocations():
        alone = cupyflash.attention_with_kvcache(p.q, p.k_cache, p.v_cache, num_splits=num_splits, **p.options)
    assert isinstance(alone, cupy.ndarray), f"return_lse=False returned a {type(alone).__qualname__}"
    assert same_bits(alone, out), "out differs from the out returned with lse"


@pytest.mark.parametrize("rotary_dim", [128, 32], ids=["rotary-full", "rotary-part"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary(rng, interleaved, mask, rotary_dim):
    """Both styles on all or part of D; queries rotated at cache_seqlens (no mask) or cache_seqlens + i
    (causal, or a window, even one that hides nothing)."""
    options = dict(none={}, causal=dict(causal=True), window=dict(window=(4096, 4096)))[mask]
    host = make_problem(
        rng,
        np.float16,
        [0, 9, 250, 395],
        nq=5,
        nnew=5,
        page_size=16,
        capacity=400,
        d=128,
        dv=128,
        rotary_dim=rotary_dim,
        rotary_interleaved=interleaved,
        **options,
    )
    host.q[...] = host.q[:, :, :1]  # identical queries: their outputs differ exactly when their positions do
    out, _ = _check(to_device(host))
    out = to_host(out)
    spread = max(max_abs(out[:, :, i] - out[:, :, 0]) for i in range(1, 5)) / max_abs(out)
    advance = mask != "none"
    assert spread > 1e-2 if advance else spread < 1e-6, f"query rows differ by {spread:.3g} of max|out|"


@pytest.mark.parametrize("page_size", [None, 3])
def test_append_without_queries(rng, page_size):
    """Nq = 0: nothing to attend; the new keys (rotated) and values are still appended."""
    p = _device_problem(
        rng, BF16, [0, 5, 45], nq=0, nnew=3, page_size=page_size, d=64, dv=64, rotary_dim=64, causal=True
    )
    out, lse = _check(p)
    assert out.shape == (3, 8, 0, 64) and lse.shape == (3, 8, 0)


@pytest.mark.parametrize("layout", ["odd-head-dims", "offset-rows"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_not_16_byte_aligned(rng, dtype, layout):
    """Cache rows that are not whole aligned 16-byte chunks take the element-wise loads: odd head dims (33,
    17), or rows one element into wider storage (the column before them must stay untouched)."""
    d, dv = (33, 17) if layout == "odd-head-dims" else (64, 64)
    host = make_problem(
        rng, dtype, [0, 70, 129, 200], nq=3, nnew=2, page_size=5, capacity=205, d=d, dv=dv, rotary_dim=16, causal=True
    )
    p = to_device(host)
    if layout == "offset-rows":
        storage = []
        for name in ("k_cache", "v_cache"):
            cache = getattr(host, name)
            wide = random_array(rng, cache.shape[:3] + (cache.shape[3] + 1,), dtype)
            wide[..., 1:] = cache
            storage.append((wide[..., 0].copy(), cupy.asarray(wide)))
            setattr(p, name, storage[-1][1][..., 1:])
    assert not (decode._aligned_rows(p.k_cache, d) and decode._aligned_rows(p.v_cache, dv))
    _check(p)
    if layout == "offset-rows":
        for column, wide in storage:
            assert np.array_equal(bits(column), bits(on_host(wide[..., 0]))), "the column before the rows changed"


def test_views_of_fused_projections(rng):
    """q, k and v as (B, N, H, D) slices of one fused projection seen as (B, H, N, D), and the block table as
    the first columns of a wider table: only their last dim is contiguous."""
    hq, hk, n, d = 8, 2, 4, 64
    host = make_problem(
        rng,
        np.float16,
        [3, 100, 250],
        nq=n,
        nnew=n,
        page_size=16,
        capacity=256,
        hq=hq,
        hk=hk,
        d=d,
        dv=d,
        rotary_dim=d,
        causal=True,
    )
    fused = cupy.asarray(np.concatenate([x.transpose(0, 2, 1, 3) for x in (host.q, host.k, host.v)], axis=2))
    p = to_device(host)
    p.q, p.k, p.v = (fused[:, :, a:b].transpose(0, 2, 1, 3) for a, b in ((0, hq), (hq, hq + hk), (hq + hk, None)))
    table = host.options["block_table"]
    wide = cupy.asarray(np.concatenate([table, np.full_like(table, 10**6)], axis=1))
    p.options["block_table"] = wide[:, : table.shape[1]]
    _check(p)


STRIDED = {
    "cache_seqlens-every-other-int": ("cache_seqlens", lambda x: cupy.repeat(x, 2)[::2]),
    "block_table-column-major": ("block_table", cupy.asfortranarray),
    "cache_seqlens-int64": ("cache_seqlens", lambda x: x.astype(cupy.int64)),
    "block_table-int64": ("block_table", lambda x: x.astype(cupy.int64)),
    "cache_seqlens-list": ("cache_seqlens", lambda x: x.get().tolist()),
    "block_table-nested-lists": ("block_table", lambda x: x.get().tolist()),
}


@pytest.mark.parametrize("case", STRIDED)
def test_index_arguments_by_one_rule(rng, case):
    """cache_seqlens and block_table as strided views, column-major, int64, or Python lists (as NumPy's path
    takes them) give the reference's results."""
    name, layout = STRIDED[case]
    p = _device_problem(
        rng, np.float16, [5, 40, 63, 200], nq=2, nnew=1, page_size=16, capacity=256, d=64, dv=64, causal=True
    )
    p.options[name] = layout(p.options[name])
    _check(p)


# ------------------------------------------------------------------------------------ the fast path
FAST_SEQLENS = {"array": ([5, 250, 0, 120], [300, 17, 1, 511], [0, 2, 64, 497]), "int": (40, 511, 3)}


@pytest.mark.parametrize("seqlens", FAST_SEQLENS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_fast_path_repeated_layouts(rng, monkeypatch, dtype, seqlens):
    """A second call of a layout (new arrays, new data, new seqlens) and a third (the same arrays refilled
    in place) skip the checks and give the reference's results; an int cache_seqlens out of range on the
    repeated layout still raises, naming it."""
    lengths = FAST_SEQLENS[seqlens]
    page_size = 32 if seqlens == "array" else None
    options = dict(
        nq=2,
        nnew=1,
        page_size=page_size,
        capacity=512,
        hq=8,
        hk=2,
        d=64,
        dv=64,
        rotary_dim=64,
        causal=True,
        alibi_slopes=alibi_slopes(8),
    )

    def problem(length):
        p = make_problem(rng, dtype, length if seqlens == "array" else [length] * 3, **options)
        if seqlens == "int":
            p.options["cache_seqlens"] = length
        return p

    first = to_device(problem(lengths[0]))
    _check(first)
    calls = counting_resolve(monkeypatch)
    second = to_device(problem(lengths[1]))  # new arrays of the same layout
    _check(second)
    refill = problem(lengths[2])
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        _fill(getattr(second, name), getattr(refill, name))
    if seqlens == "array":
        _fill(second.options["cache_seqlens"], refill.options["cache_seqlens"])
        _fill(second.options["block_table"], refill.options["block_table"])
    else:
        second.options["cache_seqlens"] = refill.options["cache_seqlens"]
    _check(second)
    assert not calls, f"{len(calls)} repeated calls took the checked path"
    if seqlens == "int":
        before = on_host(second)
        for bad in (512, -1):  # capacity - Nnew + 1 and negative
            with pytest.raises(ValueError, match=rf"cache_seqlens\[0\] = {bad} is out of range"):
                _run(second, cache_seqlens=bad)
        for name in ("k_cache", "v_cache"):
            assert np.array_equal(bits(on_host(getattr(second, name))), bits(getattr(before, name)))


def test_fast_path_int_seqlens_past_the_rotary_tables(rng):
    """An int cache_seqlens within the capacity but past the rotary tables raises on a repeated layout as on
    a first call."""
    p = _device_problem(rng, np.float16, [10, 10], nq=1, nnew=1, capacity=256, d=64, dv=64)
    cos, sin = rope_tables(100, 64)
    p.options.update(rotary_cos=cupy.asarray(cos), rotary_sin=cupy.asarray(sin), cache_seqlens=10)
    _check(p)  # the layout is remembered
    with pytest.raises(ValueError, match="rotary_cos has 100 positions"):
        _run(p, cache_seqlens=150)


# ------------------------------------------------------------------------------------ out-of-range GPU values
BAD = 1  # the sequence with a value out of range: 600 cached positions (pages 0 .. 37 of 16), 2 appended
# name -> (the GPU-resident array, the entry, its value given num_pages, what CUPYFLASH_CHECK_VALUES=1 raises)
OUT_OF_RANGE = {
    "seqlen-past-capacity": ("cache_seqlens", BAD, lambda pages: 1023, r"cache_seqlens\[1\] = 1023 is out of range"),
    "seqlen-negative": ("cache_seqlens", BAD, lambda pages: -3, r"cache_seqlens\[1\] = -3 is out of range"),
    "page-past-cache-appended": (
        "block_table",
        (BAD, 37),
        lambda pages: pages,
        r"block_table\[1, 37\] = \d+ is not a page of k_cache",
    ),
    "page-past-cache-read": (
        "block_table",
        (BAD, 5),
        lambda pages: pages + 7,
        r"block_table\[1, 5\] = \d+ is not a page of k_cache",
    ),
    "page-negative": (
        "block_table",
        (BAD, 20),
        lambda pages: -1,
        r"block_table\[1, 20\] = -1 is not a page of k_cache",
    ),
}


@pytest.mark.parametrize("case", OUT_OF_RANGE)
def test_out_of_range_gpu_values(rng, monkeypatch, case):
    """A GPU-resident cache_seqlens or block_table entry out of range, unchecked on the host: that sequence's
    out and lse rows are NaN, no cache position changes for it but its new keys in valid pages (when a
    block-table entry is bad), the other sequences are right; with
    CUPYFLASH_CHECK_VALUES=1 the call raises, naming the value, and writes nothing."""
    name, entry, value, message = OUT_OF_RANGE[case]
    host = make_problem(
        rng,
        np.float16,
        [5, 600, 1000, 0],
        nq=3,
        nnew=2,
        page_size=16,
        capacity=1024,
        d=64,
        dv=64,
        rotary_dim=64,
        causal=True,
    )
    host.options[name][entry] = value(host.k_cache.shape[0])
    p = to_device(host)
    with filled_allocations(0):
        out, lse = run(p)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isnan(out[BAD]).all()), "out of the sequence with a value out of range is not all NaN"
    assert bool(cupy.isnan(lse[BAD]).all()), "lse of the sequence with a value out of range is not all NaN"
    if case in ("page-past-cache-read", "page-negative"):
        # Documented: the append skips only positions whose own page is outside the cache, so this
        # sequence's new keys went to their (valid) page; put the old contents back for the check below,
        # which holds every position but the other sequences' new ones unchanged.
        table, page_size = host.options["block_table"], host.k_cache.shape[2]
        for pos in range(600, 602):
            page, slot = int(table[BAD, pos // page_size]), pos % page_size
            p.k_cache[page, :, slot] = cupy.asarray(host.k_cache[page, :, slot])
            p.v_cache[page, :, slot] = cupy.asarray(host.v_cache[page, :, slot])
    good = [b for b in range(host.batch) if b != BAD]
    compare(subset(host, good), subset(p, good), out[good], lse[good])

    monkeypatch.setenv("CUPYFLASH_CHECK_VALUES", "1")
    before = on_host(p)
    with pytest.raises(ValueError, match=message):
        _run(p)
    for name in ("k_cache", "v_cache"):
        assert np.array_equal(bits(on_host(getattr(p, name))), bits(getattr(before, name))), f"{name} was written"


def test_appends_into_a_shared_page_are_refused_where_checked(rng, monkeypatch):
    """Two sequences listing one page that one of them appends into: under CUPYFLASH_CHECK_VALUES=1 (a device
    block table's values are checked on the host) the call raises, naming both entries, and writes nothing; a
    prefix page shared below both sequences' cache_seqlens is fine, and gives private copies' results."""
    host = make_problem(rng, np.float16, [20, 37], nq=1, nnew=2, page_size=16, capacity=64, d=64, dv=64)
    table = host.options["block_table"]
    for cache in (host.k_cache, host.v_cache):
        cache[table[1, 0]] = cache[table[0, 0]]  # sequence 1's first 16 positions are sequence 0's
    private = to_device(host)
    out, lse = run(private)
    table[1, 0] = table[0, 0]  # ... and now read from sequence 0's page
    shared = to_device(host)
    got_out, got_lse = run(shared)
    assert same_bits(got_out, out) and same_bits(got_lse, lse)

    monkeypatch.setenv("CUPYFLASH_CHECK_VALUES", "1")
    table[1, 1] = table[0, 1]  # sequence 0 appends at 20 and 21, into its page 1, which sequence 1 reads
    p = to_device(host)
    before = on_host(p)
    with pytest.raises(
        ValueError,
        match=r"block_table\[0, 1\] = \d+: k and v would be appended into page \d+, "
        r"which block_table\[1, 1\] uses too",
    ):
        _run(p)
    for name in ("k_cache", "v_cache"):
        assert np.array_equal(bits(on_host(getattr(p, name))), bits(getattr(before, name))), f"{name} was written"


# ------------------------------------------------------------------------------------ CUDA graphs
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
def test_cuda_graph_replays_a_decode_step(rng, dtype):
    """A decode step (append, rotary, paged, several splits) captured on a stream after one warm-up call
    there; replayed twice after refilling q, k, v, the caches and cache_seqlens in place, its output arrays
    hold the reference's results for the new contents."""
    options = dict(
        nq=1,
        nnew=1,
        page_size=16,
        capacity=1024,
        d=128,
        dv=128,
        rotary_dim=128,
        causal=True,
        alibi_slopes=alibi_slopes(8),
    )
    host = make_problem(rng, dtype, [10, 300, 0, 777], **options)
    p = to_device(host)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _run(p)  # the plan and this stream's workspace exist before capture
        stream.synchronize()
        stream.begin_capture()
        out, lse = _run(p)
        graph = stream.end_capture()
    for lengths in ([900, 0, 33, 1023], [901, 1, 34, 15]):
        step = make_problem(rng, dtype, lengths, **options)
        for name in ("q", "k_cache", "v_cache", "k", "v"):
            _fill(getattr(p, name), getattr(step, name))
        _fill(p.options["cache_seqlens"], step.options["cache_seqlens"])
        cupy.cuda.Device().synchronize()
        before = on_host(p)
        graph.launch(stream)
        stream.synchronize()
        compare(before, p, out, lse)


# ------------------------------------------------------------------------------------ merging attention states
def _states(rng, dtype, shape):
    """out (shape) in dtype and lse (shape[:-1]) in lse_dtype, some rows -inf."""
    out = random_array(rng, shape, dtype)
    lse = (3 * rng.standard_normal(shape[:-1])).astype(lse_dtype(dtype))
    lse[rng.random(lse.shape) < 0.3] = -np.inf
    return out, lse


def _assert_merge_close(ours, theirs, dtype):
    """CuPy's merge against NumPy's: -inf rows alike (and out exactly 0 there); elsewhere a few units of the
    accumulator's last place (exp and log may round differently), plus one of the dtype's for out."""
    (out, lse), (out_np, lse_np) = (to_host(x) for x in ours), (to_host(x) for x in theirs)
    assert ours[0].dtype == theirs[0].dtype and ours[1].dtype == theirs[1].dtype
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_np))
    assert not out[np.isneginf(lse)].any(), "out is not 0 where no part saw a key"
    eps = np.finfo(lse_dtype(dtype)).eps
    seen = np.isfinite(lse_np)
    assert np.all(np.abs(lse[seen] - lse_np[seen]) <= 4 * eps * np.maximum(1.0, np.abs(lse_np[seen])))
    bound = 8 * eps * max_abs(out_np) + np.spacing(np.abs(out_np).astype(dtype)).astype(np.float64)
    assert np.all(np.abs(out - out_np) <= bound), f"out differs by {max_abs(out - out_np):.3g}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_merge_attention_states(rng, dtype):
    """merge_attention_states and merge_attention_states_stacked of CuPy arrays give NumPy's results, rows
    that no part saw included."""
    shape = (2, 3, 37, 40)
    a, b = _states(rng, dtype, shape), _states(rng, dtype, shape)
    b[1][0, 0, :] = -np.inf
    a[1][0, 0, :] = -np.inf  # (0, 0, all rows): no part saw a key
    with nan_filled_allocations():
        ours = cupyflash.merge_attention_states(*(cupy.asarray(x) for x in (*a, *b)))
    _assert_merge_close(ours, cupyflash.merge_attention_states(*a, *b), dtype)

    parts = [_states(rng, dtype, shape) for _ in range(5)]
    for _, lse in parts:
        lse[1, 2, :] = -np.inf
    out, lse = np.stack([o for o, _ in parts]), np.stack([x for _, x in parts])
    with nan_filled_allocations():
        ours = cupyflash.merge_attention_states_stacked(cupy.asarray(out), cupy.asarray(lse))
    _assert_merge_close(ours, cupyflash.merge_attention_states_stacked(out, lse), dtype)


# ------------------------------------------------------------------------------------ edges of the argument space
def _small(rng, batch=2, capacity=40, nq=1, d=32):
    """A contiguous float32 problem on the GPU: q, k_cache, v_cache and int32 cache_seqlens."""
    q = cupy.asarray(random_array(rng, (batch, 4, nq, d), np.float32))
    k_cache, v_cache = (cupy.asarray(random_array(rng, (batch, 2, capacity, d), np.float32)) for _ in range(2))
    seqlens = cupy.asarray(rng.integers(1, capacity + 1, batch).astype(np.int32))
    return q, k_cache, v_cache, seqlens


@pytest.mark.parametrize("window", [(-1, 2**31 - 2), (2**31, 0), (2**40, 2**40)])
def test_a_window_wider_than_any_sequence_hides_nothing(rng, window):
    """Window edges past int32 or past any length mean unbounded on that side, as on the CPU path."""
    q, k_cache, v_cache, seqlens = _small(rng)
    with nan_filled_allocations():
        out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, window=window)
    expected = cupyflash.attention_with_kvcache(
        *(cupy.asnumpy(x) for x in (q, k_cache, v_cache)), cache_seqlens=cupy.asnumpy(seqlens), window=window
    )
    assert max_abs(cupy.asnumpy(out) - expected) <= 1e-5 * max(1.0, max_abs(expected))


def test_the_fast_path_keeps_the_checks_on_option_types(rng):
    """A layout seen before with causal=True does not let causal=1 through: the checks reject it."""
    q, k_cache, v_cache, seqlens = _small(rng)
    cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=1)
    with pytest.raises(ValueError, match="num_splits"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=True)


def test_int64_lengths_past_int32_are_out_of_range_not_wrapped(rng):
    """2**32 + 5 cached positions is out of range (NaN rows), not position 5."""
    q, k_cache, v_cache, seqlens = _small(rng)
    lengths = cupy.asarray(np.array([2**32 + 5, 7], dtype=np.int64))
    out, lse = cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_lse=True)
    assert bool(cupy.isnan(out[0]).all()) and bool(cupy.isnan(lse[0]).all())
    assert not bool(cupy.isnan(out[1]).any())


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("nq", [1, 9])
def test_a_nan_in_the_cache_makes_the_rows_that_see_it_nan(rng, nq, num_splits):
    """A NaN key in a 16-bit cache: the rows that see it come back NaN in out and in lse, as on the CPU path (16- and
    64-row tiles, one split or several); merged with another part of their keys they stay NaN (a part of lse -inf
    would weigh 0 and leave them finite)."""
    q, k_cache, v_cache, seqlens = _small(rng, nq=nq)
    q, k_cache, v_cache = (x.astype(np.float16) for x in (q, k_cache, v_cache))
    seqlens[:] = 30
    k_cache[0, 1, 7, 3] = np.nan
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True, num_splits=num_splits
    )
    cpu_out, cpu_lse = cupyflash.attention_with_kvcache(
        *(cupy.asnumpy(x) for x in (q, k_cache, v_cache)), cache_seqlens=30, return_lse=True
    )
    seen = np.isnan(cpu_lse)
    assert seen[0, 2:].all() and seen.sum() == 2 * nq, "the CPU path's NaN rows: key/value head 1 of sequence 0"
    np.testing.assert_array_equal(np.isnan(cupy.asnumpy(lse)), seen)
    np.testing.assert_array_equal(np.isnan(cupy.asnumpy(out)).all(-1), seen)
    other = cupy.zeros_like(out), cupy.zeros_like(lse)
    merged, merged_lse = cupyflash.merge_attention_states(out, lse, *other)
    np.testing.assert_array_equal(np.isnan(cupy.asnumpy(merged_lse)), seen)


def test_more_sequences_than_a_grid_holds_raise(rng):
    """B past CUDA's grid limit is a clear error, not a failed launch."""
    q, k_cache, v_cache, _ = _small(rng, batch=65536, capacity=1, d=8)
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)
