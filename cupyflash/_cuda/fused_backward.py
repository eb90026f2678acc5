"""The warp-specialized fused backward's launches (cuda_src/attention_bwd_ws.cu): the preprocess, the fused
kernel over q, k, v and dout's tensor maps with its float32 dq accumulator and the counters of its ordered adds,
then dq's conversion. A launch plan (``FusedBackwardPlan``, a launch.Plan) like the two passes': a dense call's
later calls with the same layout write the addresses, encode the maps where they moved, zero a new workspace
and launch (at 2k rows the GPU's time is under a millisecond, so a checked call's host time would show).
"""

from __future__ import annotations

import numpy

from cupyflash._arrays import cupy
from cupyflash._cuda import tile_policy, tiles, tma
from cupyflash._cuda.compile import sm_count
from cupyflash._cuda.launch import Plan, ensure_context, launch_kernel

MAPPED = ("q", "k", "v", "dout")  # the inputs it reads through tensor maps, in BwdTensorMaps' order


BROADCAST = ("k", "v")  # the inputs it reads at coordinate 0 of a broadcast batch dim (GQA, MQA)


def describable(arrays, sizes, strides) -> bool:
    """Whether tensor maps describe its inputs: 16-byte aligned strides, and broadcast batch dims (stride 0) only in
    k and v (their gradients, per batch entry, are summed after the call)."""
    return tma.available() and all(
        tma.describable(arrays[name], sizes, strides[name], broadcast=name in BROADCAST) for name in MAPPED
    )


class FusedBackwardPlan(Plan):
    """The fused backward of one dense layout (``params``: its parameters; ``arrays``, ``sizes``, ``strides``: q,
    k, v, dout of collapsed layout, for the tensor maps). Each launch reads q, k, v and dout's addresses from
    its parameter words (so launch.Plan's launch and launch_with serve as they are) and allocates its own
    workspace: dq_accum (float32, a sum per chain of ordered adds, in the dQ products' fragment order), then one
    counter per (batch entry, query block, chain). In order, only the counters start at zero: the first key
    block of a chain at a query block stores its partial, the others add. Unordered, every key block adds (into
    chain 0) and dq_accum starts at zero too."""

    def __init__(self, functions, variant, params, arrays, sizes, strides, *, batch: int, nq: int, nk: int):
        super().__init__(
            functions, variant, params, [("preprocess", nq, batch), ("bwd", nk, batch), ("dq_convert", nq, batch)]
        )
        t = variant.tiles("bwd")
        m_blocks = -(-nq // t.block)
        chains = tiles.ws_bwd_dq_chains(t, variant.deterministic)
        accum = batch * m_blocks * chains * t.block * variant.head_dim  # dq_accum's floats
        self._workspace = accum + batch * m_blocks * chains  # floats, the counters after dq_accum
        self._counters_at = accum * 4  # bytes
        zeroed_from = accum * 4 if variant.deterministic else 0
        self._zeroed = (zeroed_from, self._workspace * 4 - zeroed_from)  # (first byte, bytes)
        self._fused_maps = tma.TensorMaps(
            arrays, sizes, strides, {"q": t.block, "k": t.rows, "v": t.rows, "dout": t.block}, broadcast=BROADCAST
        )
        self._address_words = self.slots(MAPPED)
        by_arrival = tile_policy.fused_backward_by_arrival(
            nk,
            variant.head_dim,
            variant.causal,
            sm_count(cupy.cuda.runtime.getDevice()),
            variant.deterministic,
            keys=t.rows,
        )
        # The fused kernel's arguments (launch.Plan's argv): the struct, the maps, then by value dq_accum's and the
        # counters' addresses and the by-arrival flag (an int32, the low half of the last value); dq's conversion takes
        # the struct and dq_accum's address.
        self.values[3] = by_arrival
        values = self.values.ctypes.data
        self.argv[2:] = [values, values + 8, values + 24]
        self._convert = numpy.array([self._buffer.ctypes.data, self.values.ctypes.data], dtype=numpy.uint64)
        self._convert_argv = int(self._convert.ctypes.data)

    def _launch_locked(self, map_addresses) -> None:
        ensure_context()
        words = self._slots
        maps = self._fused_maps.encode({name: words[w] for name, w in zip(MAPPED, self._address_words)})
        if maps is not self._maps:
            self._maps = maps
            self.argv[1] = maps.ctypes.data
        workspace = cupy.cuda.alloc(self._workspace * 4)  # freed to the stream-ordered pool after the launches
        stream = cupy.cuda.get_current_stream().ptr
        start, nbytes = self._zeroed
        cupy.cuda.runtime.memsetAsync(workspace.ptr + start, 0, nbytes, stream)
        values = self.values  # the fused kernel's by-value arguments after the struct and the maps
        values[0] = workspace.ptr  # dq_accum
        values[1] = workspace.ptr + self._counters_at  # the counters
        (pre, bwd, convert), argv = self.direct, self._argv
        launch_kernel(*pre, stream, argv, 0)
        launch_kernel(*bwd, stream, argv, 0)
        launch_kernel(*convert, stream, self._convert_argv, 0)
