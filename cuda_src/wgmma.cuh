// wgmma.cuh — Hopper's warpgroup matrix products (wgmma, sm_90a) for 16-bit inputs (and float8 e4m3 ones,
// for the FP8 forward), in the same accumulator layout as mma.cuh's mma.sync tiles.
//
// A warpgroup is 4 consecutive warps (128 threads, the first warp index divisible by 4); one wgmma
// computes D[64 x N] += A[64 x 16] * B[16 x N] for the whole group, with A from shared memory or from
// registers and B from shared memory, asynchronously. Warp w of the group holds rows 16w .. 16w + 15 of D
// as N / 8 accumulator tiles in exactly the m16n8 layout of mma.sync (row g, cols 2t, 2t+1 and row g + 8),
// and a register A operand has the m16n8k16 A layout: so the online softmax, the masks and the
// accumulator-to-operand reuse of mma.cuh work unchanged on wgmma results.
//
// Shared operands are described by 64-bit descriptors over SwizzledTile layouts (copy.cuh):
//  - K-major (the contracted dim is contiguous: Q, K in S = Q K^T): 16 elements of a row per step; the
//    8-row groups are SBO = 8 * ATOM_BYTES apart;
//  - MN-major (B stored [k][n], e.g. V in O += P V), read transposed (imm-trans-b = 1): one instruction
//    covers one atom of ATOM_COLS columns; 8-row (k) groups SBO apart, atoms LBO apart.
// Ordering: wgmma.fence before the first product that reads registers written since (accumulators,
// register A); commit_group and wait_group 0 before the results are read; fence_operands keeps the
// compiler from moving accumulator accesses across those points.
#pragma once
#include "common.cuh"
#include "copy.cuh"
#include "pieces.cuh"

typedef unsigned long long u64;

// Descriptor of a swizzled shared-memory matrix starting at byte address `addr` (unswizzled).
template <class Tile>
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
  constexpr u64 MODE = Tile::ATOM_BYTES == 128 ? 1 : Tile::ATOM_BYTES == 64 ? 2 : 3;  // 128B, 64B, 32B swizzle
  return static_cast<u64>((addr & 0x3ffffu) >> 4) | static_cast<u64>((lbo_bytes >> 4) & 0x3fffu) << 16 |
         static_cast<u64>((sbo_bytes >> 4) & 0x3fffu) << 32 | MODE << 62;
}
// K-major operand at rows [row0, ...) of `tile` (row0 a multiple of 8): the descriptor of its first
// k-step; k-step k0 adds k_major_step(k0). MN-major operand (B stored [k][n]) at column atom n0
// (a multiple of ATOM_COLS): the descriptor of rows [0, 16); rows [k0, k0 + 16) of the column atom n0
// further on (n0 a multiple of ATOM_COLS) add mn_major_step(k0, n0).
// The steps are compile-time constants once loops unroll, and the bases are warp-uniform, so the products
// of one commit group issue back to back (ptxas serializes wgmma whose descriptor registers are
// computed in between by ordinary instructions).
template <class Tile, typename T>
__device__ __forceinline__ u64 desc_k_major(const T* tile, int row0) {
  return smem_desc<Tile>(smem_u32(tile + row0 * Tile::ATOM_COLS), 16, 8 * Tile::ATOM_BYTES);
}
template <class Tile>
__host__ __device__ constexpr u64 k_major_step(int k0) {
  return static_cast<u64>((k0 / Tile::ATOM_COLS) * Tile::ATOM_SIZE + k0 % Tile::ATOM_COLS) * Tile::VEC_BYTES /
             Tile::VEC >>
         4;
}
template <class Tile, typename T>
__device__ __forceinline__ u64 desc_mn_major(const T* tile, int n0) {
  return smem_desc<Tile>(smem_u32(tile + (n0 / Tile::ATOM_COLS) * Tile::ATOM_SIZE), Tile::ATOM_SIZE * sizeof(T),
                         8 * Tile::ATOM_BYTES);
}
template <class Tile>
__host__ __device__ constexpr u64 mn_major_step(int k0, int n0 = 0) {
  return (static_cast<u64>(k0 * Tile::ATOM_COLS) * Tile::VEC_BYTES / Tile::VEC >> 4) +
         (static_cast<u64>(n0 / Tile::ATOM_COLS * Tile::ATOM_SIZE) * Tile::VEC_BYTES / Tile::VEC >> 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N_TILES>
__device__ __forceinline__ void fence_operands(float (&acc)[N_TILES][4]) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[j][e])::"memory");
}

