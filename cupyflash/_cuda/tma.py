"""TMA tensor maps (CUtensorMap) of q, k and v for the warp-specialized forward (cuda_src/tma.cuh,
attention_fwd_ws.cu), encoded by the CUDA driver's ``cuTensorMapEncodeTiled`` through ctypes: the driver
library CuPy itself runs on, so no new dependency.

Each input is described as a 5-d tensor (columns, rows, batch2, batch1, batch0) over the collapsed batch
layout (params.layout) with a box of one 128-byte swizzle atom's columns by a tile's rows: the hardware
writes SwizzledTile's layout (copy.cuh) and fills rows and columns past the tensor's end with zeros. The
maps hold the arrays' addresses, so a call encodes its own (on the host: the driver touches no GPU) unless
its addresses are the previous call's (TensorMaps.encode keeps that one)."""

from __future__ import annotations

import ctypes
import functools

import numpy

from cupyflash._arrays import cupy

MAP_BYTES = 128
MAPPED = ("q", "k", "v")  # the inputs the warp-specialized forward reads through tensor maps
_SWIZZLES = {128: 3, 64: 2, 32: 1}  # CU_TENSOR_MAP_SWIZZLE_{128B,64B,32B}, by swizzle atom bytes (copy.cuh)
_L2_PROMOTION_128B = 2
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
# CU_TENSOR_MAP_DATA_TYPE_: FLOAT16 6, UINT8 0 (the FP8 forward's e4m3 bytes); bfloat16 is 9
_DTYPES = {numpy.dtype(numpy.float16): 6, numpy.dtype(numpy.uint8): 0}
_BFLOAT16 = 9
_MAX_STRIDE = 1 << 40


@functools.lru_cache(maxsize=None)
def _encoder():
    """cuTensorMapEncodeTiled, or None where the driver library cannot be loaded or lacks it."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            library = ctypes.CDLL(name)
            function = library.cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        function.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
        return function
    return None


def available() -> bool:
    """Whether tensor maps can be encoded here (the driver library has cuTensorMapEncodeTiled)."""
    return _encoder() is not None


def describable(array, sizes, batch_strides, broadcast: bool = False) -> bool:
    """Whether a tensor map can describe ``array`` (*batch, N, D) over the collapsed batch (``sizes``, its
    ``batch_strides`` in elements): 16-byte aligned start and strides. A broadcast (stride 0) batch dim of more
    than one entry, which TMA cannot step through, only where ``broadcast``: the map then has that dim of one
    entry, and the kernel reads it at coordinate 0 (the warp-specialized forward's and the fused backward's k and
    v)."""
    itemsize = array.dtype.itemsize
    row = array.strides[-2] if array.shape[-2] > 1 else 16
    if array.data.ptr % 16 or row % 16 or not 0 < row < _MAX_STRIDE:
        return False
    return all(
        n == 1 or (broadcast and s == 0) or (s * itemsize % 16 == 0 and 0 < s * itemsize < _MAX_STRIDE)
        for n, s in zip(sizes, batch_strides)
    )


class TensorMaps:
    """The maps of q, k and v for one layout; ``encode`` fills in the arrays' addresses. ``box_rows``:
    name -> the rows of that input's tiles; ``atom_bytes``: name -> the swizzle atom of its tiles' rows
    (SwizzledTile::ATOM_BYTES; 128 unless given). ``broadcast``: the names whose kernel reads a broadcast batch dim
    (stride 0) at coordinate 0, which their maps hold as one entry; any other input must have no such dim."""

    def __init__(
        self,
        arrays: dict,
        sizes,
        batch_strides: dict,
        box_rows: dict,
        atom_bytes: dict | None = None,
        broadcast: tuple = (),
    ):
        self._function = _encoder()
        if self._function is None:
            raise RuntimeError("cupyflash: the CUDA driver's cuTensorMapEncodeTiled is not available")
        self._names = tuple(box_rows)
        self._fields = {}
        for name in self._names:
            array = arrays[name]
            itemsize = array.dtype.itemsize
            cols, rows = array.shape[-1], array.shape[-2]
            row_bytes = array.strides[-2] if rows > 1 else cols * itemsize
            # (cols, rows, b2, b1, b0); a batch dim of one entry, or broadcast (stride 0; describable), is one
            # entry in the map, with any valid stride.
            own = [n if s else 1 for n, s in zip(sizes, batch_strides[name])]
            if own != list(sizes) and name not in broadcast:
                raise ValueError(
                    f"cupyflash: {name} is broadcast over batch dims {sizes} (strides {batch_strides[name]}), which "
                    "its kernel reads entry by entry: copy it first"
                )
            dims = (ctypes.c_uint64 * 5)(cols, rows, own[2], own[1], own[0])
            strides = (ctypes.c_uint64 * 4)(
                row_bytes,
                *(s * itemsize if n > 1 else 16 for n, s in zip(reversed(own), reversed(batch_strides[name]))),
            )
            atom = (atom_bytes or {}).get(name, 128)
            box = (ctypes.c_uint32 * 5)(atom // itemsize, box_rows[name], 1, 1, 1)
            code = _DTYPES.get(array.dtype, _BFLOAT16)
            self._fields[name] = (code, dims, strides, box, _SWIZZLES[atom])
        self._element_strides = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)
        self._arg_dtype = numpy.dtype((numpy.void, MAP_BYTES * len(self._names)))
        self._last = (None, None)  # (addresses, argument) of the last encoding

    def encode(self, addresses: dict):
        """The kernel argument (a struct of the maps, by value) for arrays at these addresses: the last
        call's when they are the same (the argument is never written after it is made)."""
        found = tuple(addresses[name] for name in self._names)
        last, arg = self._last
        if found == last:
            return arg
        # Encoded straight into the argument's bytes, at a 64-byte boundary (CUtensorMap's alignment); a new
        # buffer per encoding, as plans may launch from several threads.
        size = MAP_BYTES * len(self._names)
        raw = numpy.empty(size + 64, dtype=numpy.uint8)
        offset = -raw.ctypes.data % 64
        at = raw.ctypes.data + offset
        for i, name in enumerate(self._names):
            code, dims, strides, box, swizzle = self._fields[name]
            arguments = (
                at + i * MAP_BYTES,
                code,
                5,
                found[i],
                dims,
                strides,
                box,
                self._element_strides,
                0,
                swizzle,
                _L2_PROMOTION_128B,
                0,
            )
            error = self._function(*arguments)
            if error == _INVALID_CONTEXT:
                # A thread whose runtime has not yet made the device's context current (its first CUDA call
                # can be this driver call): setting the device makes it current.
                cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())
                error = self._function(*arguments)
            if error:
                raise RuntimeError(
                    f"cupyflash: cuTensorMapEncodeTiled failed for {name} (CUresult {error}): "
                    f"dims {tuple(dims)}, strides {tuple(strides)} bytes, box {tuple(box)}"
                )
        arg = raw[offset : offset + size].view(self._arg_dtype)
        self._last = (found, arg)
        return arg
