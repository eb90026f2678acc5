"""The array type in cupyflash's public signatures.

Named ``Array``, not ``ArrayLike``: ``numpy.typing.ArrayLike`` means anything NumPy can convert (lists,
scalars), while cupyflash takes only ndarrays and raises TypeError for anything else. ``typing.Union``
rather than ``X | Y`` because the alias is evaluated at import time and Python 3.9 is supported.
"""

from typing import Union

import cupy
import numpy

Array = Union[numpy.ndarray, cupy.ndarray]
