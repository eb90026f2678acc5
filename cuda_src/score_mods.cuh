// score_mods.cuh — the score modifiers, for kernels instantiated with MODS = Mods::scalars (window, softcap,
// ALiBi; the backward's block mask), Mods::all (also bias with dbias, mask, block mask), Mods::softcap
// (the softcap alone, causal as IS_CAUSAL) or Mods::window (the window alone): ScoreMods<T, MODS, IS_CAUSAL>.
//
// Semantics (cupyflash/_modifiers.py is the authority; off = offset = nk - nq of this batch entry's
// sequence, SeqInfo):
//   x_ij = scale * q_i . k_j
//   x_ij = softcap * tanh(x_ij / softcap)          softcap > 0
//   x_ij -= slope_b * |i + off - j|                 ALiBi
//   x_ij += bias[b, i, j]                           additive bias (T or float32, any strides)
// All of it in the kernel's accumulator type A = acc_t<T>: float, or double for float64 inputs.
//   x_ij = -inf  when j >= nk, i >= nq, j is outside the window band
//                [i + off - left, i + off + right] (-1 = unbounded; causal arrives as right = 0),
//                or mask[b, i, j] is false.
// The block mask is not applied per element: kernels skip its false tiles whole (block_mask.cuh), which
// needs each kernel tile to lie inside one BLOCK_MASK_TILE x BLOCK_MASK_TILE block (tiles are powers
// of two <= 128, aligned). Scores come back in a unit of the logit (logit = unit * score): raw q . k
// without a softcap, tanh(x / softcap) with one; kernels run the softmax with unit * log2(e) as the
// exponent's scale (ScoreMods::exp_scale).
// Every option is a uniform run-time branch, except in Mods::softcap and Mods::window, where all but their
// own are compile-time constants (Mods::softcap: softcap on; window (-1, 0) if IS_CAUSAL, else none;
// Mods::window: no softcap; both: no ALiBi, block mask or packed lengths), so the same code folds down to
// that one option's work. The plain kernels (Mods::none) never see this file's code, so options that are
// off cost them nothing.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "mods.cuh"
#include "seq_info.cuh"
#include "softcap.cuh"
#include "block_mask.cuh"
#include "mask.cuh"

// Per CTA it keeps only its batch entry's base pointers and slope in registers; sizes, strides and
// flags are read from the kernel's parameter struct (constant memory operands, no registers).
// Tile transforms run as passes over the whole accumulator tile, one uniform branch per option and
// tile, so the element loops stay straight-line code the scheduler can interleave with the MMAs.
template <typename T, Mods MODS = Mods::all, bool IS_CAUSAL = false>
struct ScoreMods {
  using A = acc_t<T>;
  static constexpr bool ARRAYS = MODS == Mods::all;
  // One option alone, every other off at compile time: the softcap (window none, or causal's) or the window.
  static constexpr bool SOFTCAP_ALONE = MODS == Mods::softcap, WINDOW_ALONE = MODS == Mods::window;
  static constexpr bool ALONE = SOFTCAP_ALONE || WINDOW_ALONE;
  const AttnParams& p;
  const void* bias;
  A* dbias;  // the accumulator type (atomic adds); with p.dbias_pairs possibly T or float32 (store_dbias_pairs)
  const unsigned char* mask;
  const unsigned char* block_mask;
  A add_scale;  // what ALiBi and bias terms are multiplied by: 1 / the scores' unit (exp_scale)
  A slope;      // this batch entry's ALiBi slope, times add_scale (0 when ALONE)

