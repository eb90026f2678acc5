"""cupyflash.distributed on NumPy arrays, its ranks as threads of one process (InProcessGroup).

What this file proves:

* Ring attention is attention: for world sizes 1, 2, 3, 4 and 8, both layouts, causal or not, the sharded
  forward and backward, unsharded, equal ``cupyflash.attention_forward`` / ``attention_backward`` over the
  whole sequence (float32: to 1e-5 of the largest magnitude), and meet the project's accuracy rule against
  the float64 reference in every dtype (float64: to float64 rounding); also with grouped-query heads
  (broadcast k, v), cross attention (Nq != Nk), softcap, an explicit scale, ALiBi with global positions and
  sliding windows over global positions.
* The results are deterministic (bit for bit), and every rank's all-gathered result is the same; a world of
  one is attention's results bit for bit.
* The bookkeeping: a run of rows takes its first covering block as its accumulator (no zeroed one); under a
  window nothing is zeroed and only the rows the calls read (keys) or wrote (dK, dV sums) travel; a block
  alone on its rows comes in the inputs' dtype, rounded once by its own call.
* shard/unshard: the zigzag and contiguous layouts hold the chunks they document, round trips are exact,
  sizes that do not split raise.
* The schedule computes every (query, key) pair that the global mask allows exactly once and no other; the
  zigzag layout gives every rank the same causal work at every step; a window's calls cover its band exactly,
  each on a square sub-block whose every row sees a key, and their work grows as N w, not N^2.
* Argument errors: a rank whose call differs from the others' makes every rank raise; invalid arguments
  raise the single-process function's own error on every rank; nothing hangs.
* InProcessGroup: results in rank order, failures propagate without hanging, the group is reusable.
* Without a usable GPU, init() says so; the example runs on CPU ranks.
"""

import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_as_exact_as_the_single_call, assert_bitwise_equal, max_abs
from helpers.checks import assert_matches_reference as assert_matches_reference_scaled
from helpers.gpu import gpu_available
from helpers.modifiers import SOFTCAP, alibi_slopes
from helpers.problems import random_array, random_problem

import cupyflash
from cupyflash import distributed as dist
from cupyflash import reference
from cupyflash._arrays import cupy
from cupyflash.distributed import _pieces, _schedule
from cupyflash.distributed import _ring as ring_module
from cupyflash.distributed._layout import chunk_length, chunks_of

B, H, D, DV = 2, 3, 12, 20
WORLD_SIZES = (1, 2, 3, 4, 8)
# Rows per zigzag chunk for each world size (a contiguous chunk is twice that): N = 2 W CHUNK[W], never a
# power of two.
CHUNK = {1: 7, 2: 5, 3: 3, 4: 5, 5: 3, 6: 3, 7: 3, 8: 3}
LAYOUTS = ("zigzag", "contiguous")
DTYPES16 = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# float32 ring against the single-process call: the merges reorder float32 sums, nothing more.
RTOL = 1e-5
# float64 ring against the float64 reference (a float32 step anywhere would leave ~1e-7).
RTOL64 = 1e-12
NAMES = ("out", "lse", "dq", "dk", "dv")


def _seq(world_size):
    return 2 * world_size * CHUNK[world_size]


def _ring(world_size, q, k, v, dout, *, group=None, **kwargs):
    """Shard q, k, v, dout, run the ring's forward and backward on every rank of an InProcessGroup, and
    unshard: (out, lse, dq, dk, dv) of the whole sequence. Every rank must gather the same whole arrays."""
    layout = kwargs.get("layout", "zigzag")
    group = group or dist.InProcessGroup(world_size, timeout=30)

    def rank_work(comm):
        q_l, k_l, v_l, dout_l = (dist.shard(x, comm, layout=layout) for x in (q, k, v, dout))
        out_l, lse_l = dist.ring_attention_forward(q_l, k_l, v_l, comm=comm, **kwargs)
        assert out_l.shape == dout_l.shape and lse_l.shape == dout_l.shape[:-1]
        grads = dist.ring_attention_backward(dout_l, q_l, k_l, v_l, out_l, lse_l, comm=comm, **kwargs)
        for g, x in zip(grads, (q_l, k_l, v_l)):
            assert (g.shape, g.dtype) == (x.shape, x.dtype)
        return (
            dist.unshard(out_l, comm, layout=layout),
            dist.unshard(lse_l, comm, layout=layout, axis=-1),
            *(dist.unshard(g, comm, layout=layout) for g in grads),
        )

    results = group.run(rank_work)
    for rank, other in enumerate(results[1:], 1):
        assert_bitwise_equal(other, results[0], names=[f"rank {rank}'s {n}" for n in NAMES])
    return results[0]


def _single(q, k, v, dout, **kwargs):
    """cupyflash.attention_forward and attention_backward over the whole sequence."""
    kwargs.pop("layout", None)
    out, lse = cupyflash.attention_forward(q, k, v, **kwargs)
    return (out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, **kwargs))


def _assert_same_as_single(ring, single):
    """The ring's float32 results against the single call's: same shapes and dtypes, values to RTOL of the
    largest magnitude (lse: of max(1, |lse|))."""
    for name, x, y in zip(NAMES, ring, single):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{name}: {x.shape} {x.dtype}, single {y.shape} {y.dtype}"
        assert not np.isnan(x).any(), f"{name} has NaN"
        size = max(1.0, max_abs(y)) if name == "lse" else max_abs(y)
        error = max_abs(x.astype(np.float64) - y)
        assert error <= RTOL * size, f"{name}: max error {error:.3g} against the single call (max {size:.3g})"


def _assert_float64_matches_reference(q, k, v, dout, results, *, causal, scale=None, **options):
    """float64 results against the float64 reference, to float64 rounding (the accuracy rule's naive
    implementation computes in float32, which says nothing about float64)."""
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale, **options)
    for name, x, ref in zip(NAMES, results, (ref_out, ref_lse, *ref_grads)):
        assert (x.shape, x.dtype) == (ref.shape, np.float64), f"{name}: {x.shape} {x.dtype}"
        error, size = max_abs(x - ref), max_abs(ref)
        assert error <= RTOL64 * size, f"{name}: relative error {error / size:.3g} > {RTOL64:g}"


def _problem(rng, world_size, dtype=np.float32, batch=(B, H), d=D, dv=DV):
    n = _seq(world_size)
    return random_problem(rng, batch + (n, d), batch + (n, d), batch + (n, dv), dtype)


def _options(option):
    """The ring keywords of one named option (ALiBi slopes per head H, as (H,) or (1, H))."""
    return dict(
        softcap=dict(softcap=SOFTCAP),
        scale=dict(scale=0.3),
        alibi_h=dict(alibi_slopes=alibi_slopes(H)),
        alibi_1h=dict(alibi_slopes=alibi_slopes(H)[None]),
        all=dict(softcap=SOFTCAP, scale=0.3, alibi_slopes=alibi_slopes(H)),
    )[option]


# ---------------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_equals_attention_over_the_whole_sequence(rng, assert_matches_reference, world_size, layout, causal):
    """float32, D != Dv: the unsharded ring forward and backward equal the single-process call over the whole
    sequence to 1e-5, and meet the accuracy rule against the float64 reference."""
    q, k, v, dout = _problem(rng, world_size)
    ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout)
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=causal))
    assert_matches_reference(q, k, v, dout, ring, causal=causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 3))
