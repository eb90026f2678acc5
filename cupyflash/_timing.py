"""Timing GPU work with CUDA events, shared by ``python -m cupyflash`` and ``bench/``."""
import statistics


def median_ms(fn, *, warmup: int, repeats: int, before_each=None) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on the current stream.

    ``warmup`` untimed calls first (compilation, caches); ``before_each`` (for example an L2 flush)
    runs before every timed call, outside the timed region.
    """
    import cupy

    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)
