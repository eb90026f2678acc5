// attention_fwd.cu — fused attention forward: out = softmax(scale * q k^T) v, and its log-sum-exp.
//
// Layout: q (b, nq, d), k (b, nk, d), v (b, nk, dv) with any row/batch strides (unit column
// stride); out (b, nq, dv) of OutT (T, or float32 for 16-bit inputs: out unrounded) and lse (b, nq) float32 (float64
// for float64 inputs), contiguous; or packed variable-length sequences, each batch entry with its own nq and nk
// (SeqInfo). See params.cuh. One CTA owns BLOCK_M = 16 * NUM_WARPS
// query rows of one batch entry (16 per warp). It streams K and V tiles of BLOCK_N keys through shared memory with
// cp.async, keeps the online-softmax state (m_i, l_i) and the output accumulator in registers, feeds P straight from
// the score registers into the P V product, and writes out and lse once. Nothing of size nq x nk exists anywhere. Key
// blocks are visited last to first: under the causal mask (and at the end of nk) the masked blocks are the last ones,
// so they come first and every later block runs without a mask. MODS instantiations (HAS_MODS: Mods::scalars,
// Mods::window or Mods::all, mods.cuh) apply the score modifiers (score_mods.cuh: window, softcap, ALiBi; with
// Mods::all bias and mask too) to each score tile and skip key tiles outside the window band or off in the block mask;
// they run with IS_CAUSAL = false, causality arriving as the window's right edge. BOUNDED instantiations (wgmma,
// bfloat16, Mods::scalars) serve softcapped scores without ALiBi, which are tanh values in [-1, 1]: with the softcap at
// most 62 ln 2 (~43), exp2 of the lowest one against 1 is still a normal float, so the softmax takes 1 as every row's
// max (softmax.cuh, update_bounded) and skips the row max's reductions and their latency (docs/design/forward.md). The
// host picks them. HAS_DROPOUT instantiations zero the dropped elements of each P tile after the softmax has summed it
// (dropout.cuh: the mask is regenerated from the seed, never stored) and scale out by 1 / (1 - p) once at the end; lse
// is that of the scores, unchanged. Saved for the backward: lse only.
//
// Two kernels, one per tensor-core path, sharing everything but the main loop (RowBlock, write_out):
//  - attention_fwd_kernel (mma.sync, every GPU): per key block, S_j = Q K_j^T, softmax, O += P_j V_j,
//    with the load of V_j overlapping S_j and the load of K_{j+1} overlapping P_j V_j. Where the output
//    accumulator would not fit in registers (float32 at HEAD_DIM 256), the output columns are split
//    into D_CHUNK-wide CTAs (grid x) that each recompute the same scores.
//  - attention_fwd_wgmma_kernel (Hopper, fp16/bf16; float32 on float16 pieces): warpgroup products from
//    swizzled tiles, K and V double-buffered one block ahead, and the products of one block overlapping the
//    softmax of the next: while the tensor cores run S_{j+1} = Q K_{j+1}^T and O += P_j V_j, the warps wait
//    only for S_{j+1}, run its softmax, and rescale O once P_j V_j is done (FlashAttention-3's
//    intra-warpgroup pipelining). float32 inputs (T = float, plain and causal): k and v arrive as float16 pieces hi +
//    lo scaled by a power of two per row block (split_f32.cu, params.cuh's split_exponents), and each CTA splits its
//    own q tile as it loads it (pieces.cuh, split_tile). S takes three float16 products (Q_hi K_lo^T + Q_lo K_hi^T +
//    Q_hi K_hi^T), P is split likewise, and each block's P V is added to O in registers, so float32 accuracy holds over
//    any number of key blocks. CTAS_PER_SM is its launch bounds' minimum of resident CTAs (the tile table's
//    ctas_per_sm): more than one where short CTAs (a window's few key blocks) hide each other's setup, first copies and
//    epilogue.
#include "common.cuh"
#include "params.cuh"
#include "mods.cuh"
#include "seq_info.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "score_mods.cuh"
#include "dropout.cuh"
#include "row_block.cuh"