def test_ring_attention_returns_the_forward_output(rng, world_size, layout):
    """ring_attention (out alone) is bit for bit the out of ring_attention_forward."""
    q, k, v, _ = _problem(rng, world_size)

    def rank_work(comm):
        q_l, k_l, v_l = (dist.shard(x, comm, layout=layout) for x in (q, k, v))
        out = dist.ring_attention(q_l, k_l, v_l, comm=comm, causal=True, layout=layout)
        out_f, _ = dist.ring_attention_forward(q_l, k_l, v_l, comm=comm, causal=True, layout=layout)
        return out, out_f

    for out, out_f in dist.InProcessGroup(world_size).run(rank_work):
        assert_bitwise_equal([out], [out_f], names=["out"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (2, 3))
def test_cross_attention_with_different_lengths(rng, assert_matches_reference, world_size, layout):
    """Not causal, Nq != Nk (the q and k shards of different lengths): the whole-sequence result."""
    nq, nk = 2 * world_size * 3, 2 * world_size * 5
    q, k, v, dout = random_problem(rng, (B, H, nq, D), (B, H, nk, D), (B, H, nk, DV), np.float32)
    ring = _ring(world_size, q, k, v, dout, causal=False, layout=layout)
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=False))
    assert_matches_reference(q, k, v, dout, ring, causal=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_query_heads_by_broadcasting(rng, assert_matches_reference, layout, causal):
    """q (B, Hk, G, N, D) with k, v (B, Hk, 1, N, D), W = 3: dk and dv come back in k's and v's shapes, summed
    over the G query heads, and everything equals the single call."""
    world_size, n, hk, groups = 3, _seq(3), 2, 3
    q, k, v, dout = random_problem(rng, (B, hk, groups, n, D), (B, hk, 1, n, D), (B, hk, 1, n, DV), np.float32)
    ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout)
    assert ring[0].shape == (B, hk, groups, n, DV) and ring[3].shape == k.shape and ring[4].shape == v.shape
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=causal))
    assert_matches_reference(q, k, v, dout, ring, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("option", ["softcap", "scale", "alibi_h", "alibi_1h", "all"])
def test_options_match_the_single_call(rng, assert_matches_reference, option, layout, causal):
    """W = 3 with softcap, an explicit scale, ALiBi slopes of shape (H,) or (1, H) (global positions), or all
    three: the ring equals the single call with the same options, and meets the accuracy rule."""
    options = _options(option)
    q, k, v, dout = _problem(rng, 3)
    ring = _ring(3, q, k, v, dout, causal=causal, layout=layout, **options)
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=causal, **options))
    assert_matches_reference(q, k, v, dout, ring, causal=causal, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 2, 4, 8))
