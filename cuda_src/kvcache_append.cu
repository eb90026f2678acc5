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
//
// kvcache_append_e4m3: the same into e4m3 caches (float32 descales beside the codes: kvcache.cuh, scale_at). Each
// new element is stored as e4m3(x / scale) (x rotated first for keys, in the accumulator type; the division
// correctly rounded, as the CPU path divides; e4m3.cuh rounds), with the scale of its position. Where a cache's
// scales are per block (k_scale_set / v_scale_set) and the call writes a block's first position, that block's
// scale is set first, per head, from the largest magnitude among the rows the call writes into it: amax / 28
// (1 for zeros), a headroom of 16 below e4m3's 448 for the block's later rows, which keep it (and saturate
// beyond it). Non-finite new values are stored as NaN codes (an infinite one also makes the scale of a block it
// starts infinite; a NaN is left out of the amax): whatever reads them gets NaN, never a finite stand-in.
// Grid: x = block of positions (counted from the one holding position cache_seqlens[b]; blocks of the scales'
// size where an append sets scales, else of APPEND_E4M3_POSITIONS), y = 0 new keys, 1 new values, 2 queries
// (rotated by the CTAs of every x and z together), z = b * Hk + hk.
#include "common.cuh"
#include "mma.cuh"
#include "kvcache.cuh"
#include "e4m3.cuh"

// Rotary pair `unit` of row `src` at position `pos`: its two dims and their rotated values, in the accumulator
// type (x' = x cos - y sin, y' = y cos + x sin), not yet rounded.
template <typename T>
struct RotatedPair {
  int c0, c1;
  acc_t<T> x, y;
};

template <typename T>
__device__ __forceinline__ RotatedPair<T> rotate_pair(const T* src, const KVCacheParams& p, int pos, int unit) {
  using Acc = acc_t<T>;
  const int half = p.rotary_half;
  const int c0 = p.rotary_interleaved ? 2 * unit : unit;
  const int c1 = p.rotary_interleaved ? 2 * unit + 1 : unit + half;
  const Acc cos = static_cast<const Acc*>(p.rotary_cos)[static_cast<i64>(pos) * half + unit];
  const Acc sin = static_cast<const Acc*>(p.rotary_sin)[static_cast<i64>(pos) * half + unit];
  const Acc x = Elem<T>::to_acc(src[c0]), y = Elem<T>::to_acc(src[c1]);
  return {c0, c1, x * cos - y * sin, y * cos + x * sin};
}

// Unit `unit` of row `src` (one rotated pair, or one copied dim past them) written to `dst`, rounded once.
template <typename T>
__device__ __forceinline__ void rotate_row(T* dst, const T* src, const KVCacheParams& p, int pos, int unit) {
  if (unit >= p.rotary_half) {  // past the rotated dims: a copy
    const int c = unit + p.rotary_half;
    dst[c] = src[c];
    return;
  }
  const RotatedPair<T> r = rotate_pair(src, p, pos, unit);
  dst[r.c0] = from_acc<T>(r.x);
  dst[r.c1] = from_acc<T>(r.y);
}

