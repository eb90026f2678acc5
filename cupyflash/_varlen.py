"""Variable-length packed batches: their layout, their validation, and views of one sequence.

FlashAttention's conventions: the sequences of a batch are packed along the rows, ``q (total_q, H, D)``,
``k (total_k, Hk, D)``, ``v (total_k, Hk, Dv)``, and ``cu_seqlens_q`` (int32 or int64, an array or a
sequence, batch + 1 entries, from 0 up to total_q) says that sequence ``s`` owns query rows
``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` (likewise the keys with ``cu_seqlens_k``). Query head ``h`` attends
with key/value head ``h // (H // Hk)`` (grouped heads: Hk divides H). Each sequence is attended alone, exactly
as the dense functions would attend it: causal is bottom-right aligned per sequence, and a sequence with no
key gives zeros (lse -inf). ``lse`` comes back as ``(H, total_q)`` float32 (float64 for float64 inputs). The
flat batch index of (sequence s, query head h), which dropout's mask and ALiBi's slopes (broadcastable to
``(batch, H)``) follow, is ``s * H + h``. Nothing is ever padded: the kernels read each sequence's rows in
place.

Validation reads ``cu_seqlens_q`` and ``cu_seqlens_k`` back to the host (batch + 1 integers each): that
is how bad offsets become clear errors rather than wrong results.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from cupyflash import _modifiers
from cupyflash._checks import check_array_types, check_causal, check_head_dims, index_array, resolve_scale
from cupyflash._checks import check_dtypes as _check_dtypes


@dataclass(frozen=True)
class Packed:
    """A validated packed batch: its sizes and, on the host, its sequence offsets (int64)."""

    xp: object
    dtype: np.dtype
    heads: int  # H, query heads
    kv_heads: int  # Hk, key/value heads
    d: int
    dv: int
    cu_q: np.ndarray
    cu_k: np.ndarray
    max_q: int  # the longest sequences (or the caller's larger bound): they size the kernels' grid
    max_k: int

    @property
    def batch(self) -> int:
        return len(self.cu_q) - 1

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def total_q(self) -> int:
        return int(self.cu_q[-1])

    @property
    def total_k(self) -> int:
        return int(self.cu_k[-1])

    def sequences(self):
        """(s, q0, q1, k0, k1) for every sequence."""
        for s in range(self.batch):
            yield s, int(self.cu_q[s]), int(self.cu_q[s + 1]), int(self.cu_k[s]), int(self.cu_k[s + 1])


def check(arrays: dict, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_dtypes=True) -> Packed:
    """Validate a packed problem: ``arrays`` holds q, k, v (and dout, out, lse for the backward).
    ``check_dtypes=False`` (the float64 reference) accepts any dtype."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    xp = check_array_types(arrays)
    dtype = _check_dtypes(arrays) if check_dtypes else q.dtype
    for name, x, what in (("q", q, "(total_q, H, D)"), ("k", k, "(total_k, Hk, D)"), ("v", v, "(total_k, Hk, Dv)")):
        if x.ndim != 3:
            raise ValueError(f"{name} must be packed as {what}, got shape {x.shape}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads (total_k, Hk), got k {k.shape} and v {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim D (last dim), got q {q.shape} and k {k.shape}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"the key/value heads Hk = {kv_heads} (k.shape[1]) must divide the query heads H = {heads} (q.shape[1])"
        )
    check_head_dims(q, v)
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, xp, q.shape[0], "q", "total_q")
    cu_k = _offsets("cu_seqlens_k", cu_seqlens_k, xp, k.shape[0], "k", "total_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q has {len(cu_q)} entries but cu_seqlens_k has {len(cu_k)}; both must be batch + 1"
        )
    max_q = _max_seqlen("max_seqlen_q", max_seqlen_q, cu_q, "query")
    max_k = _max_seqlen("max_seqlen_k", max_seqlen_k, cu_k, "key")
    packed = Packed(xp, dtype, heads, kv_heads, q.shape[2], v.shape[2], cu_q, cu_k, max_q, max_k)
    if "out" in arrays:
        expected = dict(
            dout=(packed.total_q, heads, packed.dv), out=(packed.total_q, heads, packed.dv), lse=(heads, packed.total_q)
        )
        for name, shape in expected.items():
            if arrays[name].shape != shape:
                raise ValueError(
                    f"{name} has shape {arrays[name].shape}; expected {shape}, as "
                    "attention_varlen_forward returns it for these q, k, v"
                )
    return packed


def validate(
    arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes
):
    """The one set of checks of a packed call (the varlen functions and the ring's packed form): the layout
    (check), causal, the scale (its default) and the score modifiers; (packed, scale, causal, mods)."""
    packed = check(arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    causal = check_causal(causal)
    scale = resolve_scale(scale, packed.d)
    # The per-element options are checked as for one (Nq, Nk) = (1, 1) problem of leading dims (batch, H).
    mods = _modifiers.resolve(
        packed.xp,
        packed.dtype,
        (packed.batch, packed.heads),
        1,
        1,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    return packed, scale, causal, mods


def _offsets(name, cu, xp, rows, tensor, total):
    """cu_seqlens (index_array's rule: int32 or int64, an array or a sequence): 1-D, at least one entry, 0
    first, non-decreasing, ``rows`` last; returned as int64 on the host."""
    cu, host = index_array(name, cu, xp)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {cu.shape}")
    host = (cu.get() if host is None else host).astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {host[0]}")
    if np.any(np.diff(host) < 0):
        at = int(np.argmax(np.diff(host) < 0))
        raise ValueError(
            f"{name} must be non-decreasing; entry {at + 1} ({host[at + 1]}) is below entry {at} ({host[at]})"
        )
    if host[-1] != rows:
        raise ValueError(f"the last entry of {name} is {host[-1]} but {tensor} has {rows} rows ({total})")
    return host


def _max_seqlen(name, value, cu, what):
    longest = int(np.max(np.diff(cu), initial=0))
    if value is None:
        return longest
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer or None, got {value!r}")
    if value < longest:
        raise ValueError(f"{name}={value} is below the longest {what} sequence ({longest})")
    return int(value)


def sequence_view(x, r0, r1, kv_heads):
    """Rows r0:r1 of a packed (total, heads, D) array as (kv_heads, heads // kv_heads, rows, D): a view."""
    n, heads, d = r1 - r0, x.shape[1], x.shape[2]
    return x[r0:r1].transpose(1, 0, 2).reshape(kv_heads, heads // kv_heads, n, d)
