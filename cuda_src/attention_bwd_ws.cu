// attention_bwd_ws.cu — the warp-specialized fused attention backward (Hopper, fp16/bf16, plain or causal, a
// dense batch): dk, dv and dq from dout, q, k, v and the preprocess's lse_log2 and delta (attention_bwd.cu's
// preprocess), with five products per tile where the two-pass backward's recomputation takes seven.
//
// Layout: q, dout (b, nq, d) and k, v (b, nk, d) of one dense batch, read through TMA tensor maps (tma.cuh);
// lse_log2 and delta (b, nq) float32; dq, dk, dv of GradT (T, or float32 for unrounded gradients: stored from the
// registers) and dk, dv (b, nk, d) contiguous. dq_accum: float32, (b, ceil(nq / BLOCK_M),
// DQ_CHAINS, DQ_RECORD: each consumer's dQ_partial in turn) in the order the dQ products' accumulators hold it
// (DqChunk), never zeroed: the first key block of a chain at a query block stores its partial there (DETERMINISTIC;
// otherwise the host zeroes it); attention_bwd_dq_convert_kernel sums the chains, scales and rounds into dq (b, nq, d).
// dq_counters: an int per (batch entry, query block, chain), zero at launch. Saves nothing.
//
// A CTA per (block of BLOCK_N = 128 keys, or 64 PAIRED, batch entry) streams every query block that sees its keys
// (KeyBlockWalk: in which order), in three warpgroups:
//  - the producer (warpgroup 0). Warp 0: K and V once; per query block, q and dout by TMA (its lane 0) and
//    lse_log2 and delta (its 32 lanes, +inf and 0 past nq) into a ring of STAGES slots. Warp 1, one lane: the
//    dq writer (bwd_write_dq), which adds both consumers' dQ_partial into dq_accum by a bulk reduce, in
//    key-block order (DETERMINISTIC). The other warps leave; the warpgroup gives its registers to the
//    consumers (setmaxnreg).
//  - two consumers (warpgroups 1 and 2), each owning 64 of the block's keys (paired: below), per query block:
//      S^T = K Q^T and dP^T = V dO^T issued together; P^T = exp2(S^T scale_log2 - lse_log2) under dP^T;
//      dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q with P^T, dS^T from registers (as the
//      two-pass backward's dK/dV pass); dS^T stored to shared memory under dV; after a barrier of both
//      consumers, each its half of dQ_partial = dS K over all 128 keys (rows when BLOCK_M is 128, else
//      columns: DQ_SPLIT_ROWS), issued before dK and staged in shared memory for the writer while dK runs
//      (DK_ACROSS: on into the next query block's S^T and dP^T).
//    dS^T has two buffers, so one consumer's store of the next block's never meets the other's dQ product
//    still reading this one's (the barrier each block keeps them within a block of each other).
//  - PAIRED (HEAD_DIM 192 and 256): both consumers on the same 64 keys, one holding dV, the other dK
//    (bwd_consume_paired); each a share of dQ_partial's columns, staged over the slot's q or dout tile.
// Barriers (tma.cuh): kv_full (K and V's bytes), step_full[STAGES] (q and dout's bytes, and the producer's 32
// lanes once their lse_log2 and delta are stored), step_empty[STAGES] (the 256 consumer threads, after the slot's
// last product; paired, the writer), dq_full (8 consumer warps, their dQ_partial staged; paired, one per slot,
// all 256 threads), dq_empty (unpaired: the writer, once its bulk copy has read the staging buffers); named
// barrier 1 (both consumers: dS^T stored; at the end, done with sK and sV before dk, dv are staged there),
// 2 + consumer (its dk, dv staged); paired, p_full and ds_full between the consumers instead of named barrier 1.
// DETERMINISTIC: dq's float32 sums run in a fixed order per query block, so dq is bitwise reproducible (as dk
// and dv are: one CTA sums each). Without it (attention_backward(deterministic=False)) the adds land in
// whatever order the CTAs reach a query block, all into chain 0 of a zeroed dq_accum.
#include "common.cuh"
#include "params.cuh"
#include "copy.cuh"
#include "wgmma.cuh"
#include "mask.cuh"
#include "transposed_scores.cuh"
#include "tma.cuh"

// q, k, v and dout's maps, one kernel parameter.
struct BwdTensorMaps {
  TensorMap q, k, v, dout;
};

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int STAGES_, bool IS_CAUSAL_, bool DETERMINISTIC_, int DQ_CHAINS_,
          bool PAIRED_, typename GradT_>
