"""FP8 (e4m3fn) tensors for the FP8 attention forward: the holder ``FP8Tensor``, ``quantize_fp8`` and the
e4m3fn encoder and decoder, in plain array code for NumPy and CuPy alike (the module of the input).

An ``FP8Tensor`` keeps the bytes of float8 e4m3fn values (``ml_dtypes.float8_e4m3fn``) as uint8 and a float32
"descale" per block of rows: the real value of an element is its e4m3 value times the scale of its row
block, ``x[..., i, :] ~= e4m3(data[..., i, :]) * scale[..., i // block]``.

Rounding to e4m3fn is that of PTX's ``cvt.rn.satfinite``: to nearest, ties to even, saturating at +-448.
The 127 non-negative finite e4m3fn values are the codes 0x00..0x7E in increasing order, so the code of
``|y|`` is the number of midpoints between neighbours below it (a binary search), moved up by one on an
exact tie with an odd code (the code's last bit is the mantissa's last bit); the sign is bit 0x80. The
midpoints are exact in float32, so the search decides every tie exactly, in NumPy and CuPy alike.
"""

from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

from cupyflash._arrays import Array, array_module, from_float, is_cupy, to_float
from cupyflash._checks import check_array, check_float_array

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value
BLOCK_ROWS = 128  # a row block of several scales holds whole key blocks and warpgroup rows of the GPU kernel
SCALE_DTYPE = np.dtype(np.float32)
INPUT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))
FLOAT_DTYPES = INPUT_DTYPES + (np.dtype(np.float64),)

# The float32 value of each of the 256 codes (NaN for 0x7F and 0xFF): dequantization is ``DECODE_TABLE[data]``.
DECODE_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
# The non-negative finite values, codes 0x00..0x7E, increasing; the midpoints between neighbours.
_VALUES = DECODE_TABLE[:0x7F]
_MIDPOINTS = (_VALUES[:-1] + _VALUES[1:]) / np.float32(2)
assert (np.diff(_VALUES) > 0).all() and _VALUES[-1] == E4M3_MAX
assert ((_MIDPOINTS.astype(np.float64) * 2) == (_VALUES[:-1].astype(np.float64) + _VALUES[1:])).all()


def encode_e4m3(y):
    """The e4m3fn codes (uint8) of float32 or float64 y, rounded to nearest even, saturating at +-448.

    ``y`` must be finite (a NaN would encode as the largest value). Exactly ``y.astype(float8_e4m3fn)``
    wherever ``|y| <= 448``; larger magnitudes saturate to 448 (0x7E) instead of becoming NaN.
    """
    xp = array_module(y)
    midpoints = xp.asarray(_MIDPOINTS.astype(y.dtype))
    a = xp.abs(y)
    code = xp.searchsorted(midpoints, a, side="left")  # midpoints strictly below |y|: 0..126
    # |y| exactly at the midpoint between codes c and c + 1 (c = code) goes to the even one of them.
    below = xp.minimum(code, midpoints.size - 1)
    tie = (midpoints[below] == a) & ((code & 1) == 1)
    code = (code + tie).astype(xp.uint8)
    return code | (xp.signbit(y).astype(xp.uint8) << 7)


def decode_e4m3(data, dtype=np.float32):
    """The values (float32 or float64) of the e4m3fn codes ``data`` (uint8); NaN for 0x7F and 0xFF."""
    xp = array_module(data)
    return xp.asarray(DECODE_TABLE.astype(dtype))[data]


def row_scales(scale, block, n):
    """The scale of each row, shape (*scale.shape[:-1], n): row i takes ``scale[..., i // block]``."""
    xp = array_module(scale)
    # A block of at least n rows is one scale per slice: never repeat past n (block may be huge).
    return xp.repeat(scale, min(block, max(n, 1)), axis=-1)[..., :n]


