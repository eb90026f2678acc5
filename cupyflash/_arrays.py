"""Array helpers every layer shares: the optional CuPy module, the public array type, the accumulator
dtype, unsigned bit views, the sum of a broadcast gradient back to its input's shape, and the product over
the (query, key) pairs a row sees that the NumPy path and the reference use for non-finite inputs.

CuPy is optional: without it ``cupy`` is None, NumPy inputs run on the CPU path and CuPy inputs cannot
exist. Importing CuPy touches no GPU.
"""

from __future__ import annotations

from typing import Union

import numpy

try:
    import cupy
except ImportError:  # a NumPy-only install
    cupy = None

# ``typing.Union`` rather than ``X | Y``: the alias is evaluated at import time (Python 3.9 is supported).
# Named ``Array``, not ``ArrayLike``: cupyflash takes ndarrays only, not everything NumPy can convert.
Array = numpy.ndarray if cupy is None else Union[numpy.ndarray, cupy.ndarray]


def is_cupy(x) -> bool:
    """Whether x is a CuPy array (False whenever CuPy is not installed)."""
    return cupy is not None and isinstance(x, cupy.ndarray)


def lse_dtype(dtype) -> numpy.dtype:
    """The dtype of the log-sum-exp and of every float accumulator: float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32)


def bits(x):
    """The same memory viewed as unsigned integers, so that copies never need dtype support (bfloat16)."""
    return x.view(numpy.dtype(f"u{x.dtype.itemsize}"))


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def sum_to_shape(grad, shape, accumulate_dtype=None):
    """Sum ``grad`` over the dims that broadcasting added to an array of ``shape`` (NumPy or CuPy).

    The sum runs in ``accumulate_dtype`` (None: ``lse_dtype(grad.dtype)``) and the result is cast back to
    ``grad.dtype``; when nothing was broadcast, ``grad`` itself is returned.
    """
    lead = grad.ndim - len(shape)
    stretched = tuple(lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    axes = tuple(range(lead)) + stretched
    if not axes:
        return grad
    if accumulate_dtype is None:
        accumulate_dtype = lse_dtype(grad.dtype)
    total = grad.astype(accumulate_dtype, copy=False).sum(axis=axes, keepdims=True)
    return total.reshape(shape).astype(grad.dtype, copy=False)


def matmul_seen(p, x, seen):
    """``p @ x`` (NumPy, over the last two dims) over the pairs that ``seen`` (the shape of ``p``) marks: a
    pair not seen adds nothing, even where x holds a NaN or an infinity (``p`` must be 0 there), where
    0 * NaN would make the sum NaN. This is how a key that a query row cannot see never reaches that row.
    Sums that meet no non-finite value are those of ``p @ x`` bit for bit.
    """
    finite = numpy.isfinite(x)
    if finite.all():
        return p @ x
    out = p @ numpy.where(finite, x, 0)
    # Each column holding a non-finite value: where a row sees one of them, its sum over the seen pairs.
    for c in numpy.flatnonzero(~finite.reshape(-1, x.shape[-1]).all(axis=0)):
        bad = ~finite[..., None, :, c]
        reached = (seen & bad).any(axis=-1)
        if reached.any():
            total = numpy.where(seen, p * x[..., None, :, c], 0).sum(axis=-1)
            out[..., c] = numpy.where(reached, total, out[..., c])
    return out
