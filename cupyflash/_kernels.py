"""Loading, compiling and launching the CUDA kernels in ``cuda_src/``.

Sources are read as text and their ``#include "..."`` lines replaced by the files themselves, so
CuPy's compile cache (keyed on the source string) sees every byte. A variant is (direction, dtype,
HEAD_DIM, causal, score modifiers, tensor-core path); its kernels compile as one module (the backward's
two passes as two, concurrently) with ``name_expressions`` naming their template instantiations,
memoized per device. The wgmma path (compute capability 9.0: fp16/bf16, and float32 as float16 pieces
made by _split) is built for sm_90a.
Callers (``_api``) validate, broadcast and handle empty inputs; this module turns arrays into the
kernels' parameter struct and launches on CuPy's current stream.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy

from . import _config, _modifiers, _split, _tma
from ._types import lse_dtype

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_OPTIONS = ("-std=c++17",)
_MIN_CC = 80  # cp.async, bf16 mma.sync
_WGMMA_CC = 90  # Hopper: wgmma, compiled for sm_90a (whose code runs on compute capability 9.0 only)
_WGMMA_ARCH = "sm_90a"
_CTYPES = {"float16": "half_t", "bfloat16": "bfloat16_t", "float32": "float", "float64": "double"}
_ITEMSIZE = {"half_t": 2, "bfloat16_t": 2, "float": 4, "double": 8}
_SOURCES = {"fwd": "attention_fwd.cu", "bwd": "attention_bwd.cu", "probs": "attention_probs.cu"}
_WS_SOURCE = "attention_fwd_ws.cu"  # the warp-specialized forward (Variant.warp_specialized)

# Host mirror of `struct AttnParams` (cuda_src/block_info.cuh), same field order, C alignment.
PARAMS_DTYPE = numpy.dtype(
    [(name, numpy.uint64) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse_log2", "delta")]
    + [(name, numpy.int64, (4,)) for name in ("q_stride", "k_stride", "v_stride", "out_stride", "dout_stride")]
    + [(name, numpy.int32) for name in ("batch", "batch1", "batch2", "nq", "nk", "d_qk", "d_v")]
    + [("scale", numpy.float32), ("scale_log2", numpy.float32)]
    + [(name, numpy.uint64) for name in ("bias", "dbias", "mask", "block_mask", "alibi_slopes")]
    + [(name, numpy.int64, (5,)) for name in ("bias_stride", "dbias_stride", "mask_stride", "block_mask_stride")]
    + [("alibi_stride", numpy.int64, (3,))]
    + [(name, numpy.int32) for name in ("window_left", "window_right", "bias_f32", "bias_pairs", "dbias_pairs",
                                        "dbias_f32")]
    + [("softcap", numpy.float32), ("softcap_inv", numpy.float32)]
    + [(name, numpy.int32) for name in ("stream_begin", "stream_end")]
    + [("dropout_keys", numpy.uint32, (20,)), ("dropout_threshold", numpy.uint32)]
    + [("dropout_scale", numpy.float32)]
    + [(name, numpy.uint64) for name in ("cu_seqlens_q", "cu_seqlens_k")]
    + [(name, numpy.int32) for name in ("heads", "total_q", "total_k")]
    + [(name, numpy.float64) for name in ("scale_f64", "scale_log2_f64", "softcap_f64", "softcap_inv_f64",
                                          "dropout_scale_f64")]
    + [("split_exponents", numpy.uint64)],
    align=True,
)
# The launch passes the same bytes as one opaque value: CuPy finds a NumPy argument's address through
# __array_interface__, which for a structured dtype rebuilds the description of all its fields on every
# call (about 57 us, longer than a short kernel runs); for an unstructured view it does not.
_PARAMS_BYTES = numpy.dtype((numpy.void, PARAMS_DTYPE.itemsize))
_LOG2E = 1.4426950408889634
_STRIDED = ("q", "k", "v", "out", "dout")  # inputs with their own batch/row strides, in this order


# ----------------------------------------------------------------------------- sources
def _source_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupyflash: CUDA sources not found next to {here} (looked for cuda_src/)")


@functools.lru_cache(maxsize=None)
def source(filename: str) -> str:
    """The text of one .cu file with every local #include pasted in (each header once)."""
    root = _source_dir()
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (root / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: inline(m.group(1)), text)

    return inline(filename)


