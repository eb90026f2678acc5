"""Experiment 03: tile shapes of the Hopper (wgmma) kernels, from the one table (cupyflash/_cuda/tiles.py).

Like experiment 01, for the table's wgmma rows: swaps one kernel's entry at a time (forward, dK/dV pass or dQ pass),
checks forward and backward against the float64 reference on a small awkward problem, then times that kernel's
direction on the FlashAttention benchmark shape (bf16, 16k tokens, hidden 2048), by default at N = 2k and 8k, full,
and 8k causal (--shapes). Needs compute capability 9.0. Every candidate was first compiled with CUDA 13.0's ptxas
here: no spills, no serialized wgmma.

    PYTHONPATH=.:bench python bench/exp/03_wgmma_tiles.py [--only 'fwd|dq']

Results and the choice made from them: docs/design/tiles.md (the lab notebook, bench/log/NOTES.md, has the
full tables, "Experiment 03"). The warp-specialized forward now serves the 16-bit forward at HEAD_DIM 128 on
inputs TMA can read, so (128, "fwd") candidates time that kernel, not these tiles.
"""

import argparse
import ast
import importlib.util
import re
from pathlib import Path

import cupy
import numpy as np

from cupyflash._cuda import tiles

_spec = importlib.util.spec_from_file_location("exp01", Path(__file__).with_name("01_tiles.py"))
exp01 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp01)  # experiment 01's float64 check, timing and cell swap

# (HEAD_DIM, kernel): candidate tiles (warps, block, d_chunk); the first is the table's entry when this ran
CANDIDATES = {
    (64, "fwd"): [(8, 128, 64), (8, 192, 64), (8, 256, 64), (12, 128, 64)],
    (128, "fwd"): [(8, 128, 128), (8, 64, 128), (8, 192, 128)],
    (256, "fwd"): [(8, 64, 256), (8, 32, 256)],
    (64, "dkdv"): [(4, 64, 64), (8, 64, 64), (4, 128, 64)],
    (64, "dq"): [(4, 64, 64), (8, 64, 64), (4, 128, 64)],
    (128, "dkdv"): [(4, 64, 128), (8, 64, 128), (8, 32, 128)],
    (128, "dq"): [(4, 64, 128), (8, 64, 128), (4, 128, 128)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="regex on 'kernel/HEAD_DIM', e.g. 'fwd|dq/128'")
    parser.add_argument(
        "--shapes",
        default="full-2k,full-8k,causal-8k",
        help="comma-separated (full|causal)-N, N in 512, 1k, 2k, ... (default: %(default)s)",
    )
    parser.add_argument(
        "--candidates", help="a Python dict replacing CANDIDATES, e.g. \"{(64, 'fwd'): [(4, 128, 64)]}\""
    )
    args = parser.parse_args()
    if int(cupy.cuda.Device().compute_capability) != 90:
        raise SystemExit("experiment 03 needs compute capability 9.0 (the wgmma kernels)")
    rng = np.random.default_rng(3)
    shapes = [
        (s.split("-")[0] == "causal", int(s.split("-")[1].replace("k", "")) * (1024 if "k" in s else 1))
        for s in args.shapes.split(",")
    ]
    candidates_by_kernel = ast.literal_eval(args.candidates) if args.candidates else CANDIDATES
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(
        f"{'kernel':>6} {'HEAD_DIM':>8} {'tiles':>14} {'smem':>7} {'err':>8} "
        + " ".join(f"{s:>10}" for s in args.shapes.split(","))
    )
    for (head_dim, kernel), candidates in candidates_by_kernel.items():
        if not re.search(args.only, f"{kernel}/{head_dim}"):
            continue
        for shape in candidates:
            original = exp01.set_tiles("wgmma", head_dim, kernel, shape)
            smem = tiles.smem_bytes("wgmma", 2, head_dim, kernel, tiles.CELLS["wgmma", 2, head_dim, kernel, "plain"])
            error = exp01.check(head_dim, rng)
            rates = [exp01.time_direction(head_dim, kernel, causal, n) for causal, n in shapes]
            print(
                f"{kernel:>6} {head_dim:>8} {str(shape):>14} {smem:>7} {error:8.1e} "
                + " ".join(f"{r:10.1f}" for r in rates),
                flush=True,
            )
            exp01.restore_tiles("wgmma", head_dim, kernel, original)


if __name__ == "__main__":
    main()
