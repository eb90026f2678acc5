"""Fused CuPy kernels for the model's elementwise and row-wise layers, each with its backward: layernorm, GELU, a
linear layer's bias (with the residual add), its bias gradient, the loss's softmax with cross-entropy, and AdamW
over one flat buffer with the gradients' sum of squares.

model.py and optim.py keep the plain array code for NumPy and call these for CuPy arrays (``applies``): as array
code each of these layers is several CuPy kernels, every one a pass over memory and a launch, with float32 copies
of bfloat16 activations in between. Each kernel here computes what the plain code computes, in the same dtypes
(``model.accumulator``: float32, float64 for float64), and rounds a bfloat16 or float16 result once
(tests/gpu/test_gpu_gpt_example.py compares each with the plain code in float64, float32, float16 and bfloat16).

The row-wise kernels (layernorm, the loss) and the reductions are raw kernels in fused.cu, templates over the
element type (``__nv_bfloat16`` for ml_dtypes' bfloat16, as matmul.py's arrays are) compiled by NVRTC once per
dtype; the purely elementwise ones are ``cupy.ElementwiseKernel``, where CuPy names bfloat16 ``bfloat16``. No
kernel here allocates more than its outputs, waits for the device or copies from the host, so all of them can
be captured in a CUDA graph (graph.py).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np
from matmul import BFLOAT16

ENABLED = True  # the fused kernels serve CuPy arrays; False runs the plain array code there too (comparisons)

# C++ names of (element type, accumulator) for fused.cu's templates, by dtype
_CTYPES = {
    np.dtype(np.float64): ("double", "double"),
    np.dtype(np.float32): ("float", "float"),
    np.dtype(np.float16): ("__half", "float"),
    BFLOAT16: ("__nv_bfloat16", "float"),
}
_SOURCE = Path(__file__).with_name("fused.cu")
_ROW_WARPS = 8  # rows per block of the warp-per-row kernels (256 threads)
_COLUMN_BLOCK = (32, 8)  # the column sums' block: 32 columns by fused.cu's COLUMN_ROWS rows
_LOSS_THREADS = 512  # threads per row of the loss: 50k logits are ~100 per thread
_SUM_BLOCKS, _SUM_THREADS = 1024, 256  # a fixed grid, so that the sum's order is the same on every device


def applies(x) -> bool:
    """Whether x (an array) takes the fused kernels: a CuPy array, while ENABLED."""
    return ENABLED and not isinstance(x, np.ndarray)


@contextlib.contextmanager
def disabled():
    """Run the plain array code on CuPy arrays too, inside the block."""
    global ENABLED
    kept, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = kept


def accumulator(dtype) -> np.dtype:
    """float64 for float64, else float32 (model.accumulator; repeated here so that fused.py needs no model.py)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# ------------------------------------------------------------------------------------------ layernorm
def layernorm_forward(x, g, b, eps: float):
    """out = (x - mean) / sqrt(var + eps) * g + b over the last dim of x (..., C): (out in x's dtype, mean,
    rstd), the statistics (..., 1) in the accumulator dtype."""
    import cupy

    x = cupy.ascontiguousarray(x)
    acc = accumulator(x.dtype)
    rows, width = x.size // x.shape[-1], x.shape[-1]
    out = cupy.empty_like(x)
    mean, rstd = (cupy.empty(x.shape[:-1] + (1,), acc) for _ in range(2))
    kernel = _function("layernorm_forward", x.dtype)
    kernel(
        (_blocks(rows, _ROW_WARPS),),
        (32 * _ROW_WARPS,),
        (x, _vector(g, acc), _vector(b, acc), out, mean, rstd, np.int64(rows), np.int32(width), acc.type(eps)),
    )
    return out, mean, rstd


def layernorm_backward(dout, x, mean, rstd, g, dresidual=None):
    """(dx, dg, db) of layernorm_forward: dx in x's dtype, plus ``dresidual`` (x's shape and dtype) where given;
    dg and db (C,) in the accumulator dtype."""
    import cupy

    if dout.dtype != x.dtype or dout.shape != x.shape:
        raise ValueError(f"dout {dout.shape} {dout.dtype} must match x {x.shape} {x.dtype}")
    dout, x = cupy.ascontiguousarray(dout), cupy.ascontiguousarray(x)
    acc = mean.dtype
    mean, rstd = cupy.ascontiguousarray(mean), cupy.ascontiguousarray(rstd)
    rows, width = x.size // x.shape[-1], x.shape[-1]
    dx = cupy.empty_like(x)
    residual = np.uint64(0)  # a null pointer: no residual gradient to add
    if dresidual is not None:
        if dresidual.shape != x.shape or dresidual.dtype != x.dtype:
            raise ValueError(f"dresidual {dresidual.shape} {dresidual.dtype} must match x {x.shape} {x.dtype}")
        residual = cupy.ascontiguousarray(dresidual)
    _function("layernorm_backward_dx", x.dtype)(
        (_blocks(rows, _ROW_WARPS),),
        (32 * _ROW_WARPS,),
        (dout, x, mean, rstd, _vector(g, acc), residual, dx, np.int64(rows), np.int32(width)),
    )
    chunk, chunks = _row_chunks(rows)
    dg_part, db_part = (cupy.empty((chunks, width), acc) for _ in range(2))
    _function("layernorm_param_grads", x.dtype)(
        (_blocks(width, 32), chunks),
        _COLUMN_BLOCK,
        (dout, x, mean, rstd, dg_part, db_part, np.int64(rows), np.int32(width), np.int64(chunk)),
    )
    return dx, dg_part.sum(0), db_part.sum(0)


