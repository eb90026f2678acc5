"""FP8 (e4m3fn) key/value caches: the holder ``FP8KVCache``, its three scale layouts, ``quantize_kvcache``, and
the two rules every back end follows: how an element is read (its code's e4m3 value times its scale) and how
appended rows are written (quantized with the cache's scales; a block's scale set by the call that writes its
first position).

Layouts (``dim0`` is B for a contiguous cache, num_pages for a paged one; ``N`` is Ncache or page_size):

    data    (dim0, Hk, N, D) uint8, the bytes of float8 e4m3fn values; any strides with a contiguous last dim
    scale   "tensor": (1, 1, 1)      one for the whole cache
            "head":   (1, Hk, 1)     one per key/value head, shared by every sequence (or page)
            "block":  (dim0, Hk, nb) one per head and block of BLOCK_POSITIONS positions of dim 2 (a page's
                                     own when pages hold 128 positions or fewer), nb = ceil(N / 128); or
                                     (dim0, Hk, 1): one per head and page (or sequence), whatever N

Element ``[i, h, p, d]`` stands for ``e4m3(data[i, h, p, d]) * scale[i, h, p // block]``, each index of scale
taken as 0 where its dim is 1. Not FP8Tensor, the FP8 forward's holder, which is immutable (the GPU forward keeps
copies derived from its arrays) and has no scale shared by the sequences of a head: a cache and its block scales
are written in place at every step.

Scales leave a headroom of 16, ``scale = amax / 28`` (448 is e4m3's largest value): decoding sets a block's scale
from its first row, and the block's later rows must still fit. 16 is a power of two, so a value that stays a
normal e4m3 number is rounded exactly as with no headroom (docs/design/fp8_kvcache.md measures both).

Appends write ``e4m3(x / scale)``, the division in float32 (float64 for float64 inputs), rounded to nearest even
and saturating: a value beyond 448 scale is stored as +-448 scale, as the GPU's ``cvt.rn.satfinite`` stores it.
"tensor" and "head" scales are never changed by an append (shared: changing one would mean quantizing every
element under it again). A "block" scale is set by the call that writes the block's first position (slot ``p``
with ``p % block == 0``), per head, from the amax over the rows that call writes into the block (one row when
decoding, a prompt's share at prefill); later positions of the block keep it and saturate beyond it.
"""

from __future__ import annotations

import math

import numpy as np

from cupyflash._arrays import Array, array_module, from_float, is_cupy, to_float
from cupyflash._checks import check_float_array
from cupyflash._fp8.tensor import E4M3_MAX, FLOAT_DTYPES, INPUT_DTYPES, check_codes_and_scale, decode_e4m3, encode_e4m3

SCALINGS = ("tensor", "head", "block")
BLOCK_POSITIONS = 128  # every key tile of the decode kernel (16 to 128 keys) lies in one block of a contiguous cache
HEADROOM = 16  # a power of two: the normal values' rounding does not depend on it
SCALE_DIVISOR = np.float32(E4M3_MAX / HEADROOM)  # 28: a block's largest value when its scale was set


