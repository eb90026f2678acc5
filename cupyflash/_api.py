"""Public attention functions, their input validation, and the broadcast-gradient reduction.

Every public function validates its inputs here, once, for both back ends; then returns early for empty
problems (nothing is launched), broadcasts the leading (batch) dims of q, k, v to one shape with stride-0
views, and hands the arrays to the back end of their array type:

    numpy.ndarray -> cupyflash._cpu           (blocked NumPy, same algorithm as the kernels)
    cupy.ndarray  -> cupyflash._cuda.dense  (our CUDA kernels, compiled when first needed)

FP8Tensor inputs of the forward go to cupyflash._fp8.api first, which has its own checks and back ends.

Both back ends take the same arguments and return full-batch-shape results; the gradients are summed back
to the shapes of q, k, v here.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from cupyflash import _cpu, _dropout, _varlen
from cupyflash._arrays import Array, lse_dtype, sum_to_shape
from cupyflash._checks import check_bool, resolve_results_dtype
from cupyflash._cuda import dense as _gpu
from cupyflash._cuda import plans
from cupyflash._fp8 import api as _fp8_api
from cupyflash._fp8.tensor import FP8Tensor
from cupyflash._problem import validate


def attention(
    q: Array | FP8Tensor,
    k: Array | FP8Tensor,
    v: Array | FP8Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    bias: Array | None = None,
    mask: Array | None = None,
    block_mask: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    out_dtype: DTypeLike | None = None,
) -> Array:
    """Scaled dot-product attention, ``softmax(scale * q @ k^T) @ v``, without materializing the scores.

    Parameters
    ----------
    q : numpy.ndarray or cupy.ndarray, shape (..., Nq, D)
        Queries. dtype float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64.
    k : numpy.ndarray or cupy.ndarray, shape (..., Nk, D)
        Keys, same dtype as ``q``.
    v : numpy.ndarray or cupy.ndarray, shape (..., Nk, Dv)
        Values, same dtype as ``q``. ``1 <= D, Dv <= 256``.

        Or q, k, v all :class:`FP8Tensor` (:func:`quantize_fp8`): the FP8 forward, for inference
        (``python -m cupyflash --docs fp8``). It takes ``causal`` and ``scale`` only (the other options
        raise ``ValueError``), needs a Hopper GPU for CuPy data, and has no backward.
    causal : bool, optional
        Mask out keys "in the future". The mask is aligned to the bottom-right corner of the
        Nq x Nk score matrix, as in FlashAttention-2: query ``i`` sees key ``j`` iff
        ``j <= i + Nk - Nq``. For Nq = 2, Nk = 5 (1 = keep, 0 = masked out)::

            1 1 1 1 0
            1 1 1 1 1

        and for Nq = 5, Nk = 2::

            0 0
            0 0
            0 0
            1 0
            1 1

        A query row that sees no key gives an output row of zeros.
    scale : float, optional
        Multiplies the scores ``q @ k^T`` before the softmax. Finite and > 0;
        defaults to ``1 / sqrt(D)``.
    window : (int, int), optional
        ``(left, right)``: query ``i`` sees keys ``j`` with
        ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``; ``-1`` leaves that side unbounded.
        Key tiles wholly outside the band are skipped. Combines with ``causal``.
    softcap : float, optional
        If > 0, the scaled scores ``s`` become ``softcap * tanh(s / softcap)``.
    alibi_slopes : array, optional
        Floating-point (used as float32), broadcastable to the leading dims ``...``: adds
        ``-slope * |i + Nk - Nq - j|`` to the scores (after the softcap).
    bias : array, optional
        Broadcastable to ``(..., Nq, Nk)``, the inputs' dtype or float32: added to the scores (after
        the softcap and ALiBi). Broadcast dims are read with stride 0, never copied. ``-inf`` hides a key.
    mask : array of bool, optional
        Broadcastable to ``(..., Nq, Nk)``; True = the key takes part (as in torch's SDPA).
    block_mask : array of bool, optional
        Broadcastable to ``(..., ceil(Nq/128), ceil(Nk/128))``: element ``[..., a, b]`` False hides the
        128 x 128 tile of queries ``128a...`` and keys ``128b...``, which is then never loaded.
        :func:`block_mask_from_dense` builds one from a dense ``mask``.
    dropout_p : float, optional
        In [0, 1): each probability ``P_ij`` is zeroed with probability ``dropout_p`` and the kept ones
        are scaled by ``1 / (1 - dropout_p)``, ``out = (P * Z / (1 - p)) @ v``. The keep mask ``Z`` is a
        pure function of (``dropout_seed``, flat batch index, i, j) through Philox 4x32-10
        (:func:`cupyflash.reference.dropout_mask` reproduces it); the keep probability is ``1 - p``
        rounded to a multiple of 2^-16. ``0`` (the default) runs the kernels without dropout.
    dropout_seed : int, optional
        In [0, 2**64). None draws one from ``numpy.random``; pass one to reproduce a result.
    out_dtype : dtype, optional
        ``out``'s dtype. None (the default) or the inputs' dtype: ``out`` rounded to it. The accumulator's
        dtype, float32 (float64 for float64 inputs): ``out`` unrounded, as the kernels accumulate it, for
        results that are summed or merged further and should be rounded once, at the end (ring attention's
        blocks, partial results merged by :func:`merge_attention_states`). Any other value raises
        ``ValueError``. For FP8 inputs: bfloat16 (``ml_dtypes.bfloat16``, the default) or float16.

    Returns
    -------
    out : array of the inputs' type, shape (..., Nq, Dv), the inputs' dtype or ``out_dtype``
        The leading dims ``...`` are those of q, k, v broadcast together (NumPy rules), so
        grouped-query attention is ``q`` of shape (B, Hk, G, Nq, D) with ``k[:, :, None]``
        and ``v[:, :, None]``. For FP8 inputs: of their data's array type, dtype ``out_dtype``.

    Notes
    -----
    NumPy inputs run on the CPU (blocked, in float32; in float64 for float64 inputs); CuPy inputs run
    our CUDA kernels on the current device and CuPy's current stream, asynchronously. float64 runs in
    float64 throughout (its softmax, accumulators and ``lse`` too). The scores are built in the order
    ``scale``, ``softcap``, ``alibi_slopes``, ``bias``, then the hidden keys (``causal``, ``window``,
    ``mask``, ``block_mask``) become ``-inf``; a query row left with no key gives an output row of 0.
    A float32 ``out`` of float16 or bfloat16 inputs runs kernels compiled at head dims 64, 128, 192 and 256
    (narrower heads padded to the next) in fewer forms than the rounded one; a few option combinations run
    on a more general kernel, and so more slowly (docs/api.md, unrounded results).

    Examples
    --------
    NumPy inputs run on the CPU; CuPy inputs run the same call on the GPU:

    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 100, 64), dtype=np.float32) for _ in range(3))  # (B, H, N, D)
    >>> out = cupyflash.attention(q, k, v, causal=True)
    >>> out.shape, out.dtype.name
    ((2, 4, 100, 64), 'float32')

    In bfloat16 on the GPU, with a sliding window of 32 keys and a softcap:

    >>> import cupy, ml_dtypes  # doctest: +SKIP
    >>> qg, kg, vg = (cupy.asarray(x.astype(ml_dtypes.bfloat16)) for x in (q, k, v))  # doctest: +SKIP
    >>> out = cupyflash.attention(qg, kg, vg, causal=True, window=(32, 0), softcap=30.0)  # doctest: +SKIP
    """
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="attention", draw_seed=True)
    out, _ = attention_forward(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        bias=bias,
        mask=mask,
        block_mask=block_mask,
        dropout_p=dropout.p if dropout else 0.0,
        dropout_seed=dropout.seed if dropout else None,
        out_dtype=out_dtype,
    )
    return out


def attention_forward(
    q: Array | FP8Tensor,
    k: Array | FP8Tensor,
    v: Array | FP8Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    bias: Array | None = None,
    mask: Array | None = None,
    block_mask: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    out_dtype: DTypeLike | None = None,
) -> tuple[Array, Array]:
    """Attention forward pass that also returns the row-wise log-sum-exp needed by the backward.

    Parameters
    ----------
    q, k, v, causal, scale
        As in :func:`attention`: q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv), one dtype among
        float16, bfloat16, float32, float64, or all three :class:`FP8Tensor` (the FP8 forward,
        ``python -m cupyflash --docs fp8``); ``causal`` is bottom-right aligned; ``scale`` defaults to ``1 / sqrt(D)``.
    window, softcap, alibi_slopes, bias, mask, block_mask
        The score modifiers, as in :func:`attention`.
    dropout_p, dropout_seed
        As in :func:`attention`, except that ``dropout_p > 0`` needs an integer ``dropout_seed``: pass
        the same one to :func:`attention_backward`.
    out_dtype : dtype, optional
        As in :func:`attention`: None or the inputs' dtype (``out`` rounded to it), or the accumulator's
        dtype, float32 (float64 for float64 inputs: ``out`` unrounded); FP8 inputs: bfloat16 (the default) or
        float16.

    Returns
    -------
    out : array, shape (..., Nq, Dv), the inputs' dtype, or ``out_dtype``
        ``softmax(scale * q @ k^T) @ v``, with the broadcast leading dims.
    lse : array, shape (..., Nq), float32 (float64 for float64 inputs)
        ``log(sum_j exp(s_ij))`` of the (modified) scores over the keys row ``i`` sees (natural
        log); ``-inf`` for a row that sees no key (whose ``out`` row is 0).

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 100, 64), dtype=np.float32) for _ in range(3))
    >>> out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    >>> out.shape, lse.shape, lse.dtype.name
    ((2, 4, 100, 64), (2, 4, 100), 'float32')

    The FP8 forward, on e4m3 copies with a scale per (batch, head) slice:

    >>> q8, k8, v8 = (cupyflash.quantize_fp8(x) for x in (q, k, v))
    >>> out8, lse8 = cupyflash.attention_forward(q8, k8, v8, causal=True)
    >>> error = out8.astype(np.float32) - out
    >>> out8.dtype.name, bool(np.sqrt(np.mean(error ** 2)) < 0.05 * np.sqrt(np.mean(out ** 2)))  # RMSE < 5%
    ('bfloat16', True)

    bfloat16 inputs with ``out`` unrounded, in float32: two halves of the keys attended apart and merged by their
    lse, rounded once at the end (as ring attention does), give every output to within a rounding of the
    single call's:

    >>> import ml_dtypes
    >>> qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    >>> out_a, lse_a = cupyflash.attention_forward(qb, kb[..., :50, :], vb[..., :50, :], out_dtype=np.float32)
    >>> out_b, lse_b = cupyflash.attention_forward(qb, kb[..., 50:, :], vb[..., 50:, :], out_dtype=np.float32)
    >>> out_a.dtype.name
    'float32'
    >>> merged, _ = cupyflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    >>> rounded = merged.astype(ml_dtypes.bfloat16).astype(np.float32)
    >>> whole = cupyflash.attention(qb, kb, vb).astype(np.float32)
    >>> bool(np.abs(rounded - whole).max() <= 2**-7 * np.abs(whole).max())
    True
    """
    if isinstance(q, FP8Tensor) or isinstance(k, FP8Tensor) or isinstance(v, FP8Tensor):
        # Whether each option FP8 does not take was given, in the order of _fp8_api.UNSUPPORTED.
        unsupported = (
            window is not None,
            softcap != 0,
            alibi_slopes is not None,
            bias is not None,
            mask is not None,
            block_mask is not None,
            dropout_p != 0,
        )
        return _fp8_api.attention_forward(
            q, k, v, causal=causal, scale=scale, out_dtype=out_dtype, unsupported=unsupported
        )
    fast = None
    if alibi_slopes is None and bias is None and mask is None and block_mask is None and _plain_window(window):
        # A layout checked before goes straight to its launches (its call entry in cupyflash._cuda.plans).
        fast = plans.key(
            "call", "fwd", (q, k, v), (causal, scale, window, softcap, dropout_p, type(dropout_seed), out_dtype)
        )
        call = plans.get(fast)
        if call is not None:
            outputs = call.run([q.data.ptr, k.data.ptr, v.data.ptr], dropout_seed)
            if outputs is not None:
                return outputs[0], outputs[1]
    options = dict(
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, block_mask=block_mask
    )
    problem = validate(dict(q=q, k=k, v=v), causal, scale, options)
    out_dtype = resolve_results_dtype("out_dtype", out_dtype, problem.dtype)
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="attention_forward")
    xp, batch = problem.xp, problem.batch
    if problem.is_empty:
        out = xp.zeros(batch + (problem.nq, problem.dv), dtype=problem.dtype if out_dtype is None else out_dtype)
        lse = xp.full(batch + (problem.nq,), -np.inf, dtype=lse_dtype(problem.dtype))
        return out, lse
    q, k, v = (_broadcast(xp, x, batch) for x in (q, k, v))
    return _backend(problem.xp).attention_forward(
        q,
        k,
        v,
        scale=problem.scale,
        causal=problem.causal,
        mods=problem.mods,
        dropout=dropout,
        out_dtype=out_dtype,
        **_fast_key(fast),
    )


def attention_backward(
    dout: Array,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    bias: Array | None = None,
    mask: Array | None = None,
    block_mask: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    deterministic: bool = True,
    grad_dtype: DTypeLike | None = None,
) -> tuple[Array, ...]:
    """Gradients of attention with respect to q, k and v.

    Parameters
    ----------
    dout : array, shape (..., Nq, Dv)
        Gradient of the loss with respect to ``out``; the inputs' dtype.
    q, k, v : arrays, shapes (..., Nq, D), (..., Nk, D), (..., Nk, Dv)
        The forward inputs (leading dims broadcast as in :func:`attention`).
    out : array, shape (..., Nq, Dv)
        The forward output, as returned by :func:`attention_forward`.
    lse : array, shape (..., Nq), float32 (float64 for float64 inputs)
        The log-sum-exp returned by :func:`attention_forward` with the same arguments.
    causal, scale, window, softcap, alibi_slopes, bias, mask, block_mask, dropout_p, dropout_seed
        Exactly as passed to :func:`attention_forward` (the same seed regenerates the same dropout mask).
    deterministic : bool, default True
        True: the same inputs give the same bits, run after run (``dbias`` of a broadcast ``bias``
        aside, below). False lets a faster path add dq's float32 partial sums in whatever order they
        arrive, so dq's last bits may vary between runs (as with cuDNN's and FlashAttention-3's
        backward); today that is the fused backward (bfloat16 or float16 on Hopper, long sequences,
        no score modifiers or dropout). Every other call behaves the same either way (and so do calls with
        unrounded gradients: their fused backward adds in order).
    grad_dtype : dtype, optional
        The dtype of ``dq``, ``dk``, ``dv``. None (the default) or the inputs' dtype: rounded to it. The
        accumulator's dtype, float32 (float64 for float64 inputs): unrounded, as the kernels accumulate
        them, for gradients summed further and rounded once at the end (gradient accumulation over
        micro-batches, ring attention's blocks). Any other value raises ``ValueError``. ``dbias`` keeps the
        bias's dtype. float16 and bfloat16 inputs run their float32 gradients as ``out_dtype`` does in
        :func:`attention` (Notes there).

    Returns
    -------
    dq : array, shape of ``q``
    dk : array, shape of ``k``
    dv : array, shape of ``v``
        In the inputs' dtype, or ``grad_dtype``. Where an input was broadcast (MQA/GQA), its gradient is
        summed over the broadcast dims (in float32; in float64 for float64 inputs), as autograd would, from
        unrounded parts where the kernels allow: a 16-bit gradient is then rounded once, after the sum
        (docs/api.md, Shapes and broadcasting, lists where each part is rounded first).
    dbias : array, shape and dtype of ``bias``
        Only when ``bias`` is given: the gradient of the scores, ``P * (dP - rowsum(P * dP))``,
        summed over the dims along which ``bias`` was broadcast (in float32; in float64 for float64
        inputs). Where that sum runs over more than one term, its order (atomic adds on the GPU) may
        vary between runs.

    Examples
    --------
    Grouped-query attention, 2 key/value heads each shared by 3 query heads: the gradients of the
    broadcast ``k`` and ``v`` come back in their own shapes, summed over the 3 query heads.

    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 3, 50, 32), dtype=np.float32)      # (B, Hk, G, N, D)
    >>> k, v = (rng.standard_normal((1, 2, 1, 50, 32), dtype=np.float32) for _ in range(2))
    >>> out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    >>> dout = np.ones_like(out)                                         # dLoss/dout
    >>> dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((1, 2, 3, 50, 32), (1, 2, 1, 50, 32), (1, 2, 1, 50, 32))

    bfloat16 gradients accumulated over two micro-batches in float32, rounded once at the end:

    >>> import ml_dtypes
    >>> bf16 = lambda x: x.astype(ml_dtypes.bfloat16)
    >>> dk_sum = np.zeros(k.shape, dtype=np.float32)
    >>> for step in range(2):
    ...     xs = [bf16(rng.standard_normal(x.shape, dtype=np.float32)) for x in (q, k, v)]
    ...     out_s, lse_s = cupyflash.attention_forward(*xs, causal=True)
    ...     _, dk_s, _ = cupyflash.attention_backward(bf16(dout), *xs, out_s, lse_s, causal=True,
    ...                                               grad_dtype=np.float32)
    ...     dk_sum += dk_s
    >>> dk_s.dtype.name, dk_sum.shape
    ('float32', (1, 2, 1, 50, 32))
    """
    if any(isinstance(x, FP8Tensor) for x in (q, k, v)):
        raise TypeError(
            "attention_backward does not take FP8 inputs: the FP8 forward has no backward (as in "
            "FlashAttention-3); run the training step in bfloat16 or float16"
        )
    if deterministic is not True:
        deterministic = check_bool("deterministic", deterministic)
    fast = None
    if alibi_slopes is None and bias is None and mask is None and block_mask is None and _plain_window(window):
        # (unordered calls keep their plans apart: at some lengths only they take the fused backward)
        fast = plans.key(
            "call",
            "bwd" if deterministic else "bwd-unordered",
            (dout, q, k, v, out, lse),
            (causal, scale, window, softcap, dropout_p, type(dropout_seed), grad_dtype),
        )
        call = plans.get(fast)
        outputs = None if call is None else call.run([x.data.ptr for x in (q, k, v, out, dout, lse)], dropout_seed)
        if outputs is not None:  # (a call key is kept only for a valid grad_dtype: q's dtype or lse's)
            want = q.dtype if grad_dtype is None else np.dtype(grad_dtype)
            return tuple(
                g if g.shape == x.shape and g.dtype == want else sum_to_shape(g, x.shape, lse.dtype, want)
                for g, x in zip(outputs, (q, k, v))
            )
    arrays = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    options = dict(
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, block_mask=block_mask
    )
    problem = validate(arrays, causal, scale, options)
    grad_dtype = resolve_results_dtype("grad_dtype", grad_dtype, problem.dtype)
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="attention_backward")
    xp, batch = problem.xp, problem.batch
    if problem.is_empty:
        grads = tuple(xp.zeros(x.shape, dtype=problem.dtype if grad_dtype is None else grad_dtype) for x in (q, k, v))
        return grads + ((xp.zeros(bias.shape, dtype=bias.dtype),) if bias is not None else ())
    qb, kb, vb = (_broadcast(xp, x, batch) for x in (q, k, v))
    acc = lse_dtype(problem.dtype)
    want = problem.dtype if grad_dtype is None else grad_dtype
    *grads, dbias = _backend(problem.xp).attention_backward(
        dout,
        qb,
        kb,
        vb,
        out,
        lse,
        scale=problem.scale,
        causal=problem.causal,
        mods=problem.mods,
        dropout=dropout,
        deterministic=deterministic,
        grad_dtype=grad_dtype,
        summed=any(math.prod(x.shape[:-2]) < math.prod(batch) for x in (q, k, v)),
        **_fast_key(fast),
    )
    grads = tuple(sum_to_shape(g, x.shape, acc, want) for g, x in zip(grads, (q, k, v)))
    return grads + ((dbias,) if bias is not None else ())


def attention_probs(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    bias: Array | None = None,
    mask: Array | None = None,
    block_mask: Array | None = None,
) -> Array:
    """The softmax probabilities ``P`` of attention, for inspection and debugging.

    Computes the forward's log-sum-exp with the same kernels, then ``P_ij = exp(s_ij - lse_i)`` with
    the scores ``s`` built exactly as :func:`attention` builds them (same options, same order).
    Unlike the rest of cupyflash this materializes ``(..., Nq, Nk)``: O(N^2) memory.

    Parameters
    ----------
    q, k, v, causal, scale, window, softcap, alibi_slopes, bias, mask, block_mask
        As in :func:`attention`. ``v`` is needed for the shape checks only.

    Returns
    -------
    p : array, shape (..., Nq, Nk), float32 (float64 for float64 inputs)
        Rows sum to 1, except rows that see no key, which are 0; ``p @ v`` is ``attention``'s output.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 100, 64), dtype=np.float32) for _ in range(3))
    >>> p = cupyflash.attention_probs(q, k, v, causal=True)
    >>> p.shape, p.dtype.name
    ((2, 4, 100, 100), 'float32')
    >>> bool(np.allclose(p.sum(axis=-1), 1, atol=1e-5))                  # each row sums to 1
    True
    >>> bool(np.allclose(p @ v, cupyflash.attention(q, k, v, causal=True), atol=1e-5))
    True
    """
    options = dict(
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, block_mask=block_mask
    )
    problem = validate(dict(q=q, k=k, v=v), causal, scale, options)
    xp, batch = problem.xp, problem.batch
    if problem.is_empty:
        return xp.zeros(batch + (problem.nq, problem.nk), dtype=lse_dtype(problem.dtype))
    q, k, v = (_broadcast(xp, x, batch) for x in (q, k, v))
    return _backend(problem.xp).attention_probs(q, k, v, scale=problem.scale, causal=problem.causal, mods=problem.mods)


def attention_varlen(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    out_dtype: DTypeLike | None = None,
) -> Array:
    """Attention over a batch of sequences of different lengths, packed along the rows without padding.

    Parameters
    ----------
    q : array, shape (total_q, H, D)
        The queries of every sequence, one after the other.
    k : array, shape (total_k, Hk, D)
    v : array, shape (total_k, Hk, Dv)
        Keys and values likewise; ``Hk`` divides ``H`` and query head ``h`` uses key/value head
        ``h // (H // Hk)`` (grouped-query attention).
    cu_seqlens_q, cu_seqlens_k : int32 or int64 arrays, or sequences of ints, shape (batch + 1,)
        Offsets of the sequences: sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``
        and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``. They start at 0, never decrease, and end at
        total_q (total_k). Empty sequences are fine. Arrays are of q's array type (NumPy or CuPy); they are
        read back to the host to be checked (batch + 1 integers).
    max_seqlen_q, max_seqlen_k : int, optional
        Bounds on the sequence lengths (FlashAttention's arguments); computed from the offsets when None.
    causal, scale, window, softcap, dropout_p, dropout_seed
        As in :func:`attention`, per sequence: causal and the window are bottom-right aligned in each.
    alibi_slopes : array, optional
        Broadcastable to ``(batch, H)``.
    out_dtype : dtype, optional
        As in :func:`attention`: None or the inputs' dtype, or the accumulator's dtype (``out`` unrounded).

    Returns
    -------
    out : array, shape (total_q, H, Dv), the inputs' dtype or ``out_dtype``
        Each sequence's rows are what :func:`attention` gives for that sequence alone.

    Notes
    -----
    Dropout's mask and ALiBi's slopes follow the flat index ``s * H + h`` of (sequence, head). The
    dense-only options (``bias``, ``mask``, ``block_mask``) do not exist here.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> lengths = [5, 0, 12]
    >>> cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)       # [0, 5, 5, 17]
    >>> q, k, v = (rng.standard_normal((17, 4, 32), dtype=np.float32) for _ in range(3))
    >>> out = cupyflash.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> out.shape
    (17, 4, 32)
    >>> alone = cupyflash.attention(*(x[5:17].transpose(1, 0, 2) for x in (q, k, v)), causal=True)
    >>> bool(np.allclose(out[5:17], alone.transpose(1, 0, 2), atol=1e-6))
    True
    """
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="attention_varlen", draw_seed=True)
    out, _ = attention_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout.p if dropout else 0.0,
        dropout_seed=dropout.seed if dropout else None,
        out_dtype=out_dtype,
    )
    return out


def attention_varlen_forward(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    out_dtype: DTypeLike | None = None,
) -> tuple[Array, Array]:
    """:func:`attention_varlen` that also returns the log-sum-exp for the backward.

    Parameters
    ----------
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes
        As in :func:`attention_varlen`: q (total_q, H, D), k (total_k, Hk, D), v (total_k, Hk, Dv).
    dropout_p, dropout_seed
        As in :func:`attention_varlen`, except that ``dropout_p > 0`` needs an integer ``dropout_seed``
        (as in :func:`attention_forward`): pass the same one to :func:`attention_varlen_backward`.
    out_dtype : dtype, optional
        As in :func:`attention`: None or the inputs' dtype, or the accumulator's dtype (``out`` unrounded).

    Returns
    -------
    out : array, shape (total_q, H, Dv), the inputs' dtype or ``out_dtype``
    lse : array, shape (H, total_q), float32 (float64 for float64 inputs)
        Natural-log log-sum-exp of each query row's scores; ``-inf`` for rows that see no key.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 30, 100], dtype=np.int32)                          # lengths 30 and 70
    >>> q = rng.standard_normal((100, 8, 64), dtype=np.float32)               # H = 8
    >>> k, v = (rng.standard_normal((100, 2, 64), dtype=np.float32) for _ in range(2))  # Hk = 2
    >>> out, lse = cupyflash.attention_varlen_forward(q, k, v, cu, cu, causal=True)
    >>> out.shape, lse.shape
    ((100, 8, 64), (8, 100))
    """
    arrays = dict(q=q, k=k, v=v)
    packed, scale, causal, mods = _varlen.validate(
        arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes
    )
    out_dtype = resolve_results_dtype("out_dtype", out_dtype, packed.dtype)
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="attention_varlen_forward")
    xp = packed.xp
    if packed.total_q == 0 or packed.heads == 0:
        return (
            xp.zeros((packed.total_q, packed.heads, packed.dv), dtype=packed.dtype if out_dtype is None else out_dtype),
            xp.full((packed.heads, packed.total_q), -np.inf, dtype=lse_dtype(packed.dtype)),
        )
    return _backend(xp).attention_varlen_forward(
        q, k, v, packed, scale=scale, causal=causal, mods=mods, dropout=dropout, out_dtype=out_dtype
    )


def attention_varlen_backward(
    dout: Array,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    grad_dtype: DTypeLike | None = None,
) -> tuple[Array, Array, Array]:
    """Gradients of :func:`attention_varlen` with respect to q, k and v.

    Parameters
    ----------
    dout : array, shape (total_q, H, Dv)
    q, k, v, cu_seqlens_q, cu_seqlens_k
        The forward's inputs.
    out, lse : arrays
        As :func:`attention_varlen_forward` returned them: (total_q, H, Dv) and (H, total_q) float32
        (float64 for float64 inputs).
    max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes, dropout_p, dropout_seed
        Exactly as passed to :func:`attention_varlen_forward`.
    grad_dtype : dtype, optional
        As in :func:`attention_backward`: None or the inputs' dtype, or the accumulator's dtype (unrounded).

    Returns
    -------
    dq, dk, dv : arrays of the shapes of q, k, v, in their dtype or ``grad_dtype``
        dk and dv are summed over the query heads that share each key/value head, from unrounded parts where
        the kernels allow (as in :func:`attention_backward`): 16-bit sums are then rounded once.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 30, 100], dtype=np.int32)
    >>> q, k, v, dout = (rng.standard_normal((100, 4, 32), dtype=np.float32) for _ in range(4))
    >>> out, lse = cupyflash.attention_varlen_forward(q, k, v, cu, cu, dropout_p=0.1, dropout_seed=7)
    >>> dq, dk, dv = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu,
    ...                                                  dropout_p=0.1, dropout_seed=7)
    >>> dq.shape, dk.shape, dv.shape
    ((100, 4, 32), (100, 4, 32), (100, 4, 32))
    """
    arrays = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    packed, scale, causal, mods = _varlen.validate(
        arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes
    )
    grad_dtype = resolve_results_dtype("grad_dtype", grad_dtype, packed.dtype)
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="attention_varlen_backward")
    xp = packed.xp
    want = packed.dtype if grad_dtype is None else grad_dtype
    if packed.total_q == 0 or packed.total_k == 0 or packed.heads == 0:
        return tuple(xp.zeros(x.shape, dtype=want) for x in (q, k, v))
    grads = _backend(xp).attention_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        packed,
        scale=scale,
        causal=causal,
        mods=mods,
        dropout=dropout,
        grad_dtype=grad_dtype,
        summed=packed.groups > 1,
    )
    return tuple(g.astype(want, copy=False) for g in grads)


def _plain_window(window) -> bool:
    """Whether a call's window can be part of its call key: None or a tuple itself (a window of another type
    may change in place or compare equal to a different one: such calls always take the checks)."""
    return window is None or type(window) is tuple


def _fast_key(found) -> dict:
    """The back end's keyword that keeps a GPU call's plan under its call key (plans.py; None: none)."""
    return {} if found is None else {"fast_key": found}


def _backend(xp):
    return _cpu if xp is np else _gpu


def _broadcast(xp, x, batch):
    """x with the leading dims ``batch`` (a stride-0 view where it had 1s), or x itself when it has them."""
    return x if x.shape[:-2] == batch else xp.broadcast_to(x, batch + x.shape[-2:])
