"""The DRAM floor of a memory-bound call: how long this GPU takes to read some arrays once and write
others once, with nothing else to do.

A short band (bench_modifiers.py's window rows) leaves an attention call little arithmetic per byte, so
its time is bounded below by the bytes it must move: the forward reads q, k, v and writes out, the
backward reads q, k, v, out, dout and writes dq, dk, dv. ``floor_ms`` times kernels that do only that, each
output element the XOR of the inputs' elements at its index (so every byte is read and the result can
be checked), in 16-byte loads and stores, and returns the fastest of a few launch shapes: no kernel that
reads and writes those bytes once runs faster on this GPU than about that. (The lse, delta and lse_log2
vectors, under 1% of the bytes at D = 128, are left out.)

    python bench/dram_floor.py                 # the window rows' problem: B * N = 16k, H = 16, D = 128
"""

import sys
from pathlib import Path

import numpy as np

MAX_INPUTS, MAX_OUTPUTS = 5, 3
ITEMS = (1, 2, 4, 8)  # 16-byte chunks per thread and turn, loads all issued before any store
THREADS = 256
WAVES = 16  # the persistent launch shape: this many CTAs per SM, each striding over the arrays

_SOURCE = r"""
// out_j[i] = in_0[i] ^ ... ^ in_(IN-1)[i] ^ j for every output j, over n 16-byte chunks.
template <int IN, int OUT, int ITEMS>
__global__ void stream_kernel(const uint4* __restrict__ in0, const uint4* __restrict__ in1,
                              const uint4* __restrict__ in2, const uint4* __restrict__ in3,
                              const uint4* __restrict__ in4, uint4* __restrict__ out0,
                              uint4* __restrict__ out1, uint4* __restrict__ out2, long long n) {
  const uint4* in[5] = {in0, in1, in2, in3, in4};
  uint4* out[3] = {out0, out1, out2};
  const long long stride = (long long)gridDim.x * blockDim.x * ITEMS;
  for (long long base = (long long)blockIdx.x * blockDim.x * ITEMS + threadIdx.x; base < n; base += stride) {
    uint4 x[ITEMS][IN];
#pragma unroll
    for (int t = 0; t < ITEMS; ++t) {
      const long long i = base + (long long)t * blockDim.x;
#pragma unroll
      for (int a = 0; a < IN; ++a) x[t][a] = i < n ? in[a][i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int t = 0; t < ITEMS; ++t) {
      const long long i = base + (long long)t * blockDim.x;
      uint4 s = x[t][0];
#pragma unroll
      for (int a = 1; a < IN; ++a) s = make_uint4(s.x ^ x[t][a].x, s.y ^ x[t][a].y, s.z ^ x[t][a].z, s.w ^ x[t][a].w);
#pragma unroll
      for (int j = 0; j < OUT; ++j)
        if (i < n) out[j][i] = make_uint4(s.x ^ j, s.y, s.z, s.w);
    }
  }
}
"""

_modules = {}


def _kernel(n_in, n_out, items):
    import cupy

    key = (n_in, n_out)
    if key not in _modules:
        names = [f"stream_kernel<{n_in}, {n_out}, {i}>" for i in ITEMS]
        _modules[key] = cupy.RawModule(code=_SOURCE, options=("-std=c++17",), name_expressions=names)
    return _modules[key].get_function(f"stream_kernel<{n_in}, {n_out}, {items}>")


