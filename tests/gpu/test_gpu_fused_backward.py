"""The warp-specialized fused backward (cuda_src/attention_bwd_ws.cu) on Hopper: 16-bit, plain or causal, head
dims 33-128 and 161-256 (at HEAD_DIM 64, 128, 192 or 256: tiles.ws_head_dim), sequences from
tile_policy.WS_BWD_MIN_LENGTH on (ordered or unordered dq adds). Needs a GPU of compute capability 9.0:

    python -m pytest -m gpu tests/gpu/test_gpu_fused_backward.py

Short problems reach it with its length thresholds and WS_BWD_MIN_WORK lowered (the kernel is the same at every
length); every
allocation starts as NaN, so an element of dq, dk or dv that is never written, or a workspace read before it is
written, fails the reference check.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_matches_reference
from helpers.gpu import nan_filled_allocations
from helpers.modifiers import run
from helpers.problems import random_array, random_problem

import cupyflash
from cupyflash._cuda import fused_backward, tile_policy, tiles
from cupyflash._cuda.compile import current_device
from cupyflash._cuda.variants import Features

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _fused(dtype, d, dv, causal, nq, nk, deterministic=True):
    return tile_policy.dense(
        Features.of("bwd", np.dtype(dtype), d, dv, causal, lengths=(nq, nk), deterministic=deterministic),
        current_device(),
    )


def _launches(monkeypatch):
    """The variants the fused backward's plans launch, in order."""
    launched, real = [], fused_backward.FusedBackwardPlan._launch_locked

    def spy(plan, *args, **kwargs):
        launched.append(plan.variant)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(fused_backward.FusedBackwardPlan, "_launch_locked", spy)
    return launched


def _problem(rng, dtype, batch, nq, nk, d, dv=None):
    dv = d if dv is None else dv
    return random_problem(rng, batch + (nq, d), batch + (nk, d), batch + (nk, dv), dtype, xp=cupy)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(333, 397), (397, 261), (128, 128), (1000, 64), (70, 1100)])
@pytest.mark.parametrize("d", [40, 64, 80, 96, 128, 168, 192, 200, 256])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_backward_matches_the_reference(rng, any_length, dtype, d, nq, nk, causal):
    """Sizes off every block: partial query and key blocks, Nq > Nk (causal rows that see no key, whose dq is
    0 and whose query blocks no key block adds to) and Nq < Nk (key blocks no query sees: dk = dv = 0), head
    dims padded to the kernel's."""
    assert _fused(dtype, d, d, causal, nq, nk).fused_backward
    q, k, v, dout = _problem(rng, dtype, (2, 3), nq, nk, d)
    with nan_filled_allocations():
        results = run(q, k, v, dout, causal=causal)
    assert_matches_reference(q, k, v, dout, results, causal=causal)


@pytest.mark.parametrize("d, dv", [(64, 40), (48, 128), (192, 136), (256, 224)])
def test_fused_backward_with_narrower_values_or_keys(rng, any_length, d, dv):
    assert _fused(ml_dtypes.bfloat16, d, dv, True, 300, 500).fused_backward
    q, k, v, dout = _problem(rng, ml_dtypes.bfloat16, (2, 2), 300, 500, d, dv)
    with nan_filled_allocations():
        results = run(q, k, v, dout, causal=True)
    assert_matches_reference(q, k, v, dout, results, causal=True)


@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("by_arrival", [True, False], ids=["by-arrival", "by-index"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_backward_is_bitwise_reproducible(rng, any_length, monkeypatch, causal, by_arrival, d):
    """dq sums the key blocks' partials in an order fixed per query block, whichever CTA gets there first: two
    runs agree bit for bit, in both orders the host picks from (key blocks in the order they reach a query
    block, or in the order of their index: where a batch entry's CTAs cannot all be resident at once, and without
    a causal mask at long rows). Many
    batch entries, so that several waves of CTAs run and their timing differs between runs."""
    if not by_arrival:  # every batch entry as if it had more key blocks than the GPU has SMs
        monkeypatch.setattr(fused_backward, "sm_count", lambda device: 1)
    q, k, v, dout = _problem(rng, ml_dtypes.bfloat16, (4, 24), 1100, 1300, d)
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    first = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    for _ in range(3):
        again = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        for a, b in zip(first, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    assert_matches_reference(q, k, v, dout, (out, lse, *first), causal=causal)


@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "unordered"])
def test_fused_backward_with_more_batch_entries_than_a_grid_dimension_holds(rng, any_length, deterministic):
    """70000 entries > 65535: the launch splits the batch over the grid's y and z, so the last CTAs of the fused
    kernel and of its conversion fall past the batch and must leave. Allocations start as NaN: every gradient
    is written; the first and last entries match float64."""
    assert _fused(np.float16, 40, 40, True, 40, 50, deterministic).fused_backward
    q, k, v, dout = _problem(rng, np.float16, (70000,), 40, 50, 40)
    with nan_filled_allocations():
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    results = (out, lse, *grads)
    assert all(bool(cupy.isfinite(x).all()) for x in results)
    for entries in (slice(0, 3), slice(-3, None)):
        assert_matches_reference(
            q[entries], k[entries], v[entries], dout[entries], tuple(x[entries] for x in results), causal=True
        )


def test_fused_backward_serves_long_sequences(rng):
    """At the table's own thresholds: the fused kernel is what a long 16-bit call with enough work takes, and a
    shorter one (or one past CHAIN_ROWS, or one with less work) takes the two passes."""
    if not current_device().wgmma:
        pytest.skip("the fused backward runs on compute capability 9.0 only")
    n = tile_policy.WS_BWD_MIN_LENGTH[128]
    assert _fused(ml_dtypes.bfloat16, 128, 128, True, n + 5, n + 5).fused_backward
    assert not _fused(ml_dtypes.bfloat16, 128, 128, True, n - 1, n + 5).fused_backward
    assert not _fused(ml_dtypes.bfloat16, 128, 128, False, tiles.CHAIN_ROWS + 1, n).fused_backward
    n = max(n, 4096)
    batch = (3, 4)  # 12 (n + 5)^2 128 >= WS_BWD_MIN_WORK
    assert tile_policy.backward_lengths(12, n + 5, n + 5, 128) == (n + 5, n + 5)
    assert tile_policy.backward_lengths(1, n + 5, n + 5, 128) == (0, 0)
    q, k, v, dout = _problem(rng, ml_dtypes.bfloat16, batch, n + 5, n + 5, 128)
    with nan_filled_allocations():
        results = run(q, k, v, dout, causal=True)
    assert_matches_reference(q, k, v, dout, results, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(333, 397), (1000, 64), (70, 1100)])