// out = O_i / l_i (times 1 / (1 - p) with dropout; times out_factor, the split float32 inputs' scaling)
// and lse_i = scale * m_i + log(l_i), columns [c0, c0 + 8*O_TILES) (lse by the c0 = 0 CTA); exp_scale is
// the factor the softmax ran with. Staged through sQ for 16-byte stores: every warp must be done with
// its products first. An out wider than T (float32 from 16-bit inputs: unrounded) goes from the registers.
template <class QTile, int THREADS, bool HAS_DROPOUT, bool SCALED = false, typename T, int O_TILES, typename A,
          class Rows>
__device__ __forceinline__ void write_out(const Rows& rows, T* sQ, int c0, const A (&acc_o)[O_TILES][4],
                                          const OnlineSoftmax<A>& softmax, int warp, int lane, A exp_scale,
                                          A out_factor = A(1)) {
  const AttnParams& p = rows.p;
  A inv_sum[2], row_lse[2];
  softmax.finalize(exp_scale, inv_sum, row_lse);
  if constexpr (HAS_DROPOUT) {
    inv_sum[0] *= Reals<A>::dropout_scale(p);
    inv_sum[1] *= Reals<A>::dropout_scale(p);
  }
  if constexpr (SCALED) {
    inv_sum[0] *= out_factor;
    inv_sum[1] *= out_factor;
  }
  if constexpr (sizeof(typename Rows::OutElement) != sizeof(T)) {
    acc_to_gmem<O_TILES>(rows.out + c0, p.out_stride[3], warp * 16, acc_o, inv_sum, lane, rows.seq.nq() - rows.m0,
                         p.d_v - c0);
    if (c0 == 0) rows.write_lse(warp * 16, row_lse, lane);
  } else {
    __syncthreads();
    acc_to_smem<QTile, O_TILES>(sQ, warp * 16, acc_o, inv_sum, lane);
    if (c0 == 0) rows.write_lse(warp * 16, row_lse, lane);
    __syncthreads();
    store_tile<QTile, 8 * O_TILES, THREADS>(rows.out + c0, p.out_stride[3], sQ, rows.seq.nq() - rows.m0, p.d_v - c0);
  }
}

