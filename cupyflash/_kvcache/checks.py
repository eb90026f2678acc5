"""The arguments of ``attention_with_kvcache``: their checks and the resolved ``KVCacheCall`` that the CPU
path, the reference and the GPU back end read.

Layouts (``B`` sequences, ``Hq`` query heads over ``Hk`` key/value heads, ``G = Hq // Hk``):

    q             (B, Hq, Nq, D)
    k_cache       (B, Hk, Ncache, D)  contiguous, or (num_pages, Hk, page_size, D) with a block table
    v_cache       like k_cache with Dv
    k, v          (B, Hk, Nnew, D / Dv), appended at positions cache_seqlens[b] ... + Nnew
    cache_seqlens (B,) int32 or int64 (or a sequence of ints, or one int for every sequence)
    block_table   (B, max_pages) int32 or int64 (or nested sequences of ints): page block_table[b, p] holds
                  positions p*page_size ... + page_size

The index arguments follow _checks.index_array's rule; int32 arrays are read in place, others are copied to
int32 per call. Values that live on the GPU (``cache_seqlens``, ``block_table``) are checked on the host only
where that costs no synchronisation (NumPy arrays, sequences, Python ints) or when ``CUPYFLASH_CHECK_VALUES=1``
asks for it; otherwise the kernels check them: a sequence whose values are out of range gets NaN out and lse
rows, no memory outside the arrays is touched, and none of its new keys is written when its cache_seqlens is
out of range (with a block-table entry outside the cache, only the positions of that page are skipped). Where
the block table's values are checked, a page that new keys are appended into must also be used by no other
sequence or position: two appends into one page would write the same positions, which no kernel can tell.
q, k and v are read with a unit last stride: where theirs is not, they are copied (they are small).

FP8 caches (cupyflash._kvcache.fp8.FP8KVCache, both caches or neither) take the place of the cache arrays: q, k
and v keep one dtype of their own, out comes back in it, and the new k and v must be finite (e4m3 has no
infinity; the CPU path raises, the GPU stores NaN codes that read back as NaN). On the GPU q is float16 or
bfloat16: the kernel widens the codes to float16 for its products (q too).
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import numpy as np

from cupyflash._arrays import cupy, lse_dtype
from cupyflash._checks import (
    MAX_HEAD_DIM,
    MAX_SPLITS,
    SUPPORTED_DTYPES,
    check_array_types,
    check_bool,
    check_dtypes,
    index_array,
    int32_indices,
    resolve_scale,
)
from cupyflash._fp8.tensor import FP8Tensor
from cupyflash._kvcache.fp8 import FP8KVCache
from cupyflash._modifiers import check_softcap, check_window

FP8_GPU_DTYPES = ("float16", "bfloat16")  # q's dtypes with FP8 caches on the GPU (16-bit products)


@dataclass(frozen=True)
class KVCacheCall:
    """One resolved call. Arrays are of the inputs' module (numpy or cupy); the caches arrays or FP8KVCache
    holders (``fp8``, both or neither); ``cache_seqlens`` is int32
    (B,), or None for CuPy inputs given one int for every sequence (``seqlen_all``, passed to the kernels
    by value), ``block_table`` int32 (B, max_pages) or None, ``rotary_cos/sin`` ``lse_dtype`` (max_pos,
    rotary_dim / 2) or None, ``alibi_slopes`` float32 (B, Hq) (maybe a broadcast view) or None."""

    xp: object
    q: object
    k_cache: object
    v_cache: object
    k: object
    v: object
    cache_seqlens: object
    seqlen_all: int | None
    block_table: object
    rotary_cos: object
    rotary_sin: object
    rotary_interleaved: bool
    causal: bool
    scale: float
    window: tuple  # (left, right), -1 = unbounded; causal not folded in
    softcap: float
    alibi_slopes: object
    num_splits: int | None
    return_lse: bool

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def hq(self) -> int:
        return self.q.shape[1]

    @property
    def hk(self) -> int:
        return self.k_cache.shape[1]

    @property
    def group(self) -> int:
        return self.hq // self.hk

    @property
    def nq(self) -> int:
        return self.q.shape[2]

    @property
    def nnew(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    @property
    def d(self) -> int:
        return self.q.shape[3]

    @property
    def dv(self) -> int:
        return self.v_cache.shape[3]

    @property
    def fp8(self) -> bool:
        """Whether the caches are FP8KVCache holders (e4m3 codes and float32 scales)."""
        return isinstance(self.k_cache, FP8KVCache)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int:
        """Positions per page (paged); Ncache for a contiguous cache, one 'page' per sequence."""
        return self.k_cache.shape[2]

    @property
    def capacity(self) -> int:
        """Positions a sequence can hold: Ncache, or max_pages * page_size."""
        return self.block_table.shape[1] * self.k_cache.shape[2] if self.paged else self.k_cache.shape[2]

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rotary_cos is None else 2 * self.rotary_cos.shape[1]

    def window_with_causal(self) -> tuple:
        """The window with the causal mask folded in: causal is the window (left, 0)."""
        left, right = self.window
        if self.causal:
            right = 0 if right == -1 else min(right, 0)
        return left, right

    def rotary_query_positions_advance(self) -> bool:
        return queries_advance(self.causal, self.window)

    def rotary_span(self) -> int:
        return rotary_span(self.nnew, self.nq, self.rotary_query_positions_advance())


def queries_advance(causal: bool, window: tuple) -> bool:
    """Whether query i is rotated at cache_seqlens + i (causal or a window) rather than at cache_seqlens for
    every query: FlashAttention-2's rule, so that ported models get the same numbers."""
    return causal or window != (-1, -1)


