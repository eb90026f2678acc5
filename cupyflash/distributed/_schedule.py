"""Which attention calls a rank makes at each step of the ring.

At step t of W, rank r holds the key/value shard of rank s = (r - t) mod W (its own at t = 0; the shards
travel to the next rank after each step). Its query chunks meet that shard's key chunks pair by pair; under
a causal mask a pair (query chunk a, key chunk b) is

    a > b   every key is before every query: the full block, no mask
    a = b   the diagonal block: the causal mask, which is the local bottom-right one (equal lengths)
    a < b   every key is after every query: nothing to compute

Without position-dependent scores the pairs of a step merge into one rectangular call. Zigzag, W = 2
(rank 0 holds chunks [0 3], rank 1 holds [1 2]):

    rank 0, t = 0, own keys [0 3]:    q [0 3] x k [0 3], causal (the local mask is the global one)
    rank 0, t = 1, keys of rank 1:    q [3]   x k [1 2], full
    rank 1, t = 1, keys of rank 0:    q [1 2] x k [0],   full

so every rank computes the same number of pairs at every step. With ALiBi, whose bias depends on the global
distance i - j, each pair is its own call, with its global positions.

A window (left, right) keeps the keys j with i - left <= j <= i + right (global positions; causal folds in
as right = 0). In the pair of chunks a, b (length c, local rows i', keys j', d = (a - b) c) that is the band
lo <= j' - i' <= hi with lo = d - left, hi = d + right: a pair whose band misses [-(c - 1), c - 1] is
skipped, so a rank computes O(N w) scores, not O(N^2). What is left is one call of the kernels' own,
bottom-right aligned window on a square sub-block: for lo > 0 the rows [0, c - lo) against the keys
[lo, c) (the rows past c - lo see no key of the pair, the keys before lo no row), with window (0, hi - lo);
for hi < 0 the rows [-hi, c) against the keys [0, c + hi), with window (hi - lo, 0); otherwise the whole
pair with window (-lo, hi). A bound past the block's edge becomes -1 (unbounded). The local window of
every call is then one the kernels take as it is, with no position offset: the sub-block's first row and
first key sit on its diagonal.
"""

from __future__ import annotations

from dataclasses import dataclass

from cupyflash.distributed._layout import chunks_of
from cupyflash.distributed._pieces import spans


@dataclass(frozen=True)
class Block:
    """One attention call: local query rows ``q_rows`` against rows ``k_rows`` of the key/value shard in hand.

    ``causal``: apply the local bottom-right causal mask (a diagonal block). ``q_start``, ``k_start``: global
    positions of the first query and key rows when the block is one chunk pair or part of one (else None).
    ``window``: the local window of a windowed call (module docstring), None for none.
    """

    q_rows: slice
    k_rows: slice
    causal: bool
    q_start: int | None = None
    k_start: int | None = None
    window: tuple[int, int] | None = None


def source_rank(rank: int, step: int, world_size: int) -> int:
    """The rank whose key/value shard ``rank`` holds at ``step``."""
    return (rank - step) % world_size


