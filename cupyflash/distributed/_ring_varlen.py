"""Ring attention over a packed batch of sequences (``attention_varlen``'s layout), every sequence sharded
across the W ranks as one sequence is (``shard_varlen``; TransformerEngine's THD context parallelism).

A rank's rows are reordered slot-major once (all sequences' first chunks, then all their second ones:
_varlen_layout.slot_major), so that one slot's rows are one packed batch of offsets ``cu_chunk``; the key/value
shards travel in that order. The schedule is the dense ring's (``_schedule.blocks``, one call per chunk pair):
a pair of slots is one ``attention_varlen`` call over every sequence at once, since chunk a of every
sequence meets chunk b of the same sequence, under the local causal mask when a = b (the same rows in the same
order), unmasked when a > b, skipped when a < b under a causal mask. The calls' results merge by their
log-sum-exp into float accumulators laid out (H, rows, D), and the gradients add, exactly as in ``_ring`` (each
call's results unrounded, in the accumulator's dtype);
the results go back to the caller's order at the end.

A window cuts a pair of chunks down to the square its band covers (_schedule.windowed_pair), whose place and
size depend on the chunk length: the sequences are taken in groups of one chunk length, each group's part of a
pair one call on its rows gathered (their results merged and added back by row index).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from cupyflash import _varlen
from cupyflash._api import attention_varlen_backward, attention_varlen_forward
from cupyflash._arrays import Array, bits, cupy, is_cupy, lse_dtype
from cupyflash.distributed._comm import Comm, check_same_call
from cupyflash.distributed._layout import check_layout, chunks_of
from cupyflash.distributed._pieces import empty
from cupyflash.distributed._ring import check_comm, run_backward, run_forward
from cupyflash.distributed._schedule import Plan, blocks, source_rank, windowed_pair
from cupyflash.distributed._varlen_layout import chunk_lengths, host_offsets, slot_major


@dataclass(frozen=True)
class _Part:
    """A windowed call: the rows of a group of sequences' trimmed chunk pair, ``m`` per sequence (host index
    arrays of the slot-major rows and keys), and its local window."""

    q_rows: object
    k_rows: object
    m: int
    window: tuple[int, int]


class _Call:
    """A validated packed ring call: the whole batch's offsets, the slot-major order and the options."""

    def __init__(self, arrays, cu_seqlens, comm, causal, scale, window, softcap, layout, caller):
        layout = check_layout(layout)
        q, k = arrays["q"], arrays["k"]
        xp = cupy if is_cupy(q) else np
        for name in ("q", "k"):
            if getattr(arrays[name], "ndim", 0) != 3:
                shape = getattr(arrays[name], "shape", type(arrays[name]).__name__)
                raise ValueError(f"{caller}: {name} must be packed as (total / W, heads, D), got {shape}")
        if q.shape[0] != k.shape[0]:
            raise ValueError(
                f"{caller}: q and k shards hold {q.shape[0]} and {k.shape[0]} rows; the packed ring attends each "
                "sequence to itself (one cu_seqlens for queries and keys)"
            )
        world_size = comm.world_size
        cu = host_offsets(cu_seqlens, xp, q.shape[0] * world_size)
        chunks = chunk_lengths(cu, layout, world_size)
        local = cu // world_size  # the shard's own offsets: each sequence holds len / W rows on every rank
        packed, scale, causal, mods = _varlen.validate(
            arrays, local.tolist(), local.tolist(), None, None, causal, scale, window, softcap, None
        )
        check_comm(packed.xp, comm, caller)
        order, cu_chunk = slot_major(cu, layout, world_size)
        self.xp, self.dtype, self.acc = xp, packed.dtype, lse_dtype(packed.dtype)
        self.scale, self.causal, self.softcap, self.layout = scale, causal, float(softcap), layout
        self.heads, self.kv_heads, self.dv = packed.heads, packed.kv_heads, packed.dv
        self.order = xp.asarray(order)
        # (host values: an array on the device would be read back by every call's checks)
        self.cu_chunk = cu_chunk.tolist()
        self.slot_rows, self.max_chunk = int(cu_chunk[-1]), int(chunks.max(initial=0))
        self.rank, self.world_size = comm.rank, world_size
        self.digest = f"{len(cu)}:{zlib.crc32(cu.tobytes())}"
        # (left, right) over each sequence's positions, causal folded in; None: no window (or an unbounded one)
        self.window = None if window is None or mods is None else mods.window_with_causal(causal)
        # sequences by chunk length (a window's part of a pair depends on it): length -> their slot offsets
        self.groups = {}
        for s, c in enumerate(chunks.tolist()):
            if c:
                self.groups.setdefault(c, []).append(cu_chunk[s])
        self.nq = self.nk = q.shape[0]
        # the float sums of dK, dV, laid out (Hk, rows, D) as the merge kernels' accumulators are
        self.acc_k_shape = (self.kv_heads, k.shape[0], k.shape[2])
        self.acc_v_shape = (self.kv_heads, k.shape[0], arrays["v"].shape[2])
        self.plan = Plan(lambda rank, step: self.blocks(step, rank), world_size, comm.rank, self.nk)

    def blocks(self, step, rank=None):
        """The calls of ``rank`` (default: this one) at ``step``: one per pair of chunk slots over every
        sequence (slices of the slot-major rows, offsets cu_chunk), or with a window one per pair and chunk
        length (rows gathered, ``Block.window``)."""
        rank = self.rank if rank is None else rank
        if self.window is None:
            return blocks(self.layout, self.world_size, rank, step, self.slot_rows, self.slot_rows, self.causal, True)
        found = []
        q_chunks = chunks_of(self.layout, self.world_size, rank)
        k_chunks = chunks_of(self.layout, self.world_size, source_rank(rank, step, self.world_size))
        for qs, a in enumerate(q_chunks):
            for ks, b in enumerate(k_chunks):
                for c, starts in self.groups.items():
                    part = windowed_pair(a, b, c, self.window)
                    if part is None:
                        continue
                    r0, k0, m, local = part
                    starts_ = np.asarray(starts)[:, None]
                    rows = (qs * self.slot_rows + starts_ + r0 + np.arange(m)).reshape(-1)
                    keys = (ks * self.slot_rows + starts_ + k0 + np.arange(m)).reshape(-1)
                    found.append(_Part(rows, keys, m, local))
        return found

    def rows(self, rows):
        """A call's rows as an index into the arrays: a slice, or an index array on the arrays' device."""
        return rows if isinstance(rows, slice) else self.xp.asarray(rows)

    def options(self, blk):
        """The keyword arguments of ``blk``'s attention_varlen call, its offsets first."""
        if isinstance(blk, _Part):
            cu, longest, causal, window = list(range(0, len(blk.q_rows) + 1, blk.m)), blk.m, False, blk.window
        else:
            cu, longest, causal, window = self.cu_chunk, self.max_chunk, blk.causal, None
        return dict(
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            causal=causal,
            scale=self.scale,
            window=window,
            softcap=self.softcap,
        )

    def slot_major(self, x, axis=0):
        """x's rows in slot-major order (a copy)."""
        return self.xp.take(x, self.order, axis=axis)

    def back(self, pieces, shape, dtype, fill=0, axis=0):
        """An array of ``shape`` and ``dtype`` in the caller's order from pieces [(span, x)] of its rows listed
        slot-major (along ``axis``), cast once; ``fill`` in rows no piece covers."""
        x, n, done = empty(self.xp, shape, dtype), shape[axis], 0
        for span, part in pieces + [(slice(n, n), None)]:
            if span.start > done:
                gap = (slice(None),) * axis + (self.order[done : span.start],)
                if fill == 0:
                    bits(x)[gap] = 0  # (the bits of 0.0 in every float type)
                else:
                    x[gap] = fill
            if part is not None:
                index = (slice(None),) * axis + (self.order[span],)
                if part.dtype == x.dtype:
                    bits(x)[index] = bits(part)
                else:
                    x[index] = part
            done = span.stop
        return x


