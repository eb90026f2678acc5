// pieces.cuh — float32 values as float16 pieces hi + lo, for the float32 kernels on Hopper's 16-bit
// warpgroup products: split_f32.cu splits the inputs q, k, v (and dout) once per call; the kernels split
// the operands they hold in registers (P, dS) tile by tile (wgmma.cuh, split_fragments).
//
// A value x, scaled by a power of two 2^e that brings the largest magnitude of its group (an input's
// (N, D) matrix; a register operand's row) into [2^14, 2^15), is hi + lo with hi = float16(x * 2^e) and
// lo = float16(x * 2^e - hi): 22 significant bits for every element within 2^17 of the group's largest,
// an absolute error below 2^-39 of that largest for the smaller ones. A product of two split operands is
// three float16 products, a_hi b_lo + a_lo b_hi + a_hi b_hi (the dropped a_lo b_lo is 2^-22 relative).
#pragma once
#include "common.cuh"
#include "block_info.cuh"

// The exponent e that brings a largest magnitude (as float bits) into [2^14, 2^15); 0 for 0 or a
// non-finite largest value (whose products are non-finite anyway). |e| <= 126: 2^e and 2^-e are floats.
__device__ __forceinline__ int split_exponent(u32 bits) {
  const int biased = static_cast<int>((bits >> 23) & 0xffu);
  if ((bits & 0x7fffffffu) == 0 || biased == 255) return 0;
  const int e = 14 - (biased == 0 ? -127 : biased - 127);
  return max(-126, min(126, e));
}
// 2^e for |e| <= 126, exactly.
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

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

// What undoes the inputs' scaling in a kernel on pieces (ON; otherwise every factor is 1 and nothing is
// read): q, k, v, dout of batch entry b were scaled by 2^e_q, 2^e_k, 2^e_v, 2^e_dout (split_exponents).
// A product of two scaled inputs carries both powers; one of a scaled input and a register operand
// (split with its own row scales, which the product undoes itself) carries the input's.
template <bool ON>
struct Pieces {
  float q = 1.f, k = 1.f, v = 1.f, dout = 1.f;
  float scores = 1.f;  // of S = q k^T
  float dscores = 1.f; // of dP = dout v^T
  __device__ __forceinline__ Pieces(const AttnParams& p, int b) {
    if constexpr (ON) {
      const int4 e = reinterpret_cast<const int4*>(p.split_exponents)[b];
      q = pow2(-e.x);
      k = pow2(-e.y);
      v = pow2(-e.z);
      dout = pow2(-e.w);
      scores = q * k;
      dscores = v * dout;
    }
  }
};
