// mma.cuh — tensor-core fragments: ldmatrix loads from shared memory, accumulator-to-operand
// reuse, and mma.sync, for each element type.
//
// Every product is a warp-level C[16 x 8] += A[16 x k] * B[k x 8] (m16n8, "row.col").
// Accumulators (C) are Acc[4] per thread: (row g, cols 2t, 2t+1) and (row g+8, same cols),
// with g = lane / 4 and t = lane % 4; Acc is float, or double for float64 inputs.
//
//  - half_t / bfloat16_t: mma.m16n8k16 with fp32 accumulation. One k-step covers 16 elements.
//  - float: mma.m16n8k8.tf32 three times per step ("3xTF32": a*b ~ a_hi*b_hi + a_hi*b_lo + a_lo*b_hi),
//    which keeps float32 accuracy (no silent TF32). One k-step covers 8 elements.
//  - double: mma.m16n8k8.f64 on sm_90 and up, four mma.m8n8k4.f64 before (FP64 tensor cores, IEEE
//    float64 products and sums): rows 0-7 and 8-15 of the m16 tile, times two k-halves. Its C layout (row g, cols 2t,
//    2t+1) is the first half of m16n8's, so the accumulators keep the layout above. One k-step covers 8 elements (64
//    bytes of a row), read with 8-byte shared-memory loads: ldmatrix moves 16-bit pieces.
//
// Either way a k-step is 32 bytes of a shared-memory row, so the same ldmatrix addressing
// serves all types: for 32-bit data an 8x8 "b16" matrix is an 8x4 float matrix and each thread
// receives element (g, t), which is exactly the tf32 A/B fragment layout.
//
// Shared-memory tiles are row-major with rows padded by 16 bytes (see copy.cuh), so the eight
// row addresses of one 8x8 ldmatrix fall in eight different bank groups.
#pragma once
#include "common.cuh"

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Lane addresses for the two ldmatrix patterns, in elements of a tile with row stride `stride`.
// A operand, m16 x k-step at (row0, k0): matrices (rows 0-7 | 8-15) x (first | second 16 bytes).
template <typename T>
__device__ __forceinline__ const T* a_lane_ptr(const T* tile, int stride, int row0, int k0, int lane) {
  constexpr int VEC = 16 / sizeof(T);
  return tile + (row0 + (lane & 15)) * stride + k0 + (lane >> 4) * VEC;
}
// B operand stored [n][k] (e.g. K for S = Q K^T), two n-tiles of 8 at (n0, k0).
template <typename T>
__device__ __forceinline__ const T* b_lane_ptr(const T* tile, int stride, int n0, int k0, int lane) {
  constexpr int VEC = 16 / sizeof(T);
  return tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * stride + k0 + ((lane >> 3) & 1) * VEC;
}

// ---------------------------------------------------------------- 16-bit inputs (fp16, bf16)
template <typename T>
struct Mma16 {
  static constexpr int KSTEP = 16;              // k elements per mma
  static constexpr int ACC_PER_A = 2;           // accumulator n-tiles that form one A operand (P V, dS K)
  static constexpr bool ROUNDED_CHAIN = false;  // 16-bit inputs: the mma's own fp32 accumulation suffices
  static constexpr int K_UNROLL = 16;           // k-steps per group in S = Q K^T (one group: unrolled)
  using Acc = float;
  struct A {
    u32 x[4];
  };
  struct B {
    u32 x[2];
  };

  __device__ __forceinline__ static void load_a(A& a, const T* tile, int stride, int row0, int k0, int lane) {
    ldsm_x4(a.x, smem_u32(a_lane_ptr(tile, stride, row0, k0, lane)));
  }
  __device__ __forceinline__ static void load_b2(B& b0, B& b1, const T* tile, int stride, int n0, int k0, int lane) {
    u32 r[4];
    ldsm_x4(r, smem_u32(b_lane_ptr(tile, stride, n0, k0, lane)));
    b0.x[0] = r[0];
    b0.x[1] = r[1];
    b1.x[0] = r[2];
    b1.x[1] = r[3];
  }
  // B operand stored [k][n] (V in P V, dO in P^T dO, K in dS K, Q in dS^T Q): transpose on load.
  __device__ __forceinline__ static void load_b2_trans(B& b0, B& b1, const T* tile, int stride, int k0, int n0,
                                                       int lane) {
    const T* p = tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + n0 + (lane >> 4) * 8;
    u32 r[4];
    ldsm_x4_trans(r, smem_u32(p));
    b0.x[0] = r[0];
    b0.x[1] = r[1];
    b1.x[0] = r[2];
    b1.x[1] = r[3];
  }
  // Two accumulator n-tiles (16 columns) become one A operand without leaving registers:
  // the C layout of m16n8 matches the A layout of m16n8k16 pairwise.
  __device__ __forceinline__ static A a_from_acc(const float (*acc)[4]) {
    A a;
    a.x[0] = Elem<T>::pack2(acc[0][0], acc[0][1]);
    a.x[1] = Elem<T>::pack2(acc[0][2], acc[0][3]);
    a.x[2] = Elem<T>::pack2(acc[1][0], acc[1][1]);
    a.x[3] = Elem<T>::pack2(acc[1][2], acc[1][3]);
    return a;
  }
};

