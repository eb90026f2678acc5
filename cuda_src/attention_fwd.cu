// attention_fwd.cu — fused attention forward: out = softmax(scale * q k^T) v, and its log-sum-exp.
//
// Layout: q (b, nq, d), k (b, nk, d), v (b, nk, dv) with any row/batch strides (unit column
// stride); out (b, nq, dv) and lse (b, nq) float32, contiguous. See block_info.cuh.
// One CTA owns BLOCK_M = 16 * NUM_WARPS query rows of one batch entry (16 per warp). It streams
// K and V tiles of BLOCK_N keys through shared memory with cp.async (the load of V_j overlaps
// S_j = Q K_j^T, the load of K_{j-1} overlaps O += P_j V_j), keeps the online-softmax state
// (m_i, l_i) and the output accumulator in registers, feeds P straight from the score registers
// into the P V product, and writes out and lse once. Nothing of size nq x nk exists anywhere.
// Where the output accumulator would not fit in registers (float32 at HEAD_DIM 256), the output
// columns are split into D_CHUNK-wide CTAs (grid x) that each recompute the same scores.
// HAS_MODS instantiations apply the score modifiers (score_mods.cuh: window, softcap, ALiBi, bias,
// mask) to each score tile and skip key tiles outside the window band or off in the block mask;
// they run with IS_CAUSAL = false, causality arriving as the window's right edge.
// Saved for the backward: lse only.
#include "common.cuh"
#include "block_info.cuh"
#include "mma.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "score_mods.cuh"