@pytest.mark.parametrize("d", [64, 80, 100, 176, 256])
def test_unordered_fused_backward_matches_the_reference(rng, any_length, monkeypatch, d, nq, nk, causal):
    """deterministic=False: the fused kernel whose dq adds land in any order (into an accumulator the host
    zeroes: allocations start as NaN here), against float64 at awkward sizes, head dims 64, 128, 192 and 256
    (two chains of the ordered form's layout at 64; paired consumers at 192 and 256; 80 padded to 128, 176 to
    192)."""
    launched = _launches(monkeypatch)
    q, k, v, dout = _problem(rng, np.float16 if d == 64 else ml_dtypes.bfloat16, (2, 3), nq, nk, d)
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    with nan_filled_allocations():
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False)
    assert [x.deterministic for x in launched] == [False]
    assert_matches_reference(q, k, v, dout, (out, lse, *grads), causal=causal)


def test_unordered_adds_serve_from_the_same_length(rng, monkeypatch):
    """At the table's own threshold: a non-causal bfloat16 call at HEAD_DIM 128 of WS_BWD_MIN_LENGTH takes the
    fused kernel in order (planned, then again through the fast path, bit for bit) and with deterministic=False
    its unordered form, not the ordered call's plan; all match float64."""
    if not current_device().wgmma:
        pytest.skip("the fused backward runs on compute capability 9.0 only")
    n = tile_policy.WS_BWD_MIN_LENGTH[128]
    batch = (4, -(-tile_policy.WS_BWD_MIN_WORK // (4 * n * n * 128)))  # enough work for the fused backward
    assert tile_policy.backward_lengths(batch[0] * batch[1], n, n, 128) == (n, n)
    assert _fused(ml_dtypes.bfloat16, 128, 128, False, n, n, deterministic=False).fused_backward
    launched = _launches(monkeypatch)
    q, k, v, dout = _problem(rng, ml_dtypes.bfloat16, batch, n, n, 128)
    out, lse = cupyflash.attention_forward(q, k, v)
    ordered = cupyflash.attention_backward(dout, q, k, v, out, lse)
    with nan_filled_allocations():  # the plan's own workspace is new on every call, and zeroed where it must be
        ordered_again = cupyflash.attention_backward(dout, q, k, v, out, lse)  # planned, then the fast path
    unordered = cupyflash.attention_backward(dout, q, k, v, out, lse, deterministic=False)
    assert [x.deterministic for x in launched] == [True, True, False]
    for a, b in zip(ordered, ordered_again):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    for grads in (ordered, unordered):
        assert_matches_reference(q, k, v, dout, (out, lse, *grads), causal=False)


@pytest.mark.parametrize(
    "q_batch, k_batch, v_batch",
    [
        ((2, 4), (2, 1), (2, 1)),  # MQA
        ((2, 4), (1, 4), (1, 4)),  # shared by the batch
        ((2, 3, 2), (1, 3, 1), (1, 3, 1)),  # GQA shared by the batch too: the outer and inner dims
        ((2, 4), (2, 1), (2, 4)),  # k shared, v not: each by its own strides
        ((2, 4), (1, 1), (1, 1)),  # shared by every entry
    ],
    ids=["mqa", "batch-shared", "batch-and-group", "v-not-shared", "all-shared"],
)
@pytest.mark.parametrize("d", [64, 256])
def test_broadcast_keys_take_the_fused_backward(rng, monkeypatch, any_length, d, q_batch, k_batch, v_batch):
    """GQA and MQA as k and v broadcast over batch dims (stride 0): their tensor maps hold each such dim as one
    entry, read at coordinate 0, so the fused backward serves them (k and v each by its own strides); dk and dv,
    written per query head, come back summed over the heads that share them, matching the float64 reference. A
    second call of the same layout (the planned fast path, its per-head dk and dv in scratch memory) gives the
    same bits."""
    launched = _launches(monkeypatch)
    bf16 = ml_dtypes.bfloat16
    q, dout = (random_array(rng, q_batch + (300, d), bf16, xp=cupy) for _ in range(2))
    k, v = (random_array(rng, batch + (260, d), bf16, xp=cupy) for batch in (k_batch, v_batch))
    with nan_filled_allocations():
        results = run(q, k, v, dout, causal=True)
    assert results[3].shape == k.shape and results[4].shape == v.shape
    assert len(launched) == 1 and launched[0].fused_backward, launched
    assert_matches_reference(q, k, v, dout, results, causal=True)
    out, lse = results[:2]
    again = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert len(launched) == 2 and launched[1].fused_backward, launched
    for a, b in zip(again, results[2:]):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
