// attention_decode.cu — attention of a few query rows per sequence against a key/value cache (decoding),
// split along the keys (FlashDecoding) with the splits merged by their log-sum-exp.
//
// Computes out = softmax(scale * q k^T + modifiers) v and lse over keys 0 .. L_b - 1 of sequence b's cache
// (L_b = cache_seqlens[b] + Nnew; query i sits at position L_b - Nq + i: the causal mask and the window are
// bottom-right aligned). The G = Hq / Hk query heads that share a key/value head are packed into one
// tile's rows, row r = g * Nq + i (query head hk * G + g, query i), so each key is read once per
// key/value head, not once per query head.
//
// Layout: q (B, Hq, Nq, D) any strides but a unit last one; cache position pos of sequence b is row pos of
// (b, hk) of a contiguous cache, or row pos % page_size of page block_table[b, pos / page_size] (kvcache.cuh).
// Grid: x = split, y = hk * row_tiles + row tile, z = b. A CTA streams its split's key tiles through a
// STAGES-deep cp.async ring, or (STAGES = 1) one buffer each for k and v whose copies interleave with the
// products. Its warps divide a tile three ways: WARPS_M row blocks of 16, WARPS_N key
// slices (each warp keeps its own online-softmax state over its slices; the states are merged in shared
// memory at the end) and WARPS_DV column slices of v (warps of one row block and key slice compute the same
// scores; a wide Dv then needs fewer accumulator registers per thread).
//
// e4m3 caches (steps of at most 8 packed rows, contiguous or in pages of a multiple of 16, run
// attention_decode_fp8.cu instead; C = e4m3_t; T, q's and out's dtype, float16 or bfloat16): a stage holds the codes
// as copied, and each key's k and v descales (copied beside them); once a tile has landed the CTA widens its codes
// to float16, exactly, into one tile each for k and v (e4m3.cuh) that the products read, in float16 (q goes to
// float16 too, scaled by a power of two where it would overflow). The descales stay out of the widened values (scaling
// them there would round every element once more): k's multiplies each score column, and v's each probability column of
// P before its rounding for P v, over the largest v descale the warp has seen (so P stays at most 1; out is rescaled
// when that grows and multiplied by it at the end).
//
// Saves: out and lse directly for a sequence that takes one split; otherwise each split's normalized out
// and lse (accumulator dtype) in out_part / lse_part, and the CTA of the last split to finish merges them
// by their log-sum-exp (decode_splits.cuh), so one launch does it all. A sequence whose values are out of range
// (kvcache.cuh), or whose block table points outside the cache where it reads, gets NaN rows.
#include "common.cuh"
#include "mma.cuh"
#include "copy.cuh"
#include "e4m3.cuh"
#include "kvcache.cuh"
#include "mask.cuh"
#include "softcap.cuh"
#include "decode_splits.cuh"

// The products' element type: q's, or float16 for e4m3 caches (the codes widen to it at one instruction per pair).
template <bool E4M3, typename T>
struct DecodeMma {
  using type = T;
};
template <typename T>
struct DecodeMma<true, T> {
  using type = half_t;
};