  // The kernel has constructed its SeqInfo (HAS_MODS kernels do): nq() and nk() read the lengths where it
  // keeps them (in shared memory when the kernel may see packed batches, else the parameters).
  __device__ __forceinline__ ScoreMods(const AttnParams& params, int b) : p(params) {
    add_scale = capped() ? Reals<A>::softcap_inv(p) : A(1) / Reals<A>::scale(p);  // 1 / the unit
    slope = !ALONE && p.alibi_slopes ? A(p.alibi_slopes[batch_offset(p.alibi_stride, b, p)]) * add_scale : A(0);
    bias = nullptr;
    dbias = nullptr;
    mask = block_mask = nullptr;
    // Without ARRAYS (Mods::scalars) they stay null at compile time, and every branch on them folds away.
    if constexpr (ARRAYS) {
      if (p.bias)
        bias = static_cast<const char*>(p.bias) + batch_offset(p.bias_stride, b, p) * (p.bias_f32 ? 4 : sizeof(T));
      if (p.dbias) {
        dbias = reinterpret_cast<A*>(static_cast<char*>(p.dbias) +
                                     batch_offset(p.dbias_stride, b, p) * (p.dbias_f32 ? 4 : sizeof(T)));
      }
      if (p.mask) mask = p.mask + batch_offset(p.mask_stride, b, p);
      if (p.block_mask) block_mask = p.block_mask + batch_offset(p.block_mask_stride, b, p);
    }
  }

  // Whether a block mask is on. Mods::scalars serves it too (it skips tiles and touches no score), but
  // asks the parameters, keeping no pointer in a register; its line is found once, in load_tile_bitmap.
  __device__ __forceinline__ bool has_block_mask() const {
    if constexpr (ALONE) {
      return false;
    } else if constexpr (ARRAYS) {
      return block_mask != nullptr;
    } else {
      return p.block_mask != nullptr;
    }
  }

  // This batch entry's sequence lengths, as the kernel's SeqInfo<may_be_packed(MODS)> keeps them.
  __device__ __forceinline__ int nq() const { return may_be_packed(MODS) ? shared_nq() : p.nq; }
  __device__ __forceinline__ int nk() const { return may_be_packed(MODS) ? shared_nk() : p.nk; }

  // The options: is the softcap on; the window's edges (-1 = unbounded; causal is right = 0); is ALiBi on.
  __device__ __forceinline__ bool capped() const { return SOFTCAP_ALONE || (!WINDOW_ALONE && p.softcap > 0.f); }
  __device__ __forceinline__ int window_left() const { return SOFTCAP_ALONE ? -1 : p.window_left; }
  __device__ __forceinline__ int window_right() const { return SOFTCAP_ALONE ? (IS_CAUSAL ? 0 : -1) : p.window_right; }
  __device__ __forceinline__ bool has_slope() const { return !ALONE && slope != A(0); }

  // The scores' unit (logit = unit * score): without a softcap the scores keep their raw units (q . k)
  // and the scale stays folded into the exponent, as in the plain kernels; with one they are
  // t = tanh(x / softcap) and the softcap is folded in likewise (SoftcapTanh). The exponent's scale is
  // unit * log2(e); ALiBi and bias terms are divided by the unit (add_scale: one FMA each).
  __device__ __forceinline__ A exp_scale() const {
    return capped() ? Reals<A>::softcap(p) * log2e<A>() : Reals<A>::scale_log2(p);
  }

  // Keys [first, last] that some query of rows [r0, r1] may see through the window band and nk.
  __device__ __forceinline__ int first_key(int r0) const {
    return window_left() < 0 ? 0 : max(0, r0 + nk() - nq() - window_left());
  }
  __device__ __forceinline__ int last_key(int r1) const {
    return window_right() < 0 ? nk() - 1 : min(nk() - 1, r1 + nk() - nq() + window_right());
  }
  // Queries [first, last] that may see some key of columns [c0, c1] (clipped to [0, nq - 1]).
  __device__ __forceinline__ int first_query(int c0) const {
    return window_right() < 0 ? 0 : max(0, c0 - (nk() - nq()) - window_right());
  }
  __device__ __forceinline__ int last_query(int c1) const {
    return window_left() < 0 ? nq() - 1 : min(nq() - 1, c1 - (nk() - nq()) + window_left());
  }

  // Does the tile rows [r0, r1] x cols [c0, c1] need per-element bound checks? Interior tiles of the
  // band that lie inside nq x nk do not.
  __device__ __forceinline__ bool needs_bounds(int r0, int r1, int c0, int c1) const {
    const int offset = nk() - nq(), left = window_left(), right = window_right();
    return r1 >= nq() || c1 >= nk() || (right >= 0 && c1 > r0 + offset + right) ||
           (left >= 0 && c0 < r1 + offset - left);
  }

