// common.cuh — element types, constants and small helpers shared by every kernel.
//
// No system headers: NVRTC compiles this with nothing on its include path, and the
// Python loader inlines our own headers so CuPy's cache key sees every byte.
// 16-bit element types are plain bit patterns; conversions go through PTX `cvt`.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

__device__ constexpr float LOG2E = 1.4426950408889634f;  // log2(e): exp(x) == exp2(x * LOG2E)
__device__ constexpr float LN2 = 0.6931471805599453f;    // ln(2):  log(x) == log2(x) * LN2
// The same constants in an accumulator type A (float, or double for float64 inputs).
template <typename A>
__device__ __forceinline__ constexpr A log2e() {
  return A(1.4426950408889634);
}
template <typename A>
__device__ __forceinline__ constexpr A ln2() {
  return A(0.6931471805599453);
}
constexpr int WARP_SIZE = 32;
// Padding per shared-memory row of a padded tile: one 16-byte chunk keeps ldmatrix free of bank conflicts;
// float64 tiles, read with 8-byte loads (mma.cuh, Mma64), need 32 bytes.
template <typename T>
__host__ __device__ constexpr int smem_pad_bytes() {
  return sizeof(T) == 8 ? 32 : 16;
}

__host__ __device__ constexpr int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}
// Rounded towards -inf, for any sign of a (b > 0).
__host__ __device__ constexpr int floor_div(int a, int b) {
  return a >= 0 ? a / b : -((b - 1 - a) / b);
}

__device__ __forceinline__ float neg_inf() {
  return __int_as_float(0xff800000);
}
__device__ __forceinline__ float pos_inf() {
  return __int_as_float(0x7f800000);
}

// exp2 on the special-function unit; the online softmax only ever feeds it x <= 0 or -inf.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// float64 accumulators (float64 inputs): libdevice's exp2, within an ulp or two; float64 accuracy is
// the point of float64.
__device__ __forceinline__ double fast_exp2(double x) {
  return exp2(x);
}

// exp2 on the FMA units, for kernels whose special-function unit is the bottleneck (FlashAttention-4 moves
// part of its exponentials there the same way): 2^x = 2^j * 2^f with j = rint(x) and f = x - j in
// [-1/2, 1/2], 2^f a degree-3 polynomial (minimax in relative error: 7.5e-5 = 2^-13.7, a sixth of float16's
// rounding and far below bfloat16's), 2^j built in the exponent field. Nine instructions against ex2's one,
// none of them on the special-function unit. x + 1.5 * 2^23 rounds x to an integer held in the low mantissa
// bits. Inputs are in [-127, 127] or NaN (NaN stays NaN: the product carries it); -127 gives 0 (2^j's exponent
// field is then 0), as ex2.approx.ftz flushes such results. Its one caller, the bounded softcap's softmax,
// has exponents in [-124, 0] from finite scores (the bounded score form) and hides keys after the exponentials, so
// no -inf reaches it (a clamp at -127 cost an instruction per exponential).
__device__ __forceinline__ float poly_exp2(float x) {
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23
  const float t = __fadd_rn(x, ROUND);
  const float f = __fsub_rn(x, __fsub_rn(t, ROUND));
  const float p = fmaf(fmaf(fmaf(0.0551716685f, f, 0.242611140f), f, 0.693260968f), f, 0.999928057f);
  // t's bits are those of ROUND plus j, and ROUND's bits shifted by 23 leave 0 in 32 bits: (j + 127) << 23.
  return p * __int_as_float((__float_as_int(t) + 127) << 23);
}

// The few float operations the kernels spell out, for both accumulator types.
__device__ __forceinline__ float max_of(float a, float b) {
  return fmaxf(a, b);
}
__device__ __forceinline__ double max_of(double a, double b) {
  return fmax(a, b);
}
__device__ __forceinline__ float log2_of(float x) {
  return __log2f(x);
}
__device__ __forceinline__ double log2_of(double x) {
  return log2(x);
}
// The accurate exponential and logarithm, where a kernel takes a few per row (lse_merge.cuh), never per key.
__device__ __forceinline__ float exp_acc(float x) {
  return expf(x);
}
__device__ __forceinline__ double exp_acc(double x) {
  return exp(x);
}
__device__ __forceinline__ float log_acc(float x) {
  return logf(x);
}
__device__ __forceinline__ double log_acc(double x) {
  return log(x);
}
__device__ __forceinline__ float abs_of(float x) {
  return fabsf(x);
}
__device__ __forceinline__ float fma_of(float a, float b, float c) {
  return fmaf(a, b, c);
}
__device__ __forceinline__ double fma_of(double a, double b, double c) {
  return fma(a, b, c);
}
__device__ __forceinline__ double abs_of(double x) {
  return fabs(x);
}
__device__ __forceinline__ float mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}  // never fused into an FMA
__device__ __forceinline__ double mul_rn(double a, double b) {
  return __dmul_rn(a, b);
}

struct half_t {
  u16 bits;
};
struct bfloat16_t {
  u16 bits;
};
struct e4m3_t {
  unsigned char bits;
};  // float8 e4m3fn (the FP8 forward's q, k, v): its byte, as stored
template <typename T>
struct IsBfloat16 {
  static constexpr bool value = false;
};
template <>
struct IsBfloat16<bfloat16_t> {
  static constexpr bool value = true;
};

// Per-element-type conversions. `to_acc` widens an element to the accumulator type (float; double for
// double). `pack2` rounds two floats into the register layout that mma.sync expects for a pair of
// consecutive 16-bit elements (low half = first element).
template <typename T>
struct Elem;

template <>
struct Elem<half_t> {
  __device__ __forceinline__ static u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  __device__ __forceinline__ static float to_acc(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
  }
  __device__ __forceinline__ static void store2(half_t* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = pack2(a, b);
  }
};

template <>
struct Elem<bfloat16_t> {
  __device__ __forceinline__ static u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  __device__ __forceinline__ static float to_acc(bfloat16_t x) {
    return __int_as_float(static_cast<int>(x.bits) << 16);
  }
  __device__ __forceinline__ static void store2(bfloat16_t* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = pack2(a, b);
  }
};

template <>
struct Elem<float> {
  __device__ __forceinline__ static float to_acc(float x) { return x; }
  __device__ __forceinline__ static void store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  }
};

template <>
struct Elem<double> {
  __device__ __forceinline__ static double to_acc(double x) { return x; }
  __device__ __forceinline__ static void store2(double* p, double a, double b) {
    *reinterpret_cast<double2*>(p) = make_double2(a, b);
  }
};

// Reductions over the 4 threads of an mma "quad": they hold the same accumulator rows.
template <typename A>
__device__ __forceinline__ A quad_max(A x) {
  x = max_of(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max_of(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
template <typename A>
__device__ __forceinline__ A quad_sum(A x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
template <typename A>
__device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
