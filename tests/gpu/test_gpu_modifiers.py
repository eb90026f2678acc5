"""The score modifiers (window, softcap, ALiBi, bias with its gradient, mask, block mask, probabilities) in the
CUDA kernels, against the float64 reference. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_modifiers.py

Same rule as test_gpu.py (tests/helpers/checks.py: its naive implementation takes every option), with every
allocation poisoned with NaN so that an element the kernels never write fails. Where a test asserts which
kernel ran, it asks the selection (cupyflash._cuda.variants.select) with the current device's abilities.
"""

import functools
import threading

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_matches_reference
from helpers.gpu import nan_filled_allocations
from helpers.modifiers import OPTIONS, alibi_slopes, block_grid, random_options, run
from helpers.problems import random_array, random_problem

import cupyflash
from cupyflash import _modifiers, reference
from cupyflash._cuda import dense, launch, plans, tile_policy, tiles, tma
from cupyflash._cuda.compile import current_device, sm_count
from cupyflash._cuda.variants import Features

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_random = functools.partial(random_array, xp=cupy)
_random_problem = functools.partial(random_problem, xp=cupy)


def _selected(direction, dtype, head_dim, causal, mods, dv=None):
    """The variant the current device's call of these features runs (D = head_dim, Dv = dv or head_dim)."""
    features = Features.of(direction, np.dtype(dtype), head_dim, head_dim if dv is None else dv, causal, mods)
    return tile_policy.dense(features, current_device())


def _hopper_paths():
    return current_device().wgmma


def _ws_head_dim():
    """The head dim the warp-specialized tests below are built around (their L2-section and tile-count
    premises); test_warp_specialized_forward_at_each_head_dim covers the others."""
    return 128


def _ws_rows():
    return tiles.lookup("ws", 2, _ws_head_dim(), "fwd", "plain").rows


def _run(q, k, v, dout, *, causal, scale=None, **options):
    with nan_filled_allocations():
        return run(q, k, v, dout, causal=causal, scale=scale, **options)


def _check(rng, dtype, batch, nq, nk, d, causal, which, *, dv=None, bias_shape=None, scale=None):
    """Draw a problem and the options named in ``which``; run the kernels; compare with the reference."""
    dv = d if dv is None else dv
    q, k, v, dout = _random_problem(rng, batch + (nq, d), batch + (nk, d), batch + (nk, dv), dtype)
    options = random_options(rng, which, batch, nq, nk, dtype, xp=cupy, bias_shape=bias_shape)
    results = _run(q, k, v, dout, causal=causal, scale=scale, **options)
    assert_matches_reference(q, k, v, dout, results, causal=causal, scale=scale, **options)
    return results


