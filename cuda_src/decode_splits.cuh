// decode_splits.cuh — what the decode kernels (attention_decode.cu, attention_decode_fp8.cu) share around their
// key loop: the streaming copy of cache rows, and the end of a split: out and lse stored directly when a sequence
// takes one split, else the split's partial state, with the last split to finish merging them all by their
// log-sum-exp (so one launch does it all).
//
// A kernel's traits Tr give Elem (q's and out's dtype), Acc (the accumulator dtype), WARPS and THREADS.
#pragma once
#include "common.cuh"
#include "kvcache.cuh"
#include "lse_merge.cuh"

// One 16-byte chunk of the cache, or zeros when !valid (as copy.cuh's cp_async_16), with a hint that L2
// fetch the whole 128-byte line: the cache is streamed once, in whole rows (docs/design/decode.md).
__device__ __forceinline__ void cp_async_stream(u32 dst, const void* src, bool valid) {
  asm volatile(
      "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n cp.async.cg.shared.global.L2::128B [%0], [%1], 16, "
      "ignore;\n}\n" ::"r"(dst),
      "l"(src), "r"(static_cast<u32>(valid)));
}

// The merge of a (sequence, row tile)'s splits, by the CTA of the last split to finish, by the rules of
// lse_merge.cuh: a split that saw no key (lse -inf) weighs 0; a NaN lse (a poisoned split) makes the row NaN. A warp
// per row finds the weights (into shared memory: `weights` holds ROWS x MAX_SPLITS), then each thread sums columns over
// the splits. Partial states are read through L2 (__ldcg): other CTAs wrote them.
template <class Tr>
__device__ __forceinline__ void merge_splits(const KVCacheParams& p, int splits, int b, int hk, int row0, int rows,
                                             typename Tr::Acc* weights, typename Tr::Acc* row_lse) {
  using Acc = typename Tr::Acc;
  const i64 all_rows = static_cast<i64>(p.batch) * p.hq * p.nq;
  const Acc* lse_part = static_cast<const Acc*>(p.lse_part);
  const Acc* out_part = static_cast<const Acc*>(p.out_part);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  auto flat_of = [&](int r) { return PackedRow(p, b, hk, row0 + r).flat; };
  for (int r = warp; r < rows; r += Tr::WARPS) {
    const i64 flat = flat_of(r);
    Acc m = neg_inf_of<Acc>();
    bool nan = false;
    for (int s = lane; s < splits; s += WARP_SIZE) {
      const Acc x = __ldcg(lse_part + s * all_rows + flat);
      nan |= x != x;
      m = max_of(m, x);
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) m = max_of(m, __shfl_xor_sync(0xffffffffu, m, offset));
    nan = __any_sync(0xffffffffu, nan);
    const Acc base = merge_base(m);
    Acc total = Acc(0);
    for (int s = lane; s < splits; s += WARP_SIZE) {
      const Acc w = merge_weight(__ldcg(lse_part + s * all_rows + flat), base);
      weights[r * MAX_SPLITS + s] = w;
      total += w;
    }
    total = warp_sum(total);
    const Acc inv = total > Acc(0) ? Acc(1) / total : Acc(0);
    for (int s = lane; s < splits; s += WARP_SIZE) weights[r * MAX_SPLITS + s] *= inv;
    if (lane == 0) row_lse[r] = nan ? nan_of<Acc>() : merged_lse(base, total);
  }
  __syncthreads();
  constexpr int UNROLL = 4;  // splits whose loads are in flight together
  for (int e = threadIdx.x; e < rows * p.dv; e += Tr::THREADS) {
    const int r = e / p.dv, c = e % p.dv;
    const i64 flat = flat_of(r);
    const Acc* column = out_part + flat * p.dv + c;
    const Acc* w = weights + r * MAX_SPLITS;
    const i64 step = all_rows * p.dv;
    Acc x = Acc(0);
    int s = 0;
    for (; s + UNROLL <= splits; s += UNROLL) {
      Acc part[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) part[u] = __ldcg(column + (s + u) * step);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) x += w[s + u] * part[u];
    }
    for (; s < splits; ++s) x += w[s] * __ldcg(column + s * step);
    const Acc lse = row_lse[r];
    using Elem = typename Tr::Elem;
    PackedRow(p, b, hk, row0 + r).out<Elem>(p, b)[c] = from_acc<Elem>(lse != lse ? nan_of<Acc>() : x);
  }
  if (p.lse) {
    for (int r = threadIdx.x; r < rows; r += Tr::THREADS) static_cast<Acc*>(p.lse)[flat_of(r)] = row_lse[r];
  }
}

// A split's end. `merged` holds the CTA's out rows (row r at r * out_stride, accumulator dtype) and `lse_rows`
// their lse (natural log); `poisoned` makes them NaN (a sequence out of range, or a block table pointing outside
// the cache). With one split they are out and lse; otherwise they go to out_part / lse_part, and the splits of one
// (sequence, row tile) count themselves in: the last to arrive has every partial state in global memory (each
// split fenced its stores before counting) and merges them, into `weights` (ROWS x MAX_SPLITS) and `row_lse`
// (ROWS), which may lie over `merged` and `lse_rows`. It resets the counter for the next call: all of this call's
// splits have arrived.
template <class Tr>
__device__ __forceinline__ void store_or_merge(const KVCacheParams& p, int splits, int split, int b, int hk, int row0,
                                               int rows, const typename Tr::Acc* merged, int out_stride,
                                               const typename Tr::Acc* lse_rows, bool poisoned,
                                               typename Tr::Acc* weights, typename Tr::Acc* row_lse) {
  using Acc = typename Tr::Acc;
  using T = typename Tr::Elem;
  const bool direct = splits == 1;
  const i64 all_rows = static_cast<i64>(p.batch) * p.hq * p.nq;
  for (int e = threadIdx.x; e < rows * p.dv; e += Tr::THREADS) {
    const int r = e / p.dv, c = e % p.dv;
    const PackedRow row(p, b, hk, row0 + r);
    const Acc x = poisoned ? nan_of<Acc>() : merged[r * out_stride + c];
    if (direct) {
      row.out<T>(p, b)[c] = from_acc<T>(x);
    } else {
      static_cast<Acc*>(p.out_part)[(split * all_rows + row.flat) * p.dv + c] = x;
    }
  }
  for (int r = threadIdx.x; r < rows; r += Tr::THREADS) {
    const i64 flat = PackedRow(p, b, hk, row0 + r).flat;
    const Acc x = poisoned ? nan_of<Acc>() : lse_rows[r];
    if (direct) {
      if (p.lse) static_cast<Acc*>(p.lse)[flat] = x;
    } else {
      static_cast<Acc*>(p.lse_part)[split * all_rows + flat] = x;
    }
  }
  if (direct) return;
  __shared__ int arrived;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = p.split_counters + b * gridDim.y + blockIdx.y;
    arrived = atomicAdd(counter, 1);
    if (arrived == splits - 1) *counter = 0;
  }
  __syncthreads();
  if (arrived != splits - 1) return;
  __threadfence();
  merge_splits<Tr>(p, splits, b, hk, row0, rows, weights, row_lse);
}