template <typename T>
__device__ __forceinline__ void mma16_op(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]);

// An 8x8 matrix of 16-bit elements transposed across the warp (a fragment of rows g, columns 2t, 2t+1 becomes the
// transpose's): an accumulator's pair of columns into an operand's pair of rows, without shared memory.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

template <>
__device__ __forceinline__ void mma16_op<half_t>(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, "
      "%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16_op<bfloat16_t>(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, "
      "%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---------------------------------------------------------------- float32 inputs (3xTF32)
__device__ __forceinline__ u32 to_tf32(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// Split x into a TF32 head and a TF32 tail: x ~ hi + lo with about 21 significant bits.
__device__ __forceinline__ void split_tf32(u32 bits, u32& hi, u32& lo) {
  const float x = __uint_as_float(bits);
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}

struct Mma32 {
  static constexpr int KSTEP = 8;
  static constexpr int ACC_PER_A = 1;
  static constexpr bool ROUNDED_CHAIN = true;  // see gemm_acc_b
  static constexpr int K_UNROLL = 4;           // k-steps per rounded group in S = Q K^T (see gemm_smem_abt)
  using Acc = float;
  struct A {
    u32 hi[4], lo[4];
  };
  struct B {
    u32 hi[2], lo[2];
  };

  __device__ __forceinline__ static void load_a(A& a, const float* tile, int stride, int row0, int k0, int lane) {
    u32 r[4];
    ldsm_x4(r, smem_u32(a_lane_ptr(tile, stride, row0, k0, lane)));
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(r[i], a.hi[i], a.lo[i]);
  }
  __device__ __forceinline__ static void load_b2(B& b0, B& b1, const float* tile, int stride, int n0, int k0,
                                                 int lane) {
    u32 r[4];
    ldsm_x4(r, smem_u32(b_lane_ptr(tile, stride, n0, k0, lane)));
    split_tf32(r[0], b0.hi[0], b0.lo[0]);
    split_tf32(r[1], b0.hi[1], b0.lo[1]);
    split_tf32(r[2], b1.hi[0], b1.lo[0]);
    split_tf32(r[3], b1.hi[1], b1.lo[1]);
  }
  // ldmatrix cannot transpose 32-bit elements. The k index of a register-sourced A operand is
  // permuted instead (see a_from_acc): logical k = t holds column 2t, k = t + 4 holds 2t + 1.
  // B rows are read with the same permutation, so the product is unchanged.
  __device__ __forceinline__ static void load_b2_trans(B& b0, B& b1, const float* tile, int stride, int k0, int n0,
                                                       int lane) {
    const int g = lane >> 2, t = lane & 3;
    const float* row_even = tile + (k0 + 2 * t) * stride + n0 + g;
    const float* row_odd = row_even + stride;
    split_tf32(__float_as_uint(row_even[0]), b0.hi[0], b0.lo[0]);
    split_tf32(__float_as_uint(row_odd[0]), b0.hi[1], b0.lo[1]);
    split_tf32(__float_as_uint(row_even[8]), b1.hi[0], b1.lo[0]);
    split_tf32(__float_as_uint(row_odd[8]), b1.hi[1], b1.lo[1]);
  }
  // One accumulator n-tile becomes one A operand: A(g, t) = C(g, 2t), A(g, t+4) = C(g, 2t+1).
  __device__ __forceinline__ static A a_from_acc(const float (*acc)[4]) {
    A a;
    const u32 x[4] = {__float_as_uint(acc[0][0]), __float_as_uint(acc[0][2]), __float_as_uint(acc[0][1]),
                      __float_as_uint(acc[0][3])};
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(x[i], a.hi[i], a.lo[i]);
    return a;
  }
};

__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, "
      "%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---------------------------------------------------------------- float64 inputs (DMMA)
// m8n8k4.f64 fragments (g = lane / 4, t = lane % 4): A(g, t), B(k = t, n = g), C(g, 2t + i). A k-step of
// 8 runs as two k-halves of 4, and within a step the k index is permuted (the product does not care,
// as long as A and B agree):
//  - from shared memory ([m][k] and [n][k] tiles: S = Q K^T, dP = dO V^T, ...): half h takes columns
//    4h + t, plain rows of 32 bytes;
//  - from the accumulator (P V, dS K, ...): a thread holds C columns 2t and 2t + 1; half h takes
//    column 2t + (h ^ (t >> 1)). B rows are read in the same order: 2t + (h ^ (t >> 1)), so the four
//    rows of a half-warp's load are {0, 2, 5, 7} or {1, 3, 4, 6}, which with rows padded by 32 bytes
//    land in four different 32-byte bank groups (as do the plain rows of the first kind).
struct Mma64 {
  static constexpr int KSTEP = 8;
  static constexpr int ACC_PER_A = 1;
  static constexpr bool ROUNDED_CHAIN = false;  // the DMMA sums in float64
  // k-steps per group in S = Q K^T (see gemm_smem_abt): sm_90's m16n8k8 holds all of a step's A and B at
  // once, and more than one step in flight made its ptxas spill.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr int K_UNROLL = 1;
#else
  static constexpr int K_UNROLL = 4;
#endif
  using Acc = double;
  struct A {
    double x[2][2];
  };  // [k-half][rows g, g + 8]
  struct B {
    double x[2];
  };  // [k-half]

  __device__ __forceinline__ static void load_a(A& a, const double* tile, int stride, int row0, int k0, int lane) {
    const double* p = tile + (row0 + (lane >> 2)) * stride + k0 + (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      a.x[h][0] = p[4 * h];
      a.x[h][1] = p[8 * stride + 4 * h];
    }
  }
  __device__ __forceinline__ static void load_b2(B& b0, B& b1, const double* tile, int stride, int n0, int k0,
                                                 int lane) {
    const double* p = tile + (n0 + (lane >> 2)) * stride + k0 + (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      b0.x[h] = p[4 * h];
      b1.x[h] = p[8 * stride + 4 * h];
    }
  }
  __device__ __forceinline__ static void load_b2_trans(B& b0, B& b1, const double* tile, int stride, int k0, int n0,
                                                       int lane) {
    const int t = lane & 3, swap = t >> 1;
    const double* p = tile + (k0 + 2 * t) * stride + n0 + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const double* row = p + (h ^ swap) * stride;
      b0.x[h] = row[0];
      b1.x[h] = row[8];
    }
  }
  __device__ __forceinline__ static A a_from_acc(const double (*acc)[4]) {
    const bool swap = (threadIdx.x & 2) != 0;  // t >> 1
    A a;
    a.x[0][0] = swap ? acc[0][1] : acc[0][0];
    a.x[0][1] = swap ? acc[0][3] : acc[0][2];
    a.x[1][0] = swap ? acc[0][0] : acc[0][1];
    a.x[1][1] = swap ? acc[0][2] : acc[0][3];
    return a;
  }
};

__device__ __forceinline__ void mma_f64(double& c0, double& c1, double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+d"(c0), "+d"(c1)
               : "d"(a), "d"(b));
}