def test_all_options_at_every_world_size(rng, world_size, layout, causal):
    """softcap, scale and ALiBi together for the other world sizes: ALiBi's per-pair bias and lse shift are
    exact for chunk pairs on either side of the diagonal, however far apart."""
    options = dict(softcap=SOFTCAP, scale=0.3, alibi_slopes=alibi_slopes(H)[None])
    q, k, v, dout = _problem(rng, world_size)
    ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout, **options)
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=causal, **options))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_16_bit_dtypes_meet_the_accuracy_rule(rng, assert_matches_reference, dtype, world_size, layout, causal):
    """float16 and bfloat16, odd head dims (D 13, Dv 7): the unsharded ring results are within twice a naive
    same-dtype implementation's error of the float64 reference; lse is float32."""
    q, k, v, dout = _problem(rng, world_size, dtype, d=13, dv=7)
    ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout)
    assert ring[0].dtype == dtype and ring[1].dtype == np.float32
    assert_matches_reference(q, k, v, dout, ring, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_16_bit_dtypes_with_options_meet_the_accuracy_rule(rng, dtype):
    """float16 and bfloat16 with softcap, scale and ALiBi together, causal, zigzag, W = 3 (the naive rounds
    its scaled scores, as the modifiers' tests do)."""
    options = _options("all")
    q, k, v, dout = _problem(rng, 3, dtype)
    ring = _ring(3, q, k, v, dout, causal=True, **options)
    assert_matches_reference_scaled(q, k, v, dout, ring, causal=True, **options)


@pytest.mark.parametrize(
    "world_size, layout, causal, option",
    [
        (2, "zigzag", True, None),
        (3, "contiguous", False, "softcap"),
        (4, "zigzag", True, "alibi_h"),
        (2, "zigzag", True, "window"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_16_bit_errors_as_exact_as_the_single_call(rng, dtype, world_size, layout, causal, option):
    """Each block's results come unrounded (attention_forward(out_dtype=), attention_backward(grad_dtype=)) and the
    ring rounds once, at the end, as the single call does: every result's error against float64 is within the
    blocked-schedule rule of helpers/checks.py against the single call's, in each rank's shard of rows (rounding
    each block's results first fails it)."""
    options = {} if option is None else dict(window=(24, 0)) if option == "window" else _options(option)
    n = 2 * world_size * 24
    q, k, v, dout = random_problem(rng, (B, H, n, 32), (B, H, n, 32), (B, H, n, 32), dtype)
    ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout, **options)
    single = _single(q, k, v, dout, causal=causal, **options)
    exact = _single(*(x.astype(np.float64) for x in (q, k, v, dout)), causal=causal, **options)
    chunks = (2 if layout == "zigzag" else 1) * world_size  # the ranks' shards
    assert_as_exact_as_the_single_call(NAMES, ring, single, exact, dtype, chunks)


def test_the_blocked_schedule_rule_at_its_edges(rng):
    """Non-finite reference values (lse of rows that see no key) must be matched exactly and leave the norms
    alone; a run of rows whose reference is all zeros holds the blocked result to ZERO_ATOL; shapes must agree;
    the caller's arrays are left as they were."""
    ref = rng.standard_normal((4, 64))
    ref[:, :8] = -np.inf
    single = ref + 1e-3 * rng.standard_normal(ref.shape)
    blocked = ref + 5e-4 * rng.standard_normal(ref.shape)  # half the single call's error
    kept = blocked.copy()
    assert_as_exact_as_the_single_call(["lse"], [blocked], [single], [ref], np.float16, chunks=2)
    np.testing.assert_array_equal(blocked, kept)
    wrong = blocked.copy()
    wrong[0, 0] = 0.0
    with pytest.raises(AssertionError, match="non-finite"):
        assert_as_exact_as_the_single_call(["lse"], [wrong], [single], [ref], np.float16)
    ref = np.concatenate([rng.standard_normal((3, 20, 5)), np.zeros((3, 20, 5))], axis=-2)
    single = ref + 1e-3 * rng.standard_normal(ref.shape)
    blocked = ref + 5e-4 * rng.standard_normal(ref.shape)  # half the single call's error
    with pytest.raises(AssertionError, match="rows 1 of 2: .* where all is 0"):
        assert_as_exact_as_the_single_call(["out"], [blocked], [single], [ref], np.float16, chunks=2)
    with pytest.raises(AssertionError, match="out"):
        assert_as_exact_as_the_single_call(["out"], [blocked[:, :-1]], [single], [ref], np.float16)


@pytest.mark.parametrize("rounded", ["out", "gradients"])
@pytest.mark.parametrize("causal", [True, False])
def test_rounding_each_block_fails_the_blocked_schedule_rule(rng, monkeypatch, rounded, causal):
    """The rule above is not one a double rounding passes: with each block's out (or its gradients) rounded to
    bfloat16 before the float32 sums, as the ring once did, the case fails it on out (or dq), the first result
    the rounding touches."""
    if rounded == "out":
        forward = ring_module.attention_forward

        def rounding(*args, out_dtype=None, **kwargs):
            out, lse = forward(*args, **kwargs)
            return (out if out_dtype is None else out.astype(out_dtype)), lse

        monkeypatch.setattr(ring_module, "attention_forward", rounding)
    else:
        backward = ring_module.attention_backward

        def rounding(*args, grad_dtype=None, **kwargs):
            return tuple(g if grad_dtype is None else g.astype(grad_dtype) for g in backward(*args, **kwargs))

        monkeypatch.setattr(ring_module, "attention_backward", rounding)
    world_size, layout = 2, "zigzag" if causal else "contiguous"
    n = 2 * world_size * 24
    q, k, v, dout = random_problem(rng, (B, H, n, 32), (B, H, n, 32), (B, H, n, 32), ml_dtypes.bfloat16)
    ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout)
    single = _single(q, k, v, dout, causal=causal)
    exact = _single(*(x.astype(np.float64) for x in (q, k, v, dout)), causal=causal)
    chunks = (2 if layout == "zigzag" else 1) * world_size
    with pytest.raises(AssertionError, match=f"^{'out' if rounded == 'out' else 'dq'}[,:]"):
        assert_as_exact_as_the_single_call(NAMES, ring, single, exact, ml_dtypes.bfloat16, chunks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (2, 3))
def test_float64_is_exact_to_float64_rounding(rng, world_size, layout, causal):
    """float64 inputs accumulate in float64: out, lse and the gradients are float64 and the reference's to
    1e-12 (with ALiBi and softcap too)."""
    n = _seq(world_size)
    q, k, v = (rng.standard_normal((B, H, n, d)) for d in (D, D, DV))
    dout = rng.standard_normal((B, H, n, DV))
    options = dict(softcap=SOFTCAP, alibi_slopes=alibi_slopes(H).astype(np.float64))
    for kwargs in ({}, options):
        ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout, **kwargs)
        _assert_float64_matches_reference(q, k, v, dout, ring, causal=causal, **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_alibi_slopes_are_those_attention_uses(rng, layout):
    """Slopes that float32 cannot hold (0.3, 0.77, ...): the ring's blocks between chunks use them rounded to
    float32, as attention and the kernels' own ALiBi do, so float64 results agree with the single call to
    float64 rounding."""
    world_size, n = 3, _seq(3)
    q, k, v = (rng.standard_normal((B, H, n, d)) for d in (D, D, DV))
    dout = rng.standard_normal((B, H, n, DV))
    slopes = np.linspace(0.3, 0.77, H)
    for causal in (False, True):
        ring = _ring(world_size, q, k, v, dout, causal=causal, layout=layout, alibi_slopes=slopes)
        single = _single(q, k, v, dout, causal=causal, alibi_slopes=slopes)
        for name, x, y in zip(NAMES, ring, single):
            assert max_abs(x - y) <= 1e-12 * max(1.0, max_abs(y)), f"{name}: {max_abs(x - y):.3g}"


def test_results_are_deterministic(rng):
    """The same call twice on one group, and once more on a fresh group, gives bit-for-bit equal results
    (bfloat16, W = 4, causal zigzag with ALiBi: per-pair blocks and their merges)."""
    options = dict(causal=True, alibi_slopes=alibi_slopes(H), softcap=SOFTCAP)
    q, k, v, dout = _problem(rng, 4, ml_dtypes.bfloat16)
    group = dist.InProcessGroup(4)
    first = _ring(4, q, k, v, dout, group=group, **options)
    assert_bitwise_equal(_ring(4, q, k, v, dout, group=group, **options), first)
    assert_bitwise_equal(_ring(4, q, k, v, dout, **options), first)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "batch, nq, nk, causal",
    [((B, H), 0, 0, True), ((B, H), 0, 0, False), ((0, H), 12, 12, True), ((B, H), 12, 0, False)],
)
def test_empty_problems_match_the_single_call(rng, layout, batch, nq, nk, causal):
    """N = 0, an empty batch, or no keys at all (not causal): the ring returns what the single call
    returns: the same shapes and dtypes, out and gradients 0, lse -inf."""
    q, k, v, dout = random_problem(rng, batch + (nq, D), batch + (nk, D), batch + (nk, DV), np.float32)
    ring = _ring(2, q, k, v, dout, causal=causal, layout=layout)
    single = _single(q, k, v, dout, causal=causal)
    for name, x, y in zip(NAMES, ring, single):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{name}: {x.shape} {x.dtype}"
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert np.isneginf(ring[1]).all() and not ring[0].any()


# ---------------------------------------------------------------------------------------------------
# shard / unshard
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
def test_shard_holds_the_documented_chunks(world_size):
    """zigzag: rank r holds chunks r and 2W-1-r of 2W, in that order; contiguous: chunk r of W. Shards are
    contiguous copies."""
    c = 3
    x = np.arange(2 * world_size * c, dtype=np.float32)[:, None] * np.ones(5, np.float32)

    def rank_work(comm):
        return {layout: dist.shard(x, comm, layout=layout) for layout in LAYOUTS}

    for r, shards in enumerate(dist.InProcessGroup(world_size).run(rank_work)):
        zig, cont = shards["zigzag"], shards["contiguous"]
        expected_zig = list(range(r * c, (r + 1) * c)) + list(
            range((2 * world_size - 1 - r) * c, (2 * world_size - r) * c)
        )
        assert zig[:, 0].tolist() == expected_zig and zig.shape == (2 * c, 5)
        assert cont[:, 0].tolist() == list(range(r * 2 * c, (r + 1) * 2 * c))
        assert chunks_of("zigzag", world_size, r) == (r, 2 * world_size - 1 - r)
        assert chunks_of("contiguous", world_size, r) == (r,)
        for s in (zig, cont):
            assert s.flags.c_contiguous and not np.shares_memory(s, x)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 2, 3, 5))
def test_shard_unshard_round_trip(rng, world_size, layout):
    """unshard(shard(x)) is x on every rank, bit for bit: (B, H, N, D) arrays along axis -2, lse-like
    (B, H, N) arrays along axis -1, in bfloat16 and float64."""
    n = 2 * world_size * 3
    xs = [random_array(rng, (B, H, n, 5), ml_dtypes.bfloat16), random_array(rng, (B, H, n), np.float64)]

    def rank_work(comm):
        return [
            dist.unshard(dist.shard(x, comm, layout=layout, axis=axis), comm, layout=layout, axis=axis)
            for x, axis in zip(xs, (-2, -1))
        ]

    for back in dist.InProcessGroup(world_size).run(rank_work):
        assert_bitwise_equal(back, xs, names=["axis -2", "axis -1"])


@pytest.mark.parametrize(
    "layout, n, world_size", [("zigzag", 18, 2), ("zigzag", 6, 2), ("contiguous", 10, 3), ("contiguous", 7, 2)]
)
def test_shard_raises_when_the_sequence_does_not_split(layout, n, world_size):
    """N not a multiple of 2W (zigzag) or W (contiguous): ValueError naming the layout."""
    x = np.zeros((n, 4), dtype=np.float32)

    def rank_work(comm):
        with pytest.raises(ValueError, match=f"'{layout}' layout cannot cut") as info:
            dist.shard(x, comm, layout=layout)
        return str(info.value)

    for message in dist.InProcessGroup(world_size).run(rank_work):
        assert f"{n} rows" in message


def test_bad_layout_and_axis_raise():
    """A layout that is not "zigzag" or "contiguous", or an axis out of range: ValueError from shard, unshard
    and the ring."""
    x = np.zeros((1, 8, 4), dtype=np.float32)

    def rank_work(comm):
        for call in (
            lambda: dist.shard(x, comm, layout="ring"),
            lambda: dist.unshard(x, comm, layout="Zigzag"),
            lambda: dist.ring_attention(x, x, x, comm=comm, layout="striped"),
        ):
            with pytest.raises(ValueError, match="layout must be one of"):
                call()
        with pytest.raises(ValueError, match="out of range"):
            dist.shard(x, comm, axis=3)
        return True

    assert dist.InProcessGroup(2).run(rank_work) == [True, True]


