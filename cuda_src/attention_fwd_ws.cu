// attention_fwd_ws.cu — the warp-specialized fused attention forward (Hopper, fp16/bf16, and the FP8 forward on
// e4m3 inputs): out = softmax(scale * q k^T) v and its log-sum-exp, as attention_fwd.cu computes them, in
// FlashAttention-3's layout.
//
// Layout: q (b, nq, d), k (b, nk, d), v (b, nk, dv) of one dense batch, read through TMA tensor maps (tma.cuh;
// FP8: v as V^T (b, dv, nk rounded up to 32), keys in the P fragments' order); out (b, nq, dv) of OutT (T; float32
// unrounded; 16 bits for e4m3 inputs) and lse (b, nq) float32, contiguous. Saves for the backward: lse only (the FP8
// forward has no backward). 16-bit inputs (but ALiBi's and the bounded softcap's forms): out divides O by the row
// sums of the rounded P that O's products took, from the tensor cores (ROW_SUMS); lse keeps the float32 sum of the
// unrounded P.
//
// A persistent CTA per SM: warpgroup 0 copies (copy_tiles: q per tile, then the K/V tiles of its key blocks into
// a ring of STAGES slots; with STORE_WARPS, warps 1 .. WGS store out), warpgroups 1 .. WGS compute 64 rows each
// (compute_tile: S_j = Q K_j^T beside the previous block's P V, the online softmax under it), all synchronized by
// mbarriers alone. Tiles come from a per-launch counter (tile_counter: one int, zero at launch; the launch's last
// draw zeroes it again), ordered in L2 sections (WsCta::tile_at). The forms (MODS, BOUNDED, ALIBI, HALF_FIRST,
// BLOCK_MASK, FP8's PV_COLS and S_FIRST) and the measurements behind each choice:
// docs/design/warp_specialized_forward.md and docs/design/fp8.md.
#include "common.cuh"
#include "params.cuh"
#include "mods.cuh"
#include "seq_info.cuh"
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
// special-function unit, whose queue then stalls the warps: in the bounded form the n-tiles of POLY_TILES
// take poly_exp2 on the FMA units instead, and each score's tanh and exponential come in one pass, so that
// the FMA units' work fills the special-function unit's queue waits. ALIBI: scores in log2 units
// (RowBlock::alibi_scores), so the softmax's scale is 1.
template <bool BOUNDED, bool ALIBI, unsigned POLY_TILES, class Rows, class Softmax, int N, int COL_TILES>
__device__ __forceinline__ void block_probs(const Rows& rows, Softmax& softmax, float (&acc_s)[N][4],
                                            const float (&alibi_cols)[COL_TILES][2], int n, int warp, int lane,
                                            float exp_scale, float (&rescale)[2]) {
  if constexpr (ALIBI) {
    float shift[2];
    rows.alibi_scores(acc_s, n, warp * 16, lane, alibi_cols, shift);
    softmax.template update<false, true>(acc_s, 1.f, rescale, 1.f, shift);
  } else if constexpr (BOUNDED) {
    // The tanh and the exponential in one pass (no slopes here: the bounded score form); the window hides keys
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

// Batch entries per L2 section of tiles (WsCta::tile_at): the CTAs at work at any time share their K/V tiles
// through L2. Row blocks outermost across the whole batch read K and V from DRAM over and over; sections of
// 8 MB keep a head's row blocks close in time (larger ones spread them too far apart, smaller ones cost the
// long rows).
template <typename T>
__device__ __forceinline__ int l2_section_entries(const AttnParams& p) {
  constexpr i64 L2_SECTION_BYTES = i64(8) << 20;
  const i64 kv_bytes = static_cast<i64>(p.nk) * (p.d_qk + p.d_v) * static_cast<i64>(sizeof(T));
  return static_cast<int>(max(i64(1), min(static_cast<i64>(p.batch), L2_SECTION_BYTES / max(i64(1), kv_bytes))));
}

// The descales of an e4m3 batch entry b (AttnParams' fp8 fields: per flat batch entry, contiguous, one per
// block of rows): q's of a warpgroup's rows, k's and v's of a key block (row blocks are multiples of
// both, or one descale per entry). Without FP8: ones, and nothing read.
template <bool FP8>
struct Fp8Descales {
  const AttnParams& p;
  int b;
  __device__ __forceinline__ Fp8Descales(const AttnParams& p_, int b_) : p(p_), b(b_) {}
  __device__ __forceinline__ float at(int which, int row) const {
    const u64 product = static_cast<u64>(row) * p.fp8_descale_magic[which];  // row / R (AttnParams)
    const int block = static_cast<int>(product >> p.fp8_descale_shift[which]);
    return p.fp8_descale[which][b * p.fp8_descale_blocks[which] + block];
  }
  __device__ __forceinline__ float q(int row) const { return FP8 ? at(0, row) : 1.f; }
  // Key block `key / BLOCK_N`'s k and v descales.
  __device__ __forceinline__ void block(int key, float& k_descale, float& v_descale) const {
    if constexpr (FP8) {
      k_descale = at(1, key);
      v_descale = at(2, key);
    }
  }
};

// The kernel's compile-time configuration: its template parameters, tile shapes and register split.
template <typename T_, int HEAD_DIM_, int BLOCK_N_, int STAGES_, bool IS_CAUSAL_, Mods MODS_, bool BOUNDED_,
          bool ALIBI_, bool HALF_FIRST_, bool BLOCK_MASK_, bool PACK_AFTER_WAIT_, bool STORE_WARPS_, typename OutT_,
          int WGS_, int PV_COLS_, bool S_FIRST_>
struct WsTraits {
  using T = T_;
  using OutT = OutT_;  // out's type: T, float (16-bit inputs, out unrounded), or for e4m3 inputs half_t or bfloat16_t
  static constexpr bool FP8 = sizeof(T) == 1;
  // An out of other bytes than T goes from the registers (finish_tile): the q buffer, of T, cannot stage it.
  static constexpr bool OUT_FROM_REGISTERS = sizeof(OutT) != sizeof(T);
  static constexpr int HEAD_DIM = HEAD_DIM_, BLOCK_N = BLOCK_N_, STAGES = STAGES_;
  static constexpr bool IS_CAUSAL = IS_CAUSAL_, BOUNDED = BOUNDED_, ALIBI = ALIBI_, HALF_FIRST = HALF_FIRST_;
  static constexpr bool BLOCK_MASK = BLOCK_MASK_, PACK_AFTER_WAIT = PACK_AFTER_WAIT_, STORE_WARPS = STORE_WARPS_;
  static constexpr Mods MODS = MODS_;
  // WGS computing warpgroups of 64 rows each: two, or three (FlashAttention-3's 192-row tiles at small head
  // dims: the softmax's exponentials there weigh as much as the products, and a third warpgroup's overlap them).
  static constexpr int WGS = WGS_, WG_ROWS = 64, BLOCK_M = WGS * WG_ROWS;
  using QTile = SwizzledTile<T, WG_ROWS, HEAD_DIM>;  // one warpgroup's q rows; stages its out at the end
  using KVTile = SwizzledTile<T, BLOCK_N, HEAD_DIM>;
  // V's tile: as K's, read transposed by P V; for e4m3 V^T's (head dims as rows, keys as K-major columns), as
  // 8-bit products have no transposed B.
  using VTile = typename Select<FP8, SwizzledTile<T, HEAD_DIM, BLOCK_N>, KVTile>::type;
  static constexpr int S_TILES = BLOCK_N / 8, O_TILES = HEAD_DIM / 8, P_STEPS = BLOCK_N / wgmma_k<T>();
  // e4m3: a key block's P V goes into accumulators of its own (8-bit products keep about 13 significant bits of
  // the accumulator they add to), which O then adds in float32: whole, or in PV_CHUNKS chunks of PV_COLS columns
  // (the tile table's vN) where a second accumulator as wide as O does not fit beside it and S's. S_FIRST (s): a
  // key block's S and its softmax run alone, then the previous block's P V, so that S's registers and the P V
  // chunks' never live at once (HEAD_DIM 256, whose O takes 128 of a computing thread's 232 registers).
  // Otherwise the chunks take turns in two accumulators, one chunk's product running while the previous one is
  // added.
  static constexpr int PV_COLS = PV_COLS_;
  static constexpr bool S_FIRST = S_FIRST_;
  static constexpr int PV_CHUNKS = PV_COLS ? HEAD_DIM / PV_COLS : 1;
  static constexpr int PV_TILES = O_TILES / PV_CHUNKS, PV_BUFFERS = PV_CHUNKS > 1 && !S_FIRST ? 2 : 1;
  // The bounded softcap's exponentials on the FMA units: one n-tile of S in eight (more cost time).
  static constexpr unsigned SOFTCAP_POLY_TILES = 0x80808080u & ((1u << S_TILES) - 1u);
  static constexpr u32 CONSUMER_WARPS = 4 * WGS;
  // q buffers: two, so that the next tile's q lands while this one runs, where they leave the ring room
  // (rows of at most 256 bytes); one at 16-bit HEAD_DIM 256, whose two would take 128 KiB of the 227.
  static constexpr int Q_BUFFERS = HEAD_DIM * sizeof(T) <= 256 ? 2 : 1;
  static constexpr int BARRIERS = 4 + 4 * STAGES + (STORE_WARPS ? 2 * WGS : 0);
  // Registers: 32 for the copies, 232 for each computing warpgroup (24 / 240 spilled); with the storing
  // warps 40 / 224 (32 / 232 spilled). Three computing warpgroups share the 64K registers four ways: 160
  // each beside 32 (152 beside the storing warps' 40).
  static constexpr int COPY_REGISTERS = STORE_WARPS ? 40 : 32;
  static constexpr int COMPUTE_REGISTERS = WGS == 2 ? (STORE_WARPS ? 224 : 232) : (STORE_WARPS ? 152 : 160);
  // out = O / (the row sums of the rounded P, from the tensor cores: wg_issue_pb_sum), not O / l. Not in ALiBi's
  // and the bounded softcap's forms: their column offsets and polynomial tiles leave no room for l's 4 registers
  // (4 to 12 spilled).
  static constexpr bool ROW_SUMS = !FP8 && !ALIBI && !BOUNDED;
  // The ones those products read (16-bit), after the V slots: the host's tiles.smem_bytes counts them.
  static constexpr int ONES_BYTES = FP8 ? 0 : row_sum_ones_bytes<HEAD_DIM, BLOCK_N>();
  // the N = 72 products' LBO, from a V slot to the ones after the last, in the descriptor's 18 bits of bytes
  static_assert(ONES_BYTES != BLOCK_N * 128 || STAGES * VTile::SIZE * sizeof(T) < (1 << 18), "ones within reach");

  static_assert((sizeof(T) == 2 && (MODS == Mods::none || MODS == Mods::window || MODS == Mods::dense_scalars)) ||
                    (FP8 && MODS == Mods::none && !STORE_WARPS),
                "16-bit: plain, a window alone, or the scalar modifiers on a dense batch; e4m3: plain");
  static_assert(FP8 ? sizeof(OutT) == 2 : sizeof(OutT) == sizeof(T) || sizeof(OutT) == 4,
                "out: T or float32, or 16 bits for e4m3 inputs");
  static_assert(!(OUT_FROM_REGISTERS && STORE_WARPS), "the storing warps store staged rows");
  // e4m3 visits every key block from hi down to lo (its descales are loaded a block ahead) and has no
  // half-width first block (16-bit fragments).
  static_assert(!(FP8 && (BLOCK_MASK || ALIBI || HALF_FIRST || BOUNDED)), "e4m3: plain or causal only");
  static_assert(!(IS_CAUSAL && MODS != Mods::none), "with modifiers, causal is the window's right edge");
  static_assert(STAGES >= 2, "S_j is issued beside P_(j-1) V: two slots at least");
  static_assert(PV_COLS == 0 || (FP8 && HEAD_DIM % PV_COLS == 0 && PV_COLS % 16 == 0), "e4m3: chunks of 16k columns");
  static_assert(PV_CHUNKS == 1 || !PACK_AFTER_WAIT, "P V in chunks reads P_(j-1) while P_j is packed apart");
  static_assert(!S_FIRST || (FP8 && PV_CHUNKS > 1), "S first: the e4m3 forward's chunked P V");
  static_assert(!BOUNDED || (MODS == Mods::dense_scalars && IsBfloat16<T>::value), "bounded: bfloat16 scalars");
  static_assert(!ALIBI || (MODS == Mods::dense_scalars && !BOUNDED), "ALiBi folded: the scalars, row max");
  static_assert(!HALF_FIRST || ALIBI, "the half-width first block: ALiBi's form");
  static_assert(WGS == 2 || (WGS == 3 && !BLOCK_MASK && !HALF_FIRST), "two or three computing warpgroups");
  static_assert(!BLOCK_MASK ||
                    (MODS == Mods::dense_scalars && BLOCK_M == BLOCK_MASK_TILE && BLOCK_N == BLOCK_MASK_TILE),
                "the block mask: the scalars, a tile and a key block per block-mask tile");
};

// One CTA's shared buffers and barriers, and the order of its tiles: what its producer, its storing warps
// and its consumers share (shared-memory addresses, and numbers every thread computes alike).
template <class K>
struct WsCta {
  using T = typename K::T;
  const AttnParams& p;
  T* sQ;  // [Q_BUFFERS][WGS] QTile
  T* sK;  // [STAGES] KVTile
  T* sV;  // [STAGES] VTile
  u64* bars;
  int* tile_ids;                  // the tile whose q is in each buffer (>= tiles: none left), published by q_full
  int* section_entries;           // HALF_FIRST: l2_section_entries, read per tile
  const void* ones;               // K::ONES_BYTES of 16-bit ones (wg_issue_pb_sum)
  int row_blocks = 0, tiles = 0;  // set after the barriers' initialization
  int section_group = 0;          // l2_section_entries; HALF_FIRST reads section_entries instead (one register less
                                  // across the consumers' loop)

  __device__ __forceinline__ u32 q_full(int buffer) const { return smem_u32(&bars[buffer]); }
  __device__ __forceinline__ u32 q_empty(int buffer) const { return smem_u32(&bars[2 + buffer]); }
  __device__ __forceinline__ u32 k_full(int slot) const { return smem_u32(&bars[4 + slot]); }
  __device__ __forceinline__ u32 v_full(int slot) const { return smem_u32(&bars[4 + K::STAGES + slot]); }
  __device__ __forceinline__ u32 k_empty(int slot) const { return smem_u32(&bars[4 + 2 * K::STAGES + slot]); }
  __device__ __forceinline__ u32 v_empty(int slot) const { return smem_u32(&bars[4 + 3 * K::STAGES + slot]); }
  // A computing warpgroup's out staged in its own QTile of a q buffer, for its storing warp.
  __device__ __forceinline__ u32 out_full(int buffer, int group) const {
    return smem_u32(&bars[4 + 4 * K::STAGES + K::WGS * buffer + group]);
  }

  // Thread 0, before the CTA's first barrier.
  __device__ __forceinline__ void init_barriers() const {
    for (int buffer = 0; buffer < K::Q_BUFFERS; ++buffer) {
      mbar_init(q_full(buffer), 1);
      // Every thread of the storing warps, or of the computing ones, arrives once it has read what it reads of
      // the buffer (and tile_ids): its own arrival orders its own reads before the next tile's copy.
      mbar_init(q_empty(buffer), (K::STORE_WARPS ? K::WGS : K::CONSUMER_WARPS) * WARP_SIZE);
      if constexpr (K::STORE_WARPS) {
        for (int group = 0; group < K::WGS; ++group) mbar_init(out_full(buffer, group), 128);
      }
    }
    for (int slot = 0; slot < K::STAGES; ++slot) {
      mbar_init(k_full(slot), 1);
      mbar_init(v_full(slot), 1);
      mbar_init(k_empty(slot), K::CONSUMER_WARPS);
      mbar_init(v_empty(slot), K::CONSUMER_WARPS);
    }
    mbar_init_fence();
  }

  // Tile w: its section, then in the section row blocks from the last, batch entries inside a row block.
  __device__ __forceinline__ void tile_at(int w, int& b, int& m0) const {
    const int group = K::HALF_FIRST ? *section_entries : section_group;
    const int section = w / (group * row_blocks), r = w - section * group * row_blocks;
    const int entries = min(group, p.batch - section * group);  // the last section may hold fewer
    b = section * group + r % entries;
    m0 = (row_blocks - 1 - r / entries) * K::BLOCK_M;
  }
  // The tile in q buffer `buffer`, once q_full has published it.
  __device__ __forceinline__ int tile_in(int buffer) const { return *static_cast<volatile int*>(&tile_ids[buffer]); }
  // A slot's t-th use (t counted over the CTA's whole stream) completes phase t / STAGES of its barriers.
  __device__ __forceinline__ static u32 parity(int t) { return static_cast<u32>((t / K::STAGES) & 1); }
  // The key blocks a tile visits (producer and consumers alike): its range, and with BLOCK_MASK only the
  // blocks that are on. The largest visited block in [lo, n], or a value below lo; how many are visited in
  // [lo, hi].
  __device__ __forceinline__ static int prev_visited(int words, int n, int lo) {
    return K::BLOCK_MASK ? prev_on_block(words * 32, n, lo) : n;
  }
  __device__ __forceinline__ static int visited(int words, int lo, int hi) {
    return K::BLOCK_MASK ? count_on_blocks(words, lo, hi) : hi - lo + 1;
  }
};

// The producer: one thread issues every copy of every tile the CTA draws, q into the tile's buffer, then the
// K and V tiles of its key blocks, last to first, into the ring.
template <class K>
__device__ __forceinline__ void copy_tiles(const WsCta<K>& cta, const TensorMaps& maps, int* tile_counter) {
  using T = typename K::T;
  using QTile = typename K::QTile;
  using KVTile = typename K::KVTile;
  const AttnParams& p = cta.p;
  int t = 0;  // K/V tiles issued so far
  for (int j = 0;; ++j) {
    const int buffer = j % K::Q_BUFFERS;
    if (j >= K::Q_BUFFERS) mbar_wait(cta.q_empty(buffer), (j / K::Q_BUFFERS - 1) & 1);
    // The CTA's first tile is its index; the others come from the counter, in tile order. Each CTA draws
    // until one draw lands past the last tile: tiles - gridDim.x draws land on tiles and gridDim.x past
    // them, tiles draws in all, so the one that returns tiles - 1 is the launch's last.
    int w = blockIdx.x;
    if (j > 0) {
      const int drawn = atomicAdd(tile_counter, 1);
      if (drawn == cta.tiles - 1) atomicExch(tile_counter, 0);
      w = drawn + gridDim.x;
    }
    cta.tile_ids[buffer] = w;
    if (w >= cta.tiles) {
      mbar_arrive(cta.q_full(buffer));  // the computing warpgroups read tile_ids and leave
      break;
    }
    int b, m0;
    cta.tile_at(w, b, m0);
    const int b2 = b % p.batch2, b1 = (b / p.batch2) % p.batch1, b0 = b / p.batch2 / p.batch1;
    const SeqInfo<false> seq(p, b);
    const RowBlock<typename K::OutT, 8, K::BLOCK_M, K::BLOCK_N, K::IS_CAUSAL, K::MODS> rows(p, b, seq, m0, nullptr);
    const int words = buffer * TILE_BITMAP_WORDS;  // ws_on_words, published with tile_ids by q_full's arrival
    if constexpr (K::BLOCK_MASK) fill_on_blocks(words, p, b, m0, rows.n_first, rows.n_blocks);
    mbar_expect(cta.q_full(buffer), K::WGS * QTile::SIZE * sizeof(T));
#pragma unroll
    for (int group = 0; group < K::WGS; ++group)
      tma_load_tile<QTile>(cta.sQ + (K::WGS * buffer + group) * QTile::SIZE, maps.q, m0 + K::WG_ROWS * group, b0, b1,
                           b2, cta.q_full(buffer));
    // k and v broadcast over a batch dim (stride 0: a key/value head shared by a group of query heads; the same
    // dims for both, dense._tma_reads) are mapped with that dim of one entry (tma.py): coordinate 0 there.
    const int kb0 = p.k_stride[0] ? b0 : 0, kb1 = p.k_stride[1] ? b1 : 0, kb2 = p.k_stride[2] ? b2 : 0;
    for (int n = cta.prev_visited(words, rows.n_blocks - 1, rows.n_first); n >= rows.n_first;
         n = cta.prev_visited(words, n - 1, rows.n_first), ++t) {
      const int slot = t % K::STAGES;
      if (t >= K::STAGES) mbar_wait(cta.k_empty(slot), cta.parity(t - K::STAGES));
      mbar_expect(cta.k_full(slot), KVTile::SIZE * sizeof(T));
      tma_load_tile<KVTile>(cta.sK + slot * KVTile::SIZE, maps.k, n * K::BLOCK_N, kb0, kb1, kb2, cta.k_full(slot));
      if (t >= K::STAGES) mbar_wait(cta.v_empty(slot), cta.parity(t - K::STAGES));
      mbar_expect(cta.v_full(slot), K::VTile::SIZE * sizeof(T));
      if constexpr (K::FP8)  // V^T: the block's keys are columns
        tma_load_tile<typename K::VTile>(cta.sV + slot * K::VTile::SIZE, maps.v, 0, kb0, kb1, kb2, cta.v_full(slot),
                                         n * K::BLOCK_N);
      else
        tma_load_tile<KVTile>(cta.sV + slot * KVTile::SIZE, maps.v, n * K::BLOCK_N, kb0, kb1, kb2, cta.v_full(slot));
    }
  }
}

// STORE_WARPS: warp 1 + group of the copying warpgroup stores computing warpgroup `group`'s out, staged in its
// own QTile of each tile's q buffer, so that the computing warps go on to their next tile as soon as out is
// staged (a short band's tiles spend a large share of their time in the epilogue).
template <class K>
__device__ __forceinline__ void store_out_tiles(const WsCta<K>& cta, int group, int lane) {
  using T = typename K::T;
  using QTile = typename K::QTile;
  const AttnParams& p = cta.p;
  for (int j = 0;; ++j) {
    const int buffer = j % K::Q_BUFFERS;
    const u32 phase = (j / K::Q_BUFFERS) & 1;
    mbar_wait(cta.q_full(buffer), phase);
    const int w = cta.tile_in(buffer);
    if (w >= cta.tiles) break;
    int b, m0;
    cta.tile_at(w, b, m0);
    const int row0 = m0 + K::WG_ROWS * group;  // a dense batch: its rows start at 0
    T* out = static_cast<T*>(p.out) + batch_offset(p.out_stride, b, p) + row0 * p.out_stride[3];
    mbar_wait(cta.out_full(buffer, group), phase);
    // One 16-byte chunk per lane, a row pair per step, not rolled out: store_tile's loop for 32 threads (its
    // generic one, unrolled) spilled within these warps' 40 registers.
    const T* staged = cta.sQ + (K::WGS * buffer + group) * QTile::SIZE;
    constexpr int CHUNKS = K::HEAD_DIM / QTile::VEC, ROW_STEP = WARP_SIZE / CHUNKS;
    const int c = (lane % CHUNKS) * QTile::VEC, rows = min(K::WG_ROWS, p.nq - row0);
    if (c < p.d_v) {
#pragma unroll 1
      for (int r = lane / CHUNKS; r < rows; r += ROW_STEP)
        *reinterpret_cast<uint4*>(out + r * p.out_stride[3] + c) =
            *reinterpret_cast<const uint4*>(staged + QTile::offset(r, c));
    }
    fence_async_shared();  // these reads of the buffer come before the copy of a later tile's q into it
    mbar_arrive(cta.q_empty(buffer));
  }
}

// The epilogue of one warpgroup's rows: out = O / l staged through its q rows (its products are done with
// them) and stored, and lse. STORE_WARPS hands the staged rows to the storing warp instead.
// An out of other bytes than T, stored from the registers (OUT_FROM_REGISTERS: the q buffer cannot stage it): for
// e4m3 inputs out = O * v_unit / l (O is in units of the v descale of its last block), 16 bits; for 16-bit inputs
// float32 O / l, unrounded.
template <class K, class Rows, class Softmax>
__device__ __forceinline__ void finish_tile(const WsCta<K>& cta, const Rows& rows, const Softmax& softmax,
                                            const float (&acc_o)[K::O_TILES][4], float exp_scale, int buffer, int wg,
                                            int warp, int lane, int nq, float v_unit = 1.f,
                                            const float (*row_sums)[4] = nullptr) {
  using QTile = typename K::QTile;
  const AttnParams& p = cta.p;
  typename K::T* sQ_wg = cta.sQ + (K::WGS * buffer + wg) * QTile::SIZE;
  float inv_sum[2], row_lse[2];
  softmax.finalize(exp_scale, inv_sum, row_lse, row_sums);
  if constexpr (K::OUT_FROM_REGISTERS) {
    rows.write_lse(warp * 16, row_lse, lane);
    const int row = warp * 16 + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row + 8 * r >= nq - rows.m0) continue;
      typename K::OutT* out = rows.out + static_cast<i64>(row + 8 * r) * p.out_stride[3];
      const float f = inv_sum[r] * v_unit;
#pragma unroll
      for (int j = 0; j < K::O_TILES; ++j)
        if (8 * j + col < p.d_v)
          Elem<typename K::OutT>::store2(out + 8 * j + col, acc_o[j][2 * r] * f, acc_o[j][2 * r + 1] * f);
    }
    mbar_arrive(cta.q_empty(buffer));  // q's buffer is free once the products are done
  } else {
    acc_to_smem<QTile, K::O_TILES>(sQ_wg, warp * 16, acc_o, inv_sum, lane);
    rows.write_lse(warp * 16, row_lse, lane);
    if constexpr (K::STORE_WARPS) {
      mbar_arrive(cta.out_full(buffer, wg));  // each thread's staged rows, for the storing warp
    } else {
      asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");  // this warpgroup's rows are staged
      store_tile<QTile, K::HEAD_DIM, 128>(rows.out, p.out_stride[3], sQ_wg, nq - rows.m0, p.d_v, threadIdx.x % 128);
      fence_async_shared();  // these reads of the buffer come before the copy of a later tile's q into it
      mbar_arrive(cta.q_empty(buffer));
    }
  }
}

