"""bench/dram_floor.py without a GPU: the launch shapes it tries, the target-time arithmetic and its checks.
On a GPU, that its streaming kernel reads every input byte and writes every output byte, whatever the shape:
tests/gpu/test_gpu_dram_floor.py."""

import numpy as np
import pytest
from helpers.bench import load_bench_script


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


@pytest.mark.parametrize(
    "inputs, outputs, sizes, match",
    [
        (0, 1, None, "1 to 5 inputs and 1 to 3 outputs, got 0 and 1"),
        (6, 1, None, "1 to 5 inputs and 1 to 3 outputs, got 6 and 1"),
        (2, 4, None, "1 to 5 inputs and 1 to 3 outputs, got 2 and 4"),
        (2, 1, (32, 48), "one size, a multiple of 16 bytes"),
        (2, 1, (24, 24), "one size, a multiple of 16 bytes"),
    ],
)
def test_stream_rejects_bad_arrays_before_launching(floor, inputs, outputs, sizes, match):
    sizes = sizes or (32, 32)
    arrays = [np.zeros(sizes[0], np.uint8)] * inputs + [np.zeros(sizes[1], np.uint8)] * outputs
    with pytest.raises(ValueError, match=match):
        floor.stream(arrays[:inputs], arrays[inputs:], 1, 1)
