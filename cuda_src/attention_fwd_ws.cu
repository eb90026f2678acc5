// attention_fwd_ws.cu — the warp-specialized fused attention forward (Hopper, fp16/bf16): out =
// softmax(scale * q k^T) v and its log-sum-exp, as attention_fwd.cu computes them, in FlashAttention-3's
// layout.
//
// Layout: q (b, nq, d), k (b, nk, d), v (b, nk, dv) of one dense batch, read through TMA tensor maps
// (tma.cuh; the host checks that the strides allow them); out (b, nq, dv) and lse (b, nq) float32,
// contiguous. Saved for the backward: lse only.
//
// A CTA of three warpgroups, one per SM, persistent. Tiles (BLOCK_M = 128 query rows of one batch entry) are
// numbered in sections of batch entries whose K and V fit in L2 together; in a section, row blocks from the
// last (with causal rows, the longest first). CTA c runs tile c first, then whichever tile the launch's
// counter hands it next, so CTAs that drew short tiles draw more.
//  - Warpgroup 0 copies: one thread issues every TMA copy and the others leave. Per tile, q goes into one
//    of two buffers (the next tile's q lands while this one runs), then the K and V tiles of the key
//    blocks its rows see, last to first, into a ring of STAGES (K, V) slots that runs on across tiles, so
//    the next tile's first copies overlap this one's last products and its epilogue. A slot's K and V are
//    released apart: K once both warpgroups' S = Q K^T from it is done, V after their P V, so that the
//    next K lands while the previous block's P V still reads its V (with two slots of 128-key tiles and
//    one release per slot, every block waited for its K: bench/NOTES.md, v19 and v26). It gives its
//    registers to the others (setmaxnreg). With a window, its warps 1 and 2 store out for computing
//    warpgroups 1 and 2.
//  - Warpgroups 1 and 2 each own 64 of the tile's rows and run attention_fwd_wgmma_kernel's loop on them:
//    S_j = Q K_j^T issued beside the previous block's O += P V, the online softmax of S_j under that
//    product. Both read every slot of the ring, so each K/V tile crosses L2 once per 128 rows; each
//    computes only the key blocks of its own rows' band (a window's two halves differ by a block), waits
//    for and releases the others. Their epilogue stages out through their own half of the q buffer and
//    stores it; with a window it hands the staged rows to its storing warp and goes on to the next tile.
// Barriers (tma.cuh): q_full[2] (the copy's bytes, or the copier's arrival alone once no tile is left),
// q_empty[2] (8 consumer warps, or the 2 storing warps, after the epilogue read the buffer), k_full /
// v_full[STAGES] (bytes), k_empty / v_empty[STAGES] (8 consumer warps, after their S, or P V, from the slot), and
// a window's out_full[2][2] (a computing warpgroup's 128 threads, once its out is staged). Nothing waits on a
// __syncthreads after the start, so the warpgroups drift apart and one's softmax and epilogue overlap the
// other's products.
// MODS: Mods::none (IS_CAUSAL as the plain kernels), Mods::window (the window alone, causal travelling in
// it as the right edge) or Mods::dense_scalars (window, softcap and ALiBi, as Mods::scalars' forward takes
// them, on a dense batch). BOUNDED (bfloat16 dense_scalars): softcapped scores without ALiBi, whose softmax
// takes 1 as every row's max, as attention_fwd.cu's BOUNDED instantiations do, computes each score's
// tanh and exponential in one pass, and takes one exponential in eight on the FMA units (poly_exp2). ALIBI
// (dense_scalars with slopes): the slopes' column term fused with the exponent's scale and their row term a
// shift of the softmax (ScoreMods::alibi_log2). HALF_FIRST (ALIBI with a window that has a right edge,
// causal among them): a tile's first key block, whose S and softmax nothing overlaps, runs over its first 64
// keys only where a warpgroup's rows see none in its second half (warpgroup 0 on a causal diagonal block):
// ALiBi causal 2k 3% faster; the paths that never take it lost up to 1% with it (bench/NOTES.md, v28), so
// the others compile without it. BLOCK_MASK (dense_scalars with a block mask and no other array): a tile of
// 128 rows is one line of the block mask and a key block one of its tiles; the copier fills the line's bits
// for the tile's q buffer (fill_on_blocks) before q_full publishes it, copies only the blocks that are on,
// and every computing warp walks the same blocks (block-mask row at N = 16k, 10% on: 0.67 -> 0.51 ms
// against Mods::all's forward, v29). The host sends the plain, causal and scalar-modifier 16-bit forwards
// of dense batches at the head dims of _config.WS_FWD here.
// tile_counter: one int, zero at launch; the launch's last draw zeroes it for the next launch on the stream
// (the host keeps one per stream).
#include "common.cuh"
#include "block_info.cuh"
#include "copy.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "softmax.cuh"
#include "score_mods.cuh"
#include "row_block.cuh"
#include "tma.cuh"

