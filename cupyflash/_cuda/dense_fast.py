"""The fast path of dense calls on the GPU: ``attention_forward`` and ``attention_backward`` with arguments of
the layout of an earlier, fully checked call skip the checks and go straight to that call's launch plan. A
training loop calls every layer with the same layouts on every step; its host time is then the plan's
launches and the outputs' allocation. The FP8 forward takes the same path (``fp8_key``): its key is its
holders' layouts, and its plan reads the arrays each holder keeps (cupyflash/_cuda/fp8.py, kernel_inputs).

The key is everything the checks and the plan depend on but the arrays' addresses and the dropout seed's
value: every array's shape, strides, dtype, address modulo 16 and device, the current device, each option's
value and type (the checks reject ``causal=1``; a key by value alone would not tell it from ``True``), and
``CUPYFLASH_NO_WGMMA``. Only calls without the per-element modifiers (``alibi_slopes``, ``bias``, ``mask``,
``block_mask``) take it, and only layouts whose checked call launched on the caller's own arrays (no padded
or float16-piece copies) and whose backward runs unchained. At most MAX_LAYOUTS layouts are kept.

A fast call's outputs share one allocation (out and lse; dq, dk and dv), and the backward's two workspaces
another, with any gradient that is then summed over broadcast dims: one or two pool allocations instead of
two to five. The outputs' memory returns to the pool when the last of them is released.
"""

from __future__ import annotations

import os

import numpy

from cupyflash._arrays import cupy
from cupyflash._cuda.launch import Plan
from cupyflash._dropout import SEED_LIMIT, Dropout
from cupyflash._fp8.tensor import FP8Tensor

MAX_LAYOUTS = 256
_ALIGN = 256  # bytes between the outputs within their allocation (CuPy's own allocations' alignment)
_table: dict[tuple, "_Call"] = {}


def key(direction: str, arrays: tuple, causal, scale, window, softcap, dropout_p, dropout_seed) -> tuple | None:
    """The layout key of a call (module docstring); None where the call cannot take the fast path (NumPy or
    other array types). A key with an unhashable option is never kept. (One flat tuple: this runs on every
    call, and every object it makes is host time.)"""
    if cupy is None or type(arrays[0]) is not cupy.ndarray:  # (NumPy calls make no CUDA call here)
        return None
    if window is not None and type(window) is not tuple:  # (a tuple subclass could compare equal to another)
        return None
    ndarray = cupy.ndarray
    parts = [
        direction,
        cupy.cuda.runtime.getDevice(),
        os.environ.get("CUPYFLASH_NO_WGMMA", ""),
        causal,
        scale,
        window,
        softcap,
        dropout_p,
        type(causal),
        type(scale),
        type(window),
        type(softcap),
        type(dropout_p),
        type(dropout_seed),
    ]
    if type(window) is tuple:
        parts += map(type, window)
    for x in arrays:
        if type(x) is not ndarray:
            return None
        memory = x.data
        parts += (x.shape, x.strides, x.dtype, memory.ptr & 15, memory.device_id)
    return tuple(parts)


def fp8_key(q, k, v, causal, scale, out_dtype) -> tuple | None:
    """The layout key of an FP8 forward (module docstring; q, k, v FP8Tensors): each holder's layout
    (holder_layout, kept with the holder: its arrays never change), and the options by value and type; None
    where the call cannot take the fast path (NumPy holders, or anything that is not an FP8Tensor)."""
    if cupy is None:
        return None
    try:
        layouts = (q._kept["layout"], k._kept["layout"], v._kept["layout"])
    except (KeyError, AttributeError):  # a holder's first call, or not a holder (its own check then says so)
        if not all(type(x) is FP8Tensor for x in (q, k, v)):
            return None
        layouts = tuple(x.kept("layout", lambda x=x: holder_layout(x)) for x in (q, k, v))
    if None in layouts:  # (the layouts are tuples: none of them equals None)
        return None
    return (
        "fp8",
        cupy.cuda.runtime.getDevice(),
        causal,
        scale,
        out_dtype,
        type(causal),
        type(scale),
        type(out_dtype),
    ) + layouts


