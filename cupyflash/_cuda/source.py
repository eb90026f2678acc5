"""The kernel sources in ``cuda_src/``, read as text with every local ``#include "..."`` replaced by the
header itself, so that CuPy's compile cache, keyed on the source string, sees every byte.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
OPTIONS = ("-std=c++17",)  # NVRTC options of every module
MIN_CC = 80  # cp.async and bfloat16 mma.sync
WGMMA_CC = 90  # Hopper: wgmma and TMA, compiled for sm_90a, whose code runs on compute capability 9.0 only
WGMMA_ARCH = "sm_90a"
MAX_GRID_Y = 65535  # CUDA's limit on a grid's y dimension (grid z takes the rest)


def source_dir() -> Path:
    """cuda_src/: inside the package (a wheel) or beside it (the source tree, editable installs)."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupyflash: CUDA sources not found next to {here} (looked for cuda_src/)")


@functools.lru_cache(maxsize=None)
def source(filename: str) -> str:
    """The text of one .cu file with every local #include pasted in (each header once)."""
    root = source_dir()
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (root / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: inline(m.group(1)), text)

    return inline(filename)


def module_code(filename: str, names) -> str:
    """The source of a module whose kernels are the template instantiations ``names``: they lead it as a
    comment, so that each module, and each change of the tile table, has its own entry in CuPy's cache."""
    return f"// cupyflash module: {', '.join(names)}\n" + source(filename)
