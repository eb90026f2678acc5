"""Timing GPU work with CUDA events, and the host's time to queue it, shared by ``python -m cupyflash`` and
``bench/``."""

from __future__ import annotations

import statistics
import time

import numpy

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
        raise RuntimeError(
            f"a timed call took the host {slowest_host * 1e3:.2f} ms to issue, more than the "
            f"{max_host_ms} ms the GPU was kept busy for: its time includes host time"
        )
    return statistics.median(times)


_kernels: dict = {}


def _kernel(name: str, code: str):
    found = _kernels.get(name)
    if found is None:
        found = _kernels.setdefault(name, cupy.RawKernel(code, name))
    return found


def spin(ms: float) -> None:
    """Keep the GPU busy for about ``ms`` milliseconds (one thread counting clock cycles, taken at 2 GHz), so
    that work queued after it waits: the host's time to queue it is then hidden from the events, or measured
    alone."""
    kernel = _kernel(
        "spin",
        'extern "C" __global__ void spin(long long cycles) {\n'
        "  const long long start = clock64();\n"
        "  while (clock64() - start < cycles) {}\n}",
    )
    kernel((1,), (1,), (numpy.int64(2_000_000 * ms),))


def launch_empty() -> None:
    """One launch of an empty kernel: the floor of a CuPy launch's host time."""
    _kernel("empty", 'extern "C" __global__ void empty() {}')((1,), (1,), ())


def host_us(fn, *, calls: int, repeats: int, spin_ms: float) -> float:
    """Median host microseconds per call of ``fn()``, ``calls`` calls at a time queued behind a ``spin_ms``
    spin, so that no launch waits for the GPU. Keep calls × launches per call well under the GPU's launch
    queue (about a thousand): a full queue makes the host wait for the spin."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        spin(spin_ms)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        cupy.cuda.Device().synchronize()
    return statistics.median(times)
