"""cupyflash without CuPy (a NumPy-only install: CuPy is an optional extra), in subprocesses where
``sys.modules['cupy'] = None`` makes ``import cupy`` fail: the package and every module of it import, NumPy
inputs run on the CPU path and match the reference, ``warmup`` raises a RuntimeError that names CuPy, and the
CPU tests and tooling tests import without CuPy too."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _python(code):
    """Run ``code`` with CuPy hidden; its stdout, or an assertion naming what failed."""
    prelude = "import sys\nsys.modules['cupy'] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_every_module_imports_without_cupy():
    found = json.loads(
        _python(
            "import json, pkgutil, importlib, cupyflash\n"
            "names = [m.name for m in pkgutil.walk_packages(cupyflash.__path__, 'cupyflash.')]\n"
            "for name in names:\n"
            "    importlib.import_module(name)\n"
            "from cupyflash import _arrays\n"
            "assert _arrays.cupy is None and not _arrays.is_cupy(object())\n"
            "print(json.dumps(names))\n"
        )
    )
    assert "cupyflash._cuda.dense" in found and "cupyflash.__main__" in found


def test_numpy_inputs_run_on_the_cpu_path_and_match_the_reference():
    out = _python(
        "import numpy as np, cupyflash\n"
        "from cupyflash import reference\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v, dout = (rng.standard_normal((2, 3, 70, 40), dtype=np.float32) for _ in range(4))\n"
        "for causal in (False, True):\n"
        "    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, window=(30, -1))\n"
        "    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, window=(30, -1), return_lse=True)\n"
        "    assert isinstance(out, np.ndarray) and out.dtype == np.float32\n"
        "    assert np.abs(out - ref_out).max() <= 1e-5 * np.abs(ref_out).max()\n"
        "    assert np.abs(lse - ref_lse).max() <= 1e-5 * np.abs(ref_lse).max()\n"
        "    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window=(30, -1))\n"
        "    refs = reference.attention_backward(dout, q, k, v, causal=causal, window=(30, -1))\n"
        "    for g, r in zip(grads, refs):\n"
        "        assert np.abs(g - r).max() <= 1e-5 * np.abs(r).max()\n"
        "p = cupyflash.attention_probs(q, k, v)\n"
        "assert np.allclose(p.sum(-1), 1, atol=1e-5)\n"
        "print('ok')\n"
    )
    assert out.strip() == "ok"


def test_warmup_raises_runtime_error_naming_cupy():
    out = _python(
        "import cupyflash\n"
        "try:\n"
        "    cupyflash.warmup(dtypes='float16', head_dims=64)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    raise SystemExit('warmup did not raise')\n"
    )
    assert "CuPy" in out and "not installed" in out


def test_cpu_and_tooling_tests_import_without_cupy():
    """Tests that need CuPy import it inside (pytest.importorskip) or skip: no CPU or tooling test module
    imports it at module level, nor does the shared machinery."""
    files = sorted(str(p) for folder in ("cpu", "tooling", "helpers") for p in (TESTS / folder).glob("*.py"))
    out = _python(
        "import importlib.util, os\n"
        f"sys.path[:0] = [{str(TESTS)!r}]\n"
        f"files = {files!r}\n"
        "for path in files:\n"
        "    spec = importlib.util.spec_from_file_location('imported_' + os.path.basename(path)[:-3], path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    sys.path.insert(1, os.path.dirname(path))\n"
        "    spec.loader.exec_module(module)\n"
        "print(len(files))\n"
    )
    assert int(out) == len(files) > 10
