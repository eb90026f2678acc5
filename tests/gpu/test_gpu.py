"""The CUDA kernels (CuPy inputs) against the float64 reference. Needs a GPU:

    python -m pytest -m gpu

Every test computes the reference on the CPU from the very inputs the kernels saw, upcast to float64, and
holds the kernels to FlashAttention's rule (tests/helpers/checks.py): in float16/bfloat16 at most twice the
error of a naive same-dtype CuPy implementation, in float32 1e-5 relative. Outputs are allocated filled with
NaN, so an element the kernels forget to write fails the test.
"""

import functools
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_bitwise_equal, assert_rows_without_keys_are_zero
from helpers.gpu import nan_filled_allocations
from helpers.problems import check_bhnd, random_array, random_problem

import cupyflash
from cupyflash import reference
from cupyflash._cuda import plans

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
HEAD_DIMS = (16, 32, 40, 64, 80, 96, 128, 160, 192, 256)
# (batch, Nq, Nk): a small batch for the long sequences keeps the float64 CPU reference quick
SIZES = (
    ((2, 3), 1, 1),
    ((2, 3), 1, 300),
    ((2, 3), 113, 203),
    ((2, 3), 203, 113),
    ((1, 2), 512, 512),
    ((1, 2), 1023, 1024),
    ((1, 1), 2048, 2048),
)


def _run(q, k, v, dout, *, causal, scale=None):
    """Forward then backward, every output allocated as NaN: (out, lse, dq, dk, dv)."""
    with nan_filled_allocations():
        out, lse = cupyflash.attention_forward(q, k, v, causal=causal, scale=scale)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    return (out, lse, *grads)


_random = functools.partial(random_array, xp=cupy)
_random_problem = functools.partial(random_problem, xp=cupy)
_check_bhnd = functools.partial(check_bhnd, run=_run, xp=cupy)


@pytest.mark.parametrize("batch, nq, nk", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, assert_matches_reference, dtype, head_dim, causal, batch, nq, nk):
    _check_bhnd(rng, assert_matches_reference, dtype, batch, nq, nk, head_dim, head_dim, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 256))
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_mma_sync_path_on_every_gpu(rng, assert_matches_reference, monkeypatch, dtype, head_dim, causal):
    """fp16/bf16 take the wgmma kernels on Hopper; CUPYFLASH_NO_WGMMA=1 forces the mma.sync kernels that
    every other GPU runs, so a Hopper test run checks both."""
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    _check_bhnd(rng, assert_matches_reference, dtype, (1, 2), 300, 333, head_dim, head_dim, causal)


