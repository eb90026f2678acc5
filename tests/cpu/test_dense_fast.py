"""The host side of the dense fast path (cupyflash/_cuda/dense_fast.py), without a GPU.

What this file proves: NumPy calls never build a layout key and never touch the table of known layouts; a ``_Call``
lays the outputs it returns out in one allocation, and the backward's workspaces in another, at 256-byte aligned
offsets, without overlap or waste beyond the alignment; a call's dropout seed gives exactly the checked path's round
keys, and a seed that the checks reject sends the call back to them before anything is allocated or launched; the
table keeps at most MAX_LAYOUTS layouts, the oldest going first, and passes over keys it cannot hold. Building a key
from CuPy arrays, and running a ``_Call``, need a GPU: tests/gpu/test_gpu_fast_path.py.
"""

import math
import types

import numpy as np
import pytest

import cupyflash
from cupyflash._cuda import dense_fast
from cupyflash._dropout import SEED_LIMIT, Dropout

# (options as keywords of attention_forward) the fast path keys on
OPTIONS = [{}, dict(causal=True, scale=0.3), dict(window=(5, 0), softcap=12.5), dict(dropout_p=0.25, dropout_seed=11)]


class StandInPlan:
    """What _Call reads of a launch plan: the parameter words of the named addresses, and no tensor maps.
    It cannot launch: a _Call that reached the GPU here would raise."""

    tensor_maps = None

    def __init__(self):
        self.asked = []

    def slots(self, names):
        self.asked.append(tuple(names))
        return [3 * i + 1 for i in range(len(names))]


def _options_key_args(options):
    return (
        options.get("causal", False),
        options.get("scale"),
        options.get("window"),
        options.get("softcap", 0.0),
        options.get("dropout_p", 0.0),
        options.get("dropout_seed"),
    )


def _nbytes(shape, dtype):
    return math.prod(shape) * np.dtype(dtype).itemsize


# ---------------------------------------------------------------------------------------------------
# NumPy calls stay off the fast path
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_arrays_have_no_key(rng, options):
    q, k, v = (rng.standard_normal((2, 3, n, 24)).astype(np.float16) for n in (37, 53, 53))
    assert dense_fast.key("fwd", (q, k, v), *_options_key_args(options)) is None
    dout, out, lse = q.copy(), q.copy(), np.zeros((2, 3, 37), np.float32)
    assert dense_fast.key("bwd", (dout, q, k, v, out, lse), *_options_key_args(options)) is None


def test_a_mix_of_arrays_has_no_key(rng):
    # Any argument that is not exactly a cupy.ndarray rules the call out; CuPy arrays themselves need a GPU,
    # so the mix here is NumPy with a NumPy subclass and a nested list.
    q = rng.standard_normal((1, 2, 19, 16)).astype(np.float32)
    masked = np.ma.masked_array(q.copy())
    listed = q.tolist()
    for arrays in ((q, masked, listed), (masked, q, q), (listed, q, q), (q, q, masked)):
        assert dense_fast.key("fwd", arrays, False, None, None, 0.0, 0.0, None) is None


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_calls_leave_the_layout_table_alone(rng, options):
    # The table holds GPU launch plans only: a NumPy call neither adds to it nor reorders it.
    q, k, v = (rng.standard_normal((2, 3, n, 24)).astype(np.float32) for n in (37, 53, 53))
    before = list(dense_fast._table.items())
    out, lse = cupyflash.attention_forward(q, k, v, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, **options)
    assert isinstance(out, np.ndarray) and isinstance(dq, np.ndarray)
    assert (out.shape, lse.shape, dq.shape, dk.shape, dv.shape) == (q.shape, q.shape[:-1], q.shape, k.shape, v.shape)
    assert list(dense_fast._table.items()) == before


# ---------------------------------------------------------------------------------------------------
# _Call: one allocation for all outputs
# ---------------------------------------------------------------------------------------------------

# name -> (names, outputs, returned), with awkward shapes whose byte sizes are no multiples of 256
CALLS = {
    "forward": (dense_fast.FORWARD_NAMES, [((3, 5, 77, 40), np.float16), ((3, 5, 77), np.float32)], 2),
    "backward": (
        dense_fast.BACKWARD_NAMES,
        [
            ((3, 5, 77, 40), np.float16),
            ((3, 5, 133, 40), np.float16),
            ((3, 5, 133, 24), np.float16),
            ((3, 5, 77), np.float32),
            ((3, 5, 77), np.float32),
        ],
        3,
    ),
    "float64 forward, one row": (dense_fast.FORWARD_NAMES, [((1, 1, 1, 8), np.float64), ((1, 1, 1), np.float64)], 2),
}


