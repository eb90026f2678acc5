"""The model's matrix products: ``matmul(a, b, out_dtype)`` is a (..., k) @ b (k, n), every product of model.py
goes through it.

On NumPy it is ``a @ b``. On CuPy every product goes to cuBLAS's gemmEx through cublas_ctypes.py, on a handle of
our own, for two reasons: CuPy's ``@`` has no bfloat16 (it takes ml_dtypes' bfloat16, type char 'E', for an integer
type and fails in its integer GEMM), and no CuPy product can be captured in a CUDA graph (CuPy's cuBLAS wrappers
refuse any call while the stream is capturing), which graph.py needs. Two operands of one dtype of ``GEMM_TYPES``:
float64 (accumulated in float64), float32, float16 or bfloat16 (accumulated in float32, CUBLAS_COMPUTE_32F: no
TF32; the half types on the tensor cores). cuBLAS writes the result in the operands' dtype or, for the half types,
in float32 where the caller wants the accumulator (weight gradients, logits) without a rounding in between; any
other ``out_dtype`` is a cast afterwards.

cuBLAS is column-major: the buffer of a row-major (r, c) matrix read column-major is its transpose, so the
row-major C = A @ B is computed as the column-major C^T = B^T A^T, B first. ``operand_layout``, ``gemm_plan`` and
``gemm_arguments`` hold that index logic as pure functions of shapes, strides and pointers
(tests/cpu/test_gpt_example.py replays them on NumPy); transposed views (``w.T``, ``flat_x.T``) and row slices
(``x[:, -1]``) go in without a copy.
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
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_GEMM_DEFAULT = -1
_INT32_MAX = 2**31 - 1  # gemmEx takes its sizes and leading dimensions as int

F64, F32, F16 = np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)
CUDA_TYPES = {F64: CUDA_R_64F, F32: CUDA_R_32F, F16: CUDA_R_16F, BFLOAT16: CUDA_R_16BF}
# the operands' dtype -> (the compute type, the dtype of alpha and beta, the dtypes cuBLAS writes the result in)
GEMM_TYPES = {
    F64: (CUBLAS_COMPUTE_64F, F64, (F64,)),
    F32: (CUBLAS_COMPUTE_32F, F32, (F32,)),
    F16: (CUBLAS_COMPUTE_32F, F32, (F16, F32)),
    BFLOAT16: (CUBLAS_COMPUTE_32F, F32, (BFLOAT16, F32)),
}
# alpha = 1 and beta = 0, read by cuBLAS from host memory: kept for the process, so their addresses stay valid
_SCALARS = {dtype: (np.ones((), dtype), np.zeros((), dtype)) for dtype in (F64, F32)}
for _scalar in (x for pair in _SCALARS.values() for x in pair):
    _scalar.flags.writeable = False


def matmul(a, b, out_dtype=None):
    """a (..., k) @ b (k, n) -> (..., n) in ``out_dtype`` (default a's dtype).

    NumPy: ``a @ b`` cast to ``out_dtype``. CuPy: cuBLAS (see the module's docstring), eagerly or under stream
    capture; a and b of one dtype of GEMM_TYPES.
    """
    out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
    if isinstance(a, np.ndarray):
        return (a @ b).astype(out_dtype, copy=False)
    return _cublas_gemm(a, b, out_dtype)


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


def gemm_arguments(a, layout_a, b, layout_b, out) -> tuple:
    """cublasGemmEx's arguments after the handle for ``out`` (m, n) = a (m, k) @ b (k, n): a and b where they lie,
    read as their ``operand_layout``s say, ``out`` in C order; the pointers are each array's first element's
    (``data.ptr`` of a CuPy array, ``ctypes.data`` of a NumPy one). cuBLAS's A is our b and its B our a."""
    (m, k), n = a.shape, b.shape[1]
    operand_type = CUDA_TYPES[a.dtype]
    compute, scalar, _ = GEMM_TYPES[a.dtype]
    one, zero = _SCALARS[scalar]
    transa, transb, gm, gn, gk, lda, ldb, ldc = gemm_plan(m, k, n, layout_a, layout_b)
    return (
        transa, transb, gm, gn, gk,
        one.ctypes.data, _pointer(b), operand_type, lda,
        _pointer(a), operand_type, ldb,
        zero.ctypes.data, _pointer(out), CUDA_TYPES[out.dtype], ldc,
        compute, CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


_B, _A, _OUT = 6, 9, 13  # where gemm_arguments puts b's, a's and out's pointers


def _pointer(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


# The products by layout: (a's shape and strides, b's, their dtype, out_dtype) -> (the output's shape, the dtype
# cuBLAS writes, gemm_arguments with null pointers), for the operands cuBLAS reads where they lie. A model's step
# makes the same few products every time: a later one only allocates its output and writes three pointers.
_PRODUCTS = {}
_MOST_PRODUCTS = 1024  # (sampling's growing windows add a layout per length; then the cache starts afresh)


def _cublas_gemm(a, b, out_dtype):
    import cublas_ctypes
    import cupy

    key = (a.shape, a.strides, b.shape, b.strides, a.dtype, b.dtype, out_dtype)
    product = _PRODUCTS.get(key)
    if product is None:
        product = _product(a, b, out_dtype)
        if product is None:
            return _general_gemm(a, b, out_dtype)
        if len(_PRODUCTS) >= _MOST_PRODUCTS:
            _PRODUCTS.clear()
        _PRODUCTS[key] = product
    shape, written, arguments = product
    out = cupy.empty(shape, written)
    arguments = arguments.copy()
    arguments[_B], arguments[_A], arguments[_OUT] = b.data.ptr, a.data.ptr, out.data.ptr
    cublas_ctypes.gemm_ex(*arguments)  # on the current stream
    return out if written == out_dtype else out.astype(out_dtype)


def _product(a, b, out_dtype):
    """_PRODUCTS's entry for a @ b, or None where the general path must take it: no elements, an operand to copy
    first, or an ``a`` whose (m, k) reshape would be a copy (the entry's pointer is a's own). Raises on operands
    that the general path refuses."""
    _check_operands(a, b)
    k, n = b.shape
    m = math.prod(a.shape[:-1])
    if m == 0 or n == 0 or k == 0 or not (a.ndim == 2 or a.flags.c_contiguous):
        return None
    flat = a.reshape(m, k)
    strides_a, strides_b = _element_strides(flat), _element_strides(b)
    if strides_a is None or strides_b is None:
        return None
    layout_a, layout_b = operand_layout(flat.shape, strides_a), operand_layout(b.shape, strides_b)
    if layout_a is None or layout_b is None:
        return None
    written = _written(a.dtype, out_dtype)
    out = np.empty(0, written)  # (a stand-in: gemm_arguments reads its dtype; the pointers are written per call)
    arguments = list(gemm_arguments(flat, layout_a, b, layout_b, out))
    arguments[_B] = arguments[_A] = arguments[_OUT] = 0
    return a.shape[:-1] + (n,), written, arguments


def _written(dtype, out_dtype):
    """The dtype cuBLAS writes a product of ``dtype`` operands in: out_dtype where it can, else the operands'."""
    return out_dtype if out_dtype in GEMM_TYPES[dtype][2] else dtype


def _check_operands(a, b) -> None:
    if a.dtype != b.dtype or a.dtype not in GEMM_TYPES:
        names = ", ".join(str(t) for t in GEMM_TYPES)
        raise TypeError(f"a CuPy product takes two operands of one dtype of {names}; got {a.dtype} @ {b.dtype}")
    if b.ndim != 2 or a.ndim < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"expected a (..., k) @ b (k, n); got {a.shape} @ {b.shape}")


def _general_gemm(a, b, out_dtype):
    """_cublas_gemm for any operands: empty ones, and those copied to C order first."""
    import cublas_ctypes
    import cupy

    written = _written(a.dtype, out_dtype)  # another out_dtype: cast afterwards
    k, n = b.shape
    lead = a.shape[:-1]
    m = math.prod(lead)
    a = a.reshape(m, k)  # the model's (B, N, C) activations: one (B*N, C) matrix (a view when contiguous)
    if m == 0 or n == 0 or k == 0:  # nothing for cuBLAS to do; an empty sum is 0
        return cupy.zeros(lead + (n,), out_dtype)
    a, layout_a = _in_place_or_copy(a, cupy)
    b, layout_b = _in_place_or_copy(b, cupy)
    out = cupy.empty((m, n), written)
    cublas_ctypes.gemm_ex(*gemm_arguments(a, layout_a, b, layout_b, out))  # on the current stream
    return out.reshape(lead + (n,)).astype(out_dtype, copy=False)
