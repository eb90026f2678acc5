"""The plan cache (cupyflash/_cuda/plans.py) and its call entries (launch.Call), without a GPU.

What this file proves: NumPy calls never build a key and never touch the cache; a key holds each option by value
and type and each array by shape, strides, dtype, alignment and device (checked with stand-in CuPy arrays); a
``Call`` lays the outputs it returns out in one allocation, and the backward's workspaces in another, at 256-byte
aligned offsets, without overlap or waste beyond the alignment; a call's dropout seed gives exactly the checked
path's round keys, and a seed that the checks reject sends the call back to them before anything is allocated or
launched; the cache keeps at most LIMIT entries, the oldest unpinned going first, makes a plan once however many
threads ask, and passes over keys it cannot hold. Running a ``Call`` needs a GPU: tests/gpu/test_gpu_fast_path.py.
"""

import math
import threading
import types

import numpy as np
import pytest

import cupyflash
from cupyflash._cuda import dense, launch, plans
from cupyflash._dropout import SEED_LIMIT, Dropout
from cupyflash._fp8 import api as fp8_api

# (options as keywords of attention_forward) the fast path keys on
OPTIONS = [{}, dict(causal=True, scale=0.3), dict(window=(5, 0), softcap=12.5), dict(dropout_p=0.25, dropout_seed=11)]


class StandInPlan:
    """What Call reads of a launch plan: the parameter words of the named addresses, and no tensor maps.
    It cannot launch: a Call that reached the GPU here would raise."""

    tensor_maps = None

    def __init__(self):
        self.asked = []

    def slots(self, names):
        self.asked.append(tuple(names))
        return [3 * i + 1 for i in range(len(names))]


def _options(options):
    """The options of a dense call's key, as the API builds it."""
    return (
        options.get("causal", False),
        options.get("scale"),
        options.get("window"),
        options.get("softcap", 0.0),
        options.get("dropout_p", 0.0),
        type(options.get("dropout_seed")),
    )


def _nbytes(shape, dtype):
    return math.prod(shape) * np.dtype(dtype).itemsize


# ---------------------------------------------------------------------------------------------------
# NumPy calls stay off the fast path
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_arrays_have_no_key(rng, options):
    q, k, v = (rng.standard_normal((2, 3, n, 24)).astype(np.float16) for n in (37, 53, 53))
    assert plans.key("call", "fwd", (q, k, v), _options(options)) is None
    dout, out, lse = q.copy(), q.copy(), np.zeros((2, 3, 37), np.float32)
    assert plans.key("call", "bwd", (dout, q, k, v, out, lse), _options(options)) is None


def test_a_mix_of_arrays_has_no_key(rng):
    # Any argument that is not exactly a cupy.ndarray rules the call out; CuPy arrays themselves need a GPU,
    # so the mix here is NumPy with a NumPy subclass and a nested list.
    q = rng.standard_normal((1, 2, 19, 16)).astype(np.float32)
    masked = np.ma.masked_array(q.copy())
    listed = q.tolist()
    for arrays in ((q, masked, listed), (masked, q, q), (listed, q, q), (q, q, masked)):
        assert plans.key("call", "fwd", arrays, (False, None, None, 0.0, 0.0, type(None))) is None


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_calls_leave_the_plan_cache_alone(rng, options):
    # The cache holds GPU launch plans only: a NumPy call neither adds to it nor reorders it.
    q, k, v = (rng.standard_normal((2, 3, n, 24)).astype(np.float32) for n in (37, 53, 53))
    before = list(plans._entries.items())
    out, lse = cupyflash.attention_forward(q, k, v, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, **options)
    assert isinstance(out, np.ndarray) and isinstance(dq, np.ndarray)
    assert (out.shape, lse.shape, dq.shape, dk.shape, dv.shape) == (q.shape, q.shape[:-1], q.shape, k.shape, v.shape)
    assert list(plans._entries.items()) == before


# ---------------------------------------------------------------------------------------------------
# Call: one allocation for all outputs
# ---------------------------------------------------------------------------------------------------

