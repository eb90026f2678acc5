"""How a sequence is cut into shards, one per rank: which chunks of the sequence a rank holds, in what
order, and the shard/unshard copies.

The sequence axis (-2 of q, k, v, out; -1 of lse) is cut into equal chunks:

    "zigzag"      2W chunks; rank r holds chunks r and 2W-1-r, in that order. Under a causal mask every
                  rank then has the same work: an early chunk sees few keys, its partner many.
    "contiguous"  W chunks; rank r holds chunk r. Simple, but under a causal mask rank r computes
                  (2r + 1) c^2 / 2 pairs of chunk length c: rank W-1 does 2W-1 times the work of rank 0.

W = 4, zigzag, a sequence of 8 chunks 0..7:  rank 0: [0 7]  rank 1: [1 6]  rank 2: [2 5]  rank 3: [3 4]

A rank's shard keeps its chunks in increasing position, so within one rank the local causal mask of a
shard against itself is the global one.
"""

from __future__ import annotations

import numpy

from cupyflash._arrays import Array, cupy, is_cupy
from cupyflash.distributed._comm import Comm, check_same_call

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunks_of(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """The indices of the sequence's chunks that ``rank`` holds, in the order its shard holds them."""
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def chunk_length(n: int, layout: str, world_size: int, name: str) -> int:
    """The length of one chunk of a sequence of ``n`` rows (``name``'s sequence axis)."""
    parts = chunks_per_rank(layout) * world_size
    if n % parts:
        raise ValueError(
            f"{name} has {n} rows along the sequence axis, which the {layout!r} layout cannot cut into "
            f"{parts} equal chunks ({'2W' if layout == 'zigzag' else 'W'} for W = {world_size}); pad the "
            f"sequence to a multiple of {parts} (`python -m cupyflash --docs distributed` shows how to hide the "
            "padding)"
        )
    return n // parts


def shard(x: Array, comm: Comm, layout: str = "zigzag", axis: int = -2) -> Array:
    """This rank's shard of a whole array along its sequence axis: a new contiguous array.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray, shape (..., N, D) for q, k, v, dout (or (..., N) with ``axis=-1``)
        The whole array; every rank passes the same one. N must split into equal chunks: 2W for
        "zigzag", W for "contiguous" (pad the sequence otherwise; ``python -m cupyflash --docs distributed``
        shows how).
    comm : Communicator or an InProcessGroup's communicator
        Its ``rank`` and ``world_size`` pick the shard.
    layout : {"zigzag", "contiguous"}, optional
        "zigzag": rank r holds chunks r and 2W-1-r of 2W (balanced causal work); "contiguous": chunk r of W.
    axis : int, optional
        The sequence axis (-2; -1 for lse).

    Returns
    -------
    x_local : array of x's type and dtype, x's shape with N / W rows along ``axis``

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import distributed as dist
    >>> x = np.arange(8)[:, None]                       # a sequence of 8 rows, (N, D) = (8, 1)
    >>> dist.InProcessGroup(2).run(lambda comm: dist.shard(x, comm)[:, 0].tolist())   # zigzag: 4 chunks of 2
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    layout = check_layout(layout)
    axis = check_axis(x, axis)
    c = chunk_length(x.shape[axis], layout, comm.world_size, "x")
    xp = _module(x)
    pieces = [_take(x, axis, i * c, (i + 1) * c) for i in chunks_of(layout, comm.world_size, comm.rank)]
    return xp.ascontiguousarray(xp.concatenate(pieces, axis=axis))


def unshard(x_local: Array, comm: Comm, layout: str = "zigzag", axis: int = -2) -> Array:
    """The whole array from every rank's shard, on every rank (an all-gather; for checking and output).

    Parameters
    ----------
    x_local : numpy.ndarray or cupy.ndarray, shape (..., N / W, D) (or (..., N / W) with ``axis=-1``)
        This rank's shard, of one shape on every rank.
    comm : Communicator or an InProcessGroup's communicator
        The ring; every rank calls ``unshard`` at once.
    layout : {"zigzag", "contiguous"}, optional
        The layout ``x_local`` was sharded with.
    axis : int, optional
        The sequence axis (-2; -1 for lse).

    Returns
    -------
    x : array of x_local's type and dtype, x_local's shape with N rows along ``axis``

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import distributed as dist
    >>> x = np.arange(12.0).reshape(1, 12)              # an lse-like (H, N) array
    >>> back = dist.InProcessGroup(3).run(lambda comm: dist.unshard(dist.shard(x, comm, axis=-1), comm, axis=-1))
    >>> all(np.array_equal(b, x) for b in back)
    True
    """
    layout = check_layout(layout)
    axis = check_axis(x_local, axis)
    per = chunks_per_rank(layout)
    n = x_local.shape[axis]
    if n % per:
        raise ValueError(
            f"x_local has {n} rows along axis {axis}; the {layout!r} layout holds {per} equal chunks per rank"
        )
    # Every rank must gather arrays of one size: compare before the all-gather.
    check_same_call(
        comm, f"unshard {_module(x_local).__name__} {tuple(x_local.shape)}:{x_local.dtype} {layout} axis={axis}"
    )
    shards = comm.all_gather(x_local)
    c = n // per
    chunks = {}
    for rank, part in enumerate(shards):
        for slot, index in enumerate(chunks_of(layout, comm.world_size, rank)):
            chunks[index] = _take(part, axis, slot * c, (slot + 1) * c)
    return _module(x_local).concatenate([chunks[i] for i in sorted(chunks)], axis=axis)


def check_axis(x, axis) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}")
    return axis % x.ndim


def _take(x, axis, start, stop):
    return x[(slice(None),) * axis + (slice(start, stop),)]


def _module(x):
    return cupy if is_cupy(x) else numpy