// Key block n's raw scores S of one warpgroup's rows (N n-tiles of 8 keys: a whole block, or a half-width
// first block's first half) -> P in place, and the factor for O. BOUNDED: the scores are at most 1, and 1
// stands for every row's max (update_bounded). With a softcap the tanh and the exponential both take the
// special-function unit, 16 results per cycle and SM, whose queue then stalls the warps (ncu: "MIO
// throttle", bench/NOTES.md v24): in the bounded form the n-tiles of POLY_TILES take poly_exp2 on the FMA
// units instead (in the row-max form it cost time), and each score's tanh and exponential come in one
// pass, so that the FMA units' work fills the special-function unit's queue waits: 4-5% faster than a pass
// of tanh, the window's mask, then a pass of exponentials (v27). ALIBI: scores in log2 units
// (RowBlock::alibi_scores), so the softmax's scale is 1.
template <bool BOUNDED, bool ALIBI, unsigned POLY_TILES, class Rows, int N, int COL_TILES>
__device__ __forceinline__ void block_probs(const Rows& rows, OnlineSoftmax<>& softmax, float (&acc_s)[N][4],
                                            const float (&alibi_cols)[COL_TILES][2], int n, int warp, int lane,
                                            float exp_scale, float (&rescale)[2]) {
  if constexpr (ALIBI) {
    float shift[2];
    rows.alibi_scores(acc_s, n, warp * 16, lane, alibi_cols, shift);
    softmax.template update<false, true>(acc_s, 1.f, rescale, 1.f, shift);
  } else if constexpr (BOUNDED) {
    // The tanh and the exponential in one pass (no slopes here: Variant.bounded); the window hides keys
    // after it, on P.
    const SoftcapTanh<typename Rows::Element, float> softcap(rows.p);
    softmax.template update_bounded<POLY_TILES>(
        acc_s, exp_scale, rescale, 1.f, [&](float raw) { return softcap.tanh_of(raw); },
        [&](float (&probs)[N][4]) { rows.hide_probs(probs, n, warp * 16, lane); });
  } else {
    rows.scores(acc_s, n, warp * 16, lane);
    softmax.update(acc_s, exp_scale, rescale);
  }
}

// A warpgroup's S over the first N n-tiles of the K tile k_tile, with nothing beside it; then K's release.
template <typename T, int HEAD_DIM, class QTile, class KVTile, int N>
__device__ __forceinline__ void scores_alone(float (&acc_s)[N][4], const T* sQ_wg, const T* k_tile, u32 k_empty,
                                             int lane) {
  wg_issue_abt<T, HEAD_DIM, N, QTile, KVTile>(acc_s, sQ_wg, 0, k_tile);
  wgmma_wait<0>();
  fence_operands(acc_s);
  if (lane == 0) mbar_arrive(k_empty);  // K is read out
}

