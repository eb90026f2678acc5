"""Argument checks shared by the public functions, the CPU path and the reference: array types and
devices, dtypes, shapes, head dims, ``causal`` and ``scale``. Every message names the argument and the
value it got.
"""

from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

from cupyflash._arrays import cupy, is_cupy, lse_dtype

MAX_HEAD_DIM = 256  # the widest head dim D (and Dv) the kernels take
MAX_SPLITS = 128  # the most parts attention_with_kvcache splits a sequence's keys into (cuda_src/kvcache.cuh)
SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))


def check_array(name, x):
    """x must be a numpy.ndarray or a cupy.ndarray in the machine's byte order. NumPy's masked arrays and matrices
    are refused by name (a mask would be ignored; a matrix's operators are not an array's); other subclasses of
    numpy.ndarray are taken as the arrays they are."""
    if is_cupy(x):
        return
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy.ndarray or a cupy.ndarray, got {type(x).__module__}.{type(x).__qualname__}"
        )
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a numpy.ma.MaskedArray, whose mask cupyflash would ignore; pass "
            f"{name}.filled(value), or numpy.asarray({name}) for its data as it is"
        )
    if isinstance(x, np.matrix):
        raise TypeError(f"{name} is a numpy.matrix; pass numpy.asarray({name}), a numpy.ndarray")
    if not x.dtype.isnative:
        raise TypeError(
            f"{name} has dtype {x.dtype.str}, not in this machine's byte order; pass "
            f"{name}.astype({name}.dtype.newbyteorder('='))"
        )


INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def is_sequence(x) -> bool:
    """Whether an index argument was given as a Python sequence (a list or a tuple) rather than an array."""
    return isinstance(x, (list, tuple))


def index_array(name, x, xp, expected="an int32 or int64 array or a sequence of ints"):
    """An integer index argument (cache_seqlens, block_table, cu_seqlens_q, cu_seqlens_k), by one rule: an int32
    or int64 array of the inputs' array module ``xp`` (check_array_types checks the module with the others), or a
    rectangular sequence (lists or tuples, nested for 2-D) of ints, which becomes an int64 array of ``xp``.
    Returns (the array, its values on the host or None): a NumPy array's and a sequence's values are there
    without a device-to-host copy, so the callers check them at no cost."""
    if is_sequence(x):
        try:
            host = np.array(x)
        except ValueError:
            raise ValueError(
                f"{name} is a ragged sequence; expected a rectangular sequence of ints or an int32 or int64 array"
            ) from None
        if host.size == 0 and host.dtype.kind == "f":
            host = host.astype(np.int64)  # (an empty list is float64 to NumPy)
        if host.dtype.kind not in "iu" or (host.dtype == np.uint64 and host.size and host.max() > 2**63 - 1):
            raise TypeError(f"{name} must hold integers; got a sequence that NumPy reads as {host.dtype}")
        host = host.astype(np.int64)
        return (host if xp is np else cupy.asarray(host)), host
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{name} must be {expected}, got {type(x).__module__}.{type(x).__qualname__}")
    if check_array_types({name: x}) is not xp:
        raise TypeError(
            f"cannot mix NumPy and CuPy arrays: {name} is {'cupy' if is_cupy(x) else 'numpy'} but the "
            f"inputs are {xp.__name__}; pass {name} as the inputs' array type, or as a sequence of ints"
        )
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be {expected}, got dtype {x.dtype}")
    return x, (x if isinstance(x, np.ndarray) else None)


def int32_indices(xp, x):
    """x (int32 or int64) as the contiguous int32 array the kernels read. int64 values past int32's range are
    clipped, not wrapped, so that an invalid index stays invalid (the kernels and checks then say so)."""
    if x.dtype != np.int32:
        x = xp.clip(x, -(2**31), 2**31 - 1)
    return xp.ascontiguousarray(x, dtype=np.int32)


def check_array_types(arrays):
    """All arrays must be NumPy, or all CuPy on the current device (check_array each). Returns numpy or cupy."""
    for name, x in arrays.items():
        check_array(name, x)
    kinds = {name: "cupy" if is_cupy(x) else "numpy" for name, x in arrays.items()}
    if len(set(kinds.values())) > 1:
        listing = ", ".join(f"{name} is {kind}" for name, kind in kinds.items())
        raise TypeError(f"cannot mix NumPy and CuPy arrays ({listing}); convert them to one type")
    if "cupy" not in kinds.values():
        return np
    current = cupy.cuda.Device().id
    for name, x in arrays.items():
        if x.device.id != current:
            raise ValueError(
                f"{name} is on device {x.device.id} but the current device is {current}; "
                f"move it there or run under `with cupy.cuda.Device({x.device.id}):`"
            )
    return cupy