def _assert_packed(offsets, nbytes, arrays):
    """offsets at multiples of 256 from 0, each array ending before the next begins with less than 256 bytes
    between, and nbytes the span rounded up to 256."""
    sizes = [_nbytes(shape, dtype) for shape, dtype in arrays]
    assert len(offsets) == len(arrays)
    if not arrays:
        assert nbytes == 0
        return
    assert offsets[0] == 0 and all(offset % 256 == 0 for offset in offsets), offsets
    ends = [offset + size for offset, size in zip(offsets, sizes)]
    for i, end in enumerate(ends[:-1]):
        assert end <= offsets[i + 1] < end + 256, (i, offsets)
    assert ends[-1] <= nbytes < ends[-1] + 256 and nbytes % 256 == 0


def _offsets(call, which):
    """The byte offsets of the outputs that live in allocation ``which`` (0: the kept one, 1: scratch)."""
    return [offset for place, offset in call.places if place == which]


@pytest.mark.parametrize("case", CALLS)
def test_outputs_share_one_allocation_at_aligned_offsets(case):
    names, outputs, returned = CALLS[case]
    plan = StandInPlan()
    call = dense_fast._Call(plan, names, outputs, returned, 0.0)
    assert plan.asked == [tuple(names)] and call.slots == [3 * i + 1 for i in range(len(names))]
    assert call.maps is False  # no tensor maps: no q, k, v addresses to encode
    assert [place for place, _ in call.places] == [0] * returned + [1] * (len(outputs) - returned)
    _assert_packed(_offsets(call, 0), call.nbytes, outputs[:returned])  # returned: one allocation
    _assert_packed(_offsets(call, 1), call.workspace_nbytes, outputs[returned:])  # workspaces: another
    assert call.returned == [(shape, np.dtype(dtype)) for shape, dtype in outputs[:returned]]


def test_gradients_summed_after_the_call_go_to_the_scratch_allocation():
    # dk and dv of a key/value broadcast over query heads: the API sums them into smaller arrays, so the full
    # ones must not stay alive in dq's allocation.
    names, outputs, returned = CALLS["backward"]
    call = dense_fast._Call(StandInPlan(), names, outputs, returned, 0.0, scratch=(1, 2))
    assert [place for place, _ in call.places] == [0, 1, 1, 1, 1]
    _assert_packed(_offsets(call, 0), call.nbytes, outputs[:1])
    _assert_packed(_offsets(call, 1), call.workspace_nbytes, outputs[1:])


def test_output_offsets_of_a_forward_in_bytes():
    # out: 3*5*77*40 float16 = 92400 bytes -> 92416 (361 * 256); lse: 4620 bytes -> 4864
    _, outputs, returned = CALLS["forward"]
    call = dense_fast._Call(StandInPlan(), dense_fast.FORWARD_NAMES, outputs, returned, 0.0)
    assert call.places == [(0, 0), (0, 92416)] and call.nbytes == 92416 + 4864 and call.workspace_nbytes == 0


@pytest.mark.parametrize("seed", [None, -1, SEED_LIMIT])
def test_a_call_with_a_rejected_seed_returns_before_allocating(monkeypatch, seed):
    # Without CuPy any allocation would raise, and the stand-in plan cannot launch: returning None proves the
    # call went back to the checks (which raise) before either.
    monkeypatch.setattr(dense_fast, "cupy", None)
    names, outputs, returned = CALLS["forward"]
    assert dense_fast._Call(StandInPlan(), names, outputs, returned, 0.2).run([], seed) is None
    if seed is not None:  # with p = 0 the seed is still checked
        assert dense_fast._Call(StandInPlan(), names, outputs, returned, 0.0).run([], seed) is None


# ---------------------------------------------------------------------------------------------------
# _round_keys: the dropout seed
# ---------------------------------------------------------------------------------------------------


def _call_with(p):
    return types.SimpleNamespace(dropout_p=p)


def test_no_dropout_needs_no_keys():
    assert dense_fast._round_keys(_call_with(0.0), None) is None
    assert dense_fast._round_keys(_call_with(0.0), 12345) is None  # a valid seed without dropout: still none


def test_dropout_without_a_seed_goes_to_the_checks():
    # False, not None: the checked path raises "needs an integer dropout_seed".
    assert dense_fast._round_keys(_call_with(0.3), None) is False


