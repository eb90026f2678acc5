"""bench/dram_floor.py on a GPU: its streaming kernel reads every input byte and writes every output byte,
whatever the shape, and its floors time both phases. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_dram_floor.py
"""

import numpy as np
import pytest
from helpers.bench import load_bench_script

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def floor():
    return load_bench_script("dram_floor", "dram_floor.py")


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
