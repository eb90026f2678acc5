"""Score-modifier test machinery shared by the CPU (NumPy) and GPU (CuPy) test files.

``random_options`` draws the options of one problem; ``run`` calls the public forward and backward with
them; ``assert_matches_reference`` holds the results to conftest.py's rule (float16/bfloat16: at most twice
the error of a naive same-dtype implementation plus the reference's rounding; float32: 1e-5 relative), with
the naive implementation ``naive_attention`` extended to every modifier, and dbias checked like a gradient.
``dropout_p`` / ``dropout_seed`` pass through to every function, the naive one applying the reference's mask.
"""

import math

import cupy
import numpy as np

import cupyflash
from conftest import _assert_close, _assert_lse_close, _to_host, lse_atol
from cupyflash import reference
from cupyflash._api import sum_to_shape
from cupyflash._modifiers import BLOCK_MASK_TILE

OPTIONS = ("window", "softcap", "alibi_slopes", "bias", "mask", "block_mask")
NO_OPTIONS = dict(window=None, softcap=0.0, alibi_slopes=None, bias=None, mask=None, block_mask=None)
SOFTCAP = 2.0  # the scaled scores of standard-normal q, k are ~N(0, 1): tanh bends them noticeably
MASK_KEEP = 0.8  # fraction of the keys a random mask keeps
BLOCK_MASK_KEEP = 0.7  # fraction of the 128 x 128 tiles a random block_mask keeps


def block_grid(nq, nk):
    """The (query tiles, key tiles) shape of a block_mask for Nq x Nk scores."""
    return math.ceil(nq / BLOCK_MASK_TILE), math.ceil(nk / BLOCK_MASK_TILE)