template <typename T, int HEAD_DIM, int NUM_WARPS, int BLOCK_N, int D_CHUNK, bool IS_CAUSAL, bool HAS_MODS>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, 1)
attention_fwd_kernel(const AttnParams p) {
  constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  constexpr int BLOCK_M = 16 * NUM_WARPS;
  constexpr int STRIDE = SmemTile<T, HEAD_DIM>::STRIDE;
  constexpr int S_TILES = BLOCK_N / 8;   // score accumulator n-tiles per warp
  constexpr int O_TILES = D_CHUNK / 8;   // output accumulator n-tiles per warp
  constexpr int N_CHUNKS = HEAD_DIM / D_CHUNK;
  static_assert(HEAD_DIM % D_CHUNK == 0 && D_CHUNK % 16 == 0, "output column chunks");
  static_assert(!(HAS_MODS && IS_CAUSAL), "with modifiers, causal is the window's right edge");
  static_assert(BLOCK_MASK_TILE % BLOCK_M == 0 && BLOCK_MASK_TILE % BLOCK_N == 0, "tiles inside block-mask tiles");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BLOCK_M * STRIDE;
  T* sV = sK + BLOCK_N * STRIDE;

  const int b = batch_index();
  if (b >= p.batch) return;
  // Reverse order: under the causal mask the last query blocks see the most keys; start them first.
  const int m0 = (gridDim.x / N_CHUNKS - 1 - blockIdx.x / N_CHUNKS) * BLOCK_M;
  const int c0 = (blockIdx.x % N_CHUNKS) * D_CHUNK;  // this CTA's output columns
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int offset = causal_offset(p);

  const T* q = static_cast<const T*>(p.q) + batch_offset(p.q_stride, b, p) + m0 * p.q_stride[3];
  const T* k = static_cast<const T*>(p.k) + batch_offset(p.k_stride, b, p);
  const T* v = static_cast<const T*>(p.v) + batch_offset(p.v_stride, b, p);
  T* out = static_cast<T*>(p.out) + batch_offset(p.out_stride, b, p) + m0 * p.out_stride[3];
  float* lse = p.lse + static_cast<i64>(b) * p.nq + m0;

  // Keys this row block can see: all of them, or up to the causal limit of its last row.
  const int key_end = IS_CAUSAL ? min(p.nk, m0 + BLOCK_M + offset) : p.nk;
  int n_blocks = key_end > 0 ? ceil_div(key_end, BLOCK_N) : 0;
  // Key blocks [0, n_unmasked) need no mask: fully inside nk and on or below every row's diagonal.
  int n_unmasked = p.nk / BLOCK_N;
  if (IS_CAUSAL) n_unmasked = min(n_unmasked, max(0, m0 + offset + 1) / BLOCK_N);
  const Mask<IS_CAUSAL> mask{p.nk, offset};
  // With modifiers: only the key blocks [n_first, n_blocks) of the window band, and of those only the
  // ones the block mask leaves on (prev_on walks down to the next one).
  const ScoreMods<T> mods(p, b);
  int n_first = 0;
  if constexpr (HAS_MODS) {
    const int last_row = min(m0 + BLOCK_M, p.nq) - 1;
    const int k_first = mods.first_key(m0), k_last = mods.last_key(last_row);
    n_first = k_first / BLOCK_N;
    n_blocks = k_last >= k_first ? k_last / BLOCK_N + 1 : 0;
  }
  TileBitmap tile_bitmap;
  if constexpr (HAS_MODS) {
    __shared__ u32 bitmap_words[TILE_BITMAP_WORDS];
    mods.template load_tile_bitmap<NUM_WARPS, true>(tile_bitmap, bitmap_words, m0);
  }
  auto prev_on = [&](int n_block) {
    if constexpr (HAS_MODS) n_block = mods.template prev_on<BLOCK_N>(tile_bitmap, n_block, n_first);
    return n_block;
  };

  float acc_o[O_TILES][4];
  zero_acc(acc_o);
  OnlineSoftmax<S_TILES> softmax;
  softmax.init();

  int n_block = prev_on(n_blocks - 1);
  if (n_block >= n_first) {
    load_tile_async<T, BLOCK_M, HEAD_DIM, THREADS>(sQ, q, p.q_stride[3], p.nq - m0, p.d_qk);
    const int n_last = n_block * BLOCK_N;
    load_tile_async<T, BLOCK_N, HEAD_DIM, THREADS>(sK, k + n_last * p.k_stride[3], p.k_stride[3], p.nk - n_last, p.d_qk);
    cp_async_commit();
  }
  // Masked blocks sit at the end of the key range: walk it backwards so they come first.
  while (n_block >= n_first) {
    const int n0 = n_block * BLOCK_N;
    const int n_next = prev_on(n_block - 1);
    float acc_s[S_TILES][4];
    zero_acc(acc_s);

    cp_async_wait<0>();  // K_j has landed; every warp is done with V_{j+1}
    __syncthreads();
    load_tile_async<T, BLOCK_N, HEAD_DIM, THREADS>(sV, v + n0 * p.v_stride[3], p.v_stride[3], p.nk - n0, p.d_v);
    cp_async_commit();

    // S_ij = Q_i K_j^T (raw scores; the scale is folded into the exponent)
    gemm_smem_abt<T, HEAD_DIM, S_TILES, STRIDE, STRIDE>(acc_s, sQ, warp * 16, sK, lane);
    if constexpr (HAS_MODS) {
      mods.template apply<false>(acc_s, m0 + warp * 16, n0, lane,
                                 mods.needs_bounds(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1));
    } else if (n_block >= n_unmasked) {
      mask.apply(acc_s, m0 + warp * 16, n0, lane);
    }

    // m_i, l_i and P_ij = exp(scale * S_ij - m_i); O_i *= exp(m_old - m_new). Scores that softcap,
    // ALiBi or bias made logits have the scale applied already: only log2(e) is left for the exponent.
    float rescale[2];
    softmax.update(acc_s, HAS_MODS ? mods.exp_scale() : p.scale_log2, rescale);
    scale_rows(acc_o, rescale);

    cp_async_wait<0>();  // V_j has landed; every warp is done with K_j
    __syncthreads();
    if (n_next >= n_first) {
      const int n_prev = n_next * BLOCK_N;
      load_tile_async<T, BLOCK_N, HEAD_DIM, THREADS>(sK, k + n_prev * p.k_stride[3], p.k_stride[3], p.nk - n_prev, p.d_qk);
      cp_async_commit();
    }
    // O_i += P_ij V_j, P straight from the score registers
    gemm_acc_b<T, S_TILES, O_TILES, STRIDE>(acc_o, acc_s, sV, c0, lane);
    n_block = n_next;
  }

  // out = O_i / l_i; lse_i = scale * m_i + log(l_i). Stage through sQ for 16-byte stores.
  float inv_sum[2], row_lse[2];
  softmax.finalize(HAS_MODS ? mods.exp_scale() : p.scale_log2, inv_sum, row_lse);
  cp_async_wait<0>();
  __syncthreads();  // sQ is free: the last S = Q K^T is done in every warp
  acc_to_smem<T, O_TILES, STRIDE>(sQ, warp * 16, acc_o, inv_sum, lane);
  if (c0 == 0 && (lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + (lane >> 2) + 8 * r;
      if (m0 + row < p.nq) lse[row] = row_lse[r];
    }
  }
  __syncthreads();
  store_tile<T, BLOCK_M, D_CHUNK, STRIDE, THREADS>(out + c0, p.out_stride[3], sQ, p.nq - m0, p.d_v - c0);
}
