"""Score-modifier test machinery shared by the CPU (NumPy) and GPU (CuPy) tests.

``random_options`` draws the options of one problem; ``run`` calls the public forward and backward with
them; the results are then held to the accuracy rule by ``helpers.checks.assert_matches_reference`` (its
naive implementation takes every option, dropout included).
"""

import math

import numpy as np

import cupyflash
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
