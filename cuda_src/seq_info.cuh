// seq_info.cuh — one batch entry's sequence: its lengths and where its rows start, for dense and packed
// (variable-length) batches alike. A kernel that may see packed batches keeps the lengths in shared
// memory, read where used.
#pragma once
#include "common.cuh"
#include "params.cuh"

// The lengths (nq, nk) of a MAY_BE_PACKED kernel's batch entry, written once by its SeqInfo. Shared memory,
// read through volatile loads where they are used: in registers they would live through the main loop,
// and the modifiers' kernels, whose tightest variants are at 255 registers, would spill.
__shared__ int seq_lengths[2];
__device__ __forceinline__ int shared_nq() {
  return *static_cast<volatile const int*>(&seq_lengths[0]);
}
__device__ __forceinline__ int shared_nk() {
  return *static_cast<volatile const int*>(&seq_lengths[1]);
}

// The sequence of batch entry b: its lengths nq(), nk(), where its rows start in the strided tensors (added
// to the batch offset), and where they start in the library's per-row arrays: lse, delta, lse_log2, dq at
// q_flat (+ row), dk, dv at k_flat. Dense batches: (nq, nk, 0, 0, b * nq, b * nk). MAY_BE_PACKED: the
// kernel reads cu_seqlens when set (HAS_MODS kernels; the constructor then synchronizes the CTA, so every
// thread of it must construct one); otherwise the batch is dense and nq, nk are the parameters' constants.
template <bool MAY_BE_PACKED>
struct SeqInfo {
  const AttnParams& p;
  i64 q_row, k_row;
  i64 q_flat, k_flat;

  __device__ __forceinline__ SeqInfo(const AttnParams& params, int b) : p(params) {
    if (MAY_BE_PACKED && p.cu_seqlens_q) {
      const int s = b / p.heads, h = b % p.heads;
      const int q0 = p.cu_seqlens_q[s], k0 = p.cu_seqlens_k[s];
      if (threadIdx.x == 0) {
        seq_lengths[0] = p.cu_seqlens_q[s + 1] - q0;
        seq_lengths[1] = p.cu_seqlens_k[s + 1] - k0;
      }
      q_row = q0;
      k_row = k0;
      q_flat = static_cast<i64>(h) * p.total_q + q0;
      k_flat = static_cast<i64>(h) * p.total_k + k0;
    } else {
      if (MAY_BE_PACKED && threadIdx.x == 0) {
        seq_lengths[0] = p.nq;
        seq_lengths[1] = p.nk;
      }
      q_row = k_row = 0;
      q_flat = static_cast<i64>(b) * p.nq;
      k_flat = static_cast<i64>(b) * p.nk;
    }
    if (MAY_BE_PACKED) __syncthreads();
  }

  __device__ __forceinline__ int nq() const {
    if constexpr (MAY_BE_PACKED) return shared_nq();
    return p.nq;
  }
  __device__ __forceinline__ int nk() const {
    if constexpr (MAY_BE_PACKED) return shared_nk();
    return p.nk;
  }

  // Bottom-right causal alignment (FlashAttention-2): query row i sees key j iff j <= i + nk - nq.
  __device__ __forceinline__ int causal_offset() const { return nk() - nq(); }
};