def column_sums(a):
    """The sum over rows of a (..., C) in the accumulator dtype (a linear layer's bias gradient), without a
    widened copy of a."""
    import cupy

    a = cupy.ascontiguousarray(a)
    acc = accumulator(a.dtype)
    rows, width = a.size // a.shape[-1], a.shape[-1]
    chunk, chunks = _row_chunks(rows)
    part = cupy.empty((chunks, width), acc)
    _function("column_sums", a.dtype)(
        (_blocks(width, 32), chunks), _COLUMN_BLOCK, (a, part, np.int64(rows), np.int32(width), np.int64(chunk))
    )
    return part.sum(0)


# ------------------------------------------------------------------------------------------ GELU, bias
def gelu_forward(x):
    """GPT-2's tanh GELU of x, computed in the accumulator dtype and rounded once to x's."""
    return _elementwise().gelu_forward(x)


def gelu_backward(dout, x):
    """dout * GELU'(x), the tanh recomputed from x, rounded once to dout's dtype."""
    return _elementwise().gelu_backward(dout, x)


def bias_add(y, b, residual=None):
    """y + b (b: (C,) broadcast over y's rows), plus ``residual`` where given, summed in the accumulator dtype and
    rounded once to y's."""
    kernels = _elementwise()
    if residual is None:
        return kernels.bias_add(y, b)
    return kernels.bias_residual_add(y, b, residual)


# ------------------------------------------------------------------------------------------ the loss
def softmax_cross_entropy(logits, targets):
    """Each row's -log softmax(logits)[target] (rows,), for logits (rows, V) float32 or float64 and targets
    (rows,) integers in [0, V) (unchecked: an index out of range reads outside the row). Overwrites logits
    with softmax(logits): the backward needs the probabilities and nothing else of the logits."""
    import cupy

    if not logits.flags.c_contiguous or logits.dtype not in (np.float32, np.float64):
        raise ValueError(f"logits must be C-contiguous float32 or float64, got {logits.dtype} {logits.strides}")
    rows, vocab = logits.shape
    targets = cupy.ascontiguousarray(targets.reshape(-1), dtype=np.int32)
    losses = cupy.empty(rows, logits.dtype)
    _function("softmax_cross_entropy", logits.dtype)(
        (rows,), (_LOSS_THREADS,), (logits, targets, losses, np.int32(vocab))
    )
    return losses


def cross_entropy_backward(probs, targets):
    """The mean loss's gradient in place of ``probs`` (rows, V), softmax_cross_entropy's output: (probs -
    onehot(targets)) / rows. Returns probs."""
    import cupy

    targets = cupy.ascontiguousarray(targets.reshape(-1), dtype=np.int32)
    rows, vocab = probs.shape
    _elementwise().cross_entropy_backward(targets, vocab, probs.dtype.type(rows), probs)
    return probs


# ------------------------------------------------------------------------------------------ the optimizer
def sum_squares(x):
    """The sum of x's squares (a 1-D array) in the accumulator dtype, as a (1,) array; a fixed summation order."""
    import cupy

    x = cupy.ascontiguousarray(x)
    acc = accumulator(x.dtype)
    blocks = max(1, min(_SUM_BLOCKS, _blocks(x.size, _SUM_THREADS)))
    part = cupy.empty(blocks, acc)
    _function("sum_squares", x.dtype)((blocks,), (_SUM_THREADS,), (x, np.int64(x.size), part))
    return part.sum(keepdims=True)


