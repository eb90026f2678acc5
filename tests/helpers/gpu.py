"""GPU-only helpers: whether a GPU is usable, and allocations filled with NaN. Importable without CuPy."""

import contextlib

from cupyflash._arrays import cupy

NAN_BYTE = 0xFF  # 0xFFFF is a NaN in float16 and bfloat16, 0xFFFFFFFF one in float32 and float64
NO_GPU_REASON = "no CUDA GPU: CuPy is not installed, or cupy.cuda.is_available() is False"


def gpu_available():
    """Whether CuPy is installed and sees a CUDA device."""
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # a CuPy that cannot load its CUDA libraries
        return False


@contextlib.contextmanager
def nan_filled_allocations():
    """Every CuPy allocation inside starts filled with NaN, so an output element (or a workspace element
    read before written) that the kernels never write fails the test.

    The allocator is CuPy's own memory pool, with a NaN memset (on the current stream) after each malloc.
    Freeing a NaN buffer just before the call, for the pool to hand back, is not enough: arrays that stay
    alive (the forward's out and lse during the backward) pin the pool's chunk, and the pool then serves
    the next allocations from that chunk's unpoisoned remainder first.
    """
    with filled_allocations(NAN_BYTE):
        yield


@contextlib.contextmanager
def filled_allocations(byte: int):
    """Every CuPy allocation inside starts with each of its bytes set to ``byte`` (0: zeros, so that a NaN
    in the results can only come from the kernels)."""
    pool = cupy.get_default_memory_pool()

    def filled_malloc(nbytes):
        memptr = pool.malloc(nbytes)
        memptr.memset_async(byte, nbytes)
        return memptr

    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(filled_malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(previous)