template <typename T, typename C, int HEAD, int WARPS_M, int WARPS_N, int WARPS_DV, int BLOCK_N, int STAGES>
struct DecodeTraits {
  using Elem = T;
  using Cached = C;                             // the cache's element: T, or e4m3_t
  static constexpr bool E4M3 = sizeof(C) == 1;  // codes widened to Mma in shared memory before the products
  using Mma = typename DecodeMma<E4M3, T>::type;
  using Acc = acc_t<T>;
  static constexpr int WARPS = WARPS_M * WARPS_N * WARPS_DV, THREADS = WARPS * WARP_SIZE;
  static constexpr int ROWS = 16 * WARPS_M;     // packed query rows per CTA
  static constexpr int KW = BLOCK_N / WARPS_N;  // keys per warp per tile
  static constexpr int S_TILES = KW / 8;        // score accumulator n-tiles per warp
  static constexpr int DVW = HEAD / WARPS_DV;   // v columns per warp
  static constexpr int O_TILES = DVW / 8;
  using QTile = PaddedTile<Mma, ROWS, HEAD>;
  using KVTile = PaddedTile<Mma, BLOCK_N, HEAD>;  // the k and v tiles the products read
  using RawTile = PaddedTile<C, BLOCK_N, HEAD>;   // as copied from the cache (KVTile itself for a 16-bit cache)
  // A stage, bytes: the k tile, the v tile, and for e4m3 each key's k descale, then each key's v descale.
  static constexpr int SCALES_OFFSET = 2 * RawTile::SIZE * static_cast<int>(sizeof(C));
  static constexpr int STAGE_BYTES = SCALES_OFFSET + (E4M3 ? 2 * BLOCK_N * static_cast<int>(sizeof(float)) : 0);
  // e4m3: the widened k and v tiles, after the stages.
  static constexpr int WIDE_BYTES = E4M3 ? 2 * KVTile::SIZE * static_cast<int>(sizeof(Mma)) : 0;
  static constexpr int OUT_STRIDE = HEAD + 1;  // merged out rows (accumulator dtype)
  // Shared memory, bytes: the q tile, the ring, and after the loop the merged out, then the split merge's
  // weights (over the ring).
  static constexpr int RING_BYTES = STAGES * STAGE_BYTES + WIDE_BYTES;
  static constexpr int OUT_BYTES = ROWS * OUT_STRIDE * static_cast<int>(sizeof(Acc));
  static constexpr int WEIGHT_BYTES = ROWS * MAX_SPLITS * static_cast<int>(sizeof(Acc));  // merge_splits
  static constexpr int MERGE_BYTES = OUT_BYTES > WEIGHT_BYTES ? OUT_BYTES : WEIGHT_BYTES;
  static constexpr int Q_BYTES = QTile::SIZE * static_cast<int>(sizeof(Mma));
  // The row states after the loop; during it, two slots of BLOCK_N row lookups (RowFetch).
  static constexpr int ROW_STATE_BYTES = 3 * WARPS_N * ROWS * static_cast<int>(sizeof(Acc));
  static constexpr int LOOKUP_BYTES = 2 * BLOCK_N * 8;
  static constexpr int STATE_BYTES = ROW_STATE_BYTES > LOOKUP_BYTES ? ROW_STATE_BYTES : LOOKUP_BYTES;
  static constexpr int SMEM = Q_BYTES + (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) + STATE_BYTES;
  static_assert(KW % 16 == 0 && DVW % 16 == 0 && HEAD % 16 == 0, "mma tiles pair up");
  static_assert(THREADS >= HEAD * static_cast<int>(sizeof(C)) / 16, "a pass covers at least one row");
  static_assert(BLOCK_N % (THREADS / (HEAD * static_cast<int>(sizeof(C)) / 16)) == 0 ||
                    THREADS / (HEAD * static_cast<int>(sizeof(C)) / 16) > BLOCK_N,
                "passes cover a tile's rows evenly");
  static_assert(!E4M3 || STAGES > 1, "e4m3 tiles are widened from a stage of their own");
};

// Where the rows of the tile at pos0 live, in shared memory (`rows`, BLOCK_N entries; row -1: past the
// sequence's end, zeros; page -1: outside the cache). A tile inside one page (a contiguous cache, or pages
// of a multiple of BLOCK_N positions) needs only its first row's. A tile's lookups are fetched from the block
// table (into registers, `RowFetch`) one tile before they are published to shared memory, and published one
// tile before its copy: the block table's latency then passes during a tile's work, never before a copy.
template <int BLOCK_N>
__device__ __forceinline__ bool whole_page(const KVCacheParams& p, int pos0, int end) {
  return pos0 + BLOCK_N <= end && (!p.paged || (p.page_size % BLOCK_N == 0 && pos0 % BLOCK_N == 0));
}

template <int BLOCK_N, int THREADS>
struct RowFetch {
  static constexpr int PER_THREAD = ceil_div(BLOCK_N, THREADS);
  CacheRow rows[PER_THREAD] = {};  // this thread's rows threadIdx.x + i * THREADS (whole: rows[0] of thread 0)
  bool whole = false;              // (a split without tiles publishes these defaults, which nothing reads)

  __device__ __forceinline__ void fetch(const KVCacheParams& p, int b, int pos0, int end) {
    whole = whole_page<BLOCK_N>(p, pos0, end);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int r = threadIdx.x + i * THREADS, pos = pos0 + r;
      const bool wanted = whole ? r == 0 : (r < BLOCK_N && pos < end);
      rows[i] = wanted ? cache_row(p, b, pos) : CacheRow{0, -1};
    }
  }
  __device__ __forceinline__ void publish(CacheRow* slot) const {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int r = threadIdx.x + i * THREADS;
      if (whole ? r == 0 : r < BLOCK_N) slot[r] = rows[i];
    }
  }
};

