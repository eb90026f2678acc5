"""The FP8 forward on the GPU: q, k, v as e4m3 bytes with their descales (``FP8Tensor`` holders) through the
warp-specialized forward's e4m3 form (cuda_src/attention_fwd_ws.cu, ``K::FP8``).

What the kernel reads (kernel_inputs), derived from each holder once per batch shape and kept with it
(``FP8Tensor.kept``: a holder's arrays never change), with their addresses (kernel_addresses), so that a later
call on the same holders only launches:
- q and k as (*batch, N, D) contiguous bytes, D padded with zeros to a multiple of 16 bytes (TMA's row
  stride): the holder's own data where it already is so;
- V^T, (*batch, Dv, Nk') with Nk' = Nk rounded up to 32 and zeros past Nk (cuda_src/fp8_values.cu, one
  pass): 8-bit ``wgmma`` reads its B operand only K-major, so the keys must be V's columns. Within every 32
  keys they are listed in the order in which the register operand P holds them (KEY_ORDER; wgmma.cuh,
  pack_e4m3_fragments), so that P's fragments are packed straight from the score accumulators, with no
  shuffles;
- the descales as float32 (batch, blocks) per flat batch entry.
Broadcast (GQA) q and k are copied whole: the kernel reads k's and V^T's tiles at the same batch coordinates, and
V^T is written per entry (the 16-bit forward's maps hold a broadcast k and v as one entry instead). A call's plan is
kept in the plan cache (plans.py) under its call key (cupyflash/_fp8/api.py), as a dense call's is.
"""

from __future__ import annotations

import functools
import math

import numpy

from cupyflash._arrays import cupy
from cupyflash._cuda import plans, tile_policy, tma
from cupyflash._cuda.compile import functions
from cupyflash._cuda.launch import FP8_NAMES, Plan, keep_call
from cupyflash._cuda.params import dense_params, kernel_ready, layout, unpad
from cupyflash._cuda.source import OPTIONS, module_code
from cupyflash._cuda.tiles import FP8_HEAD_DIMS, WS_WARPGROUP_ROWS


def _key_order() -> numpy.ndarray:
    """Position c of a 32-key k-step -> the key the P fragments hold there: register i of a thread holds
    keys {2t, 2t + 1, 8 + 2t, 9 + 2t} (+16 for the second half) at positions 4t .. 4t + 3."""
    c = numpy.arange(32)
    half, t, i = c // 16, (c % 16) // 4, c % 4
    return 16 * half + 2 * t + (i & 1) + 8 * (i >> 1)


KEY_ORDER = _key_order()


def head_dim_for(d: int) -> int:
    """The kernel's HEAD_DIM for a head dim of d (<= 256)."""
    return next(h for h in FP8_HEAD_DIMS if d <= h)


def _atom_bytes(row_bytes: int) -> int:
    """SwizzledTile's swizzle atom for tile rows of this many bytes (copy.cuh)."""
    return 128 if row_bytes % 128 == 0 else 64 if row_bytes % 64 == 0 else 32


def _rows(x, width: int):
    """x (*batch, N, D) uint8 as contiguous rows of ``width`` >= D bytes, zero-padded."""
    if x.shape[-1] == width:
        return cupy.ascontiguousarray(x)
    padded = cupy.zeros(x.shape[:-1] + (width,), dtype=numpy.uint8)
    padded[..., : x.shape[-1]] = x
    return padded


SOURCE = "fp8_values.cu"
KERNEL = "fp8_values_transposed"
THREADS = 256  # VALUES_THREADS
_TILE = 64  # VALUES_TILE: keys and head dims per CTA
_MAX_GRID_Z = 65535


@functools.lru_cache(maxsize=None)
def _module(device_id: int):
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=module_code(SOURCE, (KERNEL,)), options=OPTIONS).get_function(KERNEL)


