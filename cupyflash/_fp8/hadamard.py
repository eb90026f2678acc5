"""``hadamard_rotate``: a random orthogonal rotation of the head dim that spreads outlier features before FP8
quantization ("incoherent processing", as in FlashAttention-3).

The rotation is ``x @ M`` with ``M = diag(signs) . blockdiag(H_n1, H_n2, ...) / sqrt(n)``, per block: D is
split into its binary powers of two, largest first (96 = 64 + 32), ``H_n`` is Sylvester's Hadamard matrix
of order n, and ``signs`` are +-1 per column from ``numpy.random.default_rng(seed)``. M is orthogonal, so
``(q M)(k M)^T = q k^T``: rotating q and k with one seed leaves the scores unchanged, while a feature
(column) that is large in every row is spread over all the columns of its block, which shrinks the amax that
sets the FP8 scale. Each block is a fast Walsh-Hadamard transform: log2(n) butterfly passes of reshapes,
O(D log D) per row, plain array code for NumPy and CuPy alike.
"""

from __future__ import annotations

import numbers

import numpy as np

from cupyflash._arrays import Array, array_module, from_float, to_float
from cupyflash._checks import check_float_array
from cupyflash._fp8.tensor import FLOAT_DTYPES


def hadamard_rotate(x: Array, *, seed: int = 0) -> Array:
    """Rotate the last dim of x by a random orthogonal matrix built from Hadamard matrices: ``x @ M``.

    Apply it to q and k with the same ``seed`` before :func:`quantize_fp8` to tame outlier features
    ("incoherent processing", FlashAttention-3): ``M`` is orthogonal, so ``(q M)(k M)^T = q k^T`` and the
    attention scores are unchanged, while a feature that is large in every row (an outlier channel) is
    spread over many columns, so the per-block amax, and with it the FP8 rounding error of every other
    element, shrinks. Do not rotate v (``out`` would come back rotated).

    ``M = diag(signs) . blockdiag(H_n1, H_n2, ...)``, each block ``H_n / sqrt(n)`` with n the binary powers
    of two of D, largest first (D = 96: 64 and 32), and ``signs`` +-1 per column drawn from
    ``numpy.random.default_rng(seed)``. Computed as fast Walsh-Hadamard transforms, O(D log D) per row.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray, shape (..., D)
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64; at least 1 dim.
    seed : int, optional
        Chooses the signs: the same seed gives the same ``M`` (default 0).

    Returns
    -------
    array of x's type, dtype and shape
        ``x @ M``, computed in float32 (float64 for float64 inputs) and rounded once to x's dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k = (rng.standard_normal((2, 4, 100, 96)) for _ in range(2))          # float64, D = 96
    >>> qr, kr = cupyflash.hadamard_rotate(q, seed=7), cupyflash.hadamard_rotate(k, seed=7)
    >>> bool(np.allclose(qr @ kr.swapaxes(-1, -2), q @ k.swapaxes(-1, -2)))      # the scores are kept
    True
    >>> bool(np.allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1)))  # so are the norms
    True
    """
    check_float_array("x", x, FLOAT_DTYPES, "float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64", "(..., D)")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    xp = array_module(x)
    work = np.float64 if x.dtype == np.float64 else np.float32
    d = x.shape[-1]
    y = to_float(x, work) * xp.asarray(random_signs(d, seed).astype(work))
    parts, start = [], 0
    for n in power_of_two_blocks(d):
        parts.append(walsh_hadamard(y[..., start : start + n]) * work(1 / np.sqrt(n)))
        start += n
    if len(parts) > 1:
        y = xp.concatenate(parts, axis=-1)
    elif parts:
        y = parts[0]
    return from_float(y, x.dtype)  # (D = 0: nothing to rotate)


def random_signs(d: int, seed: int) -> np.ndarray:
    """The +-1 (float64) of each of the d columns, from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).integers(0, 2, size=d) * 2.0 - 1.0


def power_of_two_blocks(d: int) -> list[int]:
    """The binary powers of two of d, largest first: 96 -> [64, 32], 128 -> [128], 0 -> []."""
    return [1 << b for b in reversed(range(d.bit_length())) if d >> b & 1]


def walsh_hadamard(y):
    """``y @ H_n`` over the last dim (n a power of two) for Sylvester's ``H_n`` (unnormalized, +-1 entries):
    log2(n) passes of butterflies ``(a, b) -> (a + b, a - b)`` on pairs h apart, h = 1, 2, 4, ..."""
    xp = array_module(y)
    n = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < n:
        pairs = y.reshape(lead + (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = xp.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        h *= 2
    return y
