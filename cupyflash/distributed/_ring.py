"""Ring attention: attention over a sequence sharded across W ranks, exact, by passing the key/value shards
around a ring.

Forward, on every rank at once (s = the rank whose key/value shard is in hand at step t, ``_schedule``):

    for t in 0 .. W-1:
        start sending the k, v shard in hand to rank + 1, receiving the next one from rank - 1
        for each block of the step:  out_b, lse_b = attention_forward(q rows, k rows, v rows)
                                     (out, lse) of those rows = merge_attention_states((out, lse), (out_b, lse_b))

so the transfer of step t+1's keys overlaps step t's attention. Each block's out comes unrounded, in the
accumulator's dtype (``attention_forward(out_dtype=...)``); the blocks merge in float32 (float64 for float64
inputs), and the result is rounded to the inputs' dtype once, at the end, as one GPU's is. The gradients likewise
(``attention_backward(grad_dtype=...)``).

Backward: each block's gradients come from ``attention_backward`` with the final ``out`` and ``lse`` (which
make each block's softmax exact). dQ accumulates on its rank; dK and dV accumulate in a float32 buffer that
travels with the keys, one step behind them, and arrives back at its owner after W steps. The order of every
sum is fixed by the schedule, so the gradients are deterministic for a fixed W.

Memory per rank: the shards, the float32 accumulators of out (or dq, dk, dv), and two k/v (and two dk/dv)
buffers: one in hand, one arriving.

ALiBi adds -slope * |i - j| with global positions i, j. Within one chunk pair that is the kernels' own ALiBi
for a diagonal pair (same chunk, so the local distance is the global one). For a pair whose keys all lie
before its queries it splits as -slope * (i - j) = rho_i + beta_j: beta_j = slope * (j - j_last) <= 0 per
key, passed as a (1, Nk) bias, and rho_i = -slope * (i - j_last), a per-row constant that shifts the block's
lse and leaves its out unchanged. Keys after queries mirror it.
"""

from __future__ import annotations

import numpy as np

from cupyflash._api import attention_backward, attention_forward
from cupyflash._arrays import Array, bits, cupy, lse_dtype, round_up
from cupyflash._cuda import ring_states
from cupyflash._merge import merge_attention_states
from cupyflash._problem import validate
from cupyflash.distributed._comm import Comm, Communicator, check_same_call
from cupyflash.distributed._layout import check_layout, chunks_per_rank
from cupyflash.distributed._schedule import blocks


class _Call:
    """A validated ring call: the arrays' module, dtypes, scale, options and the chunk lengths."""

    def __init__(self, arrays, comm, causal, scale, window, softcap, alibi_slopes, layout, caller):
        layout = check_layout(layout)
        options = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes)
        problem = validate(arrays, causal, scale, options)
        check_comm(problem.xp, comm, caller)
        q, k = arrays["q"], arrays["k"]
        per = chunks_per_rank(layout)
        for name, x in (("q", q), ("k", k)):
            if x.shape[-2] % per:
                raise ValueError(
                    f"{caller}: {name} holds {x.shape[-2]} rows of the sequence; a {layout!r} shard holds "
                    f"{per} equal chunks (shard the sequence with cupyflash.distributed.shard)"
                )
        if (problem.causal or window is not None or alibi_slopes is not None) and q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"{caller}: causal, window and alibi_slopes need shards of q and k of one length (a sequence "
                f"attending to itself), got {q.shape[-2]} and {k.shape[-2]} rows"
            )
        self.xp, self.dtype, self.acc = problem.xp, problem.dtype, lse_dtype(problem.dtype)
        self.scale, self.causal, self.softcap, self.layout = problem.scale, problem.causal, float(softcap), layout
        # (left, right) over global positions with causal folded in (right = 0): every pair its own call
        # (an unbounded window resolves to no modifier at all)
        self.window = (
            None if window is None or problem.mods is None else problem.mods.window_with_causal(problem.causal)
        )
        # float32 slopes, as attention uses them (then widened for float64's bias blocks)
        self.alibi = None if alibi_slopes is None else self.xp.asarray(alibi_slopes).astype(np.float32).astype(self.acc)
        self.nq_chunk, self.nk_chunk = q.shape[-2] // per, k.shape[-2] // per
        self.rank, self.world_size = comm.rank, comm.world_size

    def blocks(self, step):
        return blocks(
            self.layout,
            self.world_size,
            self.rank,
            step,
            self.nq_chunk,
            self.nk_chunk,
            self.causal,
            per_pair=self.alibi is not None,
            window=self.window,
        )

    def options(self, blk, nq, nk):
        """The keyword arguments of ``blk``'s attention call, and the shift of its lse (None: no shift)."""
        kwargs = dict(causal=blk.causal, scale=self.scale, softcap=self.softcap)
        if blk.window is not None:
            kwargs["window"] = blk.window
        if self.alibi is None:
            return kwargs, None
        if blk.q_start == blk.k_start:
            kwargs["alibi_slopes"] = self.alibi
            return kwargs, None
        xp, slope = self.xp, self.alibi[..., None]
        if blk.k_start + nk <= blk.q_start:  # every key before every query: i - j = (i - j_last) + (j_last - j)
            beta = xp.arange(nk, dtype=self.acc) - (nk - 1)
            rho = -(xp.arange(nq, dtype=self.acc) + float(blk.q_start - blk.k_start - nk + 1))
        else:  # every key after every query: j - i = (j - j_first) + (j_first - i)
            beta = -xp.arange(nk, dtype=self.acc)
            rho = -(float(blk.k_start - blk.q_start) - xp.arange(nq, dtype=self.acc))
        kwargs["bias"] = (slope * beta)[..., None, :]
        return kwargs, slope * rho