// ---------------------------------------------------------------- the instructions
// Operand strings: the N / 2 accumulator registers %0 .., then the sources and the scale-d flag.
#define CF_WGMMA_D8 "{%0, %1, %2, %3}"
#define CF_WGMMA_SS_SRC8 "%4, %5"
#define CF_WGMMA_SS_PRED8 "%6"
#define CF_WGMMA_RS_SRC8 "{%4, %5, %6, %7}, %8"
#define CF_WGMMA_RS_PRED8 "%9"
#define CF_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define CF_WGMMA_SS_SRC16 "%8, %9"
#define CF_WGMMA_SS_PRED16 "%10"
#define CF_WGMMA_RS_SRC16 "{%8, %9, %10, %11}, %12"
#define CF_WGMMA_RS_PRED16 "%13"
#define CF_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CF_WGMMA_SS_SRC32 "%16, %17"
#define CF_WGMMA_SS_PRED32 "%18"
#define CF_WGMMA_RS_SRC32 "{%16, %17, %18, %19}, %20"
#define CF_WGMMA_RS_PRED32 "%21"
#define CF_WGMMA_D64                                                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define CF_WGMMA_SS_SRC64 "%32, %33"
#define CF_WGMMA_SS_PRED64 "%34"
#define CF_WGMMA_RS_SRC64 "{%32, %33, %34, %35}, %36"
#define CF_WGMMA_RS_PRED64 "%37"
#define CF_WGMMA_D128                                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define CF_WGMMA_SS_SRC128 "%64, %65"
#define CF_WGMMA_SS_PRED128 "%66"
#define CF_WGMMA_RS_SRC128 "{%64, %65, %66, %67}, %68"
#define CF_WGMMA_RS_PRED128 "%69"
// Accumulator operands: the N / 8 n-tiles of d, read and written (CF_ACC) or written only (CF_OUT).
#define CF_ACC1(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define CF_ACC2(j) CF_ACC1(j), CF_ACC1((j) + 1)
#define CF_ACC4(j) CF_ACC2(j), CF_ACC2((j) + 2)
#define CF_ACC8(j) CF_ACC4(j), CF_ACC4((j) + 4)
#define CF_ACC16(j) CF_ACC8(j), CF_ACC8((j) + 8)
#define CF_ACC_N8 CF_ACC1(0)
#define CF_ACC_N16 CF_ACC2(0)
#define CF_ACC_N32 CF_ACC4(0)
#define CF_ACC_N64 CF_ACC8(0)
#define CF_ACC_N128 CF_ACC16(0)
#define CF_OUT1(j) "=f"(d[j][0]), "=f"(d[j][1]), "=f"(d[j][2]), "=f"(d[j][3])
#define CF_OUT2(j) CF_OUT1(j), CF_OUT1((j) + 1)
#define CF_OUT4(j) CF_OUT2(j), CF_OUT2((j) + 2)
#define CF_OUT8(j) CF_OUT4(j), CF_OUT4((j) + 4)
#define CF_OUT16(j) CF_OUT8(j), CF_OUT8((j) + 8)
#define CF_OUT_N8 CF_OUT1(0)
#define CF_OUT_N16 CF_OUT2(0)
#define CF_OUT_N32 CF_OUT4(0)
#define CF_OUT_N64 CF_OUT8(0)
#define CF_OUT_N128 CF_OUT16(0)
// D += A B with scale-d = 1 (accumulate); SS: A and B K-major in shared memory; SS_ZERO: the same with
// scale-d = 0 and output-only D, D = A B (a product's first k-step: no zeroed registers to feed in); RS:
// A in registers, B MN-major in shared memory (imm-trans-b = 1); RS_ZERO: likewise with scale-d = 0.
#define CF_WGMMA_BODY(SHAPE, SRC, PRED, TAIL) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\nwgmma.mma_async.sync.aligned." SHAPE " " SRC ", " TAIL ";\n}\n"