// Copy keys [pos0, pos0 + BLOCK_N) of sequence b (those below `end`) into a stage: the k tile and the v
// tile, zeros past `end` and past the head dims, and for e4m3 caches each key's descales; `rows` (RowFetch) says
// where the rows are. Returns false when the block table pointed outside the cache.
template <class Tr, bool LOAD_K = true, bool LOAD_V = true, typename T>
__device__ __forceinline__ bool load_stage(const KVCacheParams& p, T* stage, int b, int hk, int pos0, int end,
                                           const CacheRow* rows) {
  using Tile = typename Tr::RawTile;
  constexpr int VEC = Tile::VEC, CHUNKS = Tile::NUM_COLS / VEC, ROW_STEP = Tr::THREADS / CHUNKS;
  constexpr int PASSES = ceil_div(Tile::NUM_ROWS, ROW_STEP);
  T* k_tile = stage;
  T* v_tile = stage + Tile::SIZE;
  const T* k_base = static_cast<const T*>(p.k_cache) + hk * p.k_stride[1];
  const T* v_base = static_cast<const T*>(p.v_cache) + hk * p.v_stride[1];
  bool in_cache = true;
  const int c = (threadIdx.x % CHUNKS) * VEC, r0 = threadIdx.x / CHUNKS;
  constexpr int DST_STEP = Tile::row_shift(ROW_STEP) * static_cast<int>(sizeof(T));
  const u32 k_dst = smem_u32(k_tile + Tile::offset(r0, c)), v_dst = smem_u32(v_tile + Tile::offset(r0, c));
  if (p.vec_ok && whole_page<Tile::NUM_ROWS>(p, pos0, end)) {
    const CacheRow at = rows[0];
    in_cache = at.page >= 0;
    const T* k_src = k_base + at.page * p.k_stride[0] + (at.row + r0) * p.k_stride[2] + c;
    const T* v_src = v_base + at.page * p.v_stride[0] + (at.row + r0) * p.v_stride[2] + c;
    const bool k_ok = in_cache && c < p.d, v_ok = in_cache && c < p.dv;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      if (Tile::NUM_ROWS % ROW_STEP == 0 || r0 + pass * ROW_STEP < Tile::NUM_ROWS) {
        if (LOAD_K) cp_async_stream(k_dst + pass * DST_STEP, k_src + pass * ROW_STEP * p.k_stride[2], k_ok);
        if (LOAD_V) cp_async_stream(v_dst + pass * DST_STEP, v_src + pass * ROW_STEP * p.v_stride[2], v_ok);
      }
    }
  } else if (p.vec_ok) {
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      if (Tile::NUM_ROWS % ROW_STEP == 0 || r0 + pass * ROW_STEP < Tile::NUM_ROWS) {
        const CacheRow at = rows[r0 + pass * ROW_STEP];
        in_cache &= at.page >= 0;
        const bool row_ok = at.row >= 0 && at.page >= 0;
        const T* k_src = k_base + at.page * p.k_stride[0] + at.row * p.k_stride[2] + c;
        const T* v_src = v_base + at.page * p.v_stride[0] + at.row * p.v_stride[2] + c;
        if (LOAD_K) cp_async_stream(k_dst + pass * DST_STEP, k_src, row_ok && c < p.d);
        if (LOAD_V) cp_async_stream(v_dst + pass * DST_STEP, v_src, row_ok && c < p.dv);
      }
    }
  } else {  // rows not in whole aligned 16-byte chunks: element by element, through registers
    for (int r = threadIdx.x / WARP_SIZE; r < Tile::NUM_ROWS; r += Tr::WARPS) {
      const int pos = pos0 + r;
      CacheRow at = {0, 0};
      if (pos < end) at = cache_row(p, b, pos);
      in_cache &= at.page >= 0;
      const bool row_ok = pos < end && at.page >= 0;
      const T* k_src = k_base + at.page * p.k_stride[0] + at.row * p.k_stride[2];
      const T* v_src = v_base + at.page * p.v_stride[0] + at.row * p.v_stride[2];
      for (int col = threadIdx.x % WARP_SIZE; col < Tile::NUM_COLS; col += WARP_SIZE) {
        const T zero{};
        if (LOAD_K) k_tile[Tile::offset(r, col)] = row_ok && col < p.d ? k_src[col] : zero;
        if (LOAD_V) v_tile[Tile::offset(r, col)] = row_ok && col < p.dv ? v_src[col] : zero;
      }
    }
  }
  if constexpr (Tr::E4M3) {  // entry i: key i % BLOCK_N's k descale (i < BLOCK_N), else its v descale
    constexpr int BLOCK_N = Tile::NUM_ROWS;
    const u32 dst = smem_u32(reinterpret_cast<unsigned char*>(stage) + Tr::SCALES_OFFSET);
    const bool whole = whole_page<BLOCK_N>(p, pos0, end);  // as RowFetch published the rows
    for (int i = threadIdx.x; i < 2 * BLOCK_N; i += Tr::THREADS) {
      const int r = i % BLOCK_N;
      const CacheRow at = whole ? CacheRow{rows[0].page, rows[0].row + r} : rows[r];
      const bool is_v = i >= BLOCK_N, ok = at.row >= 0 && at.page >= 0;
      const float* src = is_v ? scale_at(p.v_scale, p.v_scale_stride, p.v_scale_block, hk, ok ? at : CacheRow{0, 0})
                              : scale_at(p.k_scale, p.k_scale_stride, p.k_scale_block, hk, ok ? at : CacheRow{0, 0});
      cp_async_small<4>(dst + i * 4, src, ok);
    }
  }
  return in_cache;
}