template <int N_TILES, typename Acc>
__device__ __forceinline__ void zero_tiles(Acc (&acc)[N_TILES][4]) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = Acc(0);
}

// ---------------------------------------------------------------- dispatch by element type
// Mma<T>::Acc is the accumulator type; acc_t<T> names it.
template <typename T>
struct Mma : Mma16<T> {
  __device__ __forceinline__ static void mma(float (&c)[4], const typename Mma16<T>::A& a,
                                             const typename Mma16<T>::B& b) {
    mma16_op<T>(c, a.x, b.x);
  }
};

template <>
struct Mma<float> : Mma32 {
  // Small terms first, so they are not lost against the large one.
  __device__ __forceinline__ static void mma(float (&c)[4], const A& a, const B& b) {
    mma_tf32(c, a.lo, b.hi);
    mma_tf32(c, a.hi, b.lo);
    mma_tf32(c, a.hi, b.hi);
  }
};

template <>
struct Mma<double> : Mma64 {
  // Hopper's FP64 tensor cores run twice A100's rate per SM only through the m16n8 shapes it added (sm_90):
  // one m16n8k8 there, whose fragments are exactly the four m8n8k4 pieces (a0 (g, t), a1 (g + 8, t),
  // a2 (g, t + 4), a3 (g + 8, t + 4); b0 (t, g), b1 (t + 4, g)).
  __device__ __forceinline__ static void mma(double (&c)[4], const A& a, const B& b) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, "
        "%3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a.x[0][0]), "d"(a.x[0][1]), "d"(a.x[1][0]), "d"(a.x[1][1]), "d"(b.x[0]), "d"(b.x[1]));
#else
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mma_f64(c[0], c[1], a.x[h][0], b.x[h]);
      mma_f64(c[2], c[3], a.x[h][1], b.x[h]);
    }
