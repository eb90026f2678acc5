"""Attention over disjoint sets of keys, merged by log-sum-exp: ``merge_attention_states`` and
``merge_attention_states_stacked``.

For one query row, attention over the keys ``K_1 ∪ ... ∪ K_S`` (disjoint) from the results over each part:

    lse = log(sum_s exp(lse_s))
    out = sum_s exp(lse_s - lse) out_s

That is how the splits of split-KV decoding combine, how a prefix cache shared by many sequences combines
with each sequence's own keys (cascade attention), and how ring attention combines its steps. The sums run
in ``lse_dtype`` (float32; float64 for float64 outs) with the largest lse subtracted first, so nothing
overflows. A part whose lse is -inf saw no key: its weight is exactly 0 and its out is never read (NaN there
changes nothing), so a row that only one part saw comes back bit for bit; a row that no part saw gets
out 0 and lse -inf, as a row that sees no key does in cupyflash.attention. An lse of +inf or NaN makes the
row NaN, out and lse.

Plain array code for NumPy and CuPy alike (the module of the inputs).
"""

from __future__ import annotations

import numpy as np

from cupyflash._arrays import Array, lse_dtype, quiet_float_errors
from cupyflash._checks import SUPPORTED_DTYPES, check_array_types


@quiet_float_errors
def merge_attention_states(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Merge the attention of the same queries over two disjoint sets of keys.

    Parameters
    ----------
    out_a, out_b : numpy.ndarray or cupy.ndarray, shape (..., N, Dv)
        Attention outputs over each set of keys, of one dtype: float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64.
    lse_a, lse_b : numpy.ndarray or cupy.ndarray, shape (..., N)
        Their log-sum-exp (as ``cupyflash.attention_forward`` or ``attention_with_kvcache(...,
        return_lse=True)`` return it): float32, float64 for float64 outs; -inf for a row that saw no key.
        For packed batches, whose lse is (H, total_q), pass ``lse.T`` with ``out`` (total_q, H, Dv).

    Returns
    -------
    out : array of the inputs' type, shape (..., N, Dv), out_a's dtype
    lse : array of the inputs' type, shape (..., N), float32 (float64 for float64 outs)
        ``log(exp(lse_a) + exp(lse_b))``; -inf where neither side saw a key (there out is 0).

    Examples
    --------
    Attention over 100 keys from attention over the first 60 and over the last 40:

    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 3, 32), dtype=np.float32)                 # (B, H, N, D)
    >>> k, v = (rng.standard_normal((2, 4, 100, 32), dtype=np.float32) for _ in range(2))
    >>> out_a, lse_a = cupyflash.attention_forward(q, k[..., :60, :], v[..., :60, :])
    >>> out_b, lse_b = cupyflash.attention_forward(q, k[..., 60:, :], v[..., 60:, :])
    >>> out, lse = cupyflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    >>> full, full_lse = cupyflash.attention_forward(q, k, v)
    >>> bool(np.abs(out - full).max() < 1e-5), bool(np.abs(lse - full_lse).max() < 1e-5)
    (True, True)
    """
    xp = _check({"out_a": out_a, "out_b": out_b}, {"lse_a": lse_a, "lse_b": lse_b}, "(..., N, Dv)", 2)
    return _merge(xp, (out_a, out_b), (lse_a, lse_b), out_a.shape, out_a.dtype)


@quiet_float_errors
def merge_attention_states_stacked(out: Array, lse: Array) -> tuple[Array, Array]:
    """Merge the attention of the same queries over S disjoint sets of keys, stacked along axis 0.

    Parameters
    ----------
    out : numpy.ndarray or cupy.ndarray, shape (S, ..., N, Dv)
        ``out[s]`` is the attention output over the s-th set of keys; float16, bfloat16
        (``ml_dtypes.bfloat16``), float32 or float64.
    lse : numpy.ndarray or cupy.ndarray, shape (S, ..., N)
        Their log-sum-exp: float32, float64 for float64 outs; -inf for a row that saw no key.

    Returns
    -------
    out : array of the inputs' type, shape (..., N, Dv), the input's dtype
    lse : array of the inputs' type, shape (..., N), float32 (float64 for float64 outs)
        ``log(sum_s exp(lse[s]))``; -inf where no set had a key for the row (there out is 0, also for S = 0).

    Examples
    --------
    Attention over 90 keys from three splits of 30, as split-KV decoding computes it:

    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 1, 32), dtype=np.float32)                 # (B, H, N, D)
    >>> k, v = (rng.standard_normal((2, 4, 90, 32), dtype=np.float32) for _ in range(2))
    >>> parts = [cupyflash.attention_forward(q, k[..., s:s + 30, :], v[..., s:s + 30, :]) for s in (0, 30, 60)]
    >>> out, lse = cupyflash.merge_attention_states_stacked(np.stack([o for o, _ in parts]),
    ...                                                     np.stack([l for _, l in parts]))
    >>> out.shape, lse.shape
    ((2, 4, 1, 32), (2, 4, 1))
    >>> bool(np.abs(out - cupyflash.attention(q, k, v)).max() < 1e-5)
    True
    """
    xp = _check({"out": out}, {"lse": lse}, "(S, ..., N, Dv)", 3)
    return _merge(xp, list(out), list(lse), out.shape[1:], out.dtype)


def _merge(xp, outs, lses, shape, dtype):
    """The merge of the parts ``outs`` and ``lses``, each of ``shape`` (..., N, Dv) and (..., N):
    (out in ``dtype``, lse in ``lse_dtype``)."""
    acc = lse_dtype(dtype)
    lses = [x.astype(acc, copy=False) for x in lses]
    top = xp.full(shape[:-1], -np.inf, dtype=acc)
    for lse in lses:
        top = xp.maximum(top, lse)  # NaN propagates
    shift = xp.where(xp.isneginf(top), 0, top)  # rows no part saw: exp(-inf - 0) = 0, not exp(NaN)
    total = xp.zeros(top.shape, dtype=acc)
    weighted = xp.zeros(shape, dtype=acc)
    for out, lse in zip(outs, lses):
        w = xp.exp(lse - shift)[..., None]
        total = total + w[..., 0]
        # A part that saw no key (lse -inf) is never read: 0 * NaN would be NaN. A NaN weight still is.
        weighted = weighted + w * xp.where(xp.isneginf(lse)[..., None], 0, out.astype(acc, copy=False))
    seen = total != 0  # True for a NaN total: it propagates
    safe_total = xp.where(seen, total, 1)
    merged = xp.where(seen[..., None], weighted / safe_total[..., None], 0).astype(dtype, copy=False)
    return merged, xp.where(seen, shift + xp.log(safe_total), -np.inf).astype(acc, copy=False)


def _check(outs, lses, layout, min_ndim):
    """outs and lses: one array module, outs one supported dtype and shape (``layout``, at least ``min_ndim``
    dims), lses ``lse_dtype`` of it and that shape without the last dim. Returns the array module."""
    xp = check_array_types({**outs, **lses})
    (first, out), *others = outs.items()
    if out.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{first} has dtype {out.dtype}; expected float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64"
        )
    if out.ndim < min_ndim:
        raise ValueError(f"{first} must have at least {min_ndim} dims {layout}, got shape {out.shape}")
    for name, other in others:
        if other.dtype != out.dtype:
            raise TypeError(
                f"{name} has dtype {other.dtype} but {first} has dtype {out.dtype}; the outs must share one dtype"
            )
        if other.shape != out.shape:
            raise ValueError(
                f"{name} has shape {other.shape} but {first} has shape {out.shape}; the outs must have one shape"
            )
    for name, lse in lses.items():
        if lse.dtype != lse_dtype(out.dtype):
            raise TypeError(
                f"{name} must be {lse_dtype(out.dtype)} for {out.dtype} outs (as attention returns it), got {lse.dtype}"
            )
        if lse.shape != out.shape[:-1]:
            raise ValueError(
                f"{name} has shape {lse.shape}; expected {first}.shape[:-1] = {out.shape[:-1]} "
                f"(out {layout} and lse without the last dim)"
            )
    return xp