def test_unshard_rejects_an_odd_zigzag_shard():
    """A zigzag shard holds two equal chunks: a shard of an odd number of rows raises."""
    x = np.zeros((5, 4), dtype=np.float32)

    def rank_work(comm):
        with pytest.raises(ValueError, match="'zigzag' layout holds 2 equal chunks"):
            dist.unshard(x, comm)
        return True

    assert dist.InProcessGroup(2).run(rank_work) == [True, True]


def test_chunk_length():
    """chunk_length: N / 2W for zigzag, N / W for contiguous; the error names the multiple to pad to."""
    assert chunk_length(24, "zigzag", 3, "q") == 4 and chunk_length(24, "contiguous", 3, "q") == 8
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 8"):
        chunk_length(20, "zigzag", 4, "q")


# ---------------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------------


def _global_rows(layout, world_size, rank, rows, chunk):
    """Global positions of the local rows ``rows`` (a slice) of ``rank``'s shard of chunks of ``chunk`` rows."""
    chunks = chunks_of(layout, world_size, rank)
    return np.array([chunks[i // chunk] * chunk + i % chunk for i in range(rows.start, rows.stop)], dtype=int)


def _coverage(layout, world_size, causal, nq_chunk, nk_chunk, per_pair):
    """How many times each (query, key) pair of global positions is computed over every rank and step, and
    the allowed pairs each rank computes at each step (W x W)."""
    per = 2 if layout == "zigzag" else 1
    nq, nk = per * world_size * nq_chunk, per * world_size * nk_chunk
    counts = np.zeros((nq, nk), dtype=int)
    work = np.zeros((world_size, world_size), dtype=int)
    for rank in range(world_size):
        for step in range(world_size):
            src = _schedule.source_rank(rank, step, world_size)
            for blk in _schedule.blocks(layout, world_size, rank, step, nq_chunk, nk_chunk, causal, per_pair):
                rows = _global_rows(layout, world_size, rank, blk.q_rows, nq_chunk)
                cols = _global_rows(layout, world_size, src, blk.k_rows, nk_chunk)
                assert len(rows) and len(cols), f"an empty block {blk}"
                if blk.causal:  # the local bottom-right mask
                    local_i = np.arange(len(rows))[:, None] + (len(cols) - len(rows))
                    seen = np.arange(len(cols))[None, :] <= local_i
                else:
                    seen = np.ones((len(rows), len(cols)), dtype=bool)
                np.add.at(counts, (rows[:, None], cols[None, :]), seen.astype(int))
                allowed = cols[None, :] <= rows[:, None] if causal else np.ones_like(seen)
                work[rank, step] += int((seen & allowed).sum())
                if per_pair:
                    assert (blk.q_start, blk.k_start) == (rows[0], cols[0]), f"{blk}: global starts"
                    assert len(rows) == nq_chunk and len(cols) == nk_chunk
                    assert np.array_equal(rows, blk.q_start + np.arange(nq_chunk))
                    assert np.array_equal(cols, blk.k_start + np.arange(nk_chunk))
    return counts, work


@pytest.mark.parametrize("per_pair", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_schedule_covers_every_allowed_pair_once(layout, causal, per_pair):
    """For W = 1..8, over every rank and step: each pair the global mask allows is computed exactly once, no
    masked pair at all (chunks of 3 rows; of 2 query and 3 key rows when not causal). per_pair: one block
    per chunk pair, its q_start and k_start the global positions of its first rows."""
    for world_size in range(1, 9):
        nq_chunk, nk_chunk = (3, 3) if causal else (2, 3)
        counts, _ = _coverage(layout, world_size, causal, nq_chunk, nk_chunk, per_pair)
        nq, nk = counts.shape
        expected = (np.arange(nk)[None, :] <= np.arange(nq)[:, None]) if causal else np.ones((nq, nk), bool)
        assert np.array_equal(counts, expected.astype(int)), (
            f"W={world_size}: {int((counts > expected).sum())} pairs computed twice or masked, "
            f"{int((counts < expected).sum())} pairs missed"
        )


# windows of every kind: one-sided, two-sided, narrower and wider than a chunk, zero-width sides
WINDOWS = [(0, 0), (1, -1), (-1, 2), (4, 1), (7, 7), (2, 30), (40, 0)]


def _window_coverage(layout, world_size, chunk, window):
    """For a global window (left, right): how many times each (query, key) pair is computed over every rank
    and step, from each block's rows, keys and local window (the kernels' bottom-right one on a square)."""
    n = (2 if layout == "zigzag" else 1) * world_size * chunk
    counts = np.zeros((n, n), dtype=int)
    for rank in range(world_size):
        for step in range(world_size):
            src = _schedule.source_rank(rank, step, world_size)
            for blk in _schedule.blocks(layout, world_size, rank, step, chunk, chunk, False, False, window):
                rows = _global_rows(layout, world_size, rank, blk.q_rows, chunk)
                cols = _global_rows(layout, world_size, src, blk.k_rows, chunk)
                assert len(rows) == len(cols) > 0 and not blk.causal, blk
                assert (blk.q_start, blk.k_start) == (rows[0], cols[0]), f"{blk}: global starts"
                i, j = np.arange(len(rows))[:, None], np.arange(len(cols))[None, :]
                left, right = blk.window
                seen = np.ones((len(rows), len(cols)), dtype=bool)
                if left >= 0:
                    seen &= j >= i - left
                if right >= 0:
                    seen &= j <= i + right
                assert seen.any(axis=1).all(), f"{blk}: a row of the block sees no key"
                np.add.at(counts, (rows[:, None], cols[None, :]), seen.astype(int))
    return counts


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_schedule_covers_its_band_once(layout, window):
    """W = 1..6, chunks of 1, 3 and 5 rows: each pair with i - left <= j <= i + right is computed exactly
    once over every rank and step, and no other pair."""
    left, right = window
    for world_size in range(1, 7):
        for chunk in (1, 3, 5):
            counts = _window_coverage(layout, world_size, chunk, window)
            i, j = np.arange(counts.shape[0])[:, None], np.arange(counts.shape[1])[None, :]
            band = np.ones(counts.shape, dtype=bool)
            if left >= 0:
                band &= j >= i - left
            if right >= 0:
                band &= j <= i + right
            assert np.array_equal(counts, band.astype(int)), (world_size, chunk, window)


def test_window_skips_the_pairs_no_row_sees():
    """A window narrower than a chunk (w = 16, chunks of 256, zigzag, W = 4): a query chunk meets only its own
    chunk and the one before it (2 of the 8 pairs), the latter as a w x w square; so the calls cover
    O(N w) off the diagonal, where the kernels' own window then skips the tiles outside the band."""
    w, chunk, world_size = 16, 256, 4
    calls, off_diagonal = 0, 0
    for rank in range(world_size):
        for step in range(world_size):
            for blk in _schedule.blocks("zigzag", world_size, rank, step, chunk, chunk, False, False, (w, 0)):
                calls += 1
                if blk.q_start != blk.k_start:
                    rows = blk.q_rows.stop - blk.q_rows.start
                    assert rows == w and blk.q_start - blk.k_start == w and blk.window == (0, -1), blk
                    off_diagonal += 1
    chunks = 2 * world_size
    assert calls == 2 * chunks - 1 and off_diagonal == chunks - 1  # the first chunk has none before it


@pytest.mark.parametrize("window", [(5, 0), (3, 8), (0, -1), (-1, 0), (9, 9)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
def test_window_equals_attention_over_the_whole_sequence(rng, assert_matches_reference, world_size, layout, window):
    """The ring with a window over global positions equals the single call with that window, forward and
    backward, causal or not, and meets the accuracy rule."""
    q, k, v, dout = _problem(rng, world_size)
    for causal in (False, True):
        ring = _ring(world_size, q, k, v, dout, causal=causal, window=window, layout=layout)
        _assert_same_as_single(ring, _single(q, k, v, dout, causal=causal, window=window))
    assert_matches_reference(q, k, v, dout, ring, causal=True, window=window)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_with_every_option_and_grouped_heads_in_float64(rng, layout):
    """A window with softcap, a scale, ALiBi (global positions) and grouped-query heads, in float64: the
    ring equals the float64 reference to float64 rounding (W = 3)."""
    n = _seq(3)
    q = rng.standard_normal((B, 1, 3, n, D))
    k, v = rng.standard_normal((B, 1, 1, n, D)), rng.standard_normal((B, 1, 1, n, DV))
    dout = rng.standard_normal((B, 1, 3, n, DV))
    options = dict(window=(4, 2), softcap=SOFTCAP, scale=0.3, alibi_slopes=alibi_slopes(3).astype(np.float64))
    for causal in (False, True):
        ring = _ring(3, q, k, v, dout, causal=causal, layout=layout, **options)
        _assert_float64_matches_reference(q, k, v, dout, ring, causal=causal, **options)


def test_window_with_shards_of_different_lengths_raises(rng):
    q, k, v, _ = random_problem(rng, (B, H, 4, D), (B, H, 6, D), (B, H, 6, DV), np.float32)
    call = lambda comm: dist.ring_attention_forward(q, k, v, comm=comm, window=(2, 2))  # noqa: E731
    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError) and "got 4 and 6 rows" in str(error), repr(error)


@pytest.mark.parametrize("per_pair", [False, True])
def test_zigzag_balances_causal_work(per_pair):
    """Zigzag, causal, W = 1..8: every rank computes the same number of allowed pairs at every step >= 1 (two
    full chunk pairs), and the same total; contiguous does not (W >= 2)."""
    c = 3
    for world_size in range(1, 9):
        _, work = _coverage("zigzag", world_size, True, c, c, per_pair)
        totals = work.sum(axis=1)
        assert (totals == totals[0]).all(), f"W={world_size}: totals {totals}"
        if world_size > 1:
            assert (work[:, 1:] == 2 * c * c).all(), f"W={world_size}: per-step work\n{work}"
            _, cont = _coverage("contiguous", world_size, True, c, c, per_pair)
            assert len(set(cont.sum(axis=1))) > 1


def test_schedule_merges_pairs_into_few_calls():
    """Without per_pair, zigzag causal steps are one call each (the diagonal step, or one rectangle); not
    causal, every step is one call over the whole shards."""
    for world_size in range(1, 9):
        for rank in range(world_size):
            for step in range(world_size):
                causal = _schedule.blocks("zigzag", world_size, rank, step, 3, 3, True, False)
                assert len(causal) == 1 and causal[0].causal == (step == 0)
                (full,) = _schedule.blocks("zigzag", world_size, rank, step, 2, 3, False, False)
                assert (full.q_rows, full.k_rows, full.causal) == (slice(0, 4), slice(0, 6), False)


def test_source_rank():
    """At step t rank r holds the shard of rank (r - t) mod W."""
    assert [_schedule.source_rank(r, 1, 4) for r in range(4)] == [3, 0, 1, 2]
    assert [_schedule.source_rank(0, t, 3) for t in range(3)] == [0, 2, 1]


# ---------------------------------------------------------------------------------------------------
# Bookkeeping: what the ring zeroes, merges, converts and moves
# ---------------------------------------------------------------------------------------------------


def _plan(world_size, rank, c, causal=True, window=None, layout="zigzag"):
    blocks_of = lambda r, t: _schedule.blocks(layout, world_size, r, t, c, c, causal, False, window)  # noqa: E731
    return _schedule.Plan(blocks_of, world_size, rank, 2 * c if layout == "zigzag" else c)


def test_spans_join_overlapping_rows():
    assert _pieces.spans([slice(4, 8), slice(0, 2), slice(6, 10), slice(3, 3)], 12) == [slice(0, 2), slice(4, 10)]
    assert _pieces.spans([slice(0, 2), slice(2, 4)], 12) == [slice(0, 2), slice(2, 4)]
    assert _pieces.spans([slice(0, 2), slice(2, 4)], 12, touching=True) == [slice(0, 4)]
    assert _pieces.spans([slice(0, 2), np.array([5, 1])], 12) == [slice(0, 12)]  # an index array: every row


def test_sums_take_the_part_that_covers_a_span_as_it_is():
    """A part covering its span whole becomes the accumulator itself (no zeros, no pass); parts that come before
    it wait and are added into it; a span that no part covers starts from neutral; a span's only part is
    direct."""
    made = []

    def add(acc, rows, part):
        acc[0][..., rows, :] += part[0]

    def neutral(n, part):
        made.append(n)
        return (np.zeros(part[0].shape[:-2] + (n, part[0].shape[-1])),)

    rows = [slice(0, 2), slice(0, 8), slice(8, 16), slice(20, 22), slice(21, 24)]
    sums = _pieces.Sums(np, rows, 24, add, neutral)
    assert [sums.direct(r) for r in rows] == [False, False, True, False, False]
    parts = {(r.start, r.stop): (np.full((3, r.stop - r.start, 2), float(i + 1)),) for i, r in enumerate(rows)}
    for r in rows:
        sums.add(r, parts[(r.start, r.stop)])
    (s0, (a0,)), (s1, (a1,)), (s2, (a2,)) = sums.finish()
    assert (s0, s1, s2) == (slice(0, 8), slice(8, 16), slice(20, 24)) and made == [4]
    assert a0 is parts[(0, 8)][0] and a1 is parts[(8, 16)][0]  # taken as they came
    np.testing.assert_array_equal(a0[0, :, 0], [3, 3, 2, 2, 2, 2, 2, 2])  # the early part waited, then added
    np.testing.assert_array_equal(a2[0, :, 0], [4, 9, 5, 5])


def test_a_window_moves_only_the_rows_it_reads_and_writes():
    """W = 2, zigzag, causal, a window w narrower than a chunk c: the only calls between ranks are w x w corners,
    so w rows of keys travel (not 2c) and w rows of dK, dV sums go home; without a window, rank 0's keys travel
    without its late chunk, which no other rank's query sees."""
    c, w = 32, 4
    plan = _plan(2, 0, c, window=(w, 0))
    assert plan.keys_after(0, 0) == [slice(c - w, c)]  # chunk 0's last w keys, for chunk 1's first w queries
    assert plan.keys_after(1, 0) == [slice(2 * c - w, 2 * c)]  # chunk 2's last w keys, for chunk 3's
    assert plan.keys_after(0, 1) == plan.keys_after(1, 1) == []
    assert plan.sums_after(0, 1) == [slice(c - w, c)] and plan.sums_after(1, 1) == [slice(2 * c - w, 2 * c)]
    plan = _plan(2, 0, c)
    assert plan.keys_after(0, 0) == [slice(0, c)] and plan.keys_after(1, 0) == [slice(0, 2 * c)]
    assert plan.sums_after(0, 1) == [slice(0, c)] and plan.sums_after(1, 1) == [slice(0, 2 * c)]


def test_a_window_zeroes_nothing_and_moves_its_rows_alone(rng, monkeypatch):
    """The whole ring with a window w < c on 2 ranks: no accumulator starts from zeros or -inf, every exchange
    carries w rows per array, the first chunk (one block) comes from its call in the inputs' dtype, and the
    results are the single call's."""
    c, w = 16, 3
    zeros = []
    for name in ("_zeros", "_no_rows"):
        make = getattr(ring_module, name)
        monkeypatch.setattr(
            ring_module, name, lambda *a, make=make: lambda n, part: zeros.append(n) or make(*a)(n, part)
        )
    dtypes = []
    forward = ring_module.attention_forward
    monkeypatch.setattr(
        ring_module, "attention_forward", lambda *a, **k: dtypes.append(k["out_dtype"]) or forward(*a, **k)
    )
    group = dist.InProcessGroup(2, timeout=30)
    moved = []
    for comm in group.comms:
        exchange = comm.exchange
        comm.exchange = lambda send, recv, exchange=exchange: (
            moved.extend(x.shape for x in send) or exchange(send, recv)
        )
    q, k, v, dout = random_problem(rng, (B, H, 4 * c, D), (B, H, 4 * c, D), (B, H, 4 * c, DV), np.float32)
    ring = _ring(2, q, k, v, dout, group=group, causal=True, window=(w, 0))
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=True, window=(w, 0)))
    assert zeros == []
    assert sorted(moved) == sorted([(B, H, w, D), (B, H, w, DV)] * 6)  # keys each way twice, sums each way once
    assert dtypes.count(None) == 1 and dtypes.count(np.float32) == len(dtypes) - 1  # chunk 0: one block


@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_a_world_of_one_is_attention_bit_for_bit(rng, dtype):
    """W = 1, causal or not: the one call covers every row and comes in the inputs' dtype, rounded once by the
    call itself: the ring's results are attention_forward's and attention_backward's bit for bit (a window and
    ALiBi make one call per chunk pair, whose merges round otherwise)."""
    q, k, v, dout = _problem(rng, 1, dtype)
    for options in (dict(causal=True), dict(causal=False, softcap=SOFTCAP)):
        assert_bitwise_equal(_ring(1, q, k, v, dout, **options), _single(q, k, v, dout, **options), names=NAMES)


# ---------------------------------------------------------------------------------------------------
# Argument errors and cross-rank checks
# ---------------------------------------------------------------------------------------------------


def _errors_on_every_rank(world_size, call):
    """Run ``call(comm)`` on every rank; each rank's exception (which every rank must raise)."""

    def rank_work(comm):
        try:
            call(comm)
        except Exception as error:  # noqa: BLE001 (returned for the test to inspect)
            return error
        return None

    errors = dist.InProcessGroup(world_size, timeout=5).run(rank_work)
    assert all(e is not None for e in errors), f"some ranks did not raise: {errors}"
    return errors


@pytest.mark.parametrize("difference", ["heads", "dtype", "causal", "softcap"])
@pytest.mark.parametrize("backward", [False, True])
def test_ranks_making_different_calls_all_raise(rng, difference, backward):
    """Rank 1 passes another head count, another dtype, another causal or another softcap than ranks 0 and 2:
    every rank raises ValueError saying the ranks' calls differ (and listing each rank's call), in the
    forward and the backward; nothing hangs."""
    q, k, v, dout = _problem(rng, 3)
    out, lse = cupyflash.attention_forward(q, k, v)

    def call(comm):
        x = [dist.shard(a, comm) for a in (dout, q, k, v, out)] + [dist.shard(lse, comm, axis=-1)]
        kwargs = dict(comm=comm, causal=False, softcap=0.0)
        if comm.rank == 1:
            if difference == "heads":
                x = [a[:, :2] for a in x]
            elif difference == "dtype":
                x = [a.astype(np.float64) for a in x]
            elif difference == "causal":
                kwargs["causal"] = True
            else:
                kwargs["softcap"] = 1.0
        if backward:
            dist.ring_attention_backward(*x, **kwargs)
        else:
            dist.ring_attention_forward(*x[1:4], **kwargs)

    start = time.perf_counter()
    errors = _errors_on_every_rank(3, call)
    assert time.perf_counter() - start < 4
    for error in errors:
        assert isinstance(error, ValueError) and "the ranks' calls differ" in str(error), repr(error)
        assert all(f"rank {r}:" in str(error) for r in range(3))


def test_group_run_reraises_the_mismatch(rng):
    """group.run itself re-raises one rank's ValueError when the ranks' calls differ."""
    q, k, v, _ = _problem(rng, 2)

    def rank_work(comm):
        q_l, k_l, v_l = (dist.shard(x, comm) for x in (q, k, v))
        return dist.ring_attention(q_l[:, : 1 + comm.rank], k_l[:, : 1 + comm.rank], v_l[:, : 1 + comm.rank], comm=comm)

    with pytest.raises(ValueError, match="the ranks' calls differ"):
        dist.InProcessGroup(2, timeout=5).run(rank_work)


def test_odd_zigzag_shard_raises(rng):
    """A q (or k) shard with an odd number of rows cannot be two zigzag chunks: ValueError on every rank;
    the same shards under contiguous are fine."""
    q, k, v, _ = _problem(rng, 2)

    def call(comm):
        dist.ring_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :], comm=comm)

    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError) and "holds 7 rows" in str(error) and "'zigzag'" in str(error)
    outs = dist.InProcessGroup(2).run(
        lambda comm: dist.ring_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :], comm=comm, layout="contiguous")
    )
    assert all(o.shape == (B, H, 7, DV) for o in outs)


