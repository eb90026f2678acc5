"""pytest's hooks, options and fixtures for the whole suite: the ``gpu`` marker (skipped when CuPy is missing
or sees no GPU), a per-test seeded RNG, and the accuracy check as a fixture.

Layout: ``cpu/`` runs on NumPy (the CPU path, the reference, selection logic), ``gpu/`` needs a CUDA GPU
(every test there is marked ``gpu``), ``tooling/`` checks the package around the code (packaging, the compile
audit, the docs, bench scripts, ``python -m cupyflash``), and ``helpers/`` holds the shared machinery (the
accuracy rule: helpers/checks.py).
"""

import functools
import zlib

import numpy as np
import pytest
from helpers import checks
from helpers.gpu import NO_GPU_REASON, gpu_available


def pytest_addoption(parser):
    group = parser.getgroup("cupyflash", "cupyflash test options")
    group.addoption(
        "--random-cases",
        type=int,
        default=None,
        metavar="N",
        help="tests/gpu/test_random_cases.py: run N random cases (default: its modest count)",
    )
    group.addoption(
        "--random-seed",
        type=int,
        default=None,
        metavar="S",
        help="tests/gpu/test_random_cases.py: base seed of the random cases (default: a fixed one)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", f"gpu: needs a CUDA GPU; skipped with '{NO_GPU_REASON}'")
    config.addinivalue_line(
        "markers", "huge: more than 2^31 elements in one tensor; needs >= 40 GiB of free GPU memory"
    )


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the test's id: fresh data for every test, the same data on every run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def assert_matches_reference():
    """``check(q, k, v, dout, results, causal=..., scale=None)`` with results = (out, lse, dq, dk, dv): the
    accuracy rule (helpers/checks.py) against a naive implementation that folds the scale into its softmax."""
    return functools.partial(checks.assert_matches_reference, round_scaled_scores=False)
