"""Where the host time of an attention forward + backward through PyTorch goes: the pieces of the docs'
first recipe (DLPack both ways, a new ExternalStream per call, out/lse converted back in the backward)
against examples/torch_attention.py's, and cProfile of our own calls. Prints one table; no arguments."""

import cProfile
import io
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_attention as ta  # noqa: E402
from bench_train_step import PassThrough, autograd_step, host_us  # noqa: E402

import cupyflash  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def old_to_cupy(t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return cupy.from_dlpack(t.view(torch.int16)).view(BF16)
    return cupy.from_dlpack(t)


def old_to_torch(x):
    if x.dtype == BF16:
        return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def old_stream():
    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


class OldFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        with old_stream():
            out, lse = cupyflash.attention_forward(old_to_cupy(q), old_to_cupy(k), old_to_cupy(v), causal=causal)
            out, lse = old_to_torch(out), old_to_torch(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with old_stream():
            dq, dk, dv = cupyflash.attention_backward(
                *(old_to_cupy(x) for x in (dout.contiguous(), q, k, v, out, lse)), causal=ctx.causal
            )
            return old_to_torch(dq), old_to_torch(dk), old_to_torch(dv), None


def main():
    rows = {}
    t = torch.randn(8, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    x = ta.to_cupy(t)
    s = ta.on_torch_stream(0)
    rows["torch.cuda.current_stream().cuda_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
    rows["ExternalStream(handle) new"] = host_us(lambda: cupy.cuda.ExternalStream(0))
    rows["on_torch_stream(0) cached"] = host_us(lambda: ta.on_torch_stream(0))

    def enter_exit():
        with s:
            pass

    rows["with cached stream"] = host_us(enter_exit)
    rows["old to_cupy (dlpack via int16)"] = host_us(lambda: old_to_cupy(t))
    rows["new to_cupy (UnownedMemory)"] = host_us(lambda: ta.to_cupy(t))
    rows["to_torch via int16 view"] = host_us(lambda: old_to_torch(x))
    try:
        torch.from_dlpack(x)
        rows["torch.from_dlpack bf16 direct"] = host_us(lambda: torch.from_dlpack(x))
    except Exception as e:  # noqa: BLE001
        print("direct bf16 from_dlpack:", e)
    with s:
        rows["to_torch under torch's stream"] = host_us(lambda: ta.to_torch(x))
    rows["cupy.empty"] = host_us(lambda: cupy.empty((8, 8, 1024, 64), dtype=BF16))
    rows["torch.empty"] = host_us(lambda: torch.empty((8, 8, 1024, 64), device="cuda", dtype=torch.bfloat16))
    rows["x[0] of a cupy array"] = host_us(lambda: x[0])
    rows["cupy.cuda.runtime.getDevice()"] = host_us(cupy.cuda.runtime.getDevice)
    rows["x.device.id"] = host_us(lambda: x.device.id)
    rows["key of (shape, strides, dtype, ptr%16)"] = host_us(lambda: (x.shape, x.strides, x.dtype, x.data.ptr % 16))

    qkv = torch.randn(8, 1024, 3, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(8, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)

    def step(fn):
        return autograd_step(qkv, dout, fn)

    variants = {
        "autograd identity fwd+bwd": step(lambda q, k, v: PassThrough.apply(q, k, v)),
        "sdpa fwd+bwd": step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "docs recipe fwd+bwd": step(lambda q, k, v: OldFunction.apply(q, k, v, True)),
        "example fwd+bwd": step(lambda q, k, v: ta.attention(q, k, v, causal=True)),
    }
    for name, fn in variants.items():
        rows[name] = host_us(fn, calls=50)
    qc, kc, vc = (ta.to_cupy(qkv.detach()[:, :, i].transpose(1, 2)) for i in range(3))
    out, lse = cupyflash.attention_forward(qc, kc, vc, causal=True)
    dc = ta.to_cupy(dout)
    rows["attention_forward (qkv view)"] = host_us(lambda: cupyflash.attention_forward(qc, kc, vc, causal=True))
    rows["attention_backward (qkv view)"] = host_us(
        lambda: cupyflash.attention_backward(dc, qc, kc, vc, out, lse, causal=True)
    )
    for name, fn in (
        ("forward", lambda: cupyflash.attention_forward(qc, kc, vc, causal=True)),
        ("backward", lambda: cupyflash.attention_backward(dc, qc, kc, vc, out, lse, causal=True)),
        ("example fwd+bwd", variants["example fwd+bwd"]),
    ):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            fn()
        profile.disable()
        cupy.cuda.Device().synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
        print(f"---- cProfile {name} (200 calls)\n" + text.getvalue().split("\n\n", 1)[-1][:4000])
    print("\n| piece | host us per call |\n|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main()