def alibi_slopes(heads):
    """ALiBi's geometric slopes 2^(-8 h / H), h = 1..H, as float32."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def random_options(rng, which, batch, nq, nk, dtype, *, xp=np, bias_shape=None):
    """A dict of the options named in ``which`` (a subset of OPTIONS), drawn for a (*batch, Nq, Nk) problem.

    The window is about a quarter of Nk wide on the left and a tenth on the right; alibi slopes are per
    last batch dim (heads); bias is standard normal in ``dtype`` of ``bias_shape`` (default the full shape).
    """
    full = tuple(batch) + (nq, nk)
    makers = dict(
        window=lambda: (max(1, nk // 4), nk // 10),
        softcap=lambda: SOFTCAP,
        alibi_slopes=lambda: xp.asarray(alibi_slopes(batch[-1] if batch else 1)),
        bias=lambda: xp.asarray(_standard_normal(rng, full if bias_shape is None else bias_shape, dtype)),
        mask=lambda: xp.asarray(rng.random(full) < MASK_KEEP),
        block_mask=lambda: xp.asarray(rng.random(tuple(batch) + block_grid(nq, nk)) < BLOCK_MASK_KEEP),
    )
    unknown = set(which) - set(OPTIONS)
    assert not unknown, f"unknown options {unknown}"
    return {name: makers[name]() for name in which}


def _standard_normal(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def run(q, k, v, dout, *, causal, scale=None, **options):
    """Public forward then backward with the options: (out, lse, dq, dk, dv) plus dbias with a bias."""
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, scale=scale, **options)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, **options)
    return (out, lse, *grads)


def assert_matches_reference(q, k, v, dout, results, *, causal, scale=None, **options):
    """``results`` = (out, lse, dq, dk, dv[, dbias]) against the float64 reference (conftest.py's rule)."""
    bias = options.get("bias")
    out, lse, dq, dk, dv, *rest = results
    assert len(rest) == (bias is not None), f"{len(results)} results; dbias is returned iff bias is given"
    xp = cupy.get_array_module(q)
    named = [(name, x, like, q.dtype) for name, x, like in (("out", out, dout), ("dq", dq, q), ("dk", dk, k),
                                                           ("dv", dv, v))]
    if bias is not None:
        named.append(("dbias", rest[0], bias, bias.dtype))
    for name, x, like, dtype in named:
        assert isinstance(x, xp.ndarray), f"{name} is a {type(x)}, expected {xp.__name__}.ndarray"
        assert (x.shape, x.dtype) == (like.shape, dtype), f"{name}: {x.shape} {x.dtype}"
    assert (lse.shape, lse.dtype) == (out.shape[:-1], np.float32), f"lse: {lse.shape} {lse.dtype}"

    host = [_to_host(x) for x in (q, k, v, dout)]
    host_options = {name: _on_host(x) for name, x in options.items()}
    ref_out, ref_lse = reference.attention(*host[:3], causal=causal, scale=scale, return_lse=True,
                                           **host_options)
    ref_grads = reference.attention_backward(host[3], *host[:3], causal=causal, scale=scale, **host_options)
    naive = naive_attention(q, k, v, dout, causal=causal, scale=scale, **options)

    _assert_lse_close(_to_host(lse), ref_lse, lse_atol(q.dtype, options.get("softcap")))
    # dbias is held to the inputs' precision too: a float32 bias does not make float16 scores exact.
    for (name, x, *_), ref, naive_x in zip(named, (ref_out, *ref_grads), naive):
        _assert_close(name, _to_host(x), ref, _to_host(naive_x), q.dtype)


def naive_attention(q, k, v, dout, *, causal, scale=None, **options):
    """The obvious forward and backward in q's dtype (see conftest.naive_attention), with the modifiers.

    Every op computes in float32 from dtype inputs and rounds its result to the dtype. Returns out, dq, dk,
    dv and, with a bias, dbias (summed over its broadcast dims in float32, then rounded to its dtype).
    """
    xp = cupy.get_array_module(q)
    dtype = q.dtype

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    options = dict(options)
    dropout_p, dropout_seed = options.pop("dropout_p", 0.0), options.pop("dropout_seed", None)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    qf, kf, vf = (xp.broadcast_to(x, batch + x.shape[-2:]).astype(xp.float32) for x in (q, k, v))
    dout = dout.astype(xp.float32)
    s, tanh = _naive_scores(qf, kf, scale, causal, rounded, options)
    p = rounded(_softmax(s))

    def drop(x):  # x * Z / (1 - p), in the dtype
        if not dropout_p:
            return x
        keep = xp.asarray(reference.dropout_mask(dropout_p, dropout_seed, x.shape))
        return rounded(xp.where(keep, x / xp.float32(1 - dropout_p), 0))

    out = rounded(drop(p) @ vf)
    dv = rounded(_transpose(drop(p)) @ dout)
    dp = drop(rounded(dout @ _transpose(vf)))
    ds = rounded(p * (dp - xp.sum(p * dp, axis=-1, keepdims=True)))
    ds_scaled = ds if tanh is None else rounded(ds * (1 - tanh * tanh))
    dq = rounded(scale * rounded(ds_scaled @ kf))
    dk = rounded(scale * rounded(_transpose(ds_scaled) @ qf))
    grads = [sum_to_shape(g.astype(dtype), x.shape) for g, x in ((dq, q), (dk, k), (dv, v))]
    bias = options.get("bias")
    if bias is not None:
        grads.append(sum_to_shape(ds, bias.shape).astype(bias.dtype))
    return (out.astype(dtype), *grads)


def _naive_scores(qf, kf, scale, causal, rounded, options):
    """The modified, masked scores in the naive's precision, and tanh(x / softcap) or None."""
    xp = cupy.get_array_module(qf)
    s = rounded(scale * rounded(qf @ _transpose(kf)))
    tanh = None
    softcap = options.get("softcap", 0.0)
    if softcap:
        tanh = rounded(xp.tanh(s / softcap))
        s = rounded(softcap * tanh)
    nq, nk = s.shape[-2:]
    distance = xp.abs(xp.arange(nk)[None, :] - xp.arange(nq)[:, None] - (nk - nq)).astype(xp.float32)
    if options.get("alibi_slopes") is not None:
        s = rounded(s - options["alibi_slopes"].astype(xp.float32)[..., None, None] * distance)
    if options.get("bias") is not None:
        s = rounded(s + options["bias"].astype(xp.float32))
    hidden = xp.asarray(hidden_keys(s.shape[:-2], nq, nk, causal, **_on_host_all(options)))
    return xp.where(hidden, -xp.inf, s), tanh


def hidden_keys(batch, nq, nk, causal, *, window=None, mask=None, block_mask=None, **_):
    """Bool (*batch, Nq, Nk): True where key j is hidden from query i (_modifiers' rules, written afresh)."""
    i = np.arange(nq)[:, None] + (nk - nq)  # the query's diagonal position among the keys
    j = np.arange(nk)[None, :]
    hidden = np.broadcast_to((j > i) if causal else np.zeros((nq, nk), bool), tuple(batch) + (nq, nk))
    left, right = (-1, -1) if window is None else window
    if left != -1:
        hidden = hidden | (j < i - left)
    if right != -1:
        hidden = hidden | (j > i + right)
    if mask is not None:
        hidden = hidden | ~mask
    if block_mask is not None:
        tiles = np.repeat(np.repeat(block_mask, BLOCK_MASK_TILE, axis=-2), BLOCK_MASK_TILE, axis=-1)
        hidden = hidden | ~tiles[..., :nq, :nk]
    return np.broadcast_to(hidden, tuple(batch) + (nq, nk))


def _softmax(s):
    xp = cupy.get_array_module(s)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -xp.inf, 0, m)  # rows that see no key: exp(-inf) = 0 everywhere, not NaN
    e = xp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    return e / xp.where(total > 0, total, 1)


def _on_host(x):
    """NumPy version of an option (arrays moved off the GPU; pairs and floats as they are)."""
    return x.get() if isinstance(x, cupy.ndarray) else x


def _on_host_all(options):
    return {name: _on_host(x) for name, x in options.items()}


def _transpose(x):
    return x.swapaxes(-1, -2)