def check_comm(xp, comm, caller) -> None:
    """The arrays' module and the current device suit the communicator: NCCL moves CuPy arrays on its own
    device."""
    if isinstance(comm, Communicator):
        if xp is np and comm.world_size > 1:
            raise TypeError(
                f"{caller}: the arrays are NumPy arrays, but an NCCL communicator moves CuPy arrays "
                "(run NumPy arrays over an InProcessGroup)"
            )
        if xp is not np and cupy.cuda.Device().id != comm.device:
            raise ValueError(
                f"{caller}: the current device is {cupy.cuda.Device().id} but the communicator's is "
                f"{comm.device}; run under `with cupy.cuda.Device({comm.device}):`"
            )


def _describe(caller, arrays, call):
    """The call as every rank must make it: resolved options (a default scale and the same value passed agree),
    the array library, shapes and dtypes."""
    shapes = " ".join(f"{name}={tuple(x.shape)}:{x.dtype}" for name, x in arrays.items())
    alibi = None if call.alibi is None else tuple(call.alibi.shape)
    return (
        f"{caller} {call.xp.__name__} layout={call.layout!r} causal={call.causal} scale={call.scale!r} "
        f"window={call.window!r} softcap={call.softcap!r} alibi={alibi} {shapes}"
    )


def _prepare(arrays, comm, causal, scale, window, softcap, alibi_slopes, layout, caller):
    """Validate on every rank and make sure every rank makes the same call, before anything travels: a rank
    that raised alone would leave the others waiting for it."""
    try:
        call, failure = _Call(arrays, comm, causal, scale, window, softcap, alibi_slopes, layout, caller), None
        description = _describe(caller, arrays, call)
    except (TypeError, ValueError) as error:
        call, failure = None, error
        description = f"{caller} raised {type(error).__name__}: {error}"
    check_same_call(comm, description)
    if failure is not None:
        raise failure
    return call


