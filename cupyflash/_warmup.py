"""``cupyflash.warmup``: compile and load kernel variants before the first call, so that services start hot.

A kernel variant (direction, dtype, HEAD_DIM, plain / causal / score modifiers) is compiled by NVRTC the
first time a call needs it on a device, about a second each. ``warmup`` describes the calls it stands for
as ``Features`` and asks ``tile_policy.dense`` for their variants, the very ones the API would pick (same dtype
table, same head-dim rounding), then loads them through the API's own loader. CuPy keeps each compiled
module on disk (``CUPY_CACHE_DIR``), so a later process only loads it, in milliseconds.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Iterable
from typing import Union

import numpy as np

from cupyflash._arrays import cupy
from cupyflash._checks import MAX_HEAD_DIM, check_bool
from cupyflash._cuda import compile as _compile
from cupyflash._cuda import decode_tiles, tile_policy, tiles
from cupyflash._cuda.tiles import HEAD_DIMS
from cupyflash._cuda.variants import DTYPES, Features, row_width

DTypeLike = Union[str, np.dtype, type]
# The benchmark's short names, accepted next to everything numpy.dtype understands ("float16", "half",
# numpy.float16, ml_dtypes.bfloat16, ...).
_DTYPE_ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}
# The calls ``modifiers=True`` stands for, as the option sets that pick distinct kernels: the scalars (a window
# without a right edge and ALiBi, so that causal and not pick ALiBi's two forms), a window alone, a softcap
# alone (its own backward on Hopper; bfloat16's bounded forward), the per-element arrays, and a block mask with
# no other array (alone, with a softcap, with ALiBi: the warp-specialized forward's block-mask forms).
_MODIFIER_CALLS = (
    dict(window=(1, -1), alibi=True),
    dict(window=(1, -1)),
    dict(softcap=1.0),
    dict(arrays=True),
    dict(block_mask=True),
    dict(block_mask=True, window=(1, -1), alibi=True),
    dict(block_mask=True, softcap=1.0),
)


def warmup(
    dtypes: DTypeLike | Iterable[DTypeLike] = DTYPES,
    head_dims: int | Iterable[int] | None = None,
    causal: bool | Iterable[bool] = (False, True),
    modifiers: bool = False,
    backward: bool = True,
    dropout: bool = False,
    decode: bool = False,
    verbose: bool = False,
) -> list:
    """Compile and load, on the current device, the kernels that later calls will need.

    Every combination of the arguments is warmed: the forward kernels of
    ``attention``/``attention_forward`` and, with ``backward``, those of ``attention_backward``. A
    variant compiled before (in any process sharing CuPy's cache directory, ``CUPY_CACHE_DIR``) is
    only loaded, in milliseconds; an uncached one takes NVRTC about a second.

    Parameters
    ----------
    dtypes : dtype or name, or a sequence of them, optional
        Among float16, bfloat16, float32 and float64 (default: all four): ``numpy.float16``,
        ``ml_dtypes.bfloat16``, a ``numpy.dtype``, or names such as ``"bfloat16"`` (``"fp16"``, ``"bf16"``,
        ``"fp32"``, ``"fp64"`` too).
    head_dims : int or sequence of ints, optional
        Head dims from 1 to 256, as the calls will pass them (``max(D, Dv)`` when they differ);
        each is rounded up to the kernel head dims the API would pick (80 warms the HEAD_DIM 96 kernels,
        and on Hopper at 16 bits the forward and the fused backward at HEAD_DIM 128).
        Default: every kernel head dim (16, 32, 64, 96, 128, 160, 192, 256).
    causal : bool or sequence of bools, optional
        The masks to warm; default both.
    modifiers : bool, optional
        Also warm the score modifiers' kernels: those of ``window``, ``softcap`` and ``alibi_slopes``
        (and on Hopper the 16-bit ones for a window alone and for a softcap alone's backward, and the
        bfloat16 forward for a softcap without ALiBi), and those that also take ``bias``, ``mask`` or
        ``block_mask`` (each serves causal and not; on Hopper the 16-bit forwards of a ``block_mask``
        without ``bias`` or ``mask``, alone, with a softcap or with ALiBi, which walk it on the
        warp-specialized kernel). ``attention_probs`` always compiles its own kernel on
        first use.
    backward : bool, optional
        Also warm the backward's kernels (default True): on Hopper, for 16-bit head dims 33-128 and
        161-256, both the two-pass backward and the fused one that long sequences take (in order: the
        form ``attention_backward(deterministic=False)`` takes compiles at its first call); and for 16-bit
        head dims 33-64, 97-128 and 161-256 the same kernels writing float32 gradients, which calls with k
        and v broadcast over query heads (GQA, MQA) take so that their sums are rounded once.
    dropout : bool, optional
        Also warm the kernels that apply dropout (calls with ``dropout_p > 0``), for every
        combination above.
    decode : bool, optional
        Also warm the kernels of ``attention_with_kvcache`` for these dtypes and head dims (``max(D,
        Dv)``): the tiles of a decode step and of more than 16 query rows per key/value head, and the one
        for paged caches whose pages do not hold whole tiles. Every option of that function (masks,
        softcap, ALiBi, rotary) runs in the same kernels.
    verbose : bool, optional
        Print one line per variant: what it is, the seconds it took, and whether it was
        ``compiled``, read from the ``disk cache`` or ``already loaded`` in this process (told
        apart by new files in ``CUPY_CACHE_DIR``; best effort).

    Returns
    -------
    variants : list of cupyflash._cuda.variants.Variant
        The distinct variants warmed, in order; each is now loaded on the current device.

    Raises
    ------
    TypeError, ValueError
        For an argument outside the values above (the message names it).
    RuntimeError
        When CUDA reports no usable device (NumPy inputs run on the CPU and need no warmup),
        or the device is older than compute capability 8.0.

    Examples
    --------
    At service start, for the shapes the service will see (here bfloat16, D = 128, causal):

    >>> import cupyflash
    >>> warmed = cupyflash.warmup(dtypes="bfloat16", head_dims=128, causal=True, verbose=True)  # doctest: +SKIP
    warmup 1/5: fwd bfloat16 HEAD_DIM=128 causal (ws)  0.60 s (compiled)
    warmup 2/5: bwd bfloat16 HEAD_DIM=128 causal (wgmma)  1.30 s (compiled)
    warmup 3/5: bwd bfloat16 -> float32 HEAD_DIM=128 causal (wgmma)  ... s (compiled)
    warmup 4/5: bwd bfloat16 HEAD_DIM=128 causal (ws)  0.90 s (compiled)
    warmup 5/5: bwd bfloat16 -> float32 HEAD_DIM=128 causal (ws)  ... s (compiled)

    Run under ``with cupy.cuda.Device(i):`` to warm device ``i``.
    """
    variants = select_variants(dtypes, head_dims, causal, modifiers, backward, dropout, decode=decode)
    device_id = _current_device_id()
    for i, variant in enumerate(variants, 1):
        status, seconds = _load(device_id, variant)
        if verbose:
            print(f"warmup {i}/{len(variants)}: {variant}  {seconds:.2f} s ({status})", flush=True)
    return variants


def select_variants(dtypes, head_dims, causal, modifiers, backward, dropout=False, device=None, decode=False) -> list:
    """The distinct variants ``warmup`` loads for these arguments (validated) on ``device`` (its abilities:
    a cupyflash._cuda.variants.Device; default the current device's, none without a GPU)."""
    dtypes = [_check_dtype(x) for x in _as_list("dtypes", dtypes)]
    dims = HEAD_DIMS if head_dims is None else [_check_head_dim(d) for d in _as_list("head_dims", head_dims)]
    causals = [check_bool("causal", c) for c in _as_list("causal", causal)]
    directions = ("fwd", "bwd") if check_bool("backward", backward) else ("fwd",)
    calls = ({},) + (_MODIFIER_CALLS if check_bool("modifiers", modifiers) else ())
    drops = (False, True) if check_bool("dropout", dropout) else (False,)
    device = _compile.current_device() if device is None else device
    variants = []
    for dtype in dtypes:
        for d in dims:
            width = row_width(d, dtype.name)
            for options in calls:
                for drop in drops:
                    for is_causal in causals:
                        for direction in directions:
                            features = Features(direction, dtype.name, width, is_causal, dropout=drop, **options)
                            forms = [features]
                            if direction == "bwd":  # long sequences' backward (the fused one, where it serves)
                                longest = (tiles.CHAIN_ROWS, tiles.CHAIN_ROWS)
                                forms.append(dataclasses.replace(features, lengths=longest))
                            for f in forms:
                                variants.append(tile_policy.dense(f, device))
                                # k, v broadcast over heads (GQA): gradients unrounded until summed, where alike
                                variants.append(tile_policy.unrounded_alike(f, device))
    if check_bool("decode", decode):
        variants += [v for dtype in dtypes for d in dims for v in decode_tiles.variants_for_call(dtype.name, d)]
    return list(dict.fromkeys(v for v in variants if v is not None))  # distinct, in order (causal may share one)


# ---------------------------------------------------------------------------------------------------------
# Loading


def _current_device_id() -> int:
    """The current CUDA device, or a RuntimeError that says why there is none."""
    if cupy is None:
        raise RuntimeError(
            "cupyflash.warmup needs a CUDA device, but CuPy is not installed (install the cuda12 "
            "or cuda13 extra); NumPy inputs run on the CPU and need no warmup"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, a driver too old for the runtime, no runtime library
        raise RuntimeError(
            f"cupyflash.warmup needs a CUDA device, but CUDA reports none usable "
            f"({type(exc).__name__}: {exc}); NumPy inputs run on the CPU and need no warmup"
        ) from exc
    if count < 1:
        raise RuntimeError("cupyflash.warmup needs a CUDA device, but the CUDA driver reports none")
    return cupy.cuda.Device().id


def _load(device_id: int, variant) -> tuple[str, float]:
    """Load one variant through the API's own loader; returns (how it was obtained, seconds)."""
    if (device_id, variant) in _compile.modules:
        return "already loaded", 0.0
    before = _cache_entries()
    t0 = time.perf_counter()
    _compile.functions(variant)
    seconds = time.perf_counter() - t0
    after = _cache_entries()
    # CuPy writes a cache file only when it compiled; with CUPY_CACHE_IN_MEMORY it always compiles.
    compiled = before is None or after != before
    return ("compiled" if compiled else "disk cache"), seconds


def _cache_entries() -> int | None:
    """Files in CuPy's kernel cache directory; None when CuPy caches in memory only."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0").strip().lower() not in ("", "0", "false", "no"):
        return None
    try:
        return len(os.listdir(_compile.cache_dir()))
    except OSError:  # not created yet: CuPy makes it on first use
        return 0


# ---------------------------------------------------------------------------------------------------------
# Argument checks


def _as_list(name: str, value) -> list:
    """A single value or an iterable of them, as a non-empty list (a string is one value)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [value]
    values = list(value)
    if not values:
        raise ValueError(f"{name} must hold at least one value, got {value!r}")
    return values


def _check_dtype(x) -> np.dtype:
    expected = f"expected one of {', '.join(DTYPES)} (a dtype or its name)"
    if x is None:  # numpy.dtype(None) would be float64
        raise TypeError(f"dtypes: None is not a dtype; {expected}")
    try:
        dtype = np.dtype(_DTYPE_ALIASES.get(x, x) if isinstance(x, str) else x)
    except TypeError:
        raise ValueError(f"dtypes: unknown dtype {x!r}; {expected}") from None
    if dtype.name not in DTYPES:
        raise ValueError(f"dtypes: {dtype.name} is not supported by the kernels; {expected}")
    return dtype


def _check_head_dim(d) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, numbers.Integral):
        raise TypeError(f"head_dims must be ints, got {d!r} ({type(d).__name__})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dims: {d} is out of range; head dims run from 1 to {MAX_HEAD_DIM}")
    return int(d)