template <typename T, int N>
struct WgmmaOp;
// K: the instruction's contracted extent (16 for 16-bit inputs, 32 for 8-bit ones); SS_TAIL and RS_TAIL: the
// operands after the sources (scale-d, then imm-scale-a, imm-scale-b, and for 16-bit inputs the
// imm-trans flags, which 8-bit products do not have: their shared operands are K-major only).
#define CF_DEFINE_WGMMA(TYPE, PTX_TYPE, K, N, SS_TAIL, RS_TAIL)                                                  \
  template <>                                                                                                    \
  struct WgmmaOp<TYPE, N> {                                                                                      \
    __device__ __forceinline__ static void ss(float (&d)[N / 8][4], u64 a, u64 b) {                              \
      asm volatile(CF_WGMMA_BODY("m64n" #N "k" #K ".f32." PTX_TYPE "." PTX_TYPE,                                 \
                                 CF_WGMMA_D##N ", " CF_WGMMA_SS_SRC##N, CF_WGMMA_SS_PRED##N, SS_TAIL)            \
                   : CF_ACC_N##N                                                                                 \
                   : "l"(a), "l"(b), "r"(1)                                                                      \
                   : "memory");                                                                                  \
    }                                                                                                            \
    __device__ __forceinline__ static void ss_zero(float (&d)[N / 8][4], u64 a, u64 b) {                         \
      asm volatile(CF_WGMMA_BODY("m64n" #N "k" #K ".f32." PTX_TYPE "." PTX_TYPE,                                 \
                                 CF_WGMMA_D##N ", " CF_WGMMA_SS_SRC##N, CF_WGMMA_SS_PRED##N, SS_TAIL)            \
                   : CF_OUT_N##N                                                                                 \
                   : "l"(a), "l"(b), "r"(0)                                                                      \
                   : "memory");                                                                                  \
    }                                                                                                            \
    __device__ __forceinline__ static void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b, int scale_d = 1) { \
      asm volatile(CF_WGMMA_BODY("m64n" #N "k" #K ".f32." PTX_TYPE "." PTX_TYPE,                                 \
                                 CF_WGMMA_D##N ", " CF_WGMMA_RS_SRC##N, CF_WGMMA_RS_PRED##N, RS_TAIL)            \
                   : CF_ACC_N##N                                                                                 \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)                            \
                   : "memory");                                                                                  \
    }                                                                                                            \
    __device__ __forceinline__ static void rs_zero(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) {             \
      asm volatile(CF_WGMMA_BODY("m64n" #N "k" #K ".f32." PTX_TYPE "." PTX_TYPE,                                 \
                                 CF_WGMMA_D##N ", " CF_WGMMA_RS_SRC##N, CF_WGMMA_RS_PRED##N, RS_TAIL)            \
                   : CF_OUT_N##N                                                                                 \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(0)                                  \
                   : "memory");                                                                                  \
    }                                                                                                            \
  };
// 16-bit: B MN-major for RS (imm-trans-b = 1: V in O += P V).
#define CF_DEFINE_WGMMA16(TYPE, PTX_TYPE, N) CF_DEFINE_WGMMA(TYPE, PTX_TYPE, 16, N, "p, 1, 1, 0, 0", "p, 1, 1, 1")
CF_DEFINE_WGMMA16(half_t, "f16", 8)
CF_DEFINE_WGMMA16(half_t, "f16", 16)
CF_DEFINE_WGMMA16(half_t, "f16", 32)
CF_DEFINE_WGMMA16(half_t, "f16", 64)
CF_DEFINE_WGMMA16(half_t, "f16", 128)
CF_DEFINE_WGMMA16(bfloat16_t, "bf16", 8)
CF_DEFINE_WGMMA16(bfloat16_t, "bf16", 16)
CF_DEFINE_WGMMA16(bfloat16_t, "bf16", 32)
CF_DEFINE_WGMMA16(bfloat16_t, "bf16", 64)
CF_DEFINE_WGMMA16(bfloat16_t, "bf16", 128)
// 16-bit, both shared operands MN-major (imm-trans-a = imm-trans-b = 1): C += A B with A stored [k][m] and B
// [k][n], as the fused backward's dQ = dS K reads dS^T (keys x queries) and K (keys x head dims).
template <typename T, int N>
struct WgmmaTrans;
#define CF_DEFINE_WGMMA_TRANS(TYPE, PTX_TYPE, N)                                                                    \
  template <>                                                                                                       \
  struct WgmmaTrans<TYPE, N> {                                                                                      \
    __device__ __forceinline__ static void ss(float (&d)[N / 8][4], u64 a, u64 b) {                                 \
      asm volatile(CF_WGMMA_BODY("m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE, CF_WGMMA_D##N ", " CF_WGMMA_SS_SRC##N, \
                                 CF_WGMMA_SS_PRED##N, "p, 1, 1, 1, 1")                                              \
                   : CF_ACC_N##N                                                                                    \
                   : "l"(a), "l"(b), "r"(1)                                                                         \
                   : "memory");                                                                                     \
    }                                                                                                               \
    __device__ __forceinline__ static void ss_zero(float (&d)[N / 8][4], u64 a, u64 b) {                            \
      asm volatile(CF_WGMMA_BODY("m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE, CF_WGMMA_D##N ", " CF_WGMMA_SS_SRC##N, \
                                 CF_WGMMA_SS_PRED##N, "p, 1, 1, 1, 1")                                              \
                   : CF_OUT_N##N                                                                                    \
                   : "l"(a), "l"(b), "r"(0)                                                                         \
                   : "memory");                                                                                     \
    }                                                                                                               \
  };
CF_DEFINE_WGMMA_TRANS(half_t, "f16", 64)
CF_DEFINE_WGMMA_TRANS(half_t, "f16", 128)
CF_DEFINE_WGMMA_TRANS(bfloat16_t, "bf16", 64)
CF_DEFINE_WGMMA_TRANS(bfloat16_t, "bf16", 128)
// 16-bit, N = 72 as 64 + 8 columns into two accumulators, d (O's 64 columns) and l (8 more), B MN-major: with B's
// second atom a tile of ones, l += P 1 rides on O += P V in one instruction (wg_issue_pb_sum).
#define CF_WGMMA_D72                                                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}"
template <typename T>
struct WgmmaRowSum72;
#define CF_DEFINE_WGMMA_ROW_SUM72(TYPE, PTX_TYPE)                                                                    \
  template <>                                                                                                        \
  struct WgmmaRowSum72<TYPE> {                                                                                       \
    __device__ __forceinline__ static void rs(float (&d)[8][4], float (&l)[1][4], const u32 (&a)[4], u64 b) {        \
      asm volatile(CF_WGMMA_BODY("m64n72k16.f32." PTX_TYPE "." PTX_TYPE, CF_WGMMA_D72 ", {%36, %37, %38, %39}, %40", \
                                 "%41", "p, 1, 1, 1")                                                                \
                   : CF_ACC8(0), "+f"(l[0][0]), "+f"(l[0][1]), "+f"(l[0][2]), "+f"(l[0][3])                          \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)                                      \
                   : "memory");                                                                                      \
    }                                                                                                                \
  };
CF_DEFINE_WGMMA_ROW_SUM72(half_t, "f16")
CF_DEFINE_WGMMA_ROW_SUM72(bfloat16_t, "bf16")
// float8 e4m3 (the FP8 forward): both shared operands K-major (V as V^T).
#define CF_DEFINE_WGMMA8(TYPE, PTX_TYPE, N) CF_DEFINE_WGMMA(TYPE, PTX_TYPE, 32, N, "p, 1, 1", "p, 1, 1")
CF_DEFINE_WGMMA8(e4m3_t, "e4m3", 16)
CF_DEFINE_WGMMA8(e4m3_t, "e4m3", 32)
CF_DEFINE_WGMMA8(e4m3_t, "e4m3", 64)
CF_DEFINE_WGMMA8(e4m3_t, "e4m3", 128)

// The contracted extent of one instruction: 16 elements of 16-bit inputs, 32 of 8-bit ones (32 bytes).
template <typename T>
__host__ __device__ constexpr int wgmma_k() {
  return 32 / static_cast<int>(sizeof(T));
}

// ---------------------------------------------------------------- warpgroup products
// n-tiles [first, first + COUNT) of an accumulator, as an array of their own (first is a constant
// once loops unroll, so this stays in registers).
template <int COUNT, int N_TILES>
__device__ __forceinline__ float (&tiles_at(float (&acc)[N_TILES][4], int first))
    [COUNT][4] { return *reinterpret_cast<float (*)[COUNT][4]>(&acc[first]); }

// The widest instruction (N <= 128, a power of two) that tiles N_COLS columns evenly.
template <int N_COLS>
__host__ __device__ constexpr int wgmma_width() {
  return N_COLS % 128 == 0 ? 128 : N_COLS % 64 == 0 ? 64 : N_COLS % 32 == 0 ? 32 : 16;
}

// One k-step of C (+)= A B^T over all of C's columns: A's columns [a_col, a_col + 16), B's [b_col, +16)
// (both K-major, descriptors a and b at column 0); ZERO: this step overwrites C (scale-d = 0).
template <typename T, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void wg_abt_kstep(float (&c)[N_TILES][4], u64 a, u64 b, int a_col, int b_col, bool zero) {
  constexpr int WIDTH = wgmma_width<8 * N_TILES>();
#pragma unroll
  for (int n0 = 0; n0 < 8 * N_TILES; n0 += WIDTH) {
    const u64 a_k = a + k_major_step<ATile>(a_col);
    const u64 b_k = b + k_major_step<BTile>(b_col) + (static_cast<u64>(n0 * BTile::ATOM_BYTES) >> 4);
    if (zero)
      WgmmaOp<T, WIDTH>::ss_zero(tiles_at<WIDTH / 8>(c, n0 / 8), a_k, b_k);
    else
      WgmmaOp<T, WIDTH>::ss(tiles_at<WIDTH / 8>(c, n0 / 8), a_k, b_k);
  }
}

// Start C[64 x 8*N_TILES] = A B^T (whatever C held: the first k-step is ss_zero) for the calling
// warpgroup, as one commit group: A = rows [row0, row0 + 64) of a_tile, B = rows [0, 8*N_TILES) of b_tile,
// both K-major over K columns. Each warp gets its 16 rows of C once wgmma_wait has seen the group complete.
template <typename T, int K, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void wg_issue_abt(float (&c)[N_TILES][4], const T* a_tile, int row0, const T* b_tile) {
  constexpr int K_STEP = wgmma_k<T>();
  static_assert(K % K_STEP == 0, "whole k-steps");
  const u64 a = desc_k_major<ATile>(a_tile, __shfl_sync(0xffffffffu, row0, 0));  // row0: warp-uniform
  const u64 b = desc_k_major<BTile>(b_tile, 0);
  wgmma_fence();
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += K_STEP) wg_abt_kstep<T, N_TILES, ATile, BTile>(c, a, b, k0, k0, k0 == 0);
  wgmma_commit();
}

// The same product for float32 inputs split into float16 pieces (pieces.cuh): both tiles hold a row's
// hi piece in columns [0, K) and its lo piece in [K, 2K), and C = A_hi B_lo^T + A_lo B_hi^T + A_hi B_hi^T,
// three products issued as one commit group, the first k-step overwriting C. The small terms go first:
// the tensor cores' float32 accumulation truncates each step to the running sum's precision, so the
// chain loses least while the sum is small (after them, K / 16 steps of A_hi B_hi^T).
template <typename E, int K, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void wg_issue_abt_split(float (&c)[N_TILES][4], const E* a_tile, int row0, const E* b_tile) {
  static_assert(K % 16 == 0 && ATile::NUM_COLS == 2 * K && BTile::NUM_COLS == 2 * K, "tiles of [hi | lo] rows");
  const u64 a = desc_k_major<ATile>(a_tile, __shfl_sync(0xffffffffu, row0, 0));
  const u64 b = desc_k_major<BTile>(b_tile, 0);
  wgmma_fence();
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    wg_abt_kstep<E, N_TILES, ATile, BTile>(c, a, b, k0, K + k0, k0 == 0);  // A_hi B_lo^T
    wg_abt_kstep<E, N_TILES, ATile, BTile>(c, a, b, K + k0, k0, false);    // A_lo B_hi^T
  }
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) wg_abt_kstep<E, N_TILES, ATile, BTile>(c, a, b, k0, k0, false);  // A_hi B_hi^T
  wgmma_commit();
}

