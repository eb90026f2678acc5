#!/usr/bin/env python3
"""Every wgmma (Hopper) kernel variant through a stand-alone ptxas: spills and serialized wgmma.

    python bench/check_wgmma_ptxas.py --ptxas /usr/local/cuda-13.0/bin/ptxas

NVRTC makes each variant's PTX (compute_90a); the given ptxas assembles it for sm_90a with -v. Two
things are reported per variant, and the exit status is 1 if any appears:
- register spills (``bytes spill stores``): CUDA 13.0's ptxas, which cupy-cuda13x's NVRTC embeds, needs
  more registers for some wgmma kernels than CUDA 12.9's, which tests/tooling/test_compile.py checks in CI;
- ptxas' performance notes C7510-C7515, "wgmma.mma_async instructions are serialized due to ...": the
  kernel still computes the right thing, at a fraction of the speed. CI's compile report fails on the
  notes that NVRTC 12.9's ptxas prints; this checks CUDA 13.0's, which the device's cupy-cuda13x uses.
  docs/design/compile.md tells what caused them.
No GPU is needed. ptxas ships with the CUDA toolkit and in the nvidia-cuda-nvcc wheels.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupyflash._cuda import tile_policy  # noqa: E402
from cupyflash._cuda.source import OPTIONS  # noqa: E402


def ptx_of(variant):
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(variant.code(), f"{variant.direction}.cu", [], [])
    try:
        for kernel in variant.kernels:
            nvrtc.addNameExpression(program, variant.name_expression(kernel))
        nvrtc.compileProgram(program, [*OPTIONS, "-arch=compute_90a"])
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return ptx if isinstance(ptx, bytes) else ptx.encode()


def problems(variant, ptxas):
    with tempfile.NamedTemporaryFile(suffix=".ptx", delete=False) as f:
        f.write(ptx_of(variant))
        path = f.name
    try:
        log = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
    finally:
        os.unlink(path)
    return [
        line.strip()
        for line in log.splitlines()
        if re.search(r"C751\d", line) or ("spill" in line and " 0 bytes spill stores, 0 bytes spill loads" not in line)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptxas", default="ptxas", help="the ptxas to check with (default: on PATH)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    variants = [v for v in tile_policy.shipped_variants() if v.path in ("wgmma", "pieces", "ws")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        found = list(pool.map(lambda v: (v, problems(v, args.ptxas)), variants))
    bad = [(v, lines) for v, lines in found if lines]
    for v, lines in bad:
        print(v, *lines, sep="\n    ")
    print(
        f"{len(variants)} wgmma variants, {len(bad)} with spills or serialized wgmma "
        f"({subprocess.run([args.ptxas, '--version'], capture_output=True, text=True).stdout.splitlines()[-1]})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
