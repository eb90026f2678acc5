// attention_bwd.cu — attention backward by recomputation: dq, dk, dv from dout, q, k, v, out, lse.
//
// Layout: as the forward (params.cuh); dq (b, nq, d), dk (b, nk, d), dv (b, nk, dv) contiguous (with
// variable-length sequences: (head, packed row, d), SeqInfo's q_flat / k_flat), of GradT: T, or float32 for 16-bit
// inputs whose caller asks for unrounded gradients (stored from the registers: a staging tile of T cannot hold
// them).
// Nothing of size nq x nk is stored: P is rebuilt tile by tile from the saved lse,
// P_ij = exp(scale * q_i . k_j - lse_i). Three launches, no atomics, so results are
// bitwise reproducible:
//  1. preprocess:  delta_i = rowsum(dout_i * out_i) and lse_log2_i = lse_i * log2(e) (workspace, O(nq)).
//  2. dK/dV pass:  one CTA per block of 16 * NUM_WARPS keys streams all query blocks:
//                  S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - delta),
//                  dK += dS^T Q; dK is scaled once at the end.
//  3. dQ pass:     one CTA per block of 16 * NUM_WARPS queries streams all key blocks:
//                  S = Q K^T, P, dP = dO V^T, dS = P * (dP - delta), dQ += dS K.
//                  (The host runs it beside the dK/dV pass, on a second stream: they share no output.)
// P^T and dS^T (or P and dS) go from the accumulator registers straight into the next product.
// Head dims above 128 divide the gradient columns into D_CHUNK-wide CTAs (grid x) so the
// accumulators fit in registers; each chunk recomputes the same S and dP. PAIRED dK/dV passes (plain and
// causal, where the tile table marks them) instead give each 16 keys a pair of warps that share the work
// without repeating any:
// one computes S^T, P^T (handed to its partner through shared memory) and dV += P^T dO, the other dP^T,
// dS^T and dK += dS^T Q, each holding one gradient: at D = 128 four products where chunking takes six
// (wider heads may still chunk their columns, each pair's chunk holding half the registers).
// Everything runs in the accumulator type A = acc_t<T>: float, or double for float64 inputs (whose
// lse, delta and lse_log2 are float64 too).
// Long sequences: the tensor cores' float32 accumulation truncates, so one accumulator chain over
// millions of rows drifts by percents. Each launch sums over [stream_begin, stream_end) of its streamed
// axis only; the host cuts sequences longer than CHAIN_ROWS into such launches and adds their results
// in the accumulator type.
// WGMMA instantiations (Hopper, fp16/bf16) run the same passes on warpgroup products from swizzled tiles
// (gemm.cuh): each warp still owns 16 rows, now of its warpgroup's 64, in the same accumulator layout.
// Their plain, causal and scalar-modifier passes (PIPELINED) issue S and dP together, compute P while
// the tensor cores compute dP, and leave the gradient products in flight while the next tile's S and dP
// are issued, so the tensor cores wait on neither the elementwise work nor the loop's turn.
// float32 WGMMA instantiations (PIECES: plain and causal) read q, k, v, dout as float16 pieces hi + lo
// scaled by a power of two per row block (split_f32.cu, pieces.cuh): S and dP take three float16 products
// each, and the products with P^T or dS (split per row in registers) go into fresh accumulators that are
// added to dV, dK, dQ in registers; the powers of two come out per tile, in the softmax's scale, in dP
// before dS, and in those additions (the streamed tile's) or the final scales (the CTA's own rows). The
// preprocess reads out and dout themselves.
// MODS instantiations (HAS_MODS; IS_CAUSAL = false, causality is the window's right edge, except in
// Mods::softcap, which takes it as the plain kernels do) rebuild the modified logits (score_mods.cuh), skip
// the tiles the window band or the block mask hide, and compute dP before S so that each element's P, dS
// and softcap derivative 1 - tanh^2 come out of one pass.
// The bias gradient dS is added (atomics in the accumulator type) into a zeroed buffer of the bias's own
// shape by the dQ pass, the first chunk of columns only; broadcast bias dims have stride 0 there, so
// the adds sum over them. The atomics are the one thing here whose order can vary between runs.
// HAS_DROPOUT instantiations regenerate the keep mask Z of each tile (dropout.cuh) and use
// dP' = Z * dP / (1 - p) in place of dP (delta = rowsum(dout * out) already holds the dropout), so
// dS = P * (dP' - delta); the dK/dV pass also feeds P * Z into dV, scaled by 1 / (1 - p) at the end.
// Without modifiers both passes carry (1 - p) dS = P * (Z * dP - (1 - p) delta) and put 1 / (1 - p) into
// dK's and dQ's final scales (DS_UNSCALED).
#include "common.cuh"
#include "params.cuh"
#include "mods.cuh"
#include "seq_info.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "score_mods.cuh"
#include "dropout.cuh"
#include "transposed_scores.cuh"

// delta_i = rowsum(dout_i * out_i). LANES lanes share a row (32 / LANES rows per warp), each reading
// 16-byte chunks of both: the rows are 16-byte aligned and d_v is a whole number of chunks (the host
// pads the rows with zeros: _cuda/params.py, kernel_ready), so a 128-wide bf16 row is one load of each per lane:
// this pass is memory-bound, and an element per lane left it at half the DRAM bandwidth
// (docs/design/backward.md).
template <typename T, int NUM_WARPS, int LANES>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, 1) attention_bwd_preprocess_kernel(const AttnParams p) {
  constexpr int VEC = 16 / sizeof(T);  // elements per chunk
  static_assert(LANES >= 1 && LANES <= WARP_SIZE && WARP_SIZE % LANES == 0, "lanes per row");
  const int b = batch_index();
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int row = (blockIdx.x * NUM_WARPS + warp) * (WARP_SIZE / LANES) + lane / LANES;
  if (b >= p.batch) return;
  const SeqInfo<true> seq(p, b);      // one instantiation serves every variant: no registers to save here
  const bool valid = row < seq.nq();  // (no return before the shuffles: the row's lanes sum together)
  using A = acc_t<T>;
  A dot = A(0);
  if (valid) {
    const T* out =
        static_cast<const T*>(p.out) + batch_offset(p.out_stride, b, p) + (seq.q_row + row) * p.out_stride[3];
    const T* dout =
        static_cast<const T*>(p.dout) + batch_offset(p.dout_stride, b, p) + (seq.q_row + row) * p.dout_stride[3];
#pragma unroll 1  // (unrolled, float and double rows took 144 registers: one CTA per SM)
    for (int c = (lane % LANES) * VEC; c < p.d_v; c += LANES * VEC) {
      const uint4 o4 = *reinterpret_cast<const uint4*>(out + c), d4 = *reinterpret_cast<const uint4*>(dout + c);
      const T* o = reinterpret_cast<const T*>(&o4);
      const T* d = reinterpret_cast<const T*>(&d4);
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += Elem<T>::to_acc(o[e]) * Elem<T>::to_acc(d[e]);
    }
  }
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (valid && lane % LANES == 0) {
    const i64 i = seq.q_flat + row;
    const A lse = static_cast<const A*>(p.lse)[i];
    static_cast<A*>(p.delta)[i] = dot;
    // A row that saw no key has lse = -inf; +inf here makes every recomputed P of it exactly 0.
    static_cast<A*>(p.lse_log2)[i] = lse == neg_inf() ? A(pos_inf()) : lse * log2e<A>();
  }
}

