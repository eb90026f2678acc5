"""float32 inputs as float16 pieces for the forward's wgmma path (``cuda_src/split_f32.cu``).

On Hopper a float32 forward runs on the 16-bit warpgroup products: each of q, k, v is scaled per
(N, D) matrix by a power of two and split into float16 hi and lo pieces, and each product becomes three
float16 products (hi·hi + hi·lo + lo·hi). ``split`` makes the pieces (a buffer the size of the float32
input) and the exponents; ``exponents`` combines them per flat batch entry as the kernel reads them.
"""
from __future__ import annotations

import functools
import math

import numpy

_THREADS = 256
_MAX_GRID_Y = 65535
_SOURCE = "split_f32.cu"
_OPTIONS = ("-std=c++17",)
KERNELS = ("split_absmax_kernel", "split_f32_kernel")


@functools.lru_cache(maxsize=None)
def _module(device_id: int):
    import cupy

    from ._kernels import source

    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source(_SOURCE), options=_OPTIONS)
        return tuple(module.get_function(name) for name in KERNELS)


def compile_report(arch: str) -> list[dict]:
    """The split kernels through NVRTC for `arch` ("sm_80", "sm_90"), rows like _kernels.compile_report's
    (no GPU needed)."""
    from cupy.cuda import nvrtc

    from ._kernels import _parse_ptxas, source

    program = nvrtc.createProgram(source(_SOURCE), _SOURCE, [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*_OPTIONS, f"-arch={arch}", "-Xptxas", "-v"])
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed on {_SOURCE} for {arch}:\n{nvrtc.getProgramLog(program)}") from error
        stats = _parse_ptxas(nvrtc.getProgramLog(program))
    finally:
        nvrtc.destroyProgram(program)
    missing = [name for name in KERNELS if name not in stats]
    if missing:
        raise RuntimeError(f"no ptxas report for {missing} on {arch}")
    return [{"kernel": name, "arch": arch, "target": arch, **stats[name], "dynamic_smem": 0, "threads": _THREADS}
            for name in KERNELS]


def _unbroadcast(x):
    """x without its broadcast (stride-0) leading dims, as a contiguous array."""
    import cupy

    index = tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None) for n, s in zip(x.shape[:-2], x.strides[:-2]))
    return cupy.ascontiguousarray(x[index])


def split(x, width: int):
    """x (*batch, N, D) float32 (D a multiple of 4, any broadcast leading dims) -> (pieces, exponents):
    pieces (*batch, N, 2 * width) float16 with rows [hi, zeros to width | lo, zeros to width] and
    exponents (*batch) int32, x * 2^e = hi + lo per (N, D) matrix. Broadcast dims stay broadcast."""
    import cupy

    absmax, split_kernel = _module(cupy.cuda.Device().id)
    base = _unbroadcast(x)
    *lead, n, d = base.shape
    slices = math.prod(lead)
    pieces = cupy.empty(tuple(lead) + (n, 2 * width), dtype=numpy.float16)
    exponents = cupy.zeros(slices, dtype=numpy.int32)
    if slices and n:
        max_bits = cupy.zeros(slices, dtype=numpy.uint32)
        vecs = n * d // 4
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        grid_y = min(slices, _MAX_GRID_Y)
        chunks = max(1, min(-(-vecs // (_THREADS * 4)), -(-4 * sms // grid_y)))
        absmax((chunks, grid_y), (_THREADS,), (base, numpy.int64(vecs), numpy.int32(slices), max_bits))
        rows_per_block = max(1, 4 * _THREADS // (width // 4))
        split_kernel((-(-n // rows_per_block), grid_y), (_THREADS,),
                     (base, numpy.int32(n), numpy.int32(d), numpy.int32(width), numpy.int32(rows_per_block),
                      numpy.int32(slices), max_bits, pieces, exponents))
    return (cupy.broadcast_to(pieces, x.shape[:-1] + (2 * width,)),
            cupy.broadcast_to(exponents.reshape(tuple(lead)), x.shape[:-2]))


def exponents(e_q, e_k, e_v, e_dout=None):
    """(batch, 4) int32, contiguous: (e_q, e_k, e_v, e_dout) per flat batch entry, from split's exponents
    (e_dout 0 without dout: the forward)."""
    import cupy

    batch = math.prod(e_q.shape)
    found = cupy.zeros((batch, 4), dtype=numpy.int32)
    for i, e in enumerate((e_q, e_k, e_v, e_dout)):
        if e is not None:
            found[:, i] = e.reshape(batch)
    return found
