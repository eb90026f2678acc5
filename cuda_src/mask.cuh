// mask.cuh — which (query, key) pairs take part, applied to a warp's m16n8 score tiles.
//
// Two reasons hide a score (set it to -inf so that exp2 gives P = 0):
//  - the key lies past the end of the sequence (the tile overhangs nk);
//  - causal, bottom-right aligned: query i sees key j only if j <= i + nk - nq.
// Kernels call this only on tiles that straddle a boundary; interior tiles skip it.
#pragma once
#include "common.cuh"

// Whether the query at position qp sees key j through a window band [qp - left, qp + right] (-1 = unbounded;
// causal is right = 0): the one test behind every kernel's window (score_mods.cuh, attention_decode.cu).
__device__ __forceinline__ bool in_window(int j, int qp, int left, int right) {
  return (left < 0 || j >= qp - left) && (right < 0 || j <= qp + right);
}

template <bool IS_CAUSAL>
struct Mask {
  int nk;      // number of keys
  int offset;  // nk - nq: the causal diagonal's shift

  // Score tile with query rows and key columns; the warp's tile starts at (q0, k0).
  template <int N_TILES, typename A>
  __device__ __forceinline__ void apply(A (&s)[N_TILES][4], int q0, int k0, int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = q0 + g + 8 * r;
      const int key_end = IS_CAUSAL ? min(nk, q + offset + 1) : nk;
#pragma unroll
      for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (k0 + j * 8 + 2 * t + c >= key_end) s[j][2 * r + c] = neg_inf();
        }
      }
    }
  }

  // Transposed tile (key rows, query columns), as the dK/dV pass computes S^T. Keys past nk
  // are not masked there: their rows of dK/dV are never stored.
  template <int N_TILES, typename A>
  __device__ __forceinline__ void apply_transposed(A (&s)[N_TILES][4], int k0, int q0, int lane) const {
    if (!IS_CAUSAL) return;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = k0 + g + 8 * r;
#pragma unroll
      for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (key > q0 + j * 8 + 2 * t + c + offset) s[j][2 * r + c] = neg_inf();
        }
      }
    }
  }
};
