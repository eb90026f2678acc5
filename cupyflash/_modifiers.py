"""Score modifiers: their exact semantics, their validation, and the resolved form every back end reads.

The scores of query ``i`` and key ``j`` (in one batch entry; ``off = Nk - Nq``) are built in this order:

    s_ij = scale * q_i . k_j
    s_ij = softcap * tanh(s_ij / softcap)             if softcap > 0
    s_ij = s_ij - slope * |i + off - j|               if alibi_slopes is given (slope of this batch entry)
    s_ij = s_ij + bias[..., i, j]                     if bias is given
    s_ij = -inf                                       if key j is hidden from query i

and key ``j`` is hidden from query ``i`` when any of these holds:

    causal and j > i + off                            (bottom-right aligned)
    window = (left, right), left  != -1 and j < i + off - left
    window = (left, right), right != -1 and j > i + off + right
    mask is given and mask[..., i, j] is False
    block_mask is given and block_mask[..., i // 128, j // 128] is False

Then ``P = softmax(s)`` over the keys, ``out = P v`` and ``lse = logsumexp(s)``; a row where every key is
hidden has ``out = 0``, ``lse = -inf`` and zero gradients. The gradient of the bias is that of the final
scores, ``dbias = dS = P * (dP - rowsum(P * dP))`` with ``dP = dout v^T``, summed over the dims along
which the bias was broadcast.

``resolve`` validates the options of one call and returns a ``Modifiers`` holding each array broadcast
(as a stride-0 view, never materialized) to the problem's full shape, or ``None`` when every option is
off: then the plain kernels run and the options cost nothing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from cupyflash._arrays import Array, cupy, is_cupy
from cupyflash._checks import check_array

BLOCK_MASK_TILE = 128  # queries x keys covered by one block_mask element; part of the public API


@dataclass(frozen=True)
class Modifiers:
    """The resolved options of one call. Arrays are views broadcast to the full problem shape."""

    window: tuple[int, int]  # (left, right); -1 = unbounded on that side; (-1, -1) = no window
    softcap: float  # 0.0 = off
    alibi_slopes: object  # float32 (*batch) or None
    bias: object  # (*batch, Nq, Nk), the inputs' dtype or float32, or None
    bias_shape: tuple  # the bias's own shape (that of dbias), or None
    mask: object  # bool (*batch, Nq, Nk) or None
    block_mask: object  # bool (*batch, ceil(Nq/128), ceil(Nk/128)) or None

    def window_with_causal(self, causal: bool) -> tuple[int, int]:
        """The window with the causal mask folded in: causal is the window (left, 0)."""
        left, right = self.window
        if causal:
            right = 0 if right == -1 else min(right, 0)
        return left, right


def resolve(
    xp, dtype, batch, nq, nk, *, window=None, softcap=0.0, alibi_slopes=None, bias=None, mask=None, block_mask=None
):
    """Validate the score-modifier options of one call; ``None`` when every one of them is off.

    ``xp`` is the inputs' array module, ``dtype`` their dtype, ``batch`` their broadcast leading shape.
    """
    if (
        window is None
        and type(softcap) is float
        and softcap == 0.0
        and alibi_slopes is None
        and bias is None
        and mask is None
        and block_mask is None
    ):
        return None  # every option at its default (the common call), nothing to check
    window = check_window(window)
    softcap = check_softcap(softcap)
    full = tuple(batch) + (nq, nk)
    grid = tuple(batch) + (math.ceil(nq / BLOCK_MASK_TILE), math.ceil(nk / BLOCK_MASK_TILE))
    if alibi_slopes is not None:
        alibi_slopes = _check_array("alibi_slopes", alibi_slopes, xp, tuple(batch), "the leading dims")
        if alibi_slopes.dtype.kind != "f":
            raise TypeError(f"alibi_slopes must be a floating-point array (used as float32), got {alibi_slopes.dtype}")
        alibi_slopes = alibi_slopes.astype(np.float32, copy=False)
    bias_shape = None
    if bias is not None:
        bias = _check_array("bias", bias, xp, full, "(..., Nq, Nk)")
        if bias.dtype not in (np.dtype(dtype), np.dtype(np.float32)):
            expected = "float32" if np.dtype(dtype) == np.float32 else f"the inputs' dtype {np.dtype(dtype)} or float32"
            raise TypeError(f"bias has dtype {bias.dtype}; expected {expected}")
        bias_shape = bias.shape
    if mask is not None:
        mask = _check_array("mask", mask, xp, full, "(..., Nq, Nk)")
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean array (True = the key takes part), got dtype {mask.dtype}")
    if block_mask is not None:
        block_mask = _check_array(
            "block_mask", block_mask, xp, grid, f"(..., ceil(Nq/{BLOCK_MASK_TILE}), ceil(Nk/{BLOCK_MASK_TILE}))"
        )
        if block_mask.dtype != np.bool_:
            raise TypeError(
                f"block_mask must be a boolean array (True = the tile takes part), got dtype {block_mask.dtype}"
            )
    if window == (-1, -1) and softcap == 0.0 and all(x is None for x in (alibi_slopes, bias, mask, block_mask)):
        return None
    views = [
        None if x is None else xp.broadcast_to(x, shape)
        for x, shape in ((alibi_slopes, tuple(batch)), (bias, full), (mask, full), (block_mask, grid))
    ]
    return Modifiers(window, softcap, views[0], views[1], bias_shape, views[2], views[3])


def check_window(window):
    """``None`` or a pair ``(left, right)`` of integers >= -1; returns the pair, (-1, -1) for None."""
    if window is None:
        return (-1, -1)
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of integers >= -1 or None, got {window!r}")
    pair = []
    for side, value in zip(("left", "right"), window):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window {side} must be an integer >= -1 (-1 = unbounded), got {value!r}")
        if value < -1:
            raise ValueError(f"window {side} must be >= -1 (-1 = unbounded), got {value}")
        pair.append(int(value))
    return tuple(pair)


def check_softcap(softcap):
    """A finite real number >= 0 (0 = off); returned as a float."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number >= 0 (0 = off), got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def _check_array(name, x, xp, shape, described):
    """x must be an array of module xp (on the current device) that broadcasts to ``shape``."""
    if not isinstance(x, xp.ndarray):
        raise TypeError(
            f"{name} must be a {xp.__name__}.ndarray like q, k, v, got {type(x).__module__}.{type(x).__qualname__}"
        )
    check_array(name, x)
    if xp is not np:
        current = xp.cuda.Device().id
        if x.device.id != current:
            raise ValueError(f"{name} is on device {x.device.id} but the current device is {current}")
    try:
        fits = np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} has shape {x.shape}, which does not broadcast to {described} = {shape}")
    return x


