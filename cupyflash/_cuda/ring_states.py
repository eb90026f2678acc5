"""Running results of ring attention, updated in place on the GPU (``cuda_src/merge_states.cu``).

``merge_rows`` merges a block's (out, lse) into rows of the float accumulators by log-sum-exp, with the
rules of ``cupyflash.merge_attention_states``, in one pass (the array expression takes a dozen);
``add_rows`` adds a block's gradient into rows of a float accumulator. One module per device holds both
kernels for every dtype.
"""

from __future__ import annotations

import functools

import numpy

from cupyflash._arrays import cupy, lse_dtype
from cupyflash._cuda.source import OPTIONS, module_code
from cupyflash._cuda.variants import CTYPES, DTYPES

SOURCE = "merge_states.cu"
THREADS = 256  # STATES_THREADS
ROWS_PER_CTA = THREADS // 32
KERNELS = tuple(f"{kernel}<{CTYPES[dtype]}>" for kernel in ("merge_states", "accumulate_rows") for dtype in DTYPES)
_MAX_CTAS = 65536


def code() -> str:
    return module_code(SOURCE, KERNELS)


@functools.lru_cache(maxsize=None)
def module(device_id: int) -> dict[str, object]:
    """The kernels on device ``device_id`` by name expression, compiled once (CuPy's disk cache after)."""
    with cupy.cuda.Device(device_id):
        compiled = cupy.RawModule(code=code(), options=OPTIONS, name_expressions=list(KERNELS))
        return {name: compiled.get_function(name) for name in KERNELS}


def _kernel(kernel: str, dtype) -> object:
    return module(cupy.cuda.Device().id)[f"{kernel}<{CTYPES[numpy.dtype(dtype).name]}>"]


def _check_rows(acc, x, row0: int, what: str):
    if not (acc.flags.c_contiguous and x.flags.c_contiguous):
        raise ValueError(f"{what}: the accumulator and the block must be C-contiguous")
    if acc.shape[:-2] != x.shape[:-2] or acc.shape[-1] != x.shape[-1] or not 0 <= row0 <= acc.shape[-2] - x.shape[-2]:
        raise ValueError(
            f"{what}: a block of shape {x.shape} at row {row0} does not fit an accumulator of shape {acc.shape}"
        )
    if acc.dtype != lse_dtype(x.dtype):
        raise TypeError(f"{what}: the accumulator must be {lse_dtype(x.dtype)} for {x.dtype} blocks, got {acc.dtype}")


def merge_rows(out_acc, lse_acc, row0: int, out_b, lse_b) -> None:
    """Rows row0 .. row0 + n of (out_acc, lse_acc), (..., N, Dv) and (..., N) float, merged in place with
    (out_b, lse_b), (..., n, Dv) and (..., n)."""
    out_b, lse_b = cupy.ascontiguousarray(out_b), cupy.ascontiguousarray(lse_b, dtype=lse_acc.dtype)
    _check_rows(out_acc, out_b, row0, "merge_rows")
    if lse_acc.shape != out_acc.shape[:-1] or lse_b.shape != out_b.shape[:-1]:
        raise ValueError("merge_rows: each lse must be its out's shape without the last dim")
    rows = lse_b.size
    if rows == 0:
        return
    grid = (-(-rows // ROWS_PER_CTA),)
    _kernel("merge_states", out_b.dtype)(
        grid,
        (THREADS,),
        (
            out_acc,
            lse_acc,
            out_b,
            lse_b,
            numpy.int64(rows),
            numpy.int32(out_b.shape[-2]),
            numpy.int32(out_acc.shape[-2]),
            numpy.int32(row0),
            numpy.int32(out_b.shape[-1]),
        ),
    )


def add_rows(acc, row0: int, x) -> None:
    """acc[..., row0:row0 + n, :] += x, with acc (..., N, W) float and x (..., n, W)."""
    x = cupy.ascontiguousarray(x)
    _check_rows(acc, x, row0, "add_rows")
    if x.size == 0:
        return
    grid = (min(_MAX_CTAS, -(-x.size // THREADS)),)
    _kernel("accumulate_rows", x.dtype)(
        grid,
        (THREADS,),
        (
            acc,
            x,
            numpy.int64(x.size),
            numpy.int32(x.shape[-2]),
            numpy.int32(acc.shape[-2]),
            numpy.int32(row0),
            numpy.int32(x.shape[-1]),
        ),
    )