def rotary_span(nnew: int, nq: int, advance: bool) -> int:
    """Rotary positions a sequence uses from cache_seqlens on: its new keys', and its queries' (Nq of them when
    they advance, else one). The kernels check the same (kvcache.cuh, sequence_length)."""
    return max(nnew, nq if advance else min(nq, 1))


def check_values_requested() -> bool:
    """CUPYFLASH_CHECK_VALUES=1: check GPU-resident cache_seqlens and block_table on the host (a
    device-to-host copy per call) and raise, instead of the kernels' NaN rows."""
    return os.environ.get("CUPYFLASH_CHECK_VALUES", "0") not in ("", "0")


def resolve(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    block_table=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
    causal=False,
    scale=None,
    window=None,
    softcap=0.0,
    alibi_slopes=None,
    num_splits=None,
    return_lse=False,
) -> KVCacheCall:
    """Check every argument of ``attention_with_kvcache``; the resolved call."""
    fp8 = _fp8_caches(k_cache, v_cache)
    caches = dict(k_cache=k_cache, v_cache=v_cache)
    arrays = dict(q=q) if fp8 else dict(q=q, **caches)  # the arrays of one shared dtype
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if k is not None:
        arrays.update(k=k, v=v)
    others = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, alibi_slopes=alibi_slopes)
    others = {name: x for name, x in others.items() if x is not None}
    if fp8:
        others.update({f"{name}.{part}": getattr(c, part) for name, c in caches.items() for part in ("data", "scale")})
    xp = check_array_types({**arrays, **others})
    if fp8 and xp is not np and q.dtype.name not in FP8_GPU_DTYPES:
        raise TypeError(
            f"q has dtype {q.dtype}; with FP8 caches on the GPU q must be float16 or bfloat16 (the kernel widens "
            "the e4m3 codes to float16 for its products). Float32 and float64 queries take FP8 caches on the CPU "
            "path (NumPy arrays)"
        )
    seqlens_host = None
    if not _is_int(cache_seqlens):
        cache_seqlens, seqlens_host = index_array(
            "cache_seqlens", cache_seqlens, xp, "an int, a sequence of ints or an int32 or int64 array"
        )
    table_host = None
    if block_table is not None:
        block_table, table_host = index_array("block_table", block_table, xp)
    check_dtypes(arrays)
    for name, x in {**arrays, **caches}.items():
        if x.ndim != 4:
            expected = {"q": "(B, Hq, Nq, D)", "k": "(B, Hk, Nnew, D)", "v": "(B, Hk, Nnew, Dv)"}.get(
                name, "(B, Hk, Ncache, D) or (num_pages, Hk, page_size, D) with a block_table"
            )
            raise ValueError(f"{name} must have 4 dims {expected}, got shape {x.shape}")
    batch, hq, nq, d = q.shape
    hk = k_cache.shape[1]
    dv = v_cache.shape[3]
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must agree in every dim but the last")
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache has head dim {k_cache.shape[3]}; expected q's head dim D = {d}")
    for what, dim in (("D (q.shape[-1])", d), ("Dv (v_cache.shape[-1])", dv)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {what} is {dim}; supported head dims are 1 to {MAX_HEAD_DIM}")
    if hk < 1 or hq % hk:
        raise ValueError(
            f"q has {hq} heads and k_cache {hk}; the query heads Hq must be a multiple of the "
            f"key/value heads Hk (query head h reads key/value head h // (Hq // Hk))"
        )
    paged = block_table is not None
    if paged:
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"block_table must be (B, max_pages) = ({batch}, max_pages), got shape {block_table.shape}"
            )
        if block_table.dtype != np.int32 or (block_table.size and block_table.strides[1] != block_table.itemsize):
            block_table = int32_indices(xp, block_table)  # the kernels read each row's pages contiguously, int32
        if k_cache.shape[2] < 1:
            raise ValueError(f"a paged k_cache (num_pages, Hk, page_size, D) needs page_size >= 1, got {k_cache.shape}")
        capacity = block_table.shape[1] * k_cache.shape[2]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"k_cache has {k_cache.shape[0]} sequences (dim 0) but q has B = {batch}; a contiguous "
                "cache is (B, Hk, Ncache, D) (a paged one needs block_table)"
            )
        capacity = k_cache.shape[2]
    nnew = 0
    if k is not None:
        nnew = k.shape[2]
        if k.shape != (batch, hk, nnew, d):
            raise ValueError(f"k has shape {k.shape}; expected (B, Hk, Nnew, D) = ({batch}, {hk}, Nnew, {d})")
        if v.shape != (batch, hk, nnew, dv):
            raise ValueError(f"v has shape {v.shape}; expected (B, Hk, Nnew, Dv) = ({batch}, {hk}, {nnew}, {dv})")
        for name, cache in caches.items():
            if fp8:
                _check_writable(f"{name}.data", cache.data)
                if cache.scaling == "block":  # the first position of a block sets its scale
                    _check_writable(f"{name}.scale", cache.scale)
                    if xp is not np and paged and cache.shape[2] % cache.block:
                        raise ValueError(
                            f"{name} has pages of {cache.shape[2]} positions with a scale per {cache.block}: the GPU "
                            "appends into block scales only where a page holds whole blocks (pages of up to 128 "
                            "positions or a multiple of 128, or one scale per page: scale of shape (num_pages, Hk, "
                            "1)). Use such pages, or append on the CPU path"
                        )
            else:
                _check_writable(name, cache)
        if fp8 and xp is np:
            for name, x in (("k", k), ("v", v)):
                if not np.isfinite(x).all():
                    raise ValueError(
                        f"{name} holds NaN or infinite values; FP8 caches store finite values only (e4m3fn has "
                        "no infinity)"
                    )
    for name, x in () if fp8 else caches.items():  # (an FP8KVCache's data was checked when it was made)
        if x.size and x.shape[3] > 1 and x.strides[3] != x.itemsize:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride {x.itemsize} bytes), got strides {x.strides}"
            )
    q = _unit_last_stride(xp, q)
    if k is not None:
        k, v = _unit_last_stride(xp, k), _unit_last_stride(xp, v)
    seqlens, seqlen_all, lengths = _resolve_seqlens(xp, cache_seqlens, seqlens_host, batch, capacity - nnew, paged)
    if paged and lengths is not None and (table_host is not None or check_values_requested()):
        _check_block_table(
            block_table if table_host is None else table_host, k_cache.shape[0], lengths, nnew, k_cache.shape[2]
        )
    causal = check_bool("causal", causal)
    window = check_window(window)
    span = rotary_span(nnew, nq, queries_advance(causal, window))
    cos, sin = _resolve_rotary(xp, rotary_cos, rotary_sin, d, q.dtype, lengths, span)
    softcap = check_softcap(softcap)
    scale = resolve_scale(scale, d)
    if alibi_slopes is not None:
        if alibi_slopes.dtype.kind != "f":
            raise TypeError(f"alibi_slopes must be a floating-point array (used as float32), got {alibi_slopes.dtype}")
        try:
            alibi_slopes = xp.broadcast_to(alibi_slopes.astype(np.float32, copy=False), (batch, hq))
        except ValueError:
            raise ValueError(
                f"alibi_slopes has shape {alibi_slopes.shape}; expected (Hq,) = ({hq},) or (B, Hq) = ({batch}, {hq})"
            ) from None
    if num_splits is not None:
        if (
            isinstance(num_splits, (bool, np.bool_))
            or not isinstance(num_splits, numbers.Integral)
            or not 1 <= num_splits <= MAX_SPLITS
        ):
            raise ValueError(
                f"num_splits must be None (chosen per call) or an integer from 1 to {MAX_SPLITS}, got {num_splits!r}"
            )
        num_splits = int(num_splits)
    return KVCacheCall(
        xp,
        q,
        k_cache,
        v_cache,
        k,
        v,
        seqlens,
        seqlen_all,
        block_table,
        cos,
        sin,
        check_bool("rotary_interleaved", rotary_interleaved),
        causal,
        scale,
        window,
        softcap,
        alibi_slopes,
        num_splits,
        check_bool("return_lse", return_lse),
    )


