// kvcache_append.cu — the step before attention against a key/value cache: new keys and values written
// into the cache, and the rotary position embedding of the new keys and of the queries.
//
// Writes k_new[b, hk, j] (rotated at position cache_seqlens[b] + j) and v_new[b, hk, j] into cache
// position cache_seqlens[b] + j of sequence b (through the block table when paged: kvcache.cuh), and the
// queries q[b, h, i] rotated at cache_seqlens[b] + i (rotary_q_advance: causal or a window) or at
// cache_seqlens[b] (FlashAttention-2's rule) into q_rot (B, Hq, Nq, D) contiguous.
// Rotary on the first rotary_dim = 2 * rotary_half dims: dim u pairs with u + rotary_half (GPT-NeoX), or
// 2u with 2u + 1 (interleaved, GPT-J); x' = x cos - y sin, y' = y cos + x sin in the accumulator type,
// rounded once. Sequences whose values are out of range, and positions whose page is outside the cache,
// are not written (the attention gives them NaN rows).
// Grid: y = 0 new keys, 1 new values, 2 queries (without new keys y = 0 is the queries); x strides over (row, unit), a
// unit being one rotated pair or one copied element.
#include "common.cuh"
#include "mma.cuh"
#include "kvcache.cuh"

template <typename T>
__device__ __forceinline__ void rotate_row(T* dst, const T* src, const KVCacheParams& p, int pos, int unit) {
  using Acc = acc_t<T>;
  const int half = p.rotary_half;
  if (unit >= half) {  // past the rotated dims: a copy
    const int c = unit + half;
    dst[c] = src[c];
    return;
  }
  const int c0 = p.rotary_interleaved ? 2 * unit : unit;
  const int c1 = p.rotary_interleaved ? 2 * unit + 1 : unit + half;
  const Acc cos = static_cast<const Acc*>(p.rotary_cos)[static_cast<i64>(pos) * half + unit];
  const Acc sin = static_cast<const Acc*>(p.rotary_sin)[static_cast<i64>(pos) * half + unit];
  const Acc x = Elem<T>::to_acc(src[c0]), y = Elem<T>::to_acc(src[c1]);
  dst[c0] = from_acc<T>(x * cos - y * sin);
  dst[c1] = from_acc<T>(y * cos + x * sin);
}

template <typename T>
__global__ void __launch_bounds__(256) kvcache_append(const KVCacheParams p) {
  const int part = blockIdx.y + (p.nnew == 0 ? 2 : 0);  // 0: k, 1: v, 2: q (the grid has the parts it needs)
  const int heads = part == 2 ? p.hq : p.hk;
  const int n = part == 2 ? p.nq : p.nnew;
  const int d = part == 1 ? p.dv : p.d;
  const int units = part == 1 ? d : d - p.rotary_half;  // rotary_half = 0 without rotary: plain copies
  const i64 total = static_cast<i64>(p.batch) * heads * n * units;
  for (i64 e = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<i64>(gridDim.x) * blockDim.x) {
    const int unit = static_cast<int>(e % units);
    const i64 row = e / units;
    const int j = static_cast<int>(row % n), h = static_cast<int>((row / n) % heads);
    const int b = static_cast<int>(row / (static_cast<i64>(n) * heads));
    if (sequence_length(p, b) < 0) continue;
    const int cached = cached_length(p, b);
    if (part == 2) {
      const T* src = static_cast<const T*>(p.q) + b * p.q_in_stride[0] + h * p.q_in_stride[1] + j * p.q_in_stride[2];
      T* dst = static_cast<T*>(p.q_rot) + (row * p.d);
      rotate_row(dst, src, p, cached + (p.rotary_q_advance ? j : 0), unit);
      continue;
    }
    const CacheRow at = cache_row(p, b, cached + j);
    if (at.page < 0) continue;
    if (part == 0) {
      const T* src =
          static_cast<const T*>(p.k_new) + b * p.k_new_stride[0] + h * p.k_new_stride[1] + j * p.k_new_stride[2];
      T* dst = static_cast<T*>(p.k_cache) + at.page * p.k_stride[0] + h * p.k_stride[1] + at.row * p.k_stride[2];
      rotate_row(dst, src, p, cached + j, unit);
    } else {
      const T* src =
          static_cast<const T*>(p.v_new) + b * p.v_new_stride[0] + h * p.v_new_stride[1] + j * p.v_new_stride[2];
      T* dst = static_cast<T*>(p.v_cache) + at.page * p.v_stride[0] + h * p.v_stride[1] + at.row * p.v_stride[2];
      dst[unit] = src[unit];
    }
  }
}
