// attention_probs.cu — the softmax probabilities P = exp(s - lse) of attention, for inspection.
//
// Layout: q (b, nq, d), k (b, nk, d) as in the forward (params.cuh); lse (b, nq) float32 from the
// forward with the same options; writes probs (b, nq, nk) in the accumulator type (float32; float64 for
// float64 inputs), contiguous (p.out).
// One CTA owns BLOCK_M = 16 * NUM_WARPS query rows and one BLOCK_N-key tile (grid x enumerates both):
// it recomputes S = Q K^T on the tensor cores exactly as the forward does, turns it into logits with
// the same score modifiers (score_mods.cuh), and writes exp(logit - lse). Tiles the window band or the
// block mask hide are written as zeros without computing anything. This is the one kernel that
// writes an nq x nk array: it exists for debugging, not for speed.
#include "common.cuh"
#include "params.cuh"
#include "mods.cuh"
#include "seq_info.cuh"
#include "gemm.cuh"
#include "score_mods.cuh"

template <typename T, int HEAD_DIM, int NUM_WARPS, int BLOCK_N, bool WGMMA>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE, 1) attention_probs_kernel(const AttnParams p) {
  constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  constexpr int BLOCK_M = 16 * NUM_WARPS;
  using QTile = SmemTile<T, BLOCK_M, HEAD_DIM, WGMMA>;
  using KTile = SmemTile<T, BLOCK_N, HEAD_DIM, WGMMA>;
  constexpr int S_TILES = BLOCK_N / 8;
  static_assert(BLOCK_MASK_TILE % BLOCK_M == 0 && BLOCK_MASK_TILE % BLOCK_N == 0, "tiles inside block-mask tiles");
  static_assert(!WGMMA || (sizeof(T) == 2 && NUM_WARPS % 4 == 0), "wgmma: 16-bit inputs, whole warpgroups");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(WGMMA ? smem_aligned(smem_raw) : smem_raw);
  T* sK = sQ + QTile::SIZE;

  const int b = batch_index();
  if (b >= p.batch) return;
  const int n_tiles = ceil_div(p.nk, BLOCK_N);
  const int m0 = (blockIdx.x / n_tiles) * BLOCK_M;
  const int n0 = (blockIdx.x % n_tiles) * BLOCK_N;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane >> 2, t = lane & 3;

  const SeqInfo<true> seq(p, b);  // dense batches only; sets the lengths ScoreMods reads
  const ScoreMods<T> mods(p, b);
  const int last_row = min(m0 + BLOCK_M, p.nq) - 1, last_key = min(n0 + BLOCK_N, p.nk) - 1;
  const bool visible = n0 <= mods.last_key(last_row) && last_key >= mods.first_key(m0) &&
                       (!mods.block_mask || mods.block_mask[(m0 / BLOCK_MASK_TILE) * p.block_mask_stride[3] +
                                                            (n0 / BLOCK_MASK_TILE) * p.block_mask_stride[4]]);

  using A = acc_t<T>;
  A acc_s[S_TILES][4];
  zero_acc(acc_s);
  if (visible) {
    const T* q = static_cast<const T*>(p.q) + batch_offset(p.q_stride, b, p) + m0 * p.q_stride[3];
    const T* k = static_cast<const T*>(p.k) + batch_offset(p.k_stride, b, p) + n0 * p.k_stride[3];
    load_tile_async<QTile, THREADS>(sQ, q, p.q_stride[3], p.nq - m0, p.d_qk);
    load_tile_async<KTile, THREADS>(sK, k, p.k_stride[3], p.nk - n0, p.d_qk);
    cp_async_commit();
    cp_async_wait<0>();
    smem_publish<QTile>();
    __syncthreads();
    gemm_abt<T, HEAD_DIM, S_TILES, QTile, KTile>(acc_s, sQ, warp * 16, sK, lane);
    mods.template apply<false>(acc_s, m0 + warp * 16, n0, lane,
                               mods.needs_bounds(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1));
  }

  A* probs = static_cast<A*>(p.out) + static_cast<i64>(b) * p.nq * p.nk;
  const A exp_scale = mods.exp_scale();  // raw scores keep the scale folded in, as in the forward
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = m0 + warp * 16 + g + 8 * r;
    if (row >= p.nq) continue;
    const A lse = static_cast<const A*>(p.lse)[static_cast<i64>(b) * p.nq + row];
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = n0 + j * 8 + 2 * t + c;
        // A hidden score (-inf) or a row that sees no key (lse = -inf) has probability 0.
        const A x = acc_s[j][2 * r + c];
        const A prob = visible && lse != neg_inf() ? fast_exp2(x * exp_scale - lse * log2e<A>()) : A(0);
        if (col < p.nk) probs[static_cast<i64>(row) * p.nk + col] = prob;
      }
    }
  }
}