# ----------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One compiled module: a direction ("fwd", "bwd" or "probs") for one dtype, HEAD_DIM and mask.
    ``mods``: the score modifiers' instantiation (causal then travels as the window, so never both), which
    also serves variable-length batches; "probs" always has it. ``wgmma``: the Hopper path (sm_90a; fp16/bf16 head dims with wgmma tiles,
    and float32 plain and causal at HEAD_DIM 64 and 128, on float16 pieces of the inputs).
    ``dropout``: the kernels that regenerate and apply the dropout mask (fwd and bwd only).
    ``large_smem``: float64 tiles that need the shared memory of compute capability >= 9.0 (sm_90 only).
    ``scalar_mods``: the modifiers' instantiation without the per-element arrays (``Mods::scalars``: window,
    softcap, ALiBi, and in bwd the block mask; fwd and bwd without dropout; 16-bit and float32), whose freed registers allow larger
    tiles in places. ``bounded``: its wgmma bfloat16 forward for softcapped scores without ALiBi, at most 1,
    whose softmax takes 1 as every row's max (cuda_src/attention_fwd.cu; _variant picks it).
    ``softcap_alone``: its wgmma backward for a softcap and nothing else (``Mods::softcap``: no window,
    ALiBi, block mask or packed batch; ``causal`` as the plain kernels take it), where those options are
    compile-time constants; same tiles as the scalars'. ``window_alone``: its wgmma forward and backward for a
    window and nothing else (``Mods::window``: causal travels in the window as in the scalars'; no softcap,
    ALiBi, block mask or packed batch), likewise, but with its own tiles where _config lists them
    (``_WGMMA_WINDOW_FWD``, ``_WGMMA_WINDOW_BWD``). ``warp_specialized``: a 16-bit wgmma forward, plain,
    causal or with the scalar modifiers on a dense batch (window alone or not; bounded or not), as the
    warp-specialized kernel (cuda_src/attention_fwd_ws.cu; _config.WS_FWD), where TMA can read the inputs.
    ``alibi``: that kernel's instantiation for the scalar modifiers with ALiBi slopes, whose softmax takes
    the slopes' row and column terms apart (cuda_src/score_mods.cuh, ``alibi_log2``). ``half_first``: its
    form for a window with a right edge (causal among them), whose tiles' first key blocks run over their
    first half alone where a warpgroup's rows see nothing in the second (the kernel's HALF_FIRST).
    ``block_mask``: its form for the scalar modifiers with a block mask (and no bias or mask), which skips the
    key blocks whose block-mask tile is off (the kernel's BLOCK_MASK; other forwards with a block mask take
    the ``Mods::all`` instantiation)."""

    direction: str
    ctype: str
    head_dim: int
    causal: bool
    mods: bool = False
    wgmma: bool = False
    dropout: bool = False
    large_smem: bool = False
    scalar_mods: bool = False
    bounded: bool = False
    softcap_alone: bool = False
    window_alone: bool = False
    warp_specialized: bool = False
    alibi: bool = False
    half_first: bool = False
    block_mask: bool = False

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.ctype]

    def tiles(self, kernel: str) -> _config.Tiles:
        return _config.tiles(self.itemsize, self.head_dim, kernel, self.mods, self.wgmma, self.dropout,
                             self.large_smem, self.scalar_mods, self.window_alone, self.warp_specialized)

    def smem(self, kernel: str) -> int:
        return 0 if kernel == "preprocess" else _config.smem_bytes(self.itemsize, self.head_dim, kernel, self.mods,
                                                                   self.wgmma, self.dropout, self.large_smem,
                                                                   self.scalar_mods, self.window_alone,
                                                                   self.warp_specialized)

    def threads(self, kernel: str) -> int:
        return 32 * _config.PREPROCESS_WARPS if kernel == "preprocess" else self.tiles(kernel).threads

    @property
    def kernels(self) -> tuple[str, ...]:
        return {"fwd": ("fwd",), "probs": ("probs",)}.get(self.direction, ("preprocess", "dkdv", "dq"))

    def name_expression(self, kernel: str) -> str:
        c, hd = self.ctype, self.head_dim
        flag = {True: "true", False: "false"}
        mods = ("Mods::softcap" if self.softcap_alone else "Mods::window" if self.window_alone else
                "Mods::scalars" if self.scalar_mods else "Mods::all" if self.mods else "Mods::none")
        flags = f"{flag[self.causal]}, {mods}, {flag[self.wgmma]}, {flag[self.dropout]}"
        fwd_flags = f"{flag[self.causal]}, {mods}, {flag[self.dropout]}"
        if kernel == "preprocess":
            lanes = _config.preprocess_lanes(self.itemsize, hd)
            return f"attention_bwd_preprocess_kernel<{c}, {_config.PREPROCESS_WARPS}, {lanes}>"
        t = self.tiles(kernel)
        if kernel == "probs":
            return f"attention_probs_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {flag[self.wgmma]}>"
        if kernel == "fwd" and self.warp_specialized:  # the scalars there: a dense batch's (no cu_seqlens)
            mods = "Mods::dense_scalars" if mods == "Mods::scalars" else mods
            stages = _config.ws_blocks(hd, self.window_alone)[1]
            return (f"attention_fwd_ws_kernel<{c}, {hd}, {t.block}, {stages}, {flag[self.causal]}, "
                    f"{mods}, {flag[self.bounded]}, {flag[self.alibi]}, {flag[self.half_first]}, "
                    f"{flag[self.block_mask]}>")
        if kernel == "fwd" and self.wgmma:  # no column chunks: the whole head dim per CTA
            return (f"attention_fwd_wgmma_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {fwd_flags}, "
                    f"{flag[self.bounded]}, {t.ctas_per_sm}>")
        if kernel == "fwd":
            return f"attention_fwd_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {t.d_chunk}, {fwd_flags}>"
        return f"attention_bwd_{kernel}_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {t.d_chunk}, {flags}, {flag[t.split]}>"

    @property
    def modules(self) -> tuple[tuple[str, ...], ...]:
        """The kernels, grouped into the modules NVRTC compiles: the backward's passes in two modules that
        compile concurrently (NVRTC runs without the GIL), which shortens its first call."""
        return {"fwd": (("fwd",),), "probs": (("probs",),)}.get(self.direction, (("preprocess", "dkdv"), ("dq",)))

    def code(self, kernels: tuple[str, ...] | None = None) -> str:
        """The source of the module holding ``kernels`` (default: all of the variant's)."""
        # The instantiated names (tiles included) lead the source, so each module, and each change of
        # the tile table, gets its own entry in CuPy's compile cache.
        names = ", ".join(self.name_expression(kernel) for kernel in (kernels or self.kernels))
        return f"// cupyflash module: {names}\n" + source(_WS_SOURCE if self.warp_specialized else _SOURCES[self.direction])

    @property
    def options(self) -> tuple[str, ...]:
        """NVRTC options. wgmma modules name sm_90a; CuPy appends its own -arch=sm_90 after it, and NVRTC
        keeps the architecture-specific target."""
        return _OPTIONS + ((f"-arch={_WGMMA_ARCH}",) if self.wgmma else ())


def shipped_variants() -> list[Variant]:
    """Every module the library can compile: (fwd, bwd) x dtypes x head dims x (plain, causal,
    modifiers) x (without, with dropout), plus the scalar modifiers without dropout, and probs x dtypes x
    head dims, on the mma.sync path; and the same again on the wgmma path for the (dtype, head dim) pairs
    that have wgmma tiles, with the bfloat16 bounded forwards, the softcap-alone backwards (plain and
    causal) and the 16-bit window-alone forwards and backwards there, and the warp-specialized kernel of
    the 16-bit plain, causal and scalar-modifier forwards (window-alone, bounded and ALiBi ones included) at
    the head dims of _config.WS_FWD."""
    ctypes = ("half_t", "bfloat16_t", "float", "double")
    variants = [
        Variant(direction, ctype, head_dim, causal, mods, dropout=dropout)
        for direction in ("fwd", "bwd")
        for ctype in ctypes
        for head_dim in _config.HEAD_DIMS
        for causal, mods in ((False, False), (True, False), (False, True))
        for dropout in (False, True)
    ] + [
        Variant(direction, ctype, head_dim, False, True, scalar_mods=True)
        for direction in ("fwd", "bwd") for ctype in ctypes for head_dim in _config.HEAD_DIMS
        if _ITEMSIZE[ctype] in _config.SCALAR_MODS_ITEMSIZES
    ] + [Variant("probs", ctype, head_dim, False, True) for ctype in ctypes for head_dim in _config.HEAD_DIMS]
    wgmma = [dataclasses.replace(v, wgmma=True) for v in variants
             if _config.has_wgmma(v.itemsize, v.head_dim)
             or (v.direction != "probs" and _config.has_wgmma_pieces(v.itemsize, v.head_dim, v.mods, v.dropout))]
    bounded = [dataclasses.replace(v, bounded=True) for v in wgmma
                if v.direction == "fwd" and v.scalar_mods and v.ctype == "bfloat16_t"]
    return (variants + wgmma + bounded
            + [dataclasses.replace(v, causal=causal, softcap_alone=True) for v in wgmma
               if v.direction == "bwd" and v.scalar_mods and v.itemsize == 2 for causal in (False, True)]
            + [dataclasses.replace(v, window_alone=True, warp_specialized=ws) for v in wgmma
               if v.scalar_mods and v.itemsize == 2
               for ws in ((False, True) if v.direction == "fwd" and v.head_dim in _config.WS_FWD else (False,))]
            + [dataclasses.replace(v, warp_specialized=True, alibi=alibi, half_first=half, block_mask=block_mask)
               for v in wgmma + bounded
               if v.direction == "fwd" and (not v.mods or v.scalar_mods) and not v.dropout and v.itemsize == 2
               and v.head_dim in _config.WS_FWD
               for alibi, half in (((False, False), (True, False), (True, True)) if v.scalar_mods and not v.bounded
                                   else ((False, False),))
               for block_mask in ((False, True) if v.scalar_mods else (False,))]
            + [dataclasses.replace(v, large_smem=True) for v in variants
               if _config.has_large_smem_tiles(v.itemsize, v.head_dim)])


def compile_targets(variant: Variant) -> dict[str, str]:
    """Architecture family -> NVRTC target a variant is built for: the wgmma path for Hopper alone (sm_90a),
    the mma.sync path for every GPU (checked as sm_80 and sm_90), its large-shared-memory tiles for sm_90 on."""
    if variant.large_smem or _config.needs_large_smem(variant.itemsize, variant.head_dim, variant.direction):
        return {"sm_90": "sm_90"}
    return {"sm_90": _WGMMA_ARCH} if variant.wgmma else {"sm_80": "sm_80", "sm_90": "sm_90"}


# ----------------------------------------------------------------------------- compiling
_lock = threading.Lock()
_modules: dict[tuple[int, Variant], dict[str, object]] = {}


def _functions(variant: Variant) -> dict[str, object]:
    """The variant's kernels on the current device, compiled once per (device, variant)."""
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, variant)
    found = _modules.get(key)
    if found is not None:
        return found
    with _lock:
        found = _modules.get(key)
        if found is None:
            cc = int(device.compute_capability)
            if cc < _MIN_CC:
                raise RuntimeError(
                    f"cupyflash needs a GPU of compute capability >= 8.0 (cp.async, bf16 tensor cores); "
                    f"device {device.id} has {cc / 10:.1f}"
                )
            built = _build_modules([(variant, kernels) for kernels in variant.modules], device.id)
            if variant.wgmma and variant.itemsize == 4:  # its inputs' float16 pieces come from _split's kernel
                _split._module(device.id)
            optin = cupy.cuda.runtime.getDeviceProperties(device.id)["sharedMemPerBlockOptin"]
            found = {}
            for kernel, function in built.items():
                name = variant.name_expression(kernel)
                smem = variant.smem(kernel)
                total = smem + function.shared_size_bytes  # dynamic + static (the block-mask bitmap)
                if total > optin:
                    raise RuntimeError(
                        f"cupyflash: {name} needs {total} bytes of shared memory per block; "
                        f"device {device.id} allows {optin}"
                    )
                if total > 48 * 1024:
                    function.max_dynamic_shared_size_bytes = smem
                found[kernel] = function
            _modules[key] = found
    return found


