"""The FP8 attention forward behind ``attention`` and ``attention_forward`` when q, k, v are FP8Tensors:
validation, empty problems, the broadcast of the leading dims, and the hand-off to a back end:

    numpy -> cupyflash._fp8.cpu   (the naive implementation, row block by row block, float64)
    cupy  -> cupyflash._cuda.fp8  (the Hopper kernel: FP8 wgmma; compute capability 9.0)

Forward only: there is no FP8 backward (as in FlashAttention-3).
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

from cupyflash._arrays import cupy
from cupyflash._checks import check_array_types, check_causal, check_head_dims, check_shapes, resolve_scale
from cupyflash._cuda import plans
from cupyflash._fp8 import cpu as _fp8_cpu
from cupyflash._fp8.tensor import FP8Tensor

OUT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
FP8_COMPUTE_CAPABILITY = 90  # the kernel is sm_90a's: FP8 wgmma and TMA, which run on compute capability 9.0 only


def check_all_fp8(arrays: dict) -> None:
    """The named arrays must all be FP8Tensors (once one of them is)."""
    held = [name for name, x in arrays.items() if isinstance(x, FP8Tensor)]
    if len(held) < len(arrays):
        plain = [name for name in arrays if name not in held]
        raise TypeError(
            f"{', '.join(held)} {'is an FP8Tensor' if len(held) == 1 else 'are FP8Tensors'} but "
            f"{', '.join(plain)} {'is' if len(plain) == 1 else 'are'} not; pass all of "
            f"{', '.join(arrays)} as FP8Tensors (quantize_fp8) or none"
        )


UNSUPPORTED = ("window", "softcap", "alibi_slopes", "bias", "mask", "block_mask", "dropout_p")


def attention_forward(q, k, v, *, causal, scale, out_dtype, unsupported):
    """out (..., Nq, Dv) ``out_dtype`` (default bfloat16) and lse (..., Nq) float32 of FP8Tensors q, k, v.

    ``unsupported``: whether each option of UNSUPPORTED (those FP8 does not take) was given, in its order. A
    GPU call whose layout was checked before goes straight to its plan (the plan cache's call entry under
    ``call_key``).
    """
    fast = None if any(unsupported) else call_key(q, k, v, causal, scale, out_dtype)
    if fast is not None:
        outputs = _gpu().forward_fast(fast, q, k, v)
        if outputs is not None:
            return outputs
    check_all_fp8(dict(q=q, k=k, v=v))
    for name, given in zip(UNSUPPORTED, unsupported):
        if given:
            raise ValueError(f"{name} is not supported with FP8 inputs")
    xp = check_array_types(dict(q=q.data, k=k.data, v=v.data))
    batch = check_shapes(q, k, v)
    check_head_dims(q, v)
    causal = check_causal(causal)
    scale = resolve_scale(scale, q.shape[-1])
    out_dtype = resolve_out_dtype(out_dtype)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    if math.prod(batch) == 0 or nq == 0 or nk == 0:
        return xp.zeros(batch + (nq, dv), dtype=out_dtype), xp.full(batch + (nq,), -np.inf, dtype=np.float32)
    if xp is np:
        q, k, v = (x.broadcast_to(batch) for x in (q, k, v))
        return _fp8_cpu.attention_forward_fp8(q, k, v, scale=scale, causal=causal, out_dtype=out_dtype)
    check_compute_capability(cupy.cuda.Device().compute_capability)
    # The holders themselves, not broadcast copies: the GPU path keeps what it derives from each with it.
    return _gpu().attention_forward_fp8(q, k, v, batch, scale=scale, causal=causal, out_dtype=out_dtype, fast_key=fast)


def call_key(q, k, v, causal, scale, out_dtype) -> tuple | None:
    """The plan cache's call key of an FP8 forward (q, k, v FP8Tensors; cupyflash/_cuda/plans.py): the options
    by value and type, then each holder's layout (holder_layout, kept with the holder: its arrays never
    change); None where the call cannot take the fast path (NumPy holders, or anything not an FP8Tensor)."""
    if cupy is None:
        return None
    try:
        layouts = (q._kept["layout"], k._kept["layout"], v._kept["layout"])
    except (KeyError, AttributeError):  # a holder's first call, or not a holder (its own check then says so)
        if not all(type(x) is FP8Tensor for x in (q, k, v)):
            return None
        layouts = tuple(x.kept("layout", lambda x=x: holder_layout(x)) for x in (q, k, v))
    if None in layouts:  # (the layouts are tuples: none of them equals None)
        return None
    return plans.key("call", "fp8", (), (causal, scale, out_dtype)) + layouts


def holder_layout(x) -> tuple | None:
    """What the FP8 plan depends on of holder x: its data's and its scale's parts of a key (plans.array_key)
    and its block; None where data or scale is not a CuPy array."""
    parts = (plans.array_key(x.data), plans.array_key(x.scale))
    return None if None in parts else parts + (x.block,)


@functools.cache
def _gpu():
    """cupyflash._cuda.fp8, loaded when an FP8 forward first runs on a GPU (and then found in one call)."""
    from cupyflash._cuda import fp8

    return fp8


def resolve_out_dtype(out_dtype) -> np.dtype:
    """None -> bfloat16; otherwise bfloat16 or float16, as a numpy dtype."""
    if out_dtype is None:
        return OUT_DTYPES[0]
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        dtype = None
    if dtype not in OUT_DTYPES:
        raise ValueError(
            f"out_dtype must be bfloat16 (ml_dtypes.bfloat16, the default) or float16 for FP8 inputs, got {out_dtype!r}"
        )
    return dtype


def check_compute_capability(compute_capability: str) -> None:
    """CuPy's ``Device.compute_capability`` (e.g. ``"90"``) must be 9.0: the kernel is built for sm_90a (Hopper's
    FP8 wgmma and TMA), whose code runs on no other architecture."""
    cc = int(compute_capability)
    if cc != FP8_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"FP8 attention needs a Hopper GPU (compute capability 9.0, FP8 wgmma); this device is {cc // 10}.{cc % 10}"
        )