// A consumer's work on tile w, whose q is in buffer `buffer`: the K/V tiles of the tile's key blocks, in the
// producer's order, from the ring's slot use t on (t advances past them all); S and the softmax of its own
// rows' blocks, the others waited for and released; then the epilogue.
// PACK_AFTER_WAIT: a block's P is rounded to 16 bits after the wait for the previous block's P V, straight
// into p_cur, which that product reads, so that P V takes one wgmma per k-step over all of V's columns
// (wg_issue_pb's WIDE: P's fragments read once per k-step); otherwise into p_next before the wait and copied
// over after it (ptxas serialized the wide form when P came through that copy).
template <class K>
__device__ __forceinline__ void compute_tile(const WsCta<K>& cta, int w, int buffer, int wg, int warp, int lane,
                                             int& t) {
  using T = typename K::T;
  using QTile = typename K::QTile;
  using KVTile = typename K::KVTile;
  constexpr int S_TILES = K::S_TILES, O_TILES = K::O_TILES, P_STEPS = K::P_STEPS, STAGES = K::STAGES;
  const AttnParams& p = cta.p;
  int b, m0;
  cta.tile_at(w, b, m0);
  const SeqInfo<false> seq(p, b);
  using OutT = typename K::OutT;
  // The copies' blocks (the whole tile's), and this warpgroup's rows.
  const RowBlock<OutT, 8, K::BLOCK_M, K::BLOCK_N, K::IS_CAUSAL, K::MODS> tile(p, b, seq, m0, nullptr);
  const RowBlock<OutT, 4, K::WG_ROWS, K::BLOCK_N, K::IS_CAUSAL, K::MODS> rows(p, b, seq, m0 + K::WG_ROWS * wg, nullptr);
  T* sQ_wg = cta.sQ + (K::WGS * buffer + wg) * QTile::SIZE;
  const int words = buffer * TILE_BITMAP_WORDS;  // this tile's ws_on_words (BLOCK_MASK)
  float acc_o[O_TILES][4];  // HALF_FIRST: zeroed once the first block's softmax, which can use its registers, is done
  if constexpr (!K::HALF_FIRST) zero_acc(acc_o);
  float acc_l[1][4];  // ROW_SUMS: the rounded P's row sums (each of a row's columns), rescaled with O
  zero_acc(acc_l);
  // e4m3: each key block's P V in accumulators of their own (WsTraits::PV_CHUNKS), which O then adds in float32.
  // 8-bit tensor cores keep about 13 significant bits of the accumulator they add to and cut the rest: fed O
  // itself, every k-step would cut O's low bits, an error that grows with the keys; fed a fresh one, only a
  // block's own sum is cut.
  float acc_pv[K::FP8 ? K::PV_BUFFERS : 1][K::FP8 ? K::PV_TILES : 1][4];
  OnlineSoftmax<float, K::FP8> softmax;
  softmax.init();
  // e4m3: q's descale (one per warpgroup: q's row blocks are multiples of 128, so a warpgroup's 64 rows lie
  // in one, where a 192-row tile may not) joins the exponent's scale. A warpgroup whose rows all lie past nq
  // (a short last tile) still runs; it reads the last row's descale, as the table ends there.
  const Fp8Descales<K::FP8> descales(p, b);
  const float exp_scale = K::ALIBI ? 1.f : rows.exp_scale() * descales.q(min(m0 + K::WG_ROWS * wg, p.nq - 1));
  float alibi_cols[S_TILES][2];  // ALIBI: the slope times this thread's column offsets in a key block
  if constexpr (K::ALIBI) rows.mods.alibi_columns(alibi_cols, lane);
  // e4m3: block n's k and v descales, loaded while the block before it is worked on (from global memory:
  // their latency would otherwise sit between S and the softmax). The blocks run from hi down to lo. O is
  // kept in units of v_unit, the v descale of the last block whose P V it holds: before block n's P V adds
  // to it, the softmax's factor for O takes v_unit / (n's v descale) too (1 with one descale per entry), so
  // that P is rounded on its own, its largest exactly 256 whatever v's scales.
  float k_descale = 1.f, v_descale = 1.f, v_unit = 1.f;
  auto scores_to_probs = [&](float (&acc_s)[S_TILES][4], int n, float (&rescale)[2]) {  // block_probs
    if constexpr (K::FP8) {
      // k's descale as the softmax's tile factor: row maxes stay in one unit across blocks.
      rows.scores(acc_s, n, warp * 16, lane);
      softmax.template update<true>(acc_s, exp_scale, rescale, k_descale);
      if (v_descale != v_unit) {  // warp-uniform
        const float to_block = v_unit / v_descale;
        rescale[0] *= to_block;
        rescale[1] *= to_block;
        v_unit = v_descale;
      }
      if (n > 0) descales.block((n - 1) * K::BLOCK_N, k_descale, v_descale);
    } else {
      block_probs<K::BOUNDED, K::ALIBI, K::SOFTCAP_POLY_TILES>(rows, softmax, acc_s, alibi_cols, n, warp, lane,
                                                               exp_scale, rescale);
    }
  };
  auto pack = [&](float (&acc_s)[S_TILES][4], u32(&frags)[P_STEPS][4]) {  // P as the P V product's operand
    if constexpr (K::FP8)
      pack_e4m3_fragments(acc_s, frags);
    else
      pack_fragments<T>(acc_s, frags);
  };
  // O += P V (e4m3: its first chunk, into its own accumulator), one commit group.
  auto issue_pv = [&](u32(&frags)[P_STEPS][4], const T* v_tile) {
    if constexpr (K::FP8)
      wg_issue_pbt<T, P_STEPS, K::PV_TILES, typename K::VTile>(acc_pv[0], frags, v_tile, 0);
    else if constexpr (K::ROW_SUMS)
      wg_issue_pb_sum<T, P_STEPS, O_TILES, KVTile, K::PACK_AFTER_WAIT, K::ONES_BYTES == K::BLOCK_N * 128>(
          acc_o, acc_l, frags, v_tile, cta.ones);
    else
      wg_issue_pb<T, P_STEPS, O_TILES, KVTile, K::PACK_AFTER_WAIT>(acc_o, frags, v_tile, 0);
  };
  // After issue_pv and whatever ran under it, the rest of P V. e4m3: O = (O + P V) * rescale, chunk by chunk, each
  // chunk issued before the previous one is added (into the other accumulator where there are two; S_FIRST: one,
  // issued once the previous is added). 16-bit: the product is waited for (O holds it), and the caller rescales O
  // once V is released.
  auto finish_pv = [&](u32(&frags)[P_STEPS][4], const T* v_tile, const float (&rescale)[2]) {
    if constexpr (K::FP8) {
      constexpr int CHUNKS = K::PV_CHUNKS, TILES = K::PV_TILES, BUFFERS = K::PV_BUFFERS;
      using VTile = typename K::VTile;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        if (BUFFERS == 1 && c > 0) wg_issue_pbt<T, P_STEPS, TILES, VTile>(acc_pv[0], frags, v_tile, 8 * TILES * c);
        if (BUFFERS == 2 && c + 1 < CHUNKS)
          wg_issue_pbt<T, P_STEPS, TILES, VTile>(acc_pv[(c + 1) % 2], frags, v_tile, 8 * TILES * (c + 1));
        if (BUFFERS == 2 && c + 1 < CHUNKS)
          wgmma_wait<1>();
        else
          wgmma_wait<0>();
        fence_operands(acc_pv[c % BUFFERS]);
        add_rescaled<TILES>(acc_o, TILES * c, acc_pv[c % BUFFERS], rescale);
      }
    } else {
      wgmma_wait<0>();
      fence_operands(acc_o);
      if constexpr (K::ROW_SUMS) fence_operands(acc_l);
    }
    fence_fragments(frags);
  };
  const float unchanged[2] = {1.f, 1.f};
  // This warpgroup's key blocks [lo, hi] among the tile's [tile.n_first, tile.n_blocks), the first one it
  // visits (hi's, if no block mask turns it off).
  const bool has_rows = rows.m0 < seq.nq();
  const int last = has_rows ? min(rows.n_blocks, tile.n_blocks) - 1 : -1;
  const int lo = max(rows.n_first, tile.n_first);
  const int hi = cta.prev_visited(words, last, lo);
  auto pass_over = [&](int count) {  // another warpgroup's blocks: wait for them, release them
    for (int i = 0; i < count; ++i, ++t) {
      mbar_wait(cta.k_full(t % STAGES), cta.parity(t));
      mbar_wait(cta.v_full(t % STAGES), cta.parity(t));
      if (lane == 0) {
        mbar_arrive(cta.k_empty(t % STAGES));
        mbar_arrive(cta.v_empty(t % STAGES));
      }
    }
  };
  descales.block(max(hi, 0) * K::BLOCK_N, k_descale, v_descale);
  v_unit = v_descale;  // O starts empty, in block hi's units
  if (hi < lo) {
    if constexpr (K::HALF_FIRST) zero_acc(acc_o);
    pass_over(cta.visited(words, tile.n_first, tile.n_blocks - 1));
  } else {
    pass_over(cta.visited(words, hi + 1, tile.n_blocks - 1));
    // Block hi: S alone, its softmax gives P. HALF_FIRST: where these rows see no key in the block's
    // second half, both over its first half only, and P's second half is 0.
    u32 p_cur[P_STEPS][4];
    int t_cur = t;  // the slot use whose V the pending P V reads
    {
      mbar_wait(cta.k_full(t % STAGES), cta.parity(t));
      const T* k_tile = cta.sK + (t % STAGES) * KVTile::SIZE;
      float rescale[2];  // of an all-zero O: unused
      bool half = false;
      if constexpr (K::HALF_FIRST) half = rows.keys_end <= hi * K::BLOCK_N + K::BLOCK_N / 2;
      auto whole_block = [&] {
        float acc_s[S_TILES][4];
        scores_alone<T, K::HEAD_DIM, QTile, KVTile>(acc_s, sQ_wg, k_tile, cta.k_empty(t % STAGES), lane);
        scores_to_probs(acc_s, hi, rescale);
        pack(acc_s, p_cur);
      };
      if constexpr (K::HALF_FIRST) {
        if (half) {
          float acc_s[S_TILES / 2][4];
          scores_alone<T, K::HEAD_DIM, QTile, KVTile>(acc_s, sQ_wg, k_tile, cta.k_empty(t % STAGES), lane);
          block_probs<K::BOUNDED, K::ALIBI, K::SOFTCAP_POLY_TILES>(rows, softmax, acc_s, alibi_cols, hi, warp, lane,
                                                                   exp_scale, rescale);
          pack_fragments<T>(acc_s, reinterpret_cast<u32(&)[P_STEPS / 2][4]>(p_cur));
#pragma unroll
          for (int kt = P_STEPS / 2; kt < P_STEPS; ++kt)
#pragma unroll
            for (int i = 0; i < 4; ++i) p_cur[kt][i] = 0u;
        } else {
          whole_block();
        }
      } else {
        whole_block();
      }
      ++t;
    }
    if constexpr (K::HALF_FIRST) zero_acc(acc_o);
    // Blocks hi - 1 .. lo: S_n beside the previous block's P V.
    for (int n = hi - 1; n >= lo; --n, ++t) {
      if constexpr (K::BLOCK_MASK) {  // the next block that is on
        n = cta.prev_visited(words, n, lo);
        if (n < lo) break;
      }
      if constexpr (K::S_FIRST) {  // S_n alone and its softmax, then O = (O + P_prev V) * rescale in chunks
        mbar_wait(cta.k_full(t % STAGES), cta.parity(t));
        float acc_s[S_TILES][4];
        scores_alone<T, K::HEAD_DIM, QTile, KVTile>(acc_s, sQ_wg, cta.sK + (t % STAGES) * KVTile::SIZE,
                                                    cta.k_empty(t % STAGES), lane);
        float rescale[2];
        scores_to_probs(acc_s, n, rescale);
        u32 p_next[P_STEPS][4];
        pack(acc_s, p_next);
        fence_fragments(p_next);  // P packed before the products start: S's registers are free for them
        mbar_wait(cta.v_full(t_cur % STAGES), cta.parity(t_cur));
        const T* v_tile = cta.sV + (t_cur % STAGES) * K::VTile::SIZE;
        issue_pv(p_cur, v_tile);
        finish_pv(p_cur, v_tile, rescale);
        if (lane == 0) mbar_arrive(cta.v_empty(t_cur % STAGES));  // the previous V is read out
#pragma unroll
        for (int kt = 0; kt < P_STEPS; ++kt)
#pragma unroll
          for (int i = 0; i < 4; ++i) p_cur[kt][i] = p_next[kt][i];
        t_cur = t;
        continue;
      }
      mbar_wait(cta.k_full(t % STAGES), cta.parity(t));
      float acc_s[S_TILES][4];
      wg_issue_abt<T, K::HEAD_DIM, S_TILES, QTile, KVTile>(acc_s, sQ_wg, 0, cta.sK + (t % STAGES) * KVTile::SIZE);
      mbar_wait(cta.v_full(t_cur % STAGES), cta.parity(t_cur));
      issue_pv(p_cur, cta.sV + (t_cur % STAGES) * K::VTile::SIZE);
      wgmma_wait<1>();  // S_n is done; the P V is still running
      fence_operands(acc_s);
      if (lane == 0) mbar_arrive(cta.k_empty(t % STAGES));  // K is read out
      float rescale[2];
      scores_to_probs(acc_s, n, rescale);
      u32 p_next[P_STEPS][4];
      if constexpr (K::PACK_AFTER_WAIT)
        fence_operands(acc_s);  // P in float32 before the wait
      else
        pack(acc_s, p_next);
      finish_pv(p_cur, cta.sV + (t_cur % STAGES) * K::VTile::SIZE, rescale);
      if (lane == 0) mbar_arrive(cta.v_empty(t_cur % STAGES));  // the previous V is read out
      if constexpr (!K::FP8)
        rescale_rows<K::ROW_SUMS>(acc_o, acc_l, rescale);  // O = (O + P_prev V) * exp(m_old - m_new), its sums too
      if constexpr (K::PACK_AFTER_WAIT) {
        pack(acc_s, p_cur);
      } else {
#pragma unroll
        for (int kt = 0; kt < P_STEPS; ++kt)
#pragma unroll
          for (int i = 0; i < 4; ++i) p_cur[kt][i] = p_next[kt][i];
      }
      t_cur = t;
    }
    // The last block's P V.
    mbar_wait(cta.v_full(t_cur % STAGES), cta.parity(t_cur));
    issue_pv(p_cur, cta.sV + (t_cur % STAGES) * K::VTile::SIZE);
    finish_pv(p_cur, cta.sV + (t_cur % STAGES) * K::VTile::SIZE, unchanged);
    if (lane == 0) mbar_arrive(cta.v_empty(t_cur % STAGES));
    pass_over(cta.visited(words, tile.n_first, lo - 1));
  }
  finish_tile(cta, rows, softmax, acc_o, exp_scale, buffer, wg, warp, lane, seq.nq(), v_unit,
              K::ROW_SUMS ? acc_l : nullptr);
}

