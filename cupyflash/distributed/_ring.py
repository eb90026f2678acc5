"""Ring attention: attention over a sequence sharded across W ranks, exact, by passing the key/value shards
around a ring.

Forward, on every rank at once (s = the rank whose key/value shard is in hand at step t, ``_schedule``):

    for t in 0 .. W-1:
        start sending the rows of the k, v shard in hand that later steps read to rank + 1, receiving the
            next shard's from rank - 1
        for each block of the step:  out_b, lse_b = attention_forward(q rows, k rows, v rows)
                                     (out, lse) of those rows = merge_attention_states((out, lse), (out_b, lse_b))

so the transfer of step t+1's keys overlaps step t's attention. Each block's out comes unrounded, in the
accumulator's dtype (``attention_forward(out_dtype=...)``); the blocks merge in float32 (float64 for float64
inputs), and the result is rounded to the inputs' dtype once, at the end, as one GPU's is. The gradients likewise
(``attention_backward(grad_dtype=...)``). The first block that covers a run of rows is that run's accumulator,
as it came (no zero-filled one, no merge into it); a block that is the only one of its rows asks for the inputs'
dtype directly (its one rounding). ``_pieces`` holds this bookkeeping.

Backward: each block's gradients come from ``attention_backward`` with the final ``out`` and ``lse`` (which
make each block's softmax exact). dQ accumulates on its rank, and so do dK and dV of its own keys (step 0); those
of another rank's keys start a float32 sum at the first rank after the owner, which travels one step behind the
keys and arrives back at its owner after the last step. The own step's blocks run half before the other steps
(while the first keys travel) and half after (while the last sums go home). The order of every sum is fixed by
the schedule, so the gradients are deterministic for a fixed W.

Only the rows that some call reads (keys) or wrote (dK, dV sums) travel, and nothing is zeroed, merged or
converted for rows no call touches: under a window the shards move a few thousand rows, not all of them.

Memory per rank: the shards, the float32 accumulators of out (or dq, dk, dv), the key/value rows in hand and
arriving (in the backward also their dK, dV sums).

ALiBi adds -slope * |i - j| with global positions i, j. Within one chunk pair that is the kernels' own ALiBi
for a diagonal pair (same chunk, so the local distance is the global one). For a pair whose keys all lie
before its queries it splits as -slope * (i - j) = rho_i + beta_j: beta_j = slope * (j - j_last) <= 0 per
key, passed as a (1, Nk) bias, and rho_i = -slope * (i - j_last), a per-row constant that shifts the block's
lse and leaves its out unchanged. Keys after queries mirror it.
"""

from __future__ import annotations

import numpy as np

