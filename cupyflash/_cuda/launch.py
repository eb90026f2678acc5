"""Launching: grids and shared memory of each kernel, the backward's two passes side by side on two
streams, passes chained over long axes, and launch plans, which a dense call's later calls with the same
layout reuse so that only the arrays' addresses are written per call (docs/design/host_time.md).
"""

from __future__ import annotations

import threading

import numpy

from cupyflash._arrays import cupy, lse_dtype
from cupyflash._cuda import plans, tiles
from cupyflash._cuda.compile import sm_count
from cupyflash._cuda.params import PARAMS_BYTES, PARAMS_DTYPE
from cupyflash._cuda.source import MAX_GRID_Y
from cupyflash._cuda.tiles import CHAIN_ROWS
from cupyflash._cuda.tma import MAPPED
from cupyflash._cuda.variants import Variant
from cupyflash._dropout import SEED_LIMIT, Dropout

# A kernel argument CuPy passes as the address it holds (cupy/cuda/function.pyx).
CPointer = None if cupy is None else cupy.cuda.function.CPointer

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
    if kernel == "bwd":  # the fused backward: a CTA per block of keys
        return _grid(-(-rows // t.rows), batch), threads, smem
    if kernel == "dq_convert":  # and per block of queries
        return _grid(-(-rows // t.block), batch), threads, smem
    if variant.path == "ws":  # persistent: one CTA per SM, at most one per tile
        tile_count = -(-rows // t.rows) * batch
        return (min(tile_count, sm_count(cupy.cuda.runtime.getDevice())), 1, 1), threads, smem
    if kernel == "probs":  # one CTA per (row block, key tile)
        return _grid(-(-rows // t.rows) * -(-cols // t.block), batch), threads, smem
    return _grid(-(-rows // t.rows) * (variant.head_dim // t.d_chunk), batch), threads, smem


def launch(functions, variant: Variant, kernel: str, rows: int, batch: int, params, cols: int = 0) -> None:
    grid, block, smem = launch_shape(variant, kernel, rows, batch, cols)
    functions[kernel](grid, block, (params.view(PARAMS_BYTES),), shared_mem=smem)


def launch_summed(
    functions, variant: Variant, kernel: str, rows: int, batch: int, params, length: int, outputs
) -> None:
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


def side_stream() -> tuple:
    """(stream, ready event, done event, lock) of the current device's second stream, made once. Calls from
    several threads share the two events: each call records and waits on them under the lock, or one
    call's dQ pass could wait on another call's record."""
    device = cupy.cuda.runtime.getDevice()
    found = _side_streams.get(device)
    if found is None:
        found = _side_streams.setdefault(
            device,
            (
                cupy.cuda.Stream(non_blocking=True),
                cupy.cuda.Event(disable_timing=True),
                cupy.cuda.Event(disable_timing=True),
                threading.Lock(),
            ),
        )
    return found


def passes_side_by_side(dkdv, dq) -> None:
    """Run ``dkdv()`` on the current stream and ``dq()`` on this device's side stream, concurrently."""
    stream = cupy.cuda.get_current_stream()
    side, ready, done, lock = side_stream()
    with lock:
        ready.record(stream)
        dkdv()
        side.wait_event(ready)
        with side:
            dq()
        done.record(side)
        stream.wait_event(done)


# cuLaunchKernel itself: a plan's launches skip CuPy's per-call conversion of the arguments (several µs a launch),
# since their arguments' addresses are fixed when the plan is made.
launch_kernel = None if cupy is None else cupy.cuda.driver.launchKernel


def ensure_context() -> None:
    """Make the current device's primary context current in this thread, as CuPy's own launches do: the
    driver launches in the context current in the calling thread, and a thread whose CUDA calls so far found
    everything in CuPy's memory pool may have none (cudaFree(0) initializes it)."""
    if not cupy.cuda.driver.ctxGetCurrent():
        cupy.cuda.runtime.free(0)


def driver_launches(launches) -> list[tuple]:
    """(function handle, grid x, y, z, block x, y, z, dynamic shared memory) of each (Function, grid, block,
    shared memory) launch, the driver's arguments but the stream and the argument array."""
    found = []
    for function, grid, block, smem in launches:
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        found.append((function.ptr, *grid, *block, smem))
    return found


# What a dense call launches (kernels, grids, shared memory, and every parameter but the arrays' addresses)
# depends only on its arrays' shapes, strides and dtype, the scalar options and the device. The first call
# of each such signature works it out and keeps it in the plan cache (plans.py); later calls copy its
# parameters and write only the addresses and the dropout key. Calls with the modifiers' per-element arrays
# (bias, mask, block_mask), and backward passes chained over long axes, always take the full route. (ALiBi's
# slopes are read in place through their broadcast view, whose strides are part of the key and whose address
# a plan writes like the others'.)
_ADDRESS_WORDS = {
    name: PARAMS_DTYPE.fields[name][1] // 8
    for name in (
        "q",
        "k",
        "v",
        "out",
        "dout",
        "dq",
        "dk",
        "dv",
        "lse",
        "lse_log2",
        "delta",
        "alibi_slopes",
        "split_exponents",
    )
}
_ADDRESS_WORDS.update(
    {f"fp8_descale_{name}": PARAMS_DTYPE.fields["fp8_descale"][1] // 8 + i for i, name in enumerate("qkv")}
)  # the FP8 forward's descale tables
_KEYS_DTYPE, _KEYS_OFFSET = PARAMS_DTYPE.fields["dropout_keys"][:2]
KEY_WORDS = slice(_KEYS_OFFSET // 4, _KEYS_OFFSET // 4 + _KEYS_DTYPE.shape[0])  # as uint32 words


class Plan:
    """The launches of one dense call's layout, with its parameters as 64-bit words.

    The kernels' parameter struct is a buffer of words that the plan keeps: a call writes its arrays'
    addresses (and dropout key) into it and launches, under the plan's lock, as the launch copies the bytes
    before it returns."""

    def __init__(self, functions: dict, variant: Variant, params, launches, tensor_maps=None, arrays=None):
        self.words = params.view(numpy.uint64).copy()  # the plan's own addresses; a plain copy
        self.variant = variant
        # The warp-specialized forward's second argument: q, k, v's tensor maps (tma.py), encoded per call
        # from the addresses (by default those of ``arrays``, the ones the plan was made with).
        self.tensor_maps = tensor_maps
        self.map_addresses = {name: arrays[name].data.ptr for name in MAPPED} if tensor_maps else None
        self._maps = None  # the last encoded tensor maps, which argv[1] points at (kept alive here)
        # (function, grid, block, dynamic shared memory) per launch of (kernel, rows, batch); a backward's
        # last two (dK/dV, dQ) run side by side. The function is the RawKernel's CUDA function on this device
        # (a plan is made for one device), launched through the driver (``direct``).
        self.launches = [
            (functions[kernel].kernel,) + launch_shape(variant, kernel, rows, batch) for kernel, rows, batch in launches
        ]
        self.side_by_side = [kernel for kernel, _, _ in launches[-2:]] == ["dkdv", "dq"]
        self.tile_counters = {}  # the warp-specialized forward's, by stream
        self.pinned = False  # a tile counter of it was captured in a CUDA graph (plans.py never evicts it)
        self._buffer = self.words.copy()
        self._slots = memoryview(self._buffer).cast("B").cast("Q")  # an address's write, without NumPy's overhead
        self._keys = self._buffer.view(numpy.uint32)[KEY_WORDS]
        # The launches go to the driver directly (driver_launches): the kernel's arguments as the address of a C
        # array of pointers, one to each argument's bytes. The first is always the parameter struct (this plan's
        # buffer, passed by value); the warp-specialized forward's second and third are its tensor maps and
        # its tile counter's address, written in `values` before each launch.
        self.values = numpy.zeros(4, dtype=numpy.uint64)
        self.argv = numpy.zeros(5, dtype=numpy.uint64)
        self.argv[0] = self._buffer.ctypes.data
        self.argv[2] = self.values.ctypes.data
        self._argv = int(self.argv.ctypes.data)
        self.direct = driver_launches(self.launches)
        self._lock = threading.Lock()

    def _tile_counter(self):
        """The warp-specialized forward's tile counter (one int, zero at launch; the launch's last draw zeroes
        it again) for launches on the current stream, which run one after another. One per stream: launches
        on two streams may run at once. The per-thread default stream has one handle for a different stream in
        each thread, and a thread's launches may outlive it: there every launch gets a new zeroed counter."""
        current = cupy.cuda.get_current_stream()
        stream = current.ptr
        if stream == _PER_THREAD_STREAM:
            return cupy.zeros(1, dtype=numpy.int32)
        if stream != 0 and current.is_capturing():
            # A graph replays the counter's address: the plan, which keeps the counter alive, must outlive it.
            # (Only a created stream can capture.)
            self.pinned = True
        counter = self.tile_counters.get(stream)
        if counter is None:
            counter = self.tile_counters.setdefault(stream, cupy.zeros(1, dtype=numpy.int32))
        return counter

    def slots(self, names) -> list[int]:
        """The parameter words that hold the addresses of these arrays (see launch_with)."""
        return [_ADDRESS_WORDS[name] for name in names]

    def launch(self, addresses: dict | None, dropout) -> None:
        """Launch with these arrays' addresses and this dropout key (None: the ones the plan was made with)."""
        if addresses is None:
            with self._lock:
                self._buffer[:] = self.words
                self._launch_locked(None)
            return
        maps = tuple(addresses[name].data.ptr for name in MAPPED) if self.tensor_maps is not None else None
        self.launch_with(
            self.slots(addresses),
            [x.data.ptr for x in addresses.values()],
            None if dropout is None else dropout.round_keys,
            maps,
        )

    def launch_with(self, slots, pointers, round_keys=None, map_addresses=None) -> None:
        """Launch with the addresses ``pointers`` written at ``slots``, and these dropout round keys;
        ``map_addresses``: q, k, v's addresses (a sequence) for the tensor maps."""
        with self._lock:
            words = self._slots
            for slot, pointer in zip(slots, pointers):
                words[slot] = pointer
            if round_keys is not None:
                self._keys[:] = round_keys
            self._launch_locked(map_addresses)

    def _launch_locked(self, map_addresses) -> None:
        ensure_context()
        stream = cupy.cuda.get_current_stream()
        argv = self._argv
        counter = None
        if self.tensor_maps is not None:
            found = self.map_addresses if map_addresses is None else dict(zip(MAPPED, map_addresses))
            maps = self.tensor_maps.encode(found)
            if maps is not self._maps:
                self._maps = maps
                self.argv[1] = maps.ctypes.data
            counter = self._tile_counter()  # (alive until its launch is queued)
            self.values[0] = counter.data.ptr
        if not self.side_by_side:
            for function, gx, gy, gz, bx, by, bz, smem in self.direct:
                launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream.ptr, argv, 0)
            return
        # The backward: preprocess, then its dK/dV pass here and its dQ pass on the second stream, at once
        # (passes_side_by_side, unrolled: this is every backward call's host time).
        pre, kv, dq = self.direct
        side, ready, done, lock = side_stream()
        launch_kernel(*pre, stream.ptr, argv, 0)
        with lock:
            ready.record(stream)
            launch_kernel(*kv, stream.ptr, argv, 0)
            side.wait_event(ready)
            launch_kernel(*dq, side.ptr, argv, 0)
            done.record(side)
            stream.wait_event(done)


# The parameter names a call entry writes, in order: its inputs' addresses, then its outputs'.
FORWARD_NAMES = ("q", "k", "v", "out", "lse")
FP8_NAMES = ("q", "k", "v", "fp8_descale_q", "fp8_descale_k", "fp8_descale_v", "out", "lse")
BACKWARD_NAMES = ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "lse_log2", "delta")


_ALIGN = 256  # bytes between a call's outputs within their allocation (CuPy's own allocations' alignment)


def _round_keys(call, dropout_seed):
    """The dropout round keys of this call's seed; False where the seed is one the checked path rejects."""
    if dropout_seed is not None and not 0 <= int(dropout_seed) < SEED_LIMIT:
        return False
    if call.dropout_p == 0.0:
        return None
    if dropout_seed is None:
        return False  # "needs an integer dropout_seed": the checked path says so
    return Dropout(call.dropout_p, int(dropout_seed)).round_keys


class Call:
    """A call entry of the plan cache (plans.py): one layout's launches (``plan``) and outputs, (shape, dtype)
    each. The first ``returned`` of them are returned as arrays and share one allocation, but for those listed
    in ``scratch`` (gradients the API then sums over broadcast dims), which share a second one with the other
    outputs (the backward's workspaces).
    The second one returns to the pool once its arrays are released (CuPy's pool is stream-ordered); the
    first one when the last returned array is: one or two pool allocations per call instead of two to five."""

    @property
    def pinned(self) -> bool:
        """Its plan ran inside a CUDA-graph capture (plans.py keeps the entries of such plans)."""
        return self.plan.pinned

    def __init__(self, plan: Plan, names, outputs, returned: int, dropout_p: float, scratch=(), context=None):
        self.plan = plan
        self.context = context  # what the caller needs to find the inputs (the FP8 forward's batch shape)
        self.slots = plan.slots(names)  # where the addresses of the inputs and then of the outputs go
        self.maps = plan.tensor_maps is not None
        self.dropout_p = dropout_p
        self.returned = [(shape, numpy.dtype(dtype)) for shape, dtype in outputs[:returned]]
        kept = [i for i in range(returned) if i not in scratch]
        spare = [i for i in range(len(outputs)) if i not in kept]
        offsets, self.nbytes = _packed([outputs[i] for i in kept])
        spare_offsets, self.workspace_nbytes = _packed([outputs[i] for i in spare])
        # (allocation: 0 the kept one, 1 the scratch one; byte offset) of each output, in order
        self.places = [None] * len(outputs)
        for i, offset in zip(kept, offsets):
            self.places[i] = (0, offset)
        for i, offset in zip(spare, spare_offsets):
            self.places[i] = (1, offset)

    def run(self, pointers: list, dropout_seed):
        """The outputs of a launch on inputs at these addresses (in the plan's order of names), or None where
        the dropout seed must go through the checks."""
        if dropout_seed is None and self.dropout_p == 0.0:  # the common call
            keys = None
        else:
            keys = _round_keys(self, dropout_seed)
            if keys is False:
                return None
        memory = (
            cupy.cuda.alloc(self.nbytes) if self.nbytes else None,
            cupy.cuda.alloc(self.workspace_nbytes) if self.workspace_nbytes else None,
        )
        ndarray = cupy.ndarray
        places = self.places
        outputs = [
            ndarray(shape, dtype, memory[place[0]] + place[1]) for (shape, dtype), place in zip(self.returned, places)
        ]
        pointers = pointers + [memory[which].ptr + offset for which, offset in places]
        self.plan.launch_with(self.slots, pointers, keys, pointers[:3] if self.maps else None)
        return outputs


def _packed(arrays) -> tuple[list[int], int]:
    """Byte offsets of arrays of these (shape, dtype) one after the other, each at a multiple of _ALIGN, and
    the bytes they span."""
    offsets, total = [], 0
    for shape, dtype in arrays:
        offsets.append(total)
        nbytes = numpy.dtype(dtype).itemsize
        for n in shape:
            nbytes *= n
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, total


def keep_call(found, plan: Plan, names, outputs, dropout, scratch=(), context=None) -> None:
    """Let later calls with the call key ``found`` (None: not eligible) launch ``plan`` directly, allocating
    ``outputs`` ((shape, dtype) of each, in the order of the output names in ``names``: out and lse of a
    forward, returned; dq, dk, dv of a backward, returned, then its workspaces lse_log2 and delta).
    ``scratch``: the indices of returned outputs that are summed into smaller arrays after the call (the
    gradients of inputs broadcast over leading dims): kept out of the allocation the call's results hold.
    ``context``: kept with the call for the caller (``plans.get(found).context``)."""
    if found is None or plans.get(found) is not None:
        return
    returned = 3 if names == BACKWARD_NAMES else 2
    plans.put(found, Call(plan, names, outputs, returned, 0.0 if dropout is None else dropout.p, scratch, context))