def holder_layout(x) -> tuple | None:
    """What the FP8 plan depends on of holder x: its data's shape, strides, address modulo 16 and device, its
    scale's shape, strides and dtype, and its block; None where data or scale is not a CuPy array."""
    data, scale = x.data, x.scale
    if type(data) is not cupy.ndarray or type(scale) is not cupy.ndarray:
        return None  # (NumPy calls make no CUDA call here)
    memory = data.data
    return (
        data.shape,
        data.strides,
        memory.ptr & 15,
        memory.device_id,
        scale.shape,
        scale.strides,
        scale.dtype,
        x.block,
    )


def lookup(found):
    """The kept call of layout key ``found``, or None (no key, an unknown one, or an unhashable option)."""
    if found is None:
        return None
    try:
        return _table.get(found)
    except TypeError:  # an unhashable option (a window given as a list): the checked path
        return None


def _round_keys(call, dropout_seed):
    """The dropout round keys of this call's seed; False where the seed is one the checked path rejects."""
    if dropout_seed is not None and not 0 <= int(dropout_seed) < SEED_LIMIT:
        return False
    if call.dropout_p == 0.0:
        return None
    if dropout_seed is None:
        return False  # "needs an integer dropout_seed": the checked path says so
    return Dropout(call.dropout_p, int(dropout_seed)).round_keys


class _Call:
    """One layout's launches (``plan``) and outputs: (shape, dtype) each. The first ``returned`` of them are
    returned as arrays and share one allocation, but for those listed in ``scratch`` (gradients the API then
    sums over broadcast dims), which share a second one with the other outputs (the backward's workspaces).
    The second one returns to the pool once its arrays are released (CuPy's pool is stream-ordered); the
    first one when the last returned array is."""

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


def forward(found, q, k, v, dropout_seed):
    """(out, lse) of a forward whose layout key is ``found``, or None when the key is unknown or the seed
    must go through the checks."""
    call = lookup(found)
    return None if call is None else call.run([q.data.ptr, k.data.ptr, v.data.ptr], dropout_seed)


def backward(found, dout, q, k, v, out, lse, dropout_seed):
    """[dq, dk, dv] of a backward whose layout key is ``found``, or None as ``forward``."""
    call = lookup(found)
    return None if call is None else call.run([x.data.ptr for x in (q, k, v, out, dout, lse)], dropout_seed)


FORWARD_NAMES = ("q", "k", "v", "out", "lse")
FP8_NAMES = ("q", "k", "v", "fp8_descale_q", "fp8_descale_k", "fp8_descale_v", "out", "lse")
BACKWARD_NAMES = ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "lse_log2", "delta")


def remember(found, plan: Plan, names, outputs, dropout, scratch=(), context=None) -> None:
    """Let later calls with the layout key ``found`` (None: not eligible) launch ``plan`` directly, allocating
    ``outputs`` ((shape, dtype) of each, in the order of the output names in ``names``: out and lse of a
    forward, returned; dq, dk, dv of a backward, returned, then its workspaces lse_log2 and delta).
    ``scratch``: the indices of returned outputs that are summed into smaller arrays after the call (the
    gradients of inputs broadcast over leading dims): kept out of the allocation the call's results hold.
    ``context``: kept with the call for the caller (``lookup(found).context``)."""
    if found is None:
        return
    try:
        if found in _table:
            return
    except TypeError:  # unhashable
        return
    if len(_table) >= MAX_LAYOUTS:
        _table.pop(next(iter(_table)))  # the oldest
    returned = 3 if names == BACKWARD_NAMES else 2
    _table[found] = _Call(plan, names, outputs, returned, 0.0 if dropout is None else dropout.p, scratch, context)
