"""The float64 reference of ``attention_with_kvcache`` and of rotary embeddings, re-exported by
cupyflash.reference.

Written from the semantics alone, sharing no code with the CPU path or its argument checks: the caches are
updated one position at a time, each sequence's keys are read back one position at a time, and the scores
are the whole (Hq, Nq, L_b) matrix with every rule applied at the positions the docstring names.

FP8 caches (FP8KVCache) are read as e4m3 values (ml_dtypes' decoding) times their scales, and written by the
append rule of cupyflash/_kvcache/fp8.py, here in code of its own: a block's new scale from the amax of the rows
the call writes into it, each value divided by its scale in the compute dtype (float32; float64 for float64 q)
and rounded to e4m3 by the spacing of its binade, ties to even, saturating at +-448.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from cupyflash._arrays import is_cupy, quiet_float_errors
from cupyflash._checks import check_bool, resolve_scale
from cupyflash._kvcache.fp8 import FP8KVCache
from cupyflash._modifiers import check_softcap, check_window

E4M3_MAX = 448.0
SCALE_DIVISOR = np.float32(28)  # 448 / 16: a block's scale leaves its largest value at 28, a headroom of 16


@quiet_float_errors
def rotary(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray | list[int], interleaved: bool = False
) -> np.ndarray:
    """Rotary position embedding in float64: row ``i`` of ``x`` rotated at position ``positions[i]``.

    With ``r = rotary_dim = 2 * cos.shape[1]``, ``c = cos[p]``, ``s = sin[p]`` and ``i < r / 2``:

        interleaved=False (GPT-NeoX):  x'[i]      = x[i] c[i] - x[i + r/2] s[i]
                                       x'[i + r/2] = x[i + r/2] c[i] + x[i] s[i]
        interleaved=True  (GPT-J):     x'[2i]     = x[2i] c[i] - x[2i + 1] s[i]
                                       x'[2i + 1] = x[2i + 1] c[i] + x[2i] s[i]

    and dims from ``r`` on are unchanged.

    Parameters
    ----------
    x : numpy.ndarray, shape (..., n, D)
    cos, sin : numpy.ndarray, shape (max_pos, rotary_dim / 2), rotary_dim <= D
    positions : integers, shape (n,)
    interleaved : bool, optional

    Returns
    -------
    numpy.ndarray, shape (..., n, D), float64 (x is not modified)

    Examples
    --------
    A rotation by the angle ``theta * position`` of each pair (here one pair, a quarter turn at position 1):

    >>> import numpy as np
    >>> from cupyflash import reference
    >>> angles = np.array([[0.0], [np.pi / 2]])                                  # (max_pos, 1)
    >>> x = np.array([[1.0, 0.0, 5.0]])                                          # (n, D), rotary_dim 2
    >>> reference.rotary(x, np.cos(angles), np.sin(angles), [1]).round(12)
    array([[0., 1., 5.]])
    """
    x, cos, sin = (_float64(name, a) for name, a in (("x", x), ("cos", cos), ("sin", sin)))
    positions = np.asarray(positions, dtype=np.int64)
    half = cos.shape[1]
    if cos.shape != sin.shape or not 0 < 2 * half <= x.shape[-1]:
        raise ValueError(
            f"cos {cos.shape} and sin {sin.shape} must be (max_pos, rotary_dim / 2) with rotary_dim "
            f"in 2 .. D = {x.shape[-1]}"
        )
    first = np.arange(0, 2 * half, 2) if interleaved else np.arange(half)
    second = first + (1 if interleaved else half)
    c, s = cos[positions], sin[positions]
    out = x.copy()
    out[..., first] = x[..., first] * c - x[..., second] * s
    out[..., second] = x[..., second] * c + x[..., first] * s
    return out


@quiet_float_errors
def attention_with_kvcache(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    k: np.ndarray | None = None,
    v: np.ndarray | None = None,
    *,
    cache_seqlens: int | np.ndarray,
    block_table: np.ndarray | None = None,
    rotary_cos: np.ndarray | None = None,
    rotary_sin: np.ndarray | None = None,
    rotary_interleaved: bool = False,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    return_lse: bool = False,
    return_caches: bool = False,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Reference :func:`cupyflash.attention_with_kvcache` in float64; its inputs are never modified.

    New key ``j`` of sequence ``b`` is rotated at position ``cache_seqlens[b] + j`` and written there (into
    page ``block_table[b, pos // page_size]``, slot ``pos % page_size`` when paged); then query ``i`` sits at
    position ``L_b - Nq + i`` among the ``L_b = cache_seqlens[b] + Nnew`` keys for causal, window and ALiBi,
    and is rotated at ``cache_seqlens[b] + i`` (causal or window) or ``cache_seqlens[b]`` (otherwise). Query
    head ``h`` reads key/value head ``h // (Hq // Hk)``.

    Parameters
    ----------
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved, causal,
    scale, window, softcap, alibi_slopes
        As in :func:`cupyflash.attention_with_kvcache`, NumPy arrays of any float dtype; the caches may be NumPy
        FP8KVCache holders (both or neither), read as their values and appended to by their rule, with the
        new keys and values quantized from float32 (float64 for float64 q).
    return_lse : bool, optional
        Also return the log-sum-exp.
    return_caches : bool, optional
        Also return float64 copies of the caches after the append (FP8 caches: FP8KVCache holders of copies of
        their codes and scales).

    Returns
    -------
    out : numpy.ndarray, shape (B, Hq, Nq, Dv), float64
    lse : numpy.ndarray, shape (B, Hq, Nq), float64; only with ``return_lse`` (-inf for rows that see no key)
    k_cache, v_cache : numpy.ndarray, float64, the caches' shapes (or FP8KVCache); only with ``return_caches``

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 1, 16), dtype=np.float32)
    >>> k_cache, v_cache = (rng.standard_normal((2, 2, 10, 16), dtype=np.float32) for _ in range(2))
    >>> k, v = (rng.standard_normal((2, 2, 1, 16), dtype=np.float32) for _ in range(2))
    >>> seqlens = np.array([3, 9], np.int32)
    >>> ref, ref_k_cache, _ = reference.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
    ...                                                        return_caches=True)
    >>> out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    >>> bool(np.abs(out - ref).max() < 1e-5), bool((k_cache == ref_k_cache).all())
    (True, True)
    """
    q, compute = _float64("q", q), (np.float64 if q.dtype == np.float64 else np.float32)  # FP8 appends' dtype
    if isinstance(k_cache, FP8KVCache) != isinstance(v_cache, FP8KVCache):
        raise TypeError("k_cache and v_cache must both be FP8KVCache holders or neither")
    k_cache, v_cache = (
        _E4M3Cache(name, x, compute) if isinstance(x, FP8KVCache) else _float64(name, x)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache))
    )
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together or both be None")
    batch, hq, nq, d = q.shape
    hk, dv = k_cache.shape[1], v_cache.shape[3]
    if k is None:
        k, v = np.zeros((batch, hk, 0, d)), np.zeros((batch, hk, 0, dv))
    k, v = _float64("k", k), _float64("v", v)
    if hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of k_cache's {hk}")
    group, nnew = hq // hk, k.shape[2]
    seqlens = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (batch,))
    pages = _Pages(block_table, k_cache.shape[2])
    rotate = (
        None
        if rotary_cos is None
        else functools.partial(
            rotary,
            cos=_float64("rotary_cos", rotary_cos),
            sin=_float64("rotary_sin", rotary_sin),
            interleaved=check_bool("rotary_interleaved", rotary_interleaved),
        )
    )
    causal, window, softcap = check_bool("causal", causal), check_window(window), check_softcap(softcap)
    scale = resolve_scale(scale, d)
    slopes = (
        None
        if alibi_slopes is None
        else np.broadcast_to(np.asarray(alibi_slopes).astype(np.float32).astype(np.float64), (batch, hq))
    )
    out, lse = np.zeros((batch, hq, nq, dv)), np.full((batch, hq, nq), -np.inf)
    for b in range(batch):
        start = int(seqlens[b])
        length = start + nnew
        if not 0 <= start <= length <= pages.capacity(k_cache):
            raise ValueError(f"cache_seqlens[{b}] = {start}: its {length} keys do not fit the cache")
        new_keys = k[b] if rotate is None else rotate(k[b], positions=start + np.arange(nnew))
        wheres = [pages.locate(b, start + j, k_cache) for j in range(nnew)]  # whichever page holds each
        for cache, rows in ((k_cache, new_keys), (v_cache, v[b])):
            if isinstance(cache, _E4M3Cache):
                cache.append(wheres, rows)
                continue
            for j, where in enumerate(wheres):  # one position at a time
                cache[where] = rows[:, j]
        if length == 0:
            continue
        keys, values = (
            np.stack([cache[pages.locate(b, pos, cache)] for pos in range(length)], axis=1)
            for cache in (k_cache, v_cache)
        )  # (Hk, L_b, D)
        queries = q[b]
        if rotate is not None:
            advance = causal or window != (-1, -1)
            queries = rotate(queries, positions=start + (np.arange(nq) if advance else np.zeros(nq, dtype=np.int64)))
        out[b], lse[b] = _attend(
            queries,
            np.repeat(keys, group, axis=0),
            np.repeat(values, group, axis=0),
            length - nq + np.arange(nq),
            scale,
            causal,
            window,
            softcap,
            None if slopes is None else slopes[b],
        )
    if isinstance(k_cache, _E4M3Cache):
        k_cache, v_cache = k_cache.holder(), v_cache.holder()
    results = (out,) + ((lse,) if return_lse else ()) + ((k_cache, v_cache) if return_caches else ())
    return results if len(results) > 1 else out


