"""The wheel carries the kernel sources and the Python modules (the package and its subpackage _cuda); the
metadata says what we depend on: NumPy and ml_dtypes at run time, CuPy through the cuda12/cuda13 extras.

The wheel is built offline (``pip wheel --no-build-isolation --no-index``) from a copy of the source
tree in a temporary folder, so no stale ``build/`` folder can hide a missing file and the checkout is
left untouched. setuptools and wheel come with the ``test`` extra.
"""

import ast
import email.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SUFFIXES = (".cu", ".cuh")
RUNTIME_REQUIREMENTS = {"numpy", "ml_dtypes"}  # CuPy is optional (the extras); SciPy is the tests' (test extra)
SUBPACKAGES = ("cupyflash", "cupyflash/_cuda", "cupyflash/_fp8", "cupyflash/_kvcache", "cupyflash/distributed")
BUILD_INPUTS = (
    "setup.cfg",
    "pyproject.toml",
    "MANIFEST.in",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "cupyflash",
    "cuda_src",
    "docs",
)
SDIST_INPUTS = BUILD_INPUTS + ("tests", "bench")  # what MANIFEST.in adds to the packages


def _in_ci():
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _kernel_sources():
    return sorted(p.name for p in (ROOT / "cuda_src").glob("*") if p.suffix in KERNEL_SUFFIXES)


def _python_modules():
    """Every module of the package and its subpackages, as paths in the wheel (cupyflash/..., cupyflash/_cuda/...)."""
    return sorted(f"{package}/{p.name}" for package in SUBPACKAGES for p in (ROOT / package).glob("*.py"))


def _static_version():
    tree = ast.parse((ROOT / "cupyflash" / "__init__.py").read_text())
    for node in tree.body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and "__version__" in targets:
            return ast.literal_eval(node.value)
    raise AssertionError("cupyflash/__init__.py assigns no literal __version__")