struct BwdWsTraits {
  using T = T_;
  using GradT = GradT_;  // dq, dk, dv: T, or float32 (unrounded), which the epilogues store from the registers
  static constexpr bool GRAD_FROM_REGISTERS = sizeof(GradT) != sizeof(T);
  static constexpr int HEAD_DIM = HEAD_DIM_, BLOCK_M = BLOCK_M_, STAGES = STAGES_;
  static constexpr bool IS_CAUSAL = IS_CAUSAL_, DETERMINISTIC = DETERMINISTIC_;
  // PAIRED (HEAD_DIM 192 and 256, where one consumer's dK and dV over 64 keys would take 192 or all 256 registers):
  // both consumers work on the same 64 keys, one holding dV (S^T, P^T, dV += P^T dO), the other dK (dP^T, dS^T
  // with the first's P^T handed over in shared memory, dK += dS^T Q); each then a share of dQ_partial's columns.
  static constexpr bool PAIRED = PAIRED_;
  static constexpr int BLOCK_N = PAIRED ? 64 : 128, WG_KEYS = 64;
  using KVTile = SwizzledTile<T, BLOCK_N, HEAD_DIM>;
  using QTile = SwizzledTile<T, BLOCK_M, HEAD_DIM>;    // q and dout
  using DsTile = SwizzledTile<T, BLOCK_N, BLOCK_M>;    // dS^T: the block's keys x the step's queries
  using OutTile = SwizzledTile<T, WG_KEYS, HEAD_DIM>;  // a consumer's dk or dv rows, staged in sK or sV
  static constexpr int S_TILES = BLOCK_M / 8, G_TILES = HEAD_DIM / 8, P_STEPS = BLOCK_M / 16;
  static constexpr bool DQ_SPLIT_ROWS = BLOCK_M == 128;
  // Split by columns, each consumer's share of dQ_partial is whole 64-column atoms of sK (the dQ product's B
  // operand cannot start inside one): halves at HEAD_DIM 256; at 192 two atoms for wg 0 and one for wg 1, which
  // takes P^T from wg 0 and so reaches its dQ product later.
  static constexpr int DQ_COLS0 = DQ_SPLIT_ROWS ? HEAD_DIM : (HEAD_DIM / 2 + 63) / 64 * 64;
  static constexpr int DQ_COLS1 = DQ_SPLIT_ROWS ? HEAD_DIM : HEAD_DIM - DQ_COLS0;
  __host__ __device__ static constexpr int dq_cols(int wg) { return wg == 0 ? DQ_COLS0 : DQ_COLS1; }
  __host__ __device__ static constexpr int dq_col0(int wg) { return DQ_SPLIT_ROWS ? 0 : wg * DQ_COLS0; }
  // Floats of consumer wg's dQ_partial, and where it starts in its (query block, chain) record of dq_accum.
  __host__ __device__ static constexpr int dq_chunk(int wg) { return 64 * dq_cols(wg); }
  __host__ __device__ static constexpr int dq_chunk_at(int wg) { return wg * dq_chunk(0); }
  static constexpr int DQ_RECORD = dq_chunk(0) + dq_chunk(1);  // floats per (query block, chain)
  // The ordered adds run in DQ_CHAINS chains per query block (the key block of rank r in chain r % DQ_CHAINS),
  // each into its own float32 accumulator, summed in chain order by the conversion: a key block then waits only
  // for the add DQ_CHAINS ranks before its own. The host's choice (tiles.ws_bwd_dq_chains): two where key blocks
  // reach a query block one step apart (by arrival with 128-query blocks: as many query blocks as key blocks),
  // so that an add's round trip may take two steps; one with 64-query blocks, which come two steps apart
  // already, and unordered (every add into chain 0).
  static constexpr int DQ_CHAINS = DQ_CHAINS_;
  static_assert(DQ_CHAINS >= 1 && (DETERMINISTIC || DQ_CHAINS == 1), "unordered adds go into one accumulator");
  // setmaxnreg only moves registers within the CTA's own: 168 a thread as launched (__launch_bounds__(384, 1):
  // 65536 / 384, rounded down to a multiple of 8).
  static constexpr int COPY_REGISTERS = 24, COMPUTE_REGISTERS = 240;
  static_assert(128 * COPY_REGISTERS + 256 * COMPUTE_REGISTERS <= 168 * 384, "the CTA's registers, redistributed");
  // dK += dS^T Q runs on into the next query block's S^T and dP^T, holding dS^T's fragments across the turn,
  // where they fit: 64-query blocks (with 128 ptxas serialized the products for registers).
  static constexpr bool DK_ACROSS = BLOCK_M == 64 && !PAIRED;
  static constexpr u32 CONSUMER_WARPS = 8;
  static_assert(sizeof(T) == 2 && (BLOCK_M == 64 || BLOCK_M == 128) && HEAD_DIM % 64 == 0 && DQ_COLS0 % 64 == 0 &&
                    DQ_COLS1 % 64 == 0 && DQ_COLS1 > 0,
                "16-bit; query blocks of 64 or 128; head dims in whole 64-column atoms");
  static_assert(DQ_SPLIT_ROWS || DQ_COLS0 + DQ_COLS1 == HEAD_DIM, "split by columns, the shares cover the row");
  // Paired, the q and dout tiles of a slot take the two consumers' dQ_partial once read (a float32 staging
  // buffer of its own would not fit beside them); what of wg 0's share a tile cannot hold (HEAD_DIM 192: a
  // quarter of it, 4 of its 16 n-tiles) goes to a small buffer per slot. Its chunk is laid out n-tile after
  // n-tile (DqChunk), so the first TILE_DQ_TILES n-tiles lie in the tile and the rest in the overflow.
  static constexpr int TILE_FLOATS = QTile::SIZE * static_cast<int>(sizeof(T)) / 4;
  static constexpr int DQ_OVERFLOW = PAIRED && dq_chunk(0) > TILE_FLOATS ? dq_chunk(0) - TILE_FLOATS : 0;
  static constexpr int TILE_DQ_TILES = TILE_FLOATS / 512;  // an n-tile of a chunk: 128 threads x 4 floats
  static_assert(!PAIRED || (BLOCK_M == 64 && dq_chunk(1) <= TILE_FLOATS && dq_chunk(0) <= 2 * TILE_FLOATS &&
                            TILE_FLOATS % 512 == 0),
                "paired: 64-query blocks, wg 1's dQ_partial within a tile, wg 0's within a tile and its overflow");
  static_assert(STAGES >= 2, "the next query block lands while this one is worked on");
  static_assert(sizeof(GradT) == sizeof(T) || sizeof(GradT) == 4, "gradients: T, or float32");
};

// One consumer's dQ_partial (64 rows x its columns) as a flat chunk: thread i of the warpgroup holds accumulator
// n-tile j's four values at float4 index j * 128 + i, so its stores to the staging buffer are 16 bytes wide and
// consecutive across threads. Element (r, c) of the chunk: warp w = r / 16 of the group, lane 4 (r % 8) + (c % 8)
// / 2, n-tile c / 8, value 2 (r % 16 >= 8) + c % 2.
struct DqChunk {
  __device__ __forceinline__ static int row(int thread, int e) {
    return (thread / 32) * 16 + (thread % 32) / 4 + 8 * (e >> 1);
  }
  __device__ __forceinline__ static int col(int thread, int j, int e) { return 8 * j + 2 * (thread % 4) + (e & 1); }
};