def check_float_array(name, x, dtypes, expected, dims):
    """One array argument of a helper (quantize_fp8, hadamard_rotate): NumPy or CuPy, a dtype among ``dtypes``
    (``expected`` names them), and at least the trailing ``dims`` (e.g. "(..., N, D)")."""
    check_array(name, x)
    if x.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {x.dtype}; expected {expected}")
    min_ndim = dims.count(",")
    if x.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dim{'s' if min_ndim > 1 else ''} {dims}, got shape {x.shape}"
        )


def check_dtypes(arrays):
    """Every array but lse one shared supported dtype, which is returned; lse ``lse_dtype`` of it."""
    named = [(name, x.dtype) for name, x in arrays.items() if name != "lse"]
    for name, dtype in named:
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {dtype}; expected float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64"
            )
    first_name, first_dtype = named[0]
    for name, dtype in named[1:]:
        if dtype != first_dtype:
            names = ", ".join(n for n, _ in named)
            hint = ""
            if name == "out" and dtype == lse_dtype(first_dtype):  # an unrounded out (attention_forward(out_dtype=))
                hint = f" (an unrounded out goes back rounded: out.astype({first_name}.dtype))"
            raise TypeError(
                f"{first_name} has dtype {first_dtype} but {name} has dtype {dtype}; {names} must share one dtype"
                + hint
            )
    if "lse" in arrays and arrays["lse"].dtype != lse_dtype(first_dtype):
        raise TypeError(
            f"lse must be {lse_dtype(first_dtype)} for {first_dtype} inputs (as attention_forward returns it), "
            f"got {arrays['lse'].dtype}"
        )
    return first_dtype


def check_shapes(q, k, v):
    """q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv); returns the broadcast leading shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, D), got shape {x.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim D (last dim), got q {q.shape} and k {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys Nk (dim -2), got k {k.shape} and v {v.shape}")
    if q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        return q.shape[:-2]  # the common case, without np.broadcast_shapes' cost
    try:
        return tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except ValueError:
        raise ValueError(
            f"the leading (batch) dims of q {q.shape}, k {k.shape} and v {v.shape} do not broadcast "
            "together (NumPy rules, last two dims excluded)"
        ) from None


def check_head_dims(q, v):
    """The kernels take head dims D (of q and k) and Dv (of v) from 1 to MAX_HEAD_DIM."""
    for what, dim in (("D (q.shape[-1])", q.shape[-1]), ("Dv (v.shape[-1])", v.shape[-1])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {what} is {dim}; supported head dims are 1 to {MAX_HEAD_DIM}")


def check_forward_outputs(arrays, batch):
    """dout and out must be (*batch, Nq, Dv) and lse (*batch, Nq), exactly as the forward returns them."""
    nq, dv = arrays["q"].shape[-2], arrays["v"].shape[-1]
    expected = dict(dout=batch + (nq, dv), out=batch + (nq, dv), lse=batch + (nq,))
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(
                f"{name} has shape {arrays[name].shape}; expected {shape}, the shape of the "
                f"{'lse' if name == 'lse' else 'out'} that attention_forward returns for these q, k, v"
            )


def resolve_results_dtype(name, value, dtype):
    """``out_dtype`` or ``grad_dtype`` (``name``) of a call on inputs of ``dtype``: None where the results come in
    the inputs' dtype (None given, or that dtype), else the accumulator's dtype (float32; float64 for float64
    inputs), in which the results come unrounded."""
    if value is None:
        return None
    accumulator = lse_dtype(dtype)
    try:
        given = np.dtype(value)
    except (TypeError, ValueError):
        given = None
    if given is not None and given == dtype:  # (a dtype equals None: NumPy reads None as float64)
        return None
    if given is not None and given == accumulator:
        return accumulator
    if accumulator == dtype:
        expected = f"None or {dtype.name} (the inputs' dtype, which is the accumulator's)"
    else:
        expected = f"None, {dtype.name} (the inputs' dtype) or {accumulator.name} (the accumulator's: unrounded)"
    raise ValueError(f"{name} for {dtype.name} inputs must be {expected}, got {value!r}")


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_causal(causal):
    return check_bool("causal", causal)


def resolve_scale(scale, head_dim):
    """Default ``1 / sqrt(head_dim)``; otherwise a finite positive real number, returned as a float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r} ({type(scale).__name__})")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    return float(scale)
