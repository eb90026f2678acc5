// split_f32.cu — float32 inputs as pairs of float16 pieces, for the 16-bit warpgroup products on Hopper
// (attention_fwd.cu and attention_bwd.cu with T = float on the wgmma path).
//
// Each block of SPLIT_BLOCK_ROWS rows of a matrix ("slice": one (N, D) matrix of a contiguous (slices, N,
// D) float32 tensor) is scaled by a power of two and split into hi + lo (pieces.cuh says how, and what
// accuracy that keeps). A product of two split operands costs three float16 products: float32 accuracy at
// three times the cost of one float16 product, where Hopper's float32 tensor-core path (TF32, split
// likewise) costs three TF32 products, i.e. six float16 products.
// Layout written: (slices, N, 2 * width) float16, row = [hi of D columns, zeros to width | lo likewise],
// and e per slice and row block (int32). The power of two is exact, so the scaling costs no accuracy;
// the kernels undo it (pieces.cuh, Pieces). One pass: a CTA holds its row block in registers while it
// finds the block's largest magnitude, so each input is read once and its pieces written once.
#include "common.cuh"
#include "pieces.cuh"

// Up to four tensors (q, k, v, dout) per launch, blockIdx.z picking one. Each a contiguous (slices, rows,
// d) float32 tensor x, split into pieces (slices, rows, 2 * width) float16. The exponent of row block r
// of slice s goes to exponents[s * slice_stride + r * block_stride] (the attention kernels' int4 per
// batch entry and row block, or a per-slice array that the host spreads over broadcast dims).
constexpr int SPLIT_MAX_JOBS = 4;
constexpr int SPLIT_THREADS = 256;
constexpr int SPLIT_MAX_WIDTH = 128;
struct SplitJobs {
  const float* x[SPLIT_MAX_JOBS];
  u16* pieces[SPLIT_MAX_JOBS];
  int* exponents[SPLIT_MAX_JOBS];
  long long slices[SPLIT_MAX_JOBS];
  long long slice_stride[SPLIT_MAX_JOBS];  // of exponents, in int32
  int block_stride[SPLIT_MAX_JOBS];
  int rows[SPLIT_MAX_JOBS];
  int d[SPLIT_MAX_JOBS];
  int width;  // columns per piece: >= d, a power of two from 4 to SPLIT_MAX_WIDTH
};

// grid (row blocks of the longest input, slices (wrapping past 65535), jobs). Each thread keeps one
// 4-column group of every (THREADS / (width / 4))-th row of the block: all its loads are in flight before
// the block's largest finite |x| is known. NaN and inf are left out of that largest value and propagate
// through the split itself (inf * 2^e = inf, lo = NaN), so a non-finite element changes no other
// element's pieces unless it replaced its block's largest finite one. Bounded to two CTAs per SM (128
// registers, 64 of them the block's values), so that one CTA's loads can run while the other stores;
// unbounded, ptxas took 145 and one CTA per SM (not timed against it).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS, 2) split_f32_kernel(const SplitJobs jobs) {
  constexpr int VECS = SPLIT_BLOCK_ROWS * (SPLIT_MAX_WIDTH / 4) / SPLIT_THREADS;  // float4 per thread, widest case
  __shared__ float warp_max[SPLIT_THREADS / WARP_SIZE];
  const int j = blockIdx.z;
  const int rows = jobs.rows[j], d = jobs.d[j], width = jobs.width;
  const int r0 = blockIdx.x * SPLIT_BLOCK_ROWS;
  if (r0 >= rows) return;  // an input shorter than the longest one
  const int block_rows = min(SPLIT_BLOCK_ROWS, rows - r0);
  const int vecs = width / 4;
  const int c = (threadIdx.x % vecs) * 4, row_step = SPLIT_THREADS / vecs;
  for (long long s = blockIdx.y; s < jobs.slices[j]; s += gridDim.y) {
    const float* xs = jobs.x[j] + (s * rows + r0) * d;
    float4 v[VECS];
    float m = 0.f;
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
      const int r = threadIdx.x / vecs + u * row_step;
      v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < block_rows && c < d) v[u] = *reinterpret_cast<const float4*>(xs + static_cast<long long>(r) * d + c);
    }
#pragma unroll
    for (int u = 0; u < VECS; ++u)
      m = fmaxf(m, fmaxf(fmaxf(finite_abs(v[u].x), finite_abs(v[u].y)), fmaxf(finite_abs(v[u].z), finite_abs(v[u].w))));
    m = cta_max<SPLIT_THREADS>(m, warp_max);
    __syncthreads();  // warp_max is rewritten for the next slice
    const int e = split_exponent(__float_as_uint(m));
    if (threadIdx.x == 0) jobs.exponents[j][s * jobs.slice_stride[j] + blockIdx.x * jobs.block_stride[j]] = e;
    const float scale = pow2(e);
    u16* outs = jobs.pieces[j] + (s * rows + r0) * 2 * width;
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
      const int r = threadIdx.x / vecs + u * row_step;
      if (r >= block_rows) continue;
      uint2 hi, lo;
      split_pair(v[u].x * scale, v[u].y * scale, hi.x, lo.x);
      split_pair(v[u].z * scale, v[u].w * scale, hi.y, lo.y);
      u16* row = outs + static_cast<long long>(r) * 2 * width + c;
      *reinterpret_cast<uint2*>(row) = hi;
      *reinterpret_cast<uint2*>(row + width) = lo;
    }
  }
}