// PAIRED: one warp's accumulator tile to its partner through shared memory, element [j][e] of lane l at
// (j * 4 + e) * 32 + l: both warps hold the same positions, so each lane reads what its twin wrote.
template <int N_TILES, typename A>
__device__ __forceinline__ void tile_to_smem(A* dst, const A (&x)[N_TILES][4], int lane) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[(j * 4 + e) * WARP_SIZE + lane] = x[j][e];
}
template <int N_TILES, typename A>
__device__ __forceinline__ void tile_from_smem(A (&x)[N_TILES][4], const A* src, int lane) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[j][e] = src[(j * 4 + e) * WARP_SIZE + lane];
}

// The dropout dK/dV pass's dS, with the keep mask Z (keep_cols' bits) applied once, to P^T, which dV then
// takes as it is: (1 - p) dS^T = (Z P^T) dP^T - P^T (1 - p) delta in place in dp (delta_kept: (1 - p) delta,
// indexed along the columns) and P^T -> Z P^T in place in prob.
template <int N_TILES, typename A>
__device__ __forceinline__ void dscores_kept_cols(A (&dp)[N_TILES][4], A (&prob)[N_TILES][4], u64 keep,
                                                  const A* delta_kept, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const A kept = (keep >> (4 * j + e)) & 1u ? prob[j][e] : A(0);
      dp[j][e] = kept * dp[j][e] - prob[j][e] * delta_kept[j * 8 + 2 * t + (e & 1)];
      prob[j][e] = kept;
    }
  }
}