  // The key blocks [first, last] (of BLOCK keys) whose tiles for query rows [r0, r1] need no bound checks,
  // i.e. where needs_bounds() is false; first > last when there are none. Worked out once per CTA, so that
  // the forward's tiles test two registers instead of re-deriving the band from nq and nk.
  template <int BLOCK>
  __device__ __forceinline__ void unchecked_key_blocks(int r0, int r1, int& first, int& last) const {
    const int offset = nk() - nq(), left = window_left(), right = window_right();
    first = left < 0 ? 0 : -floor_div(-(r1 + offset - left), BLOCK);                  // c0 >= r1 + offset - left
    last = nk() / BLOCK - 1;                                                          // c1 < nk
    if (right >= 0) last = min(last, floor_div(r0 + offset + right + 1, BLOCK) - 1);  // c1 <= r0 + offset + right
    if (r1 >= nq()) last = first - 1;
  }

  // The same for the dK/dV pass: the query blocks [first, last] (of BLOCK queries) whose tiles for key
  // columns [c0, c1] need no bound checks.
  template <int BLOCK>
  __device__ __forceinline__ void unchecked_query_blocks(int c0, int c1, int& first, int& last) const {
    const int offset = nk() - nq(), left = window_left(), right = window_right();
    first = right < 0 ? 0 : -floor_div(-(c1 - offset - right), BLOCK);              // r0 >= c1 - offset - right
    last = nq() / BLOCK - 1;                                                        // r1 < nq
    if (left >= 0) last = min(last, floor_div(c0 - offset + left + 1, BLOCK) - 1);  // r1 <= c0 - offset + left
    if (c1 >= nk()) last = first - 1;
  }

  // This CTA's line of the block mask along its streamed axis: keys of query row i (KEYS), or
  // queries of key j. Empty (all on) without a block mask.
  template <int NUM_WARPS, bool KEYS>
  // Each member is written once, with the same value by every thread (the scalars' object is shared: a reset
  // to null before the load would race with another warp's load).
  __device__ __forceinline__ void load_tile_bitmap(TileBitmap& bitmap, u32* smem_words, int b, int fixed) const {
    if (!has_block_mask()) {
      bitmap.words = nullptr;
      bitmap.line = nullptr;
      bitmap.count = 0;
      bitmap.stride = 0;
      return;
    }
    const unsigned char* lines = ARRAYS ? block_mask : p.block_mask + batch_offset(p.block_mask_stride, b, p);
    const int t = fixed / BLOCK_MASK_TILE;
    if (KEYS) {
      bitmap.load<NUM_WARPS>(smem_words, lines + t * p.block_mask_stride[3], p.block_mask_stride[4],
                             ceil_div(nk(), BLOCK_MASK_TILE));
    } else {
      bitmap.load<NUM_WARPS>(smem_words, lines + t * p.block_mask_stride[4], p.block_mask_stride[3],
                             ceil_div(nq(), BLOCK_MASK_TILE));
    }
  }

  // Kernel tiles of BLOCK positions along the streamed axis: the last one <= n (>= first) whose
  // block-mask tile is on, or first - 1; and the first one >= n (< end) that is on, or end.
  template <int BLOCK>
  __device__ __forceinline__ int prev_on(const TileBitmap& bitmap, int n, int first) const {
    if (!has_block_mask() || n < first) return n;
    constexpr int PER = BLOCK_MASK_TILE / BLOCK;
    const int t = bitmap.prev_on(n / PER);
    const int found = t == n / PER ? n : t * PER + PER - 1;
    return t < 0 || found < first ? first - 1 : found;
  }
  template <int BLOCK>
  __device__ __forceinline__ int next_on(const TileBitmap& bitmap, int n, int end) const {
    if (!has_block_mask() || n >= end) return n;
    constexpr int PER = BLOCK_MASK_TILE / BLOCK;
    const int t = bitmap.next_on(n / PER);
    const int found = t == n / PER ? n : t * PER;
    return min(found, end);
  }