template <typename T, int HEAD_DIM, int NUM_WARPS, int BLOCK_N, int D_CHUNK, bool IS_CAUSAL, Mods MODS,
          bool HAS_DROPOUT, typename OutT>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, 1) attention_fwd_kernel(const AttnParams p) {
  constexpr bool HAS_MODS = MODS != Mods::none;
  constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  constexpr int BLOCK_M = 16 * NUM_WARPS;
  using QTile = PaddedTile<T, BLOCK_M, HEAD_DIM>;  // also stages out at the end
  using KVTile = PaddedTile<T, BLOCK_N, HEAD_DIM>;
  constexpr int S_TILES = BLOCK_N / 8;  // score accumulator n-tiles per warp
  constexpr int O_TILES = D_CHUNK / 8;  // output accumulator n-tiles per warp
  constexpr int N_CHUNKS = HEAD_DIM / D_CHUNK;
  using A = acc_t<T>;  // float; double for float64 inputs
  static_assert(HEAD_DIM % D_CHUNK == 0 && D_CHUNK % 16 == 0, "output column chunks");
  static_assert(!(HAS_MODS && IS_CAUSAL), "with modifiers, causal is the window's right edge");
  static_assert(MODS != Mods::softcap, "Mods::softcap: the backward's passes only");
  static_assert(BLOCK_MASK_TILE % BLOCK_M == 0 && BLOCK_MASK_TILE % BLOCK_N == 0, "tiles inside block-mask tiles");
  static_assert(sizeof(OutT) == sizeof(T) || (sizeof(T) == 2 && sizeof(OutT) == 4), "out: T, or float32 (16-bit T)");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ u32 bitmap_words[HAS_MODS ? TILE_BITMAP_WORDS : 1];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + QTile::SIZE;
  T* sV = sK + KVTile::SIZE;

  const int b = batch_index();
  if (b >= p.batch) return;
  // Reverse order: under the causal mask the last query blocks see the most keys; start them first.
  const int m0 = (gridDim.x / N_CHUNKS - 1 - blockIdx.x / N_CHUNKS) * BLOCK_M;
  const SeqInfo<may_be_packed(MODS)> seq(p, b);
  if (m0 >= seq.nq()) return;                        // past a shorter sequence's end (variable-length batches)
  const int c0 = (blockIdx.x % N_CHUNKS) * D_CHUNK;  // this CTA's output columns
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const RowBlock<T, NUM_WARPS, BLOCK_M, BLOCK_N, IS_CAUSAL, MODS, T, T, OutT> rows(p, b, seq, m0, bitmap_words);
  const Dropout dropout(p, b);
  // P_ij -> P_ij * Z_ij, after the softmax has summed P_ij into l_i.
  auto drop = [&](A(&s)[S_TILES][4], int n_block) {
    if constexpr (HAS_DROPOUT) {
      dropout.drop_rows(s, m0 + warp * 16, n_block * BLOCK_N, lane);
    }
  };

  A acc_o[O_TILES][4];
  zero_acc(acc_o);
  OnlineSoftmax<A> softmax;
  softmax.init();

  int n_block = rows.prev_on(rows.n_blocks - 1);
  if (n_block >= rows.n_first) {
    load_tile_async<QTile, THREADS>(sQ, rows.q, p.q_stride[3], seq.nq() - m0, p.d_qk);
    const int n_last = n_block * BLOCK_N;
    load_tile_async<KVTile, THREADS>(sK, rows.k + n_last * p.k_stride[3], p.k_stride[3], rows.nk() - n_last, p.d_qk);
    cp_async_commit();
  }
  while (n_block >= rows.n_first) {
    const int n0 = n_block * BLOCK_N;
    const int n_next = rows.prev_on(n_block - 1);
    A acc_s[S_TILES][4];

    cp_async_wait<0>();  // K_j has landed; every warp is done with V_{j+1}
    __syncthreads();
    load_tile_async<KVTile, THREADS>(sV, rows.v + n0 * p.v_stride[3], p.v_stride[3], rows.nk() - n0, p.d_v);
    cp_async_commit();

    // S_ij = Q_i K_j^T (raw scores; the scale is folded into the exponent)
    gemm_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, warp * 16, sK, lane);
    rows.scores(acc_s, n_block, warp * 16, lane);
    // m_i, l_i and P_ij = exp(scale * S_ij - m_i); O_i *= exp(m_old - m_new).
    A rescale[2];
    softmax.update(acc_s, rows.exp_scale(), rescale);
    rescale_rows(acc_o, rescale);
    drop(acc_s, n_block);

    cp_async_wait<0>();  // V_j has landed; every warp is done with K_j
    __syncthreads();
    if (n_next >= rows.n_first) {
      const int n_prev = n_next * BLOCK_N;
      load_tile_async<KVTile, THREADS>(sK, rows.k + n_prev * p.k_stride[3], p.k_stride[3], rows.nk() - n_prev, p.d_qk);
      cp_async_commit();
    }
    // O_i += P_ij V_j, P straight from the score registers
    gemm_pb<T, S_TILES, O_TILES, KVTile>(acc_o, acc_s, sV, c0, lane);
    n_block = n_next;
  }
  cp_async_wait<0>();  // with no key block to visit, nothing was loaded; else everything has landed
  write_out<QTile, THREADS, HAS_DROPOUT>(rows, sQ, c0, acc_o, softmax, warp, lane, rows.exp_scale());
}