def _attend(q, k, v, positions, scale, causal, window, softcap, slopes):
    """Query rows at ``positions`` (Nq,) against keys at 0 .. L - 1: out (H, Nq, Dv) and lse (H, Nq)."""
    s = scale * (q @ k.swapaxes(-1, -2))  # (H, Nq, L)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    i, j = positions[:, None], np.arange(k.shape[1])[None, :]
    if slopes is not None:
        s = s - slopes[:, None, None] * np.abs(i - j)
    left, right = window
    hidden = (causal & (j > i)) | ((left != -1) & (j < i - left)) | ((right != -1) & (j > i + right))
    s = np.where(hidden, -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    blind = np.isneginf(m)  # every key hidden: out 0, lse -inf
    e = np.exp(s - np.where(blind, 0, m))
    total = e.sum(axis=-1, keepdims=True)
    out = (e / np.where(blind, 1, total)) @ v
    lse = np.where(blind, -np.inf, m + np.log(np.where(blind, 1, total)))
    return out, lse[..., 0]


class _Pages:
    """Where position ``pos`` of sequence ``b`` lives: page ``block_table[b, pos // page_size]``, slot
    ``pos % page_size``; without a block table, row ``b`` of the cache, slot ``pos``."""

    def __init__(self, block_table, page_size):
        self.table = None if block_table is None else np.asarray(block_table, dtype=np.int64)
        self.page_size = page_size

    def capacity(self, cache):
        """Positions a sequence can hold."""
        return cache.shape[2] if self.table is None else self.table.shape[1] * self.page_size

    def locate(self, b, pos, cache):
        """The index of (that position's) (Hk, D) slice of ``cache``."""
        if self.table is None:
            return b, slice(None), pos
        page = int(self.table[b, pos // self.page_size])
        if not 0 <= page < cache.shape[0]:
            raise ValueError(f"block_table[{b}, {pos // self.page_size}] = {page} is not a page of the cache")
        return page, slice(None), pos % self.page_size


class _E4M3Cache:
    """An FP8KVCache as the reference reads and appends to it: copies of its codes and scales; ``cache[i, :,
    slot]`` is that position's (Hk, D) values in float64, ``e4m3(code) * scale``."""

    def __init__(self, name, holder, compute):
        if is_cupy(holder.data):
            raise TypeError(f"{name} holds CuPy arrays; the reference runs on NumPy: pass an FP8KVCache of NumPy ones")
        self.codes, self.scale = np.array(holder.data), np.array(holder.scale)
        self.scaling, self.block, self.compute = holder.scaling, holder.block, compute
        self.shape = holder.shape

    def __getitem__(self, where):
        i, _, slot = where
        return self.codes[i, :, slot].view(ml_dtypes.float8_e4m3fn).astype(np.float64) * self._scale(i, slot)

    def _scale(self, i, slot):
        """The (Hk or 1, 1) float32 scales of position (i, slot)."""
        return self.scale[i if self.scale.shape[0] > 1 else 0, :, slot // self.block][:, None]

    def append(self, wheres, rows):
        """Write rows (Hk, n, D) at positions ``wheres``: rounded to the compute dtype; the scales of "block"
        blocks whose first position is among them from the amax of the rows that land in the block; then each
        value divided by its scale and rounded to e4m3."""
        rows = rows.astype(self.compute)
        blocks = [(i, slot // self.block) for i, _, slot in wheres]
        if self.scaling == "block":
            for first in {blocks[j] for j, (_, _, slot) in enumerate(wheres) if slot % self.block == 0}:
                members = [j for j, block in enumerate(blocks) if block == first]
                amax = np.abs(rows[:, members]).max(axis=(1, 2), initial=0).astype(np.float32)
                self.scale[first[0], :, first[1]] = np.where(amax == 0, np.float32(1), amax / SCALE_DIVISOR)
        for j, (i, _, slot) in enumerate(wheres):
            self.codes[i, :, slot] = _e4m3_codes(rows[:, j] / self._scale(i, slot).astype(self.compute))

    def holder(self):
        return FP8KVCache(self.codes, self.scale, self.scaling)


def _e4m3_codes(y):
    """The e4m3fn codes of float32 or float64 y, rounded to the nearest value, ties to even, saturating at
    +-448: y rounded on the spacing of its binade [2^e, 2^(e+1)), 2^(e-3) (3 mantissa bits), the subnormals
    sharing 2^-6's spacing 2^-9."""
    y = y.astype(np.float64)  # exact
    _, e = np.frexp(y)  # |y| in [2^(e-1), 2^e)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    # y / step is exact (a power of two), and an even multiple of the step is an even code.
    nearest = np.clip(np.rint(y / step) * step, -E4M3_MAX, E4M3_MAX)
    return nearest.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _float64(name, x):
    """A float64 NumPy copy (never a view of the caller's array)."""
    if is_cupy(x):
        raise TypeError(f"{name} is a CuPy array; the reference runs on NumPy: pass {name}.get()")
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__qualname__}")
    return np.array(x, dtype=np.float64)
