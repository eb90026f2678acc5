// gemm.cuh — the two products every kernel is made of, on the tensor-core path its tiles are laid out for.
//
//  gemm_abt: C = A B^T, A = this warp's 16 rows (from row0) of a_tile, B = a tile stored [n][k]:
//            S = Q K^T, S^T = K Q^T, dP = dO V^T, dP^T = V dO^T.
//  gemm_pb:  C += P B, P = accumulator tiles in registers (P or dS, rounded to T), B stored [k][n]:
//            O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K.
// C and P are acc_t<T>: float, or double for float64 inputs (mma.cuh).
// Swizzled tiles (Hopper, 16-bit inputs) run wgmma over the warp's warpgroup (64 rows from row0 rounded
// down to a multiple of 64); padded tiles run mma.sync per warp. Either way each warp's C holds its own
// 16 rows in the m16n8 accumulator layout.
#pragma once
#include "mma.cuh"
#include "copy.cuh"
#include "wgmma.cuh"

template <typename T, int K, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void gemm_abt(acc_t<T> (&c)[N_TILES][4], const T* a_tile, int row0, const T* b_tile,
                                         int lane) {
  static_assert(ATile::SWIZZLED == BTile::SWIZZLED, "one path per product");
  if constexpr (ATile::SWIZZLED) {  // the first k-step overwrites C (scale-d = 0): no zeroed registers
    wg_gemm_abt<T, K, N_TILES, ATile, BTile>(c, a_tile, row0 & ~63, b_tile);
  } else {
    zero_acc(c);
    gemm_smem_abt<T, K, N_TILES, ATile::STRIDE, BTile::STRIDE>(c, a_tile, row0, b_tile, lane);
  }
}

template <typename T, int P_TILES, int N_TILES, class BTile>
__device__ __forceinline__ void gemm_pb(acc_t<T> (&c)[N_TILES][4], const acc_t<T> (&p)[P_TILES][4], const T* b_tile,
                                        int n_begin, int lane) {
  if constexpr (BTile::SWIZZLED) {
    wg_gemm_pb<T, P_TILES, N_TILES, BTile>(c, p, b_tile, n_begin);
  } else {
    gemm_acc_b<T, P_TILES, N_TILES, BTile::STRIDE>(c, p, b_tile, n_begin, lane);
  }
}

// The same two products for float32 inputs on Hopper, as float16 pieces (pieces.cuh): tiles of rows
// [hi | lo] (K or HEAD_DIM columns each), a register operand split tile by tile.
//  gemm_abt_pieces: C = A B^T, three float16 products.
//  gemm_pb_pieces:  C += P B * b_factor, P of any magnitude: each of a thread's two rows scaled by its own
//                   power of two, split, multiplied (three products into a fresh accumulator) and added
//                   unscaled in registers (a chain of additions in the tensor cores would truncate at every
//                   step); b_factor (a power of two: the one B's pieces carry) comes out on the way.
template <int K, int N_TILES, class ATile, class BTile>
__device__ __forceinline__ void gemm_abt_pieces(float (&c)[N_TILES][4], const half_t* a_tile, int row0,
                                                const half_t* b_tile) {
  wg_issue_abt_split<half_t, K, N_TILES, ATile, BTile>(c, a_tile, row0 & ~63, b_tile);
  wgmma_wait<0>();
  fence_operands(c);
}

template <int HEAD_DIM, int P_TILES, int N_TILES, class BTile>
__device__ __forceinline__ void gemm_pb_pieces(float (&c)[N_TILES][4], const float (&p)[P_TILES][4],
                                               const half_t* b_tile, int n_begin, float b_factor) {
  float largest[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < P_TILES; ++j) {
    largest[0] = fmaxf(largest[0], fmaxf(fabsf(p[j][0]), fabsf(p[j][1])));
    largest[1] = fmaxf(largest[1], fmaxf(fabsf(p[j][2]), fabsf(p[j][3])));
  }
  float up[2], down[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int e = split_exponent(__float_as_uint(quad_max(largest[r])));
    up[r] = pow2(e);
    down[r] = pow2(-e) * b_factor;
  }
  u32 hi[P_TILES / 2][4], lo[P_TILES / 2][4];
  split_fragments<P_TILES>(p, up, hi, lo);
  float t[N_TILES][4];
  wg_issue_pb_split<half_t, P_TILES / 2, N_TILES, BTile>(t, hi, lo, b_tile, n_begin, HEAD_DIM);
  wgmma_wait<0>();
  fence_operands(t);
  fence_fragments(hi);
  fence_fragments(lo);
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
    c[j][0] += t[j][0] * down[0];
    c[j][1] += t[j][1] * down[0];
    c[j][2] += t[j][2] * down[1];
    c[j][3] += t[j][3] * down[1];
  }
}