# name -> (names, outputs, returned), with awkward shapes whose byte sizes are no multiples of 256
CALLS = {
    "forward": (launch.FORWARD_NAMES, [((3, 5, 77, 40), np.float16), ((3, 5, 77), np.float32)], 2),
    "backward": (
        launch.BACKWARD_NAMES,
        [
            ((3, 5, 77, 40), np.float16),
            ((3, 5, 133, 40), np.float16),
            ((3, 5, 133, 24), np.float16),
            ((3, 5, 77), np.float32),
            ((3, 5, 77), np.float32),
        ],
        3,
    ),
    "float64 forward, one row": (launch.FORWARD_NAMES, [((1, 1, 1, 8), np.float64), ((1, 1, 1), np.float64)], 2),
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
    call = launch.Call(plan, names, outputs, returned, 0.0)
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
    call = launch.Call(StandInPlan(), names, outputs, returned, 0.0, scratch=(1, 2))
    assert [place for place, _ in call.places] == [0, 1, 1, 1, 1]
    _assert_packed(_offsets(call, 0), call.nbytes, outputs[:1])
    _assert_packed(_offsets(call, 1), call.workspace_nbytes, outputs[1:])


def test_output_offsets_of_a_forward_in_bytes():
    # out: 3*5*77*40 float16 = 92400 bytes -> 92416 (361 * 256); lse: 4620 bytes -> 4864
    _, outputs, returned = CALLS["forward"]
    call = launch.Call(StandInPlan(), launch.FORWARD_NAMES, outputs, returned, 0.0)
    assert call.places == [(0, 0), (0, 92416)] and call.nbytes == 92416 + 4864 and call.workspace_nbytes == 0


@pytest.mark.parametrize("seed", [None, -1, SEED_LIMIT])
def test_a_call_with_a_rejected_seed_returns_before_allocating(monkeypatch, seed):
    # Without CuPy any allocation would raise, and the stand-in plan cannot launch: returning None proves the
    # call went back to the checks (which raise) before either.
    monkeypatch.setattr(launch, "cupy", None)
    names, outputs, returned = CALLS["forward"]
    assert launch.Call(StandInPlan(), names, outputs, returned, 0.2).run([], seed) is None
    if seed is not None:  # with p = 0 the seed is still checked
        assert launch.Call(StandInPlan(), names, outputs, returned, 0.0).run([], seed) is None


# ---------------------------------------------------------------------------------------------------
# _round_keys: the dropout seed
# ---------------------------------------------------------------------------------------------------


def _call_with(p):
    return types.SimpleNamespace(dropout_p=p)


def test_no_dropout_needs_no_keys():
    assert launch._round_keys(_call_with(0.0), None) is None
    assert launch._round_keys(_call_with(0.0), 12345) is None  # a valid seed without dropout: still none


def test_dropout_without_a_seed_goes_to_the_checks():
    # False, not None: the checked path raises "needs an integer dropout_seed".
    assert launch._round_keys(_call_with(0.3), None) is False


@pytest.mark.parametrize("seed", [-1, -(2**63), SEED_LIMIT, SEED_LIMIT + 12345, 2**80, np.int64(-7)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_seeds_out_of_range_go_to_the_checks(seed, p):
    assert launch._round_keys(_call_with(p), seed) is False


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
            keys = launch._round_keys(_call_with(p), seed)
            assert keys == Dropout(p, int(seed)).round_keys, (p, seed)
            assert len(keys) == 20 and all(0 <= w < 2**32 for w in keys)
    # different seeds, different keys (the key schedule is not constant)
    assert launch._round_keys(_call_with(0.1), 1) != launch._round_keys(_call_with(0.1), 2)


# ---------------------------------------------------------------------------------------------------
# keep_call, put and get: the cache's bounds
# ---------------------------------------------------------------------------------------------------


def _layout(i):
    """A stand-in call key, hashable like the real ones."""
    return (
        "call",
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
    """An empty plan cache, the real one left as it was."""
    fresh = {}
    monkeypatch.setattr(plans, "_entries", fresh)
    return fresh


def test_the_oldest_entry_goes_past_the_limit(table, monkeypatch):
    monkeypatch.setattr(plans, "LIMIT", 3)
    outputs = CALLS["forward"][1]
    for i in range(5):
        launch.keep_call(_layout(i), StandInPlan(), launch.FORWARD_NAMES, outputs, None)
        assert len(table) == min(i + 1, 3)
    assert list(table) == [_layout(2), _layout(3), _layout(4)]
    assert plans.get(_layout(0)) is None and plans.get(_layout(1)) is None
    assert plans.get(_layout(4)) is table[_layout(4)]
    # A known layout is neither replaced nor moved, and evicts nothing.
    kept = table[_layout(2)]
    launch.keep_call(_layout(2), StandInPlan(), launch.FORWARD_NAMES, outputs, None)
    assert list(table) == [_layout(2), _layout(3), _layout(4)] and table[_layout(2)] is kept


def test_keep_call_keeps_what_each_direction_returns(table):
    plan = StandInPlan()
    launch.keep_call(_layout(0), plan, launch.FORWARD_NAMES, CALLS["forward"][1], None)
    launch.keep_call(_layout(1), plan, launch.BACKWARD_NAMES, CALLS["backward"][1], Dropout(0.25, 7))
    forward, backward = table[_layout(0)], table[_layout(1)]
    assert forward.plan is plan and len(forward.returned) == 2 and _offsets(forward, 0) == [0, 92416]
    assert forward.dropout_p == 0.0
    assert len(backward.returned) == 3 and len(_offsets(backward, 0)) == 3  # dq, dk, dv
    assert len(_offsets(backward, 1)) == 2  # lse_log2, delta
    assert backward.dropout_p == 0.25
    assert plan.asked == [launch.FORWARD_NAMES, launch.BACKWARD_NAMES]


def test_keys_the_table_cannot_hold_are_passed_over(table):
    # A window given as a list makes the key unhashable: such calls always take the checked path.
    unhashable = _layout(0)[:6] + ([48, 0],) + _layout(0)[7:]
    launch.keep_call(unhashable, StandInPlan(), launch.FORWARD_NAMES, CALLS["forward"][1], None)
    launch.keep_call(None, StandInPlan(), launch.FORWARD_NAMES, CALLS["forward"][1], None)
    assert table == {}
    assert plans.get(unhashable) is None and plans.get(None) is None
    assert plans.get(_layout(1)) is None  # hashable but unknown


def test_fp8_holders_on_numpy_have_no_key():
    """The FP8 forward's call key: None for NumPy holders (the CPU path has no plan) and for anything but holders."""
    x8 = cupyflash.quantize_fp8(np.ones((2, 16, 64), np.float32))
    assert fp8_api.call_key(x8, x8, x8, False, None, None) is None
    assert x8._kept == {"layout": None}  # found once, kept with the holder
    assert fp8_api.call_key(x8, x8, x8, False, None, None) is None
    assert fp8_api.call_key(x8.data, x8, x8, False, None, None) is None
    assert fp8_api.call_key(x8, x8, x8.data, False, None, None) is None


# ---------------------------------------------------------------------------------------------------
# The key: one rule for every family
# ---------------------------------------------------------------------------------------------------


class StandInArray:
    """What plans.key reads of a CuPy array: shape, strides, dtype, and the address and device of its memory."""

    def __init__(self, shape, dtype=np.float16, ptr=4096, device=0):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.strides = tuple(int(math.prod(shape[i + 1 :])) * self.dtype.itemsize for i in range(len(shape)))
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)


@pytest.fixture
def stand_in_cupy(monkeypatch):
    """plans.key with StandInArray as CuPy's array type, on device 3."""
    runtime = types.SimpleNamespace(getDevice=lambda: 3)
    monkeypatch.setattr(
        plans, "cupy", types.SimpleNamespace(ndarray=StandInArray, cuda=types.SimpleNamespace(runtime=runtime))
    )
    monkeypatch.delenv("CUPYFLASH_NO_WGMMA", raising=False)


def test_a_key_holds_each_array_by_layout_not_address(stand_in_cupy):
    q = StandInArray((2, 3, 37, 24))
    base = plans.key("call", "fwd", (q, q, q), (False, None))
    # the same layout elsewhere in memory (same address modulo 16): the same key
    moved = StandInArray((2, 3, 37, 24), ptr=4096 + 256 * 1001)
    assert plans.key("call", "fwd", (moved, moved, moved), (False, None)) == base
    # anything a plan depends on: another key
    for other in (
        StandInArray((2, 3, 38, 24)),  # shape
        StandInArray((2, 3, 37, 24), np.float32),  # dtype
        StandInArray((2, 3, 37, 24), ptr=4096 + 8),  # alignment
        StandInArray((2, 3, 37, 24), device=1),  # the array's device
    ):
        assert plans.key("call", "fwd", (q, other, q), (False, None)) != base
    transposed = StandInArray((2, 3, 37, 24))
    transposed.strides = (2 * 3 * 37 * 24 * 2, 2, 3 * 24 * 2, 3 * 2)  # strides alone
    assert plans.key("call", "fwd", (q, q, transposed), (False, None)) != base
    # role, family and the current device
    assert plans.key("plan", "fwd", (q, q, q), (False, None)) != base
    assert plans.key("call", "bwd", (q, q, q), (False, None)) != base
    assert base[-2:] == (3, "")


def test_a_key_holds_each_option_by_value_and_type(stand_in_cupy, monkeypatch):
    q = StandInArray((1, 2, 16, 64))

    def key(*options):
        return plans.key("call", "fwd", (q,), options)

    # equal values of other types would pass other checks (causal=1 is rejected; a float window too)
    assert key(True) != key(1) and key(0.5) != key(np.float32(0.5)) and key(None) != key(0)
    assert key((4, 0)) != key((4.0, 0)) and key((4, 0)) != key((np.int64(4), 0))
    assert key((4, 0)) == key((4, 0)) and hash(key((4, 0))) == hash(key((4, 0)))
    assert key([4, 0]) is not None and plans.get(key([4, 0])) is None  # unhashable: never found, never kept
    # a None array, and the environment switch that changes the variant a call takes
    assert plans.key("call", "decode", (q, None), ()) != plans.key("call", "decode", (None, q), ())
    before = key(True)
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    assert key(True) != before


def test_anything_but_a_cupy_array_has_no_key(stand_in_cupy, rng):
    q = StandInArray((1, 2, 16, 64))
    for other in (np.zeros((1, 2, 16, 64), np.float16), [[0.0]], 3, "q"):
        assert plans.key("call", "fwd", (q, other, q), ()) is None
    assert plans.array_key(q) == ((1, 2, 16, 64), q.strides, np.dtype(np.float16), 0, 0)
    assert plans.array_key(np.zeros(3)) is None


def test_pinned_entries_are_never_evicted(table, monkeypatch):
    monkeypatch.setattr(plans, "LIMIT", 3)
    pinned = types.SimpleNamespace(pinned=True)
    plans.put(_layout(0), pinned)
    for i in range(1, 6):
        plans.put(_layout(i), types.SimpleNamespace(pinned=False))
    assert list(table) == [_layout(0), _layout(4), _layout(5)] and table[_layout(0)] is pinned
    # a cache of pinned entries only grows past its limit rather than drop a graph's workspace
    monkeypatch.setattr(plans, "LIMIT", 1)
    plans.put(_layout(6), types.SimpleNamespace(pinned=True))
    assert _layout(0) in table and _layout(6) in table


def test_a_call_entry_is_pinned_with_its_plan(table, monkeypatch):
    """A call entry holds its plan (and the plan its graph-captured memory): it stays while the plan is pinned."""
    from cupyflash._cuda import launch

    monkeypatch.setattr(plans, "LIMIT", 2)
    call = object.__new__(launch.Call)
    call.plan = types.SimpleNamespace(pinned=False)
    plans.put(_layout(0), call)
    call.plan.pinned = True  # (the plan's first launch under a capture)
    for i in range(1, 4):
        plans.put(_layout(i), types.SimpleNamespace(pinned=False))
    assert _layout(0) in table and table[_layout(0)] is call


def test_a_plan_is_made_once_however_many_threads_ask(table):
    made = []
    gate = threading.Barrier(8)

    def make():
        made.append(1)
        return types.SimpleNamespace(pinned=False)

    results = []

    def ask():
        gate.wait()
        results.append(plans.get_or_make(_layout(7), make))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(r is results[0] for r in results) and table[_layout(7)] is results[0]


def test_entries_by_role_and_family(table):
    plans.put(("plan", "fwd", 1), "a")
    plans.put(("call", "fwd", 1), "b")
    plans.put(("plan", "decode", 1), "c")
    assert plans.entries("plan") == {("plan", "fwd", 1): "a", ("plan", "decode", 1): "c"}
    assert plans.entries(family="fwd") == {("plan", "fwd", 1): "a", ("call", "fwd", 1): "b"}
    assert plans.entries("call", "decode") == {}
    plans.discard(("plan", "fwd", 1))
    assert len(table) == 2
    plans.clear()
    assert table == {}


def test_modifier_arrays_are_never_planned():
    # bias, mask and block_mask are per-element arrays read in place: their calls take the full route each time.
    for name in ("bias", "mask", "block_mask"):
        mods = types.SimpleNamespace(bias=None, mask=None, block_mask=None, window=None, softcap=0.0)
        setattr(mods, name, np.zeros((1, 1, 4, 4)))
        assert dense.plan_key("fwd", {}, 0.5, False, mods, None, np.dtype(np.float16)) is None


def test_decoding_calls_on_numpy_have_no_key(rng):
    from cupyflash._cuda import decode

    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    cache = rng.standard_normal((2, 2, 64, 32)).astype(np.float32)
    args = (q, cache, cache, None, None, 5, None, None, None, False, True, None, None, 0.0, None, 0, False)
    assert decode.call_key(*args) is None


def test_driver_launches_are_the_driver_arguments_of_each_launch():
    # Grids come as (x, y, z) and blocks as (threads,): the driver takes three of each, the function's handle
    # first and the dynamic shared memory last.
    function = types.SimpleNamespace(ptr=0xDEAD0)
    launches = [(function, (7, 3, 2), (384,), 99 * 1024), (function, (132,), (128, 2), 0)]
    assert launch.driver_launches(launches) == [
        (0xDEAD0, 7, 3, 2, 384, 1, 1, 99 * 1024),
        (0xDEAD0, 132, 1, 1, 128, 2, 1, 0),
    ]


def test_a_call_without_a_key_gets_its_own_entry_kept_nowhere(table):
    # An array the key rule does not describe (a cupy.ndarray subclass) has no key: each such call must make
    # its own plan, never share the one a previous keyless call made.
    made = iter(["first", "second"])
    assert plans.get_or_make(None, lambda: next(made)) == "first"
    assert plans.get_or_make(None, lambda: next(made)) == "second"
    assert plans.get_or_make(("call", "fwd", [1, 2]), lambda: "unhashable") == "unhashable"
    assert table == {}


def test_keys_whose_hash_raises_value_error_are_passed_over(table):
    # A writable memoryview hashes with a ValueError, not a TypeError.
    key = ("call", "fwd", memoryview(bytearray([3, 0])))
    assert plans.get(key) is None
    plans.put(key, "entry")
    assert table == {}


def test_only_plain_tuple_windows_reach_a_call_key():
    # A window of another type may change in place (its hash and equality by identity): such calls take the
    # checks every time.
    from cupyflash._api import _plain_window

    class Window:
        def __init__(self, left, right):
            self.values = [left, right]

        def __iter__(self):
            return iter(self.values)

        def __len__(self):
            return 2

    assert _plain_window(None) and _plain_window((3, 0))
    assert not _plain_window([3, 0]) and not _plain_window(Window(3, 0)) and not _plain_window(np.array([3, 0]))
