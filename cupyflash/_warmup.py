"""``cupyflash.warmup``: compile and load kernel variants before the first call, so that services start hot.

A kernel variant (direction, dtype, HEAD_DIM, plain / causal / score modifiers) is compiled by NVRTC the
first time a call needs it on a device, about a second each. ``warmup`` asks ``_kernels._functions`` for
the very variants the API would pick (same dtype table, same head-dim rounding), so the calls that follow
find them loaded. CuPy keeps each compiled module on disk (``CUPY_CACHE_DIR``), so a later process only
loads it, in milliseconds.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Iterable
from typing import Union

import numpy as np

from cupyflash import _config
from cupyflash._modifiers import Modifiers

# cupyflash._kernels is imported inside the functions, as _api does: importing cupyflash (and running
# NumPy inputs) must not load the GPU side.

DTypeLike = Union[str, np.dtype, type]
# The benchmark's short names, accepted next to everything numpy.dtype understands ("float16", "half",
# numpy.float16, ml_dtypes.bfloat16, ...).
_DTYPE_ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")  # the kernels' dtypes: the keys of _kernels._CTYPES
ROW_ALIGN_BYTES = 16  # the API pads head dims to 16-byte rows before picking a HEAD_DIM (cp.async width)
# Stand-ins for resolved modifiers: _kernels._variant asks whether any is on, whether a per-element array is
# among them (the instantiation with the arrays) or not (the scalars one: window, softcap, ALiBi), and for
# the scalars whether a softcap of at most BOUNDED_SOFTCAP_MAX comes without ALiBi (bfloat16 on Hopper: the
# bounded forward), whether it comes alone (16-bit on Hopper: the Mods::softcap backward), whether a window
# comes alone (16-bit on Hopper: Mods::window), and with ALiBi whether the window, causal folded in, has a
# right edge (Variant.half_first). Each is a Modifiers whose arrays are stood in for by True (only tested
# against None). The scalars' stand-in has a window without a right edge and ALiBi, so it takes the scalars'
# kernels themselves, and both ALiBi forms where causal is warmed and not. A block mask with no other array
# takes, in the 16-bit forward on Hopper, the warp-specialized kernel's block-mask forms (Variant.block_mask):
# alone, with a softcap (bounded in bfloat16) and with ALiBi, each stood in for below.
_SCALAR_MODIFIERS = Modifiers(window=(1, -1), softcap=0.0, alibi_slopes=True, bias=None, bias_shape=None, mask=None,
                              block_mask=None)
_WINDOW_MODIFIERS = Modifiers(window=(1, -1), softcap=0.0, alibi_slopes=None, bias=None, bias_shape=None, mask=None,
                              block_mask=None)
_SOFTCAP_MODIFIERS = Modifiers(window=(-1, -1), softcap=1.0, alibi_slopes=None, bias=None, bias_shape=None,
                               mask=None, block_mask=None)
_ARRAY_MODIFIERS = Modifiers(window=(-1, -1), softcap=0.0, alibi_slopes=None, bias=True, bias_shape=None, mask=None,
                             block_mask=None)
_BLOCK_MASK_MODIFIERS = (
    Modifiers(window=(-1, -1), softcap=0.0, alibi_slopes=None, bias=None, bias_shape=None, mask=None, block_mask=True),
    *(dataclasses.replace(mods, block_mask=True) for mods in (_SCALAR_MODIFIERS, _SOFTCAP_MODIFIERS)))
_SOME_DROPOUT = object()  # likewise for dropout
_DEFAULT_CACHE_DIR = os.path.join("~", ".cupy", "kernel_cache")  # CuPy's default for CUPY_CACHE_DIR


def warmup(dtypes: DTypeLike | Iterable[DTypeLike] = DTYPE_NAMES,
           head_dims: int | Iterable[int] | None = None, causal: bool | Iterable[bool] = (False, True),
           modifiers: bool = False, backward: bool = True, dropout: bool = False, verbose: bool = False) -> list:
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
        each is rounded up to the kernel head dim the API would pick (80 warms the HEAD_DIM 96 kernels).
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
        Also warm the backward's kernels (default True).
    dropout : bool, optional
        Also warm the kernels that apply dropout (calls with ``dropout_p > 0``), for every
        combination above.
    verbose : bool, optional
        Print one line per variant: what it is, the seconds it took, and whether it was
        ``compiled``, read from the ``disk cache`` or ``already loaded`` in this process (told
        apart by new files in ``CUPY_CACHE_DIR``; best effort).

    Returns
    -------
    variants : list of cupyflash._kernels.Variant
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
    warmup 1/2: fwd bfloat16 HEAD_DIM=128 causal  0.60 s (compiled)
    warmup 2/2: bwd bfloat16 HEAD_DIM=128 causal  1.30 s (compiled)

    Run under ``with cupy.cuda.Device(i):`` to warm device ``i``.
    """
    variants = select_variants(dtypes, head_dims, causal, modifiers, backward, dropout)
    device_id = _current_device_id()
    for i, variant in enumerate(variants, 1):
        status, seconds = _load(device_id, variant)
        if verbose:
            print(f"warmup {i}/{len(variants)}: {describe(variant)}  {seconds:.2f} s ({status})", flush=True)
    return variants


