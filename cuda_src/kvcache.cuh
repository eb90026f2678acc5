// kvcache.cuh — what the key/value-cache kernels share: their parameters, where a cached position lives
// (contiguous or paged), which sequences' values are in range, and the key range and split of a sequence.
#pragma once
#include "common.cuh"
#include "params.cuh"

constexpr int MAX_SPLITS = 128;  // splits of one sequence at most (cupyflash/_checks.py, MAX_SPLITS)

// Host mirror: cupyflash/_cuda/decode_params.py, PARAMS_DTYPE (same field order, C alignment; checked by
// tests/tooling/test_params_layout.py). Strides in elements.
struct KVCacheParams {
  const void* q;             // (B, Hq, Nq, D), unit last stride; the rotated copy (B, Hq, Nq, D) when rotary
  void* k_cache;             // (B or num_pages, Hk, Ncache or page_size, D), unit last stride
  void* v_cache;             // same with Dv
  const void* k_new;         // (B, Hk, Nnew, D): appended at cache_seqlens[b] ...
  const void* v_new;         // (B, Hk, Nnew, Dv)
  void* out;                 // (B, Hq, Nq, Dv) the inputs' dtype, any strides
  void* lse;                 // (B, Hq, Nq) accumulator dtype, contiguous; null when the caller wants no lse
  void* out_part;            // (max_splits, B * Hq * Nq, Dv) accumulator dtype: each split's normalized out
  void* lse_part;            // (max_splits, B * Hq * Nq)
  const int* cache_seqlens;  // (B,), or null: every sequence holds seqlen_all
  const int* block_table;    // (B, max_pages) or null (contiguous cache)
  const void* rotary_cos;    // (max_pos, rotary_dim / 2) accumulator dtype, contiguous
  const void* rotary_sin;
  const float* alibi_slopes;  // (B, Hq) with alibi_stride, or null
  void* q_rot;                // (B, Hq, Nq, D) contiguous: the rotated queries (written by kvcache_append)
  int* split_counters;        // (B, Hk * row_tiles), zero between calls: splits done (attention_decode.cu)
  float* k_scale;             // e4m3 caches: the descales (dim0 or 1, Hk or 1, blocks), float32; null otherwise
  float* v_scale;
  i64 q_stride[3];     // b, h, n of q (of q_rot when rotary)
  i64 q_in_stride[3];  // b, h, n of the caller's q (read by kvcache_append)
  i64 k_stride[3];     // page (or b), hk, position of k_cache
  i64 v_stride[3];
  i64 k_new_stride[3];  // b, hk, n
  i64 v_new_stride[3];
  i64 out_stride[3];      // b, h, n
  i64 k_scale_stride[3];  // page (or b), hk, block of k_scale; 0 along a dim of size 1
  i64 v_scale_stride[3];
  i64 block_table_stride;
  i64 alibi_stride[2];
  int batch;
  int hq;
  int hk;
  int group;  // Hq / Hk
  int nq;
  int nnew;
  int d;
  int dv;
  int page_size;  // positions per page (contiguous: Ncache)
  int num_pages;
  int capacity;  // positions a sequence can hold
  int paged;
  int rotary_half;  // rotary_dim / 2; 0 without rotary
  int max_pos;
  int rotary_interleaved;
  int rotary_q_advance;  // queries rotated at cache_seqlens + i (causal or a window), else at cache_seqlens
  int window_left;       // -1 = unbounded
  int window_right;      // causal folded in (right = 0); -1 = unbounded
  int softcap_on;
  int alibi_on;
  int vec_ok;  // cache rows in whole, aligned 16-byte chunks
  int max_splits;
  int min_tiles_per_split;
  int row_tiles;
  int seqlen_all;
  int k_scale_block;  // e4m3 caches: positions of dim 2 per scale (128, or page_size / Ncache)
  int v_scale_block;
  int k_scale_set;  // whether the append sets a block's scale when it writes the block's first position
  int v_scale_set;
  // The real-valued parameters, named as AttnParams names them (params.cuh, Reals reads either struct).
  float scale;
  float scale_log2;   // log2(e) * scale
  float softcap;      // 0 = off
  float softcap_inv;  // 1 / softcap (0 when off)
  double scale_f64;
  double scale_log2_f64;
  double softcap_f64;
  double softcap_inv_f64;
};