// The register A operand of P (accumulator tiles 16 rows x 8*P_TILES, rounded to T): one m16n8k16 A
// fragment per 16 columns.
template <typename T, int P_TILES>
__device__ __forceinline__ void pack_fragments(const float (&p)[P_TILES][4], u32 (&a)[P_TILES / 2][4]) {
#pragma unroll
  for (int kt = 0; kt < P_TILES / 2; ++kt) {
    const typename Mma16<T>::A frag = Mma16<T>::a_from_acc(&p[2 * kt]);
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kt][i] = frag.x[i];
  }
}

// The register A operand of P for 8-bit products (accumulator tiles 16 rows x 8*P_TILES, rounded to e4m3 with
// saturation): one fragment per 32 keys. An 8-bit fragment holds four consecutive k of a row per register
// (k = 4t .. 4t+3 of row g, then of row g+8, then k = 16 + 4t .. of each), where the accumulator holds keys
// 2t, 2t+1 of each n-tile: register 0 takes keys {2t, 2t+1, 8+2t, 9+2t} of row g, and so on. The products'
// k order is then not the keys' order, and the B operand must list its keys in that same order (the FP8
// forward's V^T is laid out so by the host: cupyflash/_cuda/fp8.py, KEY_ORDER).
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // a -> the high byte
  return r;
}
template <int P_TILES>
__device__ __forceinline__ void pack_e4m3_fragments(const float (&p)[P_TILES][4], u32 (&a)[P_TILES / 4][4]) {
  static_assert(P_TILES % 4 == 0, "k-steps of 32 keys");
#pragma unroll
  for (int kt = 0; kt < P_TILES / 4; ++kt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float (&lo)[4] = p[4 * kt + 2 * h], (&hi)[4] = p[4 * kt + 2 * h + 1];
        a[kt][2 * h + r] = e4m3x2(lo[2 * r], lo[2 * r + 1]) | e4m3x2(hi[2 * r], hi[2 * r + 1]) << 16;
      }
}

