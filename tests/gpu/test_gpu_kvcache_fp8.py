"""attention_with_kvcache on FP8 caches on the GPU (cuda_src/attention_decode.cu's e4m3 tiles, the keys-as-rows
kernel of attention_decode_fp8.cu, kvcache_append.cu's kvcache_append_e4m3) against the float64 reference. Needs a
GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_kvcache_fp8.py

Every call is held by helpers/fp8_kvcache.py's ``check_fp8_on_gpu``: the caches after the append to the reference's
own append (codes and scales bit for bit; rotated keys within one e4m3 step), and out and lse to the reference on
the values the caches hold after the call, by the 16-bit accuracy rule. Allocations are poisoned with NaN.

Covered: every scale layout on contiguous caches and pages that hold whole tiles, straddle them or hold one
position; head dims of every HEAD bucket with 16-byte rows and without (row-by-row loads); grouped heads and
64-row tiles; long caches over many splits, with outlier channels; a prompt then decoding steps with rotary
embeddings; window, softcap, ALiBi on both decode kernels; a window with splits and Dv < D on the keys-as-rows
kernel; the split count; every e4m3 code widened exactly; non-finite appended values;
the fast path of a repeated layout; CUDA graph replay; quantize_kvcache and dequantize on CuPy.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.fp8_kvcache import SCALINGS, check_fp8_on_gpu, device_problem, make_fp8_problem
from helpers.gpu import nan_filled_allocations
from helpers.kvcache import Problem, counting_resolve, run
from helpers.modifiers import alibi_slopes

import cupyflash
from cupyflash._cuda import tile_policy

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# (page_size or None, capacity): a contiguous cache (blocks of 128); pages of 64 (whole tiles), 16 and 5 (tiles over
# several pages, row by row), 1, and 160 (two scale blocks per page).
LAYOUTS = {
    "contiguous": (None, 300),
    "pages of 64": (64, 320),
    "pages of 16": (16, 96),
    "pages of 5": (5, 60),
    "pages of 1": (1, 40),
    "pages of 160": (160, 320),
}


def _run(p, **changes):
    with nan_filled_allocations():
        return run(p, **changes)


def _seqlens(capacity, nnew):
    """Lengths 0, 1, one across a block or page boundary, and the capacity."""
    return [0, 1, min(127, capacity - nnew - 1), capacity - nnew]


@pytest.mark.parametrize("nnew", [0, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d,dv", [(128, 128), (40, 24)], ids=["d128", "d40-dv24"])
def test_matches_reference(rng, d, dv, dtype, scaling, layout, nnew):
    """Grouped heads (8 over 2), causal, Nq = 4 (2 without an append); D = 40 / Dv = 24 rows are not whole 16-byte
    chunks (the row-by-row loads). Block scales in pages of 160 (two blocks a page, the second short) are read, but
    the GPU refuses to append into them: its blocks of positions would straddle pages."""
    page_size, capacity = LAYOUTS[layout]
    p = make_fp8_problem(
        rng, dtype, _seqlens(capacity, nnew), scaling=scaling, nq=4 if nnew else 2, nnew=nnew, page_size=page_size,
        capacity=capacity, d=d, dv=dv, causal=True,
    )  # fmt: skip
    if nnew and scaling == "block" and page_size is not None and page_size % p.k_cache.block:
        d_problem = device_problem(p)
        codes = d_problem.k_cache.data.copy()
        with pytest.raises(ValueError, match="only where a page holds whole blocks"):
            run(d_problem)
        assert bool((d_problem.k_cache.data == codes).all()), "a refused append wrote the cache"
        return
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("d", [16, 32, 64, 96, 256])
def test_head_dims(rng, d):
    """Every HEAD bucket (and 96 inside 128), Dv = D."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [0, 77, 200], scaling="block", nq=2, nnew=2, page_size=None, capacity=220, d=d,
        dv=d, causal=True,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("hq,hk,nq", [(32, 8, 1), (8, 1, 9), (4, 4, 1), (16, 2, 12)])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_grouped_heads(rng, scaling, hq, hk, nq):
    """Packed rows G * Nq from 1 to 96: 16-row tiles, several of them, and 64-row tiles."""
    p = make_fp8_problem(
        rng, np.float16, [33, 130], scaling=scaling, nq=nq, nnew=nq, page_size=16, capacity=192, hq=hq, hk=hk,
        d=128, dv=128, causal=True,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("page_size", [None, 64, 16])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_long_caches_with_outlier_channels(rng, scaling, page_size):
    """Caches of up to 8k keys (many splits, merged by the kernel), key dims 3 and 7 ten times larger."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [8191, 3000, 17], scaling=scaling, nq=1, nnew=1, page_size=page_size,
        capacity=8192, hq=16, hk=4, d=128, dv=128, outliers=10.0, causal=True,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_long_caches_with_a_mean(rng, scaling, page_size):
    """Caches of up to 8k keys centred on 3 (a block's scale follows the mean), key dims 3 and 7 ten times larger."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [8191, 2000, 33], scaling=scaling, nq=1, nnew=1, page_size=page_size,
        capacity=8192, hq=32, hk=8, d=128, dv=128, outliers=10.0, mean=3.0, causal=True,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("page_size", [None, 16])
def test_prefill_then_decode_with_rotary(rng, page_size):
    """A prompt of 300 positions appended into empty block-scaled caches (scales set by the call, across blocks and
    pages), then decoding steps, keys rotated before they are quantized."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [0, 0], scaling="block", nq=300, nnew=300, page_size=page_size, capacity=400,
        hq=8, hk=2, d=64, dv=64, causal=True, rotary_dim=64,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)
    for _ in range(3):
        q, k, v = (rng.standard_normal(x.shape[:2] + (1, x.shape[3]), dtype=np.float32) for x in (p.q, p.k, p.v))
        q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
        p = Problem(q, p.k_cache, p.v_cache, k, v, dict(p.options, cache_seqlens=p.seqlens() + p.nnew))
        check_fp8_on_gpu(p, _run)


MODIFIERS = {
    "window": dict(window=(70, 0)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True),
    "window-softcap": dict(window=(33, 0), softcap=3.0),
}


# (query heads, key/value heads, page size): 12 rows per key/value head (G 4 x Nq 3) on the tiled kernel,
# contiguous and in pages of 11; 6 rows (G 2 x Nq 3) on the keys-as-rows kernel, contiguous and in pages of 32.
ROUTES = {
    "tiled": (8, 2, None),
    "tiled, pages of 11": (8, 2, 11),
    "keys-as-rows": (4, 2, None),
    "keys-as-rows, pages of 32": (4, 2, 32),
}


@pytest.mark.parametrize("modifiers", MODIFIERS)
@pytest.mark.parametrize("route", ROUTES)
def test_modifiers(rng, modifiers, route):
    hq, hk, page_size = ROUTES[route]
    variant = tile_policy.decode("bfloat16", 64, 64, hq // hk * 3, page_size, "e4m3", True)
    assert variant.keys_as_rows == route.startswith("keys-as-rows"), variant  # each kernel's masked path is held
    options = dict(MODIFIERS[modifiers])
    if options.pop("alibi", False):
        options["alibi_slopes"] = alibi_slopes(hq)
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [5, 140, 290], scaling="block", nq=3, nnew=3, page_size=page_size, capacity=320,
        hq=hq, hk=hk, d=64, dv=64, causal=True, **options,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_keys_as_rows_with_a_window_splits_and_narrower_values(rng, num_splits):
    """The keys-as-rows kernel with 4 rows per key/value head (G 2 x Nq 2), D 128 and Dv 64, a window, the split
    count, pages of 16: sequences of 0 keys, of fewer keys than a 16-key group, and longer than the window."""
    assert tile_policy.decode("float16", 128, 64, 4, 16, "e4m3", True).keys_as_rows
    p = make_fp8_problem(
        rng, np.float16, [3000, 13, 0, 700], scaling="block", nq=2, nnew=2, page_size=16, capacity=3072, hq=4, hk=2,
        d=128, dv=64, causal=True, window=(500, 0), num_splits=num_splits,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_num_splits(rng, num_splits):
    p = make_fp8_problem(
        rng, np.float16, [4000, 70], scaling="head", nq=1, nnew=1, page_size=None, capacity=4096, d=128, dv=128,
        causal=True, num_splits=num_splits,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_every_code_is_widened_exactly(dtype):
    """One key per sequence, so out is its value row: the 256 codes (two rows of 128) read back as e4m3 values times
    the scale, exactly, the NaN codes as NaN."""
    codes = np.arange(256, dtype=np.uint8).reshape(2, 1, 1, 128)
    scale = np.full((1, 1, 1), 0.75, np.float32)
    k8 = cupyflash.FP8KVCache(cupy.zeros((2, 1, 1, 128), np.uint8), cupy.asarray(scale), "tensor")
    v8 = cupyflash.FP8KVCache(cupy.asarray(codes), cupy.asarray(scale), "tensor")
    q = cupy.asarray(np.zeros((2, 1, 1, 128), dtype))
    out = cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=1)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 0.75
    got = out.view(np.uint16).get().view(dtype).astype(np.float64)
    nan = np.isnan(values.reshape(2, 1, 1, 128))
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], values.reshape(2, 1, 1, 128)[~nan].astype(dtype).astype(np.float64))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("nq", [1, 3], ids=["keys-as-rows", "tiled"])
def test_non_finite_new_values_read_back_as_nan(rng, nq, num_splits):
    """The GPU cannot check CuPy values before the call: a NaN or infinite new key is stored as NaN codes (an infinite
    one also makes the scale of a block it starts infinite), and the rows that see it come back NaN in out and in
    lse, never finite (the CPU path gives the same for a cache holding NaN codes), on both decode kernels, in one
    split or several; merged with another part of their keys (merge_attention_states), they stay NaN."""
    p = make_fp8_problem(
        rng, np.float16, [10, 10], scaling="block", nq=nq, nnew=nq, capacity=64, d=64, dv=64, num_splits=num_splits
    )
    d = device_problem(p)
    k = d.k.copy()
    k[0, 0, 0, 5] = cupy.asarray(np.float16(np.nan))
    k[1, 1, 0, 9] = cupy.asarray(np.float16(np.inf))
    out, lse = cupyflash.attention_with_kvcache(d.q, d.k_cache, d.v_cache, k, d.v, return_lse=True, **d.options)
    seen = np.zeros(out.shape[:3], bool)  # (B, Hq, Nq): the rows of key/value head 0 of sequence 0, 1 of 1
    seen[0, :4], seen[1, 4:] = True, True
    out_h, lse_h = out.get(), lse.get()
    assert np.isnan(out_h[seen]).all() and np.isnan(lse_h[seen]).all(), "rows seeing a non-finite key are not NaN"
    assert np.isfinite(out_h[~seen]).all() and np.isfinite(lse_h[~seen]).all(), "rows of other heads are not finite"
    other = cupy.asarray(rng.standard_normal(out.shape).astype(np.float16)), cupy.zeros(lse.shape, np.float32)
    merged, merged_lse = cupyflash.merge_attention_states(out, lse, *other)
    assert np.isnan(merged.get()[seen]).all() and np.isnan(merged_lse.get()[seen]).all(), "a merge made them finite"


@pytest.mark.parametrize("page_size", [None, 16])
def test_non_finite_values_before_a_window_stay_unseen(rng, page_size):
    """Keys before a window's first seen key are hidden from every row: a NaN code there (as a non-finite append
    leaves) changes nothing, on the keys-as-rows kernel too, whose 16-key groups may start before that key (the CPU
    path ignores hidden keys alike)."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [200, 201], scaling="block", nq=1, nnew=0, page_size=page_size, capacity=256,
        hq=8, hk=2, d=128, dv=128, causal=True, window=(50, 0),
    )  # fmt: skip
    d = device_problem(p)
    clean = cupyflash.attention_with_kvcache(d.q, d.k_cache, d.v_cache, **d.options).get()
    # the first seen keys are 149 and 150; positions 144-148 share their 16-key group
    for b, pos in ((0, 146), (1, 148)):
        page, row = (b, pos) if page_size is None else (int(p.options["block_table"][b, pos // 16]), pos % 16)
        d.k_cache.data[page, :, row, :] = 0x7F
        d.v_cache.data[page, :, row, :] = 0x7F
    out = cupyflash.attention_with_kvcache(d.q, d.k_cache, d.v_cache, **d.options).get()
    assert np.isfinite(out).all(), "a NaN code no row sees made out NaN"
    np.testing.assert_array_equal(out, clean)


def test_fast_path_of_a_repeated_layout(rng, monkeypatch):
    """A serving loop's second call with the same layout (new arrays, new data, new lengths) skips the checks (the
    plan cache's call key covers the holders' arrays, scaling and block) and gives what a checked call gives."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [100, 250], scaling="block", nq=1, nnew=1, page_size=16, capacity=256, d=128,
        dv=128, causal=True,
    )  # fmt: skip
    check_fp8_on_gpu(p, _run)
    calls = counting_resolve(monkeypatch)
    q2 = rng.standard_normal(p.q.shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    seqlens = (p.seqlens() + 1).astype(np.int32)  # int32, as the first call's: no cast, the same layout
    p = Problem(q2, p.k_cache, p.v_cache, p.k, p.v, dict(p.options, cache_seqlens=seqlens))
    check_fp8_on_gpu(p, _run)
    assert not calls, "the repeated FP8 layout took the checked path"


def test_cuda_graph_replay(rng):
    """A decoding step captured in a CUDA graph and replayed gives the eager step's out and caches."""
    p = make_fp8_problem(
        rng, ml_dtypes.bfloat16, [60, 200], scaling="block", nq=1, nnew=1, capacity=256, d=128, dv=128, causal=True
    )
    eager, graphed = device_problem(p), device_problem(p)
    expected = cupyflash.attention_with_kvcache(
        eager.q, eager.k_cache, eager.v_cache, eager.k, eager.v, **eager.options
    )
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        warm = device_problem(p)  # the first call on this stream makes the plan's workspace
        cupyflash.attention_with_kvcache(warm.q, warm.k_cache, warm.v_cache, warm.k, warm.v, **warm.options)
        stream.begin_capture()
        out = cupyflash.attention_with_kvcache(
            graphed.q, graphed.k_cache, graphed.v_cache, graphed.k, graphed.v, **graphed.options
        )
        graph = stream.end_capture()
        graph.launch()
    stream.synchronize()
    np.testing.assert_array_equal(out.view(np.uint16).get(), expected.view(np.uint16).get())
    for a, b in ((graphed.k_cache, eager.k_cache), (graphed.v_cache, eager.v_cache)):
        np.testing.assert_array_equal(a.data.get(), b.data.get())
        np.testing.assert_array_equal(a.scale.get(), b.scale.get())


def test_float32_queries_are_refused_with_the_dtypes_that_work(rng):
    k8, v8 = (cupyflash.quantize_kvcache(cupy.asarray(rng.standard_normal((2, 2, 64, 32), np.float32))) for _ in "kv")
    q = cupy.asarray(rng.standard_normal((2, 4, 1, 32), np.float32))
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=3)


@pytest.mark.parametrize("scaling", ["tensor", "head", "block"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=["float16", "bfloat16", "float32"])
def test_quantize_and_dequantize_give_numpy_bits(rng, dtype, scaling):
    x = rng.standard_normal((3, 2, 300, 40), dtype=np.float32).astype(dtype)
    on_host, on_gpu = cupyflash.quantize_kvcache(x, scaling), cupyflash.quantize_kvcache(cupy.asarray(x), scaling)
    np.testing.assert_array_equal(on_gpu.data.get(), on_host.data)
    np.testing.assert_array_equal(on_gpu.scale.get(), on_host.scale)
    for out_dtype in (np.float32, np.float64):
        np.testing.assert_array_equal(on_gpu.dequantize(out_dtype).get(), on_host.dequantize(out_dtype))