def _build(variant: Variant, kernels: tuple[str, ...], device_id: int) -> dict[str, object]:
    """Compile (or load from CuPy's disk cache) the module of ``kernels`` on device ``device_id``."""
    import cupy

    with cupy.cuda.Device(device_id):
        names = {kernel: variant.name_expression(kernel) for kernel in kernels}
        module = cupy.RawModule(code=variant.code(kernels), options=variant.options,
                                name_expressions=list(names.values()))
        return {kernel: module.get_function(name) for kernel, name in names.items()}


def _build_modules(modules, device_id: int, max_workers: int = 16) -> dict[str, object]:
    """_build for each (variant, kernels), concurrently when there are several; kernel -> function."""
    from concurrent.futures import ThreadPoolExecutor

    if len(modules) == 1:
        return _build(*modules[0], device_id)
    with ThreadPoolExecutor(max_workers=min(max_workers, len(modules))) as pool:
        parts = list(pool.map(lambda module: _build(*module, device_id), modules))
    return {kernel: function for part in parts for kernel, function in part.items()}


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
# ptxas' C7510-C7519 notes: it serialized a kernel's warpgroup products (wgmma), naming the function. Each
# such kernel loses the overlap of its products with everything else (the forward ran 20% slower when a
# branch in its pipelined loop caused one: bench/NOTES.md, v13).
_PTXAS_SERIALIZED = re.compile(r"\(C751\d\).*?function '(\w+)'")


def _parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per mangled entry: registers, spills, stack frame, static shared memory, and the ptxas notes that its
    warpgroup products were serialized (``serialized_wgmma``, a count)."""
    found: dict[str, dict[str, int]] = {}

    def entry(name: str) -> dict[str, int]:
        return found.setdefault(name, {"registers": -1, "spill_stores": -1, "spill_loads": -1, "stack_frame": -1,
                                       "static_smem": 0, "serialized_wgmma": 0})

    current = None
    for line in log.splitlines():
        if m := _PTXAS_SERIALIZED.search(line):
            entry(m.group(1))["serialized_wgmma"] += 1
        elif m := _PTXAS_ENTRY.search(line):
            current = entry(m.group(1))
        elif current is not None and (m := _PTXAS_FRAME.search(line)):
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _PTXAS_USED.search(line)):
            current.update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
    return found


def compile_variant(variant: Variant, arch: str) -> list[dict]:
    """Compile one module through NVRTC for `arch` ("sm_80", "sm_90": the family; a wgmma module's target
    is sm_90a) with no GPU needed, and report each kernel.

    The report is kept on disk next to CuPy's kernel cache (``$CUPY_CACHE_DIR/cupyflash-ptxas``), keyed
    on the source, the options and the NVRTC version, so that a second check of the same variants (CI's
    main job, then its compile tests) reads it instead of compiling again."""
    import hashlib
    import json

    target = compile_targets(variant)[arch]
    options = [*_OPTIONS, f"-arch={target}", "-Xptxas", "-v"]
    names = {kernel: variant.name_expression(kernel) for kernel in variant.kernels}
    key = hashlib.sha256(json.dumps([variant.code(), options, list(names.values()), nvrtc_version()]).encode())
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache")) / "cupyflash-ptxas"
    path = cache / f"{key.hexdigest()}.json"
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        stats = _compile_for_report(variant, target, options, names)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(stats))
            tmp.replace(path)  # atomic: concurrent checks never read half a file
        except OSError:
            pass  # a read-only cache only costs the next check a compile
    return [{"kernel": name, "arch": arch, "target": target, **stats[kernel],
             "dynamic_smem": variant.smem(kernel), "threads": variant.threads(kernel)} for kernel, name in names.items()]


def _compile_for_report(variant: Variant, target: str, options: list, names: dict, code: str | None = None) -> dict:
    """kernel -> ptxas' registers, spills, stack, static shared memory and serialized-wgmma notes for it, from
    one NVRTC compile of the variant's source (or of ``code``, a variation of it)."""
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(variant.code() if code is None else code, f"{variant.direction}.cu", [], [])
    try:
        for name in names.values():
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed on {variant} for {target}:\n{nvrtc.getProgramLog(program)}") from error
        stats = _parse_ptxas(nvrtc.getProgramLog(program))
        found = {}
        for kernel, name in names.items():
            lowered = nvrtc.getLoweredName(program, name)
            if lowered not in stats:
                raise RuntimeError(f"no ptxas report for {name} ({lowered}) on {target}")
            found[kernel] = stats[lowered]
        return found
    finally:
        nvrtc.destroyProgram(program)


def variants_for(arch: str) -> list[Variant]:
    """The shipped variants built for architecture family `arch`."""
    return [v for v in shipped_variants() if arch in compile_targets(v)]


def compile_report(arch: str, variants: list[Variant] | None = None) -> list[dict]:
    """Compile every shipped variant built for `arch` ("sm_80", "sm_90"), one row per kernel; by default
    (variants None) also the float32 split kernels (_split)."""
    from concurrent.futures import ThreadPoolExecutor
    import os

    extra = _split.compile_report(arch) if variants is None else []
    variants = variants_for(arch) if variants is None else variants
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = pool.map(lambda variant: compile_variant(variant, arch), variants)
        return [row for rows in results for row in rows] + extra


# ----------------------------------------------------------------------------- arrays -> params
def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _bits(x):
    """The same memory viewed as unsigned integers, so copies never need dtype support for bf16."""
    return x.view(numpy.dtype(f"u{x.dtype.itemsize}"))


def _kernel_ready(x, width: int):
    """x (..., N, D) as the kernels read it: unit column stride, 16-byte aligned rows holding
    `width` >= D columns. Returns x itself when it already qualifies (any batch/row strides,
    broadcast dims included); otherwise a zero-padded copy that keeps broadcast dims unmaterialized."""
    import cupy

    if x.shape[-1] == width and x.flags.c_contiguous and x.data.ptr % 16 == 0 and (width * x.dtype.itemsize) % 16 == 0:
        return x  # the common case, decided without the general test below
    itemsize = x.dtype.itemsize
    sized = [(n, s) for n, s in zip(x.shape[:-1], x.strides[:-1]) if n > 1]
    if (x.shape[-1] == width and (x.shape[-1] == 1 or x.strides[-1] == itemsize)
            and x.data.ptr % 16 == 0 and all(s % 16 == 0 for _, s in sized)):
        return x
    base = x[tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None)
                   for n, s in zip(x.shape[:-2], x.strides[:-2]))]
    padded = cupy.zeros(base.shape[:-1] + (width,), dtype=x.dtype)
    _bits(padded)[..., : x.shape[-1]] = _bits(base)
    return cupy.broadcast_to(padded, x.shape[:-1] + (width,))