def launch_shapes(chunks, sm_count):
    """(items, grid) pairs tried: every ITEMS, on a grid that covers the arrays once and on WAVES CTAs per SM."""
    shapes = []
    for items in ITEMS:
        for grid in (-(-chunks // (THREADS * items)), WAVES * sm_count):
            if (items, grid) not in shapes:
                shapes.append((items, grid))
    return shapes


def stream(inputs, outputs, items, grid):
    """One launch: each of ``outputs`` (cupy arrays of the inputs' size, 16-byte multiples) gets the XOR of
    ``inputs`` (1 to 5 arrays), chunk by chunk, output j's first word XOR j."""
    if not 1 <= len(inputs) <= MAX_INPUTS or not 1 <= len(outputs) <= MAX_OUTPUTS:
        raise ValueError(
            f"1 to {MAX_INPUTS} inputs and 1 to {MAX_OUTPUTS} outputs, got {len(inputs)} and {len(outputs)}"
        )
    nbytes = inputs[0].nbytes
    if nbytes % 16 or any(x.nbytes != nbytes or not x.flags.c_contiguous for x in list(inputs) + list(outputs)):
        raise ValueError("the arrays must be C-contiguous, of one size, a multiple of 16 bytes")
    ins = list(inputs) + [inputs[0]] * (MAX_INPUTS - len(inputs))
    outs = list(outputs) + [outputs[0]] * (MAX_OUTPUTS - len(outputs))
    _kernel(len(inputs), len(outputs), items)((grid,), (THREADS,), (*ins, *outs, np.int64(nbytes // 16)))


def floor_ms(nbytes, n_in, n_out, timer):
    """The fastest of launch_shapes() at reading ``n_in`` arrays of ``nbytes`` bytes and writing ``n_out``, as
    (ms, items, grid); ``timer(fn)`` returns fn's time in ms (the caller's method: L2 flush, median)."""
    import cupy

    chunks = -(-nbytes // 16)
    arrays = [cupy.zeros(chunks * 16, dtype=cupy.uint8) for _ in range(n_in + n_out)]
    ins, outs = arrays[:n_in], arrays[n_in:]
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["multiProcessorCount"]
    best = None
    for items, grid in launch_shapes(chunks, sm_count):
        ms = timer(lambda: stream(ins, outs, items, grid))
        if best is None or ms < best[0]:
            best = (ms, items, grid)
    return best


_READ_SOURCE = r"""
// Every 16-byte chunk of `in` read once, XORed into the thread's register; one chunk per thread written.
extern "C" __global__ void read_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, long long n) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long stride = (long long)gridDim.x * blockDim.x * 4;
  for (long long base = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x; base < n; base += stride) {
    uint4 x[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const long long i = base + (long long)t * blockDim.x;
      x[t] = i < n ? in[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) acc = make_uint4(acc.x ^ x[t].x, acc.y ^ x[t].y, acc.z ^ x[t].z, acc.w ^ x[t].w);
  }
  out[(long long)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""


def read_floor_ms(nbytes, timer):
    """The fastest of a few grids at reading ``nbytes`` once (a decode step's floor: its cache is read once
    and its output is tiny), as (ms, grid)."""
    import cupy

    kernel = cupy.RawKernel(_READ_SOURCE, "read_kernel")
    chunks = -(-nbytes // 16)
    data = cupy.random.randint(0, 256, size=chunks * 16, dtype=cupy.uint8)  # never zeros (METHOD.md)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["multiProcessorCount"]
    best = None
    for grid in (sm_count * 4, sm_count * 8, sm_count * 16, sm_count * 32):
        out = cupy.empty(grid * THREADS * 16, dtype=cupy.uint8)
        ms = timer(lambda: kernel((grid,), (THREADS,), (data, out, cupy.int64(chunks))))
        if best is None or ms < best[0]:
            best = (ms, grid)
    return best


def attention_floors(elements, itemsize, timer):
    """{"fwd": ..., "bwd": ...} for attention on arrays of ``elements`` elements each (q, k, v, out, dout and
    the gradients all alike, Nq = Nk, Dv = D): ms, the bytes moved, and the rate."""
    nbytes = elements * itemsize
    floors = {}
    for phase, (n_in, n_out) in {"fwd": (3, 1), "bwd": (5, 3)}.items():
        ms, items, grid = floor_ms(nbytes, n_in, n_out, timer)
        moved = (n_in + n_out) * nbytes
        floors[phase] = {"ms": ms, "bytes": moved, "tb_per_s": moved / ms / 1e9, "items": items, "grid": grid}
    return floors


def time_at_target(ms, ratio, target):
    """The time at which a row measured at ``ms`` with ``ratio`` (a rate ratio: rate ~ 1 / time) would reach
    ``target``."""
    return ms * ratio / target


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_attention as ba

    flush = ba.L2Flush("gpu")
    args = type("Args", (), {"warmup": 5, "repeats": 30})()
    floors = attention_floors(16384 * 16 * 128, 2, lambda fn: ba.median_ms(fn, args, flush))
    for phase, f in floors.items():
        print(
            f"{phase}: {f['bytes'] / 1e6:.0f} MB in {f['ms']:.4f} ms, {f['tb_per_s']:.2f} TB/s "
            f"({f['items']} chunks per thread, {f['grid']} CTAs)"
        )


if __name__ == "__main__":
    main()
