// row_block.cuh — the query rows one forward CTA (or warpgroup) owns, where its tensors start, and the
// key blocks those rows see (attention_fwd.cu, attention_fwd_ws.cu).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "mods.cuh"
#include "seq_info.cuh"
#include "mask.cuh"
#include "score_mods.cuh"

// The query rows [m0, m0 + BLOCK_M) of batch entry b that one CTA owns, where its tensors start, and the
// key blocks those rows see: [n_first, n_blocks), walked downwards with prev_on. k, v hold In elements
// (T's own, or for split float32 inputs their float16 pieces), q holds QIn (the float32 forward splits its
// own q tile), out holds Out (T, or the accumulator's float32 where the caller asks for unrounded results).
template <typename T, int NUM_WARPS, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, Mods MODS, typename In = T,
          typename QIn = In, typename Out = T>
struct RowBlock {
  using Element = T;
  using OutElement = Out;
  static constexpr bool HAS_MODS = MODS != Mods::none;
  const AttnParams& p;
  SeqInfo<may_be_packed(MODS)> seq;  // this batch entry's lengths and rows
  int m0;
  const QIn* q;  // row m0
  const In* k;
  const In* v;
  Out* out;       // row m0
  acc_t<T>* lse;  // row m0
  int n_first = 0, n_blocks, n_unmasked;
  int keys_end;  // one past the last key any of these rows sees (n_blocks' last block may end before it)
  // This entry's keys, and with the scalar modifiers the key blocks that need no bound checks, in
  // registers: seq.nk() reads shared memory with modifiers, and deriving the checks from it per tile put
  // that latency between each S and its softmax. (Mods::all keeps reading: its widest tiles have no
  // registers to spare.)
  int nk_;
  int n_free_first = 0, n_free_last = -1;
  static constexpr bool KEYS_IN_REGISTERS = MODS != Mods::all;
  Mask<IS_CAUSAL> mask;
  ScoreMods<T, MODS> mods;
  TileBitmap tile_bitmap;  // Mods::all's block-mask walk (see the constructor)

  // Every thread of the CTA constructs it (the block-mask bitmap is loaded cooperatively), after
  // checking m0 < seq.nq().
  __device__ __forceinline__ RowBlock(const AttnParams& params, int b, const SeqInfo<may_be_packed(MODS)>& seq_,
                                      int m0_, u32* bitmap_words)
      : p(params), seq(seq_), m0(m0_), mods(params, b) {
    q = static_cast<const QIn*>(p.q) + batch_offset(p.q_stride, b, p) + (seq.q_row + m0) * p.q_stride[3];
    k = static_cast<const In*>(p.k) + batch_offset(p.k_stride, b, p) + seq.k_row * p.k_stride[3];
    v = static_cast<const In*>(p.v) + batch_offset(p.v_stride, b, p) + seq.k_row * p.v_stride[3];
    out = static_cast<Out*>(p.out) + batch_offset(p.out_stride, b, p) + (seq.q_row + m0) * p.out_stride[3];
    lse = static_cast<acc_t<T>*>(p.lse) + seq.q_flat + m0;
    nk_ = seq.nk();
    const int offset = seq.causal_offset();
    mask = Mask<IS_CAUSAL>{nk_, offset};
    // Keys this row block can see: all of them, or up to the causal limit of its last row.
    const int key_end = IS_CAUSAL ? min(nk_, m0 + BLOCK_M + offset) : nk_;
    n_blocks = key_end > 0 ? ceil_div(key_end, BLOCK_N) : 0;
    keys_end = key_end;
    // Key blocks [0, n_unmasked) need no mask: fully inside nk and on or below every row's diagonal.
    n_unmasked = nk_ / BLOCK_N;
    if (IS_CAUSAL) n_unmasked = min(n_unmasked, max(0, m0 + offset + 1) / BLOCK_N);
    // With modifiers: only the key blocks of the window band, and of those only the ones the block mask
    // leaves on.
    if constexpr (HAS_MODS) {
      const int last_row = min(m0 + BLOCK_M, seq.nq()) - 1;
      const int k_first = mods.first_key(m0), k_last = mods.last_key(last_row);
      n_first = k_first / BLOCK_N;
      n_blocks = k_last >= k_first ? k_last / BLOCK_N + 1 : 0;
      keys_end = k_last + 1;
      if constexpr (KEYS_IN_REGISTERS)
        mods.template unchecked_key_blocks<BLOCK_N>(m0, m0 + BLOCK_M - 1, n_free_first, n_free_last);
      // The block mask: Mods::all only. (Walking it in the scalars' forward slowed the ALiBi and window
      // forwards: the host sends block-mask forwards to Mods::all, their backward to the scalars.)
      if constexpr (MODS == Mods::all)
        mods.template load_tile_bitmap<NUM_WARPS, true>(tile_bitmap, bitmap_words, b, m0);
    }
  }

