"""Dense calls on a layout that an earlier call had checked skip the checks (their call entries in the plan
cache, cupyflash/_cuda/plans.py).
Their results must be bitwise those of the checked path on the same arrays, every output element written,
and every error of the checks must still reach the caller."""

import collections
import contextlib

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_bitwise_equal
from helpers.gpu import nan_filled_allocations

import cupyflash
from cupyflash._cuda import launch, plans

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bhnd(rng, dtype, q_shape, kv_shape):
    def make(shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    return make(q_shape), make(kv_shape), make(kv_shape)


def _qkv_views(rng, dtype, batch, n, heads, d):
    """Strided (B, H, N, D) views of one (B, N, 3, H, D) tensor, as a model's qkv projection gives them."""
    qkv = cupy.asarray(rng.standard_normal((batch, n, 3, heads, d), dtype=np.float32).astype(dtype))
    return tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


# name -> (inputs from an rng, options, whether the layout may take the fast path on every GPU)
CASES = {
    "bf16 causal": (lambda rng: _bhnd(rng, BF16, (2, 3, 200, 64), (2, 3, 200, 64)), dict(causal=True), True),
    "qkv views": (lambda rng: _qkv_views(rng, BF16, 2, 257, 4, 64), dict(causal=True), True),
    "gqa broadcast": (lambda rng: _bhnd(rng, np.float16, (1, 2, 3, 150, 64), (1, 2, 1, 150, 64)), {}, True),
    "window softcap scale": (
        lambda rng: _bhnd(rng, np.float16, (2, 2, 300, 32), (2, 2, 280, 32)),
        dict(window=(48, 0), softcap=20.0, scale=0.3),
        True,
    ),
    "dropout": (lambda rng: _bhnd(rng, BF16, (2, 2, 190, 64), (2, 2, 190, 64)), dict(dropout_p=0.2), True),
    "d128 (warp-specialized forward on Hopper)": (
        lambda rng: _bhnd(rng, BF16, (1, 4, 384, 128), (1, 4, 384, 128)),
        dict(causal=True),
        True,
    ),
    "float64": (lambda rng: _bhnd(rng, np.float64, (2, 2, 100, 32), (2, 2, 90, 32)), {}, True),
    "float32 (float16 pieces on Hopper)": (
        lambda rng: _bhnd(rng, np.float32, (2, 2, 100, 64), (2, 2, 100, 64)),
        dict(causal=True),
        False,
    ),
}


@contextlib.contextmanager
def _counting_fast_calls():
    taken = []
    run = launch.Call.run

    def counted(self, inputs, dropout_seed):
        result = run(self, inputs, dropout_seed)
        taken.append(result is not None)
        return result

    launch.Call.run = counted
    try:
        yield taken
    finally:
        launch.Call.run = run


def _both_passes(q, k, v, dout, options, seed):
    extra = dict(dropout_seed=seed) if "dropout_p" in options else {}
    out, lse = cupyflash.attention_forward(q, k, v, **options, **extra)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **options, **extra)
    return (out, lse) + tuple(grads)


@pytest.mark.parametrize("case", CASES)
def test_fast_calls_match_checked_calls(rng, case):
    make, options, always_fast = CASES[case]
    plans.clear()
    first = make(rng)
    out, _ = cupyflash.attention_forward(*first, **options, **(dict(dropout_seed=1) if "dropout_p" in options else {}))
    dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(out.dtype))
    _both_passes(*first, dout, options, seed=1)  # checked calls: the layout is now known
    known = len(plans.entries("call"))

    second = make(rng)  # new arrays (new addresses) of the same layout, a new dropout seed
    with _counting_fast_calls() as taken, nan_filled_allocations():
        fast = _both_passes(*second, dout, options, seed=2)
    if always_fast:
        assert known == 2 and taken == [True, True], "the second call of a layout should skip the checks"
    plans.clear()
    with _counting_fast_calls() as taken, nan_filled_allocations():
        checked = _both_passes(*second, dout, options, seed=2)
    assert taken == []
    assert_bitwise_equal(fast, checked, names=("out", "lse", "dq", "dk", "dv"))
    for x in fast:
        assert not bool(cupy.isnan(x).any())


def test_public_attention_draws_seeds_through_the_fast_path(rng):
    q, k, v = _bhnd(rng, BF16, (1, 2, 128, 64), (1, 2, 128, 64))
    plans.clear()
    cupyflash.attention(q, k, v, dropout_p=0.5)
    with _counting_fast_calls() as taken:
        a, b = (cupyflash.attention(q, k, v, dropout_p=0.5) for _ in range(2))
    assert taken == [True, True]
    assert not bool(cupy.array_equal(a, b)), "each call draws its own dropout seed"


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(causal=1), TypeError, "causal"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(dropout_p=0.1), ValueError, "dropout_seed"),
        (dict(dropout_p=1.5, dropout_seed=3), ValueError, "dropout_p"),
        (dict(dropout_seed=-1), ValueError, "dropout_seed"),
        (dict(dropout_seed=2**64), ValueError, "dropout_seed"),
        (dict(dropout_seed=True), TypeError, "dropout_seed"),
        (dict(window=(-2, 0)), ValueError, "window"),
        (dict(softcap=-1.0), ValueError, "softcap"),
    ],
)
def test_checks_still_raise_on_a_known_layout(rng, change, error, match):
    q, k, v = _bhnd(rng, BF16, (2, 2, 64, 64), (2, 2, 64, 64))
    out, lse = cupyflash.attention_forward(q, k, v)
    dout = cupy.ones_like(out)
    cupyflash.attention_backward(dout, q, k, v, out, lse)
    with pytest.raises(error, match=match):
        cupyflash.attention_forward(q, k, v, **change)
    with pytest.raises(error, match=match):
        cupyflash.attention_backward(dout, q, k, v, out, lse, **change)


