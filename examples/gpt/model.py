"""A GPT-2-style language model in array code, every gradient written by hand: token and position embeddings,
pre-norm blocks (layernorm, causal self-attention through cupyflash, residual; layernorm, GELU MLP, residual), a
final layernorm and an output head tied to the token embedding, with cross-entropy.

One code path for NumPy and CuPy: the array module is that of the parameters. Shapes: B sequences of N tokens,
width C, H query heads over Hk key/value heads (grouped-query attention when Hk < H) of D = C / H dims.
Each layer is a pair of functions: ``*_forward(...) -> (out, saved)`` and ``*_backward(dout, saved) -> (dx,
grads...)``; ``forward`` runs the model and keeps what ``backward`` needs, as llm.c's train_gpt2.cu does.

Precision: the parameters are float32 (the optimizer's master copy); a step computes in ``dtype`` (float32; bfloat16
or float16 on the GPU), with layernorm's statistics, GELU, the softmax of the loss and every weight gradient in
float32 (``accumulator``; all float64 for float64, which the gradient checks use). Every matrix product goes through
``matmul.matmul``, which on CuPy calls cuBLAS itself: CuPy's ``@`` has no bfloat16 and cannot be captured in a CUDA
graph. The products read the matrices in ``dtype`` (``weights``: the optimizer's copies in training, else cast once
per forward).

Layernorm, GELU, the bias and residual adds, the bias gradients, the merging of attention's heads and the loss's
softmax are written once as array code, which NumPy runs; on CuPy each is one or two fused kernels instead
(fused.py, the same arithmetic in the same dtypes), where the array code would be several passes over memory. A sum
rounded to bfloat16 is rounded once, after adding in the accumulator dtype, on either path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import fused
import numpy as np
from matmul import matmul

import cupyflash


@dataclass(frozen=True)
class Config:
    vocab: int
    context: int = 256  # the longest sequence N
    layers: int = 4
    width: int = 128  # C
    heads: int = 4  # H
    kv_heads: int | None = None  # Hk (default H); grouped-query attention when fewer

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        if self.heads % self.kv:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv}")

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def init(config: Config, xp=np, seed: int = 0) -> dict:
    """float32 parameters by name, GPT-2's initialization: N(0, 0.02), the projections into the residual stream
    scaled by 1/sqrt(2 * layers), biases 0, layernorm gains 1."""
    rng = np.random.default_rng(seed)
    c, d = config.width, config.head_dim
    qkv = c + 2 * config.kv * d

    def normal(*shape, std=0.02):
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32) * std)

    params = {"wte": normal(config.vocab, c), "wpe": normal(config.context, c)}
    residual_std = 0.02 / math.sqrt(2 * config.layers)
    for layer in range(config.layers):
        p = f"h{layer}."
        params.update({
            p + "ln1.g": xp.ones(c, np.float32), p + "ln1.b": xp.zeros(c, np.float32),
            p + "attn.wqkv": normal(c, qkv), p + "attn.bqkv": xp.zeros(qkv, np.float32),
            p + "attn.wo": normal(c, c, std=residual_std), p + "attn.bo": xp.zeros(c, np.float32),
            p + "ln2.g": xp.ones(c, np.float32), p + "ln2.b": xp.zeros(c, np.float32),
            p + "mlp.wfc": normal(c, 4 * c), p + "mlp.bfc": xp.zeros(4 * c, np.float32),
            p + "mlp.wproj": normal(4 * c, c, std=residual_std), p + "mlp.bproj": xp.zeros(c, np.float32),
        })  # fmt: skip
    params.update({"lnf.g": xp.ones(c, np.float32), "lnf.b": xp.zeros(c, np.float32)})
    return params


# ------------------------------------------------------------------------------------------------ layers
def accumulator(dtype):
    """The dtype that statistics, the loss's softmax and weight gradients take: float64 for float64 (the
    gradient checks), else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def layernorm_forward(x, g, b, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * g + b over the last dim; statistics in the accumulator dtype. Keeps x,
    mean and rstd (the backward rebuilds the normalized x from them)."""
    if fused.applies(x):
        out, mean, rstd = fused.layernorm_forward(x, g, b, eps)
        return out, (x, mean, rstd, g)
    x32 = x.astype(accumulator(x.dtype))
    mean = x32.mean(-1, keepdims=True)
    rstd = 1.0 / array_module(x).sqrt(((x32 - mean) ** 2).mean(-1, keepdims=True) + eps)
    return ((x32 - mean) * rstd * g + b).astype(x.dtype), (x, mean, rstd, g)


def layernorm_backward(dout, saved, dresidual=None):
    """(dx, dg, db); dx plus ``dresidual`` where given (the residual stream's gradient, which the block's skip
    connection adds), summed before dx is rounded to x's dtype."""
    x, mean, rstd, g = saved
    if fused.applies(dout):
        return fused.layernorm_backward(dout, x, mean, rstd, g, dresidual)
    acc = mean.dtype
    xhat = (x.astype(acc) - mean) * rstd
    dout = dout.astype(acc)
    axes = tuple(range(dout.ndim - 1))
    dg, db = (dout * xhat).sum(axes), dout.sum(axes)
    dxhat = dout * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    if dresidual is not None:
        dx = dx + dresidual.astype(acc)
    return dx.astype(x.dtype), dg, db


def linear_forward(x, w, b, residual=None):
    """x @ w + b with w (in, out) in x's dtype, plus ``residual`` (the residual stream) where given: the sum in
    the accumulator dtype, rounded once to x's."""
    y = matmul(x, w.astype(x.dtype, copy=False))
    if fused.applies(y):
        return fused.bias_add(y, b, residual), (x, w)
    acc = accumulator(x.dtype)
    out = y.astype(acc, copy=False) + b
    if residual is not None:
        out = residual.astype(acc, copy=False) + out
    return out.astype(x.dtype, copy=False), (x, w)


def linear_backward(dout, saved):
    """(dx, dw, db)."""
    dx, dw = _linear_products(dout, saved)
    flat_d = dout.reshape(-1, dout.shape[-1])
    db = fused.column_sums(flat_d) if fused.applies(flat_d) else flat_d.astype(accumulator(dout.dtype)).sum(0)
    return dx, dw, db


def _linear_products(dout, saved):
    """The products of linear_backward: (dx, dw)."""
    x, w = saved
    dx = matmul(dout, w.astype(dout.dtype, copy=False).T)
    flat_x, flat_d = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
    dw = matmul(flat_x.T, flat_d, accumulator(x.dtype))  # bfloat16 on CuPy: written as float32, never rounded
    return dx, dw


_GELU_K = math.sqrt(2.0 / math.pi)


def gelu_forward(x):
    """GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(k (x + 0.044715 x^3))), computed in the accumulator
    dtype and rounded once to x's. Keeps x only: the backward recomputes the tanh.

    The casts matter for bfloat16: a Python float times a bfloat16 array is float32, in NumPy and CuPy alike (seen
    with ml_dtypes 0.6 and CuPy 14.2), which would leave the MLP's second product in float32 with bfloat16 gradients
    flowing back into it. In float16, x^3 would overflow past |x| = 40.
    """
    if fused.applies(x):
        return fused.gelu_forward(x), (x,)
    x32 = x.astype(accumulator(x.dtype))
    t = array_module(x).tanh(_GELU_K * (x32 + 0.044715 * (x32 * x32 * x32)))
    return (0.5 * x32 * (1.0 + t)).astype(x.dtype), (x,)


def gelu_backward(dout, saved):
    (x,) = saved
    if fused.applies(dout):
        return fused.gelu_backward(dout, x)
    x32 = x.astype(accumulator(x.dtype))
    t = array_module(x).tanh(_GELU_K * (x32 + 0.044715 * (x32 * x32 * x32)))
    local = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _GELU_K * (1.0 + 3 * 0.044715 * x32 * x32)
    return (dout.astype(local.dtype) * local).astype(dout.dtype)


def linear_gelu_forward(x, w, b):
    """GELU(x @ w + b), the MLP's first half: (act, saved), saved as linear_forward's and gelu_forward's. On CuPy
    the bias and the GELU are one pass over the product (fused.bias_gelu_forward), which writes the pre-activation
    that the backward reads beside act."""
    if not fused.applies(x):
        fc, s_fc = linear_forward(x, w, b)
        act, s_gelu = gelu_forward(fc)
        return act, (s_fc, s_gelu)
    act, fc = fused.bias_gelu_forward(matmul(x, w.astype(x.dtype, copy=False)), b)
    return act, ((x, w), (fc,))


def linear_gelu_backward(dout, saved):
    """(dx, dw, db) of linear_gelu_forward. On CuPy GELU's backward sums the bias's gradient as it writes its
    result (fused.gelu_backward), rather than in a pass of its own."""
    s_fc, s_gelu = saved
    if not fused.applies(dout):
        return linear_backward(gelu_backward(dout, s_gelu), s_fc)
    d_fc, db = fused.gelu_backward(dout, *s_gelu, bias_grad=True)
    return (*_linear_products(d_fc, s_fc), db)


def attention_forward(qkv, config: Config):
    """Causal self-attention of qkv (B, N, C + 2 Hk D), q's H heads then k's and v's Hk each, through
    cupyflash: out (B, N, C). Query heads are grouped (B, Hk, H / Hk, N, D) so that k and v (B, Hk, 1, N, D)
    broadcast over each group."""
    b, n, _ = qkv.shape
    h, hk, d = config.heads, config.kv, config.head_dim
    q = qkv[..., : h * d].reshape(b, n, hk, h // hk, d).transpose(0, 2, 3, 1, 4)
    k = qkv[..., h * d : (h + hk) * d].reshape(b, n, hk, 1, d).transpose(0, 2, 3, 1, 4)
    v = qkv[..., (h + hk) * d :].reshape(b, n, hk, 1, d).transpose(0, 2, 3, 1, 4)
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)  # (the views go in without a copy)
    merged = merge_heads(out, array_module(out).empty((b, n, h * d), out.dtype))
    return merged, (q, k, v, out, lse)


def attention_backward(dout, saved, config: Config):
    """d_qkv (B, N, C + 2 Hk D): dq, dk and dv, each merged into its columns."""
    q, k, v, out, lse = saved
    b, n, _ = dout.shape
    h, hk, d = config.heads, config.kv, config.head_dim
    dout = dout.reshape(b, n, hk, h // hk, d).transpose(0, 2, 3, 1, 4)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)  # dk, dv summed over groups
    d_qkv = array_module(dq).empty((b, n, (h + 2 * hk) * d), dq.dtype)
    for grad, columns in ((dq, slice(0, h * d)), (dk, slice(h * d, (h + hk) * d)), (dv, slice((h + hk) * d, None))):
        merge_heads(grad, d_qkv[..., columns])
    return d_qkv


def merge_heads(x, out):
    """out (B, N, Hk G D) = x (B, Hk, G, N, D): each token's heads side by side in its row, written where ``out``
    lies (a column slice of a wider array too) and returned. On CuPy one fused pass; as array code, a copy through
    the transposed view."""
    if fused.applies(x):
        return fused.merge_heads(x, out)
    out[...] = x.transpose(0, 3, 1, 2, 4).reshape(out.shape)
    return out


def cross_entropy_forward(x, wte, targets):
    """The tied head and the loss: logits = x @ wte^T (B, N, V); the mean over tokens of -log softmax at the
    targets, in float32. Returns the loss as a 0-d array (no wait for the device). Keeps the probabilities, in
    place of the logits."""
    xp = array_module(x)
    logits = matmul(x, wte.astype(x.dtype, copy=False).T, accumulator(x.dtype)).reshape(-1, wte.shape[0])
    flat_targets = targets.reshape(-1)
    if fused.applies(logits):
        losses = fused.softmax_cross_entropy(logits, flat_targets)  # logits become the probabilities
        return losses.mean(), (x, wte, logits, flat_targets)
    logits -= logits.max(-1, keepdims=True)
    probs = xp.exp(logits)
    probs /= probs.sum(-1, keepdims=True)
    loss = -xp.log(probs[xp.arange(probs.shape[0]), flat_targets]).mean()
    return loss, (x, wte, probs, flat_targets)


def cross_entropy_backward(saved):
    """(dx, dwte). On CuPy the loss's gradient is written over the kept probabilities where it stays in their dtype:
    call it once per forward."""
    x, wte, probs, flat_targets = saved
    acc = accumulator(x.dtype)
    # dlogits in x's dtype, as every other layer's weight gradient takes its dout: in float32 the head's (V x B*N x
    # C) would be a bfloat16 step's largest product, and off the tensor cores. float16 keeps it in float32: its
    # range would flush most of dlogits (p / rows) to 0.
    grad_dtype = acc if x.dtype == np.float16 else x.dtype
    if fused.applies(probs):  # rounded to grad_dtype as it is written: no cast of the (B*N, V) array after
        dlogits = fused.cross_entropy_backward(probs, flat_targets, grad_dtype)
    else:
        dlogits = probs.copy()
        dlogits[array_module(probs).arange(probs.shape[0]), flat_targets] -= 1.0
        dlogits /= flat_targets.size
        dlogits = dlogits.astype(grad_dtype, copy=False)
    d = dlogits.astype(x.dtype, copy=False)
    dx = matmul(d, wte.astype(x.dtype, copy=False)).reshape(x.shape)
    flat_x = x.reshape(-1, x.shape[-1])
    if x.dtype == np.float16:
        return dx, matmul(dlogits.T, flat_x.astype(acc))
    return dx, matmul(d.T, flat_x, acc)


def array_module(x):
    """numpy or cupy: the module of array x."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def scatter_add(target, index, values) -> None:
    """target[index[i]] += values[i], repeated indices summed (an embedding's gradient)."""
    if isinstance(target, np.ndarray):
        np.add.at(target, index, values)
    else:
        import cupyx

        cupyx.scatter_add(target, index, values)


# ------------------------------------------------------------------------------------------------ the model
def forward(params: dict, tokens, targets, config: Config, dtype=np.float32, weights: dict | None = None):
    """The mean cross-entropy (a 0-d float32 array) of predicting ``targets`` (B, N) from ``tokens`` (B, N), and
    what backward needs.

    ``weights``: the matrices in ``dtype`` (``matrices``), where the caller keeps them (optim.AdamW.copies, which
    each optimizer step rewrites); None: cast from ``params`` here, once for the forward and the backward.
    """
    weights = matrices(params, dtype) if weights is None else weights
    x, saved, s_lnf = _trunk(params, weights, tokens, config, dtype)
    loss, s_loss = cross_entropy_forward(x, weights["wte"], targets)
    return loss, (tokens, saved, s_lnf, s_loss)


def logits(params: dict, tokens, config: Config, dtype=np.float32, weights: dict | None = None):
    """The next token's logits (B, V) in float32 after each sequence of ``tokens`` (B, N)."""
    weights = matrices(params, dtype) if weights is None else weights
    x, _, _ = _trunk(params, weights, tokens, config, dtype)
    return matmul(x[:, -1], weights["wte"].T, accumulator(dtype))


def matrices(params: dict, dtype) -> dict:
    """The matrices (the 2-D parameters; the products read all but wpe) cast to ``dtype``, by name: the parameters
    themselves where they are of that dtype."""
    return {name: w.astype(dtype, copy=False) for name, w in params.items() if w.ndim == 2}


def _trunk(params: dict, weights: dict, tokens, config: Config, dtype):
    """The embeddings and every block, then the final layernorm: (x (B, N, C), each block's saved, lnf's). The
    products take ``weights``, the biases and gains ``params``."""
    n = tokens.shape[1]
    if n > config.context:
        raise ValueError(f"sequences of {n} tokens are longer than the context {config.context}")
    x = (params["wte"][tokens] + params["wpe"][:n]).astype(dtype, copy=False)
    saved = []
    for layer in range(config.layers):
        p = f"h{layer}."
        h1, s_ln1 = layernorm_forward(x, params[p + "ln1.g"], params[p + "ln1.b"])
        qkv, s_qkv = linear_forward(h1, weights[p + "attn.wqkv"], params[p + "attn.bqkv"])
        att, s_att = attention_forward(qkv, config)
        x, s_proj = linear_forward(att, weights[p + "attn.wo"], params[p + "attn.bo"], residual=x)
        h2, s_ln2 = layernorm_forward(x, params[p + "ln2.g"], params[p + "ln2.b"])
        act, s_fc = linear_gelu_forward(h2, weights[p + "mlp.wfc"], params[p + "mlp.bfc"])
        x, s_mlp = linear_forward(act, weights[p + "mlp.wproj"], params[p + "mlp.bproj"], residual=x)
        saved.append((s_ln1, s_qkv, s_att, s_proj, s_ln2, s_fc, s_mlp))
    xf, s_lnf = layernorm_forward(x, params["lnf.g"], params["lnf.b"])
    return xf, saved, s_lnf


def backward(state, params: dict, config: Config) -> dict:
    """The loss's gradients by parameter name, in the accumulator dtype (float32; float64 for float64)."""
    tokens, saved, s_lnf, s_loss = state
    grads = {}
    dx, grads["wte"] = cross_entropy_backward(s_loss)
    dx, grads["lnf.g"], grads["lnf.b"] = layernorm_backward(dx, s_lnf)
    for layer in reversed(range(config.layers)):
        p = f"h{layer}."
        s_ln1, s_qkv, s_att, s_proj, s_ln2, s_fc, s_mlp = saved[layer]
        d_act, grads[p + "mlp.wproj"], grads[p + "mlp.bproj"] = linear_backward(dx, s_mlp)
        d_h2, grads[p + "mlp.wfc"], grads[p + "mlp.bfc"] = linear_gelu_backward(d_act, s_fc)
        dx, grads[p + "ln2.g"], grads[p + "ln2.b"] = layernorm_backward(d_h2, s_ln2, dresidual=dx)
        d_att, grads[p + "attn.wo"], grads[p + "attn.bo"] = linear_backward(dx, s_proj)
        d_qkv = attention_backward(d_att, s_att, config)
        d_h1, grads[p + "attn.wqkv"], grads[p + "attn.bqkv"] = linear_backward(d_qkv, s_qkv)
        dx, grads[p + "ln1.g"], grads[p + "ln1.b"] = layernorm_backward(d_h1, s_ln1, dresidual=dx)
    dx32 = dx.astype(accumulator(dx.dtype))
    n = tokens.shape[1]
    grads["wpe"] = array_module(dx).zeros(params["wpe"].shape, dx32.dtype)
    grads["wpe"][:n] = dx32.sum(0)
    scatter_add(grads["wte"], tokens.reshape(-1), dx32.reshape(-1, dx32.shape[-1]))  # the embedding's rows
    return grads