@pytest.mark.parametrize("options", [dict(causal=True), dict(alibi_slopes=alibi_slopes(H))], ids=["causal", "alibi"])
def test_causal_or_alibi_with_shards_of_different_lengths_raises(rng, options):
    """Causal or ALiBi needs one sequence attending to itself: q and k shards of different lengths raise
    ValueError on every rank."""
    q, k, v, _ = random_problem(rng, (B, H, 4, D), (B, H, 6, D), (B, H, 6, DV), np.float32)

    for error in _errors_on_every_rank(2, lambda comm: dist.ring_attention_forward(q, k, v, comm=comm, **options)):
        assert isinstance(error, ValueError) and "got 4 and 6 rows" in str(error), repr(error)


@pytest.mark.parametrize(
    "kwargs, change",
    [
        (dict(scale=-1.0), None),
        (dict(scale=float("nan")), None),
        (dict(softcap=-1.0), None),
        (dict(causal="yes"), None),
        (dict(alibi_slopes=np.ones(4, np.float32)), None),
        (dict(alibi_slopes=[1.0, 1.0, 1.0]), None),
        ({}, "head_dim"),
        ({}, "dtype"),
        ({}, "int"),
    ],
    ids=["scale", "scale_nan", "softcap", "causal", "alibi_shape", "alibi_list", "head_dim", "dtype", "int"],
)
def test_invalid_arguments_raise_the_single_call_error(rng, kwargs, change):
    """An invalid argument on every rank raises, on every rank, the very error (type and message) that
    cupyflash.attention_forward raises for it."""
    q, k, v, _ = _problem(rng, 2)
    if change == "head_dim":
        k = k[..., :-1]
    elif change == "dtype":
        k = k.astype(np.float64)
    elif change == "int":
        q = q.astype(np.int32)
    with pytest.raises((TypeError, ValueError)) as single:
        cupyflash.attention_forward(q, k, v, **kwargs)

    def call(comm):  # the shards keep every dim but N, and the messages name no N
        dist.ring_attention_forward(*(dist.shard(x, comm) for x in (q, k, v)), comm=comm, **kwargs)

    for error in _errors_on_every_rank(2, call):
        assert type(error) is single.type, repr(error)
        expected = str(single.value).replace(f", {_seq(2)}, ", f", {_seq(2) // 2}, ")
        assert str(error) == expected


