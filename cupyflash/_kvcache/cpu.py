"""The CPU path of ``attention_with_kvcache`` for NumPy inputs: append the new keys and values to the caches,
then attend each sequence over its keys with the tiled CPU forward (cupyflash._cpu).

Per sequence ``b``, with ``L_b = cache_seqlens[b] + Nnew`` keys: gather positions ``0 .. L_b - 1`` of the
caches (a view when contiguous, through ``block_table`` when paged), group the query heads as (Hk, G) so that
k and v broadcast (stride 0) over the G query heads of each key/value head, and run the forward bottom-right
aligned: query ``i`` sits at position ``L_b - Nq + i``. Memory per sequence is the gathered keys and values
plus the forward's tiles: linear in ``L_b``, never ``Nq x L_b``.

Rotary embeddings are computed in the compute dtype (float32; float64 for float64 inputs) and rounded once
to the inputs' dtype: the new keys because the cache holds that dtype, q because that is how the kernels
feed it to the matrix units.

FP8 caches (FP8KVCache): the new keys (rotated, not rounded to q's dtype) and values are quantized into them from
the compute dtype by cupyflash._kvcache.fp8.write, and a sequence's positions are read back as their values
``e4m3(code) * scale`` in the compute dtype (fp8.read): attention then runs as on those values, in float32
(float64 for float64 q), out rounded once to q's dtype.
"""

import numpy as np

from cupyflash import _cpu, _modifiers
from cupyflash._arrays import lse_dtype, quiet_float_errors
from cupyflash._kvcache import fp8 as _fp8


@quiet_float_errors
def attention_with_kvcache(call):
    """Append ``call.k``, ``call.v`` (if any), then attend: out (B, Hq, Nq, Dv) in the inputs' dtype and
    lse (B, Hq, Nq) ``lse_dtype``; a sequence with no key (L_b = 0) gets out 0 and lse -inf."""
    append(call)
    hk, g, nq = call.hk, call.group, call.nq
    out = np.zeros((call.batch, call.hq, nq, call.dv), dtype=call.dtype)
    lse = np.full((call.batch, call.hq, nq), -np.inf, dtype=lse_dtype(call.dtype))
    for b in range(call.batch):
        length = int(call.cache_seqlens[b]) + call.nnew
        if length == 0:
            continue
        q = _queries(call, b).reshape(hk, g, nq, call.d)
        k, v = (
            np.broadcast_to(_gather(call, cache, b, length)[:, None], (hk, g, length, cache.shape[3]))
            for cache in (call.k_cache, call.v_cache)
        )
        slopes = None if call.alibi_slopes is None else call.alibi_slopes[b].reshape(hk, g)
        mods = _modifiers.resolve(
            np, call.dtype, (hk, g), nq, length, window=call.window, softcap=call.softcap, alibi_slopes=slopes
        )
        out_b, lse_b = _cpu.attention_forward(q, k, v, scale=call.scale, causal=call.causal, mods=mods)
        out[b] = out_b.reshape(call.hq, nq, call.dv)
        lse[b] = lse_b.reshape(call.hq, nq)
    return out, lse


@quiet_float_errors
def append(call):
    """Write the new keys (rotated) and values into the caches at positions cache_seqlens[b] + j, in place."""
    if call.nnew == 0:
        return
    # An FP8 cache quantizes from the compute dtype; a 16-bit one stores its own dtype.
    dtype = lse_dtype(call.dtype) if call.fp8 else call.dtype
    for b in range(call.batch):
        positions = int(call.cache_seqlens[b]) + np.arange(call.nnew)
        k = call.k[b] if call.rotary_dim == 0 else _rotate(call, call.k[b], positions, dtype)
        pages, slots = _locate(call, b, positions)
        if call.fp8:
            _fp8.write(call.k_cache, pages, slots, k.astype(dtype))
            _fp8.write(call.v_cache, pages, slots, call.v[b].astype(dtype))
            continue
        # Two index arrays around a slice: the indexed dims come first, (Nnew, Hk, D).
        call.k_cache[pages, :, slots] = k.transpose(1, 0, 2)
        call.v_cache[pages, :, slots] = call.v[b].transpose(1, 0, 2)


def _queries(call, b):
    """Sequence b's q (Hq, Nq, D), rotated when rotary is on: query i at cache_seqlens[b] + i, or every query
    at cache_seqlens[b] (KVCacheCall.rotary_query_positions_advance)."""
    if call.rotary_dim == 0:
        return call.q[b]
    start = int(call.cache_seqlens[b])
    steps = np.arange(call.nq) if call.rotary_query_positions_advance() else np.zeros(call.nq, dtype=np.int64)
    return _rotate(call, call.q[b], start + steps)


def _rotate(call, x, positions, dtype=None):
    """x (..., n, D) with row i rotated at ``positions[i]`` on its first rotary_dim dims: a copy, computed in
    the rotary tables' dtype (lse_dtype) and rounded once to ``dtype`` (None: x's)."""
    cos, sin = call.rotary_cos[positions], call.rotary_sin[positions]  # (n, rotary_dim / 2)
    r = call.rotary_dim
    rotated = x.astype(cos.dtype)  # a copy; dims from rotary_dim on stay as they are
    # Interleaved (GPT-J) pairs dims (2i, 2i + 1); otherwise (GPT-NeoX) dim i pairs with i + r / 2.
    if call.rotary_interleaved:
        first, second = slice(0, r, 2), slice(1, r, 2)
    else:
        first, second = slice(0, r // 2), slice(r // 2, r)
    x1, x2 = rotated[..., first], rotated[..., second]  # views: both right-hand sides are computed before storing
    x1[...], x2[...] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return rotated.astype(x.dtype if dtype is None else dtype)


def _gather(call, cache, b, length):
    """Positions 0 .. length - 1 of sequence b in ``cache``: (Hk, length, D), a view when contiguous (FP8: their
    values in the compute dtype)."""
    if call.fp8:
        return _fp8.read(cache, *_locate(call, b, np.arange(length)), lse_dtype(call.dtype))
    if not call.paged:
        return cache[b, :, :length]
    pages, slots = _locate(call, b, np.arange(length))
    return cache[pages, :, slots].transpose(1, 0, 2)


def _locate(call, b, positions):
    """Where sequence b's ``positions`` live: (index along the cache's dim 0, index along its dim 2)."""
    if not call.paged:
        return np.full(positions.shape, b), positions
    return call.block_table[b, positions // call.page_size], positions % call.page_size
