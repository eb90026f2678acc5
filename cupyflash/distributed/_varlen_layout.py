"""How a packed batch of sequences (``attention_varlen``'s rows, ``cu_seqlens``) is cut into shards, one per
rank: every sequence is cut as one sequence would be (_layout: "zigzag", 2W chunks, rank r holding chunks r
and 2W-1-r; "contiguous", W chunks), and a rank's shard holds its chunks of sequence 0, then of sequence 1, and
so on, each sequence's chunks in increasing position (TransformerEngine's THD layout for context parallelism):
the shard is a packed batch itself, with the offsets ``cu_seqlens / W``.

Within the ring, a rank's rows are reordered slot-major once (all sequences' first chunks, then all their
second ones), so that the rows of one slot are one contiguous packed batch of offsets ``cu_chunk``.
"""

from __future__ import annotations

import zlib

import numpy

from cupyflash._arrays import Array, cupy, is_cupy
from cupyflash._checks import index_array
from cupyflash.distributed._comm import Comm, check_same_call
from cupyflash.distributed._layout import check_axis, check_layout, chunks_of, chunks_per_rank


def host_offsets(cu_seqlens, xp, total: int, name: str = "cu_seqlens") -> numpy.ndarray:
    """The whole batch's cu_seqlens on the host (int64), checked: 1-D, 0 first, non-decreasing, ``total`` last."""
    cu, host = index_array(name, cu_seqlens, xp)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {cu.shape}")
    host = (cu.get() if host is None else host).astype(numpy.int64)
    if host[0] != 0 or numpy.any(numpy.diff(host) < 0):
        raise ValueError(f"{name} must start at 0 and never decrease, got {host.tolist()}")
    if host[-1] != total:
        raise ValueError(f"the last entry of {name} is {host[-1]}, but the whole packed batch has {total} rows")
    return host


def chunk_lengths(cu: numpy.ndarray, layout: str, world_size: int) -> numpy.ndarray:
    """Each sequence's chunk length: its length over 2W (zigzag) or W (contiguous), which must divide it."""
    parts = chunks_per_rank(layout) * world_size
    lengths = numpy.diff(cu)
    bad = numpy.nonzero(lengths % parts)[0]
    if bad.size:
        s = int(bad[0])
        raise ValueError(
            f"sequence {s} of the packed batch has {int(lengths[s])} rows, which the {layout!r} layout cannot cut "
            f"into {parts} equal chunks ({'2W' if layout == 'zigzag' else 'W'} for W = {world_size}); pad every "
            f"sequence to a multiple of {parts} rows at its end (under a causal mask no real query sees the "
            "padded keys; drop the padded rows of the results and give them a zero dout)"
        )
    return lengths // parts


def shard_rows(cu: numpy.ndarray, layout: str, world_size: int, rank: int) -> numpy.ndarray:
    """The whole batch's rows that ``rank``'s shard holds, in its order (module docstring)."""
    c = chunk_lengths(cu, layout, world_size)
    pieces = [
        cu[s] + index * c[s] + numpy.arange(c[s])
        for s in range(len(c))
        for index in chunks_of(layout, world_size, rank)
    ]
    return numpy.concatenate(pieces) if pieces else numpy.zeros(0, dtype=numpy.int64)