def _fp8_caches(k_cache, v_cache) -> bool:
    """Whether the caches are FP8KVCache holders (both, or an error names the one that is not); FP8Tensor, the
    FP8 forward's holder, is refused by name."""
    caches = dict(k_cache=k_cache, v_cache=v_cache)
    for name, cache in caches.items():
        if isinstance(cache, FP8Tensor):
            raise TypeError(
                f"{name} is an FP8Tensor, the FP8 forward's holder; an FP8 cache is an FP8KVCache "
                "(cupyflash.quantize_kvcache, or FP8KVCache(data, scale, scaling))"
            )
    held = [name for name, cache in caches.items() if isinstance(cache, FP8KVCache)]
    if len(held) == 1:
        (plain,) = set(caches) - set(held)
        raise TypeError(
            f"{held[0]} is an FP8KVCache but {plain} is not; pass both caches as FP8KVCache holders or neither"
        )
    return bool(held)


def _unit_last_stride(xp, x):
    """x itself when its last dim is contiguous, else a contiguous copy (q, k, v: the step's few rows)."""
    if x.shape[-1] <= 1 or x.strides[-1] == x.itemsize:
        return x
    return xp.ascontiguousarray(x)


def _check_writable(name, cache):
    """New keys are written in place: the cache must be writable and no two of its elements may share memory
    (a broadcast view would)."""
    if isinstance(cache, np.ndarray) and not cache.flags.writeable:
        raise ValueError(f"{name} is read-only; k and v are appended to it in place (pass a writable array)")
    for n, stride in zip(cache.shape, cache.strides):
        if n > 1 and stride == 0:
            raise ValueError(
                f"{name} is a broadcast view (stride 0 in a dim of size {n}); k and v are appended "
                "to it in place, so every position needs its own memory"
            )


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _resolve_seqlens(xp, cache_seqlens, host, batch, limit, paged):
    """(cache_seqlens as int32 (B,) of module xp or None, the one int for every sequence or None, the lengths
    on the host where they are known without a synchronisation (``host``: index_array's) or checking is asked
    for, else None); the values checked where they are on the host."""
    where = "max_pages * page_size" if paged else "Ncache"
    if _is_int(cache_seqlens):
        n = int(cache_seqlens)
        _check_seqlen_values(np.array([n]), limit, where)
        lengths = np.full((batch,), n, dtype=np.int32)
        return (lengths, None, lengths) if xp is np else (None, n, lengths)
    if cache_seqlens.ndim != 1 or cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must be an int or of shape (B,) = ({batch},), got shape {cache_seqlens.shape}")
    lengths = host
    if lengths is None and check_values_requested():
        lengths = cupy.asnumpy(cache_seqlens)
    if lengths is not None:
        _check_seqlen_values(lengths, limit, where)
    # The kernels read it as a contiguous int32 vector: a cast or a strided view is copied (int32_indices: values
    # past int32 stay out of range, so that the kernels give NaN rows).
    return int32_indices(xp, cache_seqlens), None, lengths


