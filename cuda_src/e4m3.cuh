// e4m3.cuh — float8 e4m3fn codes as the key/value-cache kernels read and write them: 16 codes widened to float16
// (exactly), and a float rounded to a code (to nearest even, saturating at +-448).
//
// Every finite e4m3 value is a float16 value (4 significant bits, exponents 2^-9 to 2^8), so the widening is
// exact. sm_89 and newer convert two codes per instruction (cvt.rn.f16x2.e4m3x2, NaN codes to NaN). sm_80 works on
// the bits: a code's sign goes to bit 15 and its 7 exponent-and-mantissa bits just below float16's mantissa point,
// which reads as the value times 2^-8, subnormal codes included; one fused multiply by 2^8, exact, puts it back
// (adding -0 keeps a -0 code's sign), and the NaN codes (0x7F, 0xFF) are made NaN by a compare.
#pragma once
#include "common.cuh"

// Two codes (the low byte in the low half) as a float16 pair.
__device__ __forceinline__ u32 widen_e4m3x2(u32 two_codes) {
  u32 r;
#if __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<unsigned short>(two_codes)));
#else
  const u32 at8 = __byte_perm(two_codes, 0u, 0x1404u);  // each code in bits 8..15 of its half
  const u32 bits = (at8 & 0x80008000u) | ((at8 >> 1) & 0x3F803F80u);
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(bits), "r"(0x5C005C00u), "r"(0x80008000u));  // x 2^8, + -0
  r |= __vcmpeq2(at8 & 0x7F007F00u, 0x7F007F00u);                                                 // NaN codes
#endif
  return r;
}

// The upper two codes of a word (bytes 2 and 3) as a float16 pair. On sm_89 and newer the conversion reads the
// word's upper half in place (no shift first).
__device__ __forceinline__ u32 widen_e4m3x2_hi(u32 four_codes) {
#if __CUDA_ARCH__ >= 890
  u32 r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(four_codes));
  return r;
#else
  return widen_e4m3x2(four_codes >> 16);
#endif
}

// 16 codes (one 16-byte chunk) widened to 16 float16 values (two 16-byte chunks).
__device__ __forceinline__ void widen_e4m3x16(const uint4& codes, uint4& lo, uint4& hi) {
  lo.x = widen_e4m3x2(codes.x);
  lo.y = widen_e4m3x2_hi(codes.x);
  lo.z = widen_e4m3x2(codes.y);
  lo.w = widen_e4m3x2_hi(codes.y);
  hi.x = widen_e4m3x2(codes.z);
  hi.y = widen_e4m3x2_hi(codes.z);
  hi.z = widen_e4m3x2(codes.w);
  hi.w = widen_e4m3x2_hi(codes.w);
}

// x rounded to the nearest e4m3fn code, ties to even, magnitudes beyond 448 saturated to 448 (as
// cvt.rn.satfinite.e4m3x2.f32 rounds); NaN and infinities give the NaN code, so that a non-finite value appended
// to a cache reads back as NaN, never as a finite number.
__device__ __forceinline__ unsigned char e4m3_of(float x) {
  const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fabsf(x);
  if (!(a <= 3.402823466e38f)) return static_cast<unsigned char>(sign | 0x7Fu);
  if (a >= 448.0f) return static_cast<unsigned char>(sign | 0x7Eu);
  int exponent;
  frexpf(a, &exponent);                                    // a = m 2^exponent, m in [0.5, 1)
  int binade = max(exponent - 1, -6);                      // subnormals share the smallest normal binade's spacing
  int q = __float2int_rn(ldexpf(a, 3 - binade));           // the spacing there is 2^(binade - 3); exact scaling
  if (q < 8) return static_cast<unsigned char>(sign | q);  // a subnormal code (or zero)
  if (q == 16) {                                           // rounded up into the next binade
    q = 8;
    ++binade;
  }
  return static_cast<unsigned char>(sign | ((binade + 7) << 3) | (q - 8));
}