def slot_major(cu: numpy.ndarray, layout: str, world_size: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(order, cu_chunk): ``x[order]`` lists a shard's rows slot-major (each sequence's first chunk, then each
    one's second), and ``cu_chunk`` are the offsets of one slot's packed batch of chunks."""
    c = chunk_lengths(cu, layout, world_size)
    per = chunks_per_rank(layout)
    local = per * numpy.concatenate([[0], numpy.cumsum(c)])  # each sequence's first row in the shard
    order = [local[s] + slot * c[s] + numpy.arange(c[s]) for slot in range(per) for s in range(len(c))]
    order = numpy.concatenate(order) if order else numpy.zeros(0, dtype=numpy.int64)
    return order, numpy.concatenate([[0], numpy.cumsum(c)]).astype(numpy.int64)


def shard_varlen(x: Array, cu_seqlens: Array, comm: Comm, layout: str = "zigzag", axis: int = 0) -> Array:
    """This rank's shard of a whole packed batch: a new contiguous array.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray, shape (total, H, D) for q, k, v, dout (or (H, total) with ``axis=-1``)
        The whole packed batch (``attention_varlen``'s layout); every rank passes the same one.
    cu_seqlens : int32 or int64 array of x's type, or a sequence of ints, shape (batch + 1,)
        The whole batch's offsets. Every sequence's length must split into equal chunks: 2W for "zigzag", W
        for "contiguous" (pad each sequence at its end otherwise).
    comm : Communicator or an InProcessGroup's communicator
        Its ``rank`` and ``world_size`` pick the shard.
    layout : {"zigzag", "contiguous"}, optional
        How each sequence is cut, as in :func:`shard`.
    axis : int, optional
        The packed rows' axis (0; -1 for lse).

    Returns
    -------
    x_local : array of x's type and dtype, with total / W rows along ``axis``: this rank's chunks of sequence
        0, then of sequence 1, ... (a packed batch of offsets ``cu_seqlens / W``)

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import distributed as dist
    >>> x = np.arange(12)[:, None, None]                # two sequences of 4 and 8 rows, (total, H, D)
    >>> shards = dist.InProcessGroup(2).run(lambda comm: dist.shard_varlen(x, [0, 4, 12], comm)[:, 0, 0].tolist())
    >>> shards                                          # zigzag: 4 chunks per sequence
    [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    """
    layout = check_layout(layout)
    axis = check_axis(x, axis)
    xp = cupy if is_cupy(x) else numpy
    cu = host_offsets(cu_seqlens, xp, x.shape[axis])
    rows = shard_rows(cu, layout, comm.world_size, comm.rank)
    return xp.ascontiguousarray(xp.take(x, xp.asarray(rows), axis=axis))


def unshard_varlen(x_local: Array, cu_seqlens: Array, comm: Comm, layout: str = "zigzag", axis: int = 0) -> Array:
    """The whole packed batch from every rank's shard, on every rank (an all-gather).

    Parameters
    ----------
    x_local : numpy.ndarray or cupy.ndarray, shape (total / W, H, D) (or (H, total / W) with ``axis=-1``)
        This rank's shard (:func:`shard_varlen`).
    cu_seqlens, comm, layout, axis
        As given to :func:`shard_varlen`.

    Returns
    -------
    x : array of x_local's type and dtype, with total rows along ``axis``

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import distributed as dist
    >>> x = np.arange(24.0).reshape(2, 12)              # an lse-like (H, total) array
    >>> cu = [0, 4, 12]
    >>> back = dist.InProcessGroup(2).run(
    ...     lambda comm: dist.unshard_varlen(dist.shard_varlen(x, cu, comm, axis=-1), cu, comm, axis=-1))
    >>> all(np.array_equal(b, x) for b in back)
    True
    """
    layout = check_layout(layout)
    axis = check_axis(x_local, axis)
    xp = cupy if is_cupy(x_local) else numpy
    total = x_local.shape[axis] * comm.world_size
    cu = host_offsets(cu_seqlens, xp, total)
    chunk_lengths(cu, layout, comm.world_size)
    digest = f"{len(cu)}:{zlib.crc32(cu.tobytes())}"
    check_same_call(
        comm, f"unshard_varlen {xp.__name__} {tuple(x_local.shape)}:{x_local.dtype} {layout} axis={axis} cu={digest}"
    )
    shards = comm.all_gather(x_local)
    shape = list(x_local.shape)
    shape[axis] = total
    whole = xp.empty(tuple(shape), dtype=x_local.dtype)
    moved = xp.moveaxis(whole, axis, 0)
    for rank, part in enumerate(shards):
        moved[xp.asarray(shard_rows(cu, layout, comm.world_size, rank))] = xp.moveaxis(part, axis, 0)
    return whole
