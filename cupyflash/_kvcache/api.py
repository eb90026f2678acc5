"""Attention against a key/value cache, for decoding: ``attention_with_kvcache``.

NumPy inputs run on the CPU path (cupyflash._kvcache.cpu), CuPy inputs on the GPU (cupyflash._cuda.decode), FP8
caches (cupyflash._kvcache.fp8) on either.
The semantics are written out in the docstring below and in the inference page of the documentation
(``python -m cupyflash --docs inference``).
"""

from __future__ import annotations

import numpy as np

from cupyflash._arrays import Array, is_cupy, lse_dtype
from cupyflash._cuda import decode as _gpu_decode
from cupyflash._cuda import plans
from cupyflash._kvcache import checks as _kvcache_args
from cupyflash._kvcache import cpu as _kvcache_cpu
from cupyflash._kvcache.fp8 import FP8KVCache


def attention_with_kvcache(
    q: Array,
    k_cache: Array | FP8KVCache,
    v_cache: Array | FP8KVCache,
    k: Array | None = None,
    v: Array | None = None,
    *,
    cache_seqlens: int | Array,
    block_table: Array | None = None,
    rotary_cos: Array | None = None,
    rotary_sin: Array | None = None,
    rotary_interleaved: bool = False,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
) -> Array | tuple[Array, Array]:
    """Attention of new queries against a key/value cache, appending new keys and values to it first.

    Parameters
    ----------
    q : array (B, Hq, Nq, D)
        The queries of this step (Nq = 1 for plain decoding; more for speculative decoding or a chunk).
    k_cache, v_cache : arrays (B, Hk, Ncache, D) and (B, Hk, Ncache, Dv), or paged (num_pages, Hk,
        page_size, D / Dv) with ``block_table``
        Any strides with a contiguous last dim (FlashAttention's (B, S, H, D) caches pass as
        ``.transpose(0, 2, 1, 3)`` views). ``Hq`` must be a multiple of ``Hk``: query head ``h`` reads
        key/value head ``h // (Hq // Hk)``. Or both FP8KVCache holders of those shapes: float8 e4m3 codes with
        float32 scales per tensor, per head or per block of positions (:func:`quantize_kvcache`), attended as
        their values ``e4m3(code) * scale``; on the GPU with float16 or bfloat16 ``q``.
    k, v : arrays (B, Hk, Nnew, D / Dv), optional
        New keys and values, written in place into the caches at positions ``cache_seqlens[b] ...
        cache_seqlens[b] + Nnew - 1`` (through the block table when paged) before attention runs. Into FP8
        caches they are quantized (finite values only) with the cache's scales, saturating at +-448 times the
        scale; a call that writes a block's first position first sets that block's scale (``scaling="block"``)
        from the amax of its rows in the block, per head.
    cache_seqlens : int, or int32 or int64 array (B,), or a sequence of ints
        Valid cached positions per sequence before this call (not modified). Attention runs over
        ``L_b = cache_seqlens[b] + Nnew`` keys.
    block_table : int32 or int64 array (B, max_pages), or nested sequences of ints, optional
        Page ``block_table[b, p]`` of the caches holds positions ``p * page_size ... + page_size - 1`` of
        sequence ``b``; any page size >= 1. Sequences may share pages that lie below all their
        ``cache_seqlens`` (a common prefix); a page that ``k`` and ``v`` are appended into must be used by
        no other sequence or position (checked where the table's values are: ``python -m cupyflash --docs inference``).
    rotary_cos, rotary_sin : arrays (max_pos, rotary_dim / 2), optional
        Rotary position embedding of ``q`` and of the new ``k`` (before it is written), on the first
        ``rotary_dim`` dims: ``rotary_interleaved=False`` rotates dim ``i`` with ``i + rotary_dim / 2``
        (GPT-NeoX), ``True`` the pairs ``(2i, 2i + 1)`` (GPT-J). New key ``j`` is at position
        ``cache_seqlens[b] + j``; query ``i`` at ``cache_seqlens[b] + i`` with ``causal`` or ``window``,
        otherwise every query at ``cache_seqlens[b]`` (FlashAttention-2's rule).
    causal, scale, window, softcap, alibi_slopes
        As in :func:`attention`, bottom-right aligned per sequence: query ``i`` sits at position
        ``L_b - Nq + i``. ``alibi_slopes`` is (Hq,) or (B, Hq).
    num_splits : int, optional
        Split each sequence's keys into this many parts, computed side by side and merged by their
        log-sum-exp (None: chosen from the GPU's size and the problem). The result does not depend on it
        beyond rounding. Ignored on the CPU path.
    return_lse : bool, optional
        Also return the log-sum-exp of each row's scores.

    Returns
    -------
    out : array (B, Hq, Nq, Dv), q's dtype
    lse : array (B, Hq, Nq), float32 (float64 for float64 q); only with ``return_lse``.

    Out-of-range values in GPU-resident ``cache_seqlens`` or ``block_table`` are not checked on the host
    (that would synchronise every call) unless ``CUPYFLASH_CHECK_VALUES=1``; the kernels give such a
    sequence NaN rows, never touch memory outside the arrays, and write none of its new keys when its
    ``cache_seqlens`` is out of range (only those of pages outside the cache when a block-table entry is).

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = np.zeros((2, 2, 64, 32), np.float32)
    >>> v_cache = np.zeros((2, 2, 64, 32), np.float32)
    >>> seqlens = np.array([0, 0], np.int32)
    >>> for step in range(3):                                  # three decoding steps
    ...     q = rng.standard_normal((2, 8, 1, 32), dtype=np.float32)
    ...     k, v = (rng.standard_normal((2, 2, 1, 32), dtype=np.float32) for _ in range(2))
    ...     out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    ...     seqlens += 1
    >>> out.shape
    (2, 8, 1, 32)
    """
    key = None
    if is_cupy(q) and not _kvcache_args.check_values_requested():
        # A layout checked before (a serving loop calls with the same layout every layer of every step)
        # skips the checks: only an int cache_seqlens' range is checked again.
        key = _gpu_decode.call_key(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens,
            block_table,
            rotary_cos,
            rotary_sin,
            rotary_interleaved,
            causal,
            scale,
            window,
            softcap,
            alibi_slopes,
            num_splits,
            return_lse,
        )
        plan = plans.get(key)
        if plan is not None:
            found = _gpu_decode.run_call(
                plan,
                q,
                k_cache,
                v_cache,
                k,
                v,
                cache_seqlens,
                block_table,
                rotary_cos,
                rotary_sin,
                alibi_slopes,
                return_lse,
            )
            if found is not None:
                return found if return_lse else found[0]
    call = _kvcache_args.resolve(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        num_splits=num_splits,
        return_lse=return_lse,
    )
    if call.batch == 0 or call.hq == 0 or call.nq == 0:
        out = call.xp.zeros((call.batch, call.hq, call.nq, call.dv), dtype=call.dtype)
        lse = call.xp.full(out.shape[:-1], -np.inf, dtype=lse_dtype(call.dtype))
        if call.nnew and call.batch:
            (_kvcache_cpu if call.xp is np else _gpu_decode).append(call)
        return (out, lse) if call.return_lse else out
    if call.xp is np:
        out, lse = _kvcache_cpu.attention_with_kvcache(call)
    else:
        out, lse = _gpu_decode.attention_with_kvcache(call)
        _gpu_decode.keep_call(key, call, q, k, v, block_table, rotary_cos, rotary_sin, alibi_slopes, cache_seqlens)
    return (out, lse) if call.return_lse else out