// Accumulator tiles P (16 rows x 8*P_TILES) times a factor per row (rows g: factor[0], g + 8: factor[1])
// as float16 pieces hi + lo in the register A layout (pieces.cuh): hi = float16(x), lo = float16(x - hi).
template <int P_TILES>
__device__ __forceinline__ void split_fragments(const float (&p)[P_TILES][4], const float (&factor)[2],
                                                u32 (&hi)[P_TILES / 2][4], u32 (&lo)[P_TILES / 2][4]) {
#pragma unroll
  for (int kt = 0; kt < P_TILES / 2; ++kt) {
    float x[2][4], r[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][e] = p[2 * kt + j][e] * factor[e >> 1];
    const typename Mma16<half_t>::A h = Mma16<half_t>::a_from_acc(x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // h.x[i] packs two of x; r gets what rounding them left out
      const int j = i >> 1, e = (i & 1) * 2;
      r[j][e] = x[j][e] - Elem<half_t>::to_acc(half_t{static_cast<u16>(h.x[i] & 0xffffu)});
      r[j][e + 1] = x[j][e + 1] - Elem<half_t>::to_acc(half_t{static_cast<u16>(h.x[i] >> 16)});
    }
    const typename Mma16<half_t>::A l = Mma16<half_t>::a_from_acc(r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      hi[kt][i] = h.x[i];
      lo[kt][i] = l.x[i];
    }
  }
}