  // One bias element, and two adjacent ones (the host sets bias_pairs only when those are aligned).
  __device__ __forceinline__ A bias_at(i64 at) const {
    if constexpr (sizeof(T) != 4) {
      if (!p.bias_f32) return Elem<T>::to_acc(static_cast<const T*>(bias)[at]);
    }
    return static_cast<const float*>(bias)[at];
  }
  __device__ __forceinline__ void bias_pair(i64 at, A& b0, A& b1) const {
    if constexpr (sizeof(T) == 8) {
      if (!p.bias_f32) {
        const double2 v = *reinterpret_cast<const double2*>(static_cast<const T*>(bias) + at);
        b0 = v.x;
        b1 = v.y;
        return;
      }
    }
    if constexpr (sizeof(T) == 2) {
      if (!p.bias_f32) {
        const u32 v = *reinterpret_cast<const u32*>(static_cast<const T*>(bias) + at);
        T lo, hi;
        lo.bits = static_cast<u16>(v & 0xffffu);
        hi.bits = static_cast<u16>(v >> 16);
        b0 = Elem<T>::to_acc(lo);
        b1 = Elem<T>::to_acc(hi);
        return;
      }
    }
    const float2 v = *reinterpret_cast<const float2*>(static_cast<const float*>(bias) + at);
    b0 = v.x;
    b1 = v.y;
  }

  // (query, key) of element e of n-tile j of a warp tile at (row0, col0); TRANSPOSED tiles (the dK/dV
  // pass's S^T) hold keys along the rows.
  template <bool TRANSPOSED>
  __device__ __forceinline__ static void coords(int row0, int col0, int j, int e, int lane, int& i, int& key) {
    const int row = row0 + (lane >> 2) + 8 * (e >> 1), col = col0 + j * 8 + 2 * (lane & 3) + (e & 1);
    i = TRANSPOSED ? col : row;
    key = TRANSPOSED ? row : col;
  }

  __device__ __forceinline__ bool visible(int i, int key) const {
    return i < nq() && key < nk() && in_window(key, i + nk() - nq(), window_left(), window_right());
  }