def select_variants(dtypes, head_dims, causal, modifiers, backward, dropout=False) -> list:
    """The distinct variants ``warmup`` loads for these arguments (validated), without a GPU."""
    from cupyflash import _kernels

    dtypes = [_check_dtype(x) for x in _as_list("dtypes", dtypes)]
    dims = _config.HEAD_DIMS if head_dims is None else [_check_head_dim(d) for d in _as_list("head_dims", head_dims)]
    causals = [_check_bool("causal", c) for c in _as_list("causal", causal)]
    directions = ("fwd", "bwd") if _check_bool("backward", backward) else ("fwd",)
    mods_options = ((None, _SCALAR_MODIFIERS, _WINDOW_MODIFIERS, _SOFTCAP_MODIFIERS, _ARRAY_MODIFIERS,
                     *_BLOCK_MASK_MODIFIERS)
                    if _check_bool("modifiers", modifiers)
                    else (None,))
    dropout_options = (None, _SOME_DROPOUT) if _check_bool("dropout", dropout) else (None,)
    variants = []
    for dtype in dtypes:
        for d in dims:
            width = _kernels._round_up(d, ROW_ALIGN_BYTES // dtype.itemsize)
            for mods in mods_options:
                for drop in dropout_options:
                    for is_causal in causals:
                        for direction in directions:
                            variants.append(_kernels._variant(direction, dtype, width, width, is_causal, mods, drop))
    return list(dict.fromkeys(variants))  # distinct, in order: with modifiers, causal shares one variant


def describe(variant) -> str:
    """A variant in words, e.g. ``fwd bfloat16 HEAD_DIM=128 causal``."""
    from cupyflash import _kernels

    dtype = {ctype: name for name, ctype in _kernels._CTYPES.items()}[variant.ctype]
    kind = ("modifiers (softcap without ALiBi)" if variant.bounded else
            f"modifiers (softcap alone{', causal' if variant.causal else ''})" if variant.softcap_alone else
            "modifiers (window alone)" if variant.window_alone else
            "modifiers (window, softcap, ALiBi)" if variant.scalar_mods else "modifiers") if variant.mods else (
            "causal" if variant.causal else "plain")
    kind += (" (warp-specialized" + ("; ALiBi, the window with a right edge" if variant.half_first else "")
             + ("; block mask" if variant.block_mask else "") + ")" if variant.warp_specialized else "")
    return (f"{variant.direction} {dtype} HEAD_DIM={variant.head_dim} {kind}" + (" dropout" if variant.dropout else "")
            + (" (wgmma)" if variant.wgmma else "") + (" (large shared memory)" if variant.large_smem else ""))


# ---------------------------------------------------------------------------------------------------------
# Loading


def _current_device_id() -> int:
    """The current CUDA device, or a RuntimeError that says why there is none."""
    import cupy

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
    from cupyflash import _kernels

    if (device_id, variant) in _kernels._modules:
        return "already loaded", 0.0
    before = _cache_entries()
    t0 = time.perf_counter()
    _kernels._functions(variant)
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
        return len(os.listdir(_cache_dir()))
    except OSError:  # not created yet: CuPy makes it on first use
        return 0


def _cache_dir() -> str:
    """The directory CuPy writes compiled kernels to. CuPy 14 reads CUPY_CACHE_DIR once, when its
    compiler module is imported, into its cache backend: ask that first, then the variable."""
    from cupy.cuda import compiler

    backend_dir = getattr(getattr(compiler, "_kernel_cache_backend", None), "_cache_dir", None)
    if isinstance(backend_dir, str):
        return backend_dir
    return os.path.expanduser(os.environ.get("CUPY_CACHE_DIR", _DEFAULT_CACHE_DIR))


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
    expected = f"expected one of {', '.join(DTYPE_NAMES)} (a dtype or its name)"
    if x is None:  # numpy.dtype(None) would be float64
        raise TypeError(f"dtypes: None is not a dtype; {expected}")
    try:
        dtype = np.dtype(_DTYPE_ALIASES.get(x, x) if isinstance(x, str) else x)
    except TypeError:
        raise ValueError(f"dtypes: unknown dtype {x!r}; {expected}") from None
    if dtype.name not in DTYPE_NAMES:
        raise ValueError(f"dtypes: {dtype.name} is not supported by the kernels; {expected}")
    return dtype


def _check_head_dim(d) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, numbers.Integral):
        raise TypeError(f"head_dims must be ints, got {d!r} ({type(d).__name__})")
    if not 1 <= d <= _config.MAX_HEAD_DIM:
        raise ValueError(f"head_dims: {d} is out of range; head dims run from 1 to {_config.MAX_HEAD_DIM}")
    return int(d)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)
