"""Fused CuPy kernels for the model's elementwise and row-wise layers, each with its backward: layernorm, GELU (with
the bias before it), a linear layer's bias (with the residual add), its bias gradient, attention's heads merged
into the rows of the residual stream, the loss's softmax with cross-entropy, and AdamW over one flat buffer with
the gradients' sum of squares.

model.py and optim.py keep the plain array code for NumPy and call these for CuPy arrays (``applies``): as array
code each of these layers is several CuPy kernels, every one a pass over memory and a launch, with float32 copies
of bfloat16 activations in between. Each kernel here computes what the plain code computes, in the same dtypes
(``model.accumulator``: float32, float64 for float64), and rounds a bfloat16 or float16 result once
(tests/gpu/test_gpu_gpt_example.py compares each with the plain code in float64, float32, float16 and bfloat16).

The kernels are raw CUDA in fused.cu, templates over the element type (``__nv_bfloat16`` for ml_dtypes' bfloat16,
as matmul.py's arrays are) compiled by NVRTC once per dtype. The pointwise ones move 16 bytes per load and store
where every array they touch allows it (``_pack``), one element otherwise. No kernel here allocates more than its
outputs, waits for the device or copies from the host, so all of them can be captured in a CUDA graph (graph.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
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
# fused.cu's kernels and their template arguments: T the element type, A its accumulator, N the elements per load
# and store (1, or a 16-byte pack: _pack)
_KERNELS = {
    "layernorm_forward": "{T}, {A}",
    "layernorm_backward_dx": "{T}, {A}",
    "layernorm_param_grads": "{T}, {A}",
    "sum_squares": "{T}, {A}",
    "bias_add": "{T}, {A}, {N}",
    "bias_gelu_forward": "{T}, {A}, {N}",
    "column_sums": "{T}, {A}, {N}",
    "column_totals": "{A}",  # the column sums' partial sums, added
    "merge_heads": "{T}, {N}",
    "cross_entropy_backward": "{T}, {A}, {N}",  # packs of A: the probabilities
    "adamw": "{T}, {A}, {N}",  # packs of A: the parameters; T the dtype of their copy
    "softmax_cross_entropy": "{A}",  # float32 and float64 logits only
}
_PACKED_BY_ACCUMULATOR = ("cross_entropy_backward", "adamw")
_SOURCE = Path(__file__).with_name("fused.cu")
_ROW_WARPS = 8  # rows per block of the warp-per-row kernels (256 threads)
_COLUMN_BLOCK = (32, 8)  # the column sums' block: 32 columns (packs) by fused.cu's COLUMN_ROWS rows
_COLUMN_SUM_BLOCKS = 512  # the column sums' grid: about 4 blocks per SM of an H100 or H200, or more
_TOTAL_THREADS = 256  # threads per block of column_totals (one per column)
_LOSS_THREADS = 512  # threads per row of the loss: 50k logits are ~100 per thread
_SUM_BLOCKS, _SUM_THREADS = 1024, 256  # a fixed grid, so that the sum's order is the same on every device
_POINTWISE_BLOCKS, _POINTWISE_THREADS = 4096, 256  # the grid-stride kernels: a few waves at most, then loops


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
    out = cupy.empty(x.shape, x.dtype)
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
    dx = cupy.empty(x.shape, x.dtype)
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
    part = cupy.empty((2, chunks, width), acc)  # dg's partial sums, then db's
    _function("layernorm_param_grads", x.dtype)(
        (_blocks(width, 32), chunks),
        _COLUMN_BLOCK,
        (dout, x, mean, rstd, part[0], part[1], np.int64(rows), np.int32(width), np.int64(chunk)),
    )
    dg, db = _column_totals(part, x.dtype)
    return dx, dg, db


def column_sums(a):
    """The sum over rows of a (..., C) in the accumulator dtype (a linear layer's bias gradient), without a
    widened copy of a."""
    import cupy

    a = cupy.ascontiguousarray(a)
    return _column_sums(a, None, None, sums=True)


def _column_sums(dout, x, dx, sums: bool):
    """fused.cu's column_sums over dout (..., C): its column sums (None where not ``sums``), GELU's backward
    written to dx first where x is given."""
    import cupy

    acc = accumulator(dout.dtype)
    width = dout.shape[-1]
    if dout.size == 0:  # no rows (the sums are 0) or no columns
        return cupy.zeros(width, acc) if sums else None
    rows = dout.size // width
    pack = _pack(dout.dtype, dout, x, dx, width=width)
    column_blocks = _blocks(width, 32 * pack)
    chunk, chunks = _row_chunks(rows, max(32, _blocks(_COLUMN_SUM_BLOCKS, column_blocks)))
    part = cupy.empty((chunks, width), acc) if sums else None
    _function("column_sums", dout.dtype, pack)(
        (column_blocks, chunks),
        _COLUMN_BLOCK,
        (dout, _null(x), _null(dx), _null(part), np.int64(rows), np.int32(width), np.int64(chunk)),
    )
    return None if part is None else _column_totals(part[None], dout.dtype)[0]


def _column_totals(part, dtype):
    """The sums over rows of each of part's (count, rows, C) partial sums (the accumulator's dtype, of the column
    sums of arrays of ``dtype``), (count, C), added in the order of the rows: fused.cu's column_totals, one launch
    where CuPy's ``part.sum(1)`` takes several times its host time."""
    import cupy

    count, rows, width = part.shape
    out = cupy.empty((count, width), part.dtype)
    blocks = max(1, _blocks(count * width, _TOTAL_THREADS))
    _function("column_totals", dtype)(
        (blocks,), (_TOTAL_THREADS,), (part, out, np.int32(rows), np.int32(width), np.int32(count))
    )
    return out


