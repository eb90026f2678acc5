"""The FP8 forward's floors in TFLOP/s on this GPU, from measured rates, against its target (1.5x our bfloat16
forward): the SM clock while each forward runs, the special-function unit's ex2 rate, and each forward's time.

A key block of every computing warpgroup costs an SM at least (bench/exp/18_fwd_sass_loop.py counts the loop):
its products at the tensor cores' rate, its exponentials at the special-function unit's, and its loop body's
instructions at one per clock per scheduler. The first two are rates per clock; this script measures the clock
the kernels run at (NVML's SM clock sampled while each forward runs back to back, and clock64 against
%globaltimer in a spin kernel beside them), and the ex2 rate per clock (independent chains on every SM), so
that each floor can be written in TFLOP/s and set beside the measured forwards and the target.

    PYTHONPATH=. python bench/exp/19_fp8_floors.py [--dims 64,128,256] [--n 16384] [--gemm] [--json PATH]

Writes $OUT/fp8_floors.json (or --json).

What it taught (H200, 2026-11-27, bench/log/2026-11-27-h200-fp8-floors.txt): ex2 runs at 16 per clock per SM;
the bf16 forward runs into the power limit (1.67-1.86 GHz), the FP8 one barely (1.83-1.98); per clock the FP8
forward at D = 128 did no more work than the bf16 one, so its products are not what bounds it.
"""

import argparse
import json
import os
import statistics
import threading
import time

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing

BF16 = np.dtype(ml_dtypes.bfloat16)
parser = argparse.ArgumentParser()
parser.add_argument("--dims", default="64,128,256")
parser.add_argument("--n", type=int, default=16384)
parser.add_argument("--seconds", type=float, default=1.5, help="how long each forward runs back to back")
parser.add_argument(
    "--gemm",
    action="store_true",
    help="also time cuBLAS's bf16 and FP8 matrix products (torch), the tensor cores' rate as a library reaches it",
)
parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_floors.json"))
args = parser.parse_args()

# Exponentials a thread issues per key block in the loop (bench/exp/18: 64 scores and 2 rescales at 128-key
# blocks, 32 and 2 at 64-key blocks), per score.
EX2_PER_SCORE = {64: 66 / 64, 128: 66 / 64, 256: 34 / 32}

EX2_SOURCE = r"""
extern "C" __global__ void ex2_chains(float* out, int steps, long long* cycles) {
  // Eight independent chains per thread, so the unit, not a chain's latency, sets the pace.
  float x[8];
  for (int i = 0; i < 8; ++i) x[i] = 1e-3f * (threadIdx.x + i);
  const long long start = clock64();
  for (int s = 0; s < steps; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x[i]));
  const long long end = clock64();
  float sum = 0.f;
  for (int i = 0; i < 8; ++i) sum += x[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
}
extern "C" __global__ void clock_rate(long long* out, long long ns) {
  // One thread per SM spins for ns nanoseconds of %globaltimer and counts the SM's clocks meanwhile.
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
  const long long c1 = clock64();
  if (threadIdx.x == 0) { out[2 * blockIdx.x] = c1 - c0; out[2 * blockIdx.x + 1] = (long long)(t - t0); }
}
"""
module = cupy.RawModule(code=EX2_SOURCE)
device = cupy.cuda.Device()
sms = device.attributes["MultiProcessorCount"]


def ex2_per_clock_per_sm() -> float:
    threads, steps = 1024, 4096
    out = cupy.empty(sms * threads, dtype=cupy.float32)
    cycles = cupy.empty(sms, dtype=cupy.int64)
    kernel = module.get_function("ex2_chains")
    for _ in range(2):
        kernel((sms,), (threads,), (out, np.int32(steps), cycles))
    cupy.cuda.runtime.deviceSynchronize()
    return threads * steps * 8 / float(cupy.median(cycles.astype(cupy.float64)))


def clock_ghz_spin(ns: int = 200_000_000) -> float:
    out = cupy.empty(2 * sms, dtype=cupy.int64)
    module.get_function("clock_rate")((sms,), (32,), (out, np.int64(ns)))
    pairs = out.get().reshape(-1, 2)
    return float(np.median(pairs[:, 0] / pairs[:, 1]))