def test_invalid_backward_arguments_raise_the_single_call_error(rng):
    """The backward with an out of the wrong shape raises what cupyflash.attention_backward raises for it."""
    q, k, v, dout = _problem(rng, 2)
    out, lse = cupyflash.attention_forward(q, k, v)
    bad_out = out[..., :-1]
    with pytest.raises(ValueError) as single:
        cupyflash.attention_backward(dout, q, k, v, bad_out, lse)

    def call(comm):
        shards = [dist.shard(x, comm) for x in (dout, q, k, v, bad_out)]
        dist.ring_attention_backward(*shards, dist.shard(lse, comm, axis=-1), comm=comm)

    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError)
        assert str(error) == str(single.value).replace(f", {_seq(2)}, ", f", {_seq(2) // 2}, ")


# ---------------------------------------------------------------------------------------------------
# InProcessGroup
# ---------------------------------------------------------------------------------------------------


def test_group_returns_results_in_rank_order():
    """run(fn) calls fn(comm) on every rank and returns the results in rank order; all_gather and barrier
    see every rank."""

    def rank_work(comm):
        comm.barrier()
        gathered = comm.all_gather(np.array([comm.rank * 10]))
        return comm.rank, comm.world_size, [int(g[0]) for g in gathered]

    assert dist.InProcessGroup(5).run(rank_work) == [(r, 5, [0, 10, 20, 30, 40]) for r in range(5)]
    assert dist.InProcessGroup(1).run(lambda comm: (comm.rank, comm.world_size)) == [(0, 1)]


