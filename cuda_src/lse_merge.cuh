// lse_merge.cuh — merging attention states by their log-sum-exp: the rules every merge on the GPU follows (a
// decode step's splits, attention_decode.cu; ring attention's steps, merge_states.cu), as
// cupyflash.merge_attention_states does on the host.
//
// Parts s of a row, each the attention over its own disjoint keys with log-sum-exp lse_s and normalized out_s,
// merge into lse = M + log(sum_s exp(lse_s - M)) and out = sum_s exp(lse_s - lse) out_s, M the largest lse_s
// (subtracted first, so no exponential overflows). A part whose lse is -inf saw no key: it weighs 0 and its out
// is never read. A row that no part saw keeps lse -inf and gets out 0. A NaN lse makes the row NaN. The
// exponentials and the logarithm are the accurate ones: a merge costs a few per row, never per key.
#pragma once
#include "common.cuh"

// What the parts' lse are taken against: their max M, or 0 when no part saw a key (then every weight is
// exp(-inf - 0) = 0, not exp(-inf + inf) = NaN).
template <typename A>
__device__ __forceinline__ A merge_base(A largest) {
  return largest == static_cast<A>(neg_inf()) ? A(0) : largest;
}
// A part's unnormalized weight exp(lse_s - base): 0 for a part that saw no key.
template <typename A>
__device__ __forceinline__ A merge_weight(A lse, A base) {
  return lse == static_cast<A>(neg_inf()) ? A(0) : exp_acc(lse - base);
}
// The merged lse from the base and the weights' total: -inf when no part saw a key (a NaN total propagates).
template <typename A>
__device__ __forceinline__ A merged_lse(A base, A total) {
  return total != A(0) ? base + log_acc(total) : static_cast<A>(neg_inf());
}
