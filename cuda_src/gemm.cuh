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
__device__ __forceinline__ void gemm_abt(acc_t<T> (&c)[N_TILES][4], const T* a_tile, int row0, const T* b_tile, int lane) {
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
