"""cupyflash as a PyTorch operation: a ``torch.autograd.Function`` around ``attention_forward`` and
``attention_backward``, for training a PyTorch model with cupyflash's attention.

    from torch_attention import attention          # this file, on your path
    out = attention(q, k, v, causal=True)          # torch CUDA tensors (..., N, D), any strides
    out.sum().backward()                           # q.grad, k.grad, v.grad

Everything crosses without a copy, and without the per-call costs that dominate a small model's step
(docs/interop.md, "A fast PyTorch operation"):
- torch -> CuPy: a CuPy array over the tensor's memory built from its pointer, shape and strides
  (``to_cupy``), not DLPack, whose exchange builds stream objects and events on every call;
- CuPy -> torch: DLPack with ``stream=-1``: both sides run on torch's current stream, so the exchange
  orders nothing (``torch.from_dlpack(x)`` looks torch's stream up and has CuPy order the two);
- streams: one ``cupy.cuda.ExternalStream`` per torch stream, made once and kept, and CuPy's current
  device set to the tensors' (autograd runs backward passes on threads of its own);
- the backward reuses the forward's CuPy arrays (kept on ``ctx`` beside the saved tensors) instead of
  converting them again.
torch is imported here, never by cupyflash.

    python examples/torch_attention.py      # checks itself against torch's attention in float64
"""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy
import torch

import cupyflash

_DTYPES = {
    torch.float16: numpy.dtype(numpy.float16),
    torch.bfloat16: numpy.dtype(ml_dtypes.bfloat16),
    torch.float32: numpy.dtype(numpy.float32),
    torch.float64: numpy.dtype(numpy.float64),
    torch.bool: numpy.dtype(numpy.bool_),
}  # (bool: masks)


def to_cupy(t: torch.Tensor) -> cupy.ndarray:
    """A CuPy array on the memory of the CUDA tensor ``t`` (same shape, strides and dtype; no copy). The
    array keeps ``t`` alive. Strides may be anything torch allows but negative (torch has none)."""
    dtype = _DTYPES.get(t.dtype)
    if dtype is None or not t.is_cuda:
        raise TypeError(
            f"to_cupy takes a CUDA tensor of dtype float16, bfloat16, float32, float64 or bool, got a "
            f"{t.device.type} tensor of {t.dtype}"
        )
    shape, stride, itemsize = tuple(t.shape), t.stride(), dtype.itemsize
    extent = 1  # elements from the first to the last one, inclusive
    for n, s in zip(shape, stride):
        extent += (n - 1) * s
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), itemsize * extent if 0 not in shape else 0, t, t.get_device())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), tuple(s * itemsize for s in stride))


_bfloat16_exports = None  # whether this CuPy exports bfloat16 through DLPack (CuPy 14 with NumPy >= 2.1.2 does)


def to_torch(x: cupy.ndarray) -> torch.Tensor:
    """The CuPy array ``x`` as a torch tensor on the same memory (DLPack). The exchange establishes no stream
    order (``stream=-1``): call it where x was made on the stream torch then uses, as FlashAttention does."""
    global _bfloat16_exports
    if x.dtype == _DTYPES[torch.bfloat16]:
        if _bfloat16_exports is None:
            try:
                x[:0].__dlpack__(stream=-1)
                _bfloat16_exports = True
            except (BufferError, TypeError, ValueError):
                _bfloat16_exports = False
        if not _bfloat16_exports:  # the bits as int16, viewed back as bfloat16 by torch
            return torch.from_dlpack(x.view(numpy.int16).__dlpack__(stream=-1)).view(torch.bfloat16)
    return torch.from_dlpack(x.__dlpack__(stream=-1))


_streams: dict[tuple[int, int], cupy.cuda.ExternalStream] = {}