template <typename T, int HEAD_DIM, int NUM_WARPS, int BLOCK_M, int D_CHUNK, bool IS_CAUSAL, Mods MODS, bool WGMMA,
          bool HAS_DROPOUT, bool PAIRED, bool PIPELINED, bool ACROSS_TURN, bool LSE_BY_COPY, typename GradT>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, 1) attention_bwd_dkdv_kernel(const AttnParams p) {
  constexpr bool HAS_MODS = MODS != Mods::none;
  constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  constexpr int BLOCK_N = (PAIRED ? 8 : 16) * NUM_WARPS;  // keys of this CTA, 16 per warp (PAIRED: per pair)
  // PIECES: float32 on the wgmma path, q, k, v, dout as float16 pieces (split_f32.cu): rows [hi | lo].
  constexpr bool PIECES = WGMMA && sizeof(T) == 4;
  using E = typename Select<PIECES, half_t, T>::type;  // the shared tiles' elements
  constexpr int COLS = PIECES ? 2 * HEAD_DIM : HEAD_DIM;
  using KVTile = SmemTile<E, BLOCK_N, COLS, WGMMA>;
  using QTile = SmemTile<E, BLOCK_M, COLS, WGMMA>;        // the streamed q and dout tiles
  using OutTile = SmemTile<T, BLOCK_N, HEAD_DIM, WGMMA>;  // stages dk, dv at the end, in sK, sV
  constexpr int S_TILES = BLOCK_M / 8;                    // S^T tile: 16 keys x BLOCK_M queries per warp
  constexpr int G_TILES = D_CHUNK / 8;                    // gradient columns per CTA
  constexpr int N_CHUNKS = HEAD_DIM / D_CHUNK;
  static_assert(HEAD_DIM % D_CHUNK == 0 && D_CHUNK % 16 == 0, "gradient column chunks");
  static_assert(!(HAS_MODS && IS_CAUSAL) || MODS == Mods::softcap, "with modifiers, causal is the window's right edge");
  static_assert(BLOCK_MASK_TILE % BLOCK_M == 0 && BLOCK_MASK_TILE % BLOCK_N == 0, "tiles inside block-mask tiles");
  static_assert(!WGMMA || ((sizeof(T) == 2 || PIECES) && NUM_WARPS % 4 == 0),
                "wgmma: 16-bit or float32 (pieces) inputs, whole warpgroups");
  static_assert(!PAIRED || (!HAS_MODS && !HAS_DROPOUT && NUM_WARPS % (WGMMA ? 8 : 2) == 0),
                "paired warps: plain or causal passes, whole pairs of warps (of warpgroups with wgmma)");
  static_assert(!PIECES || (!HAS_MODS && !HAS_DROPOUT && !PAIRED && HEAD_DIM % 64 == 0 && D_CHUNK % 64 == 0),
                "pieces: plain or causal, lo pieces and column chunks on (64-element) atom boundaries");
  static_assert(OutTile::SIZE * sizeof(T) <= KVTile::SIZE * sizeof(E), "dk, dv staged in sK, sV");
  static_assert(sizeof(GradT) == sizeof(T) || (sizeof(T) == 2 && sizeof(GradT) == 4), "dk, dv: T, or float32");
  static_assert(!PIECES || (SPLIT_BLOCK_ROWS % BLOCK_M == 0 && SPLIT_BLOCK_ROWS % BLOCK_N == 0),
                "pieces: each tile inside one row block");
  using A = acc_t<T>;  // float; double for float64 inputs
  // PIPELINED (the tile table's p): the products stay in flight two or three at a time (the loop below);
  // ACROSS_TURN (a): across the loop's turn too, where the registers hold the next tile's S^T and dP^T
  // beside the operands of dV and dK in flight. The table sets them where they compile without spills or
  // serialized products.
  static_assert(!PIPELINED || (WGMMA && !PIECES && !PAIRED && !HAS_DROPOUT && MODS != Mods::all),
                "products in flight: 16-bit wgmma passes, plain, causal or the scalars, without dropout");
  static_assert(!ACROSS_TURN || PIPELINED, "across the turn: a pipelined pass");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sK = reinterpret_cast<E*>(WGMMA ? smem_aligned(smem_raw) : smem_raw);
  E* sV = sK + KVTile::SIZE;
  E* sQ = sV + KVTile::SIZE;                              // [2] QTile, double-buffered stream
  E* sdO = sQ + 2 * QTile::SIZE;                          // [2] QTile
  A* sLse = reinterpret_cast<A*>(sdO + 2 * QTile::SIZE);  // [2][BLOCK_M]
  A* sDelta = sLse + 2 * BLOCK_M;                         // [2][BLOCK_M]
  A* sP = sDelta + 2 * BLOCK_M;                           // PAIRED: [NUM_WARPS / 2][S_TILES * 4][32], P^T per pair

  const int b = batch_index();
  if (b >= p.batch) return;
  const int c0 = (blockIdx.x % N_CHUNKS) * D_CHUNK;
  const int n0 = (blockIdx.x / N_CHUNKS) * BLOCK_N;
  const SeqInfo<may_be_packed(MODS)> seq(p, b);
  if (n0 >= seq.nk()) return;  // past a shorter sequence's end (variable-length batches)
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int offset = seq.causal_offset();
  // This warp's 16 keys from row0 of the CTA's; PAIRED: role 0 (S, P, dV) or 1 (dP, dS, dK) of its pair,
  // whose partner is the next warp, or with wgmma the same warp of the next warpgroup (products are
  // warpgroup-wide, so a role is too).
  constexpr int TWIN = WGMMA ? 4 : 1;
  const int pair = PAIRED ? (warp / (2 * TWIN)) * TWIN + warp % TWIN : warp;
  const int row0 = pair * 16;
  const int role = PAIRED ? (warp / TWIN) & 1 : 0;
  A* sP_pair = sP + pair * (S_TILES * 4 * WARP_SIZE);

  const E* q = static_cast<const E*>(p.q) + batch_offset(p.q_stride, b, p) + seq.q_row * p.q_stride[3];
  const E* k = static_cast<const E*>(p.k) + batch_offset(p.k_stride, b, p) + (seq.k_row + n0) * p.k_stride[3];
  const E* v = static_cast<const E*>(p.v) + batch_offset(p.v_stride, b, p) + (seq.k_row + n0) * p.v_stride[3];
  const E* dout = static_cast<const E*>(p.dout) + batch_offset(p.dout_stride, b, p) + seq.q_row * p.dout_stride[3];
  // Columns to read (pieces: whole rows, padded with zeros), where the loads use them.
  auto qk_cols = [&]() { return PIECES ? COLS : p.d_qk; };
  auto v_cols = [&]() { return PIECES ? COLS : p.d_v; };
  const Pieces<PIECES> pieces(p, b);
  const PieceFactors kv_factors = pieces.at(n0);  // of this CTA's k and v rows
  const A* lse_log2 = static_cast<const A*>(p.lse_log2) + seq.q_flat;
  const A* delta = static_cast<const A*>(p.delta) + seq.q_flat;
  const Dropout dropout(p, b);
  // DS_UNSCALED (dropout without modifiers): the passes carry (1 - p) dS = P * (Z * dP - (1 - p) delta)
  // instead of dS, and dK's final scale takes the 1 / (1 - p): the keep test then needs no multiply per
  // element. (The modifiers' passes keep dS itself: the dQ pass adds it into dbias.)
  constexpr bool DS_UNSCALED = HAS_DROPOUT && !HAS_MODS;
  const A delta_scale = DS_UNSCALED ? A(1) / Reals<A>::dropout_scale(p) : A(1);
  // LSE_BY_COPY (the tile table's c): lse and delta reach shared memory by cp.async (load_stream) rather than
  // through registers; not where delta needs that scale, nor where the copies made the pass spill.
  static_assert(!(LSE_BY_COPY && DS_UNSCALED), "lse and delta by copy: delta without dropout's scale");

  // Only query rows i with i + nk - nq >= n0 see a key of this block under the causal mask.
  int m_first = IS_CAUSAL ? max(0, n0 - offset) / BLOCK_M : 0;
  int m_blocks = ceil_div(seq.nq(), BLOCK_M);
  const Mask<IS_CAUSAL> mask{seq.nk(), offset};
  // With modifiers: the query blocks of the window band whose block-mask tile is on (next_on).
  const ScoreMods<T, MODS, IS_CAUSAL> mods(p, b);
  if constexpr (HAS_MODS) {
    const int i_first = mods.first_query(n0), i_last = mods.last_query(min(n0 + BLOCK_N, seq.nk()) - 1);
    m_first = i_first / BLOCK_M;
    m_blocks = i_last >= i_first ? i_last / BLOCK_M + 1 : 0;
  }
  m_first = max(m_first, p.stream_begin / BLOCK_M);  // this launch's part of the queries
  m_blocks = min(m_blocks, ceil_div(p.stream_end, BLOCK_M));
  // The pipelined Mods::scalars pass: the query blocks that need no bound checks, worked out once (as the
  // dQ pass does).
  int m_free_first = 0, m_free_last = -1;
  if constexpr (PIPELINED && HAS_MODS)
    mods.template unchecked_query_blocks<BLOCK_M>(n0, n0 + BLOCK_N - 1, m_free_first, m_free_last);
  TileBitmap own_bitmap;  // Mods::all's; Mods::scalars use the shared one
  TileBitmap& tile_bitmap = tile_bitmap_for<MODS>(own_bitmap);
  if constexpr (HAS_MODS) {
    __shared__ u32 bitmap_words[TILE_BITMAP_WORDS];
    mods.template load_tile_bitmap<NUM_WARPS, false>(tile_bitmap, bitmap_words, b, n0);
  }
  auto next_on = [&](int m_block) {
    if constexpr (HAS_MODS) m_block = mods.template next_on<BLOCK_M>(tile_bitmap, m_block, m_blocks);
    return m_block;
  };

  auto load_stream = [&](int m_block, int buf) {
    const int m0 = m_block * BLOCK_M;
    load_tile_async<QTile, THREADS, true>(sQ + buf * QTile::SIZE, q + m0 * p.q_stride[3], p.q_stride[3], seq.nq() - m0,
                                          qk_cols());
    load_tile_async<QTile, THREADS, true>(sdO + buf * QTile::SIZE, dout + m0 * p.dout_stride[3], p.dout_stride[3],
                                          seq.nq() - m0, v_cols());
    if constexpr (!LSE_BY_COPY) {
      for (int i = threadIdx.x; i < BLOCK_M; i += THREADS) {
        const bool valid = m0 + i < seq.nq();  // rows past nq: P = 0 through lse = +inf
        sLse[buf * BLOCK_M + i] = valid ? lse_log2[m0 + i] : pos_inf();
        sDelta[buf * BLOCK_M + i] = valid ? delta[m0 + i] * delta_scale : A(0);
      }
    } else {
      // lse and delta copied like the tiles, so no thread waits on global memory here (plain loads put
      // that wait into the loop of the warps that stored them). Rows past nq get lse = delta = 0: their q
      // and dout rows are zeros, so S^T = dP^T = 0 there, P^T = 1 meets a zero dout row in dV, and dS^T = 0.
      for (int i = threadIdx.x; i < 2 * BLOCK_M; i += THREADS) {
        const bool is_delta = i >= BLOCK_M;
        const int r = is_delta ? i - BLOCK_M : i;
        cp_async_small<sizeof(A)>(smem_u32((is_delta ? sDelta : sLse) + buf * BLOCK_M + r),
                                  (is_delta ? delta : lse_log2) + m0 + r, m0 + r < seq.nq());
      }
    }
  };

  load_tile_async<KVTile, THREADS, true>(sK, k, p.k_stride[3], seq.nk() - n0, qk_cols());
  load_tile_async<KVTile, THREADS, true>(sV, v, p.v_stride[3], seq.nk() - n0, v_cols());
  int m_block = next_on(m_first);
  if (m_block < m_blocks) load_stream(m_block, 0);
  cp_async_commit();

  // PAIRED: acc_dk holds this warp's one gradient, dV (role 0) or dK (role 1); acc_dv is unused.
  A acc_dk[G_TILES][4], acc_dv[PAIRED ? 1 : G_TILES][4];
  if constexpr (PIPELINED) {
    // S^T_i = K Q_i^T and dP^T_i = V dO_i^T go to the tensor cores right behind the previous tile's dV and
    // dK products, without waiting for them. What needs S^T alone (P^T; with modifiers the softcap's tanh)
    // runs while they compute dP^T; dV += P^T dO_i is issued as soon as P^T is packed, dK += dS^T Q_i
    // right behind it. Q_{i+1} and dO_{i+1} are copied meanwhile into the buffer the previous tile's
    // products read. The first products overwrite dV and dK (zeroed registers would have made ptxas
    // serialize the products: C7515).
    u32 p_frag[S_TILES / 2][4], ds_frag[S_TILES / 2][4];
    bool first = true;
    for (int buf = 0; m_block < m_blocks; buf ^= 1) {
      const int m0 = m_block * BLOCK_M;
      cp_async_wait<0>();
      smem_publish<QTile>();
      __syncthreads();
      const E* sQ_i = sQ + buf * QTile::SIZE;
      const E* sdO_i = sdO + buf * QTile::SIZE;
      A acc_s[S_TILES][4], acc_dp[S_TILES][4];
      wg_issue_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, sK, (warp * 16) & ~63, sQ_i);
      wg_issue_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, sV, (warp * 16) & ~63, sdO_i);
      wgmma_wait<1>();  // S^T_i, and the previous tile's dV and dK before it
      fence_operands(acc_s);
      fence_operands(acc_dv);
      fence_operands(acc_dk);
      fence_fragments(p_frag);
      fence_fragments(ds_frag);
      __syncthreads();  // every warp is done with buffer buf ^ 1
      const int m_next = next_on(m_block + 1);
      if (m_next < m_blocks) {
        load_stream(m_next, buf ^ 1);
        cp_async_commit();
      }
      if constexpr (HAS_MODS) {
        // The softcap's tanh while dP^T is computed; P^T and dP^T folded with the derivative once it has
        // landed (the derivative's own tile of registers made these tiles spill), then dV, then dS^T.
        mods.softcap_scores(acc_s);
        wgmma_wait<0>();
        fence_operands(acc_dp);
        const A* lse_i = sLse + buf * BLOCK_M;
        const A* delta_i = sDelta + buf * BLOCK_M;
        const int t = lane & 3;
        mods.template probs_folded<true>(
            acc_s, acc_dp, n0 + warp * 16, m0, lane, m_block < m_free_first || m_block > m_free_last,
            [&](int j, int e) { return lse_i[j * 8 + 2 * t + (e & 1)]; },
            [&](int j, int e) { return delta_i[j * 8 + 2 * t + (e & 1)]; });
        pack_fragments<T>(acc_s, p_frag);
        wg_issue_pb<T, S_TILES / 2, G_TILES, QTile>(acc_dv, p_frag, sdO_i, c0, !first);
        if (mods.capped()) {
#pragma unroll
          for (int j = 0; j < S_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[j][e] *= acc_s[j][e];
        } else {
          dscores_cols(acc_dp, acc_s, delta_i, lane);
        }
      } else {
        if (IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + offset) mask.apply_transposed(acc_s, n0 + warp * 16, m0, lane);
        probs_from_scores_cols(acc_s, sLse + buf * BLOCK_M, Reals<A>::scale_log2(p), lane);
        pack_fragments<T>(acc_s, p_frag);
        wg_issue_pb<T, S_TILES / 2, G_TILES, QTile>(acc_dv, p_frag, sdO_i, c0, !first);
        wgmma_wait<1>();  // dP^T_i has landed; dV may still run
        fence_operands(acc_dp);
        dscores_cols(acc_dp, acc_s, sDelta + buf * BLOCK_M, lane);
      }
      pack_fragments<T>(acc_dp, ds_frag);
      wg_issue_pb<T, S_TILES / 2, G_TILES, QTile>(acc_dk, ds_frag, sQ_i, c0, !first);
      if constexpr (!ACROSS_TURN) wgmma_wait<0>();
      first = false;
      m_block = m_next;
    }
    wgmma_wait<0>();
    fence_operands(acc_dv);
    fence_operands(acc_dk);
    fence_fragments(p_frag);
    fence_fragments(ds_frag);
    if (first) {  // no query block to visit
      zero_acc(acc_dk);
      zero_acc(acc_dv);
    }
  } else {
    zero_acc(acc_dk);
    zero_acc(acc_dv);
    for (int buf = 0; m_block < m_blocks; buf ^= 1) {
      const int m0 = m_block * BLOCK_M;
      const int m_next = next_on(m_block + 1);
      if (m_next < m_blocks) {
        load_stream(m_next, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      smem_publish<QTile>();
      __syncthreads();
      const E* sQ_i = sQ + buf * QTile::SIZE;
      const E* sdO_i = sdO + buf * QTile::SIZE;
      const PieceFactors q_factors = pieces.at(m0);  // of Q_i and dO_i

      A acc_s[S_TILES][4], acc_dp[S_TILES][4];
      if constexpr (PIECES) {
        // S^T = K Q_i^T, P^T = exp(scale * S^T - lse) (S^T carries 2^(e_q + e_k)); dV += P^T dO_i (carrying
        // 2^e_dout); dP^T = V dO_i^T (carrying 2^(e_v + e_dout)), dS^T = P^T * (dP^T - delta); dK += dS^T Q_i
        // below (carrying 2^e_q).
        gemm_abt_pieces<HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, sK, warp * 16, sQ_i);
        if (IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + offset) mask.apply_transposed(acc_s, n0 + warp * 16, m0, lane);
        probs_from_scores_cols(acc_s, sLse + buf * BLOCK_M, Reals<A>::scale_log2(p) * (q_factors.q * kv_factors.k),
                               lane);
        gemm_pb_pieces<HEAD_DIM, S_TILES, G_TILES, QTile>(acc_dv, acc_s, sdO_i, c0, q_factors.dout);
        gemm_abt_pieces<HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, sV, warp * 16, sdO_i);
        dscores_cols(acc_dp, acc_s, sDelta + buf * BLOCK_M, lane,
                     q_factors.dout * kv_factors.v);  // dP^T unscaled on the way
      } else if constexpr (PAIRED) {
        if (role == 0) {  // S^T = K Q_i^T, P^T = exp(scale * S^T - lse), to the partner too
          gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, sK, row0, sQ_i, lane);
          if (IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + offset) mask.apply_transposed(acc_s, n0 + row0, m0, lane);
          probs_from_scores_cols(acc_s, sLse + buf * BLOCK_M, Reals<A>::scale_log2(p), lane);
          tile_to_smem(sP_pair, acc_s, lane);
        } else {  // dP^T = V dO_i^T
          gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, sV, row0, sdO_i, lane);
        }
        __syncthreads();  // P^T has reached the partners
        if (role == 0) {  // dV += P^T dO_i
          gemm_pb<T, S_TILES, G_TILES, QTile>(acc_dk, acc_s, sdO_i, c0, lane);
        } else {  // dS^T = P^T * (dP^T - delta);  dK += dS^T Q_i
          tile_from_smem(acc_s, sP_pair, lane);
          dscores_cols(acc_dp, acc_s, sDelta + buf * BLOCK_M, lane);
          gemm_pb<T, S_TILES, G_TILES, QTile>(acc_dk, acc_dp, sQ_i, c0, lane);
        }
      } else if constexpr (HAS_MODS) {
        // dP^T = V dO_i^T and S^T = K Q_i^T first; then per element the logit, P^T = exp(logit - lse),
        // dS^T = P^T * (dP^T - delta) times the softcap derivative.
        gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, sV, warp * 16, sdO_i, lane);
        gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, sK, warp * 16, sQ_i, lane);
        u64 keep = 0;
        if constexpr (HAS_DROPOUT) {  // dP^T -> Z * dP^T / (1 - p)
          keep = dropout.keep_cols<S_TILES, sizeof(T) == 2 ? S_TILES / 2 : 1>(n0 + warp * 16, m0, lane);
          apply_keep(acc_dp, keep, Reals<A>::dropout_scale(p));
        }
        // The tile is S^T: queries along the columns, their lse and delta in shared memory.
        const A* lse_i = sLse + buf * BLOCK_M;
        const A* delta_i = sDelta + buf * BLOCK_M;
        const int t = lane & 3;
        mods.template backward<true>(
            acc_s, acc_dp, n0 + warp * 16, m0, lane, mods.needs_bounds(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1),
            [&](int j, int e) { return lse_i[j * 8 + 2 * t + (e & 1)]; },
            [&](int j, int e) { return delta_i[j * 8 + 2 * t + (e & 1)]; }, false);
        if constexpr (HAS_DROPOUT) apply_keep(acc_s, keep);
        // dV += (Z * P^T) dO_i
        gemm_pb<T, S_TILES, G_TILES, QTile>(acc_dv, acc_s, sdO_i, c0, lane);
      } else {
        // S^T = K Q_i^T, then P^T = exp(scale * S^T - lse)
        gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, sK, warp * 16, sQ_i, lane);
        if (IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + offset) mask.apply_transposed(acc_s, n0 + warp * 16, m0, lane);
        probs_from_scores_cols(acc_s, sLse + buf * BLOCK_M, Reals<A>::scale_log2(p), lane);

        if constexpr (HAS_DROPOUT) {
          // dP^T = V dO_i^T;  (1 - p) dS^T = (Z P^T) dP^T - P^T (1 - p) delta;  dV += (Z P^T) dO_i
          gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, sV, warp * 16, sdO_i, lane);
          const u64 keep = dropout.keep_cols<S_TILES, sizeof(T) == 2 ? S_TILES / 2 : 1>(n0 + warp * 16, m0, lane);
          if constexpr (sizeof(T) == 8) {  // float64: Z applied twice, one step at a time (sm_90 spilled fused)
            apply_keep(acc_dp, keep);
            dscores_cols(acc_dp, acc_s, sDelta + buf * BLOCK_M, lane);
            apply_keep(acc_s, keep);
          } else {
            dscores_kept_cols(acc_dp, acc_s, keep, sDelta + buf * BLOCK_M, lane);
          }
          gemm_pb<T, S_TILES, G_TILES, QTile>(acc_dv, acc_s, sdO_i, c0, lane);
        } else {
          // dV += P^T dO_i
          gemm_pb<T, S_TILES, G_TILES, QTile>(acc_dv, acc_s, sdO_i, c0, lane);

          // dP^T = V dO_i^T;  dS^T = P^T * (dP^T - delta)
          gemm_abt<T, HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, sV, warp * 16, sdO_i, lane);
          dscores_cols(acc_dp, acc_s, sDelta + buf * BLOCK_M, lane);
        }
      }

      // dK += dS^T Q_i
      if constexpr (PIECES)
        gemm_pb_pieces<HEAD_DIM, S_TILES, G_TILES, QTile>(acc_dk, acc_dp, sQ_i, c0, q_factors.q);
      else if constexpr (!PAIRED)
        gemm_pb<T, S_TILES, G_TILES, QTile>(acc_dk, acc_dp, sQ_i, c0, lane);
      __syncthreads();  // this buffer (and PAIRED's P^T) is refilled two iterations on
      m_block = m_next;
    }
  }

  // dK = scale * dS^T Q (DS_UNSCALED: scale / (1 - p) times the sum of (1 - p) dS^T Q), dV = (Z * P^T) dO /
  // (1 - p); staged through sK / sV for 16-byte stores.
  const A dv_scale = HAS_DROPOUT ? Reals<A>::dropout_scale(p) : A(1);
  const A dk_factor = Reals<A>::scale(p) * (DS_UNSCALED ? dv_scale : A(1));
  const A dk_scale[2] = {dk_factor, dk_factor};
  const A dv_scales[2] = {dv_scale, dv_scale};
  cp_async_wait<0>();                          // with no query block to visit, the K/V copies may still be in flight
  if constexpr (sizeof(GradT) != sizeof(T)) {  // unrounded: from the registers
    GradT* dk = static_cast<GradT*>(p.dk) + (seq.k_flat + n0) * p.d_qk + c0;
    GradT* dv = static_cast<GradT*>(p.dv) + (seq.k_flat + n0) * p.d_v + c0;
    if constexpr (PAIRED) {
      if (role == 0)
        acc_to_gmem<G_TILES>(dv, p.d_v, row0, acc_dk, dv_scales, lane, seq.nk() - n0, p.d_v - c0);
      else
        acc_to_gmem<G_TILES>(dk, p.d_qk, row0, acc_dk, dk_scale, lane, seq.nk() - n0, p.d_qk - c0);
    } else {
      acc_to_gmem<G_TILES>(dk, p.d_qk, row0, acc_dk, dk_scale, lane, seq.nk() - n0, p.d_qk - c0);
      acc_to_gmem<G_TILES>(dv, p.d_v, row0, acc_dv, dv_scales, lane, seq.nk() - n0, p.d_v - c0);
    }
    return;
  }
  __syncthreads();
  T* sK_out = reinterpret_cast<T*>(sK);
  T* sV_out = reinterpret_cast<T*>(sV);
  if constexpr (PAIRED) {
    if (role == 0)
      acc_to_smem<OutTile, G_TILES>(sV_out, row0, acc_dk, dv_scales, lane);
    else
      acc_to_smem<OutTile, G_TILES>(sK_out, row0, acc_dk, dk_scale, lane);
  } else {
    acc_to_smem<OutTile, G_TILES>(sK_out, row0, acc_dk, dk_scale, lane);
    acc_to_smem<OutTile, G_TILES>(sV_out, row0, acc_dv, dv_scales, lane);
  }
  __syncthreads();
  T* dk = static_cast<T*>(p.dk) + (seq.k_flat + n0) * p.d_qk + c0;
  T* dv = static_cast<T*>(p.dv) + (seq.k_flat + n0) * p.d_v + c0;
  store_tile<OutTile, D_CHUNK, THREADS>(dk, p.d_qk, sK_out, seq.nk() - n0, p.d_qk - c0);
  store_tile<OutTile, D_CHUNK, THREADS>(dv, p.d_v, sV_out, seq.nk() - n0, p.d_v - c0);
}