@pytest.mark.parametrize("seed", [-1, -(2**63), SEED_LIMIT, SEED_LIMIT + 12345, 2**80, np.int64(-7)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_seeds_out_of_range_go_to_the_checks(seed, p):
    assert dense_fast._round_keys(_call_with(p), seed) is False


def test_valid_seeds_give_the_checked_paths_round_keys(rng):
    seeds = [
        0,
        1,
        2**32 - 1,
        2**32,
        SEED_LIMIT - 1,
        np.uint64(2**63 + 5),
        np.int64(2**62 + 3),
        int(rng.integers(0, 2**63)) * 2 + 1,
    ]
    for p in (0.1, 0.5, float(rng.uniform(0.01, 0.99))):
        for seed in seeds:
            keys = dense_fast._round_keys(_call_with(p), seed)
            assert keys == Dropout(p, int(seed)).round_keys, (p, seed)
            assert len(keys) == 20 and all(0 <= w < 2**32 for w in keys)
    # different seeds, different keys (the key schedule is not constant)
    assert dense_fast._round_keys(_call_with(0.1), 1) != dense_fast._round_keys(_call_with(0.1), 2)


# ---------------------------------------------------------------------------------------------------
# remember and lookup: the table of known layouts
# ---------------------------------------------------------------------------------------------------


def _layout(i):
    """A stand-in layout key, hashable like the real ones."""
    return (
        "fwd",
        0,
        "",
        False,
        None,
        None,
        0.0,
        0.0,
        bool,
        type(None),
        type(None),
        float,
        float,
        type(None),
        (2, 3, 37 + i, 24),
        (2304, 768, 48, 2),
        np.dtype(np.float16),
        0,
        0,
    )


@pytest.fixture
def table(monkeypatch):
    """An empty table of known layouts, the real one left as it was."""
    fresh = {}
    monkeypatch.setattr(dense_fast, "_table", fresh)
    return fresh


def test_the_oldest_layout_goes_past_max_layouts(table, monkeypatch):
    monkeypatch.setattr(dense_fast, "MAX_LAYOUTS", 3)
    outputs = CALLS["forward"][1]
    for i in range(5):
        dense_fast.remember(_layout(i), StandInPlan(), dense_fast.FORWARD_NAMES, outputs, None)
        assert len(table) == min(i + 1, 3)
    assert list(table) == [_layout(2), _layout(3), _layout(4)]
    assert dense_fast.lookup(_layout(0)) is None and dense_fast.lookup(_layout(1)) is None
    assert dense_fast.lookup(_layout(4)) is table[_layout(4)]
    # A known layout is neither replaced nor moved, and evicts nothing.
    kept = table[_layout(2)]
    dense_fast.remember(_layout(2), StandInPlan(), dense_fast.FORWARD_NAMES, outputs, None)
    assert list(table) == [_layout(2), _layout(3), _layout(4)] and table[_layout(2)] is kept


def test_remember_keeps_what_each_direction_returns(table):
    plan = StandInPlan()
    dense_fast.remember(_layout(0), plan, dense_fast.FORWARD_NAMES, CALLS["forward"][1], None)
    dense_fast.remember(_layout(1), plan, dense_fast.BACKWARD_NAMES, CALLS["backward"][1], Dropout(0.25, 7))
    forward, backward = table[_layout(0)], table[_layout(1)]
    assert forward.plan is plan and len(forward.returned) == 2 and _offsets(forward, 0) == [0, 92416]
    assert forward.dropout_p == 0.0
    assert len(backward.returned) == 3 and len(_offsets(backward, 0)) == 3  # dq, dk, dv
    assert len(_offsets(backward, 1)) == 2  # lse_log2, delta
    assert backward.dropout_p == 0.25
    assert plan.asked == [dense_fast.FORWARD_NAMES, dense_fast.BACKWARD_NAMES]


def test_keys_the_table_cannot_hold_are_passed_over(table):
    # A window given as a list makes the key unhashable: such calls always take the checked path.
    unhashable = _layout(0)[:5] + ([48, 0],) + _layout(0)[6:]
    dense_fast.remember(unhashable, StandInPlan(), dense_fast.FORWARD_NAMES, CALLS["forward"][1], None)
    dense_fast.remember(None, StandInPlan(), dense_fast.FORWARD_NAMES, CALLS["forward"][1], None)
    assert table == {}
    assert dense_fast.lookup(unhashable) is None and dense_fast.lookup(None) is None
    assert dense_fast.forward(unhashable, None, None, None, None) is None
    assert dense_fast.backward(None, None, None, None, None, None, None, None) is None
    assert dense_fast.lookup(_layout(1)) is None  # hashable but unknown


def test_fp8_holders_on_numpy_have_no_key():
    """The FP8 forward's key: None for NumPy holders (the CPU path has no plan) and for anything but holders."""
    x8 = cupyflash.quantize_fp8(np.ones((2, 16, 64), np.float32))
    assert dense_fast.fp8_key(x8, x8, x8, False, None, None) is None
    assert x8._kept == {"layout": None}  # found once, kept with the holder
    assert dense_fast.fp8_key(x8, x8, x8, False, None, None) is None
    assert dense_fast.fp8_key(x8.data, x8, x8, False, None, None) is None
    assert dense_fast.fp8_key(x8, x8, x8.data, False, None, None) is None