class FP8KVCache:
    """A key or value cache of float8 e4m3fn values with float32 scales: a cache argument of
    ``attention_with_kvcache``, written in place by its appends.

    :func:`quantize_kvcache` makes one from a 16-bit cache; the constructor wraps arrays made elsewhere (an
    empty cache: zero codes and the scales, below). The holder keeps the arrays, not copies: appends write
    their codes (and, with ``scaling="block"``, their scales) in place.

    Parameters
    ----------
    data : uint8 array, shape (B, Hk, Ncache, D) or paged (num_pages, Hk, page_size, D)
        The bytes of float8 e4m3fn values (``ml_dtypes.float8_e4m3fn``; ``data.view(float8_e4m3fn)`` on NumPy
        shows them). Any strides with a contiguous last dim, as 16-bit caches (FlashAttention's (B, S, Hk, D)
        storage passes as a ``.transpose(0, 2, 1, 3)`` view). NumPy or CuPy.
    scale : float32 array, C-contiguous
        The descales. Element ``[i, h, p, d]`` of the cache stands for ``e4m3(data[i, h, p, d]) * scale[i, h,
        p // block]``, an index taken as 0 where scale's dim is 1. Its shape by ``scaling``: ``"tensor"`` (1, 1,
        1); ``"head"`` (1, Hk, 1); ``"block"`` (dim0, Hk, ceil(N / 128)), one per block of 128 positions of
        dim 2 (per page for pages of up to 128 positions), or (dim0, Hk, 1), one per page (or sequence). Same
        array module (and CuPy device) as ``data``; finite and > 0 (not checked).
    scaling : {"tensor", "head", "block"}
        Which scales the cache has. It decides what an append does: "tensor" and "head" scales stay as they
        are; a "block" scale is set by the call that writes the block's first position (see
        ``attention_with_kvcache``).

    Returns
    -------
    FP8KVCache
        With ``data``, ``scale``, ``scaling``, ``block`` (positions of dim 2 per scale: 128, or N where a
        slice has one), ``shape`` (= ``data.shape``), ``nbytes`` and :meth:`dequantize`.

    Examples
    --------
    An empty paged pool of 64 pages of 16 positions, one scale per page and head, set by the appends:

    >>> import numpy as np
    >>> import cupyflash
    >>> k_cache = cupyflash.FP8KVCache(np.zeros((64, 2, 16, 128), np.uint8), np.ones((64, 2, 1), np.float32),
    ...                                "block")
    >>> k_cache
    FP8KVCache(shape=(64, 2, 16, 128), scaling='block', scale=(64, 2, 1), block=16, numpy)
    >>> k_cache.nbytes
    262656
    """

    __slots__ = ("data", "scale", "scaling", "block")

    def __init__(self, data: Array, scale: Array, scaling: str):
        block = _check_holder(data, scale, scaling)
        for name, value in (("data", data), ("scale", scale), ("scaling", scaling), ("block", block)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"FP8KVCache's arrays are written in place, never replaced: cannot set {name}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return 4

    @property
    def xp(self):
        """numpy or cupy: the array module of data and scale."""
        return array_module(self.data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def __repr__(self) -> str:
        kind = "cupy" if is_cupy(self.data) else "numpy"
        return (
            f"FP8KVCache(shape={self.shape}, scaling={self.scaling!r}, scale={self.scale.shape}, "
            f"block={self.block}, {kind})"
        )

    def dequantize(self, dtype=np.float32) -> Array:
        """The cache's values ``e4m3(data) * scale`` as ``dtype`` (float16, bfloat16, float32 or float64),
        shape ``data.shape``, of data's array type. The product is computed in float32 (exactly, in float64,
        for float64) and rounded once to ``dtype``."""
        dtype = np.dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype is {dtype}; expected float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64")
        work = np.float64 if dtype == np.float64 else np.float32
        return from_float(decode_e4m3(self.data, work) * self.position_scales(work)[..., None], dtype)

    def position_scales(self, dtype=np.float32) -> Array:
        """The scale of every position, shape (dim0 or 1, Hk or 1, N), as ``dtype``."""
        xp, n = self.xp, self.shape[2]
        return xp.repeat(self.scale.astype(dtype), self.block, axis=2)[:, :, :n]


def _check_holder(data, scale, scaling):
    """FP8KVCache's arguments checked; the positions per scale along dim 2."""
    check_codes_and_scale(data, scale)
    if data.ndim != 4:
        raise ValueError(
            f"data must have 4 dims (B, Hk, Ncache, D) or (num_pages, Hk, page_size, D), got shape {data.shape}"
        )
    if data.size and data.shape[3] > 1 and data.strides[3] != 1:
        raise ValueError(f"data must have a contiguous last dim (stride 1 byte), got strides {data.strides}")
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(map(repr, SCALINGS))}, got {scaling!r}")
    dim0, hk, n, _ = data.shape
    blocks = math.ceil(n / BLOCK_POSITIONS)
    expected = {"tensor": [(1, 1, 1)], "head": [(1, hk, 1)], "block": [(dim0, hk, blocks), (dim0, hk, 1)]}[scaling]
    if scale.shape not in expected:
        what = {
            "tensor": "one scale for the whole cache",
            "head": "one per key/value head",
            "block": f"one per head and block of {BLOCK_POSITIONS} positions, or one per head and page (or sequence)",
        }[scaling]
        raise ValueError(
            f"scale has shape {scale.shape}; expected {' or '.join(map(str, expected))} for scaling={scaling!r} "
            f"({what}) with data of shape {data.shape}"
        )
    if not scale.flags.c_contiguous:
        raise ValueError(f"scale must be C-contiguous (strides {scale.strides} for shape {scale.shape})")
    if scaling == "block" and scale.shape[2] == blocks and blocks > 1:
        return BLOCK_POSITIONS
    return max(n, 1)


def quantize_kvcache(cache: Array, scaling: str = "block") -> FP8KVCache:
    """Quantize a key or value cache to float8 e4m3fn with float32 scales, one per tensor, per head or per
    block of positions.

    Each group of elements that shares a scale gets ``scale = amax(|x|) / 28`` (448, e4m3fn's largest value,
    over a headroom of 16 for the values appended later; a group of zeros gets 1.0), and each element the e4m3fn
    value nearest to ``x / scale`` (float32 arithmetic, ties to even), as appends quantize. Every position
    is quantized: a cache's unused positions should hold zeros (or any finite values within the range of the
    rest), since they count in the amax of their group.

    Parameters
    ----------
    cache : numpy.ndarray or cupy.ndarray, shape (B, Hk, Ncache, D) or paged (num_pages, Hk, page_size, D)
        float16, bfloat16 (``ml_dtypes.bfloat16``) or float32, finite; any strides.
    scaling : {"block", "tensor", "head"}, optional
        ``"block"`` (default): one scale per head and block of 128 positions of dim 2 (a page's own when pages
        hold 128 positions or fewer), scale shape (dim0, Hk, ceil(N / 128)). ``"head"``: one per key/value head,
        (1, Hk, 1). ``"tensor"``: one for the whole cache, (1, 1, 1).

    Returns
    -------
    FP8KVCache
        data (uint8, the cache's shape and memory order) and scale (float32), of the cache's array type.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> k_cache = np.random.default_rng(0).standard_normal((2, 4, 300, 64), dtype=np.float32)
    >>> k8 = cupyflash.quantize_kvcache(k_cache)
    >>> k8.scale.shape, cupyflash.quantize_kvcache(k_cache, "head").scale.shape
    ((2, 4, 3), (1, 4, 1))
    >>> bool(np.all(np.abs(k8.dequantize() - k_cache) <= 2.0**-4 * np.abs(k_cache) + 2.0**-10 * k8.scale.max()))
    True
    """
    check_float_array(
        "cache", cache, INPUT_DTYPES, "float16, bfloat16 (ml_dtypes.bfloat16) or float32", "(dim0, Hk, N, D)"
    )
    if cache.ndim != 4:
        raise ValueError(
            f"cache must have 4 dims (B, Hk, Ncache, D) or (num_pages, Hk, page_size, D), got shape {cache.shape}"
        )
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(map(repr, SCALINGS))}, got {scaling!r}")
    xp = array_module(cache)
    x = to_float(cache, np.float32)
    if not bool(xp.isfinite(x).all()):
        raise ValueError("cache holds NaN or infinite values; quantize_kvcache takes finite values only")
    dim0, hk, n, d = x.shape
    position_amax = xp.abs(x).max(axis=3) if d else xp.zeros((dim0, hk, n), np.float32)  # (dim0, Hk, N)
    if scaling == "block":
        blocks = max(1, math.ceil(n / BLOCK_POSITIONS))
        padded = xp.zeros((dim0, hk, blocks * BLOCK_POSITIONS), np.float32)
        padded[:, :, :n] = position_amax
        amax = padded.reshape(dim0, hk, blocks, BLOCK_POSITIONS).max(axis=3)
    else:
        axes = (0, 1, 2) if scaling == "tensor" else (0, 2)
        amax = position_amax.max(axis=axes, keepdims=True) if position_amax.size else xp.zeros((1, 1, 1), np.float32)
        amax = xp.broadcast_to(amax, (1, hk if scaling == "head" else 1, 1))
    scale = xp.ascontiguousarray(scales_of(amax))
    data = xp.empty_like(cache, dtype=np.uint8)  # the cache's memory order
    holder = FP8KVCache(data, scale, scaling)
    data[...] = encode_e4m3(x / holder.position_scales()[..., None])
    return holder