template <class K>
struct BwdWsCta {
  using T = typename K::T;
  // The shared buffers at fixed offsets from one base (one pointer held: the producer warpgroup's 24 registers
  // could not hold a pointer per buffer beside its copies' and the dq writer's state).
  T* base;
  u64* bars;
  static constexpr int K_AT = 0, V_AT = K_AT + K::KVTile::SIZE, Q_AT = V_AT + K::KVTile::SIZE;
  static constexpr int DO_AT = Q_AT + K::STAGES * K::QTile::SIZE, DS_AT = DO_AT + K::STAGES * K::QTile::SIZE;
  static constexpr int DQ_AT = DS_AT + 2 * K::DsTile::SIZE;  // in T, then float32 buffers
  // The float32 buffers: unpaired, both consumers' dQ_partial staging; paired, the P^T handed over (a
  // consumer's S^T accumulator, thread by thread) and each slot's overflow of wg 0's dQ_partial (the rest of
  // which, and wg 1's, are staged in the slot's dout and q tiles).
  static constexpr int F32_STAGED = K::PAIRED ? K::WG_KEYS * K::BLOCK_M + K::STAGES * K::DQ_OVERFLOW : K::DQ_RECORD;
  __device__ __forceinline__ T* sK() const { return base + K_AT; }
  __device__ __forceinline__ T* sV() const { return base + V_AT; }
  __device__ __forceinline__ T* sQ(int s) const { return base + Q_AT + s * K::QTile::SIZE; }
  __device__ __forceinline__ T* sdO(int s) const { return base + DO_AT + s * K::QTile::SIZE; }
  __device__ __forceinline__ T* sdS(int i) const { return base + DS_AT + i * K::DsTile::SIZE; }
  __device__ __forceinline__ float* f32() const { return reinterpret_cast<float*>(base + DQ_AT); }
  // Where consumer wg stages its dQ_partial of slot s's query block: paired, over the tile its own gradient's
  // product read (dV reads dout, dK reads q).
  __device__ __forceinline__ float* sdQ(int wg, int s) const {
    if constexpr (K::PAIRED) return reinterpret_cast<float*>(wg == 0 ? sdO(s) : sQ(s));
    return f32() + K::dq_chunk_at(wg);
  }
  // Paired, the n-tiles of wg 0's dQ_partial past its tile (HEAD_DIM 192), slot s's.
  __device__ __forceinline__ float* sdQ_overflow(int s) const {
    return f32() + K::WG_KEYS * K::BLOCK_M + s * K::DQ_OVERFLOW;
  }
  __device__ __forceinline__ float* sP() const { return f32(); }
  __device__ __forceinline__ float* sLse(int s) const { return f32() + F32_STAGED + s * K::BLOCK_M; }
  __device__ __forceinline__ float* sDelta(int s) const { return f32() + F32_STAGED + (K::STAGES + s) * K::BLOCK_M; }
  __device__ __forceinline__ u32 kv_full() const { return smem_u32(&bars[0]); }
  __device__ __forceinline__ u32 step_full(int s) const { return smem_u32(&bars[1 + s]); }
  __device__ __forceinline__ u32 step_empty(int s) const { return smem_u32(&bars[1 + K::STAGES + s]); }
  __device__ __forceinline__ u32 dq_empty() const { return smem_u32(&bars[1 + 2 * K::STAGES]); }
  // dQ_partial staged: unpaired one barrier (the consumers wait for dq_empty before staging again); paired one
  // per slot, since the consumers stage into a slot the writer has not yet released.
  __device__ __forceinline__ u32 dq_full(int s) const {
    return smem_u32(&bars[2 + 2 * K::STAGES + (K::PAIRED ? s : 0)]);
  }
  // Paired, between the two consumers (mbarriers, every thread of the arriving consumer): p_full, P^T handed
  // over (and once more at the end: wg 0 is done with sK); ds_full, dS^T stored.
  __device__ __forceinline__ u32 p_full() const { return smem_u32(&bars[2 + 3 * K::STAGES]); }
  __device__ __forceinline__ u32 ds_full() const { return smem_u32(&bars[3 + 3 * K::STAGES]); }
  static constexpr int BARRIERS = 2 + 2 * K::STAGES + (K::PAIRED ? K::STAGES + 2 : 1);
  __device__ __forceinline__ static u32 parity(int i) { return static_cast<u32>((i / K::STAGES) & 1); }
};

// The query blocks a key block's CTA visits, in its order, and where it stands among the key blocks that add to
// each (the ordered adds: DETERMINISTIC). BY_ARRIVAL (the host's choice: in order, where a batch entry's key
// blocks fit on the GPU at once; unordered, always): each key block takes its place in the order the CTAs reach a query
// block when they run in step, so that none waits while all keep pace: without a causal mask key block n starts at
// query block floor(n M / NB) (of M query blocks, NB key blocks) and goes round, so that no two are ever at the same
// one; with it, each goes up from its first query block, and at any query block the later key blocks (which start
// nearer it) come first. A CTA may then wait for one of a higher index, launched after it: the host allows it
// only where all of a batch entry's CTAs can be resident together. Otherwise every CTA goes through its query
// blocks in one order (causal: from the last down, so that all reach each at the same step), and key blocks
// add in the order of their index: a CTA then waits only for those launched before it.
template <class K>
struct KeyBlockWalk {
  int b, n, m_first, m_blocks, start;  // start: BY_ARRIVAL without a causal mask, the first query block; else -1
  __device__ __forceinline__ KeyBlockWalk(const AttnParams& p, int by_arrival) {
    b = batch_index();
    n = blockIdx.x;
    // The query blocks that see any of these keys: causal, queries from n BLOCK_N - (nk - nq) on.
    m_first = K::IS_CAUSAL ? max(0, n * K::BLOCK_N - (p.nk - p.nq)) / K::BLOCK_M : 0;
    m_blocks = ceil_div(p.nq, K::BLOCK_M);
    start = by_arrival ? (K::IS_CAUSAL ? 0 : static_cast<int>(static_cast<i64>(n) * m_blocks / key_blocks(p))) : -1;
  }
  __device__ __forceinline__ static int key_blocks(const AttnParams& p) { return ceil_div(p.nk, K::BLOCK_N); }
  __device__ __forceinline__ int steps() const { return m_blocks - m_first; }
  __device__ __forceinline__ int query_block(int i) const {
    if constexpr (K::IS_CAUSAL) return start >= 0 ? m_first + i : m_blocks - 1 - i;
    const int m = start + i;
    return start < 0 ? i : m < m_blocks ? m : m - m_blocks;
  }
  // How many key blocks add to query block m before this one.
  __device__ __forceinline__ int rank(int m, const AttnParams& p) const {
    if (start < 0) return n;
    const int nb = key_blocks(p);
    if constexpr (K::IS_CAUSAL) {  // the key blocks that see query block m: 0 .. last, the later first
      const int last = min(nb - 1, floor_div(m * K::BLOCK_M + K::BLOCK_M - 1 + (p.nk - p.nq), K::BLOCK_N));
      return last - n;
    }
    // Key block n' reaches m (d(n') = m - start(n') mod M) steps after it began; ties in index order.
    // starts_upto(x): how many key blocks start at query block x or before.
    auto starts_upto = [&](int x) {
      return x < 0 ? 0 : min(nb, static_cast<int>((static_cast<i64>(x + 1) * nb + m_blocks - 1) / m_blocks));
    };
    const int earlier = start == m  ? 0
                        : start < m ? starts_upto(m) - starts_upto(start)
                                    : nb - starts_upto(start) + starts_upto(m);
    return earlier + n - starts_upto(start - 1);
  }
};

