"""Plain NumPy float64 attention, forward and backward, to check everything else against.

It materializes the whole score matrix and applies the textbook formulas; it is meant to be obviously right, not fast.
Same semantics as cupyflash.attention: leading dims broadcast, the causal mask is bottom-right aligned (query i sees
key j iff j <= i + Nk - Nq), the score modifiers (window, softcap, alibi_slopes, bias, mask, block_mask) are exactly
those of cupyflash._modifiers, and a query row that sees no key gives out = 0, lse = -inf and zero gradients. Dropout
(``dropout_p``, ``dropout_seed``) uses the mask of :func:`dropout_mask`, the very one the kernels and the CPU path
regenerate. Inputs must be NumPy arrays (any dtype NumPy can convert to float64, float64 included; bias any
floating-point dtype); results are float64. ALiBi slopes are used as float32, as everywhere in cupyflash.
:func:`attention_with_kvcache` (decoding against a key/value cache) and :func:`rotary` (rotary position embeddings)
come from cupyflash._kvcache.reference.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from cupyflash import _dropout, _modifiers, _varlen
from cupyflash._arrays import is_cupy, matmul_seen, quiet_float_errors, sum_to_shape
from cupyflash._checks import check_causal, check_shapes, resolve_scale
from cupyflash._kvcache import reference as _reference_kvcache

_BIAS_DTYPES_EXTRA = (np.dtype(ml_dtypes.bfloat16),)  # floating point, though NumPy's kind is not "f"

# The KV-cache reference and its rotary embedding have a file of their own; they are part of this namespace.
attention_with_kvcache = _reference_kvcache.attention_with_kvcache
rotary = _reference_kvcache.rotary


@quiet_float_errors
def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    block_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Reference attention in float64.

    Parameters
    ----------
    q : numpy.ndarray, shape (..., Nq, D)
    k : numpy.ndarray, shape (..., Nk, D)
    v : numpy.ndarray, shape (..., Nk, Dv)
    causal : bool, optional
        Bottom-right aligned causal mask, as in :func:`cupyflash.attention`.
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    return_lse : bool, optional
        Also return the row-wise log-sum-exp of the (modified, masked) scores.
    window, softcap, alibi_slopes, bias, mask, block_mask : optional
        The score modifiers, as in :func:`cupyflash.attention` (NumPy arrays).
    dropout_p, dropout_seed : optional
        As in :func:`cupyflash.attention_forward` (a seed is required when ``dropout_p > 0``):
        ``out = (P * Z / (1 - p)) @ v`` with ``Z = dropout_mask(dropout_p, dropout_seed, P.shape)``.

    Returns
    -------
    out : numpy.ndarray, shape (..., Nq, Dv), float64
    lse : numpy.ndarray, shape (..., Nq), float64
        Only if ``return_lse``; ``-inf`` for rows that see no key.

    Examples
    --------
    Check cupyflash (here its CPU path; on the GPU pass ``cupy.asarray`` inputs and ``.get()`` the
    result) against the reference:

    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 100, 64), dtype=np.float32) for _ in range(3))
    >>> ref, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    >>> ref.dtype.name, ref.shape, lse.shape
    ('float64', (2, 4, 100, 64), (2, 4, 100))
    >>> out = cupyflash.attention(q, k, v, causal=True)
    >>> bool(np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max())
    True
    """
    options = dict(
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, block_mask=block_mask
    )
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="reference.attention")
    q, k, v = _as_float64(q=q, k=k, v=v)
    out, lse = _forward(q, k, v, causal, scale, options, dropout)
    return (out, lse) if return_lse else out


def _forward(q, k, v, causal, scale, options, dropout):
    s, _ = _scores(q, k, v, causal, scale, options)
    p, lse = _softmax(s)
    return matmul_seen(_drop(p, dropout), v, ~np.isneginf(s)), lse


