"""The one cache of launch plans: dense forwards and backwards (the ring's blocks are dense calls), the fused
backward, the FP8 forward and decoding all keep what they worked out here, under keys built by one rule.

Two roles share the store:

- ``"plan"``: the launches a checked call worked out (kernels, grids, shared memory, every parameter but the
  arrays' addresses), keyed by the arrays it launches on (after any copy the checks made) and its options;
- ``"call"``: an entry for the arguments exactly as a caller passed them. A later call whose arguments have
  the same key is one the checks have already passed, so it skips them and goes straight to the plan (a
  training loop or a decoding loop calls every layer with the same layouts on every step). Only calls
  whose checked run launched on the caller's own arrays (no padded or cast copies) get one.

**The key** (``key``) is everything a plan depends on but the arrays' addresses and the dropout seed: the
role and family, the current device, ``CUPYFLASH_NO_WGMMA``, each array's shape, strides, dtype, address
modulo 16 and device (None for an array not given), and each option by value and type (the checks reject
``causal=1``: a key by value alone would not tell it from ``True``; a window's entries by type too). NumPy or
other array types make no key: their calls go through the checks, and make no CUDA call to build one.

**Bounds**: at most ``LIMIT`` entries; a new one evicts the oldest that is not pinned (a plan that ran inside a
CUDA-graph capture with memory of its own, a decoding plan's workspace or the warp-specialized forward's tile
counter, is pinned, and so are the call entries that hold it: the graph holds those addresses).

**Invalidation**: none is needed, since a key names all that its plan depends on. ``clear()`` drops every
entry (tests use it to make calls plan afresh); plans then hold no memory but their parameter words.
"""

from __future__ import annotations

import os
import threading

from cupyflash._arrays import cupy

LIMIT = 1024
_entries: dict[tuple, object] = {}
_lock = threading.Lock()


def key(role: str, family: str, arrays, options) -> tuple | None:
    """The key of a call of this role and family on these arrays (None where one was not given) with these
    option values (module docstring); None where an array is not a CuPy array. (One flat tuple: the fast
    path builds one on every call, and every object it makes is host time.)"""
    if cupy is None:
        return None
    ndarray = cupy.ndarray
    parts = [role, family]
    for x in arrays:
        if x is None:
            parts.append(None)
            continue
        if type(x) is not ndarray:
            return None
        memory = x.data
        parts += (x.shape, x.strides, x.dtype, memory.ptr & 15, memory.device_id)
    for x in options:
        kind = type(x)
        parts += (x, kind)
        if isinstance(x, tuple):
            parts += map(type, x)
    parts += (cupy.cuda.runtime.getDevice(), os.environ.get("CUPYFLASH_NO_WGMMA", ""))
    return tuple(parts)


def array_key(x) -> tuple | None:
    """One array's part of a key (shape, strides, dtype, address modulo 16, device); None for anything but a
    CuPy array."""
    if cupy is None or type(x) is not cupy.ndarray:
        return None
    return x.shape, x.strides, x.dtype, x.data.ptr & 15, x.data.device_id


def get(found):
    """The entry under key ``found``, or None (no key, an unknown one, or one with an unhashable option)."""
    if found is None:
        return None
    try:
        return _entries.get(found)
    except (TypeError, ValueError):  # an unhashable option (a window given as a list): the checked path
        return None


def put(found, entry) -> None:
    """Keep ``entry`` under key ``found`` (None or unhashable: nothing is kept), evicting the oldest unpinned
    entry when the cache is full; an entry already kept under that key stays."""
    if found is None:
        return
    try:
        if found in _entries:
            return
    except (TypeError, ValueError):
        return
    with _lock:
        _make_room()
        _entries.setdefault(found, entry)


def get_or_make(found, make):
    """The entry under key ``found``, made by ``make()`` and kept if there is none (one maker at a time, so
    two threads never build the same plan). No key (an array the rule does not describe) or an unhashable one:
    a new entry each call, kept nowhere."""
    if found is None or not _hashable(found):
        return make()
    entry = get(found)
    if entry is None:
        with _lock:
            entry = _entries.get(found)
            if entry is None:
                entry = make()
                _make_room()
                _entries[found] = entry
    return entry


def _hashable(found) -> bool:
    try:
        hash(found)
    except (TypeError, ValueError):
        return False
    return True


def _make_room() -> None:
    if len(_entries) >= LIMIT:  # dicts keep insertion order: the first unpinned entry is the oldest
        oldest = next((k for k, entry in _entries.items() if not getattr(entry, "pinned", False)), None)
        if oldest is not None:
            _entries.pop(oldest)


def entries(role: str | None = None, family: str | None = None) -> dict:
    """The kept entries by key, of one role and family where given (a snapshot)."""
    return {
        k: entry
        for k, entry in list(_entries.items())
        if (role is None or k[0] == role) and (family is None or k[1] == family)
    }


def discard(found) -> None:
    """Drop the entry under key ``found``, if any."""
    with _lock:
        _entries.pop(found, None)


def clear() -> None:
    """Drop every entry, pinned ones too: for tests and experiments, never while a CUDA graph that ran one of
    them may still be replayed."""
    with _lock:
        _entries.clear()