// e4m3 caches: a landed stage's k and v codes widened to float16 into `wide` (the k tile, then the v tile).
template <class Tr, typename C>
__device__ __forceinline__ void widen_stage(const C* stage, half_t* wide) {
  using Raw = typename Tr::RawTile;
  using Wide = typename Tr::KVTile;
  constexpr int CHUNKS = Raw::NUM_COLS / 16, PER_TILE = Raw::NUM_ROWS * CHUNKS;
  for (int i = threadIdx.x; i < 2 * PER_TILE; i += Tr::THREADS) {
    const int tile = i / PER_TILE, r = (i % PER_TILE) / CHUNKS, c = (i % CHUNKS) * 16;
    const uint4 codes = *reinterpret_cast<const uint4*>(stage + tile * Raw::SIZE + Raw::offset(r, c));
    uint4 lo, hi;
    widen_e4m3x16(codes, lo, hi);
    uint4* dst = reinterpret_cast<uint4*>(wide + tile * Wide::SIZE + Wide::offset(r, c));
    dst[0] = lo;
    dst[1] = hi;
  }
}

// MIN_CTAS: the CTAs per SM the registers are budgeted for (__launch_bounds__'s second argument). One CTA keeps
// about one tile of k or v in flight; two keep twice that, which a memory-bound step needs to reach the read roof
// (docs/design/decode.md).
template <typename T, typename C, int HEAD, int WARPS_M, int WARPS_N, int WARPS_DV, int BLOCK_N, int STAGES,
          int MIN_CTAS>
