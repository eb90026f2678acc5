"""Launching: grids and shared memory of each kernel, the backward's two passes side by side on two
streams, passes chained over long axes, and launch plans, which a dense call's later calls with the same
layout reuse so that only the arrays' addresses are written per call (docs/design/host_time.md).
"""

from __future__ import annotations

import os

import numpy

from cupyflash._arrays import cupy, lse_dtype
from cupyflash._cuda import tiles
from cupyflash._cuda.compile import sm_count
from cupyflash._cuda.params import PARAMS_BYTES, PARAMS_DTYPE, STRIDED
from cupyflash._cuda.source import MAX_GRID_Y
from cupyflash._cuda.tma import MAPPED
from cupyflash._cuda.variants import Variant

# The most rows one launch of a backward pass sums a gradient over (queries for dK/dV, keys for dQ). The
# tensor cores' float32 accumulation truncates, ~2e-8 relative per 16-row step: 1.5e-4 over 2^17 rows, below
# the rounding of a float16 result, but percents over millions. Longer axes run the pass in chunks of
# CHAIN_ROWS rows whose results are added in float32 (launch_summed; cuda_src/params.cuh, stream_begin).
CHAIN_ROWS = 131072
_PER_THREAD_STREAM = 2  # cudaStreamPerThread: CuPy's Stream.ptds