def test_failure_on_one_rank_propagates_without_hanging(rng):
    """Rank 1 raises while the others wait in a barrier or in the ring: its exception comes out of run()
    within a second or so (not after the 5 s timeout), and the group then runs the ring correctly."""
    q, k, v, dout = _problem(rng, 3)
    group = dist.InProcessGroup(3, timeout=5)

    def failing(comm):
        if comm.rank == 1:
            time.sleep(0.2)
            raise RuntimeError("rank 1 failed")
        comm.barrier()

    def failing_in_ring(comm):
        if comm.rank == 1:
            raise KeyError("rank 1 failed before the ring")
        return dist.ring_attention(*(dist.shard(x, comm) for x in (q, k, v)), comm=comm)

    for fn, error in ((failing, RuntimeError), (failing_in_ring, KeyError)):
        start = time.perf_counter()
        with pytest.raises(error, match="rank 1 failed"):
            group.run(fn)
        assert time.perf_counter() - start < 3
    ring = _ring(3, q, k, v, dout, group=group, causal=True)
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=True))


def test_a_rank_that_never_calls_times_out():
    """A rank left waiting for a message that never comes raises TimeoutError after the group's timeout."""

    def rank_work(comm):
        if comm.rank == 0:
            comm.barrier()

    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="does every rank make the same calls"):
        dist.InProcessGroup(2, timeout=0.5).run(rank_work)
    assert time.perf_counter() - start < 3


@pytest.mark.parametrize("world_size", [0, -1, 2.0, "2", None])
def test_group_world_size_must_be_a_positive_int(world_size):
    """world_size < 1 or not an int: ValueError."""
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        dist.InProcessGroup(world_size)


def test_package_exports():
    """cupyflash.distributed exports the ring, the layouts and the communicators."""
    assert dist.LAYOUTS == ("zigzag", "contiguous")
    for name in dist.__all__:
        assert hasattr(dist, name), name


@pytest.mark.skipif(cupy is None or gpu_available(), reason="checks a machine whose CuPy sees no usable GPU")
def test_init_without_a_usable_gpu_says_so():
    """As warmup() does: a RuntimeError that names the call and CUDA's answer, not CUDA's own exception."""
    with pytest.raises(
        RuntimeError,
        match=r"^cupyflash\.distributed\.init needs a CUDA device per rank, but CUDA "
        r"reports none usable \(.+\); for NumPy arrays use InProcessGroup$",
    ):
        dist.init(rank=0, world_size=1)


def test_the_example_runs_on_cpu_ranks_with_its_default_length():
    """examples/ring_attention.py --cpu 3: its default length is rounded up to a multiple of 2W for zigzag
    shards (512 -> 516), and the ring matches one device."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "ring_attention.py"), "--cpu", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 ranks (threads), N = 516" in done.stdout


# ---------------------------------------------------------------------------------------------------
# Packed batches: every sequence sharded across the ranks (shard_varlen, ring_attention_varlen_*)
# ---------------------------------------------------------------------------------------------------

# sequence lengths in chunks (times 2W for zigzag, W for contiguous): an empty sequence, a short and a long one
VARLEN_CHUNKS = (3, 0, 1, 5)


def _varlen_offsets(world_size, layout, chunks=VARLEN_CHUNKS):
    parts = (2 if layout == "zigzag" else 1) * world_size
    return np.concatenate([[0], np.cumsum([c * parts for c in chunks])]).astype(np.int32)


def _varlen_ring(world_size, q, k, v, dout, cu, **kwargs):
    """Shard, run the packed ring's forward and backward on every rank, unshard: (out, lse, dq, dk, dv)."""
    layout = kwargs.get("layout", "zigzag")

    def rank_work(comm):
        q_l, k_l, v_l, dout_l = (dist.shard_varlen(x, cu, comm, layout=layout) for x in (q, k, v, dout))
        out_l, lse_l = dist.ring_attention_varlen_forward(q_l, k_l, v_l, cu, comm=comm, **kwargs)
        grads = dist.ring_attention_varlen_backward(dout_l, q_l, k_l, v_l, out_l, lse_l, cu, comm=comm, **kwargs)
        for g, x in zip(grads, (q_l, k_l, v_l)):
            assert (g.shape, g.dtype) == (x.shape, x.dtype)
        return (
            dist.unshard_varlen(out_l, cu, comm, layout=layout),
            dist.unshard_varlen(lse_l, cu, comm, layout=layout, axis=-1),
            *(dist.unshard_varlen(g, cu, comm, layout=layout) for g in grads),
        )

    results = dist.InProcessGroup(world_size, timeout=30).run(rank_work)
    for rank, other in enumerate(results[1:], 1):
        assert_bitwise_equal(other, results[0], names=[f"rank {rank}'s {n}" for n in NAMES])
    return results[0]


def _varlen_single(q, k, v, dout, cu, **kwargs):
    kwargs.pop("layout", None)
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu, cu, **kwargs)
    return (out, lse, *cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, **kwargs))


def _varlen_problem(rng, total, dtype=np.float32, heads=4, kv_heads=2):
    q = random_array(rng, (total, heads, D), dtype)
    k = random_array(rng, (total, kv_heads, D), dtype)
    v = random_array(rng, (total, kv_heads, DV), dtype)
    dout = random_array(rng, (total, heads, DV), dtype)
    return q, k, v, dout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 8))
def test_varlen_ring_equals_attention_varlen(rng, world_size, layout, causal):
    """A packed batch (an empty sequence among them, grouped-query heads) sharded across W ranks: the ring's
    forward and backward equal attention_varlen's over the whole batch."""
    cu = _varlen_offsets(world_size, layout)
    q, k, v, dout = _varlen_problem(rng, int(cu[-1]))
    ring = _varlen_ring(world_size, q, k, v, dout, cu, causal=causal, layout=layout)
    _assert_same_as_single(ring, _varlen_single(q, k, v, dout, cu, causal=causal))


