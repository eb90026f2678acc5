"""The offline compile audit: every shipped kernel through NVRTC for sm_80 and sm_90(a), with no GPU, and
ptxas' report of each (registers, spills, stack frame, static shared memory, and its notes that it
serialized a kernel's warpgroup products). CI fails on any spill, stack frame or serialized product.

Reports are kept on disk beside CuPy's kernel cache (``$CUPY_CACHE_DIR/cupyflash-ptxas``), keyed on the
source, the options and the NVRTC version, so that a second audit of the same variants only reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cupyflash._cuda import decode_tiles, f32_pieces, fp8, ring_states
from cupyflash._cuda.compile import cache_dir
from cupyflash._cuda.source import OPTIONS, source
from cupyflash._cuda.tile_policy import variants_for
from cupyflash._cuda.variants import Variant

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_PROPERTIES = re.compile(r"Function properties for (\w+)")
# ptxas' C7510-C7519 notes: it serialized a kernel's warpgroup products (wgmma), naming the function. Such a
# kernel loses the overlap of its products with everything else (docs/design/compile.md).
_SERIALIZED = re.compile(r"\(C751\d\).*?function '(\w+)'")


def _nvrtc():
    """CuPy's NVRTC bindings, which work without a GPU (loaded on first use: CuPy is optional)."""
    from cupy.cuda import nvrtc

    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per mangled entry: registers, spills, stack frame, static shared memory, and how many notes say that
    its warpgroup products were serialized (``serialized_wgmma``). A function the entry calls (not inlined)
    has its own properties after the entry's: its spills and stack frame count for the entry too (the larger
    of the two), so that they are never read in place of the entry's."""
    found: dict[str, dict[str, int]] = {}

    def entry(name: str) -> dict[str, int]:
        return found.setdefault(
            name,
            {
                "registers": -1,
                "spill_stores": -1,
                "spill_loads": -1,
                "stack_frame": -1,
                "static_smem": 0,
                "serialized_wgmma": 0,
            },
        )

    current, current_name, properties_of = None, None, None
    for line in log.splitlines():
        if m := _SERIALIZED.search(line):
            entry(m.group(1))["serialized_wgmma"] += 1
        elif m := _ENTRY.search(line):
            current_name = m.group(1)
            current = entry(current_name)
        elif m := _PROPERTIES.search(line):
            properties_of = m.group(1)
        elif current is not None and (m := _FRAME.search(line)):
            frame = dict(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            if properties_of == current_name or properties_of is None:
                current.update(frame)
            else:  # a function the entry calls
                current.update({name: max(value, current[name]) for name, value in frame.items()})
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
    return found


def _compile(code: str, filename: str, options: list, names: dict) -> dict:
    """kernel -> ptxas' report of it, from one NVRTC compile of ``code`` with ``names`` (kernel -> name
    expression, or the plain name of an extern "C" kernel)."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(code, filename, [], [])
    try:
        for name in names.values():
            if "<" in name:
                nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed on {filename} ({options}):\n{nvrtc.getProgramLog(program)}") from error
        stats = parse_ptxas(nvrtc.getProgramLog(program))
        found = {}
        for kernel, name in names.items():
            lowered = nvrtc.getLoweredName(program, name) if "<" in name else name
            if lowered not in stats:
                raise RuntimeError(f"no ptxas report for {name} ({lowered}) in {filename} ({options})")
            found[kernel] = stats[lowered]
        return found
    finally:
        nvrtc.destroyProgram(program)


def _cached(key_parts, compute) -> dict:
    """compute(), or its result from an earlier run with the same key_parts (JSON-able)."""
    key = hashlib.sha256(json.dumps([*key_parts, nvrtc_version()]).encode()).hexdigest()
    cache = Path(cache_dir()) / "cupyflash-ptxas"
    path = cache / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    stats = compute()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(stats))
        tmp.replace(path)  # atomic: concurrent audits never read half a file
    except OSError:
        pass  # a read-only cache only costs the next audit a compile
    return stats


def compile_variant(variant: Variant, arch: str) -> list[dict]:
    """One variant through NVRTC for ``arch`` ("sm_80" or "sm_90": the family; Hopper's paths target
    sm_90a), no GPU needed: one row per kernel."""
    target = variant.compile_targets()[arch]
    options = [*OPTIONS, f"-arch={target}", "-Xptxas", "-v"]
    rows = []
    for kernels in variant.sources:  # (the fused backward's preprocess is another file's)
        names = {kernel: variant.name_expression(kernel) for kernel in kernels}
        code = variant.code(kernels)
        stats = _cached(
            [code, options, list(names.values())], lambda: _compile(code, f"{variant.direction}.cu", options, names)
        )
        rows += [
            {
                "kernel": name,
                "arch": arch,
                "target": target,
                **stats[kernel],
                "dynamic_smem": variant.smem(kernel),
                "threads": variant.threads(kernel),
            }
            for kernel, name in names.items()
        ]
    return rows


def compile_plain_kernels(arch: str) -> list[dict]:
    """The kernels outside the variant tables through NVRTC for ``arch``, rows like compile_variant's: the
    float32 split kernel (f32_pieces), ring attention's running-result kernels (ring_states) and the FP8 forward's
    V^T (fp8)."""
    options = [*OPTIONS, f"-arch={arch}", "-Xptxas", "-v"]
    rows = []
    for filename, code, names, threads in (
        (f32_pieces.SOURCE, source(f32_pieces.SOURCE), f32_pieces.KERNELS, f32_pieces.THREADS),
        (ring_states.SOURCE, ring_states.code(), ring_states.KERNELS, ring_states.THREADS),
        (fp8.SOURCE, fp8.module_code(fp8.SOURCE, (fp8.KERNEL,)), (fp8.KERNEL,), fp8.THREADS),
    ):
        by_name = {name: name for name in names}
        stats = _cached([code, options, list(names)], lambda: _compile(code, filename, options, by_name))
        rows += [
            {"kernel": name, "arch": arch, "target": arch, **stats[name], "dynamic_smem": 0, "threads": threads}
            for name in names
        ]
    return rows


def shipped_for(arch: str) -> list:
    """Every shipped variant built for ``arch``: the attention kernels' and the decode kernels'."""
    return variants_for(arch) + decode_tiles.variants_for(arch)


def compile_report(arch: str, variants: list[Variant] | None = None, progress=None) -> list[dict]:
    """Compile every shipped variant built for ``arch`` (or ``variants``), one row per kernel; by default
    the kernels outside the tables too. ``progress(done, total)`` is called as variants finish."""
    extra = compile_plain_kernels(arch) if variants is None else []
    variants = shipped_for(arch) if variants is None else variants
    rows = []
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for done, found in enumerate(pool.map(lambda variant: compile_variant(variant, arch), variants), 1):
            rows += found
            if progress is not None:
                progress(done, len(variants))
    return rows + extra
