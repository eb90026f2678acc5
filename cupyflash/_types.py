"""The array type in cupyflash's public signatures, and the dtype of the log-sum-exp and accumulators.

Named ``Array``, not ``ArrayLike``: ``numpy.typing.ArrayLike`` means anything NumPy can convert (lists,
scalars), while cupyflash takes only ndarrays and raises TypeError for anything else. ``typing.Union``
rather than ``X | Y`` because the alias is evaluated at import time and Python 3.9 is supported.
"""

from typing import Union

import cupy
import numpy

Array = Union[numpy.ndarray, cupy.ndarray]


def lse_dtype(dtype) -> numpy.dtype:
    """Dtype of the log-sum-exp and every float accumulator (CPU path, dbias): float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32)
