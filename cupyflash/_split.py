"""float32 inputs as float16 pieces for the forward's wgmma path (``cuda_src/split_f32.cu``).

On Hopper float32 runs on the 16-bit warpgroup products: each of q, k, v (and dout) is scaled per
(N, D) matrix by a power of two and split into float16 hi and lo pieces, and each product becomes three
float16 products (hi·hi + hi·lo + lo·hi). ``split`` makes the pieces (a buffer the size of each float32
input) and the exponents per flat batch entry, as the kernels read them.
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


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_id: int) -> int:
    """SMs of a device (Device.attributes queries every attribute, ~0.1 ms a call)."""
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


def _unbroadcast(x):
    """x without its broadcast (stride-0) leading dims, as a contiguous array."""
    import cupy

    index = tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None) for n, s in zip(x.shape[:-2], x.strides[:-2]))
    return cupy.ascontiguousarray(x[index])


# Host mirror of `struct SplitJobs` (cuda_src/split_f32.cu), same field order, C alignment.
_MAX_JOBS = 4
_JOBS_DTYPE = numpy.dtype(
    [(name, numpy.uint64, (_MAX_JOBS,)) for name in ("x", "pieces", "max_bits", "exponents")]
    + [("slices", numpy.int64, (_MAX_JOBS,))]
    + [(name, numpy.int32, (_MAX_JOBS,)) for name in ("rows", "d", "exponent_stride")]
    + [("width", numpy.int32), ("rows_per_block", numpy.int32)],
    align=True,
)
_JOBS_BYTES = numpy.dtype((numpy.void, _JOBS_DTYPE.itemsize))


def split(arrays, width: int, batch_shape: tuple):
    """The float32 inputs of one call (q, k, v, and dout for the backward), each (*batch_shape, N, D) with D a
    multiple of 4 and any broadcast leading dims -> (pieces, exponents). pieces: per input, (*batch_shape,
    N, 2 * width) float16 with rows [hi, zeros to width | lo, zeros to width] (broadcast dims stay
    broadcast); exponents: (batch, 4) int32, per flat batch entry the e of its (N, D) matrix of each input
    (x * 2^e = hi + lo; 0 for a missing dout), as the kernels read it (AttnParams.split_exponents).
    Two launches per input, and a copy per broadcast input to spread its exponents over the batch."""
    import cupy

    absmax, split_kernel = _module(cupy.cuda.Device().id)
    batch = math.prod(batch_shape)
    bases = [_unbroadcast(x) for x in arrays]
    slices = [math.prod(b.shape[:-2]) for b in bases]
    # An input with every batch entry its own matrix writes its exponents straight into its column.
    spread = [n != batch for n in slices]
    words = cupy.zeros(4 * batch + sum(slices) + sum(n for n, s in zip(slices, spread) if s), dtype=numpy.int32)
    exponents = words[: 4 * batch].reshape(batch, 4)
    sms = _multiprocessors(cupy.cuda.Device().id)
    rows_per_block = max(1, 4 * _THREADS // (width // 4))
    pieces, own, offset = [], [], 4 * batch
    for j, base in enumerate(bases):
        *lead, rows, d = base.shape
        piece = cupy.empty(tuple(lead) + (rows, 2 * width), dtype=numpy.float16)
        pieces.append(piece)
        # One input per launch pair: its second read (the split) then finds it in L2 more often than when
        # every input's largest value is found first (measured 5-10% of a float32 forward at N = 1k-4k).
        job = numpy.zeros(1, dtype=_JOBS_DTYPE)
        job["x"][0, 0], job["pieces"][0, 0] = base.data.ptr, piece.data.ptr
        job["max_bits"][0, 0] = words[offset:].data.ptr
        offset += slices[j]
        if spread[j]:
            own.append((j, words[offset: offset + slices[j]].reshape(tuple(lead))))
            job["exponents"][0, 0], job["exponent_stride"][0, 0] = own[-1][1].data.ptr, 1
            offset += slices[j]
        else:
            job["exponents"][0, 0], job["exponent_stride"][0, 0] = exponents[:, j].data.ptr, 4
        job["slices"][0, 0], job["rows"][0, 0], job["d"][0, 0] = slices[j], rows, d
        job["width"], job["rows_per_block"] = width, rows_per_block
        grid_y = min(slices[j], _MAX_GRID_Y)
        if grid_y and rows:
            vecs = rows * d // 4
            chunks = max(1, min(-(-vecs // (_THREADS * 4)), -(-4 * sms // grid_y)))
            args = (job.view(_JOBS_BYTES),)
            absmax((chunks, grid_y, 1), (_THREADS,), args)
            split_kernel((-(-rows // rows_per_block), grid_y, 1), (_THREADS,), args)
    for j, per_slice in own:
        exponents[:, j] = cupy.broadcast_to(per_slice, batch_shape).reshape(batch)
    return [cupy.broadcast_to(piece, x.shape[:-1] + (2 * width,)) for piece, x in zip(pieces, arrays)], exponents