class Travelling:
    """Arrays that move one rank along the ring per step: two byte buffers, the one in hand and the one
    arriving (a world of one rank needs only the first)."""

    def __init__(self, comm, xp, layout):
        self.comm, self.layout = comm, layout  # [(shape, dtype)]
        offsets, total = [], 0
        for shape, dtype in layout:
            offsets.append(total)
            total = round_up(total + int(np.prod(shape)) * np.dtype(dtype).itemsize, 256)
        self.offsets = offsets
        self.buffers = [xp.empty(total, dtype=np.uint8) for _ in range(1 if comm.world_size == 1 else 2)]
        self.current, self.pending = 0, None

    def _views(self, buffer):
        return [
            buffer[o : o + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
            for o, (shape, dtype) in zip(self.offsets, self.layout)
        ]

    def in_hand(self):
        """The arrays in hand (waiting for them if they are still arriving)."""
        if self.pending is not None:
            self.comm.wait(self.pending)
            self.pending = None
        return self._views(self.buffers[self.current])

    def settle(self):
        """After a failure: the current stream waits for the transfer in flight, so that its buffers go back
        to the memory pool only once NCCL is done with them (nothing to wait for between threads)."""
        if self.pending is not None and isinstance(self.comm, Communicator):
            self.comm.wait(self.pending)
        self.pending = None

    def pass_on(self):
        """Send the arrays in hand to the next rank; the previous rank's arrive in the other buffer."""
        other = 1 - self.current
        self.pending = self.comm.exchange([self.buffers[self.current]], [self.buffers[other]])
        self.current = other


def start_keys(comm, call, k, v):
    keys = Travelling(comm, call.xp, [(k.shape, k.dtype), (v.shape, v.dtype)])
    k_hand, v_hand = keys._views(keys.buffers[0])
    bits(k_hand)[...] = bits(k)
    bits(v_hand)[...] = bits(v)
    return keys


def ring_attention_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    comm: Comm,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    layout: str = "zigzag",
) -> tuple[Array, Array]:
    """Attention over a sequence sharded across the ranks of ``comm``: this rank's rows of ``out`` and ``lse``.

    Exactly :func:`cupyflash.attention_forward` over the whole sequence (every rank calls it at once, with
    its shards); the key/value shards travel around the ring, and each step's blocks are merged by their
    log-sum-exp in float32 (float64 for float64 inputs).

    Parameters
    ----------
    q : numpy.ndarray or cupy.ndarray, shape (..., Nq / W, D)
        This rank's shard of the queries (:func:`shard`), dtype float16, bfloat16, float32 or float64.
    k : numpy.ndarray or cupy.ndarray, shape (..., Nk / W, D)
        This rank's shard of the keys; same dtype. Leading dims broadcast as in
        :func:`cupyflash.attention` (grouped-query attention: ``k`` of shape (B, Hk, 1, Nk / W, D) with
        ``q`` (B, Hk, G, Nq / W, D)); they travel without being broadcast.
    v : numpy.ndarray or cupy.ndarray, shape (..., Nk / W, Dv)
        This rank's shard of the values.
    comm : Communicator or an InProcessGroup's communicator
        The ring (:func:`init`, :class:`InProcessGroup`).
    causal : bool, optional
        The causal mask over global positions (Nq = Nk: a sequence attending to itself).
    scale : float, optional
        Multiplies the scores; defaults to ``1 / sqrt(D)``.
    window : (int, int), optional
        As in :func:`cupyflash.attention`, over global positions (Nq = Nk): row i sees the keys j with
        ``i - left <= j <= i + right`` (-1: unbounded). Chunk pairs that no row can see are skipped, so a
        window of w costs O(N w) per rank.
    softcap : float, optional
        As in :func:`cupyflash.attention`.
    alibi_slopes : array, optional
        As in :func:`cupyflash.attention`, with global positions: ``-slope * |i - j|`` (Nq = Nk). Blocks
        between different chunks then run with a per-key bias (slower than the plain kernels).
    layout : {"zigzag", "contiguous"}, optional
        How the sequence was sharded (:func:`shard`); "zigzag" (the default) balances causal work.

    Returns
    -------
    out : array, shape (..., Nq / W, Dv), the inputs' dtype
        This rank's rows of the output, in the layout of its q shard.
    lse : array, shape (..., Nq / W), float32 (float64 for float64 inputs)
        Their log-sum-exp over the whole sequence's keys, as :func:`cupyflash.attention_forward` returns it.

    Examples
    --------
    Two ranks as threads of this process, on NumPy arrays (the same call runs on GPUs over NCCL):

    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import distributed as dist
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 64, 16), dtype=np.float32) for _ in range(3))
    >>> def rank_work(comm):
    ...     q_l, k_l, v_l = (dist.shard(x, comm, layout="zigzag") for x in (q, k, v))
    ...     out_l, lse_l = dist.ring_attention_forward(q_l, k_l, v_l, comm=comm, causal=True)
    ...     return dist.unshard(out_l, comm, layout="zigzag")
    >>> out = dist.InProcessGroup(2).run(rank_work)[0]
    >>> bool(np.abs(out - cupyflash.attention(q, k, v, causal=True)).max() < 1e-5)
    True
    """
    arrays = dict(q=q, k=k, v=v)
    call = _prepare(arrays, comm, causal, scale, window, softcap, alibi_slopes, layout, "ring_attention_forward")
    keys = start_keys(comm, call, k, v)
    try:
        return _forward_steps(comm, call, q, keys)
    except BaseException:
        keys.settle()
        raise