def _check_seqlen_values(values, limit, where):
    bad = np.flatnonzero((values < 0) | (values > limit))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"cache_seqlens[{b}] = {int(values[b])} is out of range: cache_seqlens + Nnew must lie "
            f"in 0 .. {where} (here cache_seqlens <= {limit})"
        )


def _check_block_table(block_table, num_pages, lengths, nnew, page_size):
    """Every page a sequence uses (positions below cache_seqlens + Nnew) must exist, and a page that k and v are
    appended into must be used nowhere else: sharing a page to read it (a common prefix) is fine, but two
    sequences appending into one page, or one appending over keys that another reads, write the same positions."""
    table = block_table if isinstance(block_table, np.ndarray) else cupy.asnumpy(block_table)
    first = np.arange(table.shape[1], dtype=np.int64)[None, :] * page_size  # each page's first position
    end = lengths[:, None].astype(np.int64) + nnew
    used = first < end
    bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, p = (int(x) for x in bad[0])
        raise ValueError(
            f"block_table[{b}, {p}] = {int(table[b, p])} is not a page of k_cache (0 .. num_pages - 1 "
            f"= {num_pages - 1})"
        )
    if not nnew:
        return
    written = used & (first + page_size > end - nnew)  # pages holding positions cache_seqlens .. + Nnew - 1
    uses = np.bincount(table[used].astype(np.int64), minlength=num_pages)
    shared = np.argwhere(written & (uses[np.where(used, table, 0)] > 1))
    if shared.size:
        b, p = (int(x) for x in shared[0])
        page = int(table[b, p])
        others = [(int(c), int(r)) for c, r in np.argwhere(used & (table == page)) if (c, r) != (b, p)]
        raise ValueError(
            f"block_table[{b}, {p}] = {page}: k and v would be appended into page {page}, which "
            f"block_table[{others[0][0]}, {others[0][1]}] uses too; a page that new keys are written "
            "into must be used by no other sequence or position (a page may be shared to be read, "
            "such as a common prefix, where it lies wholly below the cache_seqlens of every sequence "
            "that uses it)"
        )


def _resolve_rotary(xp, cos, sin, d, dtype, lengths, span):
    """cos and sin as contiguous accumulator-dtype arrays; the positions used checked where ``lengths`` (the
    host's copy of cache_seqlens, or None) are known."""
    if cos is None and sin is None:
        return None, None
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if cos.ndim != 2 or cos.shape != sin.shape:
        raise ValueError(f"rotary_cos {cos.shape} and rotary_sin {sin.shape} must both be (max_pos, rotary_dim / 2)")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= d:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be in 2 .. D = {d}")
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        if x.dtype.kind != "f" and x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
    max_pos = cos.shape[0]
    if lengths is not None and lengths.size and span and int(lengths.max()) + span > max_pos:
        b = int(np.argmax(lengths))
        raise ValueError(
            f"rotary_cos has {max_pos} positions but sequence {b} needs position "
            f"{int(lengths[b]) + span - 1} (the last new key's or query's)"
        )
    acc = lse_dtype(dtype)
    return (xp.ascontiguousarray(cos, dtype=acc), xp.ascontiguousarray(sin, dtype=acc))