template <typename T, int HEAD_DIM, int NUM_WARPS, int BLOCK_N, int D_CHUNK, bool IS_CAUSAL, Mods MODS, bool WGMMA,
          bool HAS_DROPOUT, bool PAIRED, bool PIPELINED, bool ACROSS_TURN, typename GradT>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, 1) attention_bwd_dq_kernel(const AttnParams p) {
  constexpr bool HAS_MODS = MODS != Mods::none;
  constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  constexpr int BLOCK_M = (PAIRED ? 8 : 16) * NUM_WARPS;  // queries of this CTA, 16 per warp (PAIRED: per pair)
  // PIECES: float32 on the wgmma path (see the dK/dV pass).
  constexpr bool PIECES = WGMMA && sizeof(T) == 4;
  using E = typename Select<PIECES, half_t, T>::type;
  constexpr int COLS = PIECES ? 2 * HEAD_DIM : HEAD_DIM;
  using QTile = SmemTile<E, BLOCK_M, COLS, WGMMA>;        // q and dout
  using KVTile = SmemTile<E, BLOCK_N, COLS, WGMMA>;       // the streamed k and v tiles
  using OutTile = SmemTile<T, BLOCK_M, HEAD_DIM, WGMMA>;  // stages dq at the end, in sQ
  constexpr int S_TILES = BLOCK_N / 8;
  constexpr int G_TILES = D_CHUNK / 8;
  constexpr int N_CHUNKS = HEAD_DIM / D_CHUNK;
  static_assert(HEAD_DIM % D_CHUNK == 0 && D_CHUNK % 16 == 0, "gradient column chunks");
  static_assert(!(HAS_MODS && IS_CAUSAL) || MODS == Mods::softcap, "with modifiers, causal is the window's right edge");
  static_assert(BLOCK_MASK_TILE % BLOCK_M == 0 && BLOCK_MASK_TILE % BLOCK_N == 0, "tiles inside block-mask tiles");
  static_assert(!WGMMA || ((sizeof(T) == 2 || PIECES) && NUM_WARPS % 4 == 0),
                "wgmma: 16-bit or float32 (pieces) inputs, whole warpgroups");
  static_assert(!PAIRED || (!HAS_MODS && !HAS_DROPOUT && NUM_WARPS % (WGMMA ? 8 : 2) == 0 && D_CHUNK % 32 == 0),
                "paired warps: plain or causal passes, whole pairs of warps (of warpgroups with wgmma)");
  static_assert(!PIECES || (!HAS_MODS && !HAS_DROPOUT && !PAIRED && HEAD_DIM % 64 == 0 && D_CHUNK % 64 == 0),
                "pieces: plain or causal, lo pieces and column chunks on (64-element) atom boundaries");
  static_assert(OutTile::SIZE * sizeof(T) <= QTile::SIZE * sizeof(E), "dq staged in sQ");
  static_assert(sizeof(GradT) == sizeof(T) || (sizeof(T) == 2 && sizeof(GradT) == 4), "dq: T, or float32");
  static_assert(!PIECES || (SPLIT_BLOCK_ROWS % BLOCK_M == 0 && SPLIT_BLOCK_ROWS % BLOCK_N == 0),
                "pieces: each tile inside one row block");
  using A = acc_t<T>;  // float; double for float64 inputs
  // PIPELINED (the tile table's p): S and dP are issued together (the loop below); ACROSS_TURN (a): across
  // the loop's turn too, where the registers hold the next tile's S and dP beside dQ's operands in flight.
  // The table sets them where they compile without spills (with the scalars, at most 64 keys per tile: the
  // softcap derivative's tile of registers).
  static_assert(!PIPELINED || (WGMMA && !PIECES && !PAIRED && !HAS_DROPOUT && MODS != Mods::all),
                "products in flight: 16-bit wgmma passes, plain, causal or the scalars, without dropout");
  static_assert(!ACROSS_TURN || PIPELINED, "across the turn: a pipelined pass");
  // PAIRED: each 16 queries get a pair of warps (as in the dK/dV pass): role 0 computes S and P, role 1 dP
  // and dS; P goes to role 1 and dS back to role 0 through shared memory, and each accumulates half of
  // the D_CHUNK columns of dQ += dS K, so the chunk needs half the registers and no second S and dP.
  constexpr int G_WARP = PAIRED ? G_TILES / 2 : G_TILES;  // dQ n-tiles per warp

  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sQ = reinterpret_cast<E*>(WGMMA ? smem_aligned(smem_raw) : smem_raw);
  E* sdO = sQ + QTile::SIZE;
  E* sK = sdO + QTile::SIZE;                            // [2] KVTile, double-buffered stream
  E* sV = sK + 2 * KVTile::SIZE;                        // [2] KVTile
  A* sP = reinterpret_cast<A*>(sV + 2 * KVTile::SIZE);  // PAIRED: [NUM_WARPS / 2][S_TILES * 4][32], P then dS

  const int b = batch_index();
  if (b >= p.batch) return;
  const int c0 = (blockIdx.x % N_CHUNKS) * D_CHUNK;
  const int m0 = (gridDim.x / N_CHUNKS - 1 - blockIdx.x / N_CHUNKS) * BLOCK_M;  // longest rows first
  const SeqInfo<may_be_packed(MODS)> seq(p, b);
  if (m0 >= seq.nq()) return;  // past a shorter sequence's end (variable-length batches)
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int offset = seq.causal_offset();
  constexpr int TWIN = WGMMA ? 4 : 1;  // a warp's partner: the next warp, or the same warp of the next warpgroup
  const int pair = PAIRED ? (warp / (2 * TWIN)) * TWIN + warp % TWIN : warp;
  const int row0 = pair * 16;  // this warp's 16 queries
  const int role = PAIRED ? (warp / TWIN) & 1 : 0;
  const int g0 = PAIRED ? role * (D_CHUNK / 2) : 0;  // this warp's first dQ column in the chunk
  A* sP_pair = sP + pair * (S_TILES * 4 * WARP_SIZE);

  const E* q = static_cast<const E*>(p.q) + batch_offset(p.q_stride, b, p) + (seq.q_row + m0) * p.q_stride[3];
  const E* k = static_cast<const E*>(p.k) + batch_offset(p.k_stride, b, p) + seq.k_row * p.k_stride[3];
  const E* v = static_cast<const E*>(p.v) + batch_offset(p.v_stride, b, p) + seq.k_row * p.v_stride[3];
  const E* dout =
      static_cast<const E*>(p.dout) + batch_offset(p.dout_stride, b, p) + (seq.q_row + m0) * p.dout_stride[3];
  // Columns to read (pieces: whole rows, padded with zeros), where the loads use them.
  auto qk_cols = [&]() { return PIECES ? COLS : p.d_qk; };
  auto v_cols = [&]() { return PIECES ? COLS : p.d_v; };
  const Pieces<PIECES> pieces(p, b);
  const PieceFactors q_factors = pieces.at(m0);  // of this CTA's q and dout rows
  const Dropout dropout(p, b);
  // As in the dK/dV pass: without modifiers, (1 - p) dS in place of dS, and 1 / (1 - p) in dQ's final scale.
  constexpr bool DS_UNSCALED = HAS_DROPOUT && !HAS_MODS;
  auto drop_dp = [&](A(&dp)[S_TILES][4], int n0) {  // dP -> Z * dP (DS_UNSCALED), else Z * dP / (1 - p)
    if constexpr (HAS_DROPOUT) {
      dropout.drop_rows(dp, m0 + warp * 16, n0, lane, DS_UNSCALED ? A(1) : Reals<A>::dropout_scale(p));
    }
  };

  // The two rows this thread holds: their lse (log2 units) and delta.
  A row_lse[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = m0 + row0 + (lane >> 2) + 8 * r;
    const i64 i = seq.q_flat + row;
    row_lse[r] = row < seq.nq() ? static_cast<const A*>(p.lse_log2)[i] : A(pos_inf());
    row_delta[r] = row < seq.nq() ? static_cast<const A*>(p.delta)[i] : A(0);
    if constexpr (DS_UNSCALED) row_delta[r] /= Reals<A>::dropout_scale(p);
  }

  const int key_end = IS_CAUSAL ? min(seq.nk(), m0 + BLOCK_M + offset) : seq.nk();
  int n_blocks = key_end > 0 ? ceil_div(key_end, BLOCK_N) : 0;
  int n_unmasked = seq.nk() / BLOCK_N;
  if (IS_CAUSAL) n_unmasked = min(n_unmasked, max(0, m0 + offset + 1) / BLOCK_N);
  const Mask<IS_CAUSAL> mask{seq.nk(), offset};
  // With modifiers: the key blocks of the window band whose block-mask tile is on (next_on).
  const ScoreMods<T, MODS, IS_CAUSAL> mods(p, b);
  int n_first = 0;
  if constexpr (HAS_MODS) {
    const int k_first = mods.first_key(m0), k_last = mods.last_key(min(m0 + BLOCK_M, seq.nq()) - 1);
    n_first = k_first / BLOCK_N;
    n_blocks = k_last >= k_first ? k_last / BLOCK_N + 1 : 0;
  }
  n_first = max(n_first, p.stream_begin / BLOCK_N);  // this launch's part of the keys
  n_blocks = min(n_blocks, ceil_div(p.stream_end, BLOCK_N));
  // Mods::scalars and ::softcap: the key blocks that need no bound checks, worked out once (as the forward
  // does), not per tile from nq and nk; Mods::all has no registers to spare for them.
  int n_free_first = 0, n_free_last = -1;
  if constexpr (HAS_MODS && MODS != Mods::all)
    mods.template unchecked_key_blocks<BLOCK_N>(m0, m0 + BLOCK_M - 1, n_free_first, n_free_last);
  TileBitmap own_bitmap;  // Mods::all's; Mods::scalars use the shared one
  TileBitmap& tile_bitmap = tile_bitmap_for<MODS>(own_bitmap);
  if constexpr (HAS_MODS) {
    __shared__ u32 bitmap_words[TILE_BITMAP_WORDS];
    mods.template load_tile_bitmap<NUM_WARPS, true>(tile_bitmap, bitmap_words, b, m0);
  }
  auto next_on = [&](int n_block) {
    if constexpr (HAS_MODS) n_block = mods.template next_on<BLOCK_N>(tile_bitmap, n_block, n_blocks);
    return n_block;
  };

  auto load_stream = [&](int n_block, int buf) {
    const int n0 = n_block * BLOCK_N;
    load_tile_async<KVTile, THREADS, true>(sK + buf * KVTile::SIZE, k + n0 * p.k_stride[3], p.k_stride[3],
                                           seq.nk() - n0, qk_cols());
    load_tile_async<KVTile, THREADS, true>(sV + buf * KVTile::SIZE, v + n0 * p.v_stride[3], p.v_stride[3],
                                           seq.nk() - n0, v_cols());
  };

  load_tile_async<QTile, THREADS, true>(sQ, q, p.q_stride[3], seq.nq() - m0, qk_cols());
  load_tile_async<QTile, THREADS, true>(sdO, dout, p.dout_stride[3], seq.nq() - m0, v_cols());
  int n_block = next_on(n_first);
  if (n_block < n_blocks) load_stream(n_block, 0);
  cp_async_commit();

  A acc_dq[G_WARP][4];
  if constexpr (PIPELINED) {
    // Software-pipelined over key blocks: S_j = Q K_j^T and dP_j go to the tensor cores right behind
    // dQ += dS_{j-1} K_{j-1}, without waiting for it, so they do not idle through the loop's turn. K_{j+1} and
    // V_{j+1} are copied while tile j's P and dS are computed, into the buffer that dQ_{j-1} read.
    // (One issue site for S and dP: two, before the loop and at its end, made ptxas move the accumulators
    // between them and serialize the products, C7515.)
    u32 ds_frag[S_TILES / 2][4];
    bool first = true;  // the first dQ product overwrites acc_dq: zeroed registers there made ptxas serialize
    for (int buf = 0; n_block < n_blocks; buf ^= 1) {
      const int n0 = n_block * BLOCK_N;
      cp_async_wait<0>();
      smem_publish<QTile>();
      __syncthreads();
      A acc_s[S_TILES][4], acc_dp[S_TILES][4];
      wg_issue_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, (warp * 16) & ~63, sK + buf * KVTile::SIZE);
      wg_issue_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_dp, sdO, (warp * 16) & ~63, sV + buf * KVTile::SIZE);
      wgmma_wait<1>();  // S_j, and dQ_{j-1} before it
      fence_operands(acc_s);
      fence_operands(acc_dq);
      fence_fragments(ds_frag);
      __syncthreads();  // every warp is done with buffer buf ^ 1
      const int n_next = next_on(n_block + 1);
      if (n_next < n_blocks) {
        load_stream(n_next, buf ^ 1);
        cp_async_commit();
      }
      if constexpr (HAS_MODS) {
        const bool check = n_block < n_free_first || n_block > n_free_last;
        mods.probs_times_derivative(acc_s, m0 + warp * 16, n0, lane, check,
                                    [&](int, int e) { return row_lse[e >> 1]; });
      } else {
        if (n_block >= n_unmasked) mask.apply(acc_s, m0 + warp * 16, n0, lane);
#pragma unroll
        for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[j][e] = fast_exp2(acc_s[j][e] * Reals<A>::scale_log2(p) - row_lse[e >> 1]);
        }
      }
      wgmma_wait<0>();
      fence_operands(acc_dp);