#endif
  }
};

template <typename T>
using acc_t = typename Mma<T>::Acc;

// C[16 x 8*N_TILES] += A[16 x K] * B^T, with A rows at row0 of `a_tile` and B stored [n][k]
// (all N_TILES n-tiles from row n0 = 0 of `b_tile`). K a multiple of the type's k-step.
// For float32 (ROUNDED_CHAIN) every K_UNROLL k-steps go through a fresh register tile that is
// added to C with rounded adds, so long head dims do not build a truncating tensor-core chain.
template <typename T, int K, int N_TILES, int A_STRIDE, int B_STRIDE>
__device__ __forceinline__ void gemm_smem_abt(acc_t<T> (&c)[N_TILES][4], const T* a_tile, int row0, const T* b_tile,
                                              int lane) {
  using M = Mma<T>;
  static_assert(N_TILES % 2 == 0, "n-tiles are loaded in pairs");
  // k elements per group: all of K in one unrolled group, or K_UNROLL k-steps (rounded chains; and
  // float64, whose operands are twice the registers: a whole unrolled K would hoist too many loads)
  constexpr int GROUP = K < M::KSTEP * M::K_UNROLL ? K : M::KSTEP * M::K_UNROLL;
  static_assert(K % GROUP == 0, "k-steps group evenly");
#pragma unroll 1
  for (int kg = 0; kg < K; kg += GROUP) {
    acc_t<T> t[N_TILES][4];
    acc_t<T>(&acc)[N_TILES][4] = M::ROUNDED_CHAIN ? t : c;
    if constexpr (M::ROUNDED_CHAIN) zero_tiles(t);
#pragma unroll
    for (int k0 = kg; k0 < kg + GROUP; k0 += M::KSTEP) {
      typename M::A a;
      M::load_a(a, a_tile, A_STRIDE, row0, k0, lane);
#pragma unroll
      for (int j = 0; j < N_TILES; j += 2) {
        typename M::B b0, b1;
        M::load_b2(b0, b1, b_tile, B_STRIDE, j * 8, k0, lane);
        M::mma(acc[j], a, b0);
        M::mma(acc[j + 1], a, b1);
      }
    }
    if constexpr (M::ROUNDED_CHAIN) {
#pragma unroll
      for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) c[j][e] += t[j][e];
      }
    }
  }
}

// C[16 x 8*N_TILES] += P * B, with P the warp's accumulator tile (16 x 8*P_TILES, in registers)
// and B stored [k][n] in shared memory; columns n_begin .. n_begin + 8*N_TILES of B.
// C accumulates over every streamed tile of a row (thousands of keys). The tensor cores' fp32
// accumulation truncates, which float32 inputs would notice over such a chain: for them each
// tile's product is summed into a fresh register tile and added to C with ordinary rounded adds.
template <typename T, int P_TILES, int N_TILES, int B_STRIDE>
__device__ __forceinline__ void gemm_acc_b(acc_t<T> (&c)[N_TILES][4], const acc_t<T> (&p)[P_TILES][4], const T* b_tile,
                                           int n_begin, int lane) {
  using M = Mma<T>;
  constexpr int K_STEPS = P_TILES / M::ACC_PER_A;
  static_assert(N_TILES % 2 == 0 && P_TILES % M::ACC_PER_A == 0, "tile counts");
  if constexpr (M::ROUNDED_CHAIN) {
    // A is rebuilt per column pair (a few ALU ops) rather than held for all k: no extra registers.
#pragma unroll
    for (int j = 0; j < N_TILES; j += 2) {
      float t0[4] = {0.f, 0.f, 0.f, 0.f}, t1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kt = 0; kt < K_STEPS; ++kt) {
        const typename M::A a = M::a_from_acc(&p[kt * M::ACC_PER_A]);
        typename M::B b0, b1;
        M::load_b2_trans(b0, b1, b_tile, B_STRIDE, kt * M::KSTEP, n_begin + j * 8, lane);
        M::mma(t0, a, b0);
        M::mma(t1, a, b1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[j][e] += t0[e];
        c[j + 1][e] += t1[e];
      }
    }
  } else {
#pragma unroll
    for (int kt = 0; kt < K_STEPS; ++kt) {
      const typename M::A a = M::a_from_acc(&p[kt * M::ACC_PER_A]);
#pragma unroll
      for (int j = 0; j < N_TILES; j += 2) {
        typename M::B b0, b1;
        M::load_b2_trans(b0, b1, b_tile, B_STRIDE, kt * M::KSTEP, n_begin + j * 8, lane);
        M::mma(c[j], a, b0);
        M::mma(c[j + 1], a, b1);
      }
    }
  }
}