def adamw(p, g, m, v, *, sumsq, lr, t, betas, eps, weight_decay, clip, decay_end):
    """AdamW in place over flat buffers p, g, m, v (one dtype): g scaled by min(1, clip / (sqrt(sumsq) + 1e-6))
    (clip None: no clipping), m and v updated, the first ``decay_end`` elements of p decayed by lr *
    weight_decay, then p -= lr * m_hat / (sqrt(v_hat) + eps) with Adam's bias corrections for step t. ``sumsq``,
    ``lr`` and ``t`` (int32) are (1,) device arrays, read by the kernel: a captured step reads their values at
    each replay."""
    kind = p.dtype.type
    b1, b2 = betas
    _elementwise().adamw(
        g, sumsq, lr, t, kind(b1), kind(b2), kind(eps), kind(weight_decay), kind(-1.0 if clip is None else clip),
        np.int64(decay_end), p, m, v,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ loading
def _blocks(count: int, per_block: int) -> int:
    return -(-count // per_block)


def _row_chunks(rows: int) -> tuple[int, int]:
    """(rows per chunk, chunks) of the column sums: at most 32 chunks, so that the blocks number a few per SM at
    the model's widths and the partial sums stay a small array."""
    chunk = max(64, _blocks(rows, 32))
    return chunk, max(1, _blocks(rows, chunk))


def _vector(a, dtype):
    import cupy

    return cupy.ascontiguousarray(a, dtype=dtype)


def _function(name: str, dtype):
    """fused.cu's ``name`` for arrays of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype not in _CTYPES:
        raise TypeError(f"the fused kernels take float64, float32, float16 or bfloat16, not {dtype}")
    return _module(dtype).get_function(_template(name, dtype))


def _template(name: str, dtype) -> str:
    element, acc = _CTYPES[np.dtype(dtype)]
    return f"{name}<{element}>" if name == "softmax_cross_entropy" else f"{name}<{element}, {acc}>"


_PER_ELEMENT = ("layernorm_forward", "layernorm_backward_dx", "layernorm_param_grads", "column_sums", "sum_squares")


@functools.cache
def _module(dtype):
    """fused.cu compiled for one dtype (NVRTC through CuPy, which keeps the build in its disk cache)."""
    import cupy

    names = [_template(name, dtype) for name in _PER_ELEMENT]
    if dtype in (np.float32, np.float64):  # the loss takes the float32 logits (float64 in the checks)
        names.append(_template("softmax_cross_entropy", dtype))
    return cupy.RawModule(code=_SOURCE.read_text(), options=("--std=c++17",), name_expressions=names)


# In the elementwise kernels, A is the accumulator of the element type T (float, double for double), as in fused.cu.
_ACCUMULATOR = """
template <typename T> struct Accumulator { typedef float type; };
template <> struct Accumulator<double> { typedef double type; };
"""
_GELU_ARGUMENT = "A(0.7978845608028654) * (v + A(0.044715) * (v * v * v))"  # sqrt(2 / pi) (x + 0.044715 x^3)


@functools.cache
def _elementwise():
    """The ElementwiseKernels, made on first use (CuPy compiles each per dtype when first called)."""
    import types

    import cupy

    def kernel(name, params, outputs, body):
        return cupy.ElementwiseKernel(
            params, outputs, "typedef typename Accumulator<T>::type A;\n" + body, "gpt_" + name, preamble=_ACCUMULATOR
        )

    return types.SimpleNamespace(
        gelu_forward=kernel(
            "gelu_forward",
            "T x",
            "T y",
            f"const A v = (A)x; const A t = tanh({_GELU_ARGUMENT}); y = (T)(A(0.5) * v * (A(1) + t));",
        ),
        gelu_backward=kernel(
            "gelu_backward",
            "T dout, T x",
            "T dx",
            f"""const A v = (A)x;
            const A t = tanh({_GELU_ARGUMENT});
            const A local = A(0.5) * (A(1) + t)
                + A(0.5) * v * (A(1) - t * t) * A(0.7978845608028654) * (A(1) + A(3 * 0.044715) * v * v);
            dx = (T)((A)dout * local);""",
        ),
        bias_add=kernel("bias_add", "T y, P b", "T out", "out = (T)((A)y + (A)b);"),
        bias_residual_add=kernel(
            "bias_residual_add", "T y, P b, T residual", "T out", "out = (T)((A)residual + ((A)y + (A)b));"
        ),
        cross_entropy_backward=kernel(
            "cross_entropy_backward",
            "raw int32 targets, int64 vocab, T rows",
            "T p",
            "const ptrdiff_t row = i / vocab; p = (p - (i - row * vocab == targets[row] ? T(1) : T(0))) / rows;",
        ),
        adamw=kernel(
            "adamw",
            "T g, raw T sumsq, raw T lr, raw int32 t, T beta1, T beta2, T eps, T weight_decay, T clip, int64 decay_end",
            "T p, T m, T v",
            """const T limit = clip / (sqrt(sumsq[0]) + T(1e-6));  // min(1, limit): the norm scaled down to clip
            const T scale = clip > T(0) && limit < T(1) ? limit : T(1);
            const T gs = g * scale;
            m = beta1 * m + (T(1) - beta1) * gs;
            v = beta2 * v + (T(1) - beta2) * gs * gs;
            const T correction1 = T(1) - pow(beta1, T(t[0])), correction2 = T(1) - pow(beta2, T(t[0]));
            if (i < decay_end) p = p * (T(1) - lr[0] * weight_decay);
            p = p - lr[0] * (m / correction1) / (sqrt(v / correction2) + eps);""",
        ),
    )