def transposed_values(v):
    """V^T as the kernel reads it: (*batch, Dv, Nk') uint8, Nk' = Nk rounded up to 32, keys in KEY_ORDER
    within every 32, zeros past Nk; one pass of cuda_src/fp8_values.cu (broadcast batch dims are read in
    place)."""
    batch_shape, (nk, d_v) = v.shape[:-2], v.shape[-2:]
    d_v_w = -(-d_v // 16) * 16
    v = kernel_ready(v, d_v_w)  # 16-byte rows, zero-padded; broadcast dims stay unmaterialized
    nk_pad = -(-nk // 32) * 32
    vt = cupy.empty(batch_shape + (d_v, nk_pad), dtype=numpy.uint8)
    arrays, sizes, strides, _ = layout(batch_shape, {"v": v})
    v = arrays["v"]  # a contiguous copy where more than three batch dims do not merge
    batch = math.prod(batch_shape)
    kernel = _module(cupy.cuda.Device().id)
    row = v.strides[-2] if nk > 1 else d_v_w
    for first in range(0, batch, _MAX_GRID_Z):
        grid = (-(-nk_pad // _TILE), -(-d_v // _TILE), min(_MAX_GRID_Z, batch - first))
        kernel(
            grid,
            (THREADS,),
            (
                v,
                vt,
                *(numpy.int64(s) for s in strides["v"]),
                numpy.int64(row),
                numpy.int32(sizes[1]),
                numpy.int32(sizes[2]),
                numpy.int32(first),
                numpy.int32(nk),
                numpy.int32(nk_pad),
                numpy.int32(d_v),
                numpy.int32(d_v_w),
            ),
        )
    return vt


def _descales(x, batch_shape):
    """x's descales as float32 (batch, blocks), contiguous per flat batch entry."""
    blocks = x.scale.shape[-1]
    flat = cupy.ascontiguousarray(cupy.broadcast_to(x.scale, batch_shape + (blocks,)), dtype=numpy.float32)
    return flat.reshape(math.prod(batch_shape), blocks)


def descale_rows(x) -> int:
    """Rows per descale of holder x: its block, or with one descale the whole sequence (so that the kernel's
    int32 row count holds any block at least as long)."""
    return max(1, int(x.block) if x.scale.shape[-1] > 1 else x.data.shape[-2])


def kernel_inputs(q, k, v, batch_shape) -> list:
    """[q, k, V^T, q's, k's and v's descale tables] as the kernel reads them (module docstring) for holders whose
    data broadcast to ``batch_shape``, each kept with its holder (FP8Tensor.kept)."""
    width = -(-q.data.shape[-1] // 16) * 16
    rows_key, tables_key = ("rows", batch_shape, width), ("descales", batch_shape)

    def rows(x):
        return _rows(cupy.broadcast_to(x.data, batch_shape + x.data.shape[-2:]), width)

    def values():
        return transposed_values(cupy.broadcast_to(v.data, batch_shape + v.data.shape[-2:]))

    return [
        q.kept(rows_key, lambda: rows(q)),
        k.kept(rows_key, lambda: rows(k)),
        v.kept(("values", batch_shape), values),
        *(x.kept(tables_key, lambda x=x: _descales(x, batch_shape)) for x in (q, k, v)),
    ]


def kernel_addresses(q, k, v, batch_shape) -> list:
    """The device addresses of kernel_inputs(q, k, v, batch_shape), in its order. Each holder keeps those of
    its own arrays, by the part it plays (q or k: its rows; v: its V^T), so that a call on holders seen
    before makes three lookups here (this runs on every call)."""
    rows_key, values_key = ("row addresses", batch_shape), ("value addresses", batch_shape)
    try:
        (q_rows, q_table), (k_rows, k_table), (vt, v_table) = q._kept[rows_key], k._kept[rows_key], v._kept[values_key]
    except KeyError:
        inputs = kernel_inputs(q, k, v, batch_shape)
        q_rows, k_rows, vt, q_table, k_table, v_table = (x.data.ptr for x in inputs)
        for x, key, pair in (
            (q, rows_key, (q_rows, q_table)),
            (k, rows_key, (k_rows, k_table)),
            (v, values_key, (vt, v_table)),
        ):
            x.kept(key, lambda pair=pair: pair)
    return [q_rows, k_rows, vt, q_table, k_table, v_table]


def division_magic(divisor: int) -> tuple[int, int]:
    """(magic, shift) with row // divisor == (row * magic) >> shift for every 0 <= row < 2**31, magic < 2**32:
    the kernel's descale block of a row (AttnParams.fp8_descale_magic). With l = ceil(log2(divisor)), shift =
    31 + l and magic = ceil(2**shift / divisor) = 2**shift / divisor + e (0 <= e < 1), the product over 2**shift
    is row / divisor plus row * e / 2**shift < 2**-l <= 1 / divisor, which never reaches the next integer."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {divisor}")
    shift = 31 + (divisor - 1).bit_length()
    return -(-(1 << shift) // divisor), shift


def attention_forward_fp8(q, k, v, batch_shape, *, scale: float, causal: bool, out_dtype, fast_key=None):
    """out (*batch, Nq, Dv) in ``out_dtype`` (float16 or bfloat16) and lse (*batch, Nq) float32 of e4m3 holders
    whose data and scales broadcast to ``batch_shape`` (the API validated them and handled empty problems).
    ``fast_key``: the call's key in the plan cache (role "call"), under which its plan is kept."""
    inputs = kernel_inputs(q, k, v, batch_shape)
    plan, out, lse, d_v = prepare(q, k, v, inputs, batch_shape, scale=scale, causal=causal, out_dtype=out_dtype)
    plan.launch(None, None)
    keep_call(fast_key, plan, FP8_NAMES, [(out.shape, out.dtype), (lse.shape, lse.dtype)], None, context=batch_shape)
    return unpad(out, d_v), lse


def forward_fast(found, q, k, v):
    """(out, lse) of a call whose layout key ``found`` has a kept plan, launched on the arrays the holders keep;
    None where there is none (the checked path then runs)."""
    call = plans.get(found)
    if call is None:
        return None
    out, lse = call.run(kernel_addresses(q, k, v, call.context), None)
    return unpad(out, v.data.shape[-1]), lse


def prepare(q, k, v, inputs, batch_shape, *, scale: float, causal: bool, out_dtype):
    """(plan, out, lse, Dv): everything but the launch, for the kernel's ``inputs`` (kernel_inputs)."""
    (nq, d), nk, d_v = q.data.shape[-2:], k.data.shape[-2], v.data.shape[-1]
    batch = math.prod(batch_shape)
    head_dim = head_dim_for(max(d, d_v))
    qd, kd, vt, *tables = inputs
    d_v_w = d_v + d_v % 2  # the kernel stores out in pairs of columns, 4-byte aligned
    out = cupy.empty(batch_shape + (nq, d_v_w), dtype=out_dtype)
    lse = cupy.empty(batch_shape + (nq,), dtype=numpy.float32)
    arrays, sizes, strides, _ = layout(batch_shape, {"q": qd, "k": kd, "v": vt, "out": out})  # all contiguous
    variant = tile_policy.fp8(head_dim, bool(causal), numpy.dtype(out_dtype).name)
    params = dense_params(
        arrays,
        sizes,
        strides,
        batch=batch,
        nq=nq,
        nk=nk,
        d=qd.shape[-1],
        d_v=d_v_w,
        scale=scale,
        others={"lse": lse},
        causal=causal,
    )
    params["fp8_descale"] = [table.data.ptr for table in tables]
    params["fp8_descale_blocks"] = [table.shape[1] for table in tables]
    magic = [division_magic(descale_rows(x)) for x in (q, k, v)]
    params["fp8_descale_magic"] = [m for m, _ in magic]
    params["fp8_descale_shift"] = [shift for _, shift in magic]
    block = variant.tiles("fwd").block
    maps = tma.TensorMaps(
        arrays,
        sizes,
        strides,
        {"q": WS_WARPGROUP_ROWS, "k": block, "v": head_dim},
        {"q": _atom_bytes(head_dim), "k": _atom_bytes(head_dim), "v": _atom_bytes(block)},
    )
    plan = Plan(functions(variant), variant, params, [("fwd", nq, batch)], maps, arrays)
    return plan, out, lse, d_v
