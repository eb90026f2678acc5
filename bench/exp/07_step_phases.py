"""Where a training step's host time goes with cupyflash's attention: the bench's small GPT (width 512, 8 heads,
N = 1024, B = 8), the example's operation timed piece by piece inside real steps (perf_counter around each piece,
from whichever thread autograd runs it on), beside the step's wall time, SDPA's, and the loop time of one
attention forward + backward with no spin (GPU included). Prints one table; no arguments."""

import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]

import bench_train_step as bts  # noqa: E402
import cupy  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_attention as ta  # noqa: E402

import cupyflash  # noqa: E402

spent = collections.defaultdict(float)
counts = collections.Counter()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
            counts[name] += 1

    return wrapper


def loop_us(fn, calls=200):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def main():
    rows = {}
    x = cupy.zeros((8, 8, 1024, 64), dtype=ta._DTYPES[torch.bfloat16])
    rows["host: torch.from_dlpack(x.toDlpack())"] = bts.host_us(lambda: torch.from_dlpack(x.toDlpack()))
    rows["host: torch.from_dlpack(x)"] = bts.host_us(lambda: torch.from_dlpack(x))
    rows["host: torch.from_dlpack(x.__dlpack__(stream=-1))"] = bts.host_us(
        lambda: torch.from_dlpack(x.__dlpack__(stream=-1))
    )
    rows["host: ta.to_torch(x)"] = bts.host_us(lambda: ta.to_torch(x))
    t = torch.zeros(8, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    rows["host: ta.to_cupy(t)"] = bts.host_us(lambda: ta.to_cupy(t))

    def enter_exit(manager):
        def run():
            with manager:
                pass

        return run

    rows["host: ta.on_torch_stream(0) + with"] = bts.host_us(lambda: enter_exit(ta.on_torch_stream(0))())
    rows["host: with cupy.cuda.Device(0)"] = bts.host_us(enter_exit(cupy.cuda.Device(0)))
    rows["host: torch.cuda.current_stream(0)"] = bts.host_us(lambda: torch.cuda.current_stream(0))
    try:
        rows["host: torch._C._cuda_getCurrentRawStream(0)"] = bts.host_us(lambda: torch._C._cuda_getCurrentRawStream(0))
    except AttributeError as e:
        print(e)
    mem = cupy.cuda.alloc(1 << 20)
    rows["host: cupy.cuda.alloc"] = bts.host_us(lambda: cupy.cuda.alloc(1 << 20))
    rows["host: ndarray(shape, dtype, memptr + off)"] = bts.host_us(
        lambda: cupy.ndarray((8, 8, 64), x.dtype, mem + 256)
    )
    rows["host: cupy.empty"] = bts.host_us(lambda: cupy.empty((8, 8, 1024, 64), dtype=x.dtype))

    qkv = torch.randn(8, 1024, 3, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(8, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)

    def step(fn):
        return bts.autograd_step(qkv, dout, fn)

    sdpa = step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    ours = step(lambda q, k, v: ta.attention(q, k, v, causal=True))

    class ConvertOnly(torch.autograd.Function):
        """The example's conversions and streams, no attention: out and the gradients are fresh CuPy arrays."""

        @staticmethod
        def forward(ctx, q, k, v):
            with ta.on_torch_stream(q.get_device()):
                arrays = ta.to_cupy(q), ta.to_cupy(k), ta.to_cupy(v)
                ctx.arrays = arrays
                return ta.to_torch(cupy.empty(arrays[2].shape, arrays[2].dtype))

        @staticmethod
        def backward(ctx, dout):
            with ta.on_torch_stream(dout.get_device()):
                d = ta.to_cupy(dout)
                return tuple(ta.to_torch(cupy.empty(d.shape, d.dtype)) for _ in range(3))

    rows["host, 10 behind a spin: identity Function fwd+bwd"] = bts.host_us(
        step(lambda q, k, v: bts.PassThrough.apply(q, k, v)), calls=10, repeats=21
    )
    rows["host, 10 behind a spin: conversions-only Function fwd+bwd"] = bts.host_us(
        step(lambda q, k, v: ConvertOnly.apply(q, k, v)), calls=10, repeats=21
    )
    rows["loop (no spin) sdpa fwd+bwd"] = loop_us(sdpa)
    rows["loop (no spin) cupyflash fwd+bwd"] = loop_us(ours)
    rows["host, 10 calls behind a spin: sdpa fwd+bwd"] = bts.host_us(sdpa, calls=10, repeats=21)
    rows["host, 10 calls behind a spin: cupyflash fwd+bwd"] = bts.host_us(ours, calls=10, repeats=21)

    # The pieces inside real training steps.
    torch.manual_seed(0)
    model = bts.GPT(512, 8, 1024).cuda()
    data = bts.batches(60, 8, 1024)
    ta.to_cupy = timed("to_cupy", ta.to_cupy)
    ta.to_torch = timed("to_torch", ta.to_torch)
    ta.on_torch_stream = timed("on_torch_stream", ta.on_torch_stream)
    cupyflash.attention_forward = timed("attention_forward", cupyflash.attention_forward)
    cupyflash.attention_backward = timed("attention_backward", cupyflash.attention_backward)
    ta.FlashAttention.forward = staticmethod(timed("Function.forward", ta.FlashAttention.forward))
    ta.FlashAttention.backward = staticmethod(timed("Function.backward", ta.FlashAttention.backward))
    import gc

    for attention in ("none", "identity", "sdpa", "cupyflash", "cupyflash without gc"):
        if attention == "cupyflash without gc":
            gc.collect()
            gc.freeze()
            gc.disable()
        spent.clear()
        counts.clear()
        m = bts.copy.deepcopy(model)
        m.set_attention(attention.split()[0])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        phases = collections.defaultdict(float)
        torch.cuda.synchronize()
        for i, tokens in enumerate(data):
            if i == 20:
                spent.clear()
                counts.clear()
                phases.clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = m(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, bts.VOCAB), tokens[:, 1:].reshape(-1))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            phases["model forward (host)"] += t1 - t0
            phases["loss.backward (host)"] += t2 - t1
            phases["optimizer (host)"] += t3 - t2
        torch.cuda.synchronize()
        steps = len(data) - 20
        rows[f"{attention}: step wall ms"] = (time.perf_counter() - start) * 1e3 / steps
        for name, value in phases.items():
            rows[f"{attention}: {name} ms/step"] = value * 1e3 / steps
        for name, value in spent.items():
            rows[f"{attention}: {name} us/call ({counts[name] // steps}/step)"] = value * 1e6 / counts[name]
    print("\n| piece | value |\n|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value:.2f} |")


if __name__ == "__main__":
    main()