def dropout_mask(dropout_p: float, dropout_seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """The dropout keep mask ``Z`` that cupyflash uses for probabilities of shape ``(..., Nq, Nk)``.

    ``Z[..., i, j]`` is True where ``P_ij`` is kept. It is a pure function of the seed, the flat (C-order)
    index of ``...``, ``i`` and ``j`` through Philox 4x32-10, the same on the GPU, on the CPU path and
    here (the formula is in ``cupyflash._dropout``). A kept element has probability ``1 - dropout_p``
    rounded to a multiple of 2^-16.

    Parameters
    ----------
    dropout_p : float
        In (0, 1).
    dropout_seed : int
        In [0, 2**64).
    shape : tuple of int
        ``(..., Nq, Nk)``: the broadcast leading dims of q, k, v, then Nq and Nk.

    Returns
    -------
    keep : numpy.ndarray of bool, shape ``shape``

    Examples
    --------
    >>> from cupyflash import reference
    >>> keep = reference.dropout_mask(0.25, 1234, (2, 4, 256, 256))
    >>> keep.shape, round(float(keep.mean()), 2)
    ((2, 4, 256, 256), 0.75)
    >>> bool((keep == reference.dropout_mask(0.25, 1234, (2, 4, 256, 256))).all())  # pure function of the seed
    True
    """
    shape = tuple(int(n) for n in shape)
    if len(shape) < 2 or any(n < 0 for n in shape):
        raise ValueError(f"shape must be (..., Nq, Nk) with sizes >= 0, got {shape}")
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="dropout_mask")
    if dropout is None:
        return np.ones(shape, dtype=bool)
    return _dropout.keep_mask(dropout, shape[:-2], np.arange(shape[-2]), np.arange(shape[-1]))


def _drop(p, dropout):
    """P * Z / (1 - p), or P itself without dropout."""
    if dropout is None:
        return p
    keep = _dropout.keep_mask(dropout, p.shape[:-2], np.arange(p.shape[-2]), np.arange(p.shape[-1]))
    return np.where(keep, p * dropout.scale, 0.0)


