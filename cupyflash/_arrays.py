"""Array helpers every layer shares: the optional CuPy module, the public array type, the accumulator dtype, unsigned
bit views, conversions to and from float that hold for bfloat16 on CuPy too, the sum of a broadcast gradient back to
its input's shape, and the product over the (query, key) pairs a row sees that the NumPy path and the reference use
for non-finite inputs, and the decorator that keeps NumPy's floating-point warnings inside them.

CuPy is optional: without it ``cupy`` is None, NumPy inputs run on the CPU path and CuPy inputs cannot
exist. Importing CuPy touches no GPU.
"""

from __future__ import annotations

import functools
from typing import Union

import ml_dtypes
import numpy

try:
    import cupy
except ImportError:  # a NumPy-only install
    cupy = None

# Named ``Array``, not ``ArrayLike``: cupyflash takes ndarrays only, not everything NumPy can convert.
Array = numpy.ndarray if cupy is None else Union[numpy.ndarray, cupy.ndarray]


BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)


def quiet_float_errors(function):
    """``function`` with NumPy's floating-point warnings (invalid, divide, overflow) off while it runs: non-finite
    inputs make NaN and infinities in the outputs on purpose (docs/api.md, non-finite values), and a row that sees
    no key takes exp(-inf - -inf); the results say so, and the caller's warnings stay its own."""

    @functools.wraps(function)
    def quiet(*args, **kwargs):
        with numpy.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return function(*args, **kwargs)

    return quiet


def is_cupy(x) -> bool:
    """Whether x is a CuPy array (False whenever CuPy is not installed)."""
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(x):
    """numpy or cupy: the module of the array x."""
    return cupy if is_cupy(x) else numpy


def to_float(x, dtype=numpy.float32):
    """x (float16, bfloat16, float32 or float64; NumPy or CuPy) as ``dtype`` (float32 or float64).

    CuPy has no bfloat16 arithmetic: a CuPy bfloat16 array is widened by its bits (exactly).
    """
    xp = array_module(x)
    if x.dtype == BFLOAT16 and xp is not numpy:
        x = (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(dtype, copy=False)


def from_float(x, dtype):
    """float32 or float64 x as ``dtype`` (float16, bfloat16, float32, float64), rounded to nearest even.

    CuPy has no bfloat16 conversion: float32 -> bfloat16 is done on the bits (a NaN stays a quiet NaN).
    """
    dtype = numpy.dtype(dtype)
    xp = array_module(x)
    if dtype != BFLOAT16 or xp is numpy:
        return x.astype(dtype, copy=False)
    u = x.astype(xp.float32, copy=False).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16
    rounded = xp.where(xp.isnan(x), xp.uint32(0x7FC0), rounded)
    return rounded.astype(xp.uint16).view(BFLOAT16)


def lse_dtype(dtype) -> numpy.dtype:
    """The dtype of the log-sum-exp and of every float accumulator: float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32)


def bits(x):
    """The same memory viewed as unsigned integers, so that copies never need dtype support (bfloat16)."""
    return x.view(numpy.dtype(f"u{x.dtype.itemsize}"))


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def sum_to_shape(grad, shape, accumulate_dtype=None, dtype=None):
    """Sum ``grad`` over the dims that broadcasting added to an array of ``shape`` (NumPy or CuPy).

    The sum runs in ``accumulate_dtype`` (None: ``lse_dtype(grad.dtype)``) and the result is cast to ``dtype``
    (None: ``grad.dtype``); when nothing was broadcast, ``grad`` itself, cast to ``dtype``.
    """
    dtype = grad.dtype if dtype is None else dtype
    lead = grad.ndim - len(shape)
    stretched = tuple(lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    axes = tuple(range(lead)) + stretched
    if not axes:
        return grad.astype(dtype, copy=False)
    if accumulate_dtype is None:
        accumulate_dtype = lse_dtype(grad.dtype)
    total = grad.astype(accumulate_dtype, copy=False).sum(axis=axes, keepdims=True)
    return total.reshape(shape).astype(dtype, copy=False)


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