#pragma unroll
      for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] - row_delta[e >> 1]);
      }
      pack_fragments<T>(acc_dp, ds_frag);
      wg_issue_pb<T, S_TILES / 2, G_WARP, KVTile>(acc_dq, ds_frag, sK + buf * KVTile::SIZE, c0, !first);
      if constexpr (!ACROSS_TURN) wgmma_wait<0>();
      first = false;
      n_block = n_next;
    }
    wgmma_wait<0>();
    fence_operands(acc_dq);
    fence_fragments(ds_frag);
    if (first) zero_acc(acc_dq);  // no key block to visit
  } else {
    zero_acc(acc_dq);
    for (int buf = 0; n_block < n_blocks; buf ^= 1) {
      const int n0 = n_block * BLOCK_N;
      const int n_next = next_on(n_block + 1);
      if (n_next < n_blocks) {
        load_stream(n_next, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      smem_publish<QTile>();
      __syncthreads();
      const E* sK_j = sK + buf * KVTile::SIZE;
      const E* sV_j = sV + buf * KVTile::SIZE;

      const PieceFactors kv_factors = pieces.at(n0);  // of K_j and V_j
      A acc_s[S_TILES][4], acc_dp[S_TILES][4];
      if constexpr (PIECES) {
        // S = Q K_j^T (carrying 2^(e_q + e_k)), P = exp(scale * S - lse); dP = dO V_j^T (carrying
        // 2^(e_v + e_dout)), dS = P * (dP - delta); dQ += dS K_j below (carrying 2^e_k).
        gemm_abt_pieces<HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, warp * 16, sK_j);
        if (n_block >= n_unmasked) mask.apply(acc_s, m0 + warp * 16, n0, lane);
        const A scale_log2 = Reals<A>::scale_log2(p) * (q_factors.q * kv_factors.k);
#pragma unroll
        for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[j][e] = fast_exp2(acc_s[j][e] * scale_log2 - row_lse[e >> 1]);
        }
        gemm_abt_pieces<HEAD_DIM, S_TILES, QTile, KVTile>(acc_dp, sdO, warp * 16, sV_j);
#pragma unroll
        for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] * (q_factors.dout * kv_factors.v) - row_delta[e >> 1]);
        }
      } else if constexpr (PAIRED) {
        if (role == 0) {  // S = Q K_j^T, P = exp(scale * S - lse), to the partner
          gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, row0, sK_j, lane);
          if (n_block >= n_unmasked) mask.apply(acc_s, m0 + row0, n0, lane);
#pragma unroll
          for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_s[j][e] = fast_exp2(acc_s[j][e] * Reals<A>::scale_log2(p) - row_lse[e >> 1]);
          }
          tile_to_smem(sP_pair, acc_s, lane);
        } else {  // dP = dO V_j^T
          gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_dp, sdO, row0, sV_j, lane);
        }
        __syncthreads();  // P has reached role 1
        if (role == 1) {  // dS = P * (dP - delta), back to role 0
          tile_from_smem(acc_s, sP_pair, lane);
#pragma unroll
          for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] - row_delta[e >> 1]);
          }
          tile_to_smem(sP_pair, acc_dp, lane);
        }
        __syncthreads();  // dS has reached role 0
        if (role == 0) tile_from_smem(acc_dp, sP_pair, lane);
      } else if constexpr (HAS_MODS) {
        // dP = dO V_j^T and S = Q K_j^T first; then per element the logit, P, dS (into dbias) and
        // dS times the softcap derivative.
        gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_dp, sdO, warp * 16, sV_j, lane);
        gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, warp * 16, sK_j, lane);
        drop_dp(acc_dp, n0);
        const bool check = MODS != Mods::all ? n_block < n_free_first || n_block > n_free_last
                                             : mods.needs_bounds(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1);
        mods.template backward<false>(
            acc_s, acc_dp, m0 + warp * 16, n0, lane, check, [&](int, int e) { return row_lse[e >> 1]; },
            [&](int, int e) { return row_delta[e >> 1]; }, c0 == 0);
      } else {
        // S = Q K_j^T, P = exp(scale * S - lse)
        gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, warp * 16, sK_j, lane);
        if (n_block >= n_unmasked) mask.apply(acc_s, m0 + warp * 16, n0, lane);
