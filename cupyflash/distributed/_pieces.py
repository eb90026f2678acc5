"""A shard's rows in pieces: the ring holds, sums and sends only the rows that its schedule uses.

A window leaves most chunk pairs out (``_schedule.windowed_pair``), so the rows that a step's calls read, or
that their results cover, are a few ranges of a shard, not all of it. The ring keeps each range as arrays of
its own:

    spans(rows, n)  the disjoint ranges that some row slices cover (overlapping ones joined), in order
    Sums            float results over spans, combined from parts (a call's out and lse, a call's gradients,
                    sums that arrived); the first part that covers its span whole becomes the span's
                    accumulator as it is (no zeroed buffer, no pass over it), the others combine into it
    Held            key/value rows in hand, one piece per span; ``take(rows)`` gives a call its rows
    exchange_rows   send spans of the rows in hand to rank + 1 and receive spans from rank - 1
    assemble        the pieces as one array of the shard's rows in the caller's dtype (one cast)

Rows are slices of a shard's rows, or index arrays (the packed ring's gathered calls), which stand for all of
them. Arrays keep their rows on axis -2 (the lse on -1), or on ``axis`` where it says so.
"""

from __future__ import annotations

import bisect

import numpy as np

from cupyflash._arrays import bits


def spans(rows, n: int, touching: bool = False) -> list[slice]:
    """The row ranges that ``rows`` cover, overlapping ones joined (``touching``: adjacent ones too), in
    increasing order; an index array stands for all ``n`` rows, an empty slice for none."""
    ranges = sorted((r.start, r.stop) if isinstance(r, slice) else (0, n) for r in rows)
    joined = []
    for start, stop in ranges:
        if start == stop:
            continue
        if joined and (start < joined[-1][1] or touching and start == joined[-1][1]):
            joined[-1][1] = max(joined[-1][1], stop)
        else:
            joined.append([start, stop])
    return [slice(start, stop) for start, stop in joined]


def _find(found: list[slice], rows) -> int | None:
    """The index of the span of ``found`` that holds ``rows`` (None for no rows)."""
    if not isinstance(rows, slice):
        return 0 if found else None
    if rows.start == rows.stop:
        return None
    i = bisect.bisect_right([s.start for s in found], rows.start) - 1
    assert i >= 0 and rows.stop <= found[i].stop, (rows, found)
    return i


def _local(xp, rows, span: slice):
    """``rows`` counted from the start of ``span`` (an index array: on the arrays' device, all rows)."""
    return slice(rows.start - span.start, rows.stop - span.start) if isinstance(rows, slice) else xp.asarray(rows)


def _whole(rows, span: slice) -> bool:
    return isinstance(rows, slice) and (rows.start, rows.stop) == (span.start, span.stop)


class Sums:
    """Results over the disjoint spans of a shard's rows, combined from parts.

    ``rows``: every part's rows, known beforehand from the schedule (in any order). ``combine(acc, local,
    part)`` combines a part's arrays into a span's accumulator in place, ``local`` its rows within the span;
    ``neutral(n, part)`` makes an accumulator of n rows that combines as nothing (zeros; lse -inf).

    A part that covers its span whole becomes the span's accumulator as it is; parts of that span that come
    first wait for it, and then combine into it. Only a span that no part covers whole starts from
    ``neutral``. A span's only part is kept as it came (it may be the caller's dtype: ``direct``).
    """

    def __init__(self, xp, rows, n: int, combine, neutral):
        self.xp, self.combine, self.neutral = xp, combine, neutral
        self.spans = spans(rows, n)
        self.count = [0] * len(self.spans)
        self.covered = [False] * len(self.spans)
        for r in rows:
            i = _find(self.spans, r)
            if i is not None:
                self.count[i] += 1
                self.covered[i] |= _whole(r, self.spans[i])
        self.acc, self.waiting = {}, {}

    def direct(self, rows) -> bool:
        """Whether the part of ``rows`` will be its span's only part, covering it whole: its result is then
        final, and may come in the caller's dtype."""
        i = _find(self.spans, rows)
        return i is not None and self.count[i] == 1 and self.covered[i]

    def add(self, rows, part) -> None:
        i = _find(self.spans, rows)
        if i is None:
            return
        span = self.spans[i]
        if i in self.acc:
            self.combine(self.acc[i], _local(self.xp, rows, span), part)
        elif _whole(rows, span):
            if self.count[i] > 1:  # combined into later: the merge kernels want it contiguous
                part = tuple(self.xp.ascontiguousarray(x) for x in part)
            self.acc[i] = part
            for local, early in self.waiting.pop(i, ()):
                self.combine(part, local, early)
        elif self.covered[i]:
            self.waiting.setdefault(i, []).append((_local(self.xp, rows, span), part))
        else:
            self.acc[i] = self.neutral(span.stop - span.start, part)
            self.combine(self.acc[i], _local(self.xp, rows, span), part)

    def finish(self) -> list[tuple[slice, tuple]]:
        """[(span, accumulator arrays)] for every span a part reached, in increasing order."""
        assert not self.waiting, "a part waited for a covering part that never came"
        return [(self.spans[i], self.acc[i]) for i in sorted(self.acc)]