def block_mask_from_dense(mask: Array, block: int = BLOCK_MASK_TILE) -> Array:
    """The block mask of a dense boolean mask: a tile is True when any of its elements is True.

    Parameters
    ----------
    mask : numpy.ndarray or cupy.ndarray of bool, shape (..., Nq, Nk)
    block : int
        The tile size; must be ``cupyflash.BLOCK_MASK_TILE`` (128), the tile the kernels skip by.

    Returns
    -------
    block_mask : array of bool, shape (..., ceil(Nq/128), ceil(Nk/128)), of mask's array type
        Passing it with ``mask`` gives the same result as ``mask`` alone, with the empty tiles skipped.

    Examples
    --------
    Every query sees the first 10 keys only: of the 3 x 3 tiles of 128 x 128, only the first
    column has a key in use, so the other key tiles are never loaded.

    >>> import numpy as np
    >>> import cupyflash
    >>> mask = np.zeros((300, 300), dtype=bool)                          # (Nq, Nk)
    >>> mask[:, :10] = True
    >>> block_mask = cupyflash.block_mask_from_dense(mask)
    >>> block_mask
    array([[ True, False, False],
           [ True, False, False],
           [ True, False, False]])
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 300, 32), dtype=np.float32) for _ in range(3))
    >>> out = cupyflash.attention(q, k, v, mask=mask, block_mask=block_mask)
    >>> bool(np.allclose(out, cupyflash.attention(q, k, v, mask=mask), atol=1e-6))
    True
    """
    if block != BLOCK_MASK_TILE:
        raise ValueError(f"block must be {BLOCK_MASK_TILE}, the tile the kernels skip by, got {block!r}")
    if not (isinstance(mask, np.ndarray) or is_cupy(mask)) or mask.ndim < 2:
        raise TypeError(
            f"mask must be a numpy or cupy array of shape (..., Nq, Nk), got {type(mask).__name__}"
            + (f" of shape {mask.shape}" if hasattr(mask, "shape") else "")
        )
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array, got dtype {mask.dtype}")
    nq, nk = mask.shape[-2:]
    gq, gk = math.ceil(nq / block), math.ceil(nk / block)
    pad = [(0, 0)] * (mask.ndim - 2) + [(0, gq * block - nq), (0, gk * block - nk)]
    xp = np if isinstance(mask, np.ndarray) else cupy
    padded = xp.pad(mask, pad, constant_values=False)
    tiles = padded.reshape(mask.shape[:-2] + (gq, block, gk, block))
    return tiles.any(axis=(-3, -1))