class FP8Tensor:
    """Float8 e4m3fn values with a float32 scale per block of rows: the input of the FP8 attention forward.

    :func:`quantize_fp8` builds one; the constructor takes arrays made elsewhere (e.g. an FP8 KV cache).
    Immutable: its arrays are kept, not copied, and must not be written afterwards. The GPU forward keeps
    what it derives from a holder with it (v's bytes transposed for the kernel, descale tables, copies of
    broadcast data), so that later calls on the same holder skip that work: about the holder's data size
    again for a holder used as v, freed with the holder.

    Parameters
    ----------
    data : uint8 array, shape (*lead, N, D), C-contiguous
        The bytes of float8 e4m3fn values (``ml_dtypes.float8_e4m3fn``; ``data.view(float8_e4m3fn)`` on
        NumPy shows them). NumPy or CuPy.
    scale : float32 array, shape (*lead_s, nb), C-contiguous
        The descale: element ``[..., i, d]`` stands for ``e4m3(data[..., i, d]) * scale[..., i // block]``.
        ``lead_s`` is ``lead`` (a scale per leading-dim slice) or all ones (per tensor, broadcast), and
        ``nb = ceil(N / block)``. Same array module (and CuPy device) as ``data``. Finite and > 0 (not
        checked).
    block : int
        Rows per scale: ``N`` (or more) for one scale per slice, otherwise a positive multiple of 128
        (the GPU kernel's row blocks); quantize_fp8 gives 1 when N = 0.

    Returns
    -------
    FP8Tensor
        With ``shape`` (= ``data.shape``), ``ndim``, ``nbytes`` and :meth:`dequantize`.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> x = np.random.default_rng(0).standard_normal((2, 4, 300, 64), dtype=np.float32)
    >>> x8 = cupyflash.quantize_fp8(x, block=128)
    >>> x8
    FP8Tensor(shape=(2, 4, 300, 64), scale=(2, 4, 3), block=128, numpy)
    >>> y = cupyflash.FP8Tensor(x8.data, x8.scale, block=128)             # the same, from its arrays
    >>> bool(np.abs(y.dequantize() - x).max() <= 0.0625 * np.abs(x).max())
    True
    """

    __slots__ = ("data", "scale", "block", "_kept")

    def __init__(self, data: Array, scale: Array, block: int):
        block = _check_holder(data, scale, block, contiguous=True)
        _set(self, data, scale, block)

    def kept(self, key, derive):
        """``derive()``, computed once per ``key`` and kept with the holder: the back ends' arrays derived
        from its data and scale, which never change."""
        kept = self._kept
        found = kept.get(key)
        if found is None:
            found = kept.setdefault(key, derive())
        return found

    def __setattr__(self, name, value):
        raise AttributeError(f"FP8Tensor is immutable: cannot set {name}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def xp(self):
        """numpy or cupy: the array module of data and scale."""
        return array_module(self.data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def __repr__(self) -> str:
        kind = "cupy" if is_cupy(self.data) else "numpy"
        return f"FP8Tensor(shape={self.shape}, scale={self.scale.shape}, block={self.block}, {kind})"

    def dequantize(self, dtype=np.float32) -> Array:
        """The values ``e4m3(data) * scale`` as ``dtype`` (float16, bfloat16, float32 or float64), shape
        ``data.shape``, of data's array type. The product is computed in float32 (exactly in float64 for
        float64) and rounded once to ``dtype``."""
        dtype = np.dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype is {dtype}; expected float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64")
        work = np.dtype(np.float64 if dtype == np.float64 else np.float32)
        scales = row_scales(self.scale.astype(work), self.block, self.shape[-2])
        return from_float(decode_e4m3(self.data, work) * scales[..., None], dtype)

    def broadcast_to(self, lead: tuple[int, ...]) -> "FP8Tensor":
        """The same values with leading dims ``lead`` (NumPy broadcasting): stride-0 views of data and
        scale, not copied (so no longer C-contiguous: only the attention back ends take these)."""
        xp = self.xp
        if self.shape[:-2] == lead and self.scale.shape[:-1] == lead:
            return self
        held = object.__new__(FP8Tensor)
        _set(
            held,
            xp.broadcast_to(self.data, lead + self.shape[-2:]),
            xp.broadcast_to(self.scale, lead + self.scale.shape[-1:]),
            self.block,
        )
        return held


def _set(holder, data, scale, block):
    object.__setattr__(holder, "data", data)
    object.__setattr__(holder, "scale", scale)
    object.__setattr__(holder, "block", block)
    object.__setattr__(holder, "_kept", {})


def check_codes_and_scale(data, scale) -> None:
    """What every holder of e4m3 codes checks of its arrays (FP8Tensor's, FP8KVCache's): arrays, of one array type
    and device, uint8 codes and float32 scales."""
    for name, x in (("data", data), ("scale", scale)):
        check_array(name, x)
    if is_cupy(data) != is_cupy(scale):
        raise TypeError(
            f"data is {'cupy' if is_cupy(data) else 'numpy'} but scale is "
            f"{'cupy' if is_cupy(scale) else 'numpy'}; they must be of one array type"
        )
    if is_cupy(data) and data.device.id != scale.device.id:
        raise ValueError(
            f"data is on device {data.device.id} but scale on device {scale.device.id}; they must be on one device"
        )
    if data.dtype != np.uint8:
        raise TypeError(f"data has dtype {data.dtype}; expected uint8 (the bytes of float8_e4m3fn values)")
    if scale.dtype != SCALE_DTYPE:
        raise TypeError(f"scale has dtype {scale.dtype}; expected float32")


def _check_holder(data, scale, block, contiguous):
    check_codes_and_scale(data, scale)
    if data.ndim < 2:
        raise ValueError(f"data must have at least 2 dims (..., N, D), got shape {data.shape}")
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral):
        raise TypeError(f"block must be an int, got {block!r} ({type(block).__name__})")
    if block < 1:
        raise ValueError(f"block must be a positive int, got {block}")
    block = int(block)
    n = data.shape[-2]
    if block < n and block % BLOCK_ROWS:
        raise ValueError(
            f"block is {block} for N = {n} rows; expected a multiple of {BLOCK_ROWS} (the GPU "
            f"kernel's tile of rows) or at least N (one scale per slice)"
        )
    lead = data.shape[:-2]
    nb = math.ceil(n / block)
    ones = (1,) * len(lead)
    if scale.shape not in (lead + (nb,), ones + (nb,)):
        raise ValueError(
            f"scale has shape {scale.shape}; expected {lead + (nb,)} (a scale per slice and block of "
            f"{block} rows) or {ones + (nb,)} (per tensor) for data of shape {data.shape}"
        )
    if contiguous:
        for name, x in (("data", data), ("scale", scale)):
            if not x.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous (strides {x.strides} for shape {x.shape})")
    return block


def quantize_fp8(x: Array, *, block: int | str | None = None) -> FP8Tensor:
    """Quantize x to float8 e4m3fn with a float32 scale per leading-dim slice, per tensor or per row block.

    Each group of elements that shares a scale gets ``scale = amax(|x|) / 448`` (448 is e4m3fn's largest
    value; a group of zeros gets 1.0), and each element the e4m3fn value nearest to ``x / scale`` (ties to
    even, float32 arithmetic), as the GPU's ``cvt.rn.satfinite`` rounds.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray, shape (*lead, N, D)
        float16, bfloat16 (``ml_dtypes.bfloat16``) or float32, finite; at least 2 dims.
    block : None, "tensor" or int, optional
        ``None`` (default): one scale per slice ``x[..., :, :]`` (per sequence and head, as in
        FlashAttention-3), scale shape ``(*lead, 1)``. ``"tensor"``: one scale for all of x, scale shape
        ``(1, ..., 1, 1)``. An int: one scale per ``block`` rows of each slice, a positive multiple of 128
        (the GPU kernel's row blocks), scale shape ``(*lead, ceil(N / block))``.

    Returns
    -------
    FP8Tensor
        data (uint8, shape of x) and scale (float32), of x's array type (and CuPy device).

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 1000, 128), dtype=np.float32)
    >>> cupyflash.quantize_fp8(x).scale.shape, cupyflash.quantize_fp8(x, block="tensor").scale.shape
    ((2, 8, 1), (1, 1, 1))
    >>> x8 = cupyflash.quantize_fp8(x, block=256)
    >>> x8.scale.shape, x8.data.dtype.name, x8.nbytes == x.nbytes // 4 + x8.scale.nbytes
    ((2, 8, 4), 'uint8', True)
    """
    check_float_array("x", x, INPUT_DTYPES, "float16, bfloat16 (ml_dtypes.bfloat16) or float32", "(..., N, D)")
    xp = array_module(x)
    *lead, n, d = x.shape
    lead = tuple(lead)
    rows = _resolve_block(block, n)
    x32 = to_float(x, np.float32)
    if not bool(xp.isfinite(x32).all()):
        raise ValueError("x holds NaN or infinite values; quantize_fp8 takes finite inputs only")
    row_amax = xp.abs(x32).max(axis=-1) if d else xp.zeros(lead + (n,), np.float32)  # (*lead, N)
    nb = math.ceil(n / rows)
    if block == "tensor":
        amax = xp.concatenate([row_amax.ravel(), xp.zeros(1, np.float32)]).max()
        amax = xp.broadcast_to(amax, (1,) * len(lead) + (nb,))
    else:
        padded = xp.zeros(lead + (nb * rows,), np.float32)
        padded[..., :n] = row_amax
        amax = padded.reshape(lead + (nb, rows)).max(axis=-1)
    scale = xp.where(amax == 0, np.float32(1), amax / np.float32(E4M3_MAX)).astype(np.float32)
    data = encode_e4m3(x32 / row_scales(scale, rows, n)[..., None])
    return FP8Tensor(xp.ascontiguousarray(data), xp.ascontiguousarray(scale), rows)


def _resolve_block(block, n):
    """The rows per scale for quantize_fp8's ``block`` on N = n rows (1 when n = 0)."""
    if block is None or (isinstance(block, str) and block == "tensor"):
        return max(n, 1)
    if isinstance(block, str):
        raise ValueError(f"block must be None, 'tensor' or a positive multiple of {BLOCK_ROWS}, got {block!r}")
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral):
        raise TypeError(f"block must be None, 'tensor' or an int, got {block!r} ({type(block).__name__})")
    if block < 1 or block % BLOCK_ROWS:
        raise ValueError(
            f"block must be a positive multiple of {BLOCK_ROWS} (the GPU kernel's row blocks), got {block}"
        )
    return int(block)