// Batch entries per L2 section of tiles (tile_at): the CTAs at work at any time share their K/V tiles through
// L2. With row blocks outermost across the whole batch, the causal 2k forward took 1.5x as long (bench/NOTES.md,
// v20). H100's L2 holds 50 MB, but 32 MB sections spread a head's row blocks so far apart in time that K and V
// were read from DRAM two to three times over: with 8 MB the full forward at N = 512 took a quarter less time,
// and 4 MB cost the causal 8k 5% (v22, v23).
template <typename T>
__device__ __forceinline__ int l2_section_entries(const AttnParams& p) {
  constexpr i64 L2_SECTION_BYTES = i64(8) << 20;
  const i64 kv_bytes = static_cast<i64>(p.nk) * (p.d_qk + p.d_v) * static_cast<i64>(sizeof(T));
  return static_cast<int>(max(i64(1), min(static_cast<i64>(p.batch), L2_SECTION_BYTES / max(i64(1), kv_bytes))));
}

// BLOCK_MASK: which of a tile's key blocks [lo, end) have their block-mask tile on, in shared memory, one set
// per q buffer, which the copier fills per tile (fill_on_blocks) and every warp of the CTA walks: as bits
// (bit n % 32 of word n / 32 from a base word), which count_on_blocks counts, and as the largest block on
// at or below each block (-1 or a block below lo if none), which prev_on_block looks up. At module scope, so
// only the kernels that use them allocate them, and indexed from offsets: a bit scan in the computing warps'
// loop, or a pointer held across it, made the ALiBi form spill.
__shared__ u32 ws_on_words[2 * TILE_BITMAP_WORDS];
__shared__ short ws_prev_on[2 * 32 * TILE_BITMAP_WORDS];
// The largest block in [lo, n] that is on, or a value below lo.
__device__ __forceinline__ int prev_on_block(int base, int n, int lo) { return n >= lo ? ws_prev_on[base + n] : lo - 1; }
// How many blocks in [lo, hi] are on.
__device__ __forceinline__ int count_on_blocks(int base, int lo, int hi) {
  int count = 0;
  for (int w = lo / 32; lo <= hi && w <= hi / 32; ++w) {
    u32 bits = ws_on_words[base + w];
    if (w == lo / 32) bits &= ~0u << (lo % 32);
    if (w == hi / 32) bits &= (2u << (hi % 32)) - 1u;
    count += __popc(bits);
  }
  return count;
}
// The copier's fill for blocks [lo, end) from batch entry b's block-mask line of query tile m0 /
// BLOCK_MASK_TILE (a key block is a block-mask tile), at base words (base * 32 entries). One thread, eight
// independent loads in flight (a line of 128 tiles is one trip to L2, then L1 hits); all 32 of a word
// spilled the copier's registers.
__device__ __forceinline__ void fill_on_blocks(int base, const AttnParams& p, int b, int m0, int lo, int end) {
  const unsigned char* line = p.block_mask + batch_offset(p.block_mask_stride, b, p) + (m0 / BLOCK_MASK_TILE) * p.block_mask_stride[3];
  int last = -1;
  for (int w = lo / 32; w * 32 < end; ++w) {
    u32 bits = 0u;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
      const int n = w * 32 + i;
      if (n >= lo && n < end) {
        if (line[n * p.block_mask_stride[4]]) {
          bits |= 1u << i;
          last = n;
        }
        ws_prev_on[base * 32 + n] = static_cast<short>(last);
      }
    }
    ws_on_words[base + w] = bits;
  }
}

template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool IS_CAUSAL, Mods MODS, bool BOUNDED, bool ALIBI,
          bool HALF_FIRST, bool BLOCK_MASK>
