"""Plain NumPy float64 attention, forward and backward, to check everything else against.

It materializes the whole score matrix S = scale * q @ k^T and applies the textbook formulas; it is meant
to be obviously right, not fast. Same semantics as cupyflash.attention: leading dims broadcast, the causal
mask is bottom-right aligned (query i sees key j iff j <= i + Nk - Nq), and a query row that sees no key
gives out = 0, lse = -inf and zero gradients. Inputs must be NumPy arrays (any dtype NumPy can convert to
float64, float64 included); results are float64.
"""

import cupy
import numpy as np

from cupyflash._api import check_causal, check_shapes, resolve_scale, sum_to_shape


def attention(q, k, v, *, causal=False, scale=None, return_lse=False):
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
        Also return the row-wise log-sum-exp of the (masked) scores.

    Returns
    -------
    out : numpy.ndarray, shape (..., Nq, Dv), float64
    lse : numpy.ndarray, shape (..., Nq), float64
        Only if ``return_lse``; ``-inf`` for rows that see no key.
    """
    q, k, v = _as_float64(q=q, k=k, v=v)
    check_shapes(q, k, v)
    scale = resolve_scale(scale, q.shape[-1])
    p, lse = _softmax(_masked_scores(q, k, check_causal(causal), scale))
    out = p @ v
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, *, causal=False, scale=None):
    """Reference gradients of attention in float64.

    Parameters
    ----------
    dout : numpy.ndarray, shape (..., Nq, Dv)
        Gradient of the loss with respect to the output (broadcast leading dims).
    q, k, v, causal, scale
        As in :func:`attention`.

    Returns
    -------
    dq, dk, dv : numpy.ndarray, float64, the shapes of q, k, v
        Summed over the dims along which q, k, v were broadcast.
    """
    dout, q, k, v = _as_float64(dout=dout, q=q, k=k, v=v)
    batch = check_shapes(q, k, v)
    out_shape = batch + (q.shape[-2], v.shape[-1])
    if dout.shape != out_shape:
        raise ValueError(f"dout has shape {dout.shape}; the output of these q, k, v has shape {out_shape}")
    scale = resolve_scale(scale, q.shape[-1])
    p, _ = _softmax(_masked_scores(q, k, check_causal(causal), scale))
    dp = dout @ _transpose(v)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = scale * ds @ k
    dk = scale * _transpose(ds) @ q
    dv = _transpose(p) @ dout
    return tuple(sum_to_shape(g, x.shape, np.float64) for g, x in ((dq, q), (dk, k), (dv, v)))


def _masked_scores(q, k, causal, scale):
    """S = scale * q @ k^T with -inf where the causal mask hides key j from query i."""
    s = scale * (q @ _transpose(k))
    if causal:
        nq, nk = s.shape[-2:]
        sees = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
        s = np.where(sees, s, -np.inf)
    return s


def _softmax(s):
    """Row softmax P and log-sum-exp of scores S; rows that are all -inf give P = 0 and lse = -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0, m)  # all-masked rows: exp(-inf - 0) = 0 instead of NaN
    e = np.exp(s - m)
    total = np.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    p = np.divide(e, total, out=np.zeros_like(e), where=seen)
    lse = np.where(seen, m + np.log(np.where(seen, total, 1)), -np.inf)
    return p, lse[..., 0]


def _as_float64(**arrays):
    converted = []
    for name, x in arrays.items():
        if isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} is a CuPy array; the reference runs on NumPy: pass {name}.get()")
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__qualname__}")
        converted.append(np.asarray(x, dtype=np.float64))
    return converted


def _transpose(x):
    return np.swapaxes(x, -1, -2)
