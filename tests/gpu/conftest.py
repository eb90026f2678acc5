"""Fixtures the GPU test files share."""

import pytest

from cupyflash._cuda import plans, tile_policy
from cupyflash._cuda.compile import current_device


@pytest.fixture
def any_length(monkeypatch):
    """The fused backward at every length (its thresholds at zero; plans and the fast path's table forgotten,
    before and after, so that no call reuses launches chosen under the other threshold). Skips where the fused
    backward does not run (compute capability 9.0 only)."""
    if not current_device().wgmma:
        pytest.skip("the fused backward runs on compute capability 9.0 only")
    monkeypatch.setattr(tile_policy, "WS_BWD_MIN_LENGTH", {d: 1 for d in tile_policy.WS_BWD_MIN_LENGTH})
    monkeypatch.setattr(tile_policy, "WS_BWD_MIN_WORK", 0)
    plans.clear()
    tile_policy.unrounded_alike.cache_clear()  # (its choices follow the thresholds)
    yield
    plans.clear()
    tile_policy.unrounded_alike.cache_clear()