// The producer warp: K and V, then each query block's q, dout (lane 0, TMA) and lse_log2, delta (every lane).
// The batch entry's three indices are worked out per copy, not held (24 registers). k and v broadcast over a batch
// dim (stride 0 in `strides`: a key/value head shared by a group of query heads) are mapped with that dim of one
// entry (tma.py): coordinate 0 there. Their dk and dv are written per batch entry all the same, and summed over the
// group after the call.
template <class Tile, typename T>
__device__ __forceinline__ void copy_rows(T* tile, const TensorMap& map, const AttnParams& p, int b, int row, u32 bar,
                                          const i64* strides = nullptr) {
  const int b0 = b / p.batch2 / p.batch1, b1 = (b / p.batch2) % p.batch1, b2 = b % p.batch2;
  if (strides == nullptr)
    tma_load_tile<Tile>(tile, map, row, b0, b1, b2, bar);
  else
    tma_load_tile<Tile>(tile, map, row, strides[0] ? b0 : 0, strides[1] ? b1 : 0, strides[2] ? b2 : 0, bar);
}
template <class K>
__device__ __forceinline__ void bwd_copy_tiles(const BwdWsCta<K>& cta, const AttnParams& p, const BwdTensorMaps& maps,
                                               const KeyBlockWalk<K>& walk, int lane) {
  using T = typename K::T;
  const int b = walk.b, n0 = walk.n * K::BLOCK_N;
  if (lane == 0) {
    mbar_expect(cta.kv_full(), 2 * K::KVTile::SIZE * sizeof(T));
    copy_rows<typename K::KVTile>(cta.sK(), maps.k, p, b, n0, cta.kv_full(), p.k_stride);
    copy_rows<typename K::KVTile>(cta.sV(), maps.v, p, b, n0, cta.kv_full(), p.v_stride);
  }
  const float* lse_log2 = static_cast<const float*>(p.lse_log2) + static_cast<i64>(b) * p.nq;
  const float* delta = static_cast<const float*>(p.delta) + static_cast<i64>(b) * p.nq;
#pragma unroll 1
  for (int i = 0; i < walk.steps(); ++i) {
    const int s = i % K::STAGES, row0 = walk.query_block(i) * K::BLOCK_M;
    if (i >= K::STAGES) mbar_wait(cta.step_empty(s), cta.parity(i - K::STAGES));
    // Paired (four TMA copies per tile at HEAD_DIM 256) the unrolled loads spilled in the warpgroup's 24 registers.
#pragma unroll(K::PAIRED ? 1 : K::BLOCK_M / WARP_SIZE)
    for (int r = lane; r < K::BLOCK_M; r += WARP_SIZE) {
      cta.sLse(s)[r] = row0 + r < p.nq ? lse_log2[row0 + r] : pos_inf();  // P = 0 past nq
      cta.sDelta(s)[r] = row0 + r < p.nq ? delta[row0 + r] : 0.f;
    }
    if (lane == 0) {
      mbar_expect(cta.step_full(s), 2 * K::QTile::SIZE * sizeof(T));
      copy_rows<typename K::QTile>(cta.sQ(s), maps.q, p, b, row0, cta.step_full(s));
      copy_rows<typename K::QTile>(cta.sdO(s), maps.dout, p, b, row0, cta.step_full(s));
    } else {
      mbar_arrive(cta.step_full(s));
    }
  }
}

