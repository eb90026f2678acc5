"""AdamW over float32 master parameters kept in one flat buffer, with the gradient's global norm clipped and a
cosine learning rate.

Weight decay applies to the matrices (2-D parameters: embeddings, projections), not to biases and layernorm
gains, as in GPT-2's and nanoGPT's recipes. The parameters, their gradients and Adam's two moments each live in
one flat buffer, the matrices first, so that a step is one pass over four buffers (one fused kernel on CuPy:
fused.adamw) and weight decay applies to a prefix of them.

The products of a bfloat16 or float16 step read the matrices in that dtype: ``copies`` keeps them in one more flat
buffer, which each step rewrites from the parameters it has just updated (in the same kernel on CuPy), so that no
step casts its weights.

Nothing in a step waits for the device: the learning rate, the step count and the gradients' norm are arrays on
the parameters' device, read where they are used. So a step can be captured in a CUDA graph (graph.py) and
replayed with a new learning rate written into ``lr`` before each replay.
"""

from __future__ import annotations

import math

import fused
import numpy as np


class AdamW:
    """AdamW with global-norm clipping over the parameters ``params`` (a dict of float arrays of one dtype, on one
    device), which it lays out in one flat buffer: each entry of ``params`` is replaced by a view of that buffer
    (same name, shape and values), which ``step`` updates in place.

    ``lr`` is the learning rate until ``set_lr`` (or ``step(..., lr=...)``) changes it; ``clip`` the bound on the
    gradients' global norm (None: no clipping).
    """

    def __init__(self, params: dict, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0):
        self.betas, self.eps, self.weight_decay, self.clip = tuple(betas), eps, weight_decay, clip
        first = next(iter(params.values()))
        xp, dtype = array_module(first), first.dtype
        # (name, offset, shape): the matrices first, each group in the dict's order
        names = [n for n in params if params[n].ndim == 2] + [n for n in params if params[n].ndim != 2]
        self.layout, offset = [], 0
        for name in names:
            self.layout.append((name, offset, params[name].shape))
            offset += params[name].size
        self.decay_end = sum(params[n].size for n in names if params[n].ndim == 2)
        self.params = xp.empty(offset, dtype)
        for name, view in self.views(self.params).items():
            view[...] = params[name]
            params[name] = view
        self.grads = xp.zeros(offset, dtype)
        self._grad_views = list(self.views(self.grads).items())  # where step copies each gradient
        self.m, self.v = xp.zeros(offset, dtype), xp.zeros(offset, dtype)
        self.t = xp.zeros(1, np.int32)  # steps taken, on the device: a captured step advances it at each replay
        self.lr = xp.full(1, lr, dtype)  # the learning rate the next step reads
        self.copy = None  # the matrices in the dtype of ``copies``, once asked for

    def copies(self, dtype) -> dict:
        """The matrices (the 2-D parameters, a prefix of the flat buffer) in ``dtype`` by name, as views of one flat
        buffer that every later ``step`` rewrites from the parameters it updates: the weights of model.forward's
        products (``weights``), with no cast in the step. Cast from the parameters now; call again after changing
        the parameters other than through ``step``. For the parameters' own dtype, their own views. One other dtype
        per optimizer (a ValueError for a second)."""
        dtype = np.dtype(dtype)
        if dtype == self.params.dtype:
            return self._matrices(self.params)
        if fused.accumulator(dtype) != self.params.dtype:  # (the fused step rounds its own results)
            raise ValueError(f"copies of {self.params.dtype} parameters are bfloat16 or float16, not {dtype}")
        if self.copy is None:
            self.copy = array_module(self.params).empty(self.decay_end, dtype)
        elif self.copy.dtype != dtype:
            raise ValueError(f"this optimizer keeps its copies in {self.copy.dtype}, not {dtype}")
        self.copy[...] = self.params[: self.decay_end]  # rounded to nearest even, as the step's kernel rounds
        return self._matrices(self.copy)

    def _matrices(self, flat) -> dict:
        """The matrices' views of ``flat``, the parameters' buffer or the copy's (which holds only them)."""
        return {name: flat[offset : offset + math.prod(shape)].reshape(shape) for name, offset, shape in self.layout
                if len(shape) == 2}  # fmt: skip

    def views(self, flat) -> dict:
        """Each parameter's view of the flat buffer ``flat`` (the parameters', the gradients' or a moment's)."""
        return {name: flat[offset : offset + math.prod(shape)].reshape(shape) for name, offset, shape in self.layout}

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following steps, written into the device array ``lr`` (on the current stream;
        a captured step reads it there at each replay)."""
        self.lr.fill(lr)

    def step(self, grads: dict, lr: float | None = None):
        """Update the parameters in place from ``grads`` (by name, the parameters' dtype); ``lr``, where given,
        is set first (``set_lr``). Returns the gradients' global norm before clipping as a 0-d array (no wait)."""
        if lr is not None:
            self.set_lr(lr)
        _gather(self._grad_views, grads)
        self.t += 1
        b1, b2 = self.betas
        if fused.applies(self.grads):
            sumsq = fused.sum_squares(self.grads)
            fused.adamw(
                self.params, self.grads, self.m, self.v, sumsq=sumsq, lr=self.lr, t=self.t, betas=self.betas,
                eps=self.eps, weight_decay=self.weight_decay, clip=self.clip, decay_end=self.decay_end, copy=self.copy,
            )  # fmt: skip
            return array_module(sumsq).sqrt(sumsq).reshape(())
        xp, dtype = array_module(self.grads), self.grads.dtype
        sumsq = (self.grads * self.grads).sum(keepdims=True)
        g = self.grads
        if self.clip is not None:
            g = g * xp.minimum(dtype.type(1), self.clip / (xp.sqrt(sumsq) + dtype.type(1e-6)))
        self.m *= b1
        self.m += (1 - b1) * g
        self.v *= b2
        self.v += (1 - b2) * g * g
        t = self.t.astype(dtype)
        correction1, correction2 = 1 - b1**t, 1 - b2**t
        self.params[: self.decay_end] *= 1 - self.lr * self.weight_decay
        self.params -= self.lr * (self.m / correction1) / (xp.sqrt(self.v / correction2) + self.eps)
        if self.copy is not None:
            self.copy[...] = self.params[: self.decay_end]
        return xp.sqrt(sumsq).reshape(())

    def state(self) -> dict:
        """The optimizer's step and moments by parameter name, for a checkpoint."""
        return {
            "t": self.t.reshape(()),
            **{f"m.{k}": v for k, v in self.views(self.m).items()},
            **{f"v.{k}": v for k, v in self.views(self.v).items()},
        }

    def load(self, state: dict) -> None:
        """Take the step and moments of ``state()`` (host or device arrays)."""
        xp = array_module(self.m)
        self.t[...] = int(state["t"])
        for key, flat in (("m", self.m), ("v", self.v)):
            for name, view in self.views(flat).items():
                view[...] = xp.asarray(state[f"{key}.{name}"])


def _gather(places, grads: dict) -> None:
    """view[...] = grads[name] for each (name, view) in ``places``. On CuPy, where the gradient is contiguous and
    matches its view, one device-to-device copy on the current stream: CuPy's assignment would make the same copy
    after several times the host time (a step gathers every parameter's gradient)."""
    if not places or isinstance(places[0][1], np.ndarray):
        for name, view in places:
            view[...] = grads[name]
        return
    import cupy

    runtime = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    for name, view in places:
        g = grads[name]
        if isinstance(g, cupy.ndarray) and g.dtype == view.dtype and g.shape == view.shape and g.flags.c_contiguous:
            runtime.memcpyAsync(view.data.ptr, g.data.ptr, view.nbytes, runtime.memcpyDeviceToDevice, stream)
        else:
            view[...] = g


def array_module(x):
    """numpy or cupy: the module of array x."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def cosine_lr(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then a cosine decay to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
