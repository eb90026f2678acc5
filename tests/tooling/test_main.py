"""``python -m cupyflash``: its options, and its run on a machine without a GPU (or without CuPy): versions and
the CPU path against the reference in seconds, and no kernel compiled unless ``--compile-report`` asks. (With
a GPU: tests/gpu/test_gpu_main.py.)"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.gpu import gpu_available

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 60  # the run takes about a second; a slow CI machine gets room
HIDE_CUPY = (
    "import runpy, sys; sys.modules['cupy'] = None; sys.argv[0] = 'cupyflash'; "
    "runpy.run_module('cupyflash', run_name='__main__', alter_sys=True)"
)


def _run(args, hide_cupy=False):
    command = [sys.executable, "-c", HIDE_CUPY, *args] if hide_cupy else [sys.executable, "-m", "cupyflash", *args]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=10 * SECONDS)
    return result, time.perf_counter() - started


def test_help_lists_the_options():
    result, _ = _run(["--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m cupyflash"), result.stdout
    for option in ("--compile-report", "--no-check", "--no-bench", "--arch", "--verbose"):
        assert option in result.stdout, option


def _assert_cpu_run(result, seconds, why):
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert seconds < SECONDS, f"took {seconds:.1f} s"
    assert why in result.stdout, result.stdout
    assert "self-check OK" in result.stdout and "FAIL" not in result.stdout, result.stdout
    assert "kernel variants compiled" not in result.stdout, "compiled kernels without --compile-report"
    assert "TFLOP/s" not in result.stdout, "timed without a GPU"
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert f"ok   {dtype}" in result.stdout, dtype


@pytest.mark.skipif(gpu_available(), reason="checks the run on a machine without a GPU")
def test_without_a_gpu_it_checks_the_cpu_path_in_seconds():
    result, seconds = _run([])
    why = "CuPy is not installed" if "CuPy is not installed" in result.stdout else "No CUDA GPU found"
    _assert_cpu_run(result, seconds, why)


def test_without_cupy_it_checks_the_cpu_path_in_seconds():
    """With CuPy hidden (``sys.modules['cupy'] = None``), as on a NumPy-only install."""
    result, seconds = _run([], hide_cupy=True)
    _assert_cpu_run(result, seconds, "CuPy is not installed")
    assert "CuPy       unavailable" in result.stdout


def test_no_check_checks_nothing():
    result, seconds = _run(["--no-check", "--no-bench"], hide_cupy=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check against" not in result.stdout and "nothing was checked" in result.stdout


def test_a_reader_that_stops_early_gets_no_traceback():
    """``python -m cupyflash | head -1``: the pipe closes under the run, which ends quietly (exit code 141, as a
    shell's for a closed pipe) instead of a BrokenPipeError traceback."""
    command = [sys.executable, "-c", HIDE_CUPY, "--no-bench"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().startswith(b"cupyflash")
    proc.stdout.close()  # as head does after its line
    _, errors = proc.communicate(timeout=10 * SECONDS)
    assert proc.returncode == 141 and b"Traceback" not in errors and b"BrokenPipe" not in errors, errors.decode()


def test_docs_prints_a_page_and_lists_them():
    """``--docs fp8`` prints docs/fp8.md; ``--docs`` lists the pages; an unknown page exits 2 with the list."""
    result, _ = _run(["--docs", "fp8"], hide_cupy=True)
    assert result.returncode == 0 and result.stdout == (ROOT / "docs" / "fp8.md").read_text() + "\n"
    result, _ = _run(["--docs"], hide_cupy=True)
    assert result.returncode == 0 and "api, deployment" in result.stdout and "fp8" in result.stdout
    result, _ = _run(["--docs", "nope"], hide_cupy=True)
    assert result.returncode == 2 and "no documentation page 'nope'" in result.stderr and "fp8" in result.stderr