// The ordered adds: a global counter per (batch entry, query block, chain) counts the key blocks whose
// dQ_partial has landed in that chain's accumulator; the key block of rank r (KeyBlockWalk::rank) waits until
// chain r % DQ_CHAINS's count equals r / DQ_CHAINS, adds, and counts itself.
__device__ __forceinline__ int load_acquire(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
__device__ __forceinline__ void add_release(int* counter, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

// The dq writer (the producer warpgroup's warp 1, one lane): per query block, both consumers' dQ_partial into dq_accum
// (DQ_RECORD contiguous floats there) by bulk copies: one from the contiguous staging buffers, or, paired, one from
// each of the slot's two tiles (and its overflow), after which it frees the slot. DETERMINISTIC: in rank order, the
// first stored and the others added, each count released once the adds have landed; otherwise added in any order.
// Waiting here, not in the consumers, lets them go on to the next query block (until they need the staging buffers, or
// paired the slot, again).
template <class K>
__device__ __forceinline__ void bwd_write_dq(const BwdWsCta<K>& cta, float* dq_accum, int* dq_counters,
                                             const KeyBlockWalk<K>& walk, const AttnParams& p) {
#pragma unroll 1
  for (int i = 0; i < walk.steps(); ++i) {
    const int m = walk.query_block(i), s = i % K::STAGES;
    const int rank = K::DETERMINISTIC ? walk.rank(m, p) : 0, chain = rank % K::DQ_CHAINS;
    if constexpr (K::PAIRED)
      mbar_wait(cta.dq_full(s), cta.parity(i));
    else
      mbar_wait(cta.dq_full(0), i & 1);
    // The accumulator and counter of (batch entry, query block, chain), from the kernel's arguments each time
    // (the producer warpgroup's 24 registers hold no pointers across the loop).
    const i64 at = (static_cast<i64>(walk.b) * walk.m_blocks + m) * K::DQ_CHAINS + chain;
    float* to = dq_accum + at * K::DQ_RECORD;
    int* counter = dq_counters + at;
    // The first key block of a chain stores its partial (dq_accum is not zeroed), the others add theirs in turn.
    bool store = false;
    if constexpr (K::DETERMINISTIC) {
      const int link = rank / K::DQ_CHAINS;
      while (load_acquire(counter) != link) {
      }
      store = link == 0;
    }
    // Unpaired the two chunks are contiguous in shared memory, paired each lies in its own tile of the slot
    // (wg 0's last n-tiles, past its tile, in the slot's overflow).
    auto copy = [&](int at_float, const float* from, int floats) {
      if (store)
        bulk_store(to + at_float, from, floats * 4);
      else
        bulk_reduce_add_f32(to + at_float, from, floats * 4);
    };
    if constexpr (!K::PAIRED) {
      copy(0, cta.sdQ(0, s), K::DQ_RECORD);
    } else {
      copy(0, cta.sdQ(0, s), K::dq_chunk(0) - K::DQ_OVERFLOW);
      if constexpr (K::DQ_OVERFLOW > 0) copy(K::dq_chunk(0) - K::DQ_OVERFLOW, cta.sdQ_overflow(s), K::DQ_OVERFLOW);
      copy(K::dq_chunk_at(1), cta.sdQ(1, s), K::dq_chunk(1));
    }
    bulk_commit();
    bulk_wait_read<0>();
    // The staging buffers may be written again: paired, the slot itself is free for the next query block.
    mbar_arrive(K::PAIRED ? cta.step_empty(s) : cta.dq_empty());
    if constexpr (K::DETERMINISTIC) {
      bulk_wait<0>();
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk adds before the release below
      add_release(counter, 1);
    }
  }
  bulk_wait<0>();  // the last adds have read the staging buffers before the CTA's shared memory goes away
}

// Keys [key0, key0 + 64)'s rows of a gradient (dk or dv, times row_scale) from a consumer's accumulator: staged in
// `stage` (64 rows of sK or sV, which no product reads any more), then stored; unrounded, from the registers.
template <class K>
__device__ __forceinline__ void store_gradient(const float (&acc)[K::G_TILES][4], typename K::T* stage, void* to,
                                               int stride, const float (&row_scale)[2], const AttnParams& p, int b,
                                               int key0, int wg, int warp, int lane) {
  using T = typename K::T;
  if constexpr (K::GRAD_FROM_REGISTERS) {
    using GradT = typename K::GradT;
    GradT* rows_at = static_cast<GradT*>(to) + (static_cast<i64>(b) * p.nk + key0) * stride;
    acc_to_gmem<K::G_TILES>(rows_at, stride, warp * 16, acc, row_scale, lane, p.nk - key0, stride);
    return;
  }
  acc_to_smem<typename K::OutTile, K::G_TILES>(stage, warp * 16, acc, row_scale, lane);
  named_barrier_sync(2 + wg, 128);
  const int rows = min(K::WG_KEYS, p.nk - key0);
  T* rows_at = static_cast<T*>(to) + (static_cast<i64>(b) * p.nk + key0) * stride;
  store_tile<typename K::OutTile, K::HEAD_DIM, 128>(rows_at, stride, stage, rows, stride, threadIdx.x % 128);
}

// A consumer (wg 0 or 1: keys [n0 + 64 wg, + 64) of the block) over every query block from m_first; then dk, dv.
template <class K>
__device__ __forceinline__ void bwd_consume(const BwdWsCta<K>& cta, const AttnParams& p, const KeyBlockWalk<K>& walk,
                                            int wg, int warp, int lane) {
  using T = typename K::T;
  using QTile = typename K::QTile;
  using KVTile = typename K::KVTile;
  using DsTile = typename K::DsTile;
  constexpr int S_TILES = K::S_TILES, G_TILES = K::G_TILES, P_STEPS = K::P_STEPS, BLOCK_M = K::BLOCK_M;
  const int thread = threadIdx.x % 128;
  const int b = walk.b, key0 = walk.n * K::BLOCK_N + K::WG_KEYS * wg;  // this consumer's first key
  const int offset = p.nk - p.nq;                                      // causal: query i sees key j <= i + offset
  const Mask<K::IS_CAUSAL> mask{p.nk, offset};
  const float ones[2] = {1.f, 1.f};
  float acc_dk[G_TILES][4], acc_dv[G_TILES][4];
  float* staging = cta.sdQ(wg, 0);
  mbar_wait(cta.kv_full(), 0);
  bool first = true;        // the first dV and dK products overwrite their accumulators (no zeroed registers)
  u32 ds_frag[P_STEPS][4];  // dS^T for dK += dS^T Q, which runs on into the next query block's S^T and dP^T
  for (int i = 0; i < walk.steps(); ++i) {
    const int s = i % K::STAGES, m = walk.query_block(i);
    const T* sQ_s = cta.sQ(s);
    const T* sdO_s = cta.sdO(s);
    mbar_wait(cta.step_full(s), cta.parity(i));
    float acc_s[S_TILES][4], acc_dp[S_TILES][4];
    wg_issue_abt<T, K::HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, cta.sK(), K::WG_KEYS * wg, sQ_s);
    wg_issue_abt<T, K::HEAD_DIM, S_TILES, KVTile, QTile>(acc_dp, cta.sV(), K::WG_KEYS * wg, sdO_s);
    wgmma_wait<1>();  // S^T, and the previous block's dK; dP^T still running
    fence_operands(acc_s);
    if (K::DK_ACROSS && !first) {
      fence_operands(acc_dk);
      fence_fragments(ds_frag);
      mbar_arrive(cta.step_empty((i - 1) % K::STAGES));  // the previous slot is read out
    }
    if (K::IS_CAUSAL && key0 + K::WG_KEYS - 1 > m * BLOCK_M + offset)  // keys after some of these queries
      mask.apply_transposed(acc_s, key0 + warp * 16, m * BLOCK_M, lane);
    probs_from_scores_cols(acc_s, cta.sLse(s), p.scale_log2, lane);
    wgmma_wait<0>();
    fence_operands(acc_dp);
    dscores_cols(acc_dp, acc_s, cta.sDelta(s), lane);
    u32 p_frag[P_STEPS][4];
    pack_fragments<T>(acc_s, p_frag);
    wg_issue_pb<T, P_STEPS, G_TILES, QTile>(acc_dv, p_frag, sdO_s, 0, !first);
    pack_fragments<T>(acc_dp, ds_frag);
    // dS^T into shared memory under dV, for both consumers' dQ products.
    T* sdS_i = cta.sdS(i & 1);
    acc_to_smem<DsTile, S_TILES>(sdS_i, K::WG_KEYS * wg + warp * 16, acc_dp, ones, lane);
    fence_async_shared();  // the stores before the products that read them
    named_barrier_sync(1, 256);
    constexpr int DQ_TILES = K::DQ_COLS0 / 8;  // unpaired, both shares alike
    static_assert(K::DQ_COLS0 == K::DQ_COLS1, "unpaired: halves");
    float acc_dq[DQ_TILES][4];
    wg_issue_atb<T, K::BLOCK_N / 16, DQ_TILES, DsTile, KVTile>(acc_dq, sdS_i, K::DQ_SPLIT_ROWS ? 64 * wg : 0, cta.sK(),
                                                               K::DQ_SPLIT_ROWS ? 0 : K::DQ_COLS0 * wg);
    wg_issue_pb<T, P_STEPS, G_TILES, QTile>(acc_dk, ds_frag, sQ_s, 0, !first);
    wgmma_wait<1>();  // dV and dQ_partial; dK runs on under the staging and into the next block
    fence_operands(acc_dv);
    fence_operands(acc_dq);
    fence_fragments(p_frag);
    // dQ_partial to the dq writer through this consumer's staging buffer, once its add of the previous
    // block's has read it.
    if (i > 0) mbar_wait(cta.dq_empty(), (i - 1) & 1);
#pragma unroll
    for (int j = 0; j < DQ_TILES; ++j)
      *reinterpret_cast<float4*>(staging + (j * 128 + thread) * 4) =
          make_float4(acc_dq[j][0], acc_dq[j][1], acc_dq[j][2], acc_dq[j][3]);
    fence_async_shared();  // the stores before the bulk copy that reads them
    __syncwarp();
    if (lane == 0) mbar_arrive(cta.dq_full(0));
    if constexpr (!K::DK_ACROSS) {
      wgmma_wait<0>();
      fence_operands(acc_dk);
      fence_fragments(ds_frag);
      mbar_arrive(cta.step_empty(s));
    }
    first = false;
  }
  wgmma_wait<0>();
  fence_operands(acc_dk);
  fence_fragments(ds_frag);
  if (first) {  // no query sees these keys
    zero_acc(acc_dk);
    zero_acc(acc_dv);
  }
  // dk = scale * dS^T Q summed, dv: staged in this consumer's half of sK and sV once both consumers' last dQ
  // products (which read all of sK) are done.
  named_barrier_sync(1, 256);
  const float dk_scale[2] = {p.scale, p.scale};
  store_gradient<K>(acc_dk, cta.sK() + wg * K::OutTile::SIZE, p.dk, p.d_qk, dk_scale, p, b, key0, wg, warp, lane);
  store_gradient<K>(acc_dv, cta.sV() + wg * K::OutTile::SIZE, p.dv, p.d_v, ones, p, b, key0, wg, warp, lane);
}

// A consumer of a PAIRED CTA (keys [n0, n0 + 64), both consumers): wg 0 computes S^T, P^T (handed over to wg 1
// through sP, p_full) and dV += P^T dO; wg 1 dP^T, dS^T = P^T (dP^T - delta) (stored for the dQ products,
// ds_full) and dK += dS^T Q. Once dS^T is stored, each its share of dQ_partial's columns, staged over the slot's
// dout (wg 0, and the slot's overflow) or q tile (wg 1) for the writer, which then frees the slot. Then dv
// (wg 0) or dk (wg 1).
template <class K, int WG>
__device__ __forceinline__ void bwd_consume_paired(const BwdWsCta<K>& cta, const AttnParams& p,
                                                   const KeyBlockWalk<K>& walk, int warp, int lane) {
  constexpr int wg = WG;  // each role its own straight-line code (one loop for both had ptxas serialize the products)
  using T = typename K::T;
  using QTile = typename K::QTile;
  using KVTile = typename K::KVTile;
  constexpr int S_TILES = K::S_TILES, G_TILES = K::G_TILES, P_STEPS = K::P_STEPS, BLOCK_M = K::BLOCK_M;
  const int thread = threadIdx.x % 128;
  const int b = walk.b, key0 = walk.n * K::BLOCK_N;
  const int offset = p.nk - p.nq;  // causal: query i sees key j <= i + offset
  const Mask<K::IS_CAUSAL> mask{p.nk, offset};
  const float ones[2] = {1.f, 1.f};
  float acc_g[G_TILES][4];  // dV (wg 0) or dK (wg 1)
  float* handover = cta.sP();
  mbar_wait(cta.kv_full(), 0);
  bool first = true;  // the first products overwrite acc_g (no zeroed registers)
  for (int i = 0; i < walk.steps(); ++i) {
    const int s = i % K::STAGES, m = walk.query_block(i);
    const T* sQ_s = cta.sQ(s);
    const T* sdO_s = cta.sdO(s);
    mbar_wait(cta.step_full(s), cta.parity(i));
    float acc_s[S_TILES][4];  // S^T then P^T (wg 0), dP^T then dS^T (wg 1)
    u32 frag[P_STEPS][4];     // P^T or dS^T as the gradient product's A operand
    T* sdS_i = cta.sdS(i & 1);
    if constexpr (WG == 0) {
      wg_issue_abt<T, K::HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, cta.sK(), 0, sQ_s);
      wgmma_wait<0>();
      fence_operands(acc_s);
      if (K::IS_CAUSAL && key0 + K::WG_KEYS - 1 > m * BLOCK_M + offset)  // keys after some of these queries
        mask.apply_transposed(acc_s, key0 + warp * 16, m * BLOCK_M, lane);
      probs_from_scores_cols(acc_s, cta.sLse(s), p.scale_log2, lane);
      // Thread t of wg 1 holds the same elements of dP^T as thread t here of P^T: no index math, no conflicts.
#pragma unroll
      for (int j = 0; j < S_TILES; ++j)
        *reinterpret_cast<float4*>(handover + (j * 128 + thread) * 4) =
            make_float4(acc_s[j][0], acc_s[j][1], acc_s[j][2], acc_s[j][3]);
      mbar_arrive(cta.p_full());
      pack_fragments<T>(acc_s, frag);
      wg_issue_pb<T, P_STEPS, G_TILES, QTile>(acc_g, frag, sdO_s, 0, !first);
    } else {
      wg_issue_abt<T, K::HEAD_DIM, S_TILES, KVTile, QTile>(acc_s, cta.sV(), 0, sdO_s);
      wgmma_wait<0>();
      fence_operands(acc_s);
      mbar_wait(cta.p_full(), i & 1);
      float prob[S_TILES][4];
#pragma unroll
      for (int j = 0; j < S_TILES; ++j) {
        const float4 x = *reinterpret_cast<const float4*>(handover + (j * 128 + thread) * 4);
        prob[j][0] = x.x, prob[j][1] = x.y, prob[j][2] = x.z, prob[j][3] = x.w;
      }
      dscores_cols(acc_s, prob, cta.sDelta(s), lane);
      pack_fragments<T>(acc_s, frag);
      wg_issue_pb<T, P_STEPS, G_TILES, QTile>(acc_g, frag, sQ_s, 0, !first);
      acc_to_smem<typename K::DsTile, S_TILES>(sdS_i, warp * 16, acc_s, ones, lane);
      fence_async_shared();  // the stores before the products that read them
      mbar_arrive(cta.ds_full());
    }
    // dS^T stored, for both consumers' dQ products. Wg 1 has read the handed-over P^T, which wg 0 may overwrite
    // from here; wg 1 reaches the next block's P^T (and then stores dS^T again) only once wg 0 has finished this
    // block's dQ product, so one dS^T buffer would do here: the second is the unpaired layout's.
    mbar_wait(cta.ds_full(), i & 1);
    constexpr int DQ_TILES = K::dq_cols(WG) / 8;
    float acc_dq[DQ_TILES][4];
    wg_issue_atb<T, K::BLOCK_N / 16, DQ_TILES, typename K::DsTile, KVTile>(acc_dq, sdS_i, 0, cta.sK(), K::dq_col0(WG));
    wgmma_wait<0>();
    fence_operands(acc_g);
    fence_operands(acc_dq);
    fence_fragments(frag);
    // Over the tile this consumer's gradient product read (waited for above); the other consumer's product
    // that reads it (wg 1's dP^T reads dout, wg 0's S^T reads q) finished before ds_full, or p_full. The slot
    // stays the writer's until its bulk copy has read the partial.
    float* staging = cta.sdQ(wg, s);
#pragma unroll
    for (int j = 0; j < DQ_TILES; ++j) {
      // n-tiles past the tile (wg 0 at HEAD_DIM 192) go on in the slot's overflow
      float* at = j < K::TILE_DQ_TILES ? staging + j * 512 : cta.sdQ_overflow(s) + (j - K::TILE_DQ_TILES) * 512;
      *reinterpret_cast<float4*>(at + thread * 4) = make_float4(acc_dq[j][0], acc_dq[j][1], acc_dq[j][2], acc_dq[j][3]);
    }
    fence_async_shared();  // the stores before the bulk copy that reads them
    mbar_arrive(cta.dq_full(s));
    first = false;
  }
  if (first) zero_acc(acc_g);  // no query sees these keys
  // Wg 0's last dQ product (which reads sK) is done before wg 1 stages dk there; wg 1's last dP^T (which reads
  // sV) was, before its last ds_full.
  if constexpr (WG == 0)
    mbar_arrive(cta.p_full());
  else
    mbar_wait(cta.p_full(), walk.steps() & 1);
  const float dk_scale[2] = {p.scale, p.scale};
  if constexpr (WG == 0)
    store_gradient<K>(acc_g, cta.sV(), p.dv, p.d_v, ones, p, b, key0, wg, warp, lane);
  else
    store_gradient<K>(acc_g, cta.sK(), p.dk, p.d_qk, dk_scale, p, b, key0, wg, warp, lane);
}