def _prepare(arrays, cu_seqlens, comm, causal, scale, window, softcap, layout, caller):
    """Validate on every rank, and make sure every rank makes the same call before anything travels."""
    try:
        call, failure = _Call(arrays, cu_seqlens, comm, causal, scale, window, softcap, layout, caller), None
        shapes = " ".join(f"{name}={tuple(x.shape)}:{x.dtype}" for name, x in arrays.items())
        description = (
            f"{caller} {call.xp.__name__} layout={call.layout!r} causal={call.causal} scale={call.scale!r} "
            f"window={call.window!r} softcap={call.softcap!r} cu_seqlens={call.digest} {shapes}"
        )
    except (TypeError, ValueError) as error:
        call, failure = None, error
        description = f"{caller} raised {type(error).__name__}: {error}"
    check_same_call(comm, description)
    if failure is not None:
        raise failure
    return call


def ring_attention_varlen_forward(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens: Array,
    *,
    comm: Comm,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    layout: str = "zigzag",
) -> tuple[Array, Array]:
    """Attention over a packed batch of sequences, each sharded across the ranks of ``comm``: this rank's rows
    of ``out`` and ``lse``.

    Exactly :func:`cupyflash.attention_varlen_forward` over the whole batch (every rank calls it at once,
    with its shards); the key/value shards travel around the ring, and each step's calls are merged by their
    log-sum-exp in float32 (float64 for float64 inputs).

    Parameters
    ----------
    q : numpy.ndarray or cupy.ndarray, shape (total / W, H, D)
        This rank's shard of the packed queries (:func:`shard_varlen`): its chunks of sequence 0, then of
        sequence 1, ...; dtype float16, bfloat16, float32 or float64.
    k, v : arrays, shapes (total / W, Hk, D) and (total / W, Hk, Dv)
        This rank's shards of the keys and values (Hk divides H: grouped-query attention).
    cu_seqlens : int32 or int64 array of q's type, or a sequence of ints, shape (batch + 1,)
        The whole batch's offsets (the same on every rank), as in :func:`cupyflash.attention_varlen` with
        ``cu_seqlens_q = cu_seqlens_k``. Every length must split into 2W equal chunks ("zigzag") or W
        ("contiguous"): pad each sequence at its end otherwise.
    comm : Communicator or an InProcessGroup's communicator
        The ring (:func:`init`, :class:`InProcessGroup`).
    causal : bool, optional
        The causal mask over each sequence's global positions.
    scale, window, softcap : optional
        As in :func:`cupyflash.attention_varlen`; the window over each sequence's global positions.
    layout : {"zigzag", "contiguous"}, optional
        How each sequence was sharded (:func:`shard_varlen`).

    Returns
    -------
    out : array, shape (total / W, H, Dv), the inputs' dtype
        This rank's rows of the output, in the layout of its q shard.
    lse : array, shape (H, total / W), float32 (float64 for float64 inputs)
        Their log-sum-exp over their whole sequences' keys.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import distributed as dist
    >>> rng = np.random.default_rng(0)
    >>> cu = [0, 16, 24, 64]                              # three sequences of 16, 8 and 40 rows
    >>> q, k, v = (rng.standard_normal((64, 2, 16), dtype=np.float32) for _ in range(3))
    >>> def rank_work(comm):
    ...     q_l, k_l, v_l = (dist.shard_varlen(x, cu, comm) for x in (q, k, v))
    ...     out_l, lse_l = dist.ring_attention_varlen_forward(q_l, k_l, v_l, cu, comm=comm, causal=True)
    ...     return dist.unshard_varlen(out_l, cu, comm)
    >>> out = dist.InProcessGroup(2).run(rank_work)[0]
    >>> expected = cupyflash.attention_varlen(q, k, v, np.array(cu), np.array(cu), causal=True)
    >>> bool(np.abs(out - expected).max() < 1e-5)
    True
    """
    arrays = dict(q=q, k=k, v=v)
    call = _prepare(arrays, cu_seqlens, comm, causal, scale, window, softcap, layout, "ring_attention_varlen_forward")
    q_sm = call.slot_major(q)

    def attend(blk, kb, vb, direct):
        options = call.options(blk)
        out_dtype = None if direct else call.acc
        out_b, lse_b = attention_varlen_forward(q_sm[call.rows(blk.q_rows)], kb, vb, **options, out_dtype=out_dtype)
        return out_b.transpose(1, 0, 2), lse_b  # (H, rows, Dv), as the merge kernels' accumulators are laid out

    found = run_forward(comm, call, call.slot_major(k), call.slot_major(v), attend, axis=0)
    out = [(span, part[0].transpose(1, 0, 2)) for span, part in found]
    lse = [(span, part[1]) for span, part in found]
    return (
        call.back(out, (q.shape[0], call.heads, call.dv), call.dtype),
        call.back(lse, (call.heads, q.shape[0]), call.acc, fill=-np.inf, axis=1),
    )


