// pieces.cuh — float32 values as float16 pieces hi + lo, for the float32 kernels on Hopper's 16-bit
// warpgroup products: split_f32.cu splits the inputs k, v (and q, dout for the backward) once per call;
// the forward splits its own q tile as it loads it; the kernels split the operands they hold in registers
// (P, dS) tile by tile (wgmma.cuh, split_fragments).
//
// A value x, scaled by a power of two 2^e that brings the largest magnitude of its group (SPLIT_BLOCK_ROWS
// rows of an input, or the forward's q tile; a register operand's row) into [2^14, 2^15), is hi + lo with
// hi = float16(x * 2^e) and lo = float16(x * 2^e - hi): 22 significant bits for every element within 2^17
// of the group's largest, an absolute error below 2^-39 of that largest for the smaller ones. A product of two split
// operands is three float16 products, a_hi b_lo + a_lo b_hi + a_hi b_hi (the dropped a_lo b_lo is 2^-22 relative).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "copy.cuh"

// The rows of an input that share one power of two: a multiple of every tile's rows, so that each tile
// the kernels load carries one (cupyflash/_cuda/f32_pieces.py mirrors it).
constexpr int SPLIT_BLOCK_ROWS = 128;

// The exponent e that brings a largest magnitude (as float bits) into [2^14, 2^15); 0 for 0 or a
// non-finite largest value (whose products are non-finite anyway). |e| <= 126: 2^e and 2^-e are floats.
__device__ __forceinline__ int split_exponent(u32 bits) {
  const int biased = static_cast<int>((bits >> 23) & 0xffu);
  if ((bits & 0x7fffffffu) == 0 || biased == 255) return 0;
  const int e = 14 - (biased == 0 ? -127 : biased - 127);
  return max(-126, min(126, e));
}
// 2^e for |e| <= 126, exactly.
__device__ __forceinline__ float pow2(int e) {
  return __int_as_float((127 + e) << 23);
}

__device__ __forceinline__ u16 to_half(float x) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
__device__ __forceinline__ float from_half(u16 h) {
  float x;
  asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
  return x;
}

__device__ __forceinline__ float finite_abs(float x) {
  return isfinite(x) ? fabsf(x) : 0.f;
}

// The largest of every thread's m over the CTA, in every thread (THREADS / 32 floats of shared memory in
// warp_max; the caller syncs before reusing it).
template <int THREADS>
__device__ __forceinline__ float cta_max(float m, float* warp_max) {
#pragma unroll
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (threadIdx.x % WARP_SIZE == 0) warp_max[threadIdx.x / WARP_SIZE] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < THREADS / WARP_SIZE; ++w) m = fmaxf(m, warp_max[w]);
  return m;
}

// Two scaled values a, b as float16 pieces, packed in pairs: hi = float16(x), lo = float16(x - hi).
__device__ __forceinline__ void split_pair(float a, float b, u32& hi, u32& lo) {
  const u16 a_hi = to_half(a), b_hi = to_half(b);
  hi = a_hi | static_cast<u32>(b_hi) << 16;
  lo = to_half(a - from_half(a_hi)) | static_cast<u32>(to_half(b - from_half(b_hi))) << 16;
}

// What undoes the inputs' scaling in a kernel on pieces (ON; otherwise every factor is 1 and nothing is
// read): rows [r, r + SPLIT_BLOCK_ROWS) (r a multiple of it) of q, k, v, dout of batch entry b were scaled by
// 2^e_q, 2^e_k, 2^e_v, 2^e_dout, the int4 split_exponents[b][r / SPLIT_BLOCK_ROWS] (dense batches: every
// entry has the same row blocks, max(nq, nk) / SPLIT_BLOCK_ROWS rounded up). A product of two scaled inputs
// carries both powers; one of a scaled input and a register operand (split with its own row scales, which
// the product undoes itself) carries the input's.
struct PieceFactors {
  float q = 1.f, k = 1.f, v = 1.f, dout = 1.f;
};
template <bool ON>
struct Pieces {
  const int4* e = nullptr;  // this batch entry's row blocks
  __device__ __forceinline__ Pieces(const AttnParams& p, int b) {
    if constexpr (ON)
      e = reinterpret_cast<const int4*>(p.split_exponents) + b * ceil_div(max(p.nq, p.nk), SPLIT_BLOCK_ROWS);
  }
  // The factors of the row block holding row `row` (its exponents read through the read-only cache).
  __device__ __forceinline__ PieceFactors at(int row) const {
    PieceFactors f;
    if constexpr (ON) {
      const int4 x = __ldg(e + row / SPLIT_BLOCK_ROWS);
      f.q = pow2(-x.x);
      f.k = pow2(-x.y);
      f.v = pow2(-x.z);
      f.dout = pow2(-x.w);
    }
    return f;
  }
};

// A tile of float32 rows straight from global memory into a swizzled shared tile of float16 pieces (Tile:
// ROWS x 2 * HEAD_DIM, row = [hi | lo]), scaled by the power of two of the tile's own largest finite
// magnitude (zeros past valid_rows and valid_cols, a multiple of 4). Returns 2^-e, the factor that undoes
// it. For a tile its CTA reads once (the forward's q): no split pass over the input, no pieces in memory.
// Every thread takes part: each holds one 8-column group (a 16-byte chunk of each piece) of every
// (THREADS / (HEAD_DIM / 8))-th row, all loads in flight before the largest value is known. warp_max:
// THREADS / 32 floats of shared memory. The pieces become visible to the tensor cores at the next
// smem_publish and barrier.
template <class Tile, int HEAD_DIM, int THREADS>
__device__ __forceinline__ float split_tile(half_t* smem, const float* gmem, i64 row_stride, int valid_rows,
                                            int valid_cols, float* warp_max) {
  constexpr int GROUPS = HEAD_DIM / 8, ROWS = Tile::NUM_ROWS;
  static_assert(Tile::NUM_COLS == 2 * HEAD_DIM && THREADS % GROUPS == 0, "whole rows of [hi | lo] per pass");
  constexpr int ROW_STEP = THREADS / GROUPS, PASSES = ceil_div(ROWS, ROW_STEP);
  const int r0 = threadIdx.x / GROUPS, c = (threadIdx.x % GROUPS) * 8;
  float x[PASSES][8];
  float m = 0.f;
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int r = r0 + pass * ROW_STEP;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < ROWS && r < valid_rows && c + 4 * h < valid_cols)
        v = *reinterpret_cast<const float4*>(gmem + r * row_stride + c + 4 * h);
      x[pass][4 * h] = v.x;
      x[pass][4 * h + 1] = v.y;
      x[pass][4 * h + 2] = v.z;
      x[pass][4 * h + 3] = v.w;
    }
  }
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass)
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, finite_abs(x[pass][i]));
  const int e = split_exponent(__float_as_uint(cta_max<THREADS>(m, warp_max)));
  const float scale = pow2(e);
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int r = r0 + pass * ROW_STEP;
    if (ROWS % ROW_STEP == 0 || r < ROWS) {
      u32 hi[4], lo[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) split_pair(x[pass][2 * i] * scale, x[pass][2 * i + 1] * scale, hi[i], lo[i]);
      *reinterpret_cast<uint4*>(smem + Tile::offset(r, c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(smem + Tile::offset(r, HEAD_DIM + c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  return pow2(-e);
}