def _normalize(name):
    """A project name as PEP 503 compares it: ml_dtypes and ml-dtypes are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _need_build_tools():
    missing = [m for m in ("setuptools", "wheel") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"building a wheel offline needs {missing} (the test extra installs them)"
        if _in_ci():
            pytest.fail(reason)
        pytest.skip(reason)


def _source_copy(tmp_path_factory, names):
    src = tmp_path_factory.mktemp("src")
    for name in names:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]"))
        elif path.exists():
            shutil.copy2(path, src / name)
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    _need_build_tools()
    src = _source_copy(tmp_path_factory, BUILD_INPUTS)
    dist = tmp_path_factory.mktemp("dist")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(src),
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--quiet",
        "-w",
        str(dist),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    (path,) = dist.glob("cupyflash-*.whl")
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(zf.read(meta_name).decode())
        licences = [zf.read(n).decode() for n in names if ".dist-info/" in n and n.endswith("LICENSE")]
    return names, metadata, licences


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(names, PKG-INFO) of the source distribution, built offline by setuptools' own backend."""
    _need_build_tools()
    src = _source_copy(tmp_path_factory, SDIST_INPUTS)
    dist = tmp_path_factory.mktemp("sdist")
    code = "import sys, setuptools.build_meta as backend; print(backend.build_sdist(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=src, capture_output=True, text=True)
    assert result.returncode == 0, f"build_sdist failed:\n{result.stdout}\n{result.stderr}"
    (path,) = dist.glob("cupyflash-*.tar.gz")
    with tarfile.open(path) as tf:
        names = [n.split("/", 1)[1] for n in tf.getnames() if "/" in n]
        (info,) = [m for m in tf.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
        metadata = email.parser.Parser().parsestr(tf.extractfile(info).read().decode())
    return names, metadata


def test_wheel_ships_every_kernel_source(wheel):
    names, _, _ = wheel
    expected = _kernel_sources()
    assert expected, f"no .cu/.cuh files in {ROOT / 'cuda_src'}"
    shipped = sorted(n[len("cupyflash/cuda_src/") :] for n in names if n.startswith("cupyflash/cuda_src/"))
    assert shipped == expected, f"wheel's cupyflash/cuda_src/ {shipped} != repo's cuda_src/ {expected}"


def test_wheel_ships_every_module(wheel):
    names, _, _ = wheel
    expected = _python_modules()
    assert "cupyflash/_cuda/__init__.py" in expected and "cupyflash/_cuda/variants.py" in expected
    subpackages = "|".join(re.escape(p.split("/", 1)[1]) for p in SUBPACKAGES if "/" in p)
    shipped = sorted(n for n in names if re.fullmatch(rf"cupyflash/(?:(?:{subpackages})/)?[^/]+\.py", n))
    missing, extra = sorted(set(expected) - set(shipped)), sorted(set(shipped) - set(expected))
    assert shipped == expected, f"missing {missing}, extra {extra}"
    assert "cupyflash/__main__.py" in names


def test_every_package_directory_is_shipped():
    """No Python package directory of cupyflash/ that the wheel would leave out (setup.cfg lists packages)."""
    found = sorted(
        str(p.parent.relative_to(ROOT)).replace("\\", "/")
        for p in (ROOT / "cupyflash").rglob("__init__.py")
        if "__pycache__" not in p.parts
    )
    assert found == sorted(SUBPACKAGES), found


def test_wheel_ships_the_user_documentation(wheel):
    """docs/*.md as cupyflash/docs/ (``python -m cupyflash --docs PAGE`` reads them), without docs/design/."""
    names, _, _ = wheel
    expected = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert "fp8.md" in expected
    shipped = sorted(
        n[len("cupyflash/docs/") :] for n in names if n.startswith("cupyflash/docs/") and n.endswith(".md")
    )
    assert shipped == expected


def test_wheel_ships_py_typed(wheel):
    # PEP 561: without the marker, type checkers ignore the package's own hints.
    names, _, _ = wheel
    assert (ROOT / "cupyflash" / "py.typed").is_file()
    assert "cupyflash/py.typed" in names


def test_wheel_metadata(wheel):
    _, metadata, _ = wheel
    assert metadata["Name"] == "cupyflash"
    assert metadata["Version"] == _static_version()
    requires = metadata.get_all("Requires-Dist") or []
    names = [re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    unconditional = {_normalize(name) for name in names}
    assert unconditional == {_normalize(name) for name in RUNTIME_REQUIREMENTS}
    assert not [r for r in requires if r.lower().startswith("torch")], "torch must never be a dependency"
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"cuda12", "cuda13", "test"} <= extras, extras
    _assert_project_metadata(metadata)


def _assert_project_metadata(metadata):
    """The licence (an SPDX identifier), who made it, which Pythons, what it is for, and the README as the
    long description."""
    assert metadata["License"] == "BSD-3-Clause" or metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata["Author"] and metadata["Summary"]
    assert metadata["Requires-Python"] == ">=3.10"
    classifiers = set(metadata.get_all("Classifier") or [])
    assert {
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.13",
        "Operating System :: POSIX :: Linux",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    } <= classifiers, classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert metadata["Keywords"] and "cupy" in metadata["Keywords"]
    body = metadata.get_payload() or metadata["Description"] or ""
    assert body.lstrip().startswith("# cupyflash"), body[:80]


def test_the_licence_ships_in_the_wheel_and_the_sdist(wheel, sdist):
    """LICENSE (BSD-3-Clause) in the wheel's dist-info and at the sdist's top, with CHANGELOG.md; the sdist's
    PKG-INFO carries the same metadata; the notebook and raw logs (bench/log/) stay out of it."""
    _, _, licences = wheel
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and licences == [text]
    names, metadata = sdist
    assert {"LICENSE", "CHANGELOG.md", "README.md", "cuda_src/attention_fwd_ws.cu", "bench/bench_fp8.py"} <= set(names)
    assert not [n for n in names if n.startswith("bench/log/")]
    _assert_project_metadata(metadata)


def test_changelog_leads_with_this_version():
    """CHANGELOG.md's first version heading is the package's version."""
    match = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert match and match.group(1) == _static_version(), match


def test_installed_package_finds_kernel_sources():
    # The loader's rule: cupyflash/cuda_src (wheel) first, else ../cuda_src (source tree, editable install).
    spec = importlib.util.find_spec("cupyflash")
    assert spec is not None and spec.origin, "cupyflash is not importable"
    package = Path(spec.origin).parent
    candidates = [package / "cuda_src", package.parent / "cuda_src"]
    found = next((c for c in candidates if c.is_dir()), None)
    assert found is not None, f"no kernel sources at {candidates}"
    assert sorted(p.name for p in found.iterdir() if p.suffix in KERNEL_SUFFIXES)


def test_readme_shows_the_ci_commands():
    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    for var in ("INSTALL_CMD", "TEST_CMD", "COMPILE_TEST_CMD"):
        match = re.search(rf"^{var}='([^']+)'$", script, re.MULTILINE)
        assert match, f".ci/run defines no {var}"
        assert match.group(1) in readme, f"README.md does not show .ci/run's {var}: {match.group(1)}"