__global__ void __launch_bounds__(DecodeTraits<T, C, HEAD, WARPS_M, WARPS_N, WARPS_DV, BLOCK_N, STAGES>::THREADS,
                                  MIN_CTAS) attention_decode(const KVCacheParams p) {
  using Tr = DecodeTraits<T, C, HEAD, WARPS_M, WARPS_N, WARPS_DV, BLOCK_N, STAGES>;
  using Acc = typename Tr::Acc;
  using Mma = typename Tr::Mma;
  extern __shared__ __align__(16) unsigned char smem[];
  Mma* q_tile = reinterpret_cast<Mma*>(smem);
  unsigned char* ring = smem + Tr::Q_BYTES;
  auto stage_at = [&](int i) { return reinterpret_cast<C*>(ring + i * Tr::STAGE_BYTES); };
  Mma* wide = reinterpret_cast<Mma*>(ring + STAGES * Tr::STAGE_BYTES);      // e4m3: the widened k and v tiles
  Acc* merged = reinterpret_cast<Acc*>(smem + Tr::Q_BYTES);                 // after the loop, over the ring
  Acc* states = reinterpret_cast<Acc*>(smem + Tr::SMEM - Tr::STATE_BYTES);  // [3][WARPS_N][ROWS]

  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.row_tiles, row0 = (blockIdx.y % p.row_tiles) * Tr::ROWS;
  const int packed_rows = p.group * p.nq;
  const int length = sequence_length(p, b);
  const SplitPlan plan = split_plan<BLOCK_N>(p, length);
  if (split >= plan.splits) return;  // this sequence needs fewer splits than the grid has
  const int tile_begin = split * plan.tiles_per_split;
  const int tile_end = min(plan.tiles, tile_begin + plan.tiles_per_split);

  bool in_cache = true;
  // The ring: the split's tile n goes to stage (n - tile_begin) % STAGES, STAGES - 1 tiles ahead of the one
  // computed; its first tiles are on their way before the q tile is read (the two latencies overlap). A
  // tile's row lookups go to slot (n - tile_begin) % 2 (the states' shared memory, unused until the loop
  // ends); a barrier stands between each slot's writes and reads.
  CacheRow* lookups = reinterpret_cast<CacheRow*>(states);
  auto tile_pos = [&](int n) { return plan.begin + n * BLOCK_N; };
  auto slot = [&](int n) { return lookups + ((n - tile_begin) & 1) * BLOCK_N; };
  RowFetch<BLOCK_N, Tr::THREADS> fetched;  // the lookups of the tile after the next to copy
  auto fetch = [&](int n) {
    if (n < tile_end) fetched.fetch(p, b, tile_pos(n), length);
  };
  // The first tiles' lookups are published at once (the copies cannot start without them).
  fetch(tile_begin);
  fetched.publish(slot(tile_begin));
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int n = tile_begin + s;
    __syncthreads();
    if (n < tile_end) in_cache &= load_stage<Tr>(p, stage_at(s), b, hk, tile_pos(n), length, slot(n));
    fetch(n + 1);
    fetched.publish(slot(n + 1));
    cp_async_commit();
  }
  if constexpr (STAGES == 1) {  // one buffer each for k and v, in commit groups of their own (see the loop)
    __syncthreads();
    if (tile_begin < tile_end) {
      in_cache &= load_stage<Tr, true, false>(p, stage_at(0), b, hk, tile_pos(tile_begin), length, slot(tile_begin));
      cp_async_commit();
      in_cache &= load_stage<Tr, false, true>(p, stage_at(0), b, hk, tile_pos(tile_begin), length, slot(tile_begin));
      cp_async_commit();
    }
    fetch(tile_begin + 1);
    fetched.publish(slot(tile_begin + 1));
  }
  fetch(tile_begin + (STAGES > 1 ? STAGES : 2));
  // The q tile: tiny and read once, element by element (any strides, any head dim), zeros past the rows
  // and past D; Q_BATCH loads in flight per thread before their stores.
  constexpr int Q_ELEMS = Tr::ROWS * HEAD, Q_BATCH = 8;
  auto q_at = [&](int e) {  // element e of the tile from q (T), or zero
    const int r = e / HEAD, c = e % HEAD, packed = row0 + r;
    if (e >= Q_ELEMS || packed >= packed_rows || c >= p.d) return T{};
    const PackedRow row(p, b, hk, packed);
    return static_cast<const T*>(p.q)[b * p.q_stride[0] + row.h * p.q_stride[1] + row.i * p.q_stride[2] + c];
  };
  // e4m3: q goes to float16 for the products, exactly where float16 holds it; a tile whose largest element
  // exceeds 2^15 is divided by the power of two q_unscale first (the k descales multiply it back).
  Acc q_unscale = Acc(1);
  if constexpr (Tr::E4M3) {
    __shared__ unsigned q_amax_bits;  // the tile's largest |q| (a float's bits: they order as the floats)
    if (threadIdx.x == 0) q_amax_bits = 0u;
    float amax = 0.0f;
    for (int e = threadIdx.x; e < Q_ELEMS; e += Tr::THREADS) amax = fmaxf(amax, fabsf(Elem<T>::to_acc(q_at(e))));
    __syncthreads();
    atomicMax(&q_amax_bits, __float_as_uint(amax));
    __syncthreads();
    amax = __uint_as_float(q_amax_bits);
    if (amax > 32768.0f && amax <= 3.402823466e38f) {
      int exponent;
      frexpf(amax / 32768.0f, &exponent);
      q_unscale = ldexpf(1.0f, exponent);
    }
    const float q_scale = 1.0f / q_unscale;  // a power of two: exact
    for (int e = threadIdx.x; e < Q_ELEMS; e += Tr::THREADS) {
      q_tile[Tr::QTile::offset(e / HEAD, e % HEAD)] = from_acc<half_t>(Elem<T>::to_acc(q_at(e)) * q_scale);
    }
  } else {
    for (int e0 = 0; e0 < Q_ELEMS; e0 += Q_BATCH * Tr::THREADS) {
      T x[Q_BATCH];  // (T is Mma here)
#pragma unroll
      for (int u = 0; u < Q_BATCH; ++u) x[u] = q_at(e0 + u * Tr::THREADS + threadIdx.x);
#pragma unroll
      for (int u = 0; u < Q_BATCH; ++u) {
        const int e = e0 + u * Tr::THREADS + threadIdx.x;
        if (e < Q_ELEMS) q_tile[Tr::QTile::offset(e / HEAD, e % HEAD)] = x[u];
      }
    }
  }

  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int wm = warp / (WARPS_N * WARPS_DV), wn = (warp / WARPS_DV) % WARPS_N, wd = warp % WARPS_DV;
  const int g = lane / 4, t = lane % 4;
  // This thread's two accumulator rows (g and g + 8 of its warp's 16): their query's position and slope.
  int query_pos[2];
  Acc slope_log2[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int packed = row0 + wm * 16 + g + 8 * half;
    // (Padding rows past G * Nq take the last query head's slope: finite, and never stored.)
    const int i = packed % p.nq, h = hk * p.group + min(packed / p.nq, p.group - 1);
    query_pos[half] = length - p.nq + i;
    slope_log2[half] =
        p.alibi_on ? Acc(p.alibi_slopes[b * p.alibi_stride[0] + h * p.alibi_stride[1]]) * log2e<Acc>() : Acc(0);
  }

  Acc o[Tr::O_TILES][4];
  zero_tiles(o);
  Acc row_max[2] = {neg_inf_of<Acc>(), neg_inf_of<Acc>()}, row_sum[2] = {Acc(0), Acc(0)};
  // Scores in log2 units: scale * q.k, or with a softcap softcap * tanh(scale * q.k / softcap) (the dense
  // kernels' SoftcapTanh, so both take the same function of a raw score).
  const Acc scale_log2 = Reals<Acc>::scale_log2(p), softcap_log2 = Reals<Acc>::softcap(p) * log2e<Acc>();
  const SoftcapTanh<T, Acc> softcap(p);

  // e4m3: the largest v descale among this warp's keys so far, by which P's columns are divided (they stay at most
  // 1, in float16's range) and out multiplied; o is rescaled when it grows (as the online softmax's max).
  Acc v_ref = Tr::E4M3 ? Acc(0) : Acc(1), v_ref_inv = Acc(0);

  // One tile's work: the scores against k_tile with the online softmax (P into s, the state into
  // row_max, row_sum and o), then P v_tile into o. `scales`: e4m3 caches' descales of the tile's keys, k's
  // then v's (load_stage), which multiply the raw scores' columns.
  auto scores = [&](const Mma* k_tile, int n, Acc(&s)[Tr::S_TILES][4], const float* scales) {
    zero_tiles(s);
    gemm_smem_abt<Mma, HEAD, Tr::S_TILES, Tr::QTile::STRIDE, Tr::KVTile::STRIDE>(
        s, q_tile, wm * 16, k_tile + wn * Tr::KW * Tr::KVTile::STRIDE, lane);
    if constexpr (Tr::E4M3) {
#pragma unroll
      for (int j = 0; j < Tr::S_TILES; ++j) {
        const float2 k_scale = *reinterpret_cast<const float2*>(scales + wn * Tr::KW + j * 8 + 2 * t);
        const Acc lo = k_scale.x * q_unscale, hi = k_scale.y * q_unscale;
        s[j][0] *= lo;
        s[j][1] *= hi;
        s[j][2] *= lo;
        s[j][3] *= hi;
      }
    }

    // Scores in log2 units, hidden keys at -inf, and the online softmax of this warp's rows. A slice that
    // every row sees whole, without softcap or ALiBi (most of a decode step's keys), skips the per-key
    // tests: the rows' queries sit at length - Nq ... length - 1.
    const int key0 = plan.begin + n * BLOCK_N + wn * Tr::KW;
    const bool plain = !(p.softcap_on | p.alibi_on) && key0 + Tr::KW <= length &&
                       (p.window_right < 0 || key0 + Tr::KW - 1 <= length - p.nq + p.window_right) &&
                       (p.window_left < 0 || key0 >= length - 1 - p.window_left);
    Acc tile_max[2] = {neg_inf_of<Acc>(), neg_inf_of<Acc>()};
    if (plain) {
#pragma unroll
      for (int j = 0; j < Tr::S_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] *= scale_log2;
          tile_max[e / 2] = max_of(tile_max[e / 2], s[j][e]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < Tr::S_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e / 2, key = key0 + j * 8 + 2 * t + (e & 1), qp = query_pos[half];
          Acc x = p.softcap_on ? softcap_log2 * softcap.tanh_of(s[j][e]) : s[j][e] * scale_log2;
          if (p.alibi_on) x -= slope_log2[half] * Acc(qp > key ? qp - key : key - qp);
          const bool hidden = key >= length || !in_window(key, qp, p.window_left, p.window_right);
          s[j][e] = hidden ? neg_inf_of<Acc>() : x;
          tile_max[half] = max_of(tile_max[half], s[j][e]);
        }
      }
    }
    Acc new_max[2], base[2];
    bool grew = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      new_max[half] = max_of(row_max[half], quad_max(tile_max[half]));
      grew |= new_max[half] != row_max[half];
      // A row that has seen no key keeps max -inf; its exponentials are then taken against 0 (all zero).
      base[half] = new_max[half] == neg_inf_of<Acc>() ? Acc(0) : new_max[half];
    }
    // The accumulators are rescaled only when a row's max grew (by exactly 1 otherwise: skipping is exact);
    // after the first tiles of a long cache it rarely does.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const Acc rescale = fast_exp2(row_max[half] - base[half]);
        row_sum[half] *= rescale;