  // Raw scores -> logits: the scale, ALiBi and bias passes (softcap is the caller's, as the backward
  // needs its derivative), then hidden keys -> -inf. Bias and mask are read only inside nq x nk.
  template <bool TRANSPOSED, int N>
  __device__ __forceinline__ void additive_and_hide(A (&s)[N][4], int row0, int col0, int lane, bool check) const {
    if (has_slope()) {
      // |i + nk - nq - key| as a float offset from this thread's first element: one add and one FMA
      // per element (exact: integers far below 2^24).
      int i0, key0;
      coords<TRANSPOSED>(row0, col0, 0, 0, lane, i0, key0);
      const A base = static_cast<A>(i0 + nk() - nq() - key0);
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int along_rows = 8 * (e >> 1), along_cols = j * 8 + (e & 1);
          const A step = TRANSPOSED ? static_cast<A>(along_cols - along_rows) : static_cast<A>(along_rows - along_cols);
          s[j][e] -= slope * abs_of(base + step);
        }
    }
    if (bias && !TRANSPOSED && !check && p.bias_pairs) {
      // Interior tile of a bias with unit column stride: each thread's two adjacent keys in one load.
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const i64 row = static_cast<i64>(row0 + g + 8 * r) * p.bias_stride[3] + col0 + 2 * t;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          A b0, b1;
          bias_pair(row + j * 8, b0, b1);
          s[j][2 * r] += add_scale * b0;
          s[j][2 * r + 1] += add_scale * b1;
        }
      }
    } else if (bias && TRANSPOSED && !check && p.bias_stride[4] == 1) {
      // Interior S^T tile (keys along rows, queries along columns) of a bias with unit column stride:
      // per thread, two key columns of the bias and queries a whole number of rows apart, so every
      // address is a base pointer plus multiples of the row stride (no per-element index math).
      const int g = lane >> 2, t = lane & 3;
      const i64 rs = p.bias_stride[3];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const i64 base = static_cast<i64>(col0 + 2 * t) * rs + row0 + g + 8 * r;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          s[j][2 * r] += add_scale * bias_at(base + j * 8 * rs);
          s[j][2 * r + 1] += add_scale * bias_at(base + (j * 8 + 1) * rs);
        }
      }
    } else if (bias) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int i, key;
          coords<TRANSPOSED>(row0, col0, j, e, lane, i, key);
          if (!check || (i < nq() && key < nk()))
            s[j][e] += add_scale * bias_at(i * p.bias_stride[3] + key * p.bias_stride[4]);
        }
    }
    hide<TRANSPOSED>(s, row0, col0, lane, check);
  }

  // Hidden keys -> -inf (or hidden: 0 for probabilities): outside nq x nk and the window band (when
  // check), or masked out.
  template <bool TRANSPOSED, int N>
  __device__ __forceinline__ void hide(A (&s)[N][4], int row0, int col0, int lane, bool check,
                                       A hidden = neg_inf()) const {
    if (check || mask) {
      // Mods::scalars works out the columns each of this thread's two rows sees once per tile
      // (visible_columns): col - first in [0, span] as unsigned numbers, one subtraction and one compare
      // per element. Mods::all tests visible() per element: its widest tiles have no registers for the
      // ranges (and its mask is read per element anyway).
      u32 first[2] = {0, 0}, span[2] = {~0u, ~0u};
      if (!ARRAYS && check) {
#pragma unroll
        for (int r = 0; r < 2; ++r) visible_columns<TRANSPOSED>(row0 + (lane >> 2) + 8 * r, first[r], span[r]);
      }
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          bool seen;
          if constexpr (ARRAYS) {
            int i, key;
            coords<TRANSPOSED>(row0, col0, j, e, lane, i, key);
            seen = !check || visible(i, key);
            if (mask && seen) seen = mask[i * p.mask_stride[3] + key * p.mask_stride[4]];
          } else {
            seen = static_cast<u32>(col0 + j * 8 + 2 * (lane & 3) + (e & 1)) - first[e >> 1] <= span[e >> 1];
          }
          if (!seen) s[j][e] = hidden;
        }
    }
  }

  // ALiBi folded into the softmax, for the warp-specialized forward (Mods::dense_scalars, its ALIBI
  // instantiation; rows not transposed). Over a tile that lies on one side of every row's diagonal position
  // i + off, -slope |i + off - j| = side * slope * (c_j - r_i), side = +1 where j <= i + off and -1 where
  // j >= i + off, with r_i = i + off - col0 and c_j = j - col0 in [0, N * 8): the column part is one FFMA
  // per score, fused with the exponent's scale, from this thread's slope * c_j (alibi_columns: the same for
  // every tile), and the row part comes back as shift[r], which OnlineSoftmax::update (SHIFTED) adds to the
  // tile's max and takes out of its reference. additive_and_hide spends an FADD and an FFMA per score on it,
  // and the exponent another FFMA. Scores come back in log2 units (exp_scale() applied), the row part left
  // out: the softmax's scale is then 1. A tile across the diagonal (side 0) takes |.| per score, shift 0.
  template <int N>
  __device__ __forceinline__ void alibi_columns(A (&cols)[N][2], int lane) const {
    const A slope_log2 = slope * exp_scale();
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) cols[j][c] = slope_log2 * static_cast<A>(j * 8 + 2 * (lane & 3) + c);
  }

  // cols may cover more n-tiles than s (a half-width block takes the first N).
  template <int N, int NC>
  __device__ __forceinline__ void alibi_log2(A (&s)[N][4], const A (&cols)[NC][2], int side, int row0, int col0,
                                             int lane, bool check, A (&shift)[2]) const {
    static_assert(MODS == Mods::dense_scalars, "the warp-specialized forward's scalars");
    static_assert(NC >= N, "a column term per n-tile");
    softcap_scores(s);
    const A scale = exp_scale(), slope_log2 = slope * scale;
    A r[2];  // r_i of this thread's two rows
#pragma unroll
    for (int h = 0; h < 2; ++h) r[h] = static_cast<A>(row0 + (lane >> 2) + 8 * h + nk() - nq() - col0);
    if (side > 0) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = fma_of(s[j][e], scale, cols[j][e & 1]);
#pragma unroll
      for (int h = 0; h < 2; ++h) shift[h] = -slope_log2 * r[h];
    } else if (side < 0) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = fma_of(s[j][e], scale, -cols[j][e & 1]);