template <typename T, int HEAD_DIM, int NUM_WARPS, int BLOCK_N, bool IS_CAUSAL, Mods MODS, bool HAS_DROPOUT,
          bool BOUNDED, int CTAS_PER_SM, typename OutT>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, CTAS_PER_SM) attention_fwd_wgmma_kernel(const AttnParams p) {
  constexpr bool HAS_MODS = MODS != Mods::none;
  // float32 inputs: k and v arrive split into float16 pieces (split_f32.cu), q is split here; the shared
  // tiles hold rows of [hi | lo], 2 * HEAD_DIM wide.
  constexpr bool PIECES = sizeof(T) == 4;
  using E = typename Select<PIECES, half_t, T>::type;  // the shared tiles' elements
  constexpr int COLS = PIECES ? 2 * HEAD_DIM : HEAD_DIM;
  constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  constexpr int BLOCK_M = 16 * NUM_WARPS;  // one warpgroup per 64 rows
  using QTile = SwizzledTile<E, BLOCK_M, COLS>;
  using KVTile = SwizzledTile<E, BLOCK_N, COLS>;
  using OutTile = SwizzledTile<T, BLOCK_M, HEAD_DIM>;  // stages out at the end, in sQ
  constexpr int S_TILES = BLOCK_N / 8;
  constexpr int O_TILES = HEAD_DIM / 8;
  constexpr int P_STEPS = S_TILES / 2;
  static_assert((sizeof(T) == 2 || PIECES) && NUM_WARPS % 4 == 0,
                "wgmma: 16-bit or split float32 inputs, whole warpgroups");
  static_assert(!PIECES || (!HAS_MODS && !HAS_DROPOUT && HEAD_DIM % KVTile::ATOM_COLS == 0),
                "split float32: plain and causal, the lo pieces on an atom boundary");
  static_assert(OutTile::SIZE * sizeof(T) <= QTile::SIZE * sizeof(E), "out staged in sQ");
  static_assert(!(HAS_MODS && IS_CAUSAL), "with modifiers, causal is the window's right edge");
  static_assert(MODS != Mods::softcap, "Mods::softcap: the backward's passes only");
  static_assert(!HAS_MODS || (BLOCK_MASK_TILE % BLOCK_M == 0 && BLOCK_MASK_TILE % BLOCK_N == 0),
                "tiles inside block-mask tiles");
  static_assert(!PIECES || SPLIT_BLOCK_ROWS % BLOCK_N == 0, "split float32: each key tile inside one row block");
  static_assert(!BOUNDED || (MODS == Mods::scalars && IsBfloat16<T>::value && !HAS_DROPOUT),
                "bounded scores: softcapped bfloat16 with the scalar modifiers");
  static_assert(sizeof(OutT) == sizeof(T) || (sizeof(T) == 2 && sizeof(OutT) == 4), "out: T, or float32 (16-bit T)");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ u32 bitmap_words[HAS_MODS ? TILE_BITMAP_WORDS : 1];
  __shared__ float warp_max[PIECES ? NUM_WARPS : 1];  // split_tile's reduction
  E* sQ = reinterpret_cast<E*>(smem_aligned(smem_raw));
  E* sK = sQ + QTile::SIZE;       // [2] KVTile: K of the t-th visited block in sK[t % 2]
  E* sV = sK + 2 * KVTile::SIZE;  // [2] KVTile: V likewise

  const int b = batch_index();
  if (b >= p.batch) return;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;  // longest causal rows first
  const SeqInfo<may_be_packed(MODS)> seq(p, b);
  if (m0 >= seq.nq()) return;  // past a shorter sequence's end (variable-length batches)
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int wg_row0 = (warp / 4) * 64;
  const RowBlock<T, NUM_WARPS, BLOCK_M, BLOCK_N, IS_CAUSAL, MODS, E, T, OutT> rows(p, b, seq, m0, bitmap_words);
  const Dropout dropout(p, b);
  // P_ij -> P_ij * Z_ij, after the softmax has summed P_ij into l_i.
  auto drop = [&](float (&s)[S_TILES][4], int n_block) {
    if constexpr (HAS_DROPOUT) {
      dropout.drop_rows(s, m0 + warp * 16, n_block * BLOCK_N, lane);
    }
  };
  // Columns to read (pieces: whole rows, padded with zeros), where the loads use them.
  auto qk_cols = [&]() { return PIECES ? COLS : p.d_qk; };
  auto v_cols = [&]() { return PIECES ? COLS : p.d_v; };

  // The visited key blocks b_0 > b_1 > ... The copies go in commit groups G_0 = {Q, K(b_0)} (split
  // inputs: {K(b_0)}, Q being split into sQ while G_0 and G_1 are in flight) and G_t = {K(b_t),
  // V(b_(t-1))}; G_t is waited for at step t and G_(t+2) issued at its end, into the buffers step t has
  // just finished with. A group may be empty (past the last block): wait_group counts it all the same.
  auto load_k = [&](int n_block, int t) {
    const int n0 = n_block * BLOCK_N;
    load_tile_async<KVTile, THREADS>(sK + (t & 1) * KVTile::SIZE, rows.k + n0 * p.k_stride[3], p.k_stride[3],
                                     rows.nk() - n0, qk_cols());
  };
  auto load_v = [&](int n_block, int t) {
    const int n0 = n_block * BLOCK_N;
    load_tile_async<KVTile, THREADS>(sV + (t & 1) * KVTile::SIZE, rows.v + n0 * p.v_stride[3], p.v_stride[3],
                                     rows.nk() - n0, v_cols());
  };
  auto wait_step = [&]() {  // G_t has landed (G_(t+1) may still be in flight), visible to the tensor cores
    cp_async_wait<1>();
    smem_publish<KVTile>();
    __syncthreads();
  };
  // S = Q K^T of one key block (K in k_tile), issued as one commit group.
  auto issue_s = [&](float (&acc_s)[S_TILES][4], const E* k_tile) {
    if constexpr (PIECES)
      wg_issue_abt_split<E, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, wg_row0, k_tile);
    else
      wg_issue_abt<E, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ, wg_row0, k_tile);
  };
  // P as the register operand of O += P V: rounded to T, or split into float16 hi and lo pieces (P is
  // at most 2^RESCALE_SLACK; times P_FACTOR the pieces stay in float16's range and keep their bits).
  constexpr float P_FACTOR = 64.f;
  struct PFragments {
    u32 hi[P_STEPS][4];
    u32 lo[PIECES ? P_STEPS : 1][4];
  };
  auto pack_p = [&](const float (&acc_s)[S_TILES][4], PFragments& f) {
    if constexpr (PIECES)
      split_fragments<S_TILES>(acc_s, {P_FACTOR, P_FACTOR}, f.hi, f.lo);
    else
      pack_fragments<E>(acc_s, f.hi);
  };
  // O accumulates in the tensor cores (O += P V), or for split inputs in registers: each block's P V
  // comes fresh (acc_pv) and is added with a rounded float32 add (wg_issue_pb_split says why), times the
  // factor of its v row block (v_factor).
  float acc_o[O_TILES][4];
  float acc_pv[PIECES ? O_TILES : 1][4];
  auto issue_pv = [&](PFragments& f, const E* v_tile) {
    if constexpr (PIECES)
      wg_issue_pb_split<E, P_STEPS, O_TILES, KVTile>(acc_pv, f.hi, f.lo, v_tile, 0, HEAD_DIM);
    else
      wg_issue_pb<E, P_STEPS, O_TILES, KVTile>(acc_o, f.hi, v_tile, 0);
  };
  auto finish_pv = [&](float v_factor) {  // after wgmma_wait: the block's P V is in acc_o
    if constexpr (PIECES) {
      fence_operands(acc_pv);
#pragma unroll
      for (int j = 0; j < O_TILES; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[j][e] += acc_pv[j][e] * v_factor;
    } else {
      fence_operands(acc_o);
    }
  };
  auto fence_p = [&](PFragments& f) {
    fence_fragments(f.hi);
    if constexpr (PIECES) fence_fragments(f.lo);
  };

  zero_acc(acc_o);
  OnlineSoftmax<> softmax;
  softmax.init();
  // Split inputs: S carries the scaling of the q tile (in exp_scale) and of its key block's k rows (the
  // softmax's tile factor), P V that of its v rows (finish_pv) and P_FACTOR (out_factor).
  const Pieces<PIECES> pieces(p, b);
  float exp_scale = rows.exp_scale();
  const float out_factor = PIECES ? 1.f / P_FACTOR : 1.f;
  // BOUNDED: the scores are at most 1, and 1 stands for every row's max (update_bounded).
  auto softmax_update = [&](float (&acc_s)[S_TILES][4], float (&rescale)[2], float tile_factor) {
    if constexpr (BOUNDED)
      softmax.update_bounded(acc_s, exp_scale, rescale, 1.f);
    else
      softmax.template update<PIECES>(acc_s, exp_scale, rescale, tile_factor);
  };

  int n_cur = rows.prev_on(rows.n_blocks - 1);  // b_t: the block whose P (p_cur) is pending
  if (n_cur >= rows.n_first) {
    int n_next = rows.prev_on(n_cur - 1);  // b_(t+1)
    if constexpr (!PIECES) load_tile_async<QTile, THREADS>(sQ, rows.q, p.q_stride[3], seq.nq() - m0, qk_cols());
    load_k(n_cur, 0);
    cp_async_commit();
    if (n_next >= rows.n_first) load_k(n_next, 1);
    load_v(n_cur, 0);
    cp_async_commit();
    if constexpr (PIECES)
      exp_scale *= split_tile<QTile, HEAD_DIM, THREADS>(sQ, rows.q, p.q_stride[3], seq.nq() - m0, p.d_qk, warp_max);
    PieceFactors f_cur = pieces.at(n_cur * BLOCK_N);  // of b_t's rows

    // Step 0: S_0 = Q K(b_0)^T alone; its softmax gives P_0.
    PFragments p_cur;
    {
      wait_step();
      float acc_s[S_TILES][4];
      issue_s(acc_s, sK);
      wgmma_wait<0>();
      fence_operands(acc_s);
      rows.scores(acc_s, n_cur, warp * 16, lane);
      float rescale[2];  // of an all-zero O: unused
      softmax_update(acc_s, rescale, f_cur.k);
      drop(acc_s, n_cur);
      pack_p(acc_s, p_cur);
      __syncthreads();  // every warpgroup is done with K(b_0)
      if (n_next >= rows.n_first) {
        const int n_after = rows.prev_on(n_next - 1);
        if (n_after >= rows.n_first) load_k(n_after, 2);
        load_v(n_next, 1);
      }
      cp_async_commit();  // G_2
    }
    // Steps t = 1, 2, ...: S_t = Q K(b_t)^T and O += P_(t-1) V(b_(t-1)) in flight together.
    int t = 1;
    for (; n_next >= rows.n_first; ++t) {
      const PieceFactors f_next = pieces.at(n_next * BLOCK_N);
      wait_step();
      float acc_s[S_TILES][4];
      issue_s(acc_s, sK + (t & 1) * KVTile::SIZE);
      issue_pv(p_cur, sV + ((t - 1) & 1) * KVTile::SIZE);
      wgmma_wait<1>();  // S_t is done; P_(t-1) V is still running
      fence_operands(acc_s);
      rows.scores(acc_s, n_next, warp * 16, lane);
      float rescale[2];
      softmax_update(acc_s, rescale, f_next.k);
      drop(acc_s, n_next);
      PFragments p_next;
      pack_p(acc_s, p_next);
      wgmma_wait<0>();
      finish_pv(f_cur.v);
      fence_p(p_cur);
      rescale_rows(acc_o, rescale);  // O = (O + P_(t-1) V) * exp(m_old - m_new)
#pragma unroll
      for (int kt = 0; kt < P_STEPS; ++kt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          p_cur.hi[kt][i] = p_next.hi[kt][i];
          if constexpr (PIECES) p_cur.lo[kt][i] = p_next.lo[kt][i];
        }
      __syncthreads();                               // every warpgroup is done with K(b_t) and V(b_(t-1))
      const int n_after = rows.prev_on(n_next - 1);  // b_(t+1)
      if (n_after >= rows.n_first) {
        const int n_after2 = rows.prev_on(n_after - 1);
        if (n_after2 >= rows.n_first) load_k(n_after2, t + 2);
        load_v(n_after, t + 1);
      }
      cp_async_commit();  // G_(t+2)
      n_next = n_after;
      f_cur = f_next;
    }
    // The last block's O += P V.
    wait_step();
    issue_pv(p_cur, sV + ((t - 1) & 1) * KVTile::SIZE);
    wgmma_wait<0>();
    finish_pv(f_cur.v);
    fence_p(p_cur);
  }
  cp_async_wait<0>();
  // (16-bit inputs: the scale again from the parameters, as the registers are scarcest there)
  write_out<OutTile, THREADS, HAS_DROPOUT, PIECES>(rows, reinterpret_cast<T*>(sQ), 0, acc_o, softmax, warp, lane,
                                                   PIECES ? exp_scale : rows.exp_scale(), out_factor);
}
