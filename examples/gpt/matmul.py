"""The model's matrix products: ``matmul(a, b, out_dtype)`` is a (..., k) @ b (k, n), every product of model.py
goes through it.

CuPy's ``@`` has no bfloat16: it takes ml_dtypes' bfloat16 (type char 'E') for an integer type and fails in its
integer GEMM. So a product of two bfloat16 CuPy arrays is handed to cuBLAS's gemmEx directly, bfloat16 inputs on
the tensor cores with float32 accumulation (CUBLAS_COMPUTE_32F), the result written by cuBLAS as bfloat16 or, where
the caller wants the accumulator (weight gradients, logits), as float32 without a bfloat16 rounding in between.
Everything else (NumPy, CuPy float16, float32, float64) is plain ``@``.

cuBLAS is column-major: the buffer of a row-major (r, c) matrix read column-major is its transpose, so the
row-major C = A @ B is computed as the column-major C^T = B^T A^T, B first. ``operand_layout`` and ``gemm_plan``
hold that index logic as pure functions of shapes and strides (tests/cpu/test_gpt_example.py replays them on
NumPy); transposed views (``w.T``, ``flat_x.T``) and row slices (``x[:, -1]``) go in without a copy.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# cuBLAS's and CUDA's enum values (cublas_api.h, library_types.h); numbers rather than the attributes of CuPy's
# cublas module, which loads libcublas on first touch and so cannot be read on a machine without CUDA
# (tests/gpu/test_gpu_gpt_example.py checks them against that module).
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
_CUDA_TYPES = {np.dtype(np.float32): CUDA_R_32F, BFLOAT16: CUDA_R_16BF}
_INT32_MAX = 2**31 - 1  # gemmEx takes its sizes and leading dimensions as int


def matmul(a, b, out_dtype=None):
    """a (..., k) @ b (k, n) -> (..., n) in ``out_dtype`` (default a's dtype).

    For two bfloat16 CuPy arrays: cuBLAS, float32 accumulation, ``out_dtype`` bfloat16 or float32. Otherwise
    ``a @ b`` cast to ``out_dtype``.
    """
    out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
    if isinstance(a, np.ndarray) or BFLOAT16 not in (a.dtype, b.dtype):
        return (a @ b).astype(out_dtype, copy=False)
    return _bfloat16_gemm(a, b, out_dtype)


def operand_layout(shape, strides):
    """How cuBLAS can read the row-major matrix of ``shape`` (r, c) and element ``strides`` where it lies:
    (CUBLAS_OP_N, ld) when its buffer read column-major with leading dimension ld is the matrix's transpose (unit
    stride along a row: C order, or rows of a larger array), (CUBLAS_OP_T, ld) when it is the matrix itself (unit
    stride down a column: a transposed view such as ``w.T``), None when neither (it must be copied first).

    The stride of a dim of length 1 is never used (NumPy and CuPy may report any value there), so such a dim meets
    either condition, and its ld is the smallest that cuBLAS accepts.
    """
    r, c = shape
    s0, s1 = strides
    if (c == 1 or s1 == 1) and (r == 1 or s0 >= max(1, c)):
        return CUBLAS_OP_N, (s0 if r > 1 else max(1, c))
    if (r == 1 or s0 == 1) and (c == 1 or s1 >= max(1, r)):
        return CUBLAS_OP_T, (s1 if c > 1 else max(1, r))
    return None


def gemm_plan(m, k, n, layout_a, layout_b):
    """gemmEx's (transa, transb, m, n, k, lda, ldb, ldc) for the row-major a (m, k) @ b (k, n) written into a
    C-order (m, n) output, from each operand's ``operand_layout``.

    Column-major, the output's buffer is C^T (n, m) with leading dimension n, and C^T = B^T A^T: cuBLAS's first
    operand is b, whose buffer read column-major is B^T when its layout is OP_N (so no transpose is asked for) and
    B when OP_T (so a transpose is); likewise its second operand a gives A^T.
    """
    (op_a, ld_a), (op_b, ld_b) = layout_a, layout_b
    plan = (op_b, op_a, n, m, k, ld_b, ld_a, max(1, n))
    if max(plan[2:]) > _INT32_MAX:
        raise ValueError(f"a ({m}, {k}) @ b ({k}, {n}) is too large for one cuBLAS call (int sizes)")
    return plan


def _element_strides(x):
    """x's strides in elements, or None where one is not a whole number of elements."""
    if any(s % x.itemsize for s in x.strides):
        return None
    return tuple(s // x.itemsize for s in x.strides)


def _in_place_or_copy(x, xp):
    """(x, its operand_layout), x copied to C order first where cuBLAS cannot read it where it lies."""
    strides = _element_strides(x)
    layout = None if strides is None else operand_layout(x.shape, strides)
    if layout is None:
        x = xp.ascontiguousarray(x)
        layout = operand_layout(x.shape, _element_strides(x))
    return x, layout


def _bfloat16_gemm(a, b, out_dtype):
    import cupy
    from cupy.cuda import cublas

    if a.dtype != BFLOAT16 or b.dtype != BFLOAT16:
        raise TypeError(f"a bfloat16 CuPy product needs both operands bfloat16; got {a.dtype} @ {b.dtype}")
    if out_dtype not in _CUDA_TYPES:
        raise TypeError(f"a bfloat16 CuPy product is written as bfloat16 or float32, not {out_dtype}")
    if b.ndim != 2 or a.ndim < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"expected a (..., k) @ b (k, n); got {a.shape} @ {b.shape}")
    k, n = b.shape
    lead = a.shape[:-1]
    m = math.prod(lead)
    a = a.reshape(m, k)  # the model's (B, N, C) activations: one (B*N, C) matrix (a view when contiguous)
    if m == 0 or n == 0 or k == 0:  # nothing for cuBLAS to do; an empty sum is 0
        return cupy.zeros(lead + (n,), out_dtype)
    a, layout_a = _in_place_or_copy(a, cupy)
    b, layout_b = _in_place_or_copy(b, cupy)
    transa, transb, gm, gn, gk, lda, ldb, ldc = gemm_plan(m, k, n, layout_a, layout_b)
    out = cupy.empty((m, n), out_dtype)
    # alpha and beta are read from host memory in cuBLAS's host pointer mode, which CuPy's handle is in except
    # inside its own calls that switch it; it is set (and restored) here rather than assumed.
    one, zero = np.ones((), np.float32), np.zeros((), np.float32)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)  # ordered with CuPy's own work on this stream
    mode = cublas.getPointerMode(handle)
    if mode != CUBLAS_POINTER_MODE_HOST:
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(
            handle, transa, transb, gm, gn, gk,
            one.ctypes.data, b.data.ptr, CUDA_R_16BF, lda,
            a.data.ptr, CUDA_R_16BF, ldb,
            zero.ctypes.data, out.data.ptr, _CUDA_TYPES[out_dtype], ldc,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
    finally:
        if mode != CUBLAS_POINTER_MODE_HOST:
            cublas.setPointerMode(handle, mode)
    return out.reshape(lead + (n,))