def scales_of(amax):
    """The scale of a group whose largest magnitude is ``amax`` (float32, any shape): amax / 28 in float32,
    1.0 for a group of zeros."""
    xp = array_module(amax)
    amax = amax.astype(np.float32)
    return xp.where(amax == 0, np.float32(1), amax / SCALE_DIVISOR).astype(np.float32)


# ------------------------------------------------------------------------------------ reads and appends
def read(holder: FP8KVCache, index0, slots, dtype) -> np.ndarray:
    """The values at positions (``index0[j]``, ``slots[j]``) of dims 0 and 2, shape (Hk, n, D), as ``dtype``
    (the compute dtype: float32, or float64): ``e4m3(code) * scale``, with one rounding in float32 (none in
    float64)."""
    codes = holder.data[index0, :, slots].transpose(1, 0, 2)  # (Hk, n, D): the indexed dims come first
    return decode_e4m3(codes, dtype) * _scales_at(holder, index0, slots).astype(dtype)[..., None]


def write(holder: FP8KVCache, index0, slots, rows) -> None:
    """Append ``rows`` (Hk, n, D), the new keys or values in the compute dtype (float32, or float64; finite),
    at positions (``index0[j]``, ``slots[j]``) of dims 0 and 2, in place: a "block" holder's blocks whose first
    position is among them get their scales from these rows first (the module docstring's rule); then every row
    is quantized with its position's scale, saturating at +-448."""
    if holder.scaling == "block":
        blocks = slots // holder.block
        first = slots % holder.block == 0
        for i, blk in set(zip(index0[first].tolist(), blocks[first].tolist())):
            members = (index0 == i) & (blocks == blk)  # this call's rows of block (i, blk)
            amax = np.abs(rows[:, members]).max(axis=(1, 2)) if rows.shape[2] else np.zeros(rows.shape[0])
            holder.scale[i, :, blk] = scales_of(amax.astype(np.float32))
    scales = _scales_at(holder, index0, slots).astype(rows.dtype)  # (Hk, n)
    holder.data[index0, :, slots] = encode_e4m3(rows / scales[..., None]).transpose(1, 0, 2)


def _scales_at(holder, index0, slots):
    """The scale of each position (``index0[j]``, ``slots[j]``): float32 (Hk, n), broadcast over the heads for
    "tensor"."""
    scale = holder.scale
    rows = index0 if scale.shape[0] > 1 else np.zeros_like(index0)
    return scale[rows, :, slots // holder.block].T  # (a slice of one scale has block = N: index 0)