template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES, bool IS_CAUSAL, bool DETERMINISTIC, int DQ_CHAINS,
          bool PAIRED, typename GradT>
__global__ void __launch_bounds__(3 * 128, 1) attention_bwd_ws_kernel(const AttnParams p,
                                                                const __grid_constant__ BwdTensorMaps maps,
                                                                float* dq_accum, int* dq_counters, int by_arrival) {
  using K = BwdWsTraits<T, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, DETERMINISTIC, DQ_CHAINS, PAIRED, GradT>;
  using Cta = BwdWsCta<K>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) u64 bars[Cta::BARRIERS];
  const Cta cta{reinterpret_cast<T*>(smem_aligned(smem_raw)), bars};
  // Past 65535 entries the grid's batch axis is split over y and z (launch._grid) and its last CTAs fall past the
  // batch: the whole CTA leaves before any barrier.
  if (batch_index() >= p.batch) return;
  if (threadIdx.x == 0) {
    mbar_init(cta.kv_full(), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(cta.step_full(s), WARP_SIZE);
      // Every consumer thread: each has read lse_log2 and delta from the slot, and its own arrival orders its
      // reads before the producer's next stores there. Paired, the writer frees the slot, once every consumer
      // thread has arrived on dq_full(s) (after its reads) and the bulk copy has read the staged partials.
      mbar_init(cta.step_empty(s), PAIRED ? 1 : K::CONSUMER_WARPS * WARP_SIZE);
      if (PAIRED) mbar_init(cta.dq_full(s), K::CONSUMER_WARPS * WARP_SIZE);
    }
    if (PAIRED) {
      mbar_init(cta.p_full(), 128);
      mbar_init(cta.ds_full(), 128);
    }
    if (!PAIRED) mbar_init(cta.dq_full(0), K::CONSUMER_WARPS);
    mbar_init(cta.dq_empty(), 1);
    mbar_init_fence();
  }
  __syncthreads();
  // Each role works out its key block's walk after setmaxnreg (values live across it would crowd the
  // producer's 24 registers).
  if (threadIdx.x < 128) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(K::COPY_REGISTERS) : "memory");
    const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / WARP_SIZE), 0);
    if (warp == 0)
      bwd_copy_tiles(cta, p, maps, KeyBlockWalk<K>(p, by_arrival), threadIdx.x);
    else if (threadIdx.x == WARP_SIZE)
      bwd_write_dq(cta, dq_accum, dq_counters, KeyBlockWalk<K>(p, by_arrival), p);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(K::COMPUTE_REGISTERS) : "memory");
  // The warpgroup through a shuffle: warp-uniform as the compiler sees it (see attention_fwd_ws.cu).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0) - 1;
  const int warp = (threadIdx.x / WARP_SIZE) % 4, lane = threadIdx.x % WARP_SIZE;
  if constexpr (!PAIRED)
    bwd_consume(cta, p, KeyBlockWalk<K>(p, by_arrival), wg, warp, lane);
  else if (wg == 0)
    bwd_consume_paired<K, 0>(cta, p, KeyBlockWalk<K>(p, by_arrival), warp, lane);
  else
    bwd_consume_paired<K, 1>(cta, p, KeyBlockWalk<K>(p, by_arrival), warp, lane);
}