@pytest.mark.parametrize("window", [(1, 1), (5, -1), (-1, 3), (7, 2), (2, 0), (-1, -1)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", (1, 2, 3))
def test_varlen_ring_with_a_window(rng, world_size, layout, window):
    """A window over each sequence's global positions, sequences of different chunk lengths (one empty): the
    ring equals attention_varlen with that window, causal or not."""
    cu = _varlen_offsets(world_size, layout, chunks=(3, 0, 1, 5, 3))
    q, k, v, dout = _varlen_problem(rng, int(cu[-1]))
    for causal in (False, True):
        ring = _varlen_ring(world_size, q, k, v, dout, cu, causal=causal, window=window, layout=layout)
        _assert_same_as_single(ring, _varlen_single(q, k, v, dout, cu, causal=causal, window=window))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_ring_with_softcap_and_scale_in_float64(rng, layout):
    """float64 throughout: the ring equals the single call to float64 rounding, with softcap and a scale, causal
    or with a window."""
    cu = _varlen_offsets(3, layout)
    q, k, v, dout = _varlen_problem(rng, int(cu[-1]), np.float64)
    for options in (dict(causal=True, softcap=SOFTCAP, scale=0.3), dict(window=(4, 6), softcap=SOFTCAP, scale=0.3)):
        ring = _varlen_ring(3, q, k, v, dout, cu, layout=layout, **options)
        single = _varlen_single(q, k, v, dout, cu, **options)
        for name, x, y in zip(NAMES, ring, single):
            assert x.dtype == np.float64 and max_abs(x - y) <= RTOL64 * max(1.0, max_abs(y)), (name, options)


@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_varlen_ring_16_bit_as_exact_as_the_single_call(rng, dtype):
    """bfloat16 and float16 (W = 2, causal): each call's results come unrounded and the ring rounds once, at
    the end, as the single call does: each result's error against float64 is within the blocked-schedule rule
    of helpers/checks.py against the single 16-bit call's."""
    cu = _varlen_offsets(2, "zigzag", chunks=(12, 0, 4, 20))
    q, k, v, dout = _varlen_problem(rng, int(cu[-1]), dtype)
    ring = _varlen_ring(2, q, k, v, dout, cu, causal=True)
    single = _varlen_single(q, k, v, dout, cu, causal=True)
    exact = _varlen_single(*(x.astype(np.float64) for x in (q, k, v, dout)), cu, causal=True)
    assert_as_exact_as_the_single_call(NAMES, ring, single, exact, dtype)


def test_shard_varlen_holds_each_sequences_chunks():
    """Zigzag, W = 2: every sequence is cut into 4 chunks; rank r holds chunks r and 3 - r of each sequence,
    sequence after sequence; contiguous: chunk r of 2."""
    x = np.arange(16)[:, None, None]  # sequences of 4 and 12 rows
    cu = [0, 4, 16]
    zigzag = dist.InProcessGroup(2).run(lambda comm: dist.shard_varlen(x, cu, comm)[:, 0, 0].tolist())
    assert zigzag == [[0, 3, 4, 5, 6, 13, 14, 15], [1, 2, 7, 8, 9, 10, 11, 12]]
    contiguous = dist.InProcessGroup(2).run(
        lambda comm: dist.shard_varlen(x, cu, comm, layout="contiguous")[:, 0, 0].tolist()
    )
    assert contiguous == [[0, 1, 4, 5, 6, 7, 8, 9], [2, 3, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_varlen_round_trip(rng, layout):
    cu = _varlen_offsets(3, layout)
    x = rng.standard_normal((int(cu[-1]), 2, 5))
    lse = rng.standard_normal((2, int(cu[-1])))

    def rank_work(comm):
        back = dist.unshard_varlen(dist.shard_varlen(x, cu, comm, layout), cu, comm, layout)
        back_lse = dist.unshard_varlen(dist.shard_varlen(lse, cu, comm, layout, axis=-1), cu, comm, layout, axis=-1)
        return back, back_lse

    for back, back_lse in dist.InProcessGroup(3).run(rank_work):
        assert np.array_equal(back, x) and np.array_equal(back_lse, lse)


def test_a_sequence_that_does_not_split_says_how_to_pad():
    x = np.zeros((14, 1, 4), np.float32)
    for error in _errors_on_every_rank(2, lambda comm: dist.shard_varlen(x, [0, 8, 14], comm)):
        assert isinstance(error, ValueError), repr(error)
        assert "sequence 1 of the packed batch has 6 rows" in str(error) and "pad every sequence" in str(error)
        assert "multiple of 4" in str(error)
    q = np.zeros((7, 1, 4), np.float32)  # a shard of 7 rows: the whole batch has 14
    call = lambda comm: dist.ring_attention_varlen_forward(q, q, q, [0, 8, 14], comm=comm)  # noqa: E731
    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError) and "pad every sequence" in str(error), repr(error)


@pytest.mark.parametrize(
    "cu, message",
    [
        ([0, 8, 12], "the whole packed batch has 16 rows"),
        ([4, 16], "must start at 0"),
        ([0, 12, 8, 16], "never decrease"),
        ([[0, 16]], "1-D"),
        ([0.0, 16.0], "cu_seqlens"),
    ],
)
def test_bad_offsets_raise_on_every_rank(cu, message):
    q = np.zeros((8, 2, 4), np.float32)
    call = lambda comm: dist.ring_attention_varlen_forward(q, q, q, cu, comm=comm)  # noqa: E731
    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, (TypeError, ValueError)) and message in str(error), repr(error)


def test_varlen_ring_rejects_what_attention_varlen_rejects():
    q = np.zeros((8, 4, 16), np.float32)
    k = np.zeros((8, 3, 16), np.float32)  # 3 key/value heads do not divide 4 query heads
    call = lambda comm: dist.ring_attention_varlen_forward(q, k, k, [0, 16], comm=comm)  # noqa: E731
    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError) and "must divide the query heads" in str(error), repr(error)
    short = np.zeros((6, 3, 16), np.float32)
    call = lambda comm: dist.ring_attention_varlen_forward(q, short, short, [0, 16], comm=comm)  # noqa: E731
    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError) and "q and k shards hold 8 and 6 rows" in str(error), repr(error)


def test_varlen_ranks_making_different_calls_all_raise(rng):
    cu = _varlen_offsets(2, "zigzag")
    q, k, v, _ = _varlen_problem(rng, int(cu[-1]))

    def call(comm):
        q_l, k_l, v_l = (dist.shard_varlen(x, cu, comm) for x in (q, k, v))
        return dist.ring_attention_varlen_forward(q_l, k_l, v_l, cu, comm=comm, causal=comm.rank == 0)

    for error in _errors_on_every_rank(2, call):
        assert isinstance(error, ValueError) and "causal=True" in str(error) and "causal=False" in str(error)


@pytest.mark.parametrize("window", [(-1, -1), [-1, -1]])
def test_an_unbounded_window_is_no_window(rng, window):
    """window=(-1, -1) is every key: the ring gives the same results as with no window."""
    q, k, v, dout = _problem(rng, 2)
    ring = _ring(2, q, k, v, dout, causal=True, window=window)
    _assert_same_as_single(ring, _single(q, k, v, dout, causal=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_windowed_ring_on_empty_shards(layout):
    """Zero rows with a window: empty results of the right shapes, as without a window."""
    q = np.zeros((1, 2, 0, 8), np.float32)

    def rank_work(comm):
        out, lse = dist.ring_attention_forward(q, q, q, comm=comm, window=(3, 0), layout=layout)
        grads = dist.ring_attention_backward(q, q, q, q, out, lse, comm=comm, window=(3, 0), layout=layout)
        return out.shape, lse.shape, [g.shape for g in grads]

    for out, lse, grads in dist.InProcessGroup(2).run(rank_work):
        assert out == (1, 2, 0, 8) and lse == (1, 2, 0) and grads == [(1, 2, 0, 8)] * 3
