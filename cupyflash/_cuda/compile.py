"""Compiled kernels per device: each variant's modules built once per (device, variant) by NVRTC through
``cupy.RawModule`` (CuPy keeps every build in its disk cache, so a later process only loads it), the
device's abilities that selection asks about, and compiling ahead of use.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from cupyflash._arrays import cupy
from cupyflash._cuda import f32_pieces
from cupyflash._cuda.source import MIN_CC, WGMMA_CC
from cupyflash._cuda.variants import Device, Variant

_lock = threading.Lock()
modules: dict[tuple[int, Variant], dict[str, object]] = {}  # (device id, variant) -> kernel -> function


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).compute_capability)


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def current_device() -> Device:
    """The current device's abilities; none without a usable device (selection only: nothing launches).
    CUPYFLASH_NO_WGMMA=1 makes a Hopper GPU take the mma.sync kernels (for comparisons and tests)."""
    try:
        cc = compute_capability(cupy.cuda.Device().id)
    except Exception:  # no CuPy, no driver or no device
        return Device()
    no_wgmma = os.environ.get("CUPYFLASH_NO_WGMMA", "0") not in ("", "0")
    return Device(wgmma=cc == WGMMA_CC and not no_wgmma, large_smem=cc >= WGMMA_CC)


def functions(variant: Variant) -> dict[str, object]:
    """The variant's kernels on the current device, compiled once per (device, variant)."""
    device = cupy.cuda.Device()
    key = (device.id, variant)
    found = modules.get(key)
    if found is not None:
        return found
    with _lock:
        found = modules.get(key)
        if found is None:
            cc = compute_capability(device.id)
            if cc < MIN_CC:
                raise RuntimeError(
                    f"cupyflash needs a GPU of compute capability >= {MIN_CC / 10:.1f} (cp.async, "
                    f"bf16 tensor cores); device {device.id} has {cc / 10:.1f}"
                )
            built = _build_modules([(variant, kernels) for kernels in variant.modules], device.id)
            if variant.path == "pieces":  # its inputs' float16 pieces come from the split kernel
                f32_pieces.module(device.id)
            optin = cupy.cuda.runtime.getDeviceProperties(device.id)["sharedMemPerBlockOptin"]
            found = {}
            for kernel, function in built.items():
                smem = variant.smem(kernel)
                total = smem + function.shared_size_bytes  # dynamic + static (the block-mask bitmap)
                if total > optin:
                    raise RuntimeError(
                        f"cupyflash: {variant.name_expression(kernel)} needs {total} bytes of shared "
                        f"memory per block; device {device.id} allows {optin}"
                    )
                if total > 48 * 1024:
                    function.max_dynamic_shared_size_bytes = smem
                found[kernel] = function
            modules[key] = found
    return found


def _build(variant: Variant, kernels: tuple[str, ...], device_id: int) -> dict[str, object]:
    """Compile (or load from CuPy's disk cache) the module of ``kernels`` on device ``device_id``."""
    with cupy.cuda.Device(device_id):
        names = {kernel: variant.name_expression(kernel) for kernel in kernels}
        module = cupy.RawModule(
            code=variant.code(kernels), options=variant.options, name_expressions=list(names.values())
        )
        return {kernel: module.get_function(name) for kernel, name in names.items()}


def _build_modules(parts, device_id: int, max_workers: int = 16) -> dict[str, object]:
    """_build for each (variant, kernels), concurrently when there are several; kernel -> function."""
    if len(parts) == 1:
        return _build(*parts[0], device_id)
    with ThreadPoolExecutor(max_workers=min(max_workers, len(parts))) as pool:
        built = list(pool.map(lambda part: _build(*part, device_id), parts))
    return {kernel: function for part in built for kernel, function in part.items()}


def cache_dir() -> str:
    """The directory CuPy keeps compiled kernels in. CuPy 14 reads CUPY_CACHE_DIR once, when its compiler
    module is imported, into its cache backend: ask that first, then the variable, then CuPy's default."""
    backend_dir = getattr(getattr(cupy.cuda.compiler, "_kernel_cache_backend", None), "_cache_dir", None)
    if isinstance(backend_dir, str):
        return backend_dir
    return os.path.expanduser(os.environ.get("CUPY_CACHE_DIR", os.path.join("~", ".cupy", "kernel_cache")))


def compile_ahead(variants, max_workers: int = 16) -> list[str]:
    """Compile variants for the current device into CuPy's disk cache, max_workers modules at a time, so
    that their first use only loads them. Returns a message per module that failed (its first call then
    compiles, and fails, on its own)."""
    device = cupy.cuda.Device().id

    def build(part):
        try:
            _build(*part, device)
            return None
        except Exception as error:  # noqa: BLE001 - reported to the caller
            return f"{part[0]} {part[1]}: {type(error).__name__}: {error}"

    todo = [
        (v, kernels) for v in sorted(set(variants), key=repr) if (device, v) not in modules for kernels in v.modules
    ]
    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        return [message for message in pool.map(build, todo) if message]