#pragma unroll
      for (int h = 0; h < 2; ++h) shift[h] = slope_log2 * r[h];
    } else {
      // r_i - c_j from r_i less this thread's first column: one FADD of a constant per score.
      const A first = static_cast<A>(2 * (lane & 3));
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const A d = (r[e >> 1] - first) - static_cast<A>(j * 8 + (e & 1));
          s[j][e] = fma_of(s[j][e], scale, -slope_log2 * abs_of(d));
        }
      shift[0] = shift[1] = A(0);
    }
    hide<false>(s, row0, col0, lane, check);
  }

  // The columns [first, first + span] that row `row` of a tile sees through nq x nk and the window band
  // (visible() for a whole row): keys of query `row`, or queries of key `row` when TRANSPOSED. An empty
  // range comes back as first = 2^31, span = 0, which no column index reaches.
  template <bool TRANSPOSED>
  __device__ __forceinline__ void visible_columns(int row, u32& first, u32& span) const {
    const int offset = nk() - nq(), left = window_left(), right = window_right();
    const int rows = TRANSPOSED ? nk() : nq(), cols = TRANSPOSED ? nq() : nk();
    // query i sees keys [i + offset - left, i + offset + right]; key j is seen by queries
    // [j - offset - right, j - offset + left]
    const int lo_edge = TRANSPOSED ? right : left, hi_edge = TRANSPOSED ? left : right;
    const int shift = TRANSPOSED ? -offset : offset;
    const int lo = lo_edge < 0 ? 0 : max(0, row + shift - lo_edge);
    const int hi = hi_edge < 0 ? cols - 1 : min(cols - 1, row + shift + hi_edge);
    const bool empty = row >= rows || hi < lo;
    first = empty ? 0x80000000u : static_cast<u32>(lo);
    span = empty ? 0u : static_cast<u32>(hi - lo);
  }

  // The backward's softcap (capped: the caller's test of it): raw scores -> t = tanh(scale * raw / softcap)
  // over the tile, each element's t also handed to keep(j, e, t), which keeps the derivative 1 - t^2.
  template <int N, typename Keep>
  __device__ __forceinline__ void softcap_tile(A (&s)[N][4], bool capped, Keep keep) const {
    if (capped) {
      const SoftcapTanh<T, A> softcap(p);
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const A t = softcap.tanh_of(s[j][e]);
          s[j][e] = t;
          keep(j, e, t);
        }
    }
  }

  // Forward (and probs): raw scores -> what the online softmax takes with exp_scale().
  template <bool TRANSPOSED, int N>
  __device__ __forceinline__ void apply(A (&s)[N][4], int row0, int col0, int lane, bool check) const {
    if (capped()) {
      const SoftcapTanh<T, A> softcap(p);
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = softcap.tanh_of(s[j][e]);
    }
    additive_and_hide<TRANSPOSED>(s, row0, col0, lane, check);
  }

  // The score of raw score q_i . k_j in exp_scale()'s units (what apply() makes of it), or -inf when
  // hidden, one element at a time; dcap = 1 - tanh^2 of the softcap (1 without). Used by the backward when
  // it needs dS both with and without the softcap derivative (softcap and bias together), where the tile
  // passes would have to keep tanh per element.
  __device__ __forceinline__ A score(A raw, int i, int key, bool check, A& dcap) const {
    A x = raw;
    dcap = A(1);
    if (capped()) {
      const A t = SoftcapTanh<T, A>(p).tanh_of(raw);
      x = t;
      dcap = A(1) - t * t;
    }
    x -= slope * abs_of(static_cast<A>(i + nk() - nq() - key));
    if (check && !visible(i, key)) return neg_inf();
    if (mask && !mask[i * p.mask_stride[3] + key * p.mask_stride[4]]) return neg_inf();
    if (bias) x += add_scale * bias_at(i * p.bias_stride[3] + key * p.bias_stride[4]);
    return x;
  }

  // Backward over a tile: from raw S and dP, P = exp(s - lse) into s and the gradient of the scaled
  // score, dS times the softcap derivative 1 - tanh^2, into dp. dS itself (the bias gradient) goes
  // into dbias when write_dbias. lse_log2(j, e) and delta(j, e) give the element's row statistics.
  template <bool TRANSPOSED, int N, typename Lse, typename Delta>
  __device__ __forceinline__ void backward(A (&s)[N][4], A (&dp)[N][4], int row0, int col0, int lane, bool check,
                                           Lse lse_log2, Delta delta, bool write_dbias) const {
    write_dbias = write_dbias && dbias;
    const A cap = Reals<A>::softcap(p);
    if (cap > A(0) && write_dbias) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int i, key;
          coords<TRANSPOSED>(row0, col0, j, e, lane, i, key);
          A dcap;
          const A x = score(s[j][e], i, key, check, dcap);
          const A prob = fast_exp2(x * exp_scale() - lse_log2(j, e));
          const A ds = prob * (dp[j][e] - delta(j, e));
          if (x != neg_inf()) atomicAdd(dbias + i * p.dbias_stride[3] + key * p.dbias_stride[4], ds);
          s[j][e] = prob;
          dp[j][e] = ds * dcap;
        }
      return;
    }
    // Otherwise in passes: the softcap's tanh, then the rest.
    softcap_scores(s);
    backward_softcapped<TRANSPOSED>(s, dp, row0, col0, lane, check, lse_log2, delta, write_dbias);
  }

  // backward() in two halves: raw scores -> t = tanh(scale * raw / softcap) (nothing without a softcap),
  // which needs S alone (the pipelined dK/dV pass computes it while the tensor cores compute dP)...
  template <int N>
  __device__ __forceinline__ void softcap_scores(A (&s)[N][4]) const {
    softcap_tile(s, capped(), [](int, int, A) {});
  }

  // ... and from those scores (t with a softcap) and dP, backward()'s P into s and dS times the softcap
  // derivative into dp. With a softcap, dS * (1 - t^2) = P * ((dP - delta) * (1 - t^2)): the derivative
  // is folded into dp while t is still in s. (Without a softcap dp ends as dS itself.)
  template <bool TRANSPOSED, int N, typename Lse, typename Delta>
  __device__ __forceinline__ void backward_softcapped(A (&s)[N][4], A (&dp)[N][4], int row0, int col0, int lane,
                                                      bool check, Lse lse_log2, Delta delta, bool write_dbias) const {
    write_dbias = write_dbias && dbias;
    const A cap = Reals<A>::softcap(p);
    const bool store_pairs = !TRANSPOSED && p.dbias_pairs;  // the host never sets it with a softcap
    fold_derivative(s, dp, delta);
    additive_and_hide<TRANSPOSED>(s, row0, col0, lane, check);
    // One loop per case, not a select per element.
    if (cap > A(0))
      probs_and_dscores<true, TRANSPOSED>(s, dp, row0, col0, lane, lse_log2, delta, write_dbias && !store_pairs);
    else
      probs_and_dscores<false, TRANSPOSED>(s, dp, row0, col0, lane, lse_log2, delta, write_dbias && !store_pairs);
    if (write_dbias && store_pairs) store_dbias_pairs(dp, row0, col0, lane, check);
  }

  // With a softcap, dp -> (dP - delta) * (1 - t^2) from t in s (what dS times the derivative is P times).
  template <int N, typename Delta>
  __device__ __forceinline__ void fold_derivative(const A (&s)[N][4], A (&dp)[N][4], Delta delta) const {
    if (capped()) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] = (dp[j][e] - delta(j, e)) * (A(1) - s[j][e] * s[j][e]);
    }
  }

  // backward_softcapped() up to P, for the dK/dV pass (Mods::scalars), which issues dV += P^T dO before it
  // computes dS: from t (softcap_scores) and dP, P into s and dp folded (fold_derivative). dS times the
  // derivative is then s * dp with a softcap, s * (dp - delta) without.
  template <bool TRANSPOSED, int N, typename Lse, typename Delta>
  __device__ __forceinline__ void probs_folded(A (&s)[N][4], A (&dp)[N][4], int row0, int col0, int lane, bool check,
                                               Lse lse_log2, Delta delta) const {
    static_assert(!ARRAYS, "the scalars' instantiation");
    fold_derivative(s, dp, delta);
    additive_and_hide<TRANSPOSED>(s, row0, col0, lane, check);
    logits_to_probs(s, lse_log2);
  }

  // Logits (in exp_scale()'s units) -> P = exp(logit - lse).
  template <int N, typename Lse>
  __device__ __forceinline__ void logits_to_probs(A (&s)[N][4], Lse lse_log2) const {
    const A exp_scale_ = exp_scale();
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = fast_exp2(s[j][e] * exp_scale_ - lse_log2(j, e));
  }

  // backward_softcapped()'s last pass: logits -> P into s, and dS (CAPPED: dp already holds
  // (dP - delta) * (1 - t^2)) into dp, also added into dbias when atomic_dbias.
  template <bool CAPPED, bool TRANSPOSED, int N, typename Lse, typename Delta>
  __device__ __forceinline__ void probs_and_dscores(A (&s)[N][4], A (&dp)[N][4], int row0, int col0, int lane,
                                                    Lse lse_log2, Delta delta, bool atomic_dbias) const {
    const A exp_scale_ = exp_scale();
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const A prob = fast_exp2(s[j][e] * exp_scale_ - lse_log2(j, e));
        const A ds = CAPPED ? prob * dp[j][e] : prob * (dp[j][e] - delta(j, e));
        if (atomic_dbias && s[j][e] != neg_inf()) {
          int i, key;
          coords<TRANSPOSED>(row0, col0, j, e, lane, i, key);
          atomicAdd(dbias + i * p.dbias_stride[3] + key * p.dbias_stride[4], ds);
        }
        dp[j][e] = ds;
        s[j][e] = prob;
      }
  }

  // backward()'s part that needs S alone (Mods::scalars: no bias, so dS itself is never stored), for the
  // passes that compute it while the tensor cores still compute dP: P into s and the softcap derivative
  // 1 - t^2 into dcap (untouched without a softcap).
  template <bool TRANSPOSED, int N, typename Lse>
  __device__ __forceinline__ void probs_and_derivative(A (&s)[N][4], A (&dcap)[N][4], int row0, int col0, int lane,
                                                       bool check, Lse lse_log2) const {
    static_assert(!ARRAYS, "the scalars' instantiation");
    softcap_tile(s, capped(), [&](int j, int e, A t) { dcap[j][e] = A(1) - t * t; });
    additive_and_hide<TRANSPOSED>(s, row0, col0, lane, check);
    logits_to_probs(s, lse_log2);
  }

  // The dQ pass's form: P times the derivative (P without a softcap) into s, from which dS times the
  // derivative is s * (dP - delta) once dP has landed.
  template <int N, typename Lse>
  __device__ __forceinline__ void probs_times_derivative(A (&s)[N][4], int row0, int col0, int lane, bool check,
                                                         Lse lse_log2) const {
    A dcap[N][4];
    probs_and_derivative<false>(s, dcap, row0, col0, lane, check, lse_log2);
    if (capped()) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= dcap[j][e];
    }
  }

  // A bias broadcast along no dim gets each dS exactly once: plain stores of two adjacent keys in the
  // bias's dtype, no atomics, no accumulator buffer (hidden elements store their dS = 0). The host sets
  // dbias_pairs only with an even Nk, so a pair never straddles nk.
  template <int N>
  __device__ __forceinline__ void store_dbias_pairs(const A (&ds)[N][4], int row0, int col0, int lane,
                                                    bool check) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row0 + g + 8 * r;
      if (check && i >= nq()) continue;
      const i64 row = static_cast<i64>(i) * p.dbias_stride[3] + col0 + 2 * t;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (check && col0 + j * 8 + 2 * t >= nk()) continue;
        if constexpr (sizeof(T) != 4) {
          if (!p.dbias_f32) {
            Elem<T>::store2(reinterpret_cast<T*>(dbias) + row + j * 8, ds[j][2 * r], ds[j][2 * r + 1]);
            continue;
          }
        }
        *reinterpret_cast<float2*>(reinterpret_cast<float*>(dbias) + row + j * 8) =
            make_float2(ds[j][2 * r], ds[j][2 * r + 1]);
      }
    }
  }
};