// One consumer's share of attention_bwd_dq_convert_kernel (below): its chunk (64 rows x COLS, at `chunk` in each
// chain's record) summed over the chains in chain order, as the accumulator fragments the dQ products held (DqChunk:
// thread's n-tile j in x[j]).
template <class K, int COLS>
__device__ __forceinline__ void sum_dq_share(const float4* chunk, int added, int thread, float (&x)[COLS / 8][4]) {
  constexpr int TILES = COLS / 8;
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const float4 y = added > 0 ? __ldg(chunk + j * 128 + thread) : make_float4(0.f, 0.f, 0.f, 0.f);
    x[j][0] = y.x, x[j][1] = y.y, x[j][2] = y.z, x[j][3] = y.w;
  }
#pragma unroll
  for (int chain = 1; chain < K::DQ_CHAINS; ++chain) {
    if (chain >= added) break;
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const float4 y = __ldg(chunk + chain * K::DQ_RECORD / 4 + j * 128 + thread);
      x[j][0] += y.x, x[j][1] += y.y, x[j][2] += y.z, x[j][3] += y.w;
    }
  }
}
// ... then scaled and rounded into `own`, from where (after the CTA's barrier) store_dq_share stores it to dq's rows
// from row0 and columns from col0.
template <class K, int COLS>
__device__ __forceinline__ void stage_dq_share(const AttnParams& p, const float (&x)[COLS / 8][4], typename K::T* own,
                                               int thread) {
  using T = typename K::T;
  // A staged row, in T: 16 bytes of padding keep the pairs' rows on other banks.
  constexpr int TILES = COLS / 8, ROW = COLS + 8;
  const int r = DqChunk::row(thread, 0);
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const int c = DqChunk::col(thread, j, 0);
    Elem<T>::store2(own + r * ROW + c, x[j][0] * p.scale, x[j][1] * p.scale);
    Elem<T>::store2(own + (r + 8) * ROW + c, x[j][2] * p.scale, x[j][3] * p.scale);
  }
}
template <class K, int COLS>
__device__ __forceinline__ void store_dq_share(const AttnParams& p, const typename K::T* own, int row0, int col0, int b,
                                               int thread) {
  using T = typename K::T;
  constexpr int ROW = COLS + 8;
  T* dq = static_cast<T*>(p.dq) + static_cast<i64>(b) * p.nq * p.d_qk;
  constexpr int PIECES = COLS / 8;  // 16-byte pieces per staged row
#pragma unroll
  for (int i = thread; i < 64 * PIECES; i += 128) {
    const int row = i / PIECES, col = (i % PIECES) * 8;
    if (row0 + row < p.nq && col0 + col < p.d_qk)
      *reinterpret_cast<uint4*>(dq + static_cast<i64>(row0 + row) * p.d_qk + col0 + col) =
          *reinterpret_cast<const uint4*>(own + row * ROW + col);
  }
}