def test_changed_arrays_on_a_known_layout_are_checked(rng):
    q, k, v = _bhnd(rng, BF16, (2, 2, 64, 64), (2, 2, 64, 64))
    out, lse = cupyflash.attention_forward(q, k, v)
    dout = cupy.ones_like(out)
    cupyflash.attention_backward(dout, q, k, v, out, lse)
    with pytest.raises(TypeError, match="dtype"):
        cupyflash.attention_forward(q, k, v.astype(np.float16))
    with pytest.raises(ValueError, match="lse"):
        cupyflash.attention_backward(dout, q, k, v, out, lse[:, :, :-1])
    with pytest.raises(TypeError, match="mix NumPy and CuPy"):
        cupyflash.attention_forward(q, k, cupy.asnumpy(v))
    # An unaligned view of the same shape and strides: copied to aligned rows, still exact.
    storage = cupy.zeros(q.size + 1, dtype=q.dtype)
    shifted = storage[1:].reshape(q.shape)
    shifted[...] = q
    assert_bitwise_equal(
        cupyflash.attention_forward(shifted, k, v), cupyflash.attention_forward(q, k, v), names=("out", "lse")
    )


def test_outputs_of_one_allocation_outlive_each_other(rng):
    q, k, v = _bhnd(rng, np.float16, (1, 2, 96, 64), (1, 2, 96, 64))
    out, lse = cupyflash.attention_forward(q, k, v)
    dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(np.float16))
    expected = [x.copy() for x in cupyflash.attention_backward(dout, q, k, v, out, lse)]
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse)  # the fast path
    del dq, dv
    cupy.full((1 << 20,), 7, dtype=np.float16)  # new allocations must not land on dk's memory
    assert_bitwise_equal([dk], [expected[1]], names=("dk",))


def test_a_window_of_a_tuple_subclass_is_checked_every_time(rng):
    # A namedtuple window compares equal to another of other element types: no key is built for it.
    Window = collections.namedtuple("Window", "left right")
    q, k, v = _bhnd(rng, BF16, (1, 2, 64, 64), (1, 2, 64, 64))
    cupyflash.attention_forward(q, k, v, window=Window(5, 0))
    with pytest.raises(TypeError, match="window"):
        cupyflash.attention_forward(q, k, v, window=Window(5.0, 0))


def test_broadcast_gradients_do_not_stay_alive_with_dq(rng):
    # k and v shared by 8 query heads: the backward computes full-size dk and dv and sums them. The full ones
    # live in the call's scratch allocation, which the pool gets back; dq's holds dq alone.
    q, k, v = _bhnd(rng, np.float16, (1, 2, 8, 256, 64), (1, 2, 1, 256, 64))
    out, lse = cupyflash.attention_forward(q, k, v)
    dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(np.float16))
    expected = [x.copy() for x in cupyflash.attention_backward(dout, q, k, v, out, lse)]  # checked; then known
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    with _counting_fast_calls() as taken:
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse)
    cupy.cuda.Device().synchronize()
    held = pool.used_bytes() - before
    assert taken == [True]
    assert held <= sum(g.nbytes for g in grads) + 3 * 512, (held, [g.nbytes for g in grads])
    assert_bitwise_equal(grads, expected, names=("dq", "dk", "dv"))


def test_a_known_layout_captured_in_a_cuda_graph(rng):
    # The fast path under stream capture: its allocations come from the capturing allocator (a private pool
    # that lives as long as the graph) and its launches are recorded; replays on new inputs give the results
    # of eager calls on them.
    q, k, v = _bhnd(rng, BF16, (2, 2, 160, 64), (2, 2, 160, 64))
    dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(BF16))
    stream = cupy.cuda.Stream(non_blocking=True)
    graph_pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(graph_pool.malloc), stream:
        warm = _both_passes(q, k, v, dout, dict(causal=True), seed=None)  # checked: the layout is now known
        del warm
        stream.synchronize()
        with _counting_fast_calls() as taken:
            stream.begin_capture()
            try:
                captured = _both_passes(q, k, v, dout, dict(causal=True), seed=None)
            finally:
                graph = stream.end_capture()
    assert taken == [True, True]
    for _ in range(2):
        for x in (q, k, v, dout):
            x.set(rng.standard_normal(x.shape, dtype=np.float32).astype(BF16))
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        eager = _both_passes(q, k, v, dout, dict(causal=True), seed=None)
        assert_bitwise_equal(captured, eager, names=("out", "lse", "dq", "dk", "dv"))