def _collapse_batch(batch: tuple[int, ...], arrays) -> tuple[list[int], list[list[int]]] | None:
    """Merge the leading dims of several (batch..., N, D) arrays into at most three, as
    (sizes, per-array strides in elements); None when more than three remain."""
    dims = []
    for i, n in enumerate(batch):
        if n == 1:
            continue
        strides = [a.strides[i] // a.dtype.itemsize for a in arrays]
        if dims and all(prev == s * n for prev, s in zip(dims[-1][1], strides)):
            dims[-1] = (dims[-1][0] * n, strides)
        else:
            dims.append((n, strides))
    if len(dims) > 3:
        return None
    dims = [(1, [0] * len(arrays))] * (3 - len(dims)) + dims
    return [n for n, _ in dims], [[s[j] for _, s in dims] for j in range(len(arrays))]


def _layout(batch, arrays: dict):
    """Collapse the leading dims of the named arrays together. Returns (arrays, sizes, batch strides
    per name, copied); in the rare case of > 3 unmergeable leading dims the arrays are materialized
    first (copied = True: a broadcast dbias accumulator is then a full one, summed afterwards)."""
    import cupy

    names, values = list(arrays), list(arrays.values())
    layout = _collapse_batch(batch, values)
    copied = layout is None
    if copied:
        values = [cupy.ascontiguousarray(_bits(a)).view(a.dtype) for a in values]
        layout = _collapse_batch(batch, values)
    sizes, strides = layout
    return dict(zip(names, values)), sizes, dict(zip(names, strides)), copied


def _new_params(pointers: dict, *, batch: int, batch1: int, batch2: int, nq: int, nk: int, d: int, dv: int,
                scale: float, causal: bool, mods, dropout):
    """An AttnParams struct (a one-element structured array: CuPy passes it by value) with what every launch
    fills: the arrays' addresses, the sizes, the scale, the whole streamed axis for the backward passes,
    the window (causal folded in) and softcap that the modifiers' kernels read, and the dropout's fields.
    Strides and the per-layout fields are the caller's (_params, _varlen_params)."""
    p = numpy.zeros(1, dtype=PARAMS_DTYPE)
    for name, array in pointers.items():
        p[name] = array.data.ptr
    p["batch"], p["batch1"], p["batch2"] = batch, batch1, batch2
    p["nq"], p["nk"], p["d_qk"], p["d_v"] = nq, nk, d, dv
    # Both precisions of the real-valued fields: float32 kernels read the first, float64 ones the second.
    p["scale"], p["scale_log2"] = scale, scale * _LOG2E
    p["scale_f64"], p["scale_log2_f64"] = scale, scale * _LOG2E
    p["stream_begin"], p["stream_end"] = 0, max(nq, nk)
    p["alibi_stride"] = batch1 * batch2, batch2, 1  # one slope per flat batch entry, contiguous (_alibi)
    # Read only by the modifiers' kernels (and attention_probs_kernel, which always has them).
    p["window_left"], p["window_right"] = (-1, 0) if causal else (-1, -1)
    if mods is not None:
        p["window_left"], p["window_right"] = mods.window_with_causal(causal)
        softcap_inv = 1.0 / mods.softcap if mods.softcap > 0 else 0.0
        p["softcap"], p["softcap_inv"] = mods.softcap, softcap_inv
        p["softcap_f64"], p["softcap_inv_f64"] = mods.softcap, softcap_inv
    if dropout is not None:  # read by the dropout kernels only
        p["dropout_keys"] = dropout.round_keys
        p["dropout_threshold"], p["dropout_scale"] = dropout.threshold, dropout.scale
        p["dropout_scale_f64"] = dropout.scale
    return p


def _params(arrays: dict, sizes, batch_strides: dict, *, batch: int, nq: int, nk: int, d: int, dv: int,
            scale: float, others: dict = None, mods=None, causal: bool = False, dropout=None):
    """The parameters of a dense batch: ``arrays`` are the strided tensors (with their collapsed batch
    strides in ``batch_strides``); ``others`` the contiguous ones (lse and workspaces), by pointer only."""
    p = _new_params({**arrays, **(others or {})}, batch=batch, batch1=sizes[1], batch2=sizes[2], nq=nq, nk=nk, d=d,
                    dv=dv, scale=scale, causal=causal, mods=mods, dropout=dropout)
    for name, array in arrays.items():
        if name == "alibi_slopes":  # (*batch): batch strides only
            p["alibi_stride"] = batch_strides[name]
            continue
        row_col = [array.strides[-2] // array.dtype.itemsize]
        if name not in _STRIDED:  # the modifiers' arrays: any column stride, 0 included
            row_col.append(array.strides[-1] // array.dtype.itemsize)
        p[f"{name}_stride"] = batch_strides[name] + row_col
    if mods is not None:
        p["bias_f32"] = mods.bias is not None and mods.bias.dtype == numpy.float32
        if "bias" in arrays:
            p["bias_pairs"] = _pairs_aligned(arrays["bias"], p["bias_stride"][0])
        if "dbias" in arrays:
            p["dbias_pairs"] = _dbias_exclusive(mods)  # see _dbias_buffer
            p["dbias_f32"] = arrays["dbias"].dtype == numpy.float32
    return p


def _dbias_buffer(mods, dtype):
    """Zeros in the bias's own shape (leading 1s added) that the dQ pass writes dbias into: the result
    itself, in the bias's dtype, when the bias is broadcast along no dim (each element has one writer,
    which stores pairs of adjacent keys: Nk even, no softcap); otherwise an accumulator for atomic adds in
    the kernels' accumulator type, float32 (float64 for float64 inputs) (the kernel's dbias_pairs flag says
    which)."""
    import cupy

    own = (1,) * (mods.bias.ndim - len(mods.bias_shape)) + tuple(mods.bias_shape)
    return cupy.zeros(own, dtype=mods.bias.dtype if _dbias_exclusive(mods) else lse_dtype(dtype))


def _dbias_exclusive(mods) -> bool:
    full = mods.bias.shape
    own = (1,) * (len(full) - len(mods.bias_shape)) + tuple(mods.bias_shape)
    return own == tuple(full) and full[-1] % 2 == 0 and mods.softcap == 0


def _pairs_aligned(array, strides) -> bool:
    """Unit column stride, and every (row, even column) element aligned to two elements' bytes, so
    the kernels may read (or write) two adjacent columns at once."""
    return bool(array.strides[-1] == array.dtype.itemsize and all(int(s) % 2 == 0 for s in strides[:4])
                and array.data.ptr % (2 * array.dtype.itemsize) == 0)


def _mod_arrays(mods) -> dict:
    """The modifiers' arrays as the dense kernels read them: broadcast views, nothing copied."""
    if mods is None:
        return {}
    return {name: getattr(mods, name) for name in ("bias", "mask", "block_mask", "alibi_slopes")
            if getattr(mods, name) is not None}


def _slopes(mods) -> dict:
    """The ALiBi slopes' broadcast view (float32, the batch shape), by name, or nothing: its address is one
    of a planned call's."""
    return {} if mods is None or mods.alibi_slopes is None else {"alibi_slopes": mods.alibi_slopes}


def _alibi(mods):
    """One float32 slope per flat batch entry, contiguous (tiny: the batch size), or nothing, for packed
    batches, whose launches take _new_params' contiguous alibi_stride. Often a new array: the caller keeps
    the dict it returns alive until the kernels are launched (a local variable), since the parameters hold
    only its address. Dense calls pass the broadcast view itself with its batch strides instead
    (_mod_arrays): no copy, no extra kernel per call."""
    import cupy

    if mods is None or mods.alibi_slopes is None:
        return {}
    return {"alibi_slopes": cupy.ascontiguousarray(mods.alibi_slopes, dtype=numpy.float32).reshape(-1)}


def _grid(blocks: int, batch: int) -> tuple[int, int, int]:
    y = min(batch, 65535)
    return blocks, y, -(-batch // y)


def _variant(direction: str, dtype, d: int, dv: int, causal: bool, mods=None, dropout=None,
             packed: bool = False, ws: bool = True) -> Variant:
    """With modifiers, causal travels in the window: one instantiation serves both. Packed (variable-length)
    batches run the modifiers' instantiation, the one that reads cu_seqlens. Without the modifiers' arrays
    and without dropout, the scalar instantiation (Variant.scalar_mods) serves; on the 16-bit wgmma path a
    backward with a softcap alone takes its Mods::softcap form (Variant.softcap_alone), causal as the plain
    kernels, and a forward or backward with a window alone (causal travelling in it) its Mods::window form
    (Variant.window_alone). The 16-bit forwards of plain, causal and scalar-modifier calls on dense batches
    are warp-specialized at the head dims of _config.WS_FWD (Variant.warp_specialized), those with a block
    mask (and no other array) included (Variant.block_mask). ``ws=False``: not that kernel (attention_forward:
    where TMA cannot read the inputs, or the block mask has more key tiles than the kernel's walk holds)."""
    name = numpy.dtype(dtype).name
    has_mods = mods is not None or direction == "probs" or packed
    ctype, head_dim = _CTYPES[name], _config.padded_head_dim(max(d, dv))
    wgmma = uses_wgmma(_ITEMSIZE[ctype], head_dim, direction, has_mods, dropout is not None)
    ws_path = (direction == "fwd" and wgmma and _ITEMSIZE[ctype] == 2 and head_dim in _config.WS_FWD and ws
               and dropout is None and not packed)
    # A block mask alone among the arrays: its forward walks it on the warp-specialized kernel (BLOCK_MASK),
    # its backward on the scalars' passes; other forwards with one take Mods::all (_scalars_only).
    block_mask = ws_path and mods is not None and mods.block_mask is not None and mods.bias is None and mods.mask is None
    scalar = (has_mods and direction != "probs" and dropout is None
              and (mods is None or block_mask or _scalars_only(mods, direction))
              and _ITEMSIZE[ctype] in _config.SCALAR_MODS_ITEMSIZES)
    bounded = (direction == "fwd" and scalar and wgmma and ctype == "bfloat16_t" and mods is not None
               and mods.alibi_slopes is None and 0.0 < mods.softcap <= BOUNDED_SOFTCAP_MAX)
    # One option alone, every other off: the instantiations that fix the others at compile time.
    single = (scalar and wgmma and _ITEMSIZE[ctype] == 2 and not packed and mods is not None
              and mods.alibi_slopes is None and mods.block_mask is None)
    alone = direction == "bwd" and single and mods.softcap > 0.0 and mods.window == (-1, -1)
    window_alone = single and mods.softcap == 0.0
    # The plain, causal and scalar-modifier 16-bit forwards of dense batches (the window alone in its own
    # form); attention_forward falls back to their other kernel where TMA cannot read the inputs.
    warp_specialized = ws_path and (scalar or not has_mods)
    alibi = warp_specialized and mods is not None and mods.alibi_slopes is not None  # mods there: the scalars
    half_first = alibi and mods.window_with_causal(causal)[1] >= 0  # the window has a right edge
    return Variant(direction, ctype, head_dim, bool(causal) and (not has_mods or alone), has_mods, wgmma,
                   dropout is not None, uses_large_smem(_ITEMSIZE[ctype], head_dim), scalar, bounded, alone,
                   window_alone, warp_specialized, alibi, half_first, block_mask)


# Softcapped scores are tanh values in [-1, 1]. Without ALiBi, exp2(c * (t - 1)) with c = softcap * log2(e)
# is at least 2^(-2c): a normal float (the exponentials are flushed to zero below 2^-126) for c <= 62, which
# leaves a factor 2^2 for the rounding of c and of tanh. Up to this softcap the bfloat16 forward takes 1 as
# every row's max (Variant.bounded).
BOUNDED_SOFTCAP_MAX = 62.0 * math.log(2.0)


def _scalars_only(mods, direction: str) -> bool:
    """Whether the modifiers need no per-element array (ALiBi's slopes are one number per batch entry). The
    block mask skips whole tiles (a bitmap read once per CTA): the scalars' backward walks it, their forward
    does not (walking it there slowed the ALiBi and window forwards; bench/NOTES.md, v15)."""
    return mods.bias is None and mods.mask is None and (mods.block_mask is None or direction == "bwd")


def uses_large_smem(itemsize: int, head_dim: int) -> bool:
    """Whether calls on the current device take the large-shared-memory tiles (float64, compute capability
    >= 9.0, where the table has them)."""
    if not _config.has_large_smem_tiles(itemsize, head_dim):
        return False
    try:
        import cupy

        device_id = cupy.cuda.Device().id
    except Exception:  # no usable device: selection only, nothing will launch
        return False
    return _compute_capability(device_id) >= _config.LARGE_SMEM_CC


def uses_wgmma(itemsize: int, head_dim: int, direction: str | None = None, mods: bool = False,
               dropout: bool = False) -> bool:
    """Whether calls on the current device take the wgmma path for this element size and HEAD_DIM: on
    compute capability 9.0 where the tile table has wgmma tiles, unless CUPYFLASH_NO_WGMMA=1 asks for the
    mma.sync kernels (which every other GPU runs). 16-bit inputs in every direction; float32 (as float16
    pieces) in "fwd" and "bwd" without modifiers or dropout, where _config.has_wgmma_pieces has tiles."""
    tiles = _config.has_wgmma(itemsize, head_dim) or (
        direction in ("fwd", "bwd") and _config.has_wgmma_pieces(itemsize, head_dim, mods, dropout))
    return tiles and _wgmma_device()


def _wgmma_device() -> bool:
    """Whether the current device is compute capability 9.0, unless CUPYFLASH_NO_WGMMA=1."""
    if os.environ.get("CUPYFLASH_NO_WGMMA", "0") not in ("", "0"):
        return False
    try:
        import cupy

        device_id = cupy.cuda.Device().id
    except Exception:  # no usable device: selection only (warmup's checks), nothing will launch
        return False
    return _compute_capability(device_id) == _WGMMA_CC


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def compile_ahead(variants, max_workers: int = 16) -> list[str]:
    """Compile variants for the current device into CuPy's on-disk kernel cache, max_workers modules at a
    time (NVRTC runs without the GIL), so that their first use only loads them. Returns a message per
    module that failed (its first call then compiles, and fails, on its own)."""
    import cupy
    from concurrent.futures import ThreadPoolExecutor

    device = cupy.cuda.Device().id

    def build(module):
        try:
            _build(*module, device)
            return None
        except Exception as error:  # noqa: BLE001 - reported to the caller
            return f"{module[0]} {module[1]}: {type(error).__name__}: {error}"

    todo = [(v, kernels) for v in sorted(set(variants), key=repr) if (device, v) not in _modules for kernels in v.modules]
    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        return [message for message in pool.map(build, todo) if message]


def _launch_shape(variant: Variant, kernel: str, rows: int, batch: int, cols: int = 0):
    """(grid, block, dynamic shared memory) of one kernel over ``rows`` rows of its axis and ``batch`` entries."""
    t = variant.tiles(kernel) if kernel != "preprocess" else None
    if variant.warp_specialized:  # persistent: one CTA per SM, at most one per tile
        tiles = -(-rows // t.rows) * batch
        return (min(tiles, _sm_count()), 1, 1), (variant.threads(kernel),), variant.smem(kernel)
    if kernel == "preprocess":
        rows_per_block = _config.PREPROCESS_WARPS * (32 // _config.preprocess_lanes(variant.itemsize, variant.head_dim))
        blocks = -(-rows // rows_per_block)
    elif kernel == "probs":  # one CTA per (row block, key tile)
        blocks = -(-rows // t.rows) * -(-cols // t.block)
    else:
        blocks = -(-rows // t.rows) * (variant.head_dim // t.d_chunk)
    return _grid(blocks, batch), (variant.threads(kernel),), variant.smem(kernel)


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def _sm_count() -> int:
    import cupy

    return _sm_count_of(cupy.cuda.runtime.getDevice())


def _launch(functions, variant: Variant, kernel: str, rows: int, batch: int, params, cols: int = 0) -> None:
    grid, block, smem = _launch_shape(variant, kernel, rows, batch, cols)
    functions[kernel](grid, block, (params.view(_PARAMS_BYTES),), shared_mem=smem)


def _launch_summed(functions, variant: Variant, kernel: str, rows: int, batch: int, params, length: int,
                   outputs) -> None:
    """A backward pass whose gradients sum over a streamed axis of ``length`` rows: one launch, or, past
    _config.CHAIN_ROWS rows, one launch per chunk of that many rows with the chunks' results (the arrays
    in ``outputs``, which each launch overwrites) added in the accumulator type (see CHAIN_ROWS)."""
    import cupy

    if length <= _config.CHAIN_ROWS:
        _launch(functions, variant, kernel, rows, batch, params)
        return
    acc = lse_dtype(outputs[0].dtype)
    sums = [cupy.zeros(out.shape, dtype=acc) for out in outputs]
    part = params.copy()
    for begin in range(0, length, _config.CHAIN_ROWS):
        part["stream_begin"], part["stream_end"] = begin, min(length, begin + _config.CHAIN_ROWS)
        _launch(functions, variant, kernel, rows, batch, part)
        for total, out in zip(sums, outputs):
            total += out.astype(acc)
    for total, out in zip(sums, outputs):
        out[...] = total.astype(out.dtype)


# The backward's dK/dV and dQ passes read the same inputs and write different outputs, so they may run at
# once: the dQ pass goes on a second stream beside the dK/dV pass, each pass's CTAs filling the SMs the
# other's last wave leaves idle (1.4-4% of the backward, most where the passes are short: bench/NOTES.md,
# v12). Both wait for what the current stream had queued (the preprocess), and the current stream waits for
# both, so to the caller the call is one stream's work as before.
_side_streams: dict[int, tuple] = {}


def _passes_side_by_side(dkdv, dq) -> None:
    """Run ``dkdv()`` on the current stream and ``dq()`` on this device's side stream, concurrently."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    device = cupy.cuda.runtime.getDevice()
    if device not in _side_streams:
        _side_streams[device] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                                 cupy.cuda.Event(disable_timing=True))
    side, ready, done = _side_streams[device]
    ready.record(stream)
    dkdv()
    side.wait_event(ready)
    with side:
        dq()
    done.record(side)
    stream.wait_event(done)


# ----------------------------------------------------------------------------- launch plans
# What a dense call launches (kernels, grids, shared memory, and every parameter but the arrays' addresses)
# depends only on its arrays' shapes, strides and dtype, the scalar options and the device. The first call
# of each such signature works it out (_params, the tile table); later calls copy its parameters and write
# only the addresses and the dropout key, so that short kernels are not left waiting for Python. Calls with
# the modifiers' per-element arrays (bias, mask, block_mask), and backward passes chained over long axes,
# always take the full route. (ALiBi's slopes are read in place through their broadcast view, whose strides
# are part of the signature and whose address the plan writes like the others'.)
_PLAN_CACHE_SIZE = 256
_ADDRESS_WORDS = {name: PARAMS_DTYPE.fields[name][1] // 8
                  for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse_log2", "delta",
                               "alibi_slopes", "split_exponents")}
_KEYS_DTYPE, _KEYS_OFFSET = PARAMS_DTYPE.fields["dropout_keys"][:2]
_KEY_WORDS = slice(_KEYS_OFFSET // 4, _KEYS_OFFSET // 4 + _KEYS_DTYPE.shape[0])  # as uint32 words
_plans: dict[tuple, "_Plan"] = {}


_PER_THREAD_STREAM = 2  # cudaStreamPerThread: CuPy's Stream.ptds
_MAPPED = ("q", "k", "v")  # the warp-specialized forward's inputs, read through tensor maps (_tma)


class _Plan:
    def __init__(self, functions: dict, variant: Variant, params, launches, tensor_maps=None, arrays=None):
        # The parameters as 64-bit words (a plain copy, and an address is one word's write).
        self.words = params.view(numpy.uint64).copy()
        self.variant = variant
        # The warp-specialized forward's second argument: q, k, v's tensor maps (_tma), encoded per call
        # from the addresses (by default those of ``arrays``, the ones the plan was made with).
        self.tensor_maps = tensor_maps
        self.map_addresses = {name: arrays[name].data.ptr for name in _MAPPED} if tensor_maps else None
        # (function, grid, block, dynamic shared memory) per launch of (kernel, rows, batch); a backward's
        # last two (dK/dV, dQ) run side by side.
        self.launches = [(functions[kernel],) + _launch_shape(variant, kernel, rows, batch)
                         for kernel, rows, batch in launches]
        self.side_by_side = [kernel for kernel, _, _ in launches[-2:]] == ["dkdv", "dq"]
        self.tile_counters = {}  # the warp-specialized forward's, by stream

    def _tile_counter(self):
        """The warp-specialized forward's tile counter (one int, zero at launch; the launch's last draw zeroes
        it again: attention_fwd_ws.cu) for launches on the current stream, which run one after another. One
        per stream: launches on two streams may run at once. The per-thread default stream has one handle
        (cudaStreamPerThread) for a different stream in each thread, and a thread's launches may outlive it:
        there every launch gets a new zeroed counter (6.8 us of host time on an H100, bench/NOTES.md v20)."""
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
        if stream == _PER_THREAD_STREAM:
            return cupy.zeros(1, dtype=numpy.int32)
        counter = self.tile_counters.get(stream)
        if counter is None:
            counter = self.tile_counters.setdefault(stream, cupy.zeros(1, dtype=numpy.int32))
        return counter

    def launch(self, addresses: dict | None, dropout) -> None:
        """Launch with these arrays' addresses and this dropout key (None: the ones the plan was made with)."""
        words = self.words
        if addresses is not None:
            words = words.copy()
            for name, array in addresses.items():
                words[_ADDRESS_WORDS[name]] = array.data.ptr
            if dropout is not None:
                words.view(numpy.uint32)[_KEY_WORDS] = dropout.round_keys
        args = (words.view(_PARAMS_BYTES),)
        if self.tensor_maps is not None:
            found = self.map_addresses if addresses is None else {name: addresses[name].data.ptr for name in _MAPPED}
            args += (self.tensor_maps.encode(found), self._tile_counter())

        def run(launches):
            for function, grid, block, smem in launches:
                function(grid, block, args, shared_mem=smem)

        if self.side_by_side:
            run(self.launches[:-2])
            _passes_side_by_side(lambda: run(self.launches[-2:-1]), lambda: run(self.launches[-1:]))
        else:
            run(self.launches)


def _plan_key(direction: str, arrays: dict, scale: float, causal: bool, mods, dropout) -> tuple | None:
    """What a dense call's launches depend on, or None when it is not planned (the modifiers' arrays)."""
    import cupy

    if mods is not None and not (mods.bias is None and mods.mask is None and mods.block_mask is None):
        return None
    # The inputs' layouts; outputs and workspaces are allocated contiguous from their shapes.
    layout = tuple((arrays[name].shape, arrays[name].strides) for name in _STRIDED if name in arrays)
    return (direction, cupy.cuda.runtime.getDevice(), arrays["q"].dtype, layout, scale, causal,
            None if mods is None else (mods.window, mods.softcap,
                                       None if mods.alibi_slopes is None else mods.alibi_slopes.strides),
            None if dropout is None else (dropout.threshold, dropout.scale),
            os.environ.get("CUPYFLASH_NO_WGMMA", ""))


def _remember(key, plan: _Plan) -> None:
    if len(_plans) >= _PLAN_CACHE_SIZE:
        _plans.pop(next(iter(_plans)))  # the oldest
    _plans[key] = plan


# ----------------------------------------------------------------------------- entry points
def _unpad(x, width: int):
    """x[..., :width] as a contiguous array (a copy only when the kernels ran on padded columns)."""
    import cupy

    return x if x.shape[-1] == width else cupy.ascontiguousarray(_bits(x[..., :width])).view(x.dtype)


def attention_forward(q, k, v, *, scale: float, causal: bool, mods=None, dropout=None):
    """out (*batch, Nq, Dv) and lse (*batch, Nq) in lse_dtype (float32; float64 for float64 inputs); see
    CONTRACT in _api for preconditions."""
    import cupy

    batch_shape, (nq, d), nk, dv = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
    vec = 16 // q.dtype.itemsize
    d_w, dv_w = _round_up(d, vec), _round_up(dv, vec)
    q, k, v = _kernel_ready(q, d_w), _kernel_ready(k, d_w), _kernel_ready(v, dv_w)
    out = cupy.empty(batch_shape + (nq, dv_w), dtype=q.dtype)
    lse = cupy.empty(batch_shape + (nq,), dtype=lse_dtype(q.dtype))
    addresses = {"q": q, "k": k, "v": v, "out": out, "lse": lse, **_slopes(mods)}
    key = _plan_key("fwd", addresses, scale, causal, mods, dropout)
    # float32 on the wgmma path: the kernel reads float16 pieces of k and v (_split), and q itself (it
    # splits each q tile as it loads it).
    split_width = _split_width(q.dtype, d_w, dv_w, mods, dropout)
    if split_width:
        (_, k, v), exponents = _split.split((None, k, v), split_width, batch_shape, max(nq, nk))
        addresses.update(k=k, v=v, split_exponents=exponents)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        dtype = q.dtype if not split_width else numpy.float32
        variant = _variant("fwd", dtype, d_w, dv_w, causal, mods, dropout)
        arrays, sizes, strides, copied = _layout(batch_shape, {"q": q, "k": k, "v": v, "out": out, **_mod_arrays(mods)})
        batch = math.prod(batch_shape)
        others = {"lse": lse}
        if split_width:
            others["split_exponents"] = addresses["split_exponents"]
        params = _params(arrays, sizes, strides, batch=batch, nq=nq, nk=nk, d=d_w, dv=dv_w, scale=scale,
                         others=others, mods=mods, causal=causal, dropout=dropout)
        maps = None
        if variant.warp_specialized:
            if (_tma.available() and all(_tma.describable(arrays[name], sizes, strides[name]) for name in _MAPPED)
                    and (not variant.block_mask or _ws_block_mask_fits(nk))):
                block = variant.tiles("fwd").block
                maps = _tma.TensorMaps(arrays, sizes, strides, {"q": _config.WS_WARPGROUP_ROWS, "k": block, "v": block})
            else:
                variant = _variant("fwd", dtype, d_w, dv_w, causal, mods, dropout, ws=False)
        plan = _Plan(_functions(variant), variant, params, [("fwd", nq, batch)], maps, arrays)
        if copied:  # the parameters point at copies made for this call
            plan.launch(None, None)
            return _unpad(arrays["out"], dv), lse
        if key is not None:  # (the modifiers' arrays: planned never, launched once)
            _remember(key, plan)
    plan.launch(addresses, dropout)
    return _unpad(out, dv), lse


def _ws_block_mask_fits(nk: int) -> bool:
    """Whether the warp-specialized forward's block-mask walk holds a key axis of nk keys (its key tiles, as
    bits and entries in shared memory: _config.WS_BLOCK_MASK_TILES)."""
    return -(-nk // _modifiers.BLOCK_MASK_TILE) <= _config.WS_BLOCK_MASK_TILES


def _split_width(dtype, d: int, dv: int, mods, dropout, direction: str = "fwd") -> int:
    """HEAD_DIM of a call that runs on float16 pieces of float32 inputs (the wgmma path), else 0."""
    if dtype != numpy.float32:
        return 0
    head_dim = _config.padded_head_dim(max(d, dv))
    return head_dim if uses_wgmma(4, head_dim, direction, mods is not None, dropout is not None) else 0


def attention_backward(dout, q, k, v, out, lse, *, scale: float, causal: bool, mods=None, dropout=None):
    """dq, dk, dv with the full (broadcast) batch shape, in the input dtype, and dbias (the bias's
    shape and dtype) or None."""
    import cupy

    batch_shape, (nq, d), nk, dv = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
    vec = 16 // q.dtype.itemsize
    d_w, dv_w = _round_up(d, vec), _round_up(dv, vec)
    q, k = _kernel_ready(q, d_w), _kernel_ready(k, d_w)
    v, out, dout = (_kernel_ready(x, dv_w) for x in (v, out, dout))
    acc = lse_dtype(q.dtype)
    if not (lse.shape == batch_shape + (nq,) and lse.dtype == acc and lse.flags.c_contiguous):
        lse = cupy.ascontiguousarray(cupy.broadcast_to(lse, batch_shape + (nq,)), dtype=acc)
    dq = cupy.empty(batch_shape + (nq, d_w), dtype=q.dtype)
    dk = cupy.empty(batch_shape + (nk, d_w), dtype=q.dtype)
    dv_ = cupy.empty(batch_shape + (nk, dv_w), dtype=q.dtype)
    lse_log2 = cupy.empty(batch_shape + (nq,), dtype=acc)
    delta = cupy.empty(batch_shape + (nq,), dtype=acc)
    addresses = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv_, "lse": lse,
                 "lse_log2": lse_log2, "delta": delta, **_slopes(mods)}
    # float32 on the wgmma path: the passes read float16 pieces of q, k, v, dout (_split); the preprocess
    # reads out and dout themselves. (Not planned: the pieces are made per call anyway.)
    split_width = _split_width(q.dtype, d_w, dv_w, mods, dropout, "bwd")
    planned = max(nq, nk) <= _config.CHAIN_ROWS and not split_width
    key = _plan_key("bwd", addresses, scale, causal, mods, dropout) if planned else None
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        plan.launch(addresses, dropout)
        return _unpad(dq, d), _unpad(dk, d), _unpad(dv_, dv), None
    variant = _variant("bwd", q.dtype, d_w, dv_w, causal, mods, dropout)
    mod_arrays, accumulator = _mod_arrays(mods), None
    if mods is not None and mods.bias is not None:
        accumulator = _dbias_buffer(mods, q.dtype)
        mod_arrays["dbias"] = cupy.broadcast_to(accumulator, mods.bias.shape)
    arrays, sizes, strides, copied = _layout(
        batch_shape, {"q": q, "k": k, "v": v, "out": out, "dout": dout, **mod_arrays})
    batch = math.prod(batch_shape)
    others = {"dq": dq, "dk": dk, "dv": dv_, "lse": lse, "lse_log2": lse_log2, "delta": delta}
    params = _params(arrays, sizes, strides, batch=batch, nq=nq, nk=nk, d=d_w, dv=dv_w, scale=scale,
                     others=others, mods=mods, causal=causal, dropout=dropout)
    functions = _functions(variant)
    if key is not None and not copied:  # (the launches of a chained pass are not planned: key is None)
        plan = _Plan(functions, variant, params, [("preprocess", nq, batch), ("dkdv", nk, batch), ("dq", nq, batch)])
        _remember(key, plan)
        plan.launch(None, None)
        return _unpad(dq, d), _unpad(dk, d), _unpad(dv_, dv), None
    _launch(functions, variant, "preprocess", nq, batch, params)
    if split_width:
        (q, k, v, dout), others["split_exponents"] = _split.split((q, k, v, dout), split_width, batch_shape, max(nq, nk))
        arrays, sizes, strides, _ = _layout(batch_shape, {"q": q, "k": k, "v": v, "out": out, "dout": dout})
        params = _params(arrays, sizes, strides, batch=batch, nq=nq, nk=nk, d=d_w, dv=dv_w, scale=scale,
                         others=others, causal=causal)
    _passes_side_by_side(lambda: _launch_summed(functions, variant, "dkdv", nk, batch, params, nq, (dk, dv_)),
                         lambda: _launch_summed(functions, variant, "dq", nq, batch, params, nk, (dq,)))
    dbias = None
    if accumulator is not None:
        from ._api import sum_to_shape

        # A full-shape accumulator (the > 3 leading dims fallback) still has to be summed over the
        # bias's broadcast dims; the usual stride-0 one already holds the sums.
        dbias = sum_to_shape(arrays["dbias"], accumulator.shape) if copied else accumulator
        dbias = dbias.reshape(mods.bias_shape).astype(mods.bias.dtype, copy=False)
    return _unpad(dq, d), _unpad(dk, d), _unpad(dv_, dv), dbias


def attention_probs(q, k, v, *, scale: float, causal: bool, mods=None):
    """P (*batch, Nq, Nk) in lse_dtype: the forward's lse, then the probs kernel over every tile."""
    import cupy

    _, lse = attention_forward(q, k, v, scale=scale, causal=causal, mods=mods)
    batch_shape, (nq, d), nk = q.shape[:-2], q.shape[-2:], k.shape[-2]
    d_w = _round_up(d, 16 // q.dtype.itemsize)
    variant = _variant("probs", q.dtype, d_w, d_w, causal, mods)
    q, k = _kernel_ready(q, d_w), _kernel_ready(k, d_w)
    probs = cupy.empty(batch_shape + (nq, nk), dtype=lse_dtype(q.dtype))
    arrays, sizes, strides, _ = _layout(batch_shape, {"q": q, "k": k, **_mod_arrays(mods)})
    batch = math.prod(batch_shape)
    others = {"out": probs, "lse": lse}
    params = _params(arrays, sizes, strides, batch=batch, nq=nq, nk=nk, d=d_w, dv=d_w, scale=scale,
                     others=others, mods=mods, causal=causal)
    _launch(_functions(variant), variant, "probs", nq, batch, params, cols=nk)
    return probs


# ----------------------------------------------------------------------------- variable-length batches
def _varlen_params(packed, arrays: dict, *, d: int, dv: int, scale: float, causal: bool, mods, dropout,
                   others: dict, cu_q, cu_k):
    """AttnParams of a packed batch (cupyflash._varlen): flat batch b = (s * Hk + hk) * G + g, the
    sequence s with batch stride 0 (its rows come from cu_seqlens), the heads split into (Hk, G) so that
    k and v have stride 0 along the G query heads that share them; q, out, dout (total_q, H, .) and k, v
    (total_k, Hk, .) with any row and head strides (unit column stride)."""
    hk, g = packed.kv_heads, packed.groups
    # nq, nk: the longest sequences, which size the grid; the kernels read each one's own from cu_seqlens.
    p = _new_params({**arrays, **others, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, batch=packed.batch * packed.heads,
                    batch1=hk, batch2=g, nq=packed.max_q, nk=packed.max_k, d=d, dv=dv, scale=scale, causal=causal,
                    mods=mods, dropout=dropout)
    for name, array in arrays.items():
        row, head = (s // array.dtype.itemsize for s in array.strides[:2])
        p[f"{name}_stride"] = [0, g * head, head, row] if name in ("q", "out", "dout") else [0, head, 0, row]
    p["heads"], p["total_q"], p["total_k"] = packed.heads, packed.total_q, packed.total_k
    return p


def _device_offsets(packed):
    """cu_seqlens as the kernels read them: int32 on the current device (the validated host copies)."""
    import cupy

    return (cupy.asarray(packed.cu_q.astype(numpy.int32)), cupy.asarray(packed.cu_k.astype(numpy.int32)))


def attention_varlen_forward(q, k, v, packed, *, scale: float, causal: bool, mods=None, dropout=None):
    """out (total_q, H, Dv) and lse (H, total_q) in lse_dtype of a packed batch; no padding anywhere."""
    import cupy

    vec = 16 // q.dtype.itemsize
    d_w, dv_w = _round_up(packed.d, vec), _round_up(packed.dv, vec)
    variant = _variant("fwd", q.dtype, d_w, dv_w, causal, mods, dropout, packed=True)
    q, k, v = _kernel_ready(q, d_w), _kernel_ready(k, d_w), _kernel_ready(v, dv_w)
    out = cupy.empty((packed.total_q, packed.heads, dv_w), dtype=q.dtype)
    lse = cupy.empty((packed.heads, packed.total_q), dtype=lse_dtype(q.dtype))
    cu_q, cu_k = _device_offsets(packed)
    others = {"lse": lse, **_alibi(mods)}  # alive until the launch
    params = _varlen_params(packed, {"q": q, "k": k, "v": v, "out": out}, d=d_w, dv=dv_w, scale=scale, causal=causal,
                            mods=mods, dropout=dropout, others=others, cu_q=cu_q, cu_k=cu_k)
    _launch(_functions(variant), variant, "fwd", packed.max_q, packed.batch * packed.heads, params)
    return _unpad(out, packed.dv), lse


def attention_varlen_backward(dout, q, k, v, out, lse, packed, *, scale: float, causal: bool, mods=None,
                              dropout=None):
    """dq (total_q, H, D), dk (total_k, Hk, D), dv (total_k, Hk, Dv) of a packed batch. The kernels write
    per-head arrays (H, total, .); dk and dv are then summed over each group's G query heads (in lse_dtype)."""
    import cupy

    vec = 16 // q.dtype.itemsize
    d_w, dv_w = _round_up(packed.d, vec), _round_up(packed.dv, vec)
    variant = _variant("bwd", q.dtype, d_w, dv_w, causal, mods, dropout, packed=True)
    q, k = _kernel_ready(q, d_w), _kernel_ready(k, d_w)
    v, out, dout = (_kernel_ready(x, dv_w) for x in (v, out, dout))
    acc = lse_dtype(q.dtype)
    lse = cupy.ascontiguousarray(lse, dtype=acc)
    h, total_q, total_k = packed.heads, packed.total_q, packed.total_k
    dq = cupy.empty((h, total_q, d_w), dtype=q.dtype)
    dk = cupy.empty((h, total_k, d_w), dtype=q.dtype)
    dv_ = cupy.empty((h, total_k, dv_w), dtype=q.dtype)
    lse_log2, delta = (cupy.empty((h, total_q), dtype=acc) for _ in range(2))
    cu_q, cu_k = _device_offsets(packed)
    others = {"dq": dq, "dk": dk, "dv": dv_, "lse": lse, "lse_log2": lse_log2, "delta": delta, **_alibi(mods)}
    params = _varlen_params(packed, {"q": q, "k": k, "v": v, "out": out, "dout": dout}, d=d_w, dv=dv_w, scale=scale,
                            causal=causal, mods=mods, dropout=dropout, others=others, cu_q=cu_q, cu_k=cu_k)
    functions, batch = _functions(variant), packed.batch * h
    _launch(functions, variant, "preprocess", packed.max_q, batch, params)
    _passes_side_by_side(
        lambda: _launch_summed(functions, variant, "dkdv", packed.max_k, batch, params, packed.max_q, (dk, dv_)),
        lambda: _launch_summed(functions, variant, "dq", packed.max_q, batch, params, packed.max_k, (dq,)))

    def packed_rows(x, width, groups):  # (H, total, w) -> (total, H // groups, width), summed over groups
        if groups > 1:
            x = x.reshape(h // groups, groups, x.shape[1], x.shape[2]).astype(acc).sum(axis=1).astype(q.dtype)
        return cupy.ascontiguousarray(_bits(x[..., :width]).transpose(1, 0, 2)).view(q.dtype)

    return (packed_rows(dq, packed.d, 1), packed_rows(dk, packed.d, packed.groups),
            packed_rows(dv_, packed.dv, packed.groups))
