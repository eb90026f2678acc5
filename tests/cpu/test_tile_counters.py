"""The warp-specialized forward's tile counters (cupyflash/_cuda/launch.py, Plan._tile_counter), without a
GPU: one per stream, since launches on two streams may run at once, and a new one per launch on the per-thread
default stream, whose single handle names a different stream in each thread. (The GPU tests in
tests/gpu/test_gpu_modifiers.py run the kernel on two streams.) CuPy is replaced by a stand-in."""

import threading
import types

import numpy as np
import pytest

from cupyflash._cuda import launch


class _FakeStream:
    capturing = set()  # the stream pointers under a CUDA-graph capture

    def __init__(self, ptr):
        self.ptr = ptr

    def is_capturing(self):
        return self.ptr in self.capturing


def _plan_with_fakes(monkeypatch, current):
    """A bare plan whose counters come from a stand-in cupy.zeros, on the stream current[0]."""
    made = []

    def zeros(shape, dtype):
        made.append(np.zeros(shape, dtype))
        return made[-1]

    fake = types.SimpleNamespace(
        zeros=zeros, cuda=types.SimpleNamespace(get_current_stream=lambda: _FakeStream(current[0]))
    )
    monkeypatch.setattr(launch, "cupy", fake)
    plan = launch.Plan.__new__(launch.Plan)
    plan.tile_counters = {}
    plan.pinned = False
    return plan, made


def test_one_counter_per_stream(monkeypatch):
    current = [0x1000]
    plan, made = _plan_with_fakes(monkeypatch, current)
    first = plan._tile_counter()
    assert plan._tile_counter() is first and len(made) == 1
    assert first.dtype == np.int32 and first.shape == (1,) and first[0] == 0
    current[0] = 0x2000
    second = plan._tile_counter()
    assert second is not first and len(made) == 2
    current[0] = 0x1000
    assert plan._tile_counter() is first
    current[0] = 0  # the legacy default stream: one stream whichever thread launches
    shared = []
    threads = [threading.Thread(target=lambda: shared.append(plan._tile_counter())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(shared) == 3 and all(c is shared[0] for c in shared)


def test_a_counter_drawn_under_a_capture_pins_its_plan(monkeypatch):
    """A graph replays the counter's address, so the plan that keeps the counter must never leave the cache."""
    current = [0x3000]
    plan, _ = _plan_with_fakes(monkeypatch, current)
    plan._tile_counter()
    assert not plan.pinned
    monkeypatch.setattr(_FakeStream, "capturing", {0x3000})
    counter = plan._tile_counter()
    assert plan.pinned and counter is plan.tile_counters[0x3000]


def test_a_new_counter_per_launch_on_the_per_thread_default_stream(monkeypatch):
    """Its one handle names a different stream in each thread, and a thread's launches may outlive the
    thread (whose identity a later thread may take): every launch there gets its own zeroed counter."""
    current = [launch._PER_THREAD_STREAM]
    plan, made = _plan_with_fakes(monkeypatch, current)
    counters = [plan._tile_counter(), plan._tile_counter()]
    threads = [threading.Thread(target=lambda: counters.append(plan._tile_counter())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 5 and len({id(c) for c in counters}) == 5 and not plan.tile_counters
    assert all(c.dtype == np.int32 and c.shape == (1,) and c[0] == 0 for c in counters)


def test_the_per_thread_default_streams_handle_is_cupys():
    cupy = pytest.importorskip("cupy")
    assert cupy.cuda.Stream.ptds.ptr == launch._PER_THREAD_STREAM
