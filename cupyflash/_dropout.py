"""Dropout on the attention probabilities: its exact semantics, its validation, and its mask in NumPy.

With ``dropout_p = p > 0`` the output is ``out = (P * Z / (1 - p)) v`` where ``P`` is the softmax of the
(modified) scores and ``Z`` is a 0/1 keep mask; ``lse`` stays the log-sum-exp of the scores (dropout
never changes it). ``Z`` is a pure function of (seed, flat batch index b, query row i, key column j)
through the counter-based generator Philox 4x32-10 (Salmon et al., SC'11; Random123's constants), so
the backward regenerates it exactly, any tile shape or launch shape gives the same mask, and
:func:`keep_mask` below reproduces it bit for bit. One Philox call gives 128 bits, read as eight 16-bit
values for eight elements of a 16 x 16 block of (i, j):

    counter = ((j >> 4) * 4 + ((j >> 1) & 3),  (i >> 4) * 8 + (i & 7),  b,  0)
    key     = (seed & 0xffffffff,  seed >> 32)
    slot    = ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1)        # 0..7
    u       = 16-bit half (slot & 1) of output word (slot >> 1)          # low half first
    Z_ij    = u < round((1 - p) * 65536)

The eight elements of one call are those (i, j), (i + 8, j), ... that one thread of an m16n8 tensor-core
tile holds, in the forward's layout (queries along rows) and, in pairs, in the dK/dV pass's transposed
one, so the kernels never compute a value they do not use twice over. The keep probability is ``1 - p``
rounded to a multiple of 2^-16 (off by at most 7.6e-6); the kept values are scaled by exactly
``1 / (1 - p)``. ``b`` is the index of the batch entry in the broadcast leading dims, flattened in C
order (so grouped heads that share k and v still get masks of their own).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

KEEP_BITS = 16  # bits of randomness per element
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox 4x32 multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Weyl key increments
_PHILOX_ROUNDS = 10
_U32 = 0xFFFFFFFF
SEED_LIMIT = 2**64


@dataclass(frozen=True)
class Dropout:
    """The resolved dropout of one call: probability ``p`` in (0, 1) and a 64-bit seed. ``batch_offset``:
    the flat batch index of the first batch entry of the arrays at hand (a variable-length batch's
    sequence s run alone starts at s * heads)."""

    p: float
    seed: int
    batch_offset: int = 0

    @property
    def threshold(self) -> int:
        """A 16-bit value u keeps its element iff u < threshold (at most 2^16: then every one is kept)."""
        return min(1 << KEEP_BITS, round((1.0 - self.p) * (1 << KEEP_BITS)))

    @property
    def scale(self) -> float:
        """The factor of the kept probabilities, 1 / (1 - p), as a float64 (a Python float): float64 inputs use
        it as it is, every other dtype rounds it once to float32."""
        return 1.0 / (1.0 - self.p)

    @property
    def key(self) -> tuple[int, int]:
        return self.seed & _U32, self.seed >> 32

    @property
    def round_keys(self) -> tuple[int, ...]:
        """key_schedule(key) flattened: round r's two key words at [2r], [2r + 1] (20 words), as the
        kernels read them from their parameters."""
        return tuple(w for pair in key_schedule(self.key) for w in pair)


def resolve(dropout_p, dropout_seed, *, caller: str, draw_seed: bool = False) -> Dropout | None:
    """Validate ``dropout_p`` and ``dropout_seed``; None when p = 0 (then the seed is only type-checked).

    ``draw_seed``: a missing seed is drawn from ``numpy.random`` (``attention``, which does both passes
    itself); otherwise p > 0 needs an integer seed, because the caller owns it between forward and backward.
    """
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r} ({type(dropout_p).__name__})")
    p = float(dropout_p)
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_seed is not None:
        if isinstance(dropout_seed, (bool, np.bool_)) or not isinstance(dropout_seed, numbers.Integral):
            raise TypeError(
                f"dropout_seed must be an integer in [0, 2**64) or None, got {dropout_seed!r} "
                f"({type(dropout_seed).__name__})"
            )
        if not 0 <= int(dropout_seed) < SEED_LIMIT:
            raise ValueError(f"dropout_seed must be in [0, 2**64), got {dropout_seed}")
    if p == 0.0:
        return None
    if dropout_seed is None:
        if not draw_seed:
            raise ValueError(
                f"{caller} needs an integer dropout_seed when dropout_p > 0 (got None): the same "
                "seed must reach attention_forward and attention_backward"
            )
        dropout_seed = int(np.random.randint(0, 2**63 - 1, dtype=np.int64))
    return Dropout(p, int(dropout_seed))


def key_schedule(key) -> list[tuple[int, int]]:
    """Philox 4x32's round keys for ``key`` (two Python ints): round r uses key + r * the Weyl increments,
    word by word, modulo 2^32."""
    k0, k1 = int(key[0]) & _U32, int(key[1]) & _U32
    return [((k0 + r * _PHILOX_W[0]) & _U32, (k1 + r * _PHILOX_W[1]) & _U32) for r in range(_PHILOX_ROUNDS)]


def philox4x32_10(counter, key):
    """Philox 4x32-10 on NumPy arrays: ``counter`` four uint32 arrays (broadcast together), ``key`` two
    Python ints; returns the four uint32 output words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    m0, m1, low = np.uint64(_PHILOX_M[0]), np.uint64(_PHILOX_M[1]), np.uint64(_U32)
    for k0, k1 in key_schedule(key):
        p0, p1 = m0 * c0, m1 * c2  # exact: 32 x 32 -> 64 bits
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0),
            p1 & low,
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1),
            p0 & low,
        )
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def keep_mask(dropout: Dropout, batch: tuple[int, ...], rows, cols) -> np.ndarray:
    """Z for the batch entries of leading shape ``batch``, query rows ``rows`` and key columns ``cols``
    (1-D integer arrays): bool, shape ``batch + (len(rows), len(cols))``, True = kept."""
    b = (dropout.batch_offset + np.arange(math.prod(batch), dtype=np.uint64)).reshape(tuple(batch) + (1, 1))
    i = np.asarray(rows, dtype=np.uint64)[:, None]
    j = np.asarray(cols, dtype=np.uint64)[None, :]
    c0 = (j >> np.uint64(4)) * np.uint64(4) + ((j >> np.uint64(1)) & np.uint64(3))
    c1 = (i >> np.uint64(4)) * np.uint64(8) + (i & np.uint64(7))
    words = philox4x32_10((c0, c1, b, np.uint64(0)), dropout.key)
    slot = (
        ((i >> np.uint64(3)) & np.uint64(1)) * np.uint64(4)
        + ((j >> np.uint64(3)) & np.uint64(1)) * np.uint64(2)
        + (j & np.uint64(1))
    )
    word = np.choose((slot >> np.uint64(1)).astype(np.intp), words)
    u = (word >> (np.uint32(16) * (slot & np.uint64(1)).astype(np.uint32))) & np.uint32(0xFFFF)
    return u < dropout.threshold