def blocks(
    layout: str,
    world_size: int,
    rank: int,
    step: int,
    nq_chunk: int,
    nk_chunk: int,
    causal: bool,
    per_pair: bool,
    window: tuple[int, int] | None = None,
) -> list[Block]:
    """The calls of ``rank`` at ``step``; chunks of ``nq_chunk`` query and ``nk_chunk`` key rows.

    ``per_pair``: one call per chunk pair, with global positions (position-dependent scores). ``window``:
    (left, right) over global positions, causal folded in (right = 0); then nq_chunk = nk_chunk and each
    pair is one call on the part of it the band covers, or none (module docstring).
    """
    q_chunks = chunks_of(layout, world_size, rank)
    k_chunks = chunks_of(layout, world_size, source_rank(rank, step, world_size))
    if window is not None and nq_chunk > 0:  # (empty shards: the plain schedule's empty calls)
        found = []
        for qs, a in enumerate(q_chunks):
            for ks, b in enumerate(k_chunks):
                part = windowed_pair(a, b, nq_chunk, window)
                if part is not None:
                    r0, k0, m, local = part
                    found.append(
                        Block(
                            slice(qs * nq_chunk + r0, qs * nq_chunk + r0 + m),
                            slice(ks * nk_chunk + k0, ks * nk_chunk + k0 + m),
                            False,
                            a * nq_chunk + r0,
                            b * nk_chunk + k0,
                            local,
                        )
                    )
        return found
    pairs = []  # (local q slot, local k slot, causal)
    for qs, a in enumerate(q_chunks):
        for ks, b in enumerate(k_chunks):
            if not causal or a > b:
                pairs.append((qs, ks, False))
            elif a == b:
                pairs.append((qs, ks, True))
    if per_pair:
        return [
            Block(
                slice(qs * nq_chunk, (qs + 1) * nq_chunk),
                slice(ks * nk_chunk, (ks + 1) * nk_chunk),
                diag,
                q_chunks[qs] * nq_chunk,
                k_chunks[ks] * nk_chunk,
            )
            for qs, ks, diag in pairs
        ]
    if not pairs:
        return []
    if any(diag for _, _, diag in pairs):
        # Only the step with the rank's own shard has diagonal pairs; its query and key chunks are the same
        # ones in the same increasing order, so one call with the local causal mask is exact.
        n = len(q_chunks)
        return [Block(slice(0, n * nq_chunk), slice(0, n * nk_chunk), True)]
    q_slots = sorted({qs for qs, _, _ in pairs})
    k_slots = sorted({ks for _, ks, _ in pairs})
    rectangle = (
        len(pairs) == len(q_slots) * len(k_slots)
        and q_slots == list(range(q_slots[0], q_slots[-1] + 1))
        and k_slots == list(range(k_slots[0], k_slots[-1] + 1))
    )
    if rectangle:
        return [
            Block(
                slice(q_slots[0] * nq_chunk, (q_slots[-1] + 1) * nq_chunk),
                slice(k_slots[0] * nk_chunk, (k_slots[-1] + 1) * nk_chunk),
                False,
            )
        ]
    return [
        Block(slice(qs * nq_chunk, (qs + 1) * nq_chunk), slice(ks * nk_chunk, (ks + 1) * nk_chunk), False)
        for qs, ks, _ in pairs
    ]


def windowed_pair(a: int, b: int, c: int, window: tuple[int, int]):
    """The part of the pair of chunks ``a`` (queries) and ``b`` (keys), ``c`` rows each, that the global
    ``window`` (left, right; -1 unbounded) lets any row see: (first row, first key, rows = keys, local window),
    all local to the chunks, or None when no row of a sees a key of b (module docstring)."""
    left, right = window
    d = (a - b) * c
    lo = -c if left < 0 else d - left  # the band lo <= j' - i' <= hi, clipped to the pair below
    hi = c if right < 0 else d + right
    lo, hi = max(lo, -(c - 1)), min(hi, c - 1)
    if lo > hi:
        return None
    if lo > 0:
        r0, k0, m = 0, lo, c - lo
    elif hi < 0:
        r0, k0, m = -hi, 0, c + hi
    else:
        r0, k0, m = 0, 0, c
    shift = k0 - r0  # the sub-block's j' - i' on its diagonal
    local_left = -1 if lo - shift <= -(m - 1) else shift - lo
    local_right = -1 if hi - shift >= m - 1 else hi - shift
    return r0, k0, m, (local_left, local_right)


class Plan:
    """Every rank's calls at every step (``blocks_of(rank, step)``: each rank works them all out, since what
    travels depends on the calls of the ranks it travels to), and the rows that travel.

    Key/value shards travel from rank to rank, and so do the float sums of their dK, dV (one step behind,
    from the first rank after the shard's owner back home, ``_ring``); of either only the rows some call
    reads or wrote travel. ``n``: the rows of a key shard.
    """

    def __init__(self, blocks_of, world_size: int, rank: int, n: int):
        self.world_size, self.rank, self.n = world_size, rank, n
        self.table = [[blocks_of(r, t) for t in range(world_size)] for r in range(world_size)]

    def blocks(self, step: int) -> list:
        """This rank's calls at ``step``."""
        return self.table[self.rank][step]

    def _key_rows(self, source: int, steps) -> list:
        """The key rows of rank ``source``'s shard that the calls at ``steps`` read (by the ranks holding it)."""
        w = self.world_size
        return [blk.k_rows for t in steps for blk in self.table[(source + t) % w][t]]

    def keys_after(self, source: int, step: int) -> list[slice]:
        """The rows of rank ``source``'s key/value shard that go on at ``step``: those read after it."""
        return spans(self._key_rows(source, range(step + 1, self.world_size)), self.n, touching=True)

    def sums_after(self, source: int, step: int) -> list[slice]:
        """The rows of the dK, dV sums of rank ``source``'s shard after ``step`` (>= 1): those the calls of
        steps 1 .. step wrote (the owner's own, step 0, stay home)."""
        return spans(self._key_rows(source, range(1, step + 1)), self.n)
