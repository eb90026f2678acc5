"""Decode tile shapes and split counts, bf16, Hq = 32, Hk = 8, Nq = 1: GPU time per call of each (table
entry, split rule) against torch SDPA flash in the same run, each checked against flash first.

    python bench/exp/05_decode_tiles.py                        # D = 128, the configurations below
    HEAD=64 CONFIGS=1.8.1.128.2,1.4.1.128.1 SIZES=8x8192 python bench/exp/05_decode_tiles.py
    CONFIGS=1.4.2.128.1.1,1.4.2.128.1.2,1.4.2.64.2.2,1.4.2.64.3.2 python bench/exp/05_decode_tiles.py  # CTAs per SM
"""

import itertools
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
from bench_decode import Problem, _bf16, gpu_time_us, ours, peer, rotating  # noqa: E402

from cupyflash._cuda import compile as _compile  # noqa: E402
from cupyflash._cuda import decode, decode_tiles, plans  # noqa: E402

HEAD = int(os.environ.get("HEAD", "128"))  # the head dim whose 16-row entry is varied

DEFAULT = "1.8.2.128.2,1.4.1.128.1,1.4.2.128.1,1.8.1.128.1,1.4.1.64.1"
# WARPS_M.WARPS_N.WARPS_DV.BLOCK_N.STAGES[.MIN_CTAS]: the table's tuple (MIN_CTAS 1 where not given)
CONFIGS = [
    tuple(int(x) for x in (c + ".1" if c.count(".") == 4 else c).split("."))
    for c in os.environ.get("CONFIGS", DEFAULT).split(",")
]
WAVES = [1.0]


def main():
    rng = np.random.default_rng(0)
    rows = []
    sizes = os.environ.get("SIZES", "1x2048,1x32768,8x8192,8x131072,64x2048,64x8192")
    for batch, nk in (tuple(int(x) for x in size.split("x")) for size in sizes.split(",")):
        problem = Problem(rng, _bf16(), batch, 32, 8, 1, nk, HEAD)
        flash = gpu_time_us(rotating(problem, peer(problem, "flash")))
        for config, waves in itertools.product(CONFIGS, WAVES):
            decode_tiles.TABLE[(2, HEAD, 16)] = config
            decode.WAVES = waves
            plans.clear()
            _compile.modules.clear()  # the variant's name is the same; its tiles are not
            mine = cupy.asarray(ours(problem)(problem.sets[0]), dtype=np.float32)
            theirs = cupy.from_dlpack(peer(problem, "flash")(problem.sets[0]).contiguous()).astype(np.float32)
            gap = float(cupy.linalg.norm(mine - theirs) / cupy.linalg.norm(theirs))
            assert gap < 2e-2, f"{config}: ours and flash differ by {gap:.2e}"
            t = gpu_time_us(rotating(problem, ours(problem)))
            splits = next(iter(plans.entries("plan", "decode").values())).max_splits
            rows.append((batch, nk, config, waves, splits, t, flash))
            print(
                f"B{batch} Nk{nk} {config} waves{waves} splits{splits}: {t:.1f} us, flash {flash:.1f}, "
                f"x{t / flash:.2f}, {problem.kv_bytes / t / 1e6:.2f} TB/s",
                flush=True,
            )
        del problem
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
