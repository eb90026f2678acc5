"""A whole training step (forward, backward, clipping, AdamW) captured once as a CUDA graph and replayed for every
later step, with each step's batch copied into the graph's static input buffers: the host then launches one
graph per step instead of a thousand kernels.

What makes the step capturable:

- nothing in it waits for the device: the loss and the gradients' norm stay device arrays, and the optimizer
  reads its learning rate and step count from device arrays (optim.AdamW), which the replays see change;
- every kernel is compiled, every cupyflash plan made and cuBLAS's handle and this stream's workspace allocated
  (matmul.py, cublas_ctypes.py) before the capture: the first call runs the step once uncaptured (a real step, the
  first of training) on the same stream and buffers, then captures it;
- the matrix products call cuBLAS through its C API (cublas_ctypes.py), not CuPy's wrappers, which refuse any call
  during a capture; in every dtype matmul.py takes (float32, float16, bfloat16; float64);
- the memory the graph uses is its own: the uncaptured step and the capture allocate from a private CuPy memory
  pool that nothing else allocates from, and that lives as long as the graph. A replay allocates nothing: it
  writes the same addresses the capture recorded, which hold what the next replay needs (the loss, the norm);
- one stream: the copies into the input buffers, the learning rate's update (``AdamW.set_lr``) and the replays
  all go to ``stream``, in order. Work on other streams that touches the parameters (an evaluation) must run on
  that stream too, or wait for it.

cupyflash's dense forward and backward are capturable after one uncaptured call on the same stream (its docs,
deployment.md): they launch with no host synchronization; the backward's dQ pass forks onto a second stream and
joins back through events, which a capture follows; the fused backward's workspace is allocated (from the current
pool) and zeroed with cudaMemsetAsync, both captured as graph nodes.
"""

from __future__ import annotations

import contextlib

import numpy as np


class CapturedStep:
    """``step(tokens, targets)`` (device arrays in, device arrays out) run as a CUDA graph.

    ``shape`` is the (B, N) of every batch, ``dtype`` the tokens' integer type. Call it with each step's batch (host
    or device arrays): the first call runs ``step`` uncaptured and captures it, every later one replays the graph.
    It returns step's outputs, which a replay overwrites: read or copy them (on ``stream``) before the next call.
    Work queued on other streams before the first call is waited for at that call, but not by anything the caller
    queues on ``stream`` before it (a learning rate's update): synchronize the device before that (train.py does
    when it enters the stream). After the first call, work elsewhere that touches what the step reads or writes
    must be ordered with ``stream`` by the caller.
    """

    def __init__(self, step, shape, dtype=np.int32, stream=None):
        import cupy

        self.step = step
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()  # the graph's memory: nothing else allocates from it
        self.tokens = cupy.zeros(shape, dtype)
        self.targets = cupy.zeros(shape, dtype)
        self.graph = None
        self.outputs = None

    def __call__(self, tokens, targets):
        import cupy

        if self.graph is None:
            # The parameters and these buffers were made on the default stream, whose work this non-blocking
            # stream does not wait for: let it finish, once.
            cupy.cuda.Device().synchronize()
        with self.stream:
            _copy_into(self.tokens, tokens)
            _copy_into(self.targets, targets)
            if self.graph is not None:
                self.graph.launch(self.stream)
                return self.outputs
            with cupy.cuda.using_allocator(self.pool.malloc):
                first = self.step(self.tokens, self.targets)  # compiles, plans, and is the first real step
                self.stream.synchronize()
                self.stream.begin_capture()
                try:
                    outputs = self.step(self.tokens, self.targets)
                except BaseException:
                    with contextlib.suppress(Exception):  # end the capture; the step's own error is the one to see
                        self.stream.end_capture()
                    raise
                self.graph = self.stream.end_capture()
                self.outputs = outputs
            return first


def _copy_into(buffer, values) -> None:
    """buffer[...] = values, from the host or the device, on the current stream."""
    if isinstance(values, np.ndarray):
        buffer.set(np.ascontiguousarray(values, dtype=buffer.dtype))
    else:
        buffer[...] = values