#pragma unroll
        for (int j = 0; j < Tr::O_TILES; ++j) {
          o[j][2 * half] *= rescale;
          o[j][2 * half + 1] *= rescale;
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_max[half] = new_max[half];
#pragma unroll
      for (int j = 0; j < Tr::S_TILES; ++j) {
        s[j][2 * half] = fast_exp2(s[j][2 * half] - base[half]);
        s[j][2 * half + 1] = fast_exp2(s[j][2 * half + 1] - base[half]);
        row_sum[half] += s[j][2 * half] + s[j][2 * half + 1];
      }
    }
  };
  // e4m3: P's columns times their keys' v descales over v_ref.
  auto weigh_by_v_scales = [&](Acc(&s)[Tr::S_TILES][4], const float* scales) {
    float2 v_scale[Tr::S_TILES];
    Acc top = v_ref;
#pragma unroll
    for (int j = 0; j < Tr::S_TILES; ++j) {
      v_scale[j] = *reinterpret_cast<const float2*>(scales + BLOCK_N + wn * Tr::KW + j * 8 + 2 * t);
      top = fmaxf(top, fmaxf(v_scale[j].x, v_scale[j].y));
    }
    top = quad_max(top);  // the warp's columns are the same for every row: top is the warp's
    if (top > v_ref) {
      const Acc rescale = v_ref / top;
#pragma unroll
      for (int j = 0; j < Tr::O_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] *= rescale;
      }
      v_ref = top;
      v_ref_inv = Acc(1) / top;
    }