// One element rounded from the accumulator type (float; double for float64 inputs).
template <typename T>
__device__ __forceinline__ T from_acc(float x);
template <>
__device__ __forceinline__ half_t from_acc<half_t>(float x) {
  half_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <>
__device__ __forceinline__ bfloat16_t from_acc<bfloat16_t>(float x) {
  bfloat16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <>
__device__ __forceinline__ float from_acc<float>(float x) {
  return x;
}
template <typename T>
__device__ __forceinline__ T from_acc(double x) {
  return x;
}

template <typename A>
__device__ __forceinline__ A neg_inf_of() {
  return A(neg_inf());
}
template <typename A>
__device__ __forceinline__ A nan_of();
template <>
__device__ __forceinline__ float nan_of<float>() {
  return __int_as_float(0x7fffffff);
}
template <>
__device__ __forceinline__ double nan_of<double>() {
  return __longlong_as_double(0x7ff8000000000000ll);
}
// Sequence b's cached positions before the append.
__device__ __forceinline__ int cached_length(const KVCacheParams& p, int b) {
  return p.cache_seqlens ? p.cache_seqlens[b] : p.seqlen_all;
}
// Sequence b's length after the append (L_b = cache_seqlens[b] + Nnew), or -1 when its values are out of
// range: a negative length, more positions than the cache holds, or rotary positions past the tables.
// Such a sequence is left alone by the append and gets NaN rows from the attention.
__device__ __forceinline__ int sequence_length(const KVCacheParams& p, int b) {
  const int cached = cached_length(p, b);
  if (cached < 0 || cached > p.capacity - p.nnew) return -1;
  if (p.rotary_half) {
    const int q_span = p.rotary_q_advance ? p.nq : 1;
    const int span = p.nnew > q_span ? p.nnew : q_span;
    if (cached > p.max_pos - span) return -1;
  }
  return cached + p.nnew;
}

// Packed row `packed` of key/value head hk in sequence b (the G query heads of hk share a tile's rows):
// query head h = hk * G + packed / Nq, query i = packed % Nq, and `flat` its index in (B, Hq, Nq).
struct PackedRow {
  int h, i;
  i64 flat;
  __device__ __forceinline__ PackedRow(const KVCacheParams& p, int b, int hk, int packed)
      : h(hk * p.group + packed / p.nq), i(packed % p.nq), flat((static_cast<i64>(b) * p.hq + h) * p.nq + i) {}
  template <typename T>
  __device__ __forceinline__ T* out(const KVCacheParams& p, int b) const {
    return static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
  }
};

// The page (contiguous: the sequence) and the row within it of position pos of sequence b; page -1 when
// the block table points outside the cache.
struct CacheRow {
  int page, row;
};
// log2(n) where n is a power of two, else -1: lets a kernel divide by a page or scale block size with a shift.
__device__ __forceinline__ int shift_of(int n) {
  return n > 0 && (n & (n - 1)) == 0 ? __ffs(n) - 1 : -1;
}
// pos / n, by `shift` (shift_of(n)) where n is a power of two.
__device__ __forceinline__ int divide(int pos, int n, int shift) {
  return shift >= 0 ? pos >> shift : pos / n;
}
// (page_shift: shift_of(p.page_size), where a kernel has it.)
__device__ __forceinline__ CacheRow cache_row(const KVCacheParams& p, int b, int pos, int page_shift = -1) {
  if (!p.paged) return {b, pos};
  const int slot = divide(pos, p.page_size, page_shift);
  const int page = p.block_table[b * p.block_table_stride + slot];
  return {(page >= 0 && page < p.num_pages) ? page : -1, pos - slot * p.page_size};
}

// The descale of cache row `at` of key/value head hk, for an e4m3 cache's scale array and its strides.
template <typename F>
__device__ __forceinline__ F* scale_at(F* scale, const i64 (&stride)[3], int block, int hk, CacheRow at,
                                       int block_shift = -1) {
  return scale + at.page * stride[0] + hk * stride[1] + divide(at.row, block, block_shift) * stride[2];
}

// The keys a row tile of sequence b (length L) can see start at key_begin: with a left window, the
// earliest query (at L - Nq) sees nothing before L - Nq - left. They end at L (a right window or the
// causal mask hides nothing before the last query's position L - 1).
__device__ __forceinline__ int key_begin(const KVCacheParams& p, int length) {
  if (p.window_left < 0) return 0;
  const int first = length - p.nq - p.window_left;
  return first > 0 ? first : 0;
}

// How sequence b's key tiles are split: `splits` parts of `tiles_per_split` tiles (the last maybe fewer,
// none empty). A sequence of length 0, or whose values are out of range, takes one split of no tiles.
// The decode kernel and the merge compute this alike from the same parameters. The tiles start at key_begin
// rounded down to a multiple of ALIGN (the keys before key_begin are hidden by the window test anyway): tiles of
// ALIGN positions then never straddle pages of a multiple of ALIGN.
struct SplitPlan {
  int begin, tiles, tiles_per_split, splits;
};
template <int BLOCK_N, int ALIGN = 1>
__device__ __forceinline__ SplitPlan split_plan(const KVCacheParams& p, int length) {
  if (length <= 0) return {0, 0, 0, 1};
  const int begin = key_begin(p, length) / ALIGN * ALIGN;
  const int tiles = ceil_div(length - begin, BLOCK_N);
  int splits = ceil_div(tiles, p.min_tiles_per_split);
  splits = splits < p.max_splits ? splits : p.max_splits;
  const int per = ceil_div(tiles, splits);
  return {begin, tiles, per, ceil_div(tiles, per)};
}