# ------------------------------------------------------------------------------------------ GELU, bias
def gelu_forward(x):
    """GPT-2's tanh GELU of x, computed in the accumulator dtype and rounded once to x's."""
    import cupy

    x = cupy.ascontiguousarray(x)
    act = cupy.empty(x.shape, x.dtype)
    _pointwise("bias_gelu_forward", x, (x, _null(None), _null(None), act), (x, act))
    return act


def bias_gelu_forward(y, b):
    """(act, pre): pre = y + b (b: (C,) broadcast over y's rows), summed in the accumulator dtype and rounded to
    y's, and act = GELU(pre) from the rounded pre, rounded once: a linear layer's bias and the GELU after it, one
    pass over y."""
    import cupy

    y = cupy.ascontiguousarray(y)
    pre, act = cupy.empty(y.shape, y.dtype), cupy.empty(y.shape, y.dtype)
    _pointwise("bias_gelu_forward", y, (y, _vector(b, accumulator(y.dtype)), pre, act), (y, pre, act))
    return act, pre


def gelu_backward(dout, x, bias_grad=False):
    """dout * GELU'(x), the tanh recomputed from x, rounded once to dout's dtype; with ``bias_grad``, (that, its
    column sums over every dim but the last in the accumulator dtype): the gradient of the bias before the GELU,
    summed in the same pass as the rounded gradient it sums."""
    import cupy

    if dout.dtype != x.dtype or dout.shape != x.shape:
        raise ValueError(f"dout {dout.shape} {dout.dtype} must match x {x.shape} {x.dtype}")
    dout, x = cupy.ascontiguousarray(dout), cupy.ascontiguousarray(x)
    dx = cupy.empty(x.shape, x.dtype)
    db = _column_sums(dout, x, dx, sums=bias_grad)
    return (dx, db) if bias_grad else dx


def bias_add(y, b, residual=None):
    """y + b (b: (C,) broadcast over y's rows), plus ``residual`` where given, summed in the accumulator dtype and
    rounded once to y's."""
    import cupy

    y = cupy.ascontiguousarray(y)
    if residual is not None:
        if residual.shape != y.shape or residual.dtype != y.dtype:
            raise ValueError(f"residual {residual.shape} {residual.dtype} must match y {y.shape} {y.dtype}")
        residual = cupy.ascontiguousarray(residual)
    out = cupy.empty(y.shape, y.dtype)
    _pointwise("bias_add", y, (y, _vector(b, accumulator(y.dtype)), _null(residual), out), (y, residual, out))
    return out