  __device__ __forceinline__ int nk() const {
    if constexpr (KEYS_IN_REGISTERS) return nk_;
    return seq.nk();
  }

  // The last visible key block <= n_block, or n_first - 1 when none is left.
  __device__ __forceinline__ int prev_on(int n_block) const {
    if constexpr (MODS == Mods::all) n_block = mods.template prev_on<BLOCK_N>(tile_bitmap, n_block, n_first);
    return n_block;
  }

  // Whether key block n_block needs the modifiers' bound checks (KEYS_IN_REGISTERS: from the block range
  // the constructor found free of them).
  __device__ __forceinline__ bool needs_checks(int n_block) const {
    return n_block < n_free_first || n_block > n_free_last;
  }

  // Raw scores S of key block n_block, this warp's rows from row0 (CTA-relative) -> what the softmax
  // takes with exp_scale(): masked, or modified into the modifiers' score units (ScoreMods::exp_scale).
  template <int S_TILES>
  __device__ __forceinline__ void scores(acc_t<T> (&s)[S_TILES][4], int n_block, int row0, int lane) const {
    const int n0 = n_block * BLOCK_N;
    if constexpr (HAS_MODS) {
      const bool check =
          KEYS_IN_REGISTERS ? needs_checks(n_block) : mods.needs_bounds(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1);
      mods.template apply<false>(s, m0 + row0, n0, lane, check);
    } else if (n_block >= n_unmasked) {
      mask.apply(s, m0 + row0, n0, lane);
    }
  }
  // The bounded softcap's P of key block n_block (OnlineSoftmax::update_bounded from raw scores): hidden
  // keys' P -> 0, where scores() would have set their scores to -inf. With the scalar modifiers, whose only
  // per-score option with a softcap and no slopes is the window.
  template <int S_TILES>
  __device__ __forceinline__ void hide_probs(acc_t<T> (&s)[S_TILES][4], int n_block, int row0, int lane) const {
    static_assert(KEYS_IN_REGISTERS && HAS_MODS, "the scalars' bound checks");
    const bool check = needs_checks(n_block);
    mods.template hide<false>(s, m0 + row0, n_block * BLOCK_N, lane, check, acc_t<T>(0));
  }
  // scores() with the ALiBi slopes folded into the softmax (ScoreMods::alibi_log2, the warp-specialized
  // forward's ALIBI instantiation): which side of the rows' diagonal positions [m0, m0 + BLOCK_M) + off the
  // key block lies on, from the block's first and last rows, so the same for all its warps.
  template <int S_TILES, int COL_TILES>
  __device__ __forceinline__ void alibi_scores(acc_t<T> (&s)[S_TILES][4], int n_block, int row0, int lane,
                                               const acc_t<T> (&cols)[COL_TILES][2], acc_t<T> (&shift)[2]) const {
    static_assert(KEYS_IN_REGISTERS, "the scalars' bound checks");
    const int n0 = n_block * BLOCK_N, offset = nk_ - seq.nq();
    // A window whose right edge is the diagonal (causal) shows each row only keys j <= i + off, so every
    // block takes side 1 (the hidden keys' terms are thrown away); likewise side -1 with a left edge of 0.
    // That spares the blocks across the diagonal the |.| per score, and a causal tile's first block, the
    // diagonal one, is the one no product overlaps.
    const int side = mods.window_right() == 0 || n0 + BLOCK_N - 1 <= m0 + offset  ? 1
                     : mods.window_left() == 0 || n0 >= m0 + BLOCK_M - 1 + offset ? -1
                                                                                  : 0;
    const bool check = needs_checks(n_block);
    mods.alibi_log2(s, cols, side, m0 + row0, n0, lane, check, shift);
  }
  // lse of one warp's two accumulator rows, row0 + lane / 4 and 8 below it (CTA-relative), by the lanes
  // that hold them, within the sequence's rows.
  template <typename A>
  __device__ __forceinline__ void write_lse(int row0, const A (&row_lse)[2], int lane) const {
    if ((lane & 3) != 0) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + (lane >> 2) + 8 * r;
      if (m0 + row < seq.nq()) lse[row] = row_lse[r];
    }
  }
  // The exponent's scale: log2(e) times the scores' unit (the scale for raw scores, the softcap for
  // softcapped ones).
  __device__ __forceinline__ acc_t<T> exp_scale() const {
    return HAS_MODS ? mods.exp_scale() : Reals<acc_t<T>>::scale_log2(p);
  }
};
