// split_f32.cu — float32 inputs as pairs of float16 pieces, for the forward's 16-bit warpgroup products
// on Hopper (attention_fwd.cu, attention_fwd_wgmma_kernel with T = float).
//
// Each matrix ("slice": one (N, D) matrix of a contiguous (slices, N, D) float32 tensor) is scaled by a
// power of two and split into hi + lo (pieces.cuh says how, and what accuracy that keeps). A product of
// two split operands costs three float16 products: float32 accuracy at three times the cost of one
// float16 product, where Hopper's float32 tensor-core path (TF32, split likewise) costs three TF32
// products, i.e. six float16 products.
// Layout written: (slices, N, 2 * width) float16, row = [hi of D columns, zeros to width | lo likewise],
// and e per slice (int32). The power of two is exact, so the scaling costs no accuracy; the kernels
// undo it in the softmax's scale (q and k) and in the output's normalisation (v).
#include "common.cuh"
#include "pieces.cuh"

__device__ __forceinline__ float finite_abs(float x) { return isfinite(x) ? fabsf(x) : 0.f; }

// |x|'s largest finite value over each slice, as float bits (non-negative floats order like their bits):
// grid (chunks, slices; grid y wraps past 65535 slices), float4 loads, one atomic per warp. NaN and inf
// are skipped here and propagate through the split itself (inf * 2^e = inf, lo = NaN), so a non-finite
// element changes no other element's pieces unless it replaced its slice's largest finite one.

extern "C" __global__ void split_absmax_kernel(const float4* x, long long vecs_per_slice, int slices, u32* max_bits) {
  for (int s = blockIdx.y; s < slices; s += gridDim.y) {
    const float4* xs = x + static_cast<long long>(s) * vecs_per_slice;
    float m = 0.f;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs_per_slice;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
      const float4 v = xs[i];
      m = fmaxf(m, fmaxf(fmaxf(finite_abs(v.x), finite_abs(v.y)), fmaxf(finite_abs(v.z), finite_abs(v.w))));
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % WARP_SIZE == 0) atomicMax(max_bits + s, __float_as_uint(m));
  }
}

// Rows [blockIdx.x * rows_per_block, ...) of slice s.
__device__ __forceinline__ void split_rows(const float* x, int rows, int d, int width, int rows_per_block, int s,
                                           const u32* max_bits, u16* out, int* exponents) {
  const int e = split_exponent(max_bits[s]);
  if (blockIdx.x == 0 && threadIdx.x == 0) exponents[s] = e;
  const float scale = pow2(e);
  const int r0 = blockIdx.x * rows_per_block;
  const int r_end = min(rows, r0 + rows_per_block);
  const int vecs = width / 4;
  const float* xs = x + static_cast<long long>(s) * rows * d;
  u16* outs = out + static_cast<long long>(s) * rows * 2 * width;
  for (int i = threadIdx.x; i < (r_end - r0) * vecs; i += blockDim.x) {
    const int r = r0 + i / vecs, c = (i % vecs) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < d) v = *reinterpret_cast<const float4*>(xs + static_cast<long long>(r) * d + c);
    const float in[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
    u16 hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      hi[j] = to_half(in[j]);
      lo[j] = to_half(in[j] - from_half(hi[j]));
    }
    u16* row = outs + static_cast<long long>(r) * 2 * width + c;
    *reinterpret_cast<uint2*>(row) = make_uint2(hi[0] | static_cast<u32>(hi[1]) << 16, hi[2] | static_cast<u32>(hi[3]) << 16);
    *reinterpret_cast<uint2*>(row + width) = make_uint2(lo[0] | static_cast<u32>(lo[1]) << 16, lo[2] | static_cast<u32>(lo[3]) << 16);
  }
}

// grid (row blocks, slices; y wraps like split_absmax_kernel's), each thread 4 consecutive columns of a
// row at a time; block (0, s) also records e of slice s. `d` columns are read (a multiple of 4), `width`
// >= d written per piece (zeros past d).
extern "C" __global__ void split_f32_kernel(const float* x, int rows, int d, int width, int rows_per_block, int slices,
                                            const u32* max_bits, u16* out, int* exponents) {
  for (int s = blockIdx.y; s < slices; s += gridDim.y) split_rows(x, rows, d, width, rows_per_block, s, max_bits, out, exponents);
}