@pytest.mark.parametrize(
    "which",
    [[], ["window"], ["softcap", "alibi_slopes"], ["window", "softcap", "block_mask"]],
    ids=["plain", "window", "softcap-alibi", "window-softcap-block-mask"],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "d, dtype",
    [
        (40, np.float16),
        (64, ml_dtypes.bfloat16),
        (176, ml_dtypes.bfloat16),
        (192, np.float16),
        (200, ml_dtypes.bfloat16),
        (256, np.float16),
    ],
    ids=["d40-float16", "d64", "d176", "d192-float16", "d200", "d256-float16"],
)
def test_warp_specialized_forward_at_each_head_dim(rng, d, dtype, causal, which):
    """The warp-specialized forward at 16-bit HEAD_DIM 64 (128-key blocks), 192 and 256 (64-key blocks, one q buffer;
    a block mask takes the other forward there), head dims padded to them or not, with more row blocks than the GPU
    has SMs so that CTAs run several tiles, on sizes off the tile grid."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    batch = (3, 2 * sm_count(cupy.cuda.Device().id) // 5 + 1)  # two tiles of 128 rows per head: about 2.4 per SM
    q, k, v, dout = _random_problem(rng, batch + (133, d), batch + (197, d), batch + (197, d), dtype)
    options = random_options(rng, which, batch, 133, 197, dtype, xp=cupy)
    mods = _modifiers.resolve(cupy, np.dtype(dtype), batch, 133, 197, **options) if options else None
    chosen = _selected("fwd", dtype, -(-d // 8) * 8, causal, mods)
    if "block_mask" in which and -(-d // 8) * 8 > 128:
        assert chosen.path != "ws", chosen  # the 64-key blocks are not the mask's 128-key tiles
    else:
        assert chosen.path == "ws" and chosen.block_mask == ("block_mask" in which), chosen
    results = _run(q, k, v, dout, causal=causal, **options)
    assert_matches_reference(q, k, v, dout, results, causal=causal, **options)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_each_option_alone(rng, dtype, causal, option):
    _check(rng, dtype, (2, 3), 203, 290, 64, causal, [option])


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_all_options_combined(rng, dtype, causal, head_dim):
    _check(rng, dtype, (2, 2), 300, 457, head_dim, causal, OPTIONS)


@pytest.mark.parametrize("head_dim", [16, 32, 72, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_softcap_alone_at_every_head_dim(rng, dtype, causal, head_dim):
    """A softcap and no other option: on Hopper the backward runs the Mods::softcap passes (causal as the plain
    kernels take it), pipelined or not by head dim; Nq > Nk leaves causal rows that see no key."""
    _check(rng, dtype, (1, 2), 197, 130, head_dim, causal, ["softcap"])
    mods = _modifiers.resolve(cupy, np.dtype(dtype), (1, 2), 197, 130, softcap=5.0)
    variant = _selected("bwd", dtype, head_dim, causal, mods)
    assert (variant.mods == "softcap") == (_hopper_paths() and tiles.has("wgmma", 2, variant.head_dim))


@pytest.mark.parametrize("head_dim", [16, 32, 72, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_window_alone_at_every_head_dim(rng, dtype, causal, head_dim):
    """A window and no other option: on Hopper the forward and backward run Mods::window (causal as its right
    edge). Nq > Nk with a band: rows that see no key, and tiles on both sides of the band."""
    _check(rng, dtype, (1, 2), 197, 130, head_dim, causal, ["window"])
    mods = _modifiers.resolve(cupy, np.dtype(dtype), (1, 2), 197, 130, window=(40, 9))
    for direction in ("fwd", "bwd"):
        variant = _selected(direction, dtype, head_dim, causal, mods)
        assert (variant.mods == "window") == (_hopper_paths() and tiles.has("wgmma", 2, variant.head_dim))


def _own_window_tiles():
    """The head dims where the tile table gives the window alone cells of its own (the wgmma forward or
    backward, or the warp-specialized forward)."""
    found = set()
    for (path, itemsize, head_dim, kernel, form), cell in tiles.CELLS.items():
        if form == "window" and itemsize == 2:
            other = "plain" if path == "ws" else "scalars"
            if cell != tiles.lookup(path, itemsize, head_dim, kernel, other):
                found.add(head_dim)
    return sorted(found)


@pytest.mark.parametrize("head_dim", _own_window_tiles())
@pytest.mark.parametrize("window, causal", [((300, 0), True), ((257, 31), False), ((-1, 40), False)])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_window_alone_long_bands(rng, dtype, window, causal, head_dim):
    """Bands of many key blocks through the window-alone kernels' own tiles (on Hopper at the head dims where
    the tile table gives the window alone cells of its own), with sizes off every tile and Nq != Nk."""
    q, k, v, dout = _random_problem(rng, (2, 2, 701, head_dim), (2, 2, 650, head_dim), (2, 2, 650, head_dim), dtype)
    results = _run(q, k, v, dout, causal=causal, window=window)
    assert_matches_reference(q, k, v, dout, results, causal=causal, window=window)
    mods = _modifiers.resolve(cupy, np.dtype(dtype), (2, 2), 701, 650, window=window)
    forward, backward = (_selected(d, dtype, head_dim, causal, mods) for d in ("fwd", "bwd"))
    if _hopper_paths():
        assert forward.mods == backward.mods == "window" and backward.path == "wgmma"
        ws = tiles.ws_head_dim(head_dim)
        assert forward.path == ("ws" if ws else "wgmma")
        assert forward.tiles("fwd") == tiles.lookup(forward.path, 2, ws or head_dim, "fwd", "window")
        for kernel in ("dkdv", "dq"):
            assert backward.tiles(kernel) == tiles.lookup("wgmma", 2, head_dim, kernel, "window")
    else:
        assert forward.mods == backward.mods == "scalars" and forward.path == backward.path == "mma"


def _dense_plans() -> list:
    """Every dense plan the cache holds: its plan entries, and the plans of its call entries (an entry of either
    role may have been evicted without the other)."""
    calls = [c.plan for c in plans.entries("call").values() if isinstance(c, launch.Call)]
    return list(plans.entries("plan").values()) + calls


class _CountTensorMaps:
    """Counts the tensor maps attention_forward builds (one per planned warp-specialized forward)."""

    def __init__(self, monkeypatch):
        self.built = 0
        original = tma.TensorMaps.__init__

        def counted(maps, *args, **kwargs):
            self.built += 1
            original(maps, *args, **kwargs)

        monkeypatch.setattr(tma.TensorMaps, "__init__", counted)


@pytest.mark.parametrize(
    "options, causal",
    [
        ({"window": (256, 0)}, True),
        ({"window": (100, 17)}, False),
        ({"window": (-1, 0)}, True),
        ({}, True),
        ({}, False),
        ({"softcap": 30.0}, True),
        ({"softcap": 3.0}, False),
        ({"alibi_slopes": "drawn"}, False),
        ({"alibi_slopes": "drawn", "softcap": 50.0, "window": (300, 20)}, True),
    ],
    ids=[
        "window-causal",
        "window",
        "left-unbounded",
        "causal",
        "plain",
        "softcap-causal",
        "softcap",
        "alibi",
        "all-scalars-causal",
    ],
)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_warp_specialized_forward_many_tiles_per_cta(rng, monkeypatch, dtype, options, causal):
    """The warp-specialized forward (on Hopper at the head dims of tiles.WS_HEAD_DIMS: plain, causal, windows
    and the other scalar modifiers) with more tiles than SMs, so that every persistent CTA runs several, drawn
    from the tile counter, and its q buffers and K/V ring carry over from one tile to the next; sizes off
    every tile, Nq != Nk, and rows past the band's start that see no key. The same plan called again gives
    the same out and lse, and each launch leaves its tile counter at zero for the next."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    head_dim = _ws_head_dim()
    batch, nq, nk = (16, 4), 601, 650
    tile_count = batch[0] * batch[1] * -(-nq // _ws_rows())
    assert tile_count > 2 * sm_count(cupy.cuda.Device().id), "every CTA runs several tiles"
    q, k, v, dout = _random_problem(rng, batch + (nq, head_dim), batch + (nk, head_dim), batch + (nk, head_dim), dtype)
    if "alibi_slopes" in options:  # a slope per head, broadcast over the batch
        options = {**options, "alibi_slopes": cupy.asarray(rng.uniform(0.01, 0.3, (1, batch[1])), dtype=cupy.float32)}
    counter = _CountTensorMaps(monkeypatch)
    plans.clear()
    results = _run(q, k, v, dout, causal=causal, **options)
    assert counter.built == 1
    assert_matches_reference(q, k, v, dout, results, causal=causal, **options)
    with nan_filled_allocations():
        again = cupyflash.attention_forward(q, k, v, causal=causal, **options)
    assert counter.built == 1, "the second call reuses the plan"
    for first, second in zip(results[:2], again):
        assert bool(cupy.array_equal(first, second))
    known = _dense_plans()
    plan = next(p for p in known if p.tensor_maps is not None)
    assert [int(c.get()[0]) for c in plan.tile_counters.values()] == [0], "each launch leaves its counter at zero"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch, nq, nk", [((40, 4), 600, 600), ((1, 2), 256, 66_000)], ids=["sections-short-last", "one-head-per-section"]
)
def test_warp_specialized_forward_tile_order_over_l2_sections(rng, batch, nq, nk, causal):
    """The warp-specialized forward hands out tiles section by section, each section holding the heads whose
    k and v fit its L2 budget (8 MB; at most 32 MB would still make these cases what they are): 160 heads of
    600 keys make several sections and a shorter last one; 66,000 keys (33.8 MB of k and v per head) make a
    section of one head at either budget. Each tile's rows are then found from its section again, so
    every row block of every head must come out once, right."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    head_dim = _ws_head_dim()
    heads, kv_bytes = batch[0] * batch[1], nk * 2 * head_dim * 2  # k and v of one head in bf16
    for budget in (8 << 20, 32 << 20):  # the test's premise at the kernel's budget and at four times it
        group = max(1, min(heads, budget // kv_bytes))
        assert group < heads and (group == 1 or heads % group), "several sections: one head each, or a short last"
    q, k, v, dout = _random_problem(
        rng, batch + (nq, head_dim), batch + (nk, head_dim), batch + (nk, head_dim), ml_dtypes.bfloat16
    )
    plans.clear()
    results = _run(q, k, v, dout, causal=causal)
    assert any(p.tensor_maps is not None for p in plans.entries("plan").values()), "the warp-specialized forward ran"
    assert_matches_reference(q, k, v, dout, results, causal=causal)


@pytest.mark.parametrize("nq, nk", [(700, 700), (300, 1000), (1000, 300)], ids=["square", "more-keys", "more-queries"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_warp_specialized_alibi_on_either_side_of_the_diagonal(rng, dtype, causal, nq, nk):
    """The warp-specialized forward's ALiBi forms (score alibi, alibi_half_first) split the slope term into a
    column part, fused with the exponent's scale, and a shift per row, on key blocks that lie wholly on one
    side of every row's diagonal position i + Nk - Nq, and take |i + Nk - Nq - j| per score on blocks across
    it. Full rows see blocks on both sides; Nq != Nk moves the diagonal off the tile grid either way; slopes
    from 2^-8 (blocks far from the diagonal still count) to 1 (only the nearest keys do); alone, then with a
    window and a softcap. With a right edge (causal, the window's) its half-width first block runs: for
    warpgroup 0 of the square problem's causal diagonal blocks, for warpgroup 1 where Nk = Nq + 700."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    batch, head_dim = (2, 4), _ws_head_dim()
    slopes = cupy.asarray([2.0**-8, 2.0**-4, 0.25, 1.0], dtype=cupy.float32)
    for extra in ({}, {"window": (200, 50), "softcap": 20.0}):
        options = {"alibi_slopes": slopes, **extra}
        q, k, v, dout = _random_problem(
            rng, batch + (nq, head_dim), batch + (nk, head_dim), batch + (nk, head_dim), dtype
        )
        plans.clear()
        results = _run(q, k, v, dout, causal=causal, **options)
        ran = [
            p.variant
            for p in plans.entries("plan").values()
            if p.variant.score.startswith("alibi") and p.tensor_maps is not None
        ]
        assert ran, "the ALiBi form ran"
        # causal, or the window's right edge 50: the half-width first block (score alibi_half_first)
        assert all((v.score == "alibi_half_first") == (causal or "window" in extra) for v in ran), ran
        assert_matches_reference(q, k, v, dout, results, causal=causal, **options)


def _warp_specialized_problems(rng, count):
    """``count`` bf16 problems of more tiles than SMs for the warp-specialized forward, with no plan cached
    (skips where that forward does not run)."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    shape = (16, 4, 601, _ws_head_dim())
    plans.clear()
    return [_random_problem(rng, shape, shape, shape, ml_dtypes.bfloat16) for _ in range(count)]


def test_warp_specialized_forward_on_two_streams_at_once(rng):
    """One plan launched in turn on two streams, whose launches may run at once: each stream draws tiles from
    its own counter, every launch on a stream gives the same out and lse, and both match the reference."""
    problems = _warp_specialized_problems(rng, 2)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in problems]
    cupy.cuda.Device().synchronize()
    outs = []
    for _ in range(3):
        for stream, (q, k, v, _) in zip(streams, problems):
            with stream:
                outs.append(cupyflash.attention_forward(q, k, v, causal=True))
    for stream in streams:
        stream.synchronize()
    known = _dense_plans()
    plan = next(p for p in known if p.tensor_maps is not None)
    assert len(plan.tile_counters) == 2 and all(int(c.get()[0]) == 0 for c in plan.tile_counters.values())
    for i, (out, lse) in enumerate(outs):
        q, k, v, dout = problems[i % 2]
        expected_out, expected_lse = outs[i % 2]
        assert bool(cupy.array_equal(out, expected_out)) and bool(cupy.array_equal(lse, expected_lse))
    for (q, k, v, dout), (out, lse) in zip(problems, outs[:2]):
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        assert_matches_reference(q, k, v, dout, (out, lse, *grads), causal=True)


def test_warp_specialized_forward_on_the_per_thread_default_stream_from_threads(rng):
    """Three threads at once on the per-thread default stream, whose one handle names a different stream in
    each thread, so their launches of one plan may run at once: each launch gets its own zeroed tile counter
    (none is kept for that handle), and every thread's calls give the out and lse of the same problem run
    alone on the legacy stream, bit for bit."""
    problems = _warp_specialized_problems(rng, 3)
    expected = [cupyflash.attention_forward(q, k, v, causal=True) for q, k, v, _ in problems]
    cupy.cuda.Device().synchronize()
    barrier = threading.Barrier(len(problems))
    results, errors = {}, []

    def work(i):
        q, k, v, _ = problems[i]
        try:
            with cupy.cuda.Stream.ptds:
                barrier.wait(timeout=120)
                results[i] = [cupyflash.attention_forward(q, k, v, causal=True) for _ in range(4)]
                cupy.cuda.Stream.ptds.synchronize()
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a thread is still running after 10 minutes"
    if errors:
        raise errors[0]
    known = _dense_plans()
    plan = next(p for p in known if p.tensor_maps is not None)
    assert launch._PER_THREAD_STREAM not in plan.tile_counters
    for i, (expected_out, expected_lse) in enumerate(expected):
        for out, lse in results[i]:
            assert bool(cupy.array_equal(out, expected_out)) and bool(cupy.array_equal(lse, expected_lse))
    q, k, v, dout = problems[0]
    grads = cupyflash.attention_backward(dout, q, k, v, *expected[0], causal=True)
    assert_matches_reference(q, k, v, dout, (*expected[0], *grads), causal=True)


@pytest.mark.parametrize("d, dv", [(100, 120), (128, 104), (97, 97), (80, 80), (72, 96), (136, 136), (160, 192)])
def test_warp_specialized_forward_narrower_heads(rng, monkeypatch, d, dv):
    """Head dims padded up to a HEAD_DIM of tiles.WS_HEAD_DIMS (tiles.ws_head_dim): the tensor maps' zero fill
    supplies the columns past d (and dv), and only dv columns of out are written."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    assert tiles.ws_head_dim(max(d, dv)) in tiles.WS_HEAD_DIMS
    counter = _CountTensorMaps(monkeypatch)
    plans.clear()
    q, k, v, dout = _random_problem(rng, (1, 3, 333, d), (1, 3, 400, d), (1, 3, 400, dv), ml_dtypes.bfloat16)
    results = _run(q, k, v, dout, causal=True, window=(200, 0))
    assert counter.built == 1
    assert_matches_reference(q, k, v, dout, results, causal=True, window=(200, 0))


@pytest.mark.parametrize("d", [80, 160])
def test_padded_head_dims_fall_back_to_their_own_wgmma_forward(rng, monkeypatch, d):
    """Head dims that the warp-specialized forward serves padded (65-96 at 128, 129-192 at 256), with q shared
    across heads (no tensor map): the wgmma forward at the table's own HEAD_DIM (96, 160), plain causal and with a
    window alone, matching float64."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    loaded = []  # the variants whose kernels the calls ask for
    functions = dense.functions
    monkeypatch.setattr(dense, "functions", lambda variant: loaded.append(variant) or functions(variant))
    q, k, v, dout = _random_problem(rng, (2, 1, 300, d), (2, 4, 333, d), (2, 4, 333, d), ml_dtypes.bfloat16)
    plans.clear()
    for options in ({}, {"window": (50, 0)}):
        loaded.clear()
        results = _run(q, k, v, dout, causal=True, **options)
        forward = next(variant for variant in loaded if variant.direction == "fwd")
        assert (forward.path, forward.head_dim) == ("wgmma", tiles.padded_head_dim(d)), options
        assert_matches_reference(q, k, v, dout, results, causal=True, **options)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_warp_specialized_forward_falls_back_where_tma_cannot_read(rng, monkeypatch, dtype):
    """q shared across heads (a broadcast batch dim, stride 0, that q's tensor map cannot step through; k's and
    v's can) takes the window-alone kernel, for causal the wgmma forward, and for a softcap the scalars' one
    (bounded in bfloat16), instead, with the same results; a q sliced from wider rows (strided, its rows 16-byte
    aligned) stays on the warp-specialized one."""
    if not _hopper_paths():
        pytest.skip("the warp-specialized forward runs on compute capability 9.0 only")
    head_dim = _ws_head_dim()
    counter = _CountTensorMaps(monkeypatch)
    q, k, v, dout = _random_problem(rng, (2, 1, 300, head_dim), (2, 4, 333, head_dim), (2, 4, 333, head_dim), dtype)
    plans.clear()
    results = _run(q, k, v, dout, causal=True, window=(50, 0))
    assert counter.built == 0
    assert_matches_reference(q, k, v, dout, results, causal=True, window=(50, 0))
    results = _run(q, k, v, dout, causal=True)
    assert counter.built == 0
    assert_matches_reference(q, k, v, dout, results, causal=True)
    loaded = []  # the variants whose kernels the calls ask for
    functions = dense.functions
    monkeypatch.setattr(dense, "functions", lambda variant: loaded.append(variant) or functions(variant))
    results = _run(q, k, v, dout, causal=True, softcap=20.0)
    assert counter.built == 0
    forward = next(variant for variant in loaded if variant.direction == "fwd")
    assert forward.path != "ws" and (forward.score == "bounded") == (dtype is ml_dtypes.bfloat16)
    assert_matches_reference(q, k, v, dout, results, causal=True, softcap=20.0)
    wide = _random(rng, (2, 3, 300, head_dim + 8), dtype)  # rows of 136 elements: 272 bytes, 16-byte aligned
    q = wide[..., :head_dim]
    k, v, dout = (
        _random(rng, shape, dtype) for shape in ((2, 3, 280, head_dim), (2, 3, 280, head_dim), (2, 3, 300, head_dim))
    )
    results = _run(q, k, v, dout, causal=False, window=(40, 40))
    assert counter.built == 1
    assert_matches_reference(q, k, v, dout, results, causal=False, window=(40, 40))


@pytest.mark.parametrize(
    "batch, nq, nk", [((1, 2), 1, 1), ((1, 2), 1, 300), ((2, 2), 203, 113), ((2, 2), 113, 203), ((1, 2), 1023, 1024)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_awkward_sizes_every_option(rng, causal, batch, nq, nk):
    _check(rng, ml_dtypes.bfloat16, batch, nq, nk, 64, causal, OPTIONS)


@pytest.mark.parametrize("window", [(0, 0), (5, -1), (-1, 3), (130, 0), (0, 200), (1000, 1000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(300, 300), (150, 420), (420, 150)])
def test_windows(rng, nq, nk, causal, window):
    q, k, v, dout = _random_problem(rng, (2, nq, 64), (2, nk, 64), (2, nk, 64), np.float16)
    results = _run(q, k, v, dout, causal=causal, window=window)
    assert_matches_reference(q, k, v, dout, results, causal=causal, window=window)


@pytest.mark.parametrize("bias_shape", ["1,1,Nq,Nk", "B,1,1,Nk", "Nq,Nk", "B,H,1,Nk", "H,1,Nk"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_broadcast_bias_and_its_gradient(rng, dtype, bias_shape):
    """dbias has the bias's own shape: summed over every dim it was broadcast along."""
    batch, nq, nk = (2, 3), 150, 170
    sizes = dict(B=batch[0], H=batch[1], Nq=nq, Nk=nk)
    shape = tuple(sizes[name] if name in sizes else int(name) for name in bias_shape.split(","))
    results = _check(rng, dtype, batch, nq, nk, 64, True, ["bias"], bias_shape=shape)
    assert results[-1].shape == shape


def test_float32_bias_with_half_inputs(rng):
    q, k, v, dout = _random_problem(rng, (2, 2, 170, 64), (2, 2, 190, 64), (2, 2, 190, 64), np.float16)
    bias = cupy.asarray(rng.standard_normal((1, 2, 170, 190), dtype=np.float32))
    results = _run(q, k, v, dout, causal=False, bias=bias)
    assert results[-1].dtype == np.float32 and results[-1].shape == bias.shape
    assert_matches_reference(q, k, v, dout, results, causal=False, bias=bias)


def test_strided_bias_and_mask_views(rng):
    """A transposed bias and a sliced mask are read through their strides, giving a copy's bits."""
    q, k, v, dout = _random_problem(rng, (2, 140, 32), (2, 160, 32), (2, 160, 32), ml_dtypes.bfloat16)
    bias = _random(rng, (2, 160, 140), ml_dtypes.bfloat16).swapaxes(-1, -2)
    mask = cupy.asarray(rng.random((2, 140, 320)) < 0.8)[:, :, ::2]
    strided = _run(q, k, v, dout, causal=False, bias=bias, mask=mask)
    copied = _run(q, k, v, dout, causal=False, bias=cupy.ascontiguousarray(bias), mask=cupy.ascontiguousarray(mask))
    for x, y in zip(strided, copied):
        assert cupy.array_equal(
            x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32),
            y.view(np.uint16 if y.dtype.itemsize == 2 else np.uint32),
        )
    assert_matches_reference(q, k, v, dout, strided, causal=False, bias=bias, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_query_attention_with_options(rng, dtype):
    batch, kv_heads, groups, nq, nk = 2, 2, 3, 177, 190
    q = _random(rng, (batch, kv_heads, groups, nq, 64), dtype)
    k, v = (_random(rng, (batch, kv_heads, nk, 64), dtype)[:, :, None] for _ in range(2))
    dout = _random(rng, (batch, kv_heads, groups, nq, 64), dtype)
    options = dict(
        window=(40, 5),
        softcap=5.0,
        alibi_slopes=cupy.asarray([0.5, 0.25, 0.125], np.float32),
        bias=_random(rng, (kv_heads, 1, nq, nk), dtype),
    )
    results = _run(q, k, v, dout, causal=True, **options)
    assert results[3].shape == (batch, kv_heads, 1, nk, 64) and results[-1].shape == (kv_heads, 1, nq, nk)
    assert_matches_reference(q, k, v, dout, results, causal=True, **options)


def test_many_leading_dims_with_broadcast_bias(rng):
    """Five leading dims that do not merge into three: the launch copies, dbias is summed after."""
    q_shape, kv_shape = (2, 2, 3, 2, 2, 40, 32), (2, 1, 3, 1, 2, 50, 32)
    q, k, v, dout = _random_problem(rng, q_shape, kv_shape, kv_shape, np.float32)
    bias = _random(rng, (2, 1, 3, 1, 1, 40, 50), np.float32)
    mask = cupy.asarray(rng.random((1, 2, 1, 2, 1, 40, 50)) < 0.9)
    results = _run(q, k, v, dout, causal=False, bias=bias, mask=mask)
    assert_matches_reference(q, k, v, dout, results, causal=False, bias=bias, mask=mask)


def test_fully_masked_rows(rng):
    """Rows whose mask hides every key: out 0, lse -inf, zero dq and dbias, nothing NaN."""
    nq, nk = 200, 150
    q, k, v, dout = _random_problem(rng, (2, nq, 64), (2, nk, 64), (2, nk, 64), ml_dtypes.bfloat16)
    mask = cupy.asarray(rng.random((2, nq, nk)) < 0.5)
    blind = [0, 7, 64, 65, 199]
    mask[:, blind] = False
    bias = _random(rng, (2, nq, nk), ml_dtypes.bfloat16)
    out, lse, dq, dk, dv, dbias = results = _run(q, k, v, dout, causal=False, mask=mask, bias=bias)
    assert not out[:, blind].any() and cupy.isneginf(lse[:, blind]).all()
    assert not dq[:, blind].any() and not dbias[:, blind].any()
    for x in (out, dq, dk, dv, dbias):
        assert not cupy.isnan(x.astype(np.float32)).any()
    assert_matches_reference(q, k, v, dout, results, causal=False, mask=mask, bias=bias)


@pytest.mark.parametrize("softcap", [42.9, 44.0])
@pytest.mark.parametrize("window", [None, (100, 0)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bfloat16", "float16"])
def test_softcap_with_every_logit_near_its_floor(rng, dtype, d, window, softcap):
    """The bfloat16 forward of softcapped rows without ALiBi takes 1 as their max score (score bounded) up to
    softcap 62 ln 2 (42.98), where exp2 of the lowest score against 1 is still a normal float: rows whose
    every logit sits near -softcap (q against k's common direction) are the extreme case, at 42.9 on that
    path and at 44 past it, and in float16 (never on it) alike; at D = 128 on Hopper in the warp-specialized
    forward."""
    nq, nk = 190, 260
    direction = rng.standard_normal(d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    size = 40.0 * (d / 64) ** 0.25  # the same scaled score q . k / sqrt(d) at every d
    q = cupy.asarray((-size * direction + 0.3 * rng.standard_normal((2, nq, d))).astype(np.float32).astype(dtype))
    k = cupy.asarray((size * direction + 0.3 * rng.standard_normal((2, nk, d))).astype(np.float32).astype(dtype))
    v, dout = (_random(rng, (2, n, d), dtype) for n in (nk, nq))
    options = dict(softcap=softcap) if window is None else dict(softcap=softcap, window=window)
    results = _run(q, k, v, dout, causal=window is not None, **options)
    assert float(results[1].max()) < np.log(nk) - 0.99 * softcap, "every logit should sit near -softcap"
    assert_matches_reference(q, k, v, dout, results, causal=window is not None, **options)


def test_block_mask_that_skips_every_tile_of_some_rows(rng):
    nq, nk = 400, 300
    q, k, v, dout = _random_problem(rng, (2, nq, 64), (2, nk, 64), (2, nk, 64), np.float16)
    block_mask = cupy.asarray(rng.random((2,) + block_grid(nq, nk)) < 0.6)
    block_mask[0, 1] = False  # queries 128..255 of batch 0 see nothing
    block_mask[1, 3] = False  # queries 384..399 of batch 1
    out, lse, dq, dk, dv = results = _run(q, k, v, dout, causal=False, block_mask=block_mask)
    assert not out[0, 128:256].any() and cupy.isneginf(lse[0, 128:256]).all() and not dq[0, 128:256].any()
    assert not out[1, 384:].any() and cupy.isneginf(lse[1, 384:]).all()
    assert_matches_reference(q, k, v, dout, results, causal=False, block_mask=block_mask)


def test_skipped_tiles_are_never_read(rng):
    """Keys in tiles the band and the block mask hide are NaN: the results stay finite and correct."""
    nq, nk = 512, 512
    q, k, v, dout = _random_problem(rng, (1, nq, 64), (1, nk, 64), (1, nk, 64), ml_dtypes.bfloat16)
    block_mask = cupy.ones((1, 4, 4), dtype=bool)
    block_mask[:, :, 1] = False  # key tile 1 hidden from every query tile
    poisoned_k, poisoned_v = k.copy(), v.copy()
    for x in (poisoned_k, poisoned_v):
        x[:, 128:256] = np.nan
    options = dict(window=(100, 0), block_mask=block_mask)
    # The window keeps queries >= 356 from keys < 256, and the block mask hides keys 128..255 from all.
    out, lse, dq, dk, dv = _run(q, poisoned_k, poisoned_v, dout, causal=True, **options)
    clean = _run(q, k, v, dout, causal=True, **options)
    for name, x, y in zip(("out", "lse", "dq"), (out, lse, dq), clean[:3]):
        assert cupy.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{name}: a skipped tile was read"


def test_block_mask_from_dense_skips_without_changing_results(rng):
    nq, nk = 300, 400
    q, k, v, dout = _random_problem(rng, (2, nq, 64), (2, nk, 64), (2, nk, 64), np.float16)
    rows, cols = np.arange(nq)[:, None], np.arange(nk)[None, :]
    mask = cupy.asarray(np.broadcast_to(np.abs(rows - cols) < 60, (2, nq, nk)))  # a band: most tiles empty
    block_mask = cupyflash.block_mask_from_dense(mask)
    assert isinstance(block_mask, cupy.ndarray) and block_mask.shape == (2,) + block_grid(nq, nk)
    dense = _run(q, k, v, dout, causal=False, mask=mask)
    sparse = _run(q, k, v, dout, causal=False, mask=mask, block_mask=block_mask)
    for x, y in zip(dense, sparse):
        assert cupy.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_block_mask_alone_on_long_sequences_matches_the_dense_mask(rng):
    """A block mask without bias or mask runs the scalars' kernels, the same with its dense mask the full
    instantiation: at thousands of CTAs (whose warps reach the bitmap at different times) they agree."""
    nq = nk = 4096
    q, k, v, dout = _random_problem(rng, (1, 8, nq, 128), (1, 8, nk, 128), (1, 8, nk, 128), ml_dtypes.bfloat16)
    block_mask = cupy.asarray(rng.random((1, 8) + block_grid(nq, nk)) < 0.25)
    block_mask[..., cupy.arange(nq // 128), cupy.arange(nk // 128)] = True  # every row sees a tile
    dense = cupy.repeat(cupy.repeat(block_mask, 128, axis=-2), 128, axis=-1)
    full = _run(q, k, v, dout, causal=False, mask=dense, block_mask=block_mask)
    for _ in range(3):
        scalars = _run(q, k, v, dout, causal=False, block_mask=block_mask)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), scalars, full):
            x, y = x.astype(np.float32), y.astype(np.float32)
            assert float(cupy.abs(x - y).max()) <= 1e-2 * float(cupy.abs(y).max()), name


_WS_BLOCK_MASK_OPTIONS = {  # (causal, options): each form of the warp-specialized forward with a block mask
    "alone": (False, {}),
    "causal": (True, {}),
    "window": (True, dict(window=(300, 0))),
    "window-both-sides": (False, dict(window=(200, 150))),
    "softcap": (False, dict(softcap=2.0)),
    "alibi-causal": (True, dict(alibi_slopes=True)),
    "alibi": (False, dict(alibi_slopes=True)),
}


@pytest.mark.skipif(not _hopper_paths(), reason="the warp-specialized forward runs on Hopper only")
@pytest.mark.parametrize("name", _WS_BLOCK_MASK_OPTIONS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_block_mask_on_the_warp_specialized_forward(rng, dtype, name):
    """A block mask with no other array at HEAD_DIM 128 on Hopper: the warp-specialized forward's BLOCK_MASK
    form walks it (the route is asserted). Against float64 on Nq != Nk with a key axis of two bit words (36 key
    tiles), query tiles whose whole line is off (no key at all: out 0, lse -inf) and a line with one tile on;
    then against the Mods::all forward (its dense mask beside it) at 256 tiles, so that each persistent CTA
    runs several tiles and both q buffers' bits are in use."""
    causal, options = _WS_BLOCK_MASK_OPTIONS[name]
    heads = 2
    if options.get("alibi_slopes"):
        options = dict(options, alibi_slopes=cupy.asarray(alibi_slopes(heads)))
    nq, nk = 700, 4500
    q, k, v, dout = _random_problem(rng, (1, heads, nq, 120), (1, heads, nk, 120), (1, heads, nk, 120), dtype)
    tiles = rng.random((1, heads) + block_grid(nq, nk)) < 0.3
    tiles[..., 0, :] = False  # queries 0..127 see nothing
    tiles[..., 2, :] = False
    tiles[..., 2, 33] = True  # queries 256..383: keys 4224..4351 only (word 1)
    tiles[..., 3:, -1] = True  # the last (partial) key tile
    block_mask = cupy.asarray(tiles)
    mods = _modifiers.resolve(cupy, np.dtype(dtype), (1, heads), nq, nk, block_mask=block_mask, **options)
    variant = _selected("fwd", dtype, 120, causal, mods)
    assert variant.block_mask and variant.path == "ws", variant
    results = _run(q, k, v, dout, causal=causal, block_mask=block_mask, **options)
    out, lse = results[:2]
    assert not out[..., :128, :].any() and cupy.isneginf(lse[..., :128]).all()
    assert_matches_reference(q, k, v, dout, results, causal=causal, block_mask=block_mask, **options)

    batch, n = (2, 8), 2048  # 2 * 8 * 16 = 256 tiles
    q, k, v = (_random(rng, batch + (n, 128), dtype) for _ in range(3))
    if options.get("alibi_slopes") is not None:
        options = dict(options, alibi_slopes=cupy.asarray(alibi_slopes(batch[-1])))
    tiles = rng.random(batch + block_grid(n, n)) < 0.2
    block_mask = cupy.asarray(tiles)
    dense = cupy.repeat(cupy.repeat(block_mask, 128, axis=-2), 128, axis=-1)
    with nan_filled_allocations():
        walked = cupyflash.attention_forward(q, k, v, causal=causal, block_mask=block_mask, **options)
        full = cupyflash.attention_forward(q, k, v, causal=causal, mask=dense, block_mask=block_mask, **options)
    seen = cupy.isfinite(full[1])
    assert cupy.array_equal(seen, cupy.isfinite(walked[1])) and not walked[0][~seen].any()
    for x, y in zip(walked, full):
        x, y = x.astype(np.float32)[seen], y.astype(np.float32)[seen]
        assert float(cupy.abs(x - y).max()) <= 1e-2 * max(1.0, float(cupy.abs(y).max()))


def test_block_mask_at_the_benchmark_shape(rng):
    """bench_modifiers.py's block-mask row (B = 1, H = 16, N = 16k, ~10% of the tiles): 2048 CTAs per pass,
    whose warps reach the shared bitmap at different times (a race there read a null line and faulted).
    Two calls give the same bits (the backward is deterministic) and sampled rows match float64."""
    n, heads = 16384, 16
    q, k, v, dout = _random_problem(rng, (1, heads, n, 128), (1, heads, n, 128), (1, heads, n, 128), ml_dtypes.bfloat16)
    block_mask = cupy.asarray(rng.random((1, heads) + block_grid(n, n)) < 0.1)
    block_mask[..., cupy.arange(n // 128), cupy.arange(n // 128)] = True
    first, second = (_run(q, k, v, dout, causal=False, block_mask=block_mask) for _ in range(2))
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert cupy.array_equal(x.view(np.uint8), y.view(np.uint8)), name
    out, lse = (x.get().astype(np.float64) for x in first[:2])
    qh, kh, vh, tiles = (x.get() for x in (q, k, v, block_mask))
    for h in (0, heads - 1):
        rows = rng.choice(n, 8, replace=False)
        s = (qh[0, h, rows].astype(np.float64) @ kh[0, h].astype(np.float64).T) / np.sqrt(128.0)
        s[~np.repeat(tiles[0, h, rows // 128], 128, axis=-1)] = -np.inf
        ref_lse = np.logaddexp.reduce(s, axis=-1)
        ref_out = np.exp(s - ref_lse[:, None]) @ vh[0, h].astype(np.float64)
        assert np.abs(lse[0, h, rows] - ref_lse).max() < 1e-3
        assert np.abs(out[0, h, rows] - ref_out).max() < 2e-2 * np.abs(ref_out).max()


@pytest.mark.parametrize("which", [(), ("window",), OPTIONS])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_attention_probs(rng, dtype, causal, which):
    """P against the reference's; rows sum to 1 (0 where nothing is seen); P v is attention's output."""
    batch, nq, nk, d = (2, 2), 190, 300, 64
    q, k, v, _ = _random_problem(rng, batch + (nq, d), batch + (nk, d), batch + (nk, d), dtype)
    options = random_options(rng, which, batch, nq, nk, dtype, xp=cupy)
    with nan_filled_allocations():
        p = cupyflash.attention_probs(q, k, v, causal=causal, **options)
    assert isinstance(p, cupy.ndarray) and (p.shape, p.dtype) == (batch + (nq, nk), np.float32)
    host = {name: x.get() if isinstance(x, cupy.ndarray) else x for name, x in options.items()}
    qh, kh, vh = (np.asarray(x.get(), dtype=np.float64) for x in (q, k, v))
    ref = reference.attention_probs(qh, kh, vh, causal=causal, **host)
    tolerance = 1e-5 if dtype == np.float32 else 2e-3  # scores from rounded inputs are exact; exp in fp32
    assert float(np.max(np.abs(p.get() - ref))) <= tolerance
    sums = p.sum(axis=-1).get()
    seen = ref.sum(axis=-1) > 0
    assert np.allclose(sums[seen], 1, atol=1e-4) and not sums[~seen].any()
    out = cupyflash.attention(q, k, v, causal=causal, **options)
    via_p = (p @ v.astype(np.float32)).get()
    assert np.allclose(via_p, out.get().astype(np.float32), atol=2e-2 if dtype != np.float32 else 1e-4)


def test_options_that_are_off_run_the_plain_kernels(rng):
    """window None / (-1, -1), softcap 0 and no arrays are the plain path: the very same bits."""
    q, k, v, dout = _random_problem(rng, (2, 3, 200, 64), (2, 3, 250, 64), (2, 3, 250, 64), np.float16)
    plain = _run(q, k, v, dout, causal=True)
    off = _run(q, k, v, dout, causal=True, window=(-1, -1), softcap=0.0)
    for x, y in zip(plain, off):
        assert cupy.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_block_mask_calls_read_their_own_block_mask(rng):
    """A block mask is an array, like bias and mask: calls with one are never planned, so a second call of
    the same layout with another block mask reads the new one (forward and backward)."""
    q, k, v, dout = _random_problem(rng, (2, 300, 64), (2, 300, 64), (2, 300, 64), ml_dtypes.bfloat16)
    planned = set(plans.entries("plan"))
    for block_mask in (
        cupy.ones((2, 3, 3), dtype=bool),
        cupy.asarray(np.broadcast_to(np.eye(3, dtype=bool), (2, 3, 3))),
    ):
        results = _run(q, k, v, dout, causal=False, block_mask=block_mask)
        assert_matches_reference(q, k, v, dout, results, causal=False, block_mask=block_mask)
    assert set(plans.entries("plan")) == planned, "block-mask calls should not be planned"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_repeated_layout_with_new_slopes_and_arrays(rng, dtype):
    """The second call of a window + softcap + ALiBi layout reuses the first call's launch plan: it must read
    its own inputs and its own slopes (a new address, new values), held to the reference."""
    shapes = (2, 3, 177, 64), (2, 3, 230, 64), (2, 3, 230, 64)

    def options():
        return dict(window=(60, 10), softcap=4.0, alibi_slopes=cupy.asarray(rng.uniform(0.1, 1.0, 3), dtype=np.float32))

    _run(*_random_problem(rng, *shapes, dtype), causal=True, **options())
    planned = set(plans.entries("plan"))
    q, k, v, dout = _random_problem(rng, *shapes, dtype)
    second = options()
    results = _run(q, k, v, dout, causal=True, **second)
    assert set(plans.entries("plan")) == planned, "the second call should have found both of its plans"
    assert_matches_reference(q, k, v, dout, results, causal=True, **second)


def test_alibi_slopes_read_in_place_through_any_view(rng):
    """The dense kernels read the slopes through their broadcast view's batch strides (no per-call copy):
    a slope per head broadcast over the batch, per batch entry broadcast over the heads, a strided view
    and float64 slopes all give bit for bit what the expanded contiguous float32 slopes give, and each
    call of one (q, k, v) layout with a new slopes layout finds its own plan."""
    batch, heads, nq, nk = 2, 3, 150, 170
    q, k, v, dout = _random_problem(
        rng, (batch, heads, nq, 64), (batch, heads, nk, 64), (batch, heads, nk, 64), ml_dtypes.bfloat16
    )
    wide = cupy.asarray(rng.uniform(0.05, 0.5, (batch, 2 * heads)), dtype=np.float32)
    views = {
        "per head": wide[0, :heads],
        "per batch entry": wide[:, :1],
        "strided": wide[:, ::2],
        "float64": wide[:, :heads].astype(np.float64),
    }
    for name, slopes in views.items():
        got = _run(q, k, v, dout, causal=True, window=(50, 0), alibi_slopes=slopes)
        expanded = cupy.ascontiguousarray(cupy.broadcast_to(slopes, (batch, heads)), dtype=np.float32)
        want = _run(q, k, v, dout, causal=True, window=(50, 0), alibi_slopes=expanded)
        for x, y in zip(got, want):
            assert cupy.array_equal(
                x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32),
                y.view(np.uint16 if y.dtype.itemsize == 2 else np.uint32),
            ), name
        assert_matches_reference(q, k, v, dout, got, causal=True, window=(50, 0), alibi_slopes=slopes)


@pytest.mark.parametrize("causal", [False, True])
def test_modifier_kernels_without_modification_match_plain(rng, causal):
    """A mask of all True goes through the modifier kernels: same results as the plain kernels, within
    rounding (the scale is applied before the exponent instead of inside it)."""
    q, k, v, dout = _random_problem(rng, (2, 300, 128), (2, 333, 128), (2, 333, 128), np.float32)
    plain = _run(q, k, v, dout, causal=causal)
    through_mods = _run(q, k, v, dout, causal=causal, mask=cupy.ones((300, 333), dtype=bool))
    for x, y in zip(plain, through_mods):
        x, y = x.get(), y.get()
        finite = np.isfinite(x)
        assert np.array_equal(finite, np.isfinite(y))
        assert np.allclose(x[finite], y[finite], rtol=0, atol=2e-5 * np.abs(x[finite]).max())


def test_bias_of_minus_infinity_is_a_mask(rng):
    q, k, v, dout = _random_problem(rng, (2, 150, 64), (2, 170, 64), (2, 170, 64), np.float32)
    mask = cupy.asarray(rng.random((2, 150, 170)) < 0.7)
    bias = cupy.where(mask, 0, -np.inf).astype(np.float32)
    by_bias = _run(q, k, v, dout, causal=False, bias=bias)
    by_mask = _run(q, k, v, dout, causal=False, mask=mask)
    for x, y in zip(by_bias[:5], by_mask):
        assert np.allclose(x.get(), y.get(), rtol=0, atol=1e-6)
    assert not cupy.isnan(by_bias[-1]).any()


@pytest.mark.parametrize(
    "option, value, error, match",
    [
        ("mask", lambda: cupy.ones((5, 6), dtype=np.float32), TypeError, "mask must be a boolean array"),
        ("bias", lambda: cupy.ones((3, 6), dtype=np.float16), ValueError, "bias has shape"),
        ("bias", lambda: np.ones((5, 6), dtype=np.float16), TypeError, "bias must be a cupy.ndarray"),
        ("window", lambda: (-2, 0), ValueError, "window left must be >= -1"),
        ("softcap", lambda: -1.0, ValueError, "softcap must be finite and >= 0"),
        ("block_mask", lambda: cupy.ones((2, 2), dtype=bool), ValueError, "block_mask has shape"),
    ],
)
def test_bad_options_on_the_gpu(rng, option, value, error, match):
    q, k, v, _ = _random_problem(rng, (2, 5, 8), (2, 6, 8), (2, 6, 8), np.float16)
    with pytest.raises(error, match=match):
        cupyflash.attention(q, k, v, **{option: value()})