def ring_attention_varlen_backward(
    dout: Array,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    cu_seqlens: Array,
    *,
    comm: Comm,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    layout: str = "zigzag",
) -> tuple[Array, Array, Array]:
    """Gradients of packed ring attention: this rank's shards of ``dq``, ``dk`` and ``dv``.

    Every rank calls it at once. dQ accumulates on its rank; the float32 sums of dK and dV travel around the
    ring with the keys and arrive back at their owner. Deterministic for a fixed world size.

    Parameters
    ----------
    dout : array, shape (total / W, H, Dv)
        This rank's shard of the gradient of the loss with respect to ``out``; the inputs' dtype.
    q, k, v, cu_seqlens
        As given to :func:`ring_attention_varlen_forward`.
    out, lse : arrays, shapes (total / W, H, Dv) and (H, total / W)
        What :func:`ring_attention_varlen_forward` returned on this rank.
    comm, causal, scale, window, softcap, layout
        Exactly as passed to :func:`ring_attention_varlen_forward`.

    Returns
    -------
    dq, dk, dv : arrays of the shapes and dtype of q, k, v
        This rank's shards of the gradients; dk and dv summed over the query heads of each key/value head.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import distributed as dist
    >>> rng = np.random.default_rng(0)
    >>> cu = [0, 12, 36]
    >>> q, dout = (rng.standard_normal((36, 4, 8), dtype=np.float32) for _ in range(2))
    >>> k, v = (rng.standard_normal((36, 2, 8), dtype=np.float32) for _ in range(2))
    >>> def rank_work(comm):
    ...     q_l, k_l, v_l, dout_l = (dist.shard_varlen(x, cu, comm) for x in (q, k, v, dout))
    ...     out_l, lse_l = dist.ring_attention_varlen_forward(q_l, k_l, v_l, cu, comm=comm, causal=True)
    ...     grads = dist.ring_attention_varlen_backward(dout_l, q_l, k_l, v_l, out_l, lse_l, cu, comm=comm,
    ...                                                 causal=True)
    ...     return [dist.unshard_varlen(g, cu, comm) for g in grads]
    >>> dq, dk, dv = dist.InProcessGroup(3).run(rank_work)[0]
    >>> cu_ = np.array(cu)
    >>> out, lse = cupyflash.attention_varlen_forward(q, k, v, cu_, cu_, causal=True)
    >>> expected = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_, cu_, causal=True)
    >>> [bool(np.abs(a - b).max() < 1e-5) for a, b in zip((dq, dk, dv), expected)]
    [True, True, True]
    """
    arrays = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    call = _prepare(arrays, cu_seqlens, comm, causal, scale, window, softcap, layout, "ring_attention_varlen_backward")
    dout_sm, q_sm, out_sm = (call.slot_major(x) for x in (dout, q, out))
    lse_sm = call.slot_major(lse, axis=1)

    def gradients(blk, kb, vb, direct):
        rows = call.rows(blk.q_rows)
        grads = attention_varlen_backward(
            dout_sm[rows],
            q_sm[rows],
            kb,
            vb,
            out_sm[rows],
            lse_sm[:, rows],
            **call.options(blk),
            grad_dtype=None if direct else call.acc,
        )
        return tuple(g.transpose(1, 0, 2) for g in grads)  # (heads, rows, D)

    dq, dkv = run_backward(comm, call, call.slot_major(k), call.slot_major(v), gradients, axis=0)
    return (
        call.back([(s, p[0].transpose(1, 0, 2)) for s, p in dq], q.shape, call.dtype),
        call.back([(s, p[0].transpose(1, 0, 2)) for s, p in dkv], k.shape, call.dtype),
        call.back([(s, p[1].transpose(1, 0, 2)) for s, p in dkv], v.shape, call.dtype),
    )


def ring_attention_varlen(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens: Array,
    *,
    comm: Comm,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    layout: str = "zigzag",
) -> Array:
    """Packed ring attention's output alone: :func:`ring_attention_varlen_forward` without the lse.

    Parameters
    ----------
    q, k, v, cu_seqlens, comm, causal, scale, window, softcap, layout
        As in :func:`ring_attention_varlen_forward`.

    Returns
    -------
    out : array, shape (total / W, H, Dv), the inputs' dtype

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import distributed as dist
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((24, 2, 8), dtype=np.float32) for _ in range(3))
    >>> outs = dist.InProcessGroup(2).run(lambda comm: dist.ring_attention_varlen(
    ...     *(dist.shard_varlen(x, [0, 8, 24], comm) for x in (q, k, v)), [0, 8, 24], comm=comm))
    >>> [o.shape for o in outs]
    [(12, 2, 8), (12, 2, 8)]
    """
    out, _ = ring_attention_varlen_forward(
        q, k, v, cu_seqlens, comm=comm, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout
    )
    return out