#pragma unroll
    for (int j = 0; j < Tr::S_TILES; ++j) {
      const Acc lo = v_scale[j].x * v_ref_inv, hi = v_scale[j].y * v_ref_inv;
      s[j][0] *= lo;
      s[j][1] *= hi;
      s[j][2] *= lo;
      s[j][3] *= hi;
    }
  };
  auto accumulate = [&](const Mma* v_tile, const Acc(&s)[Tr::S_TILES][4]) {
    gemm_acc_b<Mma, Tr::S_TILES, Tr::O_TILES, Tr::KVTile::STRIDE>(o, s, v_tile + wn * Tr::KW * Tr::KVTile::STRIDE,
                                                                  wd * Tr::DVW, lane);
  };
  if constexpr (STAGES > 1) {
    for (int n = tile_begin; n < tile_end; ++n) {
      cp_async_wait<(STAGES > 1 ? STAGES - 2 : 0)>();
      __syncthreads();  // tile n has landed for every thread; stage (n - 1) % STAGES is free again
      const int ahead = n + STAGES - 1;
      if (ahead < tile_end) {
        in_cache &=
            load_stage<Tr>(p, stage_at((ahead - tile_begin) % STAGES), b, hk, tile_pos(ahead), length, slot(ahead));
      }
      cp_async_commit();
      if (ahead + 1 < tile_end) fetched.publish(slot(ahead + 1));
      fetch(ahead + 2);
      const C* stage = stage_at((n - tile_begin) % STAGES);
      Acc s[Tr::S_TILES][4];
      if constexpr (Tr::E4M3) {
        const float* scales =
            reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(stage) + Tr::SCALES_OFFSET);
        widen_stage<Tr>(stage, wide);
        __syncthreads();  // the widened tiles are whole (the loop's first barrier: every warp is done with them)
        scores(wide, n, s, scales);
        weigh_by_v_scales(s, scales);
        accumulate(wide + Tr::KVTile::SIZE, s);
      } else {
        scores(stage, n, s, nullptr);
        accumulate(stage + Tr::KVTile::SIZE, s);
      }
    }
  } else {
    // One buffer each: v of tile n lands while its scores are computed, k of tile n + 1 while P v is (as
    // FlashAttention-2 interleaves them). Half the shared memory of two stages, so more CTAs fit an SM.
    T* k_tile = stage_at(0);
    T* v_tile = k_tile + Tr::KVTile::SIZE;
    for (int n = tile_begin; n < tile_end; ++n) {
      cp_async_wait<1>();
      __syncthreads();  // k of tile n has landed (v may still be on its way)
      Acc s[Tr::S_TILES][4];
      scores(k_tile, n, s, nullptr);
      __syncthreads();  // every warp is done with k of tile n
      if (n + 1 < tile_end) {
        in_cache &= load_stage<Tr, true, false>(p, stage_at(0), b, hk, tile_pos(n + 1), length, slot(n + 1));
      }
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();  // v of tile n has landed
      accumulate(v_tile, s);
      __syncthreads();  // every warp is done with v of tile n
      if (n + 1 < tile_end) {
        in_cache &= load_stage<Tr, false, true>(p, stage_at(0), b, hk, tile_pos(n + 1), length, slot(n + 1));
      }
      cp_async_commit();
      if (n + 2 < tile_end) fetched.publish(slot(n + 2));
      fetch(n + 3);
    }
  }
  cp_async_wait<0>();
  in_cache = __syncthreads_and(in_cache);  // every load has landed and every warp is done with the ring

  // Merge the WARPS_N key slices' states: max M and sum over the slices, each slice's out weighted by
  // 2^(m_slice - M) / sum. Warps with wd == 0 publish the row states (those of every wd are the same).
  Acc* maxes = states;
  Acc* sums = states + WARPS_N * Tr::ROWS;