@pytest.mark.parametrize("d, dv", [(1, 1), (3, 5), (33, 17), (17, 33), (64, 24), (72, 200), (1, 256), (256, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_odd_and_unequal_head_dims(rng, assert_matches_reference, dtype, causal, d, dv):
    check = assert_matches_reference
    if d == 1:
        # With D = 1, dq is one product per element: the naive's error is that of one rounded sum, while the
        # kernels' also carries delta = rowsum(dout * out) over Dv rounded values of out, as every
        # FlashAttention backward does. Emulating both roundings in NumPy over 300 draws at (1, 256): 1.7%
        # of the draws exceed twice the naive's error, the worst by 1.6 times that (median 0.44).
        check = functools.partial(assert_matches_reference, naive_factors={"dq": 4.0})
    _check_bhnd(rng, check, dtype, (2, 1), 137, 145, d, dv, causal)


@pytest.mark.parametrize("scale", [0.01, 0.3, 2.0])
def test_explicit_scale(rng, assert_matches_reference, scale):
    _check_bhnd(rng, assert_matches_reference, np.float16, (2,), 150, 170, 64, 64, True, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_query_attention(rng, assert_matches_reference, dtype, causal):
    """GQA: q (B, Hk, G, N, D) attends to k, v (B, Hk, N, D) through k[:, :, None]; dk sums the G groups."""
    batch, kv_heads, groups, nq, nk = 2, 2, 3, 177, 190
    q = _random(rng, (batch, kv_heads, groups, nq, 64), dtype)
    k, v = (_random(rng, (batch, kv_heads, nk, 64), dtype)[:, :, None] for _ in range(2))
    dout = _random(rng, (batch, kv_heads, groups, nq, 64), dtype)
    results = _run(q, k, v, dout, causal=causal)
    assert results[3].shape == (batch, kv_heads, 1, nk, 64)
    assert_matches_reference(q, k, v, dout, results, causal=causal)


@pytest.mark.parametrize(
    "q_shape, kv_shape, v_like_k",
    [
        ((2, 4, 300, 64), (2, 1, 300, 64), True),  # MQA: one key/value head per batch entry
        ((2, 3, 260, 128), (1, 3, 260, 128), True),  # shared by the batch entries
        ((2, 2, 3, 200, 128), (2, 2, 1, 200, 128), True),  # GQA
        ((2, 3, 230, 64), (230, 64), True),  # shared by every batch entry and head
        ((2, 3, 2, 210, 128), (1, 3, 1, 210, 128), True),  # GQA shared by the batch: the outer and inner dims
        ((1, 2, 2, 190, 256), (1, 2, 1, 190, 256), True),  # GQA at the widest head dim
        ((2, 4, 250, 64), (2, 1, 250, 64), False),  # k shared, v not: other dims, the wgmma forward
    ],
    ids=["mqa", "batch", "gqa", "all", "batch-and-group", "gqa-d256", "k-only"],
)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_keys_broadcast_over_batch_dims_are_read_through_tensor_maps(
    rng, monkeypatch, assert_matches_reference, dtype, q_shape, kv_shape, v_like_k
):
    """On Hopper the warp-specialized forward reads k and v broadcast over any of the batch dims through tensor maps
    whose broadcast dims have one entry (read at coordinate 0); k and v broadcast over different dims leave it to the
    wgmma forward. Either way the results match the reference."""
    from cupyflash._cuda import dense
    from cupyflash._cuda.compile import current_device

    mapped = []
    tma_reads = dense._tma_reads
    monkeypatch.setattr(dense, "_tma_reads", lambda *args: mapped.append(tma_reads(*args)) or mapped[-1])
    plans.clear()
    v_shape = kv_shape if v_like_k else q_shape[:-1] + (kv_shape[-1],)
    q, k, v, dout = _random_problem(rng, q_shape, kv_shape, v_shape, dtype)
    results = _run(q, k, v, dout, causal=True)
    assert_matches_reference(q, k, v, dout, results, causal=True)
    if current_device().wgmma:
        assert mapped == [v_like_k], mapped


def test_keys_shared_by_every_batch_and_head(rng, assert_matches_reference):
    """k and v with no leading dims at all broadcast over q's (B, H); their gradients sum over both."""
    q, k, v, dout = _random_problem(rng, (3, 4, 165, 32), (180, 32), (180, 32), np.float16)
    assert_matches_reference(q, k, v, dout, _run(q, k, v, dout, causal=True), causal=True)


def test_many_leading_dims(rng, assert_matches_reference):
    """Five leading dims, two of them broadcast."""
    q_shape, kv_shape = (2, 2, 3, 2, 2, 40, 32), (2, 1, 3, 1, 2, 50, 32)
    q, k, v, dout = _random_problem(rng, q_shape, kv_shape, kv_shape, ml_dtypes.bfloat16)
    assert_matches_reference(q, k, v, dout, _run(q, k, v, dout, causal=False), causal=False)


def test_more_batch_elements_than_a_grid_dimension_holds(rng, assert_matches_reference):
    """B * H = 70000 > 65535, the largest grid y (or z) dimension."""
    _check_bhnd(rng, assert_matches_reference, np.float16, (70000,), 3, 5, 16, 16, True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_strided_flash_attention_layout(rng, assert_matches_reference, dtype, causal):
    """(B, N, H, D) tensors viewed as (B, H, N, D) give the same bits as contiguous copies."""
    batch, heads, nq, nk, d = 2, 3, 170, 190, 64
    qkv = _random(rng, (batch, nk, 3, heads, d), dtype)  # packed q, k, v, as one projection gives
    q = _random(rng, (batch, nq, heads, d), dtype).transpose(0, 2, 1, 3)
    k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in (1, 2))
    dout = _random(rng, (batch, nq, heads, d), dtype).transpose(0, 2, 1, 3)
    strided = _run(q, k, v, dout, causal=causal)
    contiguous = _run(*map(cupy.ascontiguousarray, (q, k, v, dout)), causal=causal)
    assert_bitwise_equal(strided, contiguous)
    assert_matches_reference(q, k, v, dout, strided, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_deterministic(rng, dtype, causal):
    """Forward and backward give the same bits on every run (no atomics whose order varies)."""
    q, k, v, dout = _random_problem(rng, (2, 4, 1023, 128), (2, 4, 1024, 128), (2, 4, 1024, 128), dtype)
    assert_bitwise_equal(_run(q, k, v, dout, causal=causal), _run(q, k, v, dout, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_repeated_layout_reads_the_new_arrays(rng, assert_matches_reference, dtype):
    """A call whose arrays have the layout of an earlier call's reuses that call's launch plan (parameters
    worked out once); it must still read and write its own arrays: fresh inputs, held to the reference."""
    shapes = (2, 3, 333, 64), (2, 3, 400, 64), (2, 3, 400, 64)
    _run(*_random_problem(rng, *shapes, dtype), causal=True)
    planned = set(plans.entries("plan"))
    q, k, v, dout = _random_problem(rng, *shapes, dtype)
    results = _run(q, k, v, dout, causal=True)
    assert set(plans.entries("plan")) == planned, "the second call should have found both of its plans"
    assert_matches_reference(q, k, v, dout, results, causal=True)


def test_non_default_stream(rng):
    """On a non-blocking stream the kernels run there and give the default stream's bits."""
    q, k, v, dout = _random_problem(rng, (2, 3, 300, 64), (2, 3, 400, 64), (2, 3, 400, 64), np.float16)
    on_default = _run(q, k, v, dout, causal=True)
    cupy.cuda.Device().synchronize()  # a non-blocking stream does not wait for the default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
        on_stream = (out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True))
    stream.synchronize()
    assert_bitwise_equal(on_stream, on_default)


def test_backward_joins_its_second_stream(rng):
    """The backward's dQ pass runs on a second stream beside the dK/dV pass and must join the caller's
    stream before the call returns: under CUDA graph capture an unjoined stream is an error, and replaying
    the captured call gives the eager call's bits."""
    q, k, v, dout = _random_problem(rng, (2, 3, 300, 64), (2, 3, 400, 64), (2, 3, 400, 64), ml_dtypes.bfloat16)
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    eager = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)  # the pool then has blocks to reuse
        stream.begin_capture()
        captured = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        graph = stream.end_capture()
        graph.launch()
    stream.synchronize()
    assert_bitwise_equal(captured, eager)


def test_a_captured_forward_keeps_its_plan(rng, monkeypatch):
    """A forward captured in a CUDA graph pins its plan in the plan cache (the warp-specialized forward's tile
    counter lives there and the graph replays its address): filling the cache past its limit evicts other plans,
    and the graph still replays the eager call's bits."""
    q, k, v, _ = _random_problem(rng, (2, 3, 300, 64), (2, 3, 400, 64), (2, 3, 400, 64), ml_dtypes.bfloat16)
    eager = cupyflash.attention_forward(q, k, v, causal=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupyflash.attention_forward(q, k, v, causal=True)  # planned, and the counter made, outside the capture
        stream.begin_capture()
        captured = cupyflash.attention_forward(q, k, v, causal=True)
        graph = stream.end_capture()
    held = [entry for entry in plans.entries().values() if getattr(entry, "pinned", False)]
    if not any(getattr(entry, "tile_counters", None) for entry in held):
        pytest.skip("this GPU runs the forward without a tile counter (not the warp-specialized kernel)")
    monkeypatch.setattr(plans, "LIMIT", len(plans.entries()) + 2)
    fillers = [("filler", "test", i) for i in range(len(plans.entries()) + 4)]
    for key in fillers:
        plans.put(key, SimpleNamespace(pinned=False))
    assert all(any(entry is kept for kept in plans.entries().values()) for entry in held)
    for key in fillers:
        plans.discard(key)
    with stream:
        for _ in range(2):
            graph.launch()
    stream.synchronize()
    assert_bitwise_equal(captured, eager)


def test_rows_that_see_no_key_are_zero(rng):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key: out 0, lse -inf, dq 0, never NaN."""
    nq, nk = 300, 100
    q, k, v, dout = _random_problem(rng, (2, nq, 64), (2, nk, 64), (2, nk, 64), np.float16)
    out, lse, dq, dk, dv = _run(q, k, v, dout, causal=True)
    assert_rows_without_keys_are_zero(out, lse, dq, dk, dv, nq - nk)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch, nq, nk", [((2, 3), 0, 5), ((2, 3), 4, 0), ((0, 3), 4, 5), ((2, 0), 4, 5), ((2, 3), 0, 0)]
)
def test_empty_problems(rng, batch, nq, nk, causal):
    """Empty batch or sequences: correctly shaped CuPy zeros (lse -inf where Nk == 0)."""
    q, k, v, dout = _random_problem(rng, batch + (nq, 8), batch + (nk, 8), batch + (nk, 6), np.float16)
    out, lse, dq, dk, dv = _run(q, k, v, dout, causal=causal)
    assert all(isinstance(x, cupy.ndarray) for x in (out, lse, dq, dk, dv))
    assert (out.shape, out.dtype) == (batch + (nq, 6), np.float16)
    assert (lse.shape, lse.dtype) == (batch + (nq,), np.float32)
    assert not out.any() and cupy.isneginf(lse).all()
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert (g.shape, g.dtype) == (x.shape, x.dtype) and not g.any()


def test_mixing_numpy_and_cupy_is_an_error(rng):
    q, k, v, _ = _random_problem(rng, (4, 8), (5, 8), (5, 8), np.float16)
    with pytest.raises(TypeError, match="cannot mix NumPy and CuPy arrays .*k is numpy"):
        cupyflash.attention(q, k.get(), v)


def test_reference_rejects_cupy_arrays(rng):
    q, k, v, _ = _random_problem(rng, (4, 8), (5, 8), (5, 8), np.float32)
    with pytest.raises(TypeError, match=r"q is a CuPy array; .* pass q.get\(\)"):
        reference.attention(q, k, v)


def test_input_on_another_device(rng):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    q, k, v, _ = _random_problem(rng, (4, 8), (5, 8), (5, 8), np.float16)
    current = cupy.cuda.Device().id
    other = (current + 1) % cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(other):
        k_elsewhere = cupy.asarray(k.get())
    with pytest.raises(ValueError, match=f"k is on device {other} but the current device is {current}"):
        cupyflash.attention(q, k_elsewhere, v)