// Query row `row` of (B, Hq, Nq) rotated into q_rot, its unit `unit` (one pair, or one copied dim).
template <typename T>
__device__ __forceinline__ void rotate_query(const KVCacheParams& p, i64 row, int unit) {
  const int j = static_cast<int>(row % p.nq), h = static_cast<int>((row / p.nq) % p.hq);
  const int b = static_cast<int>(row / (static_cast<i64>(p.nq) * p.hq));
  if (sequence_length(p, b) < 0) return;
  const T* src = static_cast<const T*>(p.q) + b * p.q_in_stride[0] + h * p.q_in_stride[1] + j * p.q_in_stride[2];
  rotate_row(static_cast<T*>(p.q_rot) + row * p.d, src, p, cached_length(p, b) + (p.rotary_q_advance ? j : 0), unit);
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
    if (part == 2) {
      rotate_query<T>(p, row, unit);
      continue;
    }
    const int j = static_cast<int>(row % n), h = static_cast<int>((row / n) % heads);
    const int b = static_cast<int>(row / (static_cast<i64>(n) * heads));
    if (sequence_length(p, b) < 0) continue;
    const int cached = cached_length(p, b);
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

constexpr int APPEND_E4M3_POSITIONS = 128;  // positions per CTA where an append sets no scale

// Element c of new key or value row `src` (at position pos) as it is quantized: rotated for keys, unrounded.
template <typename T>
__device__ __forceinline__ float new_value(const KVCacheParams& p, const T* src, bool is_key, int pos, int c) {
  const int half = p.rotary_half;
  if (!is_key || c >= 2 * half) return Elem<T>::to_acc(src[c]);
  const int unit = p.rotary_interleaved ? c / 2 : (c < half ? c : c - half);
  const RotatedPair<T> r = rotate_pair(src, p, pos, unit);
  return c == r.c0 ? r.x : r.y;
}

template <typename T>
__global__ void __launch_bounds__(256) kvcache_append_e4m3(const KVCacheParams p) {
  const int part = blockIdx.y + (p.nnew == 0 ? 2 : 0);  // 0: k, 1: v, 2: q
  if (part == 2) {
    const int units = p.d - p.rotary_half;
    const i64 total = static_cast<i64>(p.batch) * p.hq * p.nq * units;
    const i64 step = static_cast<i64>(gridDim.x) * gridDim.z * blockDim.x;
    for (i64 e = (static_cast<i64>(blockIdx.z) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += step) {
      rotate_query<T>(p, e / units, static_cast<int>(e % units));
    }
    return;
  }
  const int b = blockIdx.z / p.hk, hk = blockIdx.z % p.hk;
  if (sequence_length(p, b) < 0) return;
  const bool is_key = part == 0;
  const int block = is_key ? p.k_scale_block : p.v_scale_block;
  const bool sets = is_key ? p.k_scale_set : p.v_scale_set;
  const int cached = cached_length(p, b), span = sets ? block : APPEND_E4M3_POSITIONS;
  const int first = (cached / span + static_cast<int>(blockIdx.x)) * span;  // this CTA's block: [first, first + span)
  const int lo = max(cached, first), hi = min(cached + p.nnew, first + span);
  if (lo >= hi) return;
  const int d = is_key ? p.d : p.dv;
  const i64* new_stride = is_key ? p.k_new_stride : p.v_new_stride;
  const i64* stride = is_key ? p.k_stride : p.v_stride;
  const T* new_rows = static_cast<const T*>(is_key ? p.k_new : p.v_new) + b * new_stride[0] + hk * new_stride[1];
  unsigned char* codes = static_cast<unsigned char*>(is_key ? p.k_cache : p.v_cache) + hk * stride[1];
  float* scale = is_key ? p.k_scale : p.v_scale;
  const i64(&scale_stride)[3] = is_key ? p.k_scale_stride : p.v_scale_stride;
  auto value = [&](int pos, int c) { return new_value(p, new_rows + (pos - cached) * new_stride[2], is_key, pos, c); };
  const int elements = (hi - lo) * d;

  __shared__ float block_scale;
  __shared__ float warp_max[256 / WARP_SIZE];
  const bool setting = sets && lo == first;  // this call writes the block's first position
  if (setting) {
    float amax = 0.0f;
    for (int e = threadIdx.x; e < elements; e += blockDim.x) amax = fmaxf(amax, fabsf(value(lo + e / d, e % d)));
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (threadIdx.x % WARP_SIZE == 0) warp_max[threadIdx.x / WARP_SIZE] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x) / WARP_SIZE; ++w) amax = fmaxf(amax, warp_max[w]);
      const float s = amax == 0.0f ? 1.0f : __fdiv_rn(amax, 28.0f);  // E4M3_MAX / HEADROOM (fp8.py)
      const CacheRow at = cache_row(p, b, lo);
      if (at.page >= 0) *scale_at(scale, scale_stride, block, hk, at) = s;
      block_scale = s;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < elements; e += blockDim.x) {
    const int pos = lo + e / d, c = e % d;
    const CacheRow at = cache_row(p, b, pos);
    if (at.page < 0) continue;  // (the attention gives the sequence NaN rows)
    const float s = setting ? block_scale : *scale_at(scale, scale_stride, block, hk, at);
    codes[at.page * stride[0] + at.row * stride[2] + c] = e4m3_of(__fdiv_rn(value(pos, c), s));
  }
}