// dq = scale * dq_accum, rounded to T: a CTA per (query block, batch entry), a thread per accumulator thread of
// the two consumers' chunks (DqChunk). A query block no key block adds to (causal: queries before every key,
// or no keys at all) has 0 for dq and nothing in dq_accum. It reads every float of its chunks before it stores
// (the compiler may not move a load of dq_accum above a store to dq, which could alias: one DRAM round trip per
// tile made this kernel latency-bound), and the rounded rows go out through shared memory as 16-byte pieces of
// whole rows (the fragments' 4-byte pairs would fill half of each 32-byte sector per store). Unrounded (GradT
// float32), the sums go out from the registers: their 8-byte pairs fill whole sectors.
template <typename T, int HEAD_DIM, int BLOCK_M, bool IS_CAUSAL, int DQ_CHAINS, bool PAIRED, typename GradT>
__global__ void __launch_bounds__(256) attention_bwd_dq_convert_kernel(const AttnParams p, const float* dq_accum) {
  using K = BwdWsTraits<T, HEAD_DIM, BLOCK_M, 2, IS_CAUSAL, true, DQ_CHAINS, PAIRED, GradT>;
  __shared__ __align__(16) T staged[2][K::GRAD_FROM_REGISTERS ? 8 : 64 * (K::DQ_COLS0 + 8)];
  const int b = batch_index(), m = blockIdx.x;
  if (b >= p.batch) return;  // a CTA past the batch (launch._grid), before the barrier: the whole CTA leaves
  // The key blocks that added to this query block: all, or causal those up to the last that sees its last row.
  const int key_blocks = ceil_div(p.nk, K::BLOCK_N);
  const int added =
      IS_CAUSAL ? min(key_blocks, floor_div(m * BLOCK_M + BLOCK_M - 1 + (p.nk - p.nq), K::BLOCK_N) + 1) : key_blocks;
  const int wg = threadIdx.x / 128, thread = threadIdx.x % 128;
  const float* record = dq_accum + (static_cast<i64>(b) * gridDim.x + m) * K::DQ_CHAINS * K::DQ_RECORD;
  // Each consumer's 64 rows x its columns: its rows from row0, its columns from col0 (of the row's d_qk, a
  // multiple of 8 on the tensor-map path, and dq's rows start on 16 bytes).
  const int row0 = m * BLOCK_M + (K::DQ_SPLIT_ROWS ? 64 * wg : 0), col0 = K::dq_col0(wg);
  const float4* chunk = reinterpret_cast<const float4*>(record + K::dq_chunk_at(wg));
  if constexpr (K::GRAD_FROM_REGISTERS) {
    const float scale[2] = {p.scale, p.scale};
    GradT* dq = static_cast<GradT*>(p.dq) + (static_cast<i64>(b) * p.nq + row0) * p.d_qk + col0;
    const int warp = thread / WARP_SIZE, lane = thread % WARP_SIZE;  // DqChunk's rows are the fragments'
    if (wg == 0) {
      float x[K::DQ_COLS0 / 8][4];
      sum_dq_share<K, K::DQ_COLS0>(chunk, added, thread, x);
      acc_to_gmem<K::DQ_COLS0 / 8>(dq, p.d_qk, warp * 16, x, scale, lane, p.nq - row0, p.d_qk - col0);
    } else {
      float x[K::DQ_COLS1 / 8][4];
      sum_dq_share<K, K::DQ_COLS1>(chunk, added, thread, x);
      acc_to_gmem<K::DQ_COLS1 / 8>(dq, p.d_qk, warp * 16, x, scale, lane, p.nq - row0, p.d_qk - col0);
    }
    return;
  }
  if (wg == 0) {
    float x[K::DQ_COLS0 / 8][4];
    sum_dq_share<K, K::DQ_COLS0>(chunk, added, thread, x);
    stage_dq_share<K, K::DQ_COLS0>(p, x, staged[0], thread);
  } else {
    float x[K::DQ_COLS1 / 8][4];
    sum_dq_share<K, K::DQ_COLS1>(chunk, added, thread, x);
    stage_dq_share<K, K::DQ_COLS1>(p, x, staged[1], thread);
  }
  __syncthreads();
  if (wg == 0)
    store_dq_share<K, K::DQ_COLS0>(p, staged[0], row0, col0, b, thread);
  else
    store_dq_share<K, K::DQ_COLS1>(p, staged[1], row0, col0, b, thread);
}