@quiet_float_errors
def attention_probs(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    block_mask: np.ndarray | None = None,
) -> np.ndarray:
    """Reference attention probabilities ``P = softmax(s)`` in float64.

    Parameters
    ----------
    q, k, v, causal, scale, window, softcap, alibi_slopes, bias, mask, block_mask
        As in :func:`attention`; ``v`` is needed for the shape checks only.

    Returns
    -------
    p : numpy.ndarray, shape (..., Nq, Nk), float64
        Rows sum to 1, except rows that see no key, which are 0.

    Examples
    --------
    The causal mask is aligned to the bottom-right corner: with 2 queries and 4 keys, query 0 sees
    keys 0 to 2 and query 1 all four.

    >>> import numpy as np
    >>> from cupyflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((2, 8)), rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    >>> p = reference.attention_probs(q, k, v, causal=True)
    >>> (p > 0).astype(int)
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    options = dict(
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, block_mask=block_mask
    )
    q, k, v = _as_float64(q=q, k=k, v=v)
    s, _ = _scores(q, k, v, causal, scale, options)
    return _softmax(s)[0]


@quiet_float_errors
def attention_backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    block_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> tuple[np.ndarray, ...]:
    """Reference gradients of attention in float64.

    Parameters
    ----------
    dout : numpy.ndarray, shape (..., Nq, Dv)
        Gradient of the loss with respect to the output (broadcast leading dims).
    q, k, v, causal, scale, window, softcap, alibi_slopes, bias, mask, block_mask, dropout_p, dropout_seed
        As in :func:`attention`.

    Returns
    -------
    dq, dk, dv : numpy.ndarray, float64, the shapes of q, k, v
        Summed over the dims along which q, k, v were broadcast.
    dbias : numpy.ndarray, float64, the shape of bias
        Only when ``bias`` is given: dS summed over the dims along which bias was broadcast.

    Examples
    --------
    The reference takes no ``out`` or ``lse``: it recomputes them.

    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dout = (rng.standard_normal((1, 2, 50, 32), dtype=np.float32) for _ in range(4))
    >>> dq, dk, dv = reference.attention_backward(dout, q, k, v, causal=True)
    >>> dq.dtype.name, dq.shape
    ('float64', (1, 2, 50, 32))
    >>> out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    >>> ours = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> all(np.abs(g - r).max() <= 1e-4 * np.abs(r).max() for g, r in zip(ours, (dq, dk, dv)))
    True
    """
    options = dict(
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, block_mask=block_mask
    )
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="reference.attention_backward")
    dout, q, k, v = _as_float64(dout=dout, q=q, k=k, v=v)
    return _backward(dout, q, k, v, causal, scale, options, dropout, bias)


def _backward(dout, q, k, v, causal, scale, options, dropout, bias=None):
    s, tanh = _scores(q, k, v, causal, scale, options)
    out_shape = s.shape[:-1] + v.shape[-1:]
    if dout.shape != out_shape:
        raise ValueError(f"dout has shape {dout.shape}; the output of these q, k, v has shape {out_shape}")
    scale = resolve_scale(scale, q.shape[-1])
    p, _ = _softmax(s)
    # A key that row i does not see (s = -inf) takes no part in row i's sums, even with a non-finite k, v,
    # dout or q: its dP and dS are 0, not 0 * NaN, and the products skip it (matmul_seen).
    seen = ~np.isneginf(s)  # (a NaN score is seen: it propagates)
    seen_t = _transpose(seen)
    p = np.where(seen, p, 0.0)  # a row whose sum is NaN has P NaN even where hidden
    # With dropout, out = (P o Z / (1 - p)) v: the gradient of P is dP o Z / (1 - p).
    dp = np.where(seen, _drop(dout @ _transpose(v), dropout), 0.0)
    ds = np.where(seen, p * (dp - np.sum(p * dp, axis=-1, keepdims=True)), 0.0)  # dS = P o (dP - D)
    # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2: the gradient of the scaled score x = scale q.k
    ds_scaled = ds if tanh is None else np.where(seen, ds * (1 - tanh**2), 0.0)
    dq = scale * matmul_seen(ds_scaled, k, seen)
    dk = scale * matmul_seen(_transpose(ds_scaled), q, seen_t)
    dv = matmul_seen(_transpose(_drop(p, dropout)), dout, seen_t)
    grads = tuple(sum_to_shape(g, x.shape, np.float64) for g, x in ((dq, q), (dk, k), (dv, v)))
    if bias is None:
        return grads
    return grads + (sum_to_shape(ds, bias.shape, np.float64),)


@quiet_float_errors
def attention_varlen(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Reference :func:`cupyflash.attention_varlen` in float64: each sequence through :func:`attention`.

    Sequence ``s`` is computed alone with its heads as leading dims, its ALiBi slopes ``alibi_slopes[s]``
    and dropout's flat batch index starting at ``s * H``.

    Parameters
    ----------
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes
        As in :func:`cupyflash.attention_varlen`, NumPy arrays (any float dtype for q, k, v).
    return_lse : bool, optional
        Also return the log-sum-exp.
    dropout_p, dropout_seed : optional
        As in :func:`cupyflash.attention_varlen_forward` (a seed is required when ``dropout_p > 0``).

    Returns
    -------
    out : numpy.ndarray, shape (total_q, H, Dv), float64
    lse : numpy.ndarray, shape (H, total_q), float64
        Only if ``return_lse``.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> from cupyflash import reference
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 3, 40], dtype=np.int32)
    >>> q, k, v = (rng.standard_normal((40, 2, 16), dtype=np.float32) for _ in range(3))
    >>> ref = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> ref.dtype.name, ref.shape
    ('float64', (40, 2, 16))
    >>> bool(np.abs(cupyflash.attention_varlen(q, k, v, cu, cu, causal=True) - ref).max() < 1e-5)
    True
    """
    options = dict(window=window, softcap=softcap, alibi_slopes=None, bias=None, mask=None, block_mask=None)
    packed, slopes, dropout = _varlen_problem(
        dict(q=q, k=k, v=v),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        options,
        alibi_slopes,
        dropout_p,
        dropout_seed,
    )
    q, k, v = _as_float64(q=q, k=k, v=v)
    out = np.zeros((packed.total_q, packed.heads, packed.dv))
    lse = np.full((packed.heads, packed.total_q), -np.inf)
    for s, q0, q1, k0, k1 in packed.sequences():
        views = [
            _varlen.sequence_view(x, r0, r1, packed.kv_heads) for x, r0, r1 in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
        ]
        opts, drop = _sequence_options(packed, s, options, slopes, dropout)
        out_s, lse_s = _forward(*views, causal, scale, opts, drop)
        out[q0:q1] = out_s.reshape(packed.heads, q1 - q0, packed.dv).transpose(1, 0, 2)
        lse[:, q0:q1] = lse_s.reshape(packed.heads, q1 - q0)
    return (out, lse) if return_lse else out


