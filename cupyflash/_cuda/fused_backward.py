"""The warp-specialized fused backward's launches (cuda_src/attention_bwd_ws.cu): the preprocess, the fused
kernel over q, k, v and dout's tensor maps with its float32 dq accumulator and the counters of its ordered adds,
then dq's conversion. Called unplanned: it serves long sequences, whose GPU time dwarfs a call's host time.
"""

from __future__ import annotations

import numpy

from cupyflash._arrays import cupy
from cupyflash._cuda import tiles, tma
from cupyflash._cuda.compile import sm_count
from cupyflash._cuda.launch import CPointer, launch, launch_shape
from cupyflash._cuda.params import PARAMS_BYTES

MAPPED = ("q", "k", "v", "dout")  # the inputs it reads through tensor maps, in BwdTensorMaps' order


def describable(arrays, sizes, strides) -> bool:
    """Whether tensor maps describe its inputs (no broadcast batch dims, 16-byte aligned strides)."""
    return tma.available() and all(tma.describable(arrays[name], sizes, strides[name]) for name in MAPPED)


def adds_by_arrival(nk: int, head_dim: int, causal: bool, sms: int, deterministic: bool = True, *,
                    keys: int) -> bool:
    """Whether key blocks take their turn at a query block in the order they reach it (attention_bwd_ws.cu), else
    in the order of their index. In order: by arrival only where all of a batch entry's CTAs can be resident at
    once (one per SM: a CTA may wait for one launched after it), and without a causal mask below
    tiles.WS_BWD_INDEX_ORDER_KEYS keys, from where the index order was faster. Unordered adds wait for nothing,
    so their key blocks always walk as by arrival, each from its own query block: in index order every CTA
    would add into the same query block's accumulator at once (docs/design/backward.md). ``keys``: a CTA's key
    block."""
    if not deterministic:
        return True
    if -(-nk // keys) > sms:
        return False
    return causal or nk < tiles.WS_BWD_INDEX_ORDER_KEYS[head_dim]


def run(functions, variant, params, arrays, sizes, strides, *, batch: int, nq: int, nk: int) -> None:
    """Launch the fused backward of the dense problem whose parameters are ``params`` (dq, dk, dv and the
    preprocess's workspaces among them), on the arrays (q, k, v, dout) ``arrays`` of collapsed layout
    ``sizes``, ``strides``."""
    t = variant.tiles("bwd")
    m_blocks = -(-nq // t.block)
    chains = tiles.ws_bwd_dq_chains(t, variant.deterministic)
    chunk = m_blocks * chains * t.block * variant.head_dim  # dq_accum's floats per batch entry
    # dq_accum (float32, a sum per chain of ordered adds, in the dQ products' fragment order), then one counter
    # per (batch entry, query block, chain). In order, only the counters start at zero: the first key block of a
    # chain at a query block stores its partial, the others add. Unordered, every key block adds (into chain 0)
    # and dq_accum starts at zero too.
    workspace = cupy.empty(batch * (chunk + m_blocks * chains), dtype=numpy.float32)
    dq_accum = workspace[:batch * chunk]
    counters = workspace[batch * chunk:].view(numpy.int32)
    stream = cupy.cuda.get_current_stream()
    zeroed = counters if variant.deterministic else workspace
    cupy.cuda.runtime.memsetAsync(zeroed.data.ptr, 0, zeroed.nbytes, stream.ptr)
    rows = {"q": t.block, "k": t.rows, "v": t.rows, "dout": t.block}
    maps = tma.TensorMaps(arrays, sizes, strides, rows).encode({name: arrays[name].data.ptr for name in MAPPED})
    by_arrival = adds_by_arrival(nk, variant.head_dim, variant.causal, sm_count(cupy.cuda.runtime.getDevice()),
                                 variant.deterministic, keys=t.rows)
    argument = params.view(PARAMS_BYTES)
    launch(functions, variant, "preprocess", nq, batch, params)
    grid, block, smem = launch_shape(variant, "bwd", nk, batch)
    functions["bwd"](grid, block, (argument, CPointer(maps.ctypes.data), dq_accum, counters, numpy.int32(by_arrival)),
                     shared_mem=smem)
    grid, block, smem = launch_shape(variant, "dq_convert", nq, batch)
    functions["dq_convert"](grid, block, (argument, dq_accum), shared_mem=smem)