def on_torch_stream(device: int):
    """A context manager that sets CuPy's current stream to torch's current one on CUDA device ``device``
    (one CuPy stream per torch stream, made once), and CuPy's current device to ``device``, so that
    cupyflash queues its kernels in order with torch's. Both settings are per thread in CuPy, and autograd
    runs backward passes on threads of its own, so every pass sets them."""
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _streams.get((device, handle))
    if stream is None:
        stream = _streams.setdefault((device, handle), cupy.cuda.ExternalStream(handle, device))
    if cupy.cuda.runtime.getDevice() == device:  # the common case: the stream alone is cheaper to enter
        return stream
    return _DeviceAndStream(cupy.cuda.Device(device), stream)


class _DeviceAndStream:
    def __init__(self, device, stream):
        self.device, self.stream = device, stream

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


class FlashAttention(torch.autograd.Function):
    """cupyflash's attention on CUDA tensors q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv) and an optional
    ``bias`` (a tensor or None; its gradient is returned like q's), with any other keyword of
    ``cupyflash.attention_forward`` in ``options`` (tensors among them, such as ``alibi_slopes``, ``mask``
    or ``block_mask``, are taken as constants). Dropout needs a seed per step: pass ``dropout_p`` and a new
    ``dropout_seed`` on every call; both passes use it.

    The tensors the backward needs (q, k, v, bias and the returned out) are saved with ``save_for_backward``,
    so that torch detects any of them modified in place between the passes and frees them after the backward;
    their CuPy views (and lse) are kept on ``ctx`` too, and the backward uses those: one conversion per tensor
    instead of two. After a backward, or under saved-tensor hooks, the views are made again from the saved
    tensors."""

    @staticmethod
    def forward(ctx, q, k, v, bias, options):
        arrays = to_cupy(q), to_cupy(k), to_cupy(v)  # (first: a tensor that is not on a GPU raises here)
        options = {name: to_cupy(x) if isinstance(x, torch.Tensor) else x for name, x in options.items()}
        if bias is not None:
            options["bias"] = to_cupy(bias)
        with on_torch_stream(q.get_device()):
            out, lse = cupyflash.attention_forward(*arrays, **options)
            out_t = to_torch(out)
        ctx.save_for_backward(q, k, v, out_t, bias)
        ctx.views, ctx.lse, ctx.options = arrays + (out,), lse, options
        return out_t

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # (raises if one was modified in place since the forward)
        views, ctx.views = ctx.views, None  # let the saved tensors go with the graph's own references
        if views is None or any(x.data_ptr() != y.data.ptr for x, y in zip(saved, views)):
            views = tuple(to_cupy(x) for x in saved[:4])  # a second backward (retain_graph), or hooks
        dout = to_cupy(dout)
        with on_torch_stream(dout.device.id):
            grads = cupyflash.attention_backward(dout, *views, ctx.lse, **ctx.options)
            return tuple(to_torch(g) for g in grads) + ((None,) if len(grads) == 4 else (None, None))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None, **options
) -> torch.Tensor:
    """``cupyflash.attention`` on torch tensors, differentiable in q, k, v and ``bias``; ``options`` as in
    ``cupyflash.attention_forward`` (``causal``, ``scale``, ``window``, ``softcap``, ``alibi_slopes``, ...)."""
    return FlashAttention.apply(q, k, v, bias, options)


def _check() -> None:
    """Forward and backward against torch's own attention in float64, on strided views of a packed qkv."""
    torch.manual_seed(0)
    batch, n, heads, d = 2, 300, 4, 64
    qkv = torch.randn(batch, n, 3, heads, d, device="cuda").to(torch.bfloat16).requires_grad_()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views, no copy
    out = attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaf = qkv.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(leaf[:, :, i].transpose(1, 2) for i in range(3)), is_causal=True
    )
    ref.backward(dout.double())
    for name, got, want in (("out", out, ref), ("dqkv", qkv.grad, leaf.grad)):
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        print(f"{name}: max error {error:.2e} of the largest value")
        assert error <= 2e-2, name


if __name__ == "__main__":
    _check()