__global__ void __launch_bounds__(3 * 128, 1)
attention_fwd_ws_kernel(const AttnParams p, const __grid_constant__ TensorMaps maps, int* tile_counter) {
  constexpr int BLOCK_M = 128, WG_ROWS = 64;
  using QTile = SwizzledTile<T, WG_ROWS, HEAD_DIM>;  // one warpgroup's q rows; stages its out at the end
  using KVTile = SwizzledTile<T, BLOCK_N, HEAD_DIM>;
  constexpr int S_TILES = BLOCK_N / 8, O_TILES = HEAD_DIM / 8, P_STEPS = S_TILES / 2;
  // The bounded softcap's exponentials on the FMA units: one n-tile of S in eight. With the tanh and the
  // exponential in one pass, 1 in 8 ran 0.6-1.4% faster than 1 in 4, which ran 4-5% faster than 1 in 2;
  // none ran 3-6% slower than 1 in 4 (bench/NOTES.md, v24, v27).
  constexpr unsigned SOFTCAP_POLY_TILES = 0x80808080u & ((1u << S_TILES) - 1u);
  // Where a block's P is rounded to 16 bits: after the wait for the previous block's P V, straight into
  // p_cur (which that product reads), or before it into p_next, copied over after the wait. After the wait,
  // P V takes one instruction per k-step over all of V's columns (wg_issue_pb's WIDE: P's fragments read
  // once per k-step, not once per 64-column atom), which the copy of p_next into p_cur made ptxas serialize
  // (C7513). Every form but the window's rounds after the wait. Measured on 128-key tiles against the
  // two-instruction P V: alone, plain and causal 4-6% faster, ALiBi 2-4%; with softmax.cuh's tree max, whose
  // gain it mostly shares, plain 0-1% and ALiBi 4-7%; the softcap within 1% (bench/NOTES.md, v25-v27). The
  // window alone, on 64-key tiles, keeps the copy.
  constexpr bool PACK_AFTER_WAIT = MODS != Mods::window;
  static_assert(sizeof(T) == 2 && (MODS == Mods::none || MODS == Mods::window || MODS == Mods::dense_scalars),
                "16-bit; plain, a window alone, or the scalar modifiers on a dense batch");
  static_assert(!(IS_CAUSAL && MODS != Mods::none), "with modifiers, causal is the window's right edge");
  static_assert(STAGES >= 2, "S_j is issued beside P_(j-1) V: two slots at least");
  static_assert(!BOUNDED || (MODS == Mods::dense_scalars && IsBfloat16<T>::value), "bounded: bfloat16 scalars");
  static_assert(!ALIBI || (MODS == Mods::dense_scalars && !BOUNDED), "ALiBi folded: the scalars, row max");
  static_assert(!HALF_FIRST || ALIBI, "the half-width first block: ALiBi's form");
  static_assert(!BLOCK_MASK || (MODS == Mods::dense_scalars && BLOCK_M == BLOCK_MASK_TILE && BLOCK_N == BLOCK_MASK_TILE),
                "the block mask: the scalars, a tile and a key block per block-mask tile");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The window's epilogue (a few key blocks per tile) hands the store of out to two warps of the copying
  // warpgroup, so that its computing warps go on to the next tile as soon as out is staged: window forward
  // -2 to -4% (bench/NOTES.md, v21). The long rows of plain and causal tiles lost 1-2% with it.
  constexpr bool STORE_WARPS = MODS == Mods::window;
  __shared__ __align__(8) u64 bars[(STORE_WARPS ? 8 : 4) + 4 * STAGES];
  __shared__ int tile_ids[2];  // the tile whose q is in each buffer (>= tiles: none left), published by q_full
  __shared__ int section_entries;  // HALF_FIRST: l2_section_entries, read per tile
  T* sQ = reinterpret_cast<T*>(smem_aligned(smem_raw));  // [2 buffers][2 warpgroups] QTile
  T* sK = sQ + 4 * QTile::SIZE;                           // [STAGES] KVTile
  T* sV = sK + STAGES * KVTile::SIZE;                     // [STAGES] KVTile
  auto q_full = [&](int buffer) { return smem_u32(&bars[buffer]); };
  auto q_empty = [&](int buffer) { return smem_u32(&bars[2 + buffer]); };
  auto k_full = [&](int slot) { return smem_u32(&bars[4 + slot]); };
  auto v_full = [&](int slot) { return smem_u32(&bars[4 + STAGES + slot]); };
  auto k_empty = [&](int slot) { return smem_u32(&bars[4 + 2 * STAGES + slot]); };
  auto v_empty = [&](int slot) { return smem_u32(&bars[4 + 3 * STAGES + slot]); };
  // A computing warpgroup's out staged in its half of a q buffer, for its storing warp.
  auto out_full = [&](int buffer, int group) { return smem_u32(&bars[4 + 4 * STAGES + 2 * buffer + group]); };
  constexpr u32 CONSUMER_WARPS = 8;
  if (threadIdx.x == 0) {
    for (int buffer = 0; buffer < 2; ++buffer) {
      mbar_init(q_full(buffer), 1);
      mbar_init(q_empty(buffer), STORE_WARPS ? 2 : CONSUMER_WARPS);  // the storing warps, or the computing ones
      if constexpr (STORE_WARPS) {
        mbar_init(out_full(buffer, 0), 128);
        mbar_init(out_full(buffer, 1), 128);
      }
    }
    for (int slot = 0; slot < STAGES; ++slot) {
      mbar_init(k_full(slot), 1);
      mbar_init(v_full(slot), 1);
      mbar_init(k_empty(slot), CONSUMER_WARPS);
      mbar_init(v_empty(slot), CONSUMER_WARPS);
    }
    mbar_init_fence();
    if constexpr (HALF_FIRST) section_entries = l2_section_entries<T>(p);
  }
  __syncthreads();

  const int row_blocks = ceil_div(p.nq, BLOCK_M);
  const int tiles = p.batch * row_blocks;
  // Sections of `group` batch entries (l2_section_entries). HALF_FIRST reads it from shared memory per tile:
  // 1% faster at causal 2k than holding it in a register across the computing warps' loop (bench/NOTES.md,
  // v28).
  const int section_group = HALF_FIRST ? 0 : l2_section_entries<T>(p);
  // Tile w: its section, then in the section row blocks from the last, batch entries inside a row block.
  auto tile_at = [&](int w, int& b, int& m0) {
    const int group = HALF_FIRST ? section_entries : section_group;
    const int section = w / (group * row_blocks), r = w - section * group * row_blocks;
    const int entries = min(group, p.batch - section * group);  // the last section may hold fewer
    b = section * group + r % entries;
    m0 = (row_blocks - 1 - r / entries) * BLOCK_M;
  };
  // A slot's t-th use (t counted over the CTA's whole stream) completes phase t / STAGES of its barriers.
  auto parity = [](int t) { return static_cast<u32>((t / STAGES) & 1); };
  // The key blocks a tile visits (copier and computing warps alike): its range, and with BLOCK_MASK only the
  // blocks that are on. The largest visited block in [lo, n], or a value below lo; how many are visited in
  // [lo, hi].
  auto prev_visited = [&](int words, int n, int lo) { return BLOCK_MASK ? prev_on_block(words * 32, n, lo) : n; };
  auto visited = [&](int words, int lo, int hi) { return BLOCK_MASK ? count_on_blocks(words, lo, hi) : hi - lo + 1; };

  // Registers: 32 for the copies, 232 for each computing warpgroup (24 / 240 spilled with the tile counter);
  // with the storing warps 40 / 224 (32 / 232 spilled).
  constexpr int COPY_REGISTERS = STORE_WARPS ? 40 : 32, COMPUTE_REGISTERS = STORE_WARPS ? 224 : 232;
  if (threadIdx.x < 128) {  // the copies
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(COPY_REGISTERS) : "memory");
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (STORE_WARPS && (warp == 1 || warp == 2)) {  // warp 1 + g stores computing warpgroup g's out
      const int group = warp - 1;
      for (int j = 0;; ++j) {
        const int buffer = j & 1;
        mbar_wait(q_full(buffer), (j >> 1) & 1);
        const int w = *static_cast<volatile int*>(&tile_ids[buffer]);
        if (w >= tiles) break;
        int b, m0;
        tile_at(w, b, m0);
        const int row0 = m0 + WG_ROWS * group;  // a dense batch: its rows start at 0
        T* out = static_cast<T*>(p.out) + batch_offset(p.out_stride, b, p) + row0 * p.out_stride[3];
        mbar_wait(out_full(buffer, group), (j >> 1) & 1);
        // One 16-byte chunk per lane, a row pair per step, not rolled out: store_tile's loop for 32 threads
        // (its generic one, unrolled) spilled 128 bytes within these warps' 40 registers.
        const T* staged = sQ + (2 * buffer + group) * QTile::SIZE;
        constexpr int CHUNKS = HEAD_DIM / QTile::VEC, ROW_STEP = WARP_SIZE / CHUNKS;
        const int c = (lane % CHUNKS) * QTile::VEC, rows = min(WG_ROWS, p.nq - row0);
        if (c < p.d_v) {
#pragma unroll 1
          for (int r = lane / CHUNKS; r < rows; r += ROW_STEP)
            *reinterpret_cast<uint4*>(out + r * p.out_stride[3] + c) =
                *reinterpret_cast<const uint4*>(staged + QTile::offset(r, c));
        }
        fence_async_shared();  // these reads of the buffer come before the copy of a later tile's q into it
        __syncwarp();
        if (lane == 0) mbar_arrive(q_empty(buffer));
      }
      return;
    }
    if (threadIdx.x != 0) return;
    int t = 0;  // K/V tiles issued so far
    for (int j = 0;; ++j) {
      const int buffer = j & 1;
      if (j >= 2) mbar_wait(q_empty(buffer), ((j >> 1) - 1) & 1);
      // The CTA's first tile is its index; the others come from the counter, in tile order. Each CTA draws
      // until one draw lands past the last tile: tiles - gridDim.x draws land on tiles and gridDim.x past
      // them, tiles draws in all, so the one that returns tiles - 1 is the launch's last.
      int w = blockIdx.x;
      if (j > 0) {
        const int drawn = atomicAdd(tile_counter, 1);
        if (drawn == tiles - 1) atomicExch(tile_counter, 0);
        w = drawn + gridDim.x;
      }
      tile_ids[buffer] = w;
      if (w >= tiles) {
        mbar_arrive(q_full(buffer));  // the computing warpgroups read tile_ids and leave
        break;
      }
      int b, m0;
      tile_at(w, b, m0);
      const int b2 = b % p.batch2, b1 = (b / p.batch2) % p.batch1, b0 = b / p.batch2 / p.batch1;
      const SeqInfo<false> seq(p, b);
      const RowBlock<T, 8, BLOCK_M, BLOCK_N, IS_CAUSAL, MODS> rows(p, b, seq, m0, nullptr);
      const int words = buffer * TILE_BITMAP_WORDS;  // ws_on_words, published with tile_ids by q_full's arrival
      if constexpr (BLOCK_MASK) fill_on_blocks(words, p, b, m0, rows.n_first, rows.n_blocks);
      mbar_expect(q_full(buffer), 2 * QTile::SIZE * sizeof(T));
      tma_load_tile<QTile>(sQ + 2 * buffer * QTile::SIZE, maps.q, m0, b0, b1, b2, q_full(buffer));
      tma_load_tile<QTile>(sQ + (2 * buffer + 1) * QTile::SIZE, maps.q, m0 + WG_ROWS, b0, b1, b2, q_full(buffer));
      for (int n = prev_visited(words, rows.n_blocks - 1, rows.n_first); n >= rows.n_first;
           n = prev_visited(words, n - 1, rows.n_first), ++t) {
        const int slot = t % STAGES;
        if (t >= STAGES) mbar_wait(k_empty(slot), parity(t - STAGES));
        mbar_expect(k_full(slot), KVTile::SIZE * sizeof(T));
        tma_load_tile<KVTile>(sK + slot * KVTile::SIZE, maps.k, n * BLOCK_N, b0, b1, b2, k_full(slot));
        if (t >= STAGES) mbar_wait(v_empty(slot), parity(t - STAGES));
        mbar_expect(v_full(slot), KVTile::SIZE * sizeof(T));
        tma_load_tile<KVTile>(sV + slot * KVTile::SIZE, maps.v, n * BLOCK_N, b0, b1, b2, v_full(slot));
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(COMPUTE_REGISTERS) : "memory");
  // The warpgroup through a shuffle: warp-uniform as the compiler sees it, so the branches around the
  // products stay convergent (ptxas serializes wgmma on a path it thinks divergent).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0) - 1;
  const int warp = (threadIdx.x / WARP_SIZE) % 4, lane = threadIdx.x % WARP_SIZE;
  int t = 0;  // K/V tiles consumed so far
  for (int j = 0;; ++j) {
    const int buffer = j & 1;
    mbar_wait(q_full(buffer), (j >> 1) & 1);  // also publishes tile_ids[buffer]
    const int w = *static_cast<volatile int*>(&tile_ids[buffer]);
    if (w >= tiles) break;
    int b, m0;
    tile_at(w, b, m0);
    const SeqInfo<false> seq(p, b);
    const RowBlock<T, 8, BLOCK_M, BLOCK_N, IS_CAUSAL, MODS> tile(p, b, seq, m0, nullptr);  // the copies' blocks
    const RowBlock<T, 4, WG_ROWS, BLOCK_N, IS_CAUSAL, MODS> rows(p, b, seq, m0 + WG_ROWS * wg, nullptr);
    T* sQ_wg = sQ + (2 * buffer + wg) * QTile::SIZE;
    const int words = buffer * TILE_BITMAP_WORDS;  // this tile's ws_on_words (BLOCK_MASK)
    float acc_o[O_TILES][4];  // HALF_FIRST: zeroed once the first block's softmax, which can use its registers, is done
    if constexpr (!HALF_FIRST) zero_acc(acc_o);
    OnlineSoftmax<> softmax;
    softmax.init();
    const float exp_scale = ALIBI ? 1.f : rows.exp_scale();
    float alibi_cols[S_TILES][2];  // ALIBI: the slope times this thread's column offsets in a key block
    if constexpr (ALIBI) rows.mods.alibi_columns(alibi_cols, lane);
    auto scores_to_probs = [&](float (&acc_s)[S_TILES][4], int n, float (&rescale)[2]) {  // block_probs
      block_probs<BOUNDED, ALIBI, SOFTCAP_POLY_TILES>(rows, softmax, acc_s, alibi_cols, n, warp, lane, exp_scale,
                                                       rescale);
    };
    // This warpgroup's key blocks [lo, hi] among the tile's [tile.n_first, tile.n_blocks), the first one it
    // visits (hi's, if no block mask turns it off).
    const bool has_rows = rows.m0 < seq.nq();
    const int last = has_rows ? min(rows.n_blocks, tile.n_blocks) - 1 : -1;
    const int lo = max(rows.n_first, tile.n_first);
    const int hi = prev_visited(words, last, lo);
    auto pass_over = [&](int count) {  // another warpgroup's blocks: wait for them, release them
      for (int i = 0; i < count; ++i, ++t) {
        mbar_wait(k_full(t % STAGES), parity(t));
        mbar_wait(v_full(t % STAGES), parity(t));
        if (lane == 0) { mbar_arrive(k_empty(t % STAGES)); mbar_arrive(v_empty(t % STAGES)); }
      }
    };
    if (hi < lo) {
      if constexpr (HALF_FIRST) zero_acc(acc_o);
      pass_over(visited(words, tile.n_first, tile.n_blocks - 1));
    } else {
      pass_over(visited(words, hi + 1, tile.n_blocks - 1));
      // Block hi: S alone, its softmax gives P. HALF_FIRST: where these rows see no key in the block's
      // second half, both over its first half only, and P's second half is 0.
      u32 p_cur[P_STEPS][4];
      int t_cur = t;  // the slot use whose V the pending P V reads
      {
        mbar_wait(k_full(t % STAGES), parity(t));
        const T* k_tile = sK + (t % STAGES) * KVTile::SIZE;
        float rescale[2];  // of an all-zero O: unused
        bool half = false;
        if constexpr (HALF_FIRST) half = rows.keys_end <= hi * BLOCK_N + BLOCK_N / 2;
        if (half) {
          float acc_s[S_TILES / 2][4];
          scores_alone<T, HEAD_DIM, QTile, KVTile>(acc_s, sQ_wg, k_tile, k_empty(t % STAGES), lane);
          block_probs<BOUNDED, ALIBI, SOFTCAP_POLY_TILES>(rows, softmax, acc_s, alibi_cols, hi, warp, lane, exp_scale,
                                                           rescale);
          pack_fragments<T>(acc_s, reinterpret_cast<u32 (&)[P_STEPS / 2][4]>(p_cur));
#pragma unroll
          for (int kt = P_STEPS / 2; kt < P_STEPS; ++kt)
#pragma unroll
            for (int i = 0; i < 4; ++i) p_cur[kt][i] = 0u;
        } else {
          float acc_s[S_TILES][4];
          scores_alone<T, HEAD_DIM, QTile, KVTile>(acc_s, sQ_wg, k_tile, k_empty(t % STAGES), lane);
          scores_to_probs(acc_s, hi, rescale);
          pack_fragments<T>(acc_s, p_cur);
        }
        ++t;
      }
      if constexpr (HALF_FIRST) zero_acc(acc_o);
      // Blocks hi - 1 .. lo: S_n beside the previous block's P V.
      for (int n = hi - 1; n >= lo; --n, ++t) {
        if constexpr (BLOCK_MASK) {  // the next block that is on
          n = prev_visited(words, n, lo);
          if (n < lo) break;
        }
        mbar_wait(k_full(t % STAGES), parity(t));
        float acc_s[S_TILES][4];
        wg_issue_abt<T, HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ_wg, 0, sK + (t % STAGES) * KVTile::SIZE);
        mbar_wait(v_full(t_cur % STAGES), parity(t_cur));
        const T* v_prev = sV + (t_cur % STAGES) * KVTile::SIZE;
        wg_issue_pb<T, P_STEPS, O_TILES, KVTile, PACK_AFTER_WAIT>(acc_o, p_cur, v_prev, 0);
        wgmma_wait<1>();  // S_n is done; the P V is still running
        fence_operands(acc_s);
        if (lane == 0) mbar_arrive(k_empty(t % STAGES));  // K is read out
        float rescale[2];
        scores_to_probs(acc_s, n, rescale);
        u32 p_next[P_STEPS][4];
        if constexpr (PACK_AFTER_WAIT) fence_operands(acc_s);  // P in float32 before the wait
        else pack_fragments<T>(acc_s, p_next);
        wgmma_wait<0>();
        fence_operands(acc_o);
        fence_fragments(p_cur);
        if (lane == 0) mbar_arrive(v_empty(t_cur % STAGES));  // the previous V is read out
        rescale_rows(acc_o, rescale);  // O = (O + P_prev V) * exp(m_old - m_new)
        if constexpr (PACK_AFTER_WAIT) {
          pack_fragments<T>(acc_s, p_cur);
        } else {
#pragma unroll
          for (int kt = 0; kt < P_STEPS; ++kt)
#pragma unroll
            for (int i = 0; i < 4; ++i) p_cur[kt][i] = p_next[kt][i];
        }
        t_cur = t;
      }
      // The last block's P V.
      mbar_wait(v_full(t_cur % STAGES), parity(t_cur));
      wg_issue_pb<T, P_STEPS, O_TILES, KVTile, PACK_AFTER_WAIT>(acc_o, p_cur, sV + (t_cur % STAGES) * KVTile::SIZE, 0);
      wgmma_wait<0>();
      fence_operands(acc_o);
      fence_fragments(p_cur);
      if (lane == 0) mbar_arrive(v_empty(t_cur % STAGES));
      pass_over(visited(words, tile.n_first, lo - 1));
    }
    // Epilogue: out = O / l through this warpgroup's q rows (its products are done with them), and lse.
    float inv_sum[2], row_lse[2];
    softmax.finalize(exp_scale, inv_sum, row_lse);
    acc_to_smem<QTile, O_TILES>(sQ_wg, warp * 16, acc_o, inv_sum, lane);
    rows.write_lse(warp * 16, row_lse, lane);
    if constexpr (STORE_WARPS) {
      mbar_arrive(out_full(buffer, wg));  // each thread's staged rows, for the storing warp
    } else {
      asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");  // this warpgroup's rows are staged
      store_tile<QTile, HEAD_DIM, 128>(rows.out, p.out_stride[3], sQ_wg, seq.nq() - rows.m0, p.d_v, threadIdx.x % 128);
      fence_async_shared();  // these reads of the buffer come before the copy of a later tile's q into it
      __syncwarp();
      if (lane == 0) mbar_arrive(q_empty(buffer));
    }
  }
}