from cupyflash._api import attention_backward, attention_forward
from cupyflash._arrays import Array, cupy, lse_dtype
from cupyflash._cuda import ring_states
from cupyflash._merge import merge_attention_states
from cupyflash._problem import validate
from cupyflash.distributed._comm import Comm, Communicator, check_same_call
from cupyflash.distributed._layout import check_layout, chunks_per_rank
from cupyflash.distributed._pieces import Held, Sums, assemble, exchange_rows
from cupyflash.distributed._schedule import Plan, blocks


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
        self.batch, self.dv = problem.batch, arrays["v"].shape[-1]
        self.nq, self.nk = q.shape[-2], k.shape[-2]
        # the float sums of dK, dV: k's and v's shapes
        self.acc_k_shape, self.acc_v_shape = k.shape, arrays["v"].shape
        self.rank, self.world_size = comm.rank, comm.world_size
        self.plan = Plan(lambda rank, step: self.blocks(step, rank), comm.world_size, comm.rank, self.nk)

    def blocks(self, step, rank=None):
        """The calls of ``rank`` (default: this one) at ``step``."""
        return blocks(
            self.layout,
            self.world_size,
            self.rank if rank is None else rank,
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
    return _forward(comm, call, q, k, v)


def run_forward(comm, call, k, v, attend, axis=-2):
    """The forward's steps, shared with the packed ring: at each, the key/value rows that later steps read go
    on to the next rank while ``attend(blk, kb, vb, direct)`` computes each of the step's blocks against the
    rows in hand, returning its (out, lse) with the rows on axes -2 and -1 (in the caller's dtype if
    ``direct``: the block is the only one of its rows). The keys' rows lie on ``axis``.

    Returns the pieces [(rows, (out, lse))] of the merged results (``_pieces.Sums``): a block that covers its
    rows first is their accumulator, no zero-filled one, and rows no block covers have no piece."""
    xp, plan, w = call.xp, call.plan, comm.world_size
    found = Sums(xp, [blk.q_rows for t in range(w) for blk in plan.blocks(t)], call.nq, _merge(xp), _no_rows(xp))
    held, pending, arrived = own_keys(call, k, v, axis), None, []
    try:
        for t in range(w):
            if pending is not None:
                comm.wait(pending)
                held = Held(xp, arrived, held.layout, axis)
            if t + 1 < w:
                pending, arrived = pass_keys(comm, call, held, t)
            for blk in plan.blocks(t):
                found.add(blk.q_rows, attend(blk, *held.take(blk.k_rows), found.direct(blk.q_rows)))
    except BaseException:
        settle(comm, [pending])
        raise
    return found.finish()


def own_keys(call, k, v, axis) -> Held:
    """The rank's own key/value shard, in hand at step 0 (the caller's arrays: nothing copied)."""
    return Held(call.xp, [(slice(0, k.shape[axis]), (k, v))], [(k.shape, k.dtype), (v.shape, v.dtype)], axis)


def pass_keys(comm, call, held, step):
    """Start sending the key/value rows in hand that later steps read (``Plan.keys_after``) on to the next rank,
    and receiving the next shard's from the previous one: (pending, arriving pieces)."""
    w, r, plan = comm.world_size, comm.rank, call.plan
    travel = plan.keys_after((r - step) % w, step), plan.keys_after((r - 1 - step) % w, step)
    return exchange_rows(comm, call.xp, held.pieces, *travel, held.layout, held.axis)


def _merge(xp):
    return lambda acc, rows, part: merge_rows(xp, acc[0], acc[1], rows, part[0], part[1])


def _no_rows(xp):
    """Accumulators of out and lse that merge as nothing: out 0, lse -inf."""

    def neutral(n, part):
        out, lse = part
        return (
            xp.zeros(out.shape[:-2] + (n, out.shape[-1]), dtype=lse.dtype),
            xp.full(lse.shape[:-1] + (n,), -np.inf, dtype=lse.dtype),
        )

    return neutral


def _add(xp):
    return lambda acc, rows, part: [add_rows(xp, x, rows, y) for x, y in zip(acc, part)]


def _zeros(xp, dtype):
    return lambda n, part: tuple(xp.zeros(x.shape[:-2] + (n, x.shape[-1]), dtype=dtype) for x in part)


def settle(comm, pending) -> None:
    """After a failure: the current stream waits for the transfers in flight, so that their buffers go back
    to the memory pool only once NCCL is done with them (nothing to wait for between threads)."""
    if isinstance(comm, Communicator):
        for p in pending:
            if p is not None:
                comm.wait(p)


def run_backward(comm, call, k, v, gradients, axis=-2):
    """The backward's steps, shared with the packed ring. ``gradients(blk, kb, vb, direct)`` returns a
    block's (dq, dk, dv), rows on axis -2 (the caller's dtype if ``direct``: the block is the only one of
    its rows of dq and of dk, dv).

    dQ sums on its rank. The dK, dV of the rank's own keys (step 0) stay home; those of another rank's keys
    (step t >= 1) start a float sum at the first rank after the owner, go on one step behind the keys, and
    arrive home after the last step. The own step's calls are split around the others: the first half runs
    while the first keys travel, the second while the last sums go home. Only the rows some call wrote
    travel (``Plan.sums_after``).

    Returns the pieces [(rows, (dq,))] and [(rows, (dk, dv))] of this rank's sums."""
    xp, plan, acc = call.xp, call.plan, call.acc
    w, r = comm.world_size, comm.rank
    own = plan.blocks(0)
    early, late = own[: len(own) // 2], own[len(own) // 2 :]
    order = early + [blk for t in range(1, w) for blk in plan.blocks(t)] + late
    dq = Sums(xp, [blk.q_rows for blk in order], call.nq, _add(xp), _zeros(xp, acc))
    home_remote = plan.sums_after(r, w - 1) if w > 1 else []
    home = Sums(xp, [blk.k_rows for blk in own] + home_remote, call.nk, _add(xp), _zeros(xp, acc))
    sums_layout = [(call.acc_k_shape, acc), (call.acc_v_shape, acc)]
    mine = own_keys(call, k, v, axis)

    def run(blk, held, sums):
        direct = sums is home and dq.direct(blk.q_rows) and home.direct(blk.k_rows)
        dq_b, dk_b, dv_b = gradients(blk, *held.take(blk.k_rows), direct)
        dq.add(blk.q_rows, (dq_b,))
        sums.add(blk.k_rows, (dk_b, dv_b))

    held, keys, sums, arriving, arrived = mine, None, None, [], []
    try:
        for t in range(w):
            if keys is not None:
                comm.wait(keys)
                held = Held(xp, arriving, held.layout, axis)
            if t + 1 < w:
                keys, arriving = pass_keys(comm, call, held, t)
            if t == 0:
                for blk in early:
                    run(blk, mine, home)
                continue
            step = Sums(
                xp, [s for s, _ in arrived] + [blk.k_rows for blk in plan.blocks(t)], call.nk, _add(xp), _zeros(xp, acc)
            )
            for blk in plan.blocks(t):  # queued before the wait: the sums arrive while they run
                run(blk, held, step)
            if sums is not None:
                comm.wait(sums)
                for span, part in arrived:
                    step.add(span, part)
            source = (r - t) % w
            pieces = step.finish()
            assert [s for s, _ in pieces] == plan.sums_after(source, t), "the sums differ from the plan"
            travel = (plan.sums_after(source, t), plan.sums_after((source - 1) % w, t))
            sums, arrived = exchange_rows(comm, xp, pieces, *travel, sums_layout, -2)
        for blk in late:
            run(blk, mine, home)
        if sums is not None:
            comm.wait(sums)
            for span, part in arrived:
                home.add(span, part)
    except BaseException:
        settle(comm, [keys, sums])
        raise
    return dq.finish(), home.finish()


def _forward(comm, call, q, k, v):
    xp, acc = call.xp, call.acc

    def attend(blk, kb, vb, direct):
        kwargs, shift = call.options(blk, blk.q_rows.stop - blk.q_rows.start, kb.shape[-2])
        out_b, lse_b = attention_forward(q[..., blk.q_rows, :], kb, vb, **kwargs, out_dtype=None if direct else acc)
        return out_b, lse_b if shift is None else lse_b + shift

    found = run_forward(comm, call, k, v, attend)
    out = assemble(xp, call.batch + (call.nq, call.dv), call.dtype, [(s, p[0]) for s, p in found])
    lse = assemble(xp, call.batch + (call.nq,), acc, [(s, p[1]) for s, p in found], fill=-np.inf, axis=-1)
    return out, lse


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
    return _backward(comm, call, dout, q, k, v, out, lse)


def _backward(comm, call, dout, q, k, v, out, lse):
    xp = call.xp

    def gradients(blk, kb, vb, direct):
        kwargs, shift = call.options(blk, blk.q_rows.stop - blk.q_rows.start, kb.shape[-2])
        lse_b = lse[..., blk.q_rows] if shift is None else lse[..., blk.q_rows] - shift
        rows = (..., blk.q_rows, slice(None))
        grads = attention_backward(
            dout[rows], q[rows], kb, vb, out[rows], lse_b, **kwargs, grad_dtype=None if direct else call.acc
        )
        return grads[:3]

    dq, dkv = run_backward(comm, call, k, v, gradients)
    return (
        assemble(xp, q.shape, call.dtype, [(s, p[0]) for s, p in dq]),
        assemble(xp, k.shape, call.dtype, [(s, p[0]) for s, p in dkv]),
        assemble(xp, v.shape, call.dtype, [(s, p[1]) for s, p in dkv]),
    )


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