#pragma unroll
        for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[j][e] = fast_exp2(acc_s[j][e] * Reals<A>::scale_log2(p) - row_lse[e >> 1]);
        }

        // dP = dO V_j^T;  dS = P * (dP - delta)
        gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_dp, sdO, warp * 16, sV_j, lane);
        drop_dp(acc_dp, n0);
#pragma unroll
        for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] - row_delta[e >> 1]);
        }
      }

      // dQ += dS K_j (PAIRED: this warp's half of the chunk's columns)
      if constexpr (PIECES)
        gemm_pb_pieces<HEAD_DIM, S_TILES, G_WARP, KVTile>(acc_dq, acc_dp, sK_j, c0, kv_factors.k);
      else
        gemm_pb<T, S_TILES, G_WARP, KVTile>(acc_dq, acc_dp, sK_j, c0 + g0, lane);
      __syncthreads();  // this buffer is refilled two iterations on
      n_block = n_next;
    }
  }

  // dQ = scale * dS K (DS_UNSCALED: scale / (1 - p) times the sum of (1 - p) dS K), staged through sQ (free
  // once the loop is done) for 16-byte stores.
  const A dq_factor = Reals<A>::scale(p) * (DS_UNSCALED ? Reals<A>::dropout_scale(p) : A(1));
  const A dq_scale[2] = {dq_factor, dq_factor};
  cp_async_wait<0>();                          // with no key block to visit, the Q/dO copies may still be in flight
  if constexpr (sizeof(GradT) != sizeof(T)) {  // unrounded: from the registers
    GradT* dq = static_cast<GradT*>(p.dq) + (seq.q_flat + m0) * p.d_qk + c0;
    acc_to_gmem<G_WARP>(dq, p.d_qk, row0, acc_dq, dq_scale, lane, seq.nq() - m0, p.d_qk - c0, g0);
    return;
  }
  __syncthreads();
  T* sQ_out = reinterpret_cast<T*>(sQ);
  acc_to_smem<OutTile, G_WARP>(sQ_out, row0, acc_dq, dq_scale, lane, g0);
  __syncthreads();
  T* dq = static_cast<T*>(p.dq) + (seq.q_flat + m0) * p.d_qk + c0;
  store_tile<OutTile, D_CHUNK, THREADS>(dq, p.d_qk, sQ_out, seq.nq() - m0, p.d_qk - c0);
}
