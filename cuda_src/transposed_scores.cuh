// transposed_scores.cuh — the backward's elementwise steps on score tiles held transposed (key rows, query
// columns: S^T and dP^T, as a CTA that owns a block of keys computes them), with each query's lse_log2 and
// delta read from shared memory along the columns.
#pragma once
#include "common.cuh"

// P = exp2(scale_log2 * S - lse_log2) for a score tile whose query index runs along the columns
// (dK/dV pass: S^T) and whose lse_log2 sits in shared memory.
template <int N_TILES, typename A>
__device__ __forceinline__ void probs_from_scores_cols(A (&s)[N_TILES][4], const A* lse_log2, A scale_log2, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = fast_exp2(s[j][e] * scale_log2 - lse_log2[j * 8 + 2 * t + (e & 1)]);
  }
}

// dS = P * (dP - delta), in place in dp, delta indexed along the columns (dK/dV pass).
template <int N_TILES, typename A>
__device__ __forceinline__ void dscores_cols(A (&dp)[N_TILES][4], const A (&prob)[N_TILES][4], const A* delta,
                                             int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[j][e] = prob[j][e] * (dp[j][e] - delta[j * 8 + 2 * t + (e & 1)]);
  }
}
// The same from a dP that carries a factor 1 / dp_factor (pieces: the inputs' powers of two).
template <int N_TILES, typename A>
__device__ __forceinline__ void dscores_cols(A (&dp)[N_TILES][4], const A (&prob)[N_TILES][4], const A* delta, int lane,
                                             A dp_factor) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[j][e] = prob[j][e] * (dp[j][e] * dp_factor - delta[j * 8 + 2 * t + (e & 1)]);
  }
}