def nvml_sampler():
    """A function that returns the median NVML SM clock (GHz) over a callable's run, or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
    except Exception:  # noqa: BLE001 - NVML is optional: the spin kernel's clock still stands
        return None

    def sample(run):
        found, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                found.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
                time.sleep(0.02)

        thread = threading.Thread(target=poll)
        thread.start()
        run()
        stop.set()
        thread.join()
        return statistics.median(found) / 1000 if found else None

    return sample


def gemm_rates(sample):
    """TFLOP/s and SM clock (NVML) of cuBLAS's 8192^3 products through torch: bf16, and e4m3 (torch._scaled_mm,
    B column-major as it requires) with a bf16 out. The tensor cores' rate as a library reaches it, at the clock
    it holds."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    forms = {
        "bf16": lambda: a @ b,
        "fp8": lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    }
    found = {}
    for name, call in forms.items():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        found[f"{name}_tflops"] = 2 * n**3 / statistics.median(times) / 1e9

        def back_to_back(call=call):
            stop = time.perf_counter() + args.seconds
            while time.perf_counter() < stop:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()

        found[f"{name}_clock_ghz_nvml"] = sample(back_to_back) if sample else None
    return found


def inputs(d, n):
    b, h = 16384 // n, 2048 // d
    rng = np.random.default_rng(d + n)
    return [cupy.asarray(rng.standard_normal((b, h, n, d), dtype=np.float32)).astype(BF16) for _ in range(3)]


def main():
    sample = nvml_sampler()
    results = {"device": cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode(), "sms": sms}
    results["ex2_per_clock_per_sm"] = ex2_per_clock_per_sm()
    results["clock_ghz_idle_spin"] = clock_ghz_spin()
    if args.gemm:
        results["gemm"] = gemm_rates(sample)
        print("cuBLAS 8192^3:", {key: round(value, 3) for key, value in results["gemm"].items() if value}, flush=True)
    flush = cupy.empty(256 << 20, dtype=cupy.uint8)

    def before():
        flush.fill(0)
        _timing.spin(15)

    rows = []
    for d in [int(x) for x in args.dims.split(",")]:
        q, k, v = inputs(d, args.n)
        fq, fk, fv = (cupyflash.quantize_fp8(x) for x in (q, k, v))
        flops = 4 * q.shape[0] * q.shape[1] * args.n * args.n * d
        row = {"d": d, "n": args.n}
        for name, call in (
            ("bf16", lambda: cupyflash.attention(q, k, v)),
            ("fp8", lambda: cupyflash.attention(fq, fk, fv)),
        ):
            ms = _timing.median_ms(call, warmup=3, repeats=20, before_each=before)
            row[f"{name}_tflops"] = flops / ms / 1e9

            def back_to_back(call=call):
                end = time.perf_counter() + args.seconds
                while time.perf_counter() < end:
                    for _ in range(5):
                        call()
                    cupy.cuda.runtime.deviceSynchronize()

            row[f"{name}_clock_ghz_nvml"] = sample(back_to_back) if sample else None
        ghz = row["fp8_clock_ghz_nvml"] or results["clock_ghz_idle_spin"]
        # Floors of the FP8 forward at the clock it ran at: the exponentials alone, per score 4·D FLOPs.
        row["fp8_ex2_floor_tflops"] = (
            results["ex2_per_clock_per_sm"] * sms * ghz * 1e9 * 4 * d / EX2_PER_SCORE[d] / 1e12
        )
        row["fp8_tensor_spec_tflops"] = 8192 * sms * ghz * 1e9 / 1e12
        row["target_tflops"] = 1.5 * row["bf16_tflops"]
        rows.append(row)
        print(
            f"D={d:3d} N={args.n}: bf16 {row['bf16_tflops']:6.1f} fp8 {row['fp8_tflops']:6.1f} TFLOP/s "
            f"(x{row['fp8_tflops'] / row['bf16_tflops']:.2f}); target {row['target_tflops']:6.1f}; at "
            f"{ghz:.3f} GHz the exponentials allow {row['fp8_ex2_floor_tflops']:6.1f}, the FP8 products "
            f"{row['fp8_tensor_spec_tflops']:6.1f} (dense spec rate); SM clock bf16 {row['bf16_clock_ghz_nvml']} "
            f"fp8 {row['fp8_clock_ghz_nvml']} GHz (NVML)",
            flush=True,
        )
    results["rows"] = rows
    print(
        f"ex2: {results['ex2_per_clock_per_sm']:.2f} per clock per SM; spin-kernel clock "
        f"{results['clock_ghz_idle_spin']:.3f} GHz"
    )
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


main()
