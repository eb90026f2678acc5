"""The fast path of ``attention_with_kvcache`` on the GPU: a call whose arguments have the layout of an
earlier, fully checked call skips the checks and goes straight to that call's plan. A serving loop calls with
the same layout for every layer of every step, and its host time is then the plan's launches.

The key is everything the checks and the plan depend on but the addresses and an int cache_seqlens' value:
shapes, strides, dtypes, addresses modulo 16, devices, the options with their types (the checks reject
``causal=1``; a key by value alone would not tell it from ``True``). Kept for at most MAX_LAYOUTS layouts.
"""

from __future__ import annotations

import numpy

from cupyflash._arrays import cupy
from cupyflash._cuda.decode import Plan, plan_for

MAX_LAYOUTS = 256
_fast: dict[tuple, Plan] = {}


def _array_key(x):
    return None if x is None else (x.shape, x.strides, x.dtype, x.data.ptr % 16, x.device.id)


def fast_key(
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
):
    """The call's layout key (module docstring); None where a call cannot take the fast path (NumPy arrays,
    unhashable options)."""
    try:
        seqlens = "int" if type(cache_seqlens) is int else _array_key(cache_seqlens)
        options = (rotary_interleaved, causal, scale, window, softcap, num_splits, return_lse)
        types = tuple(map(type, options)) + (tuple(map(type, window)) if type(window) is tuple else ())
        key = (
            cupy.cuda.Device().id,
            _array_key(q),
            _array_key(k_cache),
            _array_key(v_cache),
            _array_key(k),
            _array_key(v),
            seqlens,
            _array_key(block_table),
            _array_key(rotary_cos),
            _array_key(rotary_sin),
            _array_key(alibi_slopes),
            options,
            types,
        )
        hash(key)
    except (AttributeError, TypeError):  # a NumPy array or an unhashable option: the checked path
        return None
    return key


def remember(key, call, q, k, v, block_table, rotary_cos, rotary_sin, alibi_slopes, cache_seqlens) -> None:
    """Let later calls with this key skip the checks, where the checked call launched on the caller's own
    arrays (no cast or copy of rotary tables, slopes or lengths that the fast path would have to redo)."""
    if key is None:
        return
    if rotary_cos is not None and (call.rotary_cos is not rotary_cos or call.rotary_sin is not rotary_sin):
        return
    if alibi_slopes is not None and alibi_slopes.dtype != numpy.float32:
        return
    if call.q is not q or call.k is not k or call.v is not v:  # copied to a unit last stride
        return
    if type(cache_seqlens) is not int and call.cache_seqlens is not cache_seqlens:  # cast or copied
        return
    if call.block_table is not block_table:  # copied to contiguous columns
        return
    if len(_fast) >= MAX_LAYOUTS:  # the oldest unpinned layout goes (dicts keep insertion order)
        oldest = next((k for k, p in _fast.items() if not p.pinned), None)
        if oldest is not None:
            _fast.pop(oldest)
    _fast[key] = plan_for(call)


def fast_plan(key):
    return None if key is None else _fast.get(key)


def run_fast(
    plan: Plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes, return_lse
):
    if type(cache_seqlens) is int and not 0 <= cache_seqlens <= plan.seqlen_limit:
        return None  # the checked path raises the error
    return plan.run(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes, want_lse=return_lse
    )
