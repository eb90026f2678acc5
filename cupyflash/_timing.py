"""Timing GPU work with CUDA events, shared by ``python -m cupyflash`` and ``bench/``."""
from __future__ import annotations

import statistics
import time

from cupyflash._arrays import cupy


def median_ms(fn, *, warmup: int, repeats: int, before_each=None, max_host_ms: float | None = None) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on the current stream.

    ``warmup`` untimed calls first (compilation, caches); ``before_each`` (for example an L2 flush)
    runs before every timed call, outside the timed region. ``max_host_ms``: raise RuntimeError if a timed
    call took the host longer than that to issue (when ``before_each`` keeps the GPU busy that long, so
    that the events time the GPU alone).
    """
    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    slowest_host = 0.0
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start.record()
        t0 = time.perf_counter()
        fn()
        slowest_host = max(slowest_host, time.perf_counter() - t0)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    if max_host_ms is not None and slowest_host * 1e3 > max_host_ms:
        raise RuntimeError(f"a timed call took the host {slowest_host * 1e3:.2f} ms to issue, more than the "
                           f"{max_host_ms} ms the GPU was kept busy for: its time includes host time")
    return statistics.median(times)