def _pointwise(name: str, y, arguments, streamed):
    """fused.cu's grid-stride kernel ``name`` over y (..., C): ``arguments`` are its arguments before n and C, in
    order; ``streamed`` the arrays among them of y's shape, which it loads and stores in packs (the bias is read
    one element at a time)."""
    if y.size == 0:
        return
    width = y.shape[-1] if y.ndim else 1
    pack = _pack(y.dtype, *streamed, width=width)
    blocks = max(1, min(_POINTWISE_BLOCKS, _blocks(y.size // pack, _POINTWISE_THREADS)))
    _function(name, y.dtype, pack)((blocks,), (_POINTWISE_THREADS,), (*arguments, np.int64(y.size), np.int32(width)))


# ------------------------------------------------------------------------------------------ attention's heads
def merge_heads(x, out):
    """out (B, N, H * D) = x (B, H, N, D) (or (B, Hk, G, N, D), H = Hk * G) with each token's heads side by side:
    attention's output or gradient back in the rows of the residual stream, written where ``out`` lies (its last
    dim contiguous: a column slice of a wider array, a third of the qkv gradient, is written in place)."""
    import cupy

    x = cupy.ascontiguousarray(x)
    b, n, width = out.shape
    if x.size == 0 and out.size == 0:
        return out
    heads, d = x.size // max(1, b * n * x.shape[-1]), x.shape[-1]
    if x.dtype != out.dtype or (x.shape[0], x.shape[-2]) != (b, n) or heads * d != width:
        raise ValueError(f"x {x.shape} {x.dtype} does not fill out {out.shape} {out.dtype}")
    item = out.itemsize
    if out.strides[2] != item or any(s % item for s in out.strides):
        raise ValueError(f"out's last dim must be contiguous, got strides {out.strides}")
    batch_stride, row_stride = out.strides[0] // item, out.strides[1] // item
    pack = _pack(x.dtype, x, out, width=math.gcd(d, batch_stride, row_stride))
    blocks = max(1, min(_POINTWISE_BLOCKS, _blocks(x.size // pack, _POINTWISE_THREADS)))
    _function("merge_heads", x.dtype, pack)(
        (blocks,),
        (_POINTWISE_THREADS,),
        (x, out, np.int64(x.size), np.int32(heads), np.int32(n), np.int32(d), np.int64(batch_stride),
         np.int64(row_stride)),
    )  # fmt: skip
    return out


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


def cross_entropy_backward(probs, targets, dtype=None):
    """The mean loss's gradient (probs - onehot(targets)) / rows from ``probs`` (rows, V), softmax_cross_entropy's
    output, computed in its dtype and rounded once to ``dtype``: in place of probs where ``dtype`` is theirs (None,
    the default), else a new array (the bfloat16 gradient the head's products take, with no cast after)."""
    import cupy

    if not probs.flags.c_contiguous or probs.dtype not in (np.float32, np.float64):
        raise ValueError(f"probs must be C-contiguous float32 or float64, got {probs.dtype} {probs.strides}")
    dtype = probs.dtype if dtype is None else np.dtype(dtype)
    if accumulator(dtype) != probs.dtype:
        raise ValueError(
            f"a gradient in {dtype} is computed from {accumulator(dtype)} probabilities, not {probs.dtype}"
        )
    targets = cupy.ascontiguousarray(targets.reshape(-1), dtype=np.int32)
    rows, vocab = probs.shape
    d = probs if dtype == probs.dtype else cupy.empty(probs.shape, dtype)
    pack = _pack(probs.dtype, probs, d, width=vocab)
    _function("cross_entropy_backward", dtype, pack)(
        (rows,), (_LOSS_THREADS,), (probs, targets, d, np.int32(vocab), probs.dtype.type(rows))
    )
    return d


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


def adamw(p, g, m, v, *, sumsq, lr, t, betas, eps, weight_decay, clip, decay_end, copy=None):
    """AdamW in place over flat buffers p, g, m, v (one dtype): g scaled by min(1, clip / (sqrt(sumsq) + 1e-6))
    (clip None: no clipping), m and v updated, the first ``decay_end`` elements of p decayed by lr *
    weight_decay, then p -= lr * m_hat / (sqrt(v_hat) + eps) with Adam's bias corrections for step t. ``sumsq``,
    ``lr`` and ``t`` (int32) are (1,) device arrays, read by the kernel: a captured step reads their values at
    each replay. ``copy``, where given (decay_end elements, a dtype whose accumulator is p's), gets the updated
    p[:decay_end] rounded to its dtype, in the same pass."""
    kind = p.dtype.type
    b1, b2 = betas
    arrays = (p, g, m, v)
    if any(a.dtype != p.dtype or a.shape != p.shape or not a.flags.c_contiguous for a in arrays):
        raise ValueError(
            f"p, g, m, v must be C-contiguous of one shape and dtype: {[(a.shape, a.dtype) for a in arrays]}"
        )
    dtype = p.dtype if copy is None else copy.dtype
    if copy is not None and (
        copy.shape != (decay_end,) or not copy.flags.c_contiguous or accumulator(dtype) != p.dtype
    ):
        raise ValueError(
            f"copy {copy.shape} {copy.dtype} is not a contiguous ({decay_end},) copy of {p.dtype} parameters"
        )
    pack = _pack(p.dtype, *arrays, copy)
    blocks = max(1, min(_POINTWISE_BLOCKS, _blocks(p.size // pack, _POINTWISE_THREADS)))
    _function("adamw", dtype, pack)(
        (blocks,),
        (_POINTWISE_THREADS,),
        (*arrays, _null(copy), sumsq, lr, t, kind(b1), kind(b2), kind(eps), kind(weight_decay),
         kind(-1.0 if clip is None else clip), np.int64(decay_end), np.int64(p.size)),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ loading
def _blocks(count: int, per_block: int) -> int:
    return -(-count // per_block)


def _row_chunks(rows: int, most: int = 32) -> tuple[int, int]:
    """(rows per chunk, chunks) of the column sums: at most ``most`` chunks and at least 64 rows each, so that the
    blocks number a few per SM at the model's widths and the partial sums stay a small array."""
    chunk = max(64, _blocks(rows, most))
    return chunk, max(1, _blocks(rows, chunk))


def _pack(dtype, *arrays, width: int | None = None) -> int:
    """The elements of ``dtype`` per load and store of a pointwise kernel: 16 bytes' worth where ``width`` (the
    row length that a pack must not straddle; None: no rows) is a multiple of it and every array in ``arrays``
    (None: no array) starts at a multiple of a pack of its own elements; else 1. CuPy's allocations start at
    multiples of 256 bytes, so a whole array fits, and a view fits where its offset does."""
    wide = 16 // np.dtype(dtype).itemsize
    if (width is not None and width % wide) or any(a is not None and a.data.ptr % (wide * a.itemsize) for a in arrays):
        return 1
    return wide


def _null(a):
    """a, or a null pointer for a kernel argument that is absent."""
    return np.uint64(0) if a is None else a


def _vector(a, dtype):
    import cupy

    return cupy.ascontiguousarray(a, dtype=dtype)


def _function(name: str, dtype, pack: int | None = None):
    """fused.cu's ``name`` for arrays of ``dtype`` (its T) on the current device, moving ``pack`` elements at a
    time where it takes N."""
    import cupy

    return _device_function(cupy.cuda.runtime.getDevice(), name, dtype, pack)


@functools.cache
def _device_function(device: int, name: str, dtype, pack: int | None):
    """_function's lookup, kept: CuPy's makes a new function object each time (a module is loaded per device)."""
    dtype = np.dtype(dtype)
    if dtype not in _CTYPES:
        raise TypeError(f"the fused kernels take float64, float32, float16 or bfloat16, not {dtype}")
    return _module(dtype).get_function(_template(name, dtype, pack))


def _template(name: str, dtype, pack: int | None = None) -> str:
    element, acc = _CTYPES[np.dtype(dtype)]
    return f"{name}<{_KERNELS[name].format(T=element, A=acc, N=pack)}>"


def _names(dtype) -> list[str]:
    """The name expressions of every kernel fused.py launches for arrays of ``dtype``: each pointwise kernel with
    packs of 1 and of 16 bytes; the loss's softmax for float32 and float64 only (the logits' dtypes)."""
    dtype = np.dtype(dtype)
    acc = accumulator(dtype)
    names = []
    for name, arguments in _KERNELS.items():
        if name == "softmax_cross_entropy" and dtype != acc:
            continue
        if "{N}" not in arguments:
            names.append(_template(name, dtype))
            continue
        wide = 16 // (acc if name in _PACKED_BY_ACCUMULATOR else dtype).itemsize
        names += [_template(name, dtype, pack) for pack in (1, wide)]
    return names


@functools.cache
def _module(dtype):
    """fused.cu compiled for one dtype (NVRTC through CuPy, which keeps the build in its disk cache)."""
    import cupy

    return cupy.RawModule(code=_SOURCE.read_text(), options=("--std=c++17",), name_expressions=_names(dtype))