def _grid(blocks: int, batch: int) -> tuple[int, int, int]:
    y = min(batch, MAX_GRID_Y)
    return blocks, y, -(-batch // y)


def launch_shape(variant: Variant, kernel: str, rows: int, batch: int, cols: int = 0):
    """(grid, block, dynamic shared memory) of one kernel over ``rows`` rows of its axis and ``batch``
    entries (``cols``: attention_probs' keys)."""
    threads, smem = (variant.threads(kernel),), variant.smem(kernel)
    if kernel == "preprocess":
        rows_per_block = tiles.PREPROCESS_WARPS * (32 // tiles.preprocess_lanes(variant.itemsize, variant.head_dim))
        return _grid(-(-rows // rows_per_block), batch), threads, smem
    t = variant.tiles(kernel)
    if variant.path == "ws":  # persistent: one CTA per SM, at most one per tile
        tile_count = -(-rows // t.rows) * batch
        return (min(tile_count, sm_count(cupy.cuda.runtime.getDevice())), 1, 1), threads, smem
    if kernel == "probs":  # one CTA per (row block, key tile)
        return _grid(-(-rows // t.rows) * -(-cols // t.block), batch), threads, smem
    return _grid(-(-rows // t.rows) * (variant.head_dim // t.d_chunk), batch), threads, smem


def launch(functions, variant: Variant, kernel: str, rows: int, batch: int, params, cols: int = 0) -> None:
    grid, block, smem = launch_shape(variant, kernel, rows, batch, cols)
    functions[kernel](grid, block, (params.view(PARAMS_BYTES),), shared_mem=smem)


def launch_summed(functions, variant: Variant, kernel: str, rows: int, batch: int, params, length: int,
                  outputs) -> None:
    """A backward pass whose gradients sum over a streamed axis of ``length`` rows: one launch, or, past
    CHAIN_ROWS rows, one launch per chunk of that many rows with the chunks' results (the arrays in
    ``outputs``, which each launch overwrites) added in the accumulator dtype."""
    if length <= CHAIN_ROWS:
        launch(functions, variant, kernel, rows, batch, params)
        return
    acc = lse_dtype(outputs[0].dtype)
    sums = [cupy.zeros(out.shape, dtype=acc) for out in outputs]
    part = params.copy()
    for begin in range(0, length, CHAIN_ROWS):
        part["stream_begin"], part["stream_end"] = begin, min(length, begin + CHAIN_ROWS)
        launch(functions, variant, kernel, rows, batch, part)
        for total, out in zip(sums, outputs):
            total += out.astype(acc)
    for total, out in zip(sums, outputs):
        out[...] = total.astype(out.dtype)


# The backward's dK/dV and dQ passes read the same inputs and write different outputs, so they may run at
# once: the dQ pass goes on a second stream beside the dK/dV pass, each pass's CTAs filling the SMs the
# other's last wave leaves idle. Both wait for what the current stream had queued (the preprocess), and the
# current stream waits for both, so to the caller the call is one stream's work.
_side_streams: dict[int, tuple] = {}


def passes_side_by_side(dkdv, dq) -> None:
    """Run ``dkdv()`` on the current stream and ``dq()`` on this device's side stream, concurrently."""
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


# What a dense call launches (kernels, grids, shared memory, and every parameter but the arrays' addresses)
# depends only on its arrays' shapes, strides and dtype, the scalar options and the device. The first call
# of each such signature works it out; later calls copy its parameters and write only the addresses and the
# dropout key. Calls with the modifiers' per-element arrays (bias, mask, block_mask), and backward passes
# chained over long axes, always take the full route. (ALiBi's slopes are read in place through their
# broadcast view, whose strides are part of the signature and whose address a plan writes like the others'.)
_PLAN_CACHE_SIZE = 256
_ADDRESS_WORDS = {name: PARAMS_DTYPE.fields[name][1] // 8
                  for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse_log2", "delta",
                               "alibi_slopes", "split_exponents")}
_KEYS_DTYPE, _KEYS_OFFSET = PARAMS_DTYPE.fields["dropout_keys"][:2]
_KEY_WORDS = slice(_KEYS_OFFSET // 4, _KEYS_OFFSET // 4 + _KEYS_DTYPE.shape[0])  # as uint32 words
plans: dict[tuple, "Plan"] = {}


class Plan:
    """The launches of one dense call's layout, with its parameters as 64-bit words."""

    def __init__(self, functions: dict, variant: Variant, params, launches, tensor_maps=None, arrays=None):
        self.words = params.view(numpy.uint64).copy()  # a plain copy: an address is one word's write
        self.variant = variant
        # The warp-specialized forward's second argument: q, k, v's tensor maps (tma.py), encoded per call
        # from the addresses (by default those of ``arrays``, the ones the plan was made with).
        self.tensor_maps = tensor_maps
        self.map_addresses = {name: arrays[name].data.ptr for name in MAPPED} if tensor_maps else None
        # (function, grid, block, dynamic shared memory) per launch of (kernel, rows, batch); a backward's
        # last two (dK/dV, dQ) run side by side.
        self.launches = [(functions[kernel],) + launch_shape(variant, kernel, rows, batch)
                         for kernel, rows, batch in launches]
        self.side_by_side = [kernel for kernel, _, _ in launches[-2:]] == ["dkdv", "dq"]
        self.tile_counters = {}  # the warp-specialized forward's, by stream

    def _tile_counter(self):
        """The warp-specialized forward's tile counter (one int, zero at launch; the launch's last draw zeroes
        it again) for launches on the current stream, which run one after another. One per stream: launches
        on two streams may run at once. The per-thread default stream has one handle for a different stream in
        each thread, and a thread's launches may outlive it: there every launch gets a new zeroed counter."""
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
        args = (words.view(PARAMS_BYTES),)
        if self.tensor_maps is not None:
            found = self.map_addresses if addresses is None else {name: addresses[name].data.ptr for name in MAPPED}
            args += (self.tensor_maps.encode(found), self._tile_counter())

        def run(launches):
            for function, grid, block, smem in launches:
                function(grid, block, args, shared_mem=smem)

        if self.side_by_side:
            run(self.launches[:-2])
            passes_side_by_side(lambda: run(self.launches[-2:-1]), lambda: run(self.launches[-1:]))
        else:
            run(self.launches)


def plan_key(direction: str, arrays: dict, scale: float, causal: bool, mods, dropout) -> tuple | None:
    """What a dense call's launches depend on, or None when it is not planned (the modifiers' arrays)."""
    if mods is not None and not (mods.bias is None and mods.mask is None and mods.block_mask is None):
        return None
    # The inputs' layouts; outputs and workspaces are allocated contiguous from their shapes.
    layout = tuple((arrays[name].shape, arrays[name].strides) for name in STRIDED if name in arrays)
    return (direction, cupy.cuda.runtime.getDevice(), arrays["q"].dtype, layout, scale, causal,
            None if mods is None else (mods.window, mods.softcap,
                                       None if mods.alibi_slopes is None else mods.alibi_slopes.strides),
            None if dropout is None else (dropout.threshold, dropout.scale),
            os.environ.get("CUPYFLASH_NO_WGMMA", ""))


def remember(key, plan: Plan) -> None:
    if len(plans) >= _PLAN_CACHE_SIZE:
        plans.pop(next(iter(plans)))  # the oldest
    plans[key] = plan
