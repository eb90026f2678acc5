"""The tree keeps its format: ``ruff format`` and ``ruff check`` (pyproject.toml's [tool.ruff]) over the Python,
``clang-format`` (cuda_src/.clang-format) over the kernels, each at 120 columns. The tools come with the test extras
at pinned versions (a formatter's output changes between versions); where one is missing the test says so and
skips. To fix what a failure lists: ``ruff format . && ruff check --fix .`` and ``clang-format -i cuda_src/*.cu
cuda_src/*.cuh`` from the repository root.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cuda_src").glob("*.cu*"))


def _tool(name):
    """The tool's executable: beside this Python (a venv's bin) or on PATH; skips where neither has it."""
    here = Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' brings it)")
    return found


def _run(*command):
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, (done.stdout + done.stderr).strip()


def test_python_is_formatted():
    code, output = _run(_tool("ruff"), "format", "--check", ".")
    assert code == 0, f"ruff format would change these files:\n{output}"


def test_python_passes_the_linter():
    code, output = _run(_tool("ruff"), "check", ".")
    assert code == 0, f"ruff check:\n{output}"


def test_kernels_are_formatted():
    assert KERNELS, "no kernel sources found in cuda_src/"
    code, output = _run(_tool("clang-format"), "--dry-run", "--Werror", *KERNELS)
    assert code == 0, f"clang-format would change these lines:\n{output[:4000]}"
