// split_f32.cu — float32 inputs as pairs of float16 pieces, for the 16-bit warpgroup products on Hopper
// (attention_fwd.cu and attention_bwd.cu with T = float on the wgmma path).
//
// Each matrix ("slice": one (N, D) matrix of a contiguous (slices, N, D) float32 tensor) is scaled by a
// power of two and split into hi + lo (pieces.cuh says how, and what accuracy that keeps). A product of
// two split operands costs three float16 products: float32 accuracy at three times the cost of one
// float16 product, where Hopper's float32 tensor-core path (TF32, split likewise) costs three TF32
// products, i.e. six float16 products.
// Layout written: (slices, N, 2 * width) float16, row = [hi of D columns, zeros to width | lo likewise],
// and e per slice (int32). The power of two is exact, so the scaling costs no accuracy; the kernels
// undo it (pieces.cuh, Pieces).
#include "common.cuh"
#include "pieces.cuh"

// Up to four tensors (q, k, v, dout) per launch, blockIdx.z picking one (the host launches one at a time:
// a tensor's second read, by the split, then hits L2 more often; _split.py). Each a contiguous
// (slices, rows, d) float32 tensor x, split into pieces (slices, rows, 2 * width) float16. max_bits (zeroed
// by the host) receives each slice's largest finite |x|; the exponent of slice s goes to
// exponents[s * exponent_stride] (the attention kernels' per-batch-entry int4, or a per-slice array).
constexpr int SPLIT_MAX_JOBS = 4;
struct SplitJobs {
  const float* x[SPLIT_MAX_JOBS];
  u16* pieces[SPLIT_MAX_JOBS];
  u32* max_bits[SPLIT_MAX_JOBS];
  int* exponents[SPLIT_MAX_JOBS];
  long long slices[SPLIT_MAX_JOBS];
  int rows[SPLIT_MAX_JOBS];
  int d[SPLIT_MAX_JOBS];
  int exponent_stride[SPLIT_MAX_JOBS];
  int width;           // columns per piece (>= d, a multiple of 4)
  int rows_per_block;  // split_f32_kernel: rows per CTA
};

__device__ __forceinline__ float finite_abs(float x) { return isfinite(x) ? fabsf(x) : 0.f; }

// |x|'s largest finite value over each slice, as float bits (non-negative floats order like their bits):
// grid (chunks, slices; grid y wraps past 65535 slices, jobs), float4 loads, one atomic per warp. NaN and
// inf are skipped here and propagate through the split itself (inf * 2^e = inf, lo = NaN), so a
// non-finite element changes no other element's pieces unless it replaced its slice's largest finite one.
extern "C" __global__ void split_absmax_kernel(const SplitJobs jobs) {
  const int j = blockIdx.z;
  const long long vecs = static_cast<long long>(jobs.rows[j]) * jobs.d[j] / 4;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long s = blockIdx.y; s < jobs.slices[j]; s += gridDim.y) {
    const float4* xs = reinterpret_cast<const float4*>(jobs.x[j]) + s * vecs;
    float m = 0.f;
    long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    // Four independent loads in flight per thread: one at a time, the loop waits on memory latency.
    for (; i + 3 * step < vecs; i += 4 * step) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = xs[i + u * step];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        m = fmaxf(m, fmaxf(fmaxf(finite_abs(v[u].x), finite_abs(v[u].y)), fmaxf(finite_abs(v[u].z), finite_abs(v[u].w))));
    }
    for (; i < vecs; i += step) {
      const float4 v = xs[i];
      m = fmaxf(m, fmaxf(fmaxf(finite_abs(v.x), finite_abs(v.y)), fmaxf(finite_abs(v.z), finite_abs(v.w))));
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % WARP_SIZE == 0) atomicMax(jobs.max_bits[j] + s, __float_as_uint(m));
  }
}

// grid (row blocks, slices; y wraps like split_absmax_kernel's, jobs), each thread 4 consecutive columns
// of a row at a time; block (0, s) also records e of slice s. Columns past d are written as zeros.
extern "C" __global__ void split_f32_kernel(const SplitJobs jobs) {
  const int j = blockIdx.z;
  const int rows = jobs.rows[j], d = jobs.d[j], width = jobs.width;
  const int r0 = blockIdx.x * jobs.rows_per_block;
  const int r_end = min(rows, r0 + jobs.rows_per_block);
  const int vecs = width / 4;
  for (long long s = blockIdx.y; s < jobs.slices[j]; s += gridDim.y) {
    const int e = split_exponent(jobs.max_bits[j][s]);
    if (blockIdx.x == 0 && threadIdx.x == 0) jobs.exponents[j][s * jobs.exponent_stride[j]] = e;
    const float scale = pow2(e);
    const float* xs = jobs.x[j] + s * rows * d;
    u16* outs = jobs.pieces[j] + s * rows * 2 * width;
    for (int i = threadIdx.x; i < (r_end - r0) * vecs; i += blockDim.x) {
      const int r = r0 + i / vecs, c = (i % vecs) * 4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (c < d) v = *reinterpret_cast<const float4*>(xs + static_cast<long long>(r) * d + c);
      const float in[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
      u16 hi[4], lo[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        hi[k] = to_half(in[k]);
        lo[k] = to_half(in[k] - from_half(hi[k]));
      }
      u16* row = outs + static_cast<long long>(r) * 2 * width + c;
      *reinterpret_cast<uint2*>(row) = make_uint2(hi[0] | static_cast<u32>(hi[1]) << 16, hi[2] | static_cast<u32>(hi[3]) << 16);
      *reinterpret_cast<uint2*>(row + width) = make_uint2(lo[0] | static_cast<u32>(lo[1]) << 16, lo[2] | static_cast<u32>(lo[3]) << 16);
    }
  }
}
