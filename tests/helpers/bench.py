"""bench/ scripts as modules: bench/ is no package, so a script is loaded by its path."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench_script(name, filename):
    """bench/<filename> as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