#pragma unroll
  for (int half = 0; half < 2; ++half) row_sum[half] = quad_sum(row_sum[half]);
  if (wd == 0 && t == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * 16 + g + 8 * half;
      maxes[wn * Tr::ROWS + r] = row_max[half];
      sums[wn * Tr::ROWS + r] = row_sum[half];
    }
  }
  __syncthreads();
  Acc weight[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wm * 16 + g + 8 * half;
    Acc m = neg_inf_of<Acc>();
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) m = max_of(m, maxes[w * Tr::ROWS + r]);
    const Acc base = m == neg_inf_of<Acc>() ? Acc(0) : m;
    Acc total = Acc(0);
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) total += sums[w * Tr::ROWS + r] * fast_exp2(maxes[w * Tr::ROWS + r] - base);
    // A row that saw no key sums to 0 (out 0, lse -inf); one that saw a NaN score sums to NaN, which must stay
    // NaN in lse as in out (a merge weighs a part of lse -inf as 0 and would drop it): hence !(total <= 0).
    const bool seen = !(total <= Acc(0));
    weight[half] = seen ? v_ref * fast_exp2(row_max[half] - base) / total : Acc(0);
    if (wn == 0 && wd == 0 && t == 0) {  // the row's lse, natural log
      states[2 * WARPS_N * Tr::ROWS + r] = seen ? (m + log2_of(total)) * ln2<Acc>() : neg_inf_of<Acc>();
    }
  }
// The slices add their weighted out into `merged` one after another (a fixed order: deterministic).
#pragma unroll 1
  for (int w = 0; w < WARPS_N; ++w) {
    if (wn == w) {
#pragma unroll
      for (int j = 0; j < Tr::O_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = wm * 16 + g + 8 * (e / 2), c = wd * Tr::DVW + j * 8 + 2 * t + (e & 1);
          const Acc x = o[j][e] * weight[e / 2];
          merged[r * Tr::OUT_STRIDE + c] = w == 0 ? x : merged[r * Tr::OUT_STRIDE + c] + x;
        }
      }
    }
    __syncthreads();
  }

  // Store out and lse, or this split's partial state (and the last split to finish merges them all).
  const int rows = min(Tr::ROWS, packed_rows - row0);
  store_or_merge<Tr>(p, plan.splits, split, b, hk, row0, rows, merged, Tr::OUT_STRIDE, states + 2 * WARPS_N * Tr::ROWS,
                     length < 0 || !in_cache, merged, states);
}