@quiet_float_errors
def attention_varlen_backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference gradients of :func:`cupyflash.attention_varlen` in float64, sequence by sequence.

    Parameters
    ----------
    dout : numpy.ndarray, shape (total_q, H, Dv)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes
        As in :func:`attention_varlen`.
    dropout_p, dropout_seed : optional
        As in :func:`attention_varlen`.

    Returns
    -------
    dq, dk, dv : numpy.ndarray, float64, the shapes of q, k, v
        dk and dv summed over the query heads of each key/value head.

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash import reference
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 3, 40], dtype=np.int32)
    >>> q, dout = (rng.standard_normal((40, 4, 16)) for _ in range(2))
    >>> k, v = (rng.standard_normal((40, 2, 16)) for _ in range(2))          # 2 key/value heads for 4
    >>> dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, cu, cu, causal=True)
    >>> dq.shape, dk.shape
    ((40, 4, 16), (40, 2, 16))
    """
    options = dict(window=window, softcap=softcap, alibi_slopes=None, bias=None, mask=None, block_mask=None)
    packed, slopes, dropout = _varlen_problem(
        dict(q=q, k=k, v=v),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        options,
        alibi_slopes,
        dropout_p,
        dropout_seed,
    )
    dout, q, k, v = _as_float64(dout=dout, q=q, k=k, v=v)
    if dout.shape != (packed.total_q, packed.heads, packed.dv):
        raise ValueError(
            f"dout has shape {dout.shape}; the output has shape {(packed.total_q, packed.heads, packed.dv)}"
        )
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for s, q0, q1, k0, k1 in packed.sequences():
        views = [
            _varlen.sequence_view(x, r0, r1, packed.kv_heads)
            for x, r0, r1 in ((dout, q0, q1), (q, q0, q1), (k, k0, k1), (v, k0, k1))
        ]
        opts, drop = _sequence_options(packed, s, options, slopes, dropout)
        dq_s, dk_s, dv_s = _backward(*views, causal, scale, opts, drop)
        dq[q0:q1] = dq_s.reshape(packed.heads, q1 - q0, packed.d).transpose(1, 0, 2)
        dk[k0:k1] = dk_s[:, 0].transpose(1, 0, 2)
        dv[k0:k1] = dv_s[:, 0].transpose(1, 0, 2)
    return dq, dk, dv


def _varlen_problem(
    arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, alibi_slopes, dropout_p, dropout_seed
):
    """Validate as cupyflash.attention_varlen does; slopes broadcast to (batch, H) as float32, or None."""
    for name, x in {**arrays, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}.items():
        if is_cupy(x):
            raise TypeError(f"{name} is a CuPy array; the reference runs on NumPy: pass {name}.get()")
    packed = _varlen.check(arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_dtypes=False)
    mods = _modifiers.resolve(
        np,
        np.float64,
        (packed.batch, packed.heads),
        1,
        1,
        window=options["window"],
        softcap=options["softcap"],
        alibi_slopes=alibi_slopes,
    )
    slopes = None if mods is None else mods.alibi_slopes
    dropout = _dropout.resolve(dropout_p, dropout_seed, caller="reference.attention_varlen")
    return packed, slopes, dropout


def _sequence_options(packed, s, options, slopes, dropout):
    """Sequence s's options with its heads as leading dims (Hk, G): its slopes, dropout's batch offset."""
    options = dict(options, alibi_slopes=None if slopes is None else slopes[s].reshape(packed.kv_heads, packed.groups))
    if dropout is not None:
        dropout = dataclasses.replace(dropout, batch_offset=s * packed.heads)
    return options, dropout


def _scores(q, k, v, causal, scale, options):
    """The final scores s (..., Nq, Nk) with -inf where keys are hidden, and tanh(x / softcap) or None."""
    batch = check_shapes(q, k, v)
    causal = check_causal(causal)
    scale = resolve_scale(scale, q.shape[-1])
    nq, nk = q.shape[-2], k.shape[-2]
    mods = _resolve(batch, nq, nk, options)
    s = scale * (q @ _transpose(k))
    s = np.broadcast_to(s, batch + (nq, nk))
    if mods is None:
        return np.where(_hidden(batch, nq, nk, causal, None), -np.inf, s), None
    tanh = None
    if mods.softcap > 0:
        tanh = np.tanh(s / mods.softcap)
        s = mods.softcap * tanh
    if mods.alibi_slopes is not None:
        slopes = mods.alibi_slopes.astype(np.float64)[..., None, None]
        s = s - slopes * np.abs(_key_offsets(nq, nk))
    if mods.bias is not None:
        s = s + mods.bias.astype(np.float64)
    # Hidden keys are -inf whatever the bias there holds (even NaN or +inf): they are never read.
    return np.where(_hidden(batch, nq, nk, causal, mods), -np.inf, s), tanh


def _key_offsets(nq, nk):
    """j - (i + Nk - Nq) for every query i and key j: 0 on the bottom-right aligned diagonal."""
    return np.arange(nk)[None, :] - (np.arange(nq)[:, None] + (nk - nq))


def _hidden(batch, nq, nk, causal, mods):
    """True where key j is hidden from query i: each rule of cupyflash._modifiers, one by one."""
    rel = _key_offsets(nq, nk)
    hidden = np.zeros(batch + (nq, nk), dtype=bool)
    hidden |= causal & (rel > 0)
    if mods is None:
        return hidden
    left, right = mods.window
    if left != -1:
        hidden |= rel < -left
    if right != -1:
        hidden |= rel > right
    if mods.mask is not None:
        hidden |= ~mods.mask
    if mods.block_mask is not None:
        tile = _modifiers.BLOCK_MASK_TILE
        rows, cols = np.arange(nq) // tile, np.arange(nk) // tile
        hidden |= ~mods.block_mask[..., rows[:, None], cols[None, :]]
    return hidden


def _resolve(batch, nq, nk, options):
    """cupyflash._modifiers.resolve, except that the bias may have any floating-point dtype."""
    bias = options["bias"]
    dtype = bias.dtype if isinstance(bias, np.ndarray) else np.float64
    if isinstance(bias, np.ndarray) and bias.dtype.kind != "f" and bias.dtype not in _BIAS_DTYPES_EXTRA:
        raise TypeError(f"bias must be a floating-point array, got dtype {bias.dtype}")
    return _modifiers.resolve(np, dtype, batch, nq, nk, **options)


def _softmax(s):
    """Row softmax P and log-sum-exp of scores S; rows that are all -inf give P = 0 and lse = -inf.

    Non-finite inputs propagate (cupyflash's policy): a NaN score, or a +inf one, makes its row's P and
    lse NaN, at its hidden (-inf) scores too (0 / NaN); the backward zeroes those (what a hidden key adds).
    """
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # NaN if the row holds a NaN
    blind = np.isneginf(m)  # every key hidden
    m = np.where(blind, 0, m)  # blind rows: exp(-inf - 0) = 0 instead of NaN
    e = np.where(np.isneginf(s), 0, np.exp(s - m))
    total = np.sum(e, axis=-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=~blind)
    lse = np.where(blind, -np.inf, m + np.log(np.where(blind, 1, total)))
    return p, lse[..., 0]


def _as_float64(**arrays):
    converted = []
    for name, x in arrays.items():
        if is_cupy(x):
            raise TypeError(f"{name} is a CuPy array; the reference runs on NumPy: pass {name}.get()")
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__qualname__}")
        converted.append(np.asarray(x, dtype=np.float64))
    return converted


def _transpose(x):
    return np.swapaxes(x, -1, -2)