def run_steps(comm, keys, blocks_of, attend) -> None:
    """The ring's steps: at each, the key/value shard in hand goes on to the next rank while ``attend(blk,
    k_hand, v_hand)`` runs each block of ``blocks_of(step)`` against it."""
    for step in range(comm.world_size):
        k_hand, v_hand = keys.in_hand()
        if step + 1 < comm.world_size:
            keys.pass_on()
        for blk in blocks_of(step):
            attend(blk, k_hand, v_hand)


def run_backward_steps(comm, xp, keys, grads, blocks_of, gradients) -> None:
    """The backward's steps: ``gradients(blk, k_hand, v_hand)`` returns a block's (key rows, dk, dv) (having
    added its dq itself); each step's dK, dV are added into the sums of the keys in hand, which arrive from the
    previous rank while the step's blocks run and go on with the keys, one step behind them: after the last
    step each sum is home (``grads.in_hand()``)."""
    for step in range(comm.world_size):
        k_hand, v_hand = keys.in_hand()
        if step + 1 < comm.world_size:
            keys.pass_on()
        parts = [gradients(blk, k_hand, v_hand) for blk in blocks_of(step)]
        dk_hand, dv_hand = grads.in_hand()
        if step == 0:
            dk_hand[...], dv_hand[...] = 0, 0
        for rows, dk_b, dv_b in parts:
            add_rows(xp, dk_hand, rows, dk_b)
            add_rows(xp, dv_hand, rows, dv_b)
        if comm.world_size > 1:
            grads.pass_on()  # after the last step this sends each sum home


def _forward_steps(comm, call, q, keys):
    xp, acc = call.xp, call.acc
    state = {}  # out and lse, made at the first block (lse -inf: its first merge into a row copies the block)

    def attend(blk, k_hand, v_hand):
        qb, kb, vb = q[..., blk.q_rows, :], k_hand[..., blk.k_rows, :], v_hand[..., blk.k_rows, :]
        kwargs, shift = call.options(blk, qb.shape[-2], kb.shape[-2])
        out_b, lse_b = attention_forward(qb, kb, vb, **kwargs, out_dtype=acc)
        if shift is not None:
            lse_b = lse_b + shift
        if not state:
            state["out"] = xp.zeros(out_b.shape[:-2] + (q.shape[-2], out_b.shape[-1]), dtype=acc)
            state["lse"] = xp.full(state["out"].shape[:-1], -np.inf, dtype=acc)
        merge_rows(xp, state["out"], state["lse"], blk.q_rows, out_b, lse_b)

    run_steps(comm, keys, call.blocks, attend)
    return state["out"].astype(call.dtype), state["lse"]


def ring_attention_backward(
    dout: Array,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    *,
    comm: Comm,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    layout: str = "zigzag",
) -> tuple[Array, Array, Array]:
    """Gradients of ring attention: this rank's shards of ``dq``, ``dk`` and ``dv``.

    Every rank calls it at once. dQ accumulates on its rank; the float32 sums of dK and dV travel around
    the ring with the keys and arrive back at their owner. Deterministic for a fixed world size.

    Parameters
    ----------
    dout : array, shape (..., Nq / W, Dv)
        This rank's shard of the gradient of the loss with respect to ``out``; the inputs' dtype.
    q, k, v : arrays, shapes (..., Nq / W, D), (..., Nk / W, D), (..., Nk / W, Dv)
        This rank's shards, as given to :func:`ring_attention_forward`.
    out, lse : arrays, shapes (..., Nq / W, Dv) and (..., Nq / W)
        What :func:`ring_attention_forward` returned on this rank.
    comm, causal, scale, window, softcap, alibi_slopes, layout
        Exactly as passed to :func:`ring_attention_forward`.

    Returns
    -------
    dq : array, shape of ``q``
    dk : array, shape of ``k``
    dv : array, shape of ``v``
        This rank's shards of the gradients, in the inputs' dtype; where an input was broadcast (GQA), its
        gradient is summed over the broadcast dims.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import distributed as dist
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 3, 48, 16), dtype=np.float32)      # (B, Hk, G, N, D)
    >>> k, v = (rng.standard_normal((1, 2, 1, 48, 16), dtype=np.float32) for _ in range(2))
    >>> dout = rng.standard_normal(q.shape, dtype=np.float32)
    >>> def rank_work(comm):
    ...     q_l, k_l, v_l, dout_l = (dist.shard(x, comm) for x in (q, k, v, dout))
    ...     out_l, lse_l = dist.ring_attention_forward(q_l, k_l, v_l, comm=comm, causal=True)
    ...     grads = dist.ring_attention_backward(dout_l, q_l, k_l, v_l, out_l, lse_l, comm=comm, causal=True)
    ...     return [dist.unshard(g, comm) for g in grads]
    >>> dq, dk, dv = dist.InProcessGroup(3).run(rank_work)[0]
    >>> out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    >>> expected = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> [bool(np.abs(a - b).max() < 1e-5) for a, b in zip((dq, dk, dv), expected)]
    [True, True, True]
    """
    arrays = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    call = _prepare(arrays, comm, causal, scale, window, softcap, alibi_slopes, layout, "ring_attention_backward")
    xp, acc = call.xp, call.acc
    keys = start_keys(comm, call, k, v)
    grads = Travelling(comm, xp, [(k.shape, acc), (v.shape, acc)])  # dk, dv of the keys in hand
    try:
        return _backward_steps(comm, call, dout, q, out, lse, keys, grads)
    except BaseException:
        keys.settle()
        grads.settle()
        raise


