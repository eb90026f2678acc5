"""``python -m cupyflash`` on a GPU: the kernels against the reference on awkward shapes in every dtype, and
no kernel compiled for the NVRTC audit unless ``--compile-report`` asks. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_main.py
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_self_check_on_the_gpu():
    result = subprocess.run(
        [sys.executable, "-m", "cupyflash", "--no-bench"], capture_output=True, text=True, cwd=ROOT, timeout=1800
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "GPU        " in out and "No CUDA GPU found" not in out and "CuPy is not installed" not in out
    assert "self-check OK" in out and "FAIL" not in out, out
    assert "kernel variants compiled" not in out
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert f"ok   {dtype}" in out, dtype