// wgmma reads register operands while it runs: keep the compiler from reusing them before the wait.
template <int K_STEPS>
__device__ __forceinline__ void fence_fragments(u32 (&a)[K_STEPS][4]) {
#pragma unroll
  for (int kt = 0; kt < K_STEPS; ++kt)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kt][i])::"memory");
}

// The instructions of C += P B, every k-step and column atom (an MN-major instruction spans one atom), B
// from the descriptor b of its first rows and columns. WIDE: one instruction spans every column, its atoms
// LBO apart (desc_mn_major), so P's fragments are read once per k-step.
template <typename T, int K_STEPS, int N_TILES, class BTile, bool WIDE = false>
__device__ __forceinline__ void wg_pb_steps(float (&c)[N_TILES][4], u32 (&a)[K_STEPS][4], u64 b,
                                            bool accumulate = true) {
  constexpr int WIDTH = WIDE ? wgmma_width<8 * N_TILES>() : BTile::ATOM_COLS;
#pragma unroll
  for (int kt = 0; kt < K_STEPS; ++kt) {
#pragma unroll
    for (int n0 = 0; n0 < 8 * N_TILES; n0 += WIDTH) {
      WgmmaOp<T, WIDTH>::rs(tiles_at<WIDTH / 8>(c, n0 / 8), a[kt], b + mn_major_step<BTile>(16 * kt, n0),
                            kt > 0 || accumulate);
    }
  }
}

// Start C[64 x 8*N_TILES] = P B^T for 8-bit inputs, as one commit group: P as packed fragments
// (pack_e4m3_fragments), B K-major: rows [n_begin, n_begin + 8*N_TILES) of b_tile are C's columns (V^T's head
// dims), its columns the keys, in the fragments' k order. C is overwritten (its first k-step has scale-d = 0), never
// added to: 8-bit products keep about 13 significant bits of the accumulator they add to, so a caller sums
// such products in float32 itself. The fragments must stay untouched until wgmma_wait has seen the group
// complete.
template <typename T, int K_STEPS, int N_TILES, class BTile>
__device__ __forceinline__ void wg_issue_pbt(float (&c)[N_TILES][4], u32 (&a)[K_STEPS][4], const T* b_tile,
                                             int n_begin) {
  constexpr int WIDTH = wgmma_width<8 * N_TILES>(), K_STEP = wgmma_k<T>();
  const u64 b = desc_k_major<BTile>(b_tile, n_begin);
  wgmma_fence();
  fence_fragments(a);
#pragma unroll
  for (int kt = 0; kt < K_STEPS; ++kt)
#pragma unroll
    for (int n0 = 0; n0 < 8 * N_TILES; n0 += WIDTH) {
      const u64 b_step = b + k_major_step<BTile>(K_STEP * kt) + (static_cast<u64>(n0 * BTile::ATOM_BYTES) >> 4);
      if (kt == 0)
        WgmmaOp<T, WIDTH>::rs_zero(tiles_at<WIDTH / 8>(c, n0 / 8), a[kt], b_step);
      else
        WgmmaOp<T, WIDTH>::rs(tiles_at<WIDTH / 8>(c, n0 / 8), a[kt], b_step);
    }
  wgmma_commit();
}