def _backward_steps(comm, call, dout, q, out, lse, keys, grads):
    xp, acc = call.xp, call.acc
    dq = xp.zeros(q.shape, dtype=acc)

    def gradients(blk, k_hand, v_hand):
        kb, vb = k_hand[..., blk.k_rows, :], v_hand[..., blk.k_rows, :]
        kwargs, shift = call.options(blk, blk.q_rows.stop - blk.q_rows.start, kb.shape[-2])
        lse_b = lse[..., blk.q_rows] if shift is None else lse[..., blk.q_rows] - shift
        dq_b, dk_b, dv_b, *_ = attention_backward(
            dout[..., blk.q_rows, :],
            q[..., blk.q_rows, :],
            kb,
            vb,
            out[..., blk.q_rows, :],
            lse_b,
            **kwargs,
            grad_dtype=acc,
        )
        add_rows(xp, dq, blk.q_rows, dq_b)
        return blk.k_rows, dk_b, dv_b

    run_backward_steps(comm, xp, keys, grads, call.blocks, gradients)
    dk, dv = grads.in_hand()
    return dq.astype(call.dtype), dk.astype(call.dtype), dv.astype(call.dtype)


def merge_rows(xp, out, lse, rows, out_b, lse_b):
    """Rows ``rows`` (a slice, or an index array of distinct rows) of the running (out, lse) merged with a
    block's (out_b, lse_b): the public merge on NumPy and for index arrays, its one-pass kernel on CuPy."""
    if xp is np or not isinstance(rows, slice):
        out[..., rows, :], lse[..., rows] = merge_attention_states(
            out[..., rows, :], lse[..., rows], out_b.astype(out.dtype), lse_b
        )
    else:
        ring_states.merge_rows(out, lse, rows.start, out_b, lse_b)


def add_rows(xp, acc, rows, x):
    """acc[..., rows, :] += x, summed in acc's float type (rows: a slice, or an index array of distinct rows)."""
    if xp is np or not isinstance(rows, slice):
        acc[..., rows, :] += x.astype(acc.dtype)
    else:
        ring_states.add_rows(acc, rows.start, x)


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    comm: Comm,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    layout: str = "zigzag",
) -> Array:
    """Ring attention's output alone: :func:`ring_attention_forward` without the lse.

    Parameters
    ----------
    q, k, v, comm, causal, scale, window, softcap, alibi_slopes, layout
        As in :func:`ring_attention_forward`: this rank's shards (..., N / W, D) and the ring.

    Returns
    -------
    out : array, shape (..., Nq / W, Dv), the inputs' dtype
        This rank's rows of ``attention(q, k, v)`` over the whole sequence.

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import distributed as dist
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 40, 8), dtype=np.float32) for _ in range(3))
    >>> group = dist.InProcessGroup(4)
    >>> outs = group.run(lambda comm: dist.ring_attention(*(dist.shard(x, comm, layout="contiguous")
    ...                                                      for x in (q, k, v)), comm=comm, layout="contiguous"))
    >>> [o.shape for o in outs]
    [(2, 10, 8), (2, 10, 8), (2, 10, 8), (2, 10, 8)]
    """
    out, _ = ring_attention_forward(
        q,
        k,
        v,
        comm=comm,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        layout=layout,
    )
    return out
