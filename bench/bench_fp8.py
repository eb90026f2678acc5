#!/usr/bin/env python3
"""The FP8 forward against our bfloat16 forward on the same shapes, same run, and FlashAttention-3's outlier
accuracy experiment.

    python bench/bench_fp8.py [--head-dims 64,128,256] [--seqlens 2k,8k,16k] [--json PATH] [--no-accuracy]

Speed: FlashAttention's benchmark shapes (16384 tokens, hidden 2048: B = 16384 // N, H = 2048 // D), causal and
not. The bfloat16 inputs are quantized once, untimed (``quantize_fp8``, one descale per sequence and head); the
FP8 call's time includes everything it does per call besides the kernel. Each call is timed two ways, median of
--repeats:

- ``gpu``: ``--timing gpu`` of bench_attention.py: L2 flushed before every call and a spin that covers the host's
  issue, so that the events time the GPU's work alone;
- ``user``: as a user's loop sees it: the GPU idle, events recorded around the call, then a wait for the end
  event, so that the host's time to issue the call counts wherever the GPU would wait for it.

``host``: the host's microseconds per call, calls queued behind a spin (no launch waits for the GPU). TFLOP/s
count the same FLOPs for both: 4·B·H·N²·D, halved for causal. Before timing, each call's last 256 rows of two
heads are checked against the float64 reference on the inputs it computed with (FP8: the dequantized ones); the
relative max errors are printed.

Accuracy (FlashAttention-3's experiment): q, k, v ~ N(0, 1) + N(0, 100) · Bernoulli(0.001), B = 1, H = 16,
N = 8k, D = 128; RMSE of out against float64 attention on the unquantized inputs, for: block quantization
(128 rows) with q and k rotated by ``hadamard_rotate``, with v in blocks too and with v's descale per sequence
and head; per-tensor descales without the rotation; one descale per sequence and head without it; our
bfloat16 forward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402
from bench_attention import Case, L2Flush, inputs_for, median_ms  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _timing, reference  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
CHECK_ROWS, CHECK_HEADS = 256, 2


def parse_size(text):
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def check(out, q, k, v, causal):
    """Relative max error of out's last CHECK_ROWS rows of CHECK_HEADS heads (batch 0) against float64."""
    q64, k64, v64 = (np.asarray(x[0, :CHECK_HEADS], dtype=np.float64) for x in (q, k, v))
    ref = reference.attention(q64[..., -CHECK_ROWS:, :], k64, v64, causal=causal)
    got = cupy.asnumpy(out[0, :CHECK_HEADS, -CHECK_ROWS:]).astype(np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def user_ms(call, args):
    """Median milliseconds of ``call()`` between events with the GPU idle before it (host time included)."""
    for _ in range(args.warmup):
        call()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(args.repeats):
        cupy.cuda.get_current_stream().synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def speed_row(case, args, flush):
    q, k, v, _ = inputs_for(case)
    fq, fk, fv = (cupyflash.quantize_fp8(x) for x in (q, k, v))
    deq = [cupy.asnumpy(x.dequantize()[:1]) for x in (fq, fk, fv)]
    host = [cupy.asnumpy(x[:1]).astype(np.float32) for x in (q, k, v)]
    row = {
        "case": case.name,
        "d": case.d,
        "n": case.n,
        "causal": case.causal,
        "b": case.b,
        "h": case.h,
        "flops": case.flops_fwd,
    }
    calls = {
        "bf16": (lambda: cupyflash.attention_forward(q, k, v, causal=case.causal)[0], host),
        "fp8": (lambda: cupyflash.attention_forward(fq, fk, fv, causal=case.causal)[0], deq),
    }
    for name, (call, inputs) in calls.items():
        row[f"{name}_err"] = check(call(), *inputs, case.causal)
        ms = median_ms(call, args, flush)
        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, case.flops_fwd / ms / 1e9
        row[f"{name}_user_ms"] = user_ms(call, args)
        row[f"{name}_host_us"] = _timing.host_us(call, calls=20, repeats=5, spin_ms=20)
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    row["user_speedup"] = row["bf16_user_ms"] / row["fp8_user_ms"]
    print(
        f"{case.name:24} gpu: bf16 {row['bf16_tflops']:7.1f} fp8 {row['fp8_tflops']:7.1f} TFLOP/s "
        f"x{row['speedup']:.2f}"
        f" | user: x{row['user_speedup']:.2f} | host us bf16 {row['bf16_host_us']:.0f} fp8 {row['fp8_host_us']:.0f}"
        f" | err bf16 {row['bf16_err']:.1e} fp8 {row['fp8_err']:.1e}",
        flush=True,
    )
    return row


def accuracy(seed=0, b=1, h=16, n=8192, d=128):
    rng = cupy.random.default_rng(seed)

    def draw():
        x = rng.standard_normal((b, h, n, d), dtype=np.float32)
        return x + 10 * rng.standard_normal((b, h, n, d), dtype=np.float32) * (rng.random((b, h, n, d)) < 1e-3)

    q, k, v = draw(), draw(), draw()
    ref, _ = cupyflash.attention_forward(*(x.astype(np.float64) for x in (q, k, v)))

    def rmse(out):
        return float(cupy.sqrt(cupy.mean((out.astype(np.float64) - ref) ** 2)))

    found = {}
    qr, kr = cupyflash.hadamard_rotate(q, seed=1), cupyflash.hadamard_rotate(k, seed=1)
    found["fp8 blocks of 128 + hadamard_rotate"] = rmse(
        cupyflash.attention(*(cupyflash.quantize_fp8(x, block=128) for x in (qr, kr, v)))
    )
    found["fp8 q, k blocks of 128 + hadamard_rotate, v per sequence and head"] = rmse(
        cupyflash.attention(
            cupyflash.quantize_fp8(qr, block=128), cupyflash.quantize_fp8(kr, block=128), cupyflash.quantize_fp8(v)
        )
    )
    found["fp8 per tensor"] = rmse(cupyflash.attention(*(cupyflash.quantize_fp8(x, block="tensor") for x in (q, k, v))))
    found["fp8 per sequence and head"] = rmse(cupyflash.attention(*(cupyflash.quantize_fp8(x) for x in (q, k, v))))
    found["bfloat16"] = rmse(cupyflash.attention(*(x.astype(BF16) for x in (q, k, v))))
    for name, value in found.items():
        print(f"accuracy D={d} N={n}: {name:64} RMSE {value:.2e}", flush=True)
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="2k,8k,16k")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    parser.add_argument("--no-speed", dest="speed", action="store_false")
    args = parser.parse_args(argv)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    result = {"device": props["name"].decode(), "timing": "gpu"}
    print(f"# {result['device']}")
    if args.speed:
        flush = L2Flush("gpu")
        result["speed"] = [
            speed_row(Case("bf16", d, n, causal), args, flush)
            for d in (int(x) for x in args.head_dims.split(","))
            for causal in (False, True)
            for n in (parse_size(s) for s in args.seqlens.split(","))
        ]
    if args.accuracy:
        result["accuracy"] = accuracy()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