// Start C[64 x 8*N_TILES] += P B for the calling warpgroup, as one commit group: P as packed fragments
// (pack_fragments), B stored [k][n] in b_tile, columns [n_begin, n_begin + 8*N_TILES). The fragments must
// stay untouched until wgmma_wait has seen the group complete. accumulate = false: C = P B, whatever C
// held (a sum's first term, with no zeroed registers to feed in).
template <typename T, int K_STEPS, int N_TILES, class BTile, bool WIDE = false>
__device__ __forceinline__ void wg_issue_pb(float (&c)[N_TILES][4], u32 (&a)[K_STEPS][4], const T* b_tile, int n_begin,
                                            bool accumulate = true) {
  static_assert((8 * N_TILES) % BTile::ATOM_COLS == 0, "whole atoms");
  const u64 b = desc_mn_major<BTile>(b_tile, n_begin);
  wgmma_fence();
  fence_operands(c);
  fence_fragments(a);
  wg_pb_steps<T, K_STEPS, N_TILES, BTile, WIDE>(c, a, b, accumulate);
  wgmma_commit();
}

// P's row sums from the tensor cores. l's 8 columns each hold their row's sum of the 16-bit P the products take, so
// that O / l is the mean of v weighted exactly as O weighs it: dividing by the float32 sum of the unrounded P
// instead leaves every row of out off by one factor, 1 + sum_j (P~_ij - P_ij) / l_i, which the backward's D =
// rowsum(dout * out) takes whole where v has a mean (docs/design/forward.md, Row sums). The products read
// row_sum_ones_bytes of 16-bit ones in shared memory.
template <int HEAD_DIM, int BLOCK_N>
__host__ __device__ constexpr int row_sum_ones_bytes() {
  // 16-bit HEAD_DIM 64, V's tile one 128-byte atom: l's columns are B's second atom, ones in every row a run of
  // k-steps reads (BLOCK_N rows of 128 bytes); otherwise products of their own, whose 16 x 8 ones (no swizzle, core
  // matrices 128 bytes apart) lie in 512 bytes. The host's tiles.ws_row_sum_ones_bytes mirrors this.
  return HEAD_DIM == 64 ? BLOCK_N * 128 : 512;
}

// As wg_issue_pb with accumulate, and in the same commit group l += P 1 (l's columns: every one its row's sum).
// ONES_ATOM (B one atom, the ones row_sum_ones_bytes of a whole atom after b_tile in shared memory, LBO from it):
// each k-step one N = 72 product whose second atom is the ones, so the sums take no instruction of their own;
// otherwise an N = 8 product per k-step, from 512 bytes of ones.
template <typename T, int K_STEPS, int N_TILES, class BTile, bool WIDE = false, bool ONES_ATOM = false>
__device__ __forceinline__ void wg_issue_pb_sum(float (&c)[N_TILES][4], float (&l)[1][4], u32 (&a)[K_STEPS][4],
                                                const T* b_tile, const void* ones) {
  static_assert((8 * N_TILES) % BTile::ATOM_COLS == 0, "whole atoms");
  wgmma_fence();
  fence_operands(c);
  fence_operands(l);
  fence_fragments(a);
  if constexpr (ONES_ATOM) {
    static_assert(8 * N_TILES == BTile::ATOM_COLS && N_TILES == 8 && BTile::ATOM_BYTES == 128,
                  "one 128-byte atom of 64 columns");
    const u64 b = smem_desc<BTile>(smem_u32(b_tile), smem_u32(ones) - smem_u32(b_tile), 8 * BTile::ATOM_BYTES);
#pragma unroll
    for (int kt = 0; kt < K_STEPS; ++kt) WgmmaRowSum72<T>::rs(c, l, a[kt], b + mn_major_step<BTile>(16 * kt));
  } else {
    wg_pb_steps<T, K_STEPS, N_TILES, BTile, WIDE>(c, a, desc_mn_major<BTile>(b_tile, 0), true);
    // no swizzle (mode 0), leading and stride byte offsets 128: all ones, wherever a core matrix is read
    const u64 b = static_cast<u64>((smem_u32(ones) & 0x3ffffu) >> 4) | static_cast<u64>(128 >> 4) << 16 |
                  static_cast<u64>(128 >> 4) << 32;
#pragma unroll
    for (int kt = 0; kt < K_STEPS; ++kt) WgmmaOp<T, 8>::rs(l, a[kt], b);
  }
  wgmma_commit();
}