template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool IS_CAUSAL, Mods MODS, bool BOUNDED, bool ALIBI,
          bool HALF_FIRST, bool BLOCK_MASK, bool PACK_AFTER_WAIT, bool STORE_WARPS, typename OutT, int WGS, int PV_COLS,
          bool S_FIRST>
__global__ void __launch_bounds__((WGS + 1) * 128, 1) attention_fwd_ws_kernel(const AttnParams p,
                                                                        const __grid_constant__ TensorMaps maps,
                                                                        int* tile_counter) {
  using K = WsTraits<T, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, MODS, BOUNDED, ALIBI, HALF_FIRST, BLOCK_MASK,
                     PACK_AFTER_WAIT, STORE_WARPS, OutT, WGS, PV_COLS, S_FIRST>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) u64 bars[K::BARRIERS];
  __shared__ int tile_ids[2];
  __shared__ int section_entries;
  T* sQ = reinterpret_cast<T*>(smem_aligned(smem_raw));              // [Q_BUFFERS][WGS] QTile
  T* sK = sQ + WGS * K::Q_BUFFERS * K::QTile::SIZE;                  // [STAGES] KVTile
  T* sV = sK + STAGES * K::KVTile::SIZE;                             // [STAGES] VTile
  u32* ones = reinterpret_cast<u32*>(sV + STAGES * K::VTile::SIZE);  // ONES_BYTES
  WsCta<K> cta{p, sQ, sK, sV, bars, tile_ids, &section_entries, ones};
  if constexpr (K::ROW_SUMS) {
    for (int i = threadIdx.x; i < K::ONES_BYTES / 4; i += blockDim.x) ones[i] = Elem<T>::pack2(1.f, 1.f);
    fence_async_shared();  // before the barrier below: the products read them through the async proxy
  }
  if (threadIdx.x == 0) {
    cta.init_barriers();
    if constexpr (HALF_FIRST) section_entries = l2_section_entries<T>(p);
  }
  __syncthreads();
  cta.row_blocks = ceil_div(p.nq, K::BLOCK_M);
  cta.tiles = p.batch * cta.row_blocks;
  cta.section_group = HALF_FIRST ? 0 : l2_section_entries<T>(p);

  if (threadIdx.x < 128) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(K::COPY_REGISTERS) : "memory");
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (STORE_WARPS && warp >= 1 && warp <= WGS) {
      store_out_tiles(cta, warp - 1, lane);
      return;
    }
    if (threadIdx.x != 0) return;
    copy_tiles(cta, maps, tile_counter);
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(K::COMPUTE_REGISTERS) : "memory");
  // The warpgroup through a shuffle: warp-uniform as the compiler sees it, so the branches around the
  // products stay convergent (ptxas serializes wgmma on a path it thinks divergent).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0) - 1;
  const int warp = (threadIdx.x / WARP_SIZE) % 4, lane = threadIdx.x % WARP_SIZE;
  int t = 0;  // K/V tiles consumed so far
  for (int j = 0;; ++j) {
    const int buffer = j % K::Q_BUFFERS;
    mbar_wait(cta.q_full(buffer), (j / K::Q_BUFFERS) & 1);  // also publishes tile_ids[buffer]
    const int w = cta.tile_in(buffer);
    if (w >= cta.tiles) break;
    compute_tile(cta, w, buffer, wg, warp, lane, t);
  }
}
