"""bench/dram_floor.py: the launch shapes it tries, the target-time arithmetic and its checks (CPU), and on
a GPU that its streaming kernel reads every input byte and writes every output byte, whatever the shape."""

import cupy
import numpy as np
import pytest

from conftest import load_bench_script


@pytest.fixture(scope="module")
def floor():
    return load_bench_script("dram_floor", "dram_floor.py")


def test_launch_shapes_cover_every_items_count_on_both_grids(floor):
    chunks, sms = 1000, 132
    shapes = floor.launch_shapes(chunks, sms)
    assert len(shapes) == len(set(shapes))
    assert {items for items, _ in shapes} == set(floor.ITEMS)
    for items in floor.ITEMS:  # one grid that covers the chunks in one turn, one persistent
        assert (items, -(-chunks // (floor.THREADS * items))) in shapes
        assert (items, floor.WAVES * sms) in shapes


def test_time_at_target_scales_the_time_by_ratio_over_target(floor):
    # A row at 0.120 ms with ratio 0.60 against a 0.85 target passes at 0.120 * 0.60 / 0.85 ms.
    assert floor.time_at_target(0.120, 0.60, 0.85) == pytest.approx(0.0847058823)
    assert floor.time_at_target(0.5, 0.9, 0.9) == pytest.approx(0.5)


@pytest.mark.parametrize("inputs, outputs, sizes, match", [
    (0, 1, None, "1 to 5 inputs and 1 to 3 outputs, got 0 and 1"),
    (6, 1, None, "1 to 5 inputs and 1 to 3 outputs, got 6 and 1"),
    (2, 4, None, "1 to 5 inputs and 1 to 3 outputs, got 2 and 4"),
    (2, 1, (32, 48), "one size, a multiple of 16 bytes"),
    (2, 1, (24, 24), "one size, a multiple of 16 bytes"),
])
def test_stream_rejects_bad_arrays_before_launching(floor, inputs, outputs, sizes, match):
    sizes = sizes or (32, 32)
    arrays = [np.zeros(sizes[0], np.uint8)] * inputs + [np.zeros(sizes[1], np.uint8)] * outputs
    with pytest.raises(ValueError, match=match):
        floor.stream(arrays[:inputs], arrays[inputs:], 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("n_in, n_out", [(1, 1), (3, 1), (5, 3)])
def test_stream_writes_the_xor_of_every_input(floor, rng, n_in, n_out):
    chunks = 3 * floor.THREADS * max(floor.ITEMS) + 37  # not a whole number of any CTA's turn
    ins = [cupy.asarray(rng.integers(0, 2**32, size=4 * chunks, dtype=np.uint32)) for _ in range(n_in)]
    want = ins[0].copy()
    for x in ins[1:]:
        want ^= x
    for items, grid in [(1, 1), (8, 3)] + floor.launch_shapes(chunks, 2):  # tiny grids stride many turns
        outs = [cupy.full(4 * chunks, 0xDEADBEEF, dtype=np.uint32) for _ in range(n_out)]  # poisoned
        floor.stream(ins, outs, items, grid)
        for j, out in enumerate(outs):
            expect = want.copy()
            expect[::4] ^= j
            assert bool((out == expect).all()), (items, grid, j)


@pytest.mark.gpu
def test_attention_floors_time_both_phases(floor):
    times = []

    def timer(fn):  # each phase's shapes in turn, every one timed slower than the one before
        fn()
        times.append(1.0 + 0.001 * len(times))
        return times[-1]

    floors = floor.attention_floors(4096 * 64, 2, timer)
    shapes = floor.launch_shapes(-(-4096 * 64 * 2 // 16), cupy.cuda.Device().attributes["MultiProcessorCount"])
    assert len(times) == 2 * len(shapes)
    assert floors["fwd"]["bytes"] == 4 * 4096 * 64 * 2 and floors["bwd"]["bytes"] == 8 * 4096 * 64 * 2
    for phase, first in (("fwd", times[0]), ("bwd", times[len(shapes)])):  # the fastest: each phase's first shape
        assert floors[phase]["ms"] == first
        assert (floors[phase]["items"], floors[phase]["grid"]) == shapes[0]
        assert floors[phase]["tb_per_s"] == pytest.approx(floors[phase]["bytes"] / first / 1e9)