// C = P B (overwritten) for split float32 inputs as one commit group: P as hi and lo fragments
// (split_fragments), B's tile with the hi piece of column n in column n and its lo piece in n + lo_col,
// columns [n_begin, n_begin + 8*N_TILES): P_hi B_lo + P_lo B_hi + P_hi B_hi, small terms first (see
// wg_issue_abt_split). The caller adds C to
// its running sum in registers: chained across key blocks in the tensor cores, the truncation of every
// step would add up over the whole sequence. The fragments must stay untouched until wgmma_wait has
// seen the group complete.
template <typename E, int K_STEPS, int N_TILES, class BTile>
__device__ __forceinline__ void wg_issue_pb_split(float (&c)[N_TILES][4], u32 (&a_hi)[K_STEPS][4],
                                                  u32 (&a_lo)[K_STEPS][4], const E* b_tile, int n_begin, int lo_col) {
  constexpr int WIDTH = BTile::ATOM_COLS;
  static_assert((8 * N_TILES) % WIDTH == 0, "whole atoms");
  const u64 b_hi = desc_mn_major<BTile>(b_tile, n_begin), b_lo = desc_mn_major<BTile>(b_tile, n_begin + lo_col);
  wgmma_fence();
  fence_fragments(a_hi);
  fence_fragments(a_lo);
#pragma unroll
  for (int kt = 0; kt < K_STEPS; ++kt) {
#pragma unroll
    for (int n0 = 0; n0 < 8 * N_TILES; n0 += WIDTH) {
      const u64 step = mn_major_step<BTile>(16 * kt, n0);
      float (&d)[WIDTH / 8][4] = tiles_at<WIDTH / 8>(c, n0 / 8);
      if (kt == 0)
        WgmmaOp<E, WIDTH>::rs_zero(d, a_hi[kt], b_lo + step);
      else
        WgmmaOp<E, WIDTH>::rs(d, a_hi[kt], b_lo + step);
      WgmmaOp<E, WIDTH>::rs(d, a_lo[kt], b_hi + step);
    }
  }
  wg_pb_steps<E, K_STEPS, N_TILES, BTile>(c, a_hi, b_hi);
  wgmma_commit();
}

// Start C[64 x 8*N_TILES] = A B (overwritten) for the calling warpgroup, as one commit group, both operands
// MN-major in shared memory: A stored [k][m], its m columns [m0, m0 + 64) of a_tile (one swizzle atom), B
// stored [k][n], its columns [n0, n0 + 8*N_TILES), over K_STEPS k-steps of 16 rows of both.
template <typename T, int K_STEPS, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void wg_issue_atb(float (&c)[N_TILES][4], const T* a_tile, int m0, const T* b_tile, int n0) {
  static_assert(ATile::ATOM_COLS == 64 && (8 * N_TILES) % BTile::ATOM_COLS == 0,
                "A: one atom of 64 rows; B: whole atoms");
  constexpr int WIDTH = wgmma_width<8 * N_TILES>();
  const u64 a = desc_mn_major<ATile>(a_tile, m0), b = desc_mn_major<BTile>(b_tile, n0);
  wgmma_fence();
#pragma unroll
  for (int kt = 0; kt < K_STEPS; ++kt) {
#pragma unroll
    for (int n = 0; n < 8 * N_TILES; n += WIDTH) {
      const u64 a_k = a + mn_major_step<ATile>(16 * kt), b_k = b + mn_major_step<BTile>(16 * kt, n);
      if (kt == 0)
        WgmmaTrans<T, WIDTH>::ss_zero(tiles_at<WIDTH / 8>(c, n / 8), a_k, b_k);
      else
        WgmmaTrans<T, WIDTH>::ss(tiles_at<WIDTH / 8>(c, n / 8), a_k, b_k);
    }
  }
  wgmma_commit();
}

// Wait until at most PENDING of this warpgroup's commit groups are still running.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// The synchronous forms: issue, wait for everything, results in c.
template <typename T, int K, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void wg_gemm_abt(float (&c)[N_TILES][4], const T* a_tile, int row0, const T* b_tile) {
  wg_issue_abt<T, K, N_TILES, ATile, BTile>(c, a_tile, row0, b_tile);
  wgmma_wait<0>();
  fence_operands(c);
}

template <typename T, int P_TILES, int N_TILES, class BTile>
__device__ __forceinline__ void wg_gemm_pb(float (&c)[N_TILES][4], const float (&p)[P_TILES][4], const T* b_tile,
                                           int n_begin) {
  static_assert(P_TILES % 2 == 0, "k-steps of 16");
  u32 a[P_TILES / 2][4];
  pack_fragments<T>(p, a);
  wg_issue_pb<T, P_TILES / 2, N_TILES, BTile>(c, a, b_tile, n_begin);
  wgmma_wait<0>();
  fence_operands(c);
  fence_fragments(a);
}
