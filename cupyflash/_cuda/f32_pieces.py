"""float32 inputs as float16 pieces for Hopper's 16-bit warpgroup products (``cuda_src/split_f32.cu``).

On Hopper float32 runs on the 16-bit warpgroup products: each block of BLOCK_ROWS rows of k, v (and q,
dout for the backward; the forward splits its q tiles itself) is scaled by a power of two and split into
float16 hi and lo pieces, and each product becomes three float16 products (hi·hi + hi·lo + lo·hi).
``split`` makes the pieces (a buffer the size of each float32 input) and the exponents per flat batch
entry and row block, as the kernels read them, in one launch.
"""

from __future__ import annotations

import functools
import math

import numpy

from cupyflash._arrays import cupy
from cupyflash._cuda.source import MAX_GRID_Y, OPTIONS, source

THREADS = 256
SOURCE = "split_f32.cu"
KERNELS = ("split_f32_kernel",)
BLOCK_ROWS = 128  # rows per power of two: SPLIT_BLOCK_ROWS (cuda_src/pieces.cuh)
_MAX_WIDTH = 128  # SPLIT_MAX_WIDTH (cuda_src/split_f32.cu)


@functools.lru_cache(maxsize=None)
def module(device_id: int):
    """The split kernel on device ``device_id``, compiled once."""
    with cupy.cuda.Device(device_id):
        compiled = cupy.RawModule(code=source(SOURCE), options=OPTIONS)
        return tuple(compiled.get_function(name) for name in KERNELS)


def _unbroadcast(x):
    """x without its broadcast (stride-0) leading dims, as a contiguous array."""
    index = tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None) for n, s in zip(x.shape[:-2], x.strides[:-2]))
    return cupy.ascontiguousarray(x[index])


# Host mirror of `struct SplitJobs` (cuda_src/split_f32.cu), same field order, C alignment.
_MAX_JOBS = 4
_JOBS_DTYPE = numpy.dtype(
    [(name, numpy.uint64, (_MAX_JOBS,)) for name in ("x", "pieces", "exponents")]
    + [(name, numpy.int64, (_MAX_JOBS,)) for name in ("slices", "slice_stride")]
    + [(name, numpy.int32, (_MAX_JOBS,)) for name in ("block_stride", "rows", "d")]
    + [("width", numpy.int32)],
    align=True,
)
_JOBS_BYTES = numpy.dtype((numpy.void, _JOBS_DTYPE.itemsize))


def split(arrays, width: int, batch_shape: tuple, rows: int | None = None):
    """The float32 inputs of one call in the kernels' order (q, k, v, and dout for the backward), each
    (*batch_shape, N, D) with D a multiple of 4 and any broadcast leading dims, or None for one that is
    not split here (the forward's q) -> (pieces, exponents).
    pieces: per input, (*batch_shape, N, 2 * width) float16 with rows [hi, zeros to width | lo, zeros to
    width] (broadcast dims stay broadcast; None for None). exponents: (batch, blocks, 4) int32, per flat
    batch entry and block of BLOCK_ROWS rows the e of each input, in column j for arrays[j] (x * 2^e = hi +
    lo), as the kernels read it (AttnParams.split_exponents); blocks covers `rows` (the kernels' max(Nq, Nk);
    default: the longest input given), and entries past an input's rows, or of a None input, are left
    unwritten (no kernel reads them).
    One launch for every input, and a copy per broadcast input to spread its exponents over the batch."""
    if not (4 <= width <= _MAX_WIDTH and width & (width - 1) == 0):
        raise ValueError(f"width must be a power of two from 4 to {_MAX_WIDTH}, got {width}")
    if len(arrays) > _MAX_JOBS:
        raise ValueError(f"at most {_MAX_JOBS} arrays, got {len(arrays)}")
    batch = math.prod(batch_shape)
    present = [j for j, x in enumerate(arrays) if x is not None]
    longest = max(arrays[j].shape[-2] for j in present)
    if rows is None:
        rows = longest
    elif rows < longest:
        raise ValueError(f"rows must cover every input's {longest} rows, got {rows}")
    blocks = -(-rows // BLOCK_ROWS)
    bases = {j: _unbroadcast(arrays[j]) for j in present}
    slices = {j: math.prod(bases[j].shape[:-2]) for j in present}
    # An input with every batch entry its own matrix writes its exponents straight into its column;
    # a broadcast one into its own (slices, blocks) array, spread afterwards.
    spread = [j for j in present if slices[j] != batch]
    words = cupy.empty(blocks * (4 * batch + sum(slices[j] for j in spread)), dtype=numpy.int32)
    exponents = words[: 4 * batch * blocks].reshape(batch, blocks, 4)
    jobs = numpy.zeros(1, dtype=_JOBS_DTYPE)
    pieces, own, offset = [None] * len(arrays), [], 4 * batch * blocks
    for i, j in enumerate(present):
        *lead, n, d = bases[j].shape
        pieces[j] = cupy.empty(tuple(lead) + (n, 2 * width), dtype=numpy.float16)
        jobs["x"][0, i], jobs["pieces"][0, i] = bases[j].data.ptr, pieces[j].data.ptr
        if j in spread:
            per_slice = words[offset : offset + slices[j] * blocks]
            own.append((j, per_slice.reshape(tuple(lead) + (blocks,))))
            offset += slices[j] * blocks
            jobs["exponents"][0, i], jobs["slice_stride"][0, i], jobs["block_stride"][0, i] = (
                per_slice.data.ptr,
                blocks,
                1,
            )
        else:
            jobs["exponents"][0, i] = exponents[:, :, j].data.ptr
            jobs["slice_stride"][0, i], jobs["block_stride"][0, i] = 4 * blocks, 4
        jobs["slices"][0, i], jobs["rows"][0, i], jobs["d"][0, i] = slices[j], n, d
    jobs["width"] = width
    grid_y = min(max(slices.values()), MAX_GRID_Y)
    if grid_y and longest:
        (kernel,) = module(cupy.cuda.Device().id)
        kernel((-(-longest // BLOCK_ROWS), grid_y, len(present)), (THREADS,), (jobs.view(_JOBS_BYTES),))
    for j, per_slice in own:
        exponents[:, :, j] = cupy.broadcast_to(per_slice, tuple(batch_shape) + (blocks,)).reshape(batch, blocks)
    return [
        None if piece is None else cupy.broadcast_to(piece, x.shape[:-1] + (2 * width,))
        for piece, x in zip(pieces, arrays)
    ], exponents