def _index(axis: int, rows) -> tuple:
    return (slice(None),) * axis + (rows,) if axis >= 0 else (Ellipsis, rows) + (slice(None),) * (-axis - 1)


def rows_of(xp, x, rows: slice, axis: int):
    """Rows ``rows`` of x along ``axis`` as a C-contiguous array: x itself when it is all of them."""
    part = x[_index(axis, rows)]
    if part.flags.c_contiguous:
        return part
    copy = empty(xp, part.shape, part.dtype)
    bits(copy)[...] = bits(part)
    return copy


def empty(xp, shape, dtype):
    """An uninitialized array, allocated as unsigned integers (CuPy need not know the dtype: bfloat16)."""
    dtype = np.dtype(dtype)
    return xp.empty(shape, dtype=np.dtype(f"u{dtype.itemsize}")).view(dtype)


def with_rows(shape, n: int, axis: int) -> tuple:
    shape = list(shape)
    shape[axis] = n
    return tuple(shape)


class Held:
    """Key/value rows in hand: pieces [(span, (k, v))] of arrays of ``layout`` ([(shape, dtype)]), the rows on
    ``axis``."""

    def __init__(self, xp, pieces, layout, axis: int):
        self.xp, self.pieces, self.layout, self.axis = xp, pieces, layout, axis

    def take(self, rows) -> tuple:
        """The arrays' rows ``rows`` (a slice: views; an index array: gathered)."""
        i = _find([span for span, _ in self.pieces], rows)
        if i is None:  # no rows (a call on empty shards)
            return tuple(empty(self.xp, with_rows(shape, 0, self.axis), dtype) for shape, dtype in self.layout)
        span, arrays = self.pieces[i]
        return tuple(x[_index(self.axis, _local(self.xp, rows, span))] for x in arrays)


def exchange_rows(comm, xp, held, send: list[slice], receive: list[slice], layout, axis: int):
    """Send the spans ``send`` of the pieces ``held`` ([(span, arrays)]) to rank + 1 and receive the spans
    ``receive`` from rank - 1, as arrays of ``layout`` ([(shape, dtype)], one per array of a piece, the shape
    with any number of rows). Returns (pending, received pieces); every rank exchanges at the same points,
    with nothing to move or not, and the received arrays may be read after ``comm.wait(pending)``."""
    outgoing = []
    for span in send:
        i = _find([s for s, _ in held], span)
        have, arrays = held[i]
        outgoing.extend(rows_of(xp, x, _local(xp, span, have), axis) for x in arrays)
    received = [
        (span, tuple(empty(xp, with_rows(shape, span.stop - span.start, axis), dtype) for shape, dtype in layout))
        for span in receive
    ]
    incoming = [x for _, arrays in received for x in arrays]
    # as unsigned integers: the in-process group copies what arrives, which CuPy's bfloat16 would not take
    pending = comm.exchange([bits(x) for x in outgoing if x.nbytes], [bits(x) for x in incoming if x.nbytes])
    return pending, received


def assemble(xp, shape, dtype, pieces, fill=0, axis: int = -2):
    """An array of ``shape`` and ``dtype`` whose rows along ``axis`` are the pieces' ([(span, array)], cast
    once) and ``fill`` elsewhere; a piece that is all of it is returned as it is, or cast."""
    n = shape[axis]
    if len(pieces) == 1 and _whole(pieces[0][0], slice(0, n)):
        return pieces[0][1].astype(dtype, copy=False)
    x = empty(xp, shape, dtype)
    done = 0
    for span, part in pieces + [(slice(n, n), None)]:
        if span.start > done:
            gap = x[_index(axis, slice(done, span.start))]
            if fill == 0:
                bits(gap)[...] = 0  # (the bits of 0.0 in every float type)
            else:
                gap[...] = fill
        if part is not None and part.dtype == x.dtype:
            bits(x[_index(axis, span)])[...] = bits(part)
        elif part is not None:
            x[_index(axis, span)] = part
        done = span.stop
    return x
