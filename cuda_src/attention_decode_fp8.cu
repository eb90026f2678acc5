// attention_decode_fp8.cu — a decoding step on an e4m3 key/value cache for up to 8 packed query rows per key/value
// head (G * Nq <= 8: GQA groups of a decode step), with the keys as the products' rows.
//
// Computes what attention_decode.cu computes (out = softmax(scale * q k^T + modifiers) v and lse over keys
// 0 .. L_b - 1, masks bottom-right aligned, splits merged by their log-sum-exp), for the step where that kernel's
// 16-row tiles would be at most half full. Here the 16 rows of every m16n8k16 product are 16 keys and its 8
// columns the packed query rows: S^T = K q^T, then O^T += V^T P^T, so no product is spent on empty rows and each
// key's codes feed the tensor cores straight from shared memory, widened in registers (e4m3.cuh):
// - S^T = K q^T: the head dims are permuted within a key's row so that thread t's reduction indices of slab s
//   (2t, 2t+1, 2t+8, 2t+9) are dims (HEAD / 4) t + 4 s + 0..3: a thread reads a key's HEAD / 4 codes as one
//   run and each word of 4 codes is an A fragment's two pairs; q's fragments (in registers for the whole split)
//   are permuted alike.
// - O^T += V^T P^T: the products' rows are v's dims, permuted so that row g of fragment m is dim (HEAD / 8) g + 2m
//   and row g + 8 the next: for each of its keys 2t, 2t+1, 2t+8, 2t+9 a thread reads one run of HEAD / 8 codes,
//   and one byte permute per key pair and fragment pairs two keys' codes of one dim. P^T, the B operand, comes
//   from S^T's accumulators by movmatrix.trans.
// Products in float16, float32 accumulators; q goes to float16, divided by a power of two where it would
// overflow, and the keys' k descale multiplies their scores; their v descale multiplies their probabilities over
// the largest v descale the warp has seen (as attention_decode.cu does).
//
// Layout: as attention_decode.cu (q (B, Hq, Nq, D) with a unit last stride; the cache contiguous, or paged with
// pages of a multiple of 16 positions; rows in whole aligned 16-byte chunks). Grid: x = split, y = hk, z = b;
// 4 warps, each with a pipeline of its own: a warp copies, waits for and reads only its own 16 keys of each 64-key
// tile (STAGES deep, cp.async), so no warp waits for another inside the loop. A stage holds per warp 16 rows of k
// codes and 16 of v codes, and the 16 keys' k and v descales (one each: the keys share a scale block) in the first
// row's padding.
//
// Saves: as attention_decode.cu (decode_splits.cuh): out and lse directly, or each split's partial state, merged
// by the last split to finish; a sequence out of range or whose block table points outside the cache gets NaN rows.
#include "common.cuh"
#include "mma.cuh"
#include "copy.cuh"
#include "e4m3.cuh"
#include "kvcache.cuh"
#include "mask.cuh"
#include "softcap.cuh"
#include "decode_splits.cuh"

template <typename T, int HEAD, int STAGES>
struct Fp8DecodeTraits {
  using Elem = T;
  using Acc = float;
  static constexpr int WARPS = 4, THREADS = WARPS * WARP_SIZE;
  static constexpr int ROWS = 8;                           // packed query rows: the products' 8 columns
  static constexpr int KEYS = 16;                          // a warp's keys per tile: the products' 16 rows
  static constexpr int BLOCK_N = WARPS * KEYS;             // keys per tile (the split plan's unit)
  static constexpr int ROW_BYTES = HEAD + 16;              // a key's codes, then padding that spreads rows over banks
  static constexpr int K_WORDS = HEAD / 16;                // a thread's words of one k row (HEAD / 4 codes)
  static constexpr int V_WORDS = HEAD / 32;                // a thread's words of one v row (HEAD / 8 codes)
  static constexpr int CHUNKS = HEAD / 16;                 // 16-byte chunks per row
  static constexpr int WARP_STAGE = 2 * KEYS * ROW_BYTES;  // a warp's k rows, then its v rows
  static constexpr int RING_BYTES = STAGES * WARPS * WARP_STAGE;
  static constexpr int OUT_STRIDE = HEAD + 1;
  static constexpr int OUT_BYTES = ROWS * OUT_STRIDE * 4;
  static constexpr int WEIGHT_BYTES = ROWS * MAX_SPLITS * 4;
  static constexpr int MERGE_BYTES = OUT_BYTES > WEIGHT_BYTES ? OUT_BYTES : WEIGHT_BYTES;
  static constexpr int STATE_BYTES = 3 * WARPS * ROWS * 4;  // each warp's row maxes and sums, then the rows' lse
  static constexpr int SMEM = (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) + STATE_BYTES;
  static_assert(HEAD % 32 == 0 && HEAD >= 32, "every thread's share of a row is whole words");
  static_assert(STAGES >= 2, "a tile is copied while the one before it is computed");
  static_assert(WARP_SIZE % CHUNKS == 0 && KEYS % (WARP_SIZE / CHUNKS) == 0, "a warp copies its rows in whole passes");
};

// A thread's N words of a row from shared memory, in the widest loads the run's alignment allows.
template <int N>
__device__ __forceinline__ void load_words(u32 (&w)[N], const unsigned char* at) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 x = reinterpret_cast<const uint4*>(at)[i];
      w[4 * i] = x.x;
      w[4 * i + 1] = x.y;
      w[4 * i + 2] = x.z;
      w[4 * i + 3] = x.w;
    }
  } else if constexpr (N == 2) {
    const uint2 x = *reinterpret_cast<const uint2*>(at);
    w[0] = x.x;
    w[1] = x.y;
  } else {
    static_assert(N == 1, "runs of 1, 2 or a multiple of 4 words");
    w[0] = *reinterpret_cast<const u32*>(at);
  }
}

// MIN_CTAS: the CTAs per SM the registers are budgeted for (__launch_bounds__), which the split count then fills.
template <typename T, int HEAD, int STAGES, int MIN_CTAS>
__global__ void __launch_bounds__(Fp8DecodeTraits<T, HEAD, STAGES>::THREADS, MIN_CTAS)
    attention_decode_fp8(const KVCacheParams p) {
  using Tr = Fp8DecodeTraits<T, HEAD, STAGES>;
  constexpr int KEYS = Tr::KEYS, BLOCK_N = Tr::BLOCK_N, ROW_BYTES = Tr::ROW_BYTES;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  unsigned char* ring = smem + warp * Tr::WARP_STAGE;  // this warp's part of stage s: + s * WARPS * WARP_STAGE
  float* merged = reinterpret_cast<float*>(smem);      // after the loop, over the ring
  float* states = reinterpret_cast<float*>(smem + Tr::SMEM - Tr::STATE_BYTES);

  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int packed_rows = p.group * p.nq;
  const int length = sequence_length(p, b);
  const SplitPlan plan = split_plan<BLOCK_N, KEYS>(p, length);
  if (split >= plan.splits) return;  // this sequence needs fewer splits than the grid has
  const int tile_begin = split * plan.tiles_per_split;
  const int tile_end = min(plan.tiles, tile_begin + plan.tiles_per_split);

  // Where this warp's 16 keys of tile n live: one lookup (they never straddle a page: the plan's begin is a
  // multiple of 16, as the pages are). Looked up one tile before the copy that needs it, so the block table's
  // latency passes during a tile's work.
  const int page_shift = shift_of(p.page_size);
  auto first_key = [&](int n) { return plan.begin + n * BLOCK_N + warp * KEYS; };
  auto lookup = [&](int n) {
    const int pos = first_key(n);
    return n < tile_end && pos < length ? cache_row(p, b, pos, page_shift) : CacheRow{0, -1};
  };
  // The copies' lane constants: lane l copies chunk l % CHUNKS of the warp's rows l / CHUNKS + j * PASS_ROWS, k's
  // into the warp's k rows and v's into its v rows; a copy that is not valid reads nothing (its address need not be
  // in the cache) and writes zeros.
  constexpr int PASS_ROWS = WARP_SIZE / Tr::CHUNKS, STAGE_BYTES = Tr::WARPS * Tr::WARP_STAGE;
  const int r0 = lane / Tr::CHUNKS, col = (lane % Tr::CHUNKS) * 16;
  const unsigned char* k_lane =
      static_cast<const unsigned char*>(p.k_cache) + hk * p.k_stride[1] + r0 * p.k_stride[2] + col;
  const unsigned char* v_lane =
      static_cast<const unsigned char*>(p.v_cache) + hk * p.v_stride[1] + r0 * p.v_stride[2] + col;
  // A pass's rows are PASS_ROWS positions apart within a page (or a sequence): an int (the host routes row strides
  // of 2^27 bytes and more to the tiled kernel).
  const int k_pass = PASS_ROWS * static_cast<int>(p.k_stride[2]), v_pass = PASS_ROWS * static_cast<int>(p.v_stride[2]);
  const bool k_col = col < p.d, v_col = col < p.dv;
  const u32 k_dst = smem_u32(ring + r0 * ROW_BYTES + col);
  // A warp's 16 keys share one k descale and one v descale (a scale block is 128 positions, a page of a multiple of
  // 16, or the whole cache): lane 0 copies k's into the padding of the warp's first k row, lane 1 v's into that of its
  // first v row (the other lanes' copies write zeros into the padding of other rows, which nothing reads).
  const u32 k_scale_dst = smem_u32(ring + (lane / 4) * ROW_BYTES + HEAD + 4 * (lane % 4));
  const int swapped = lane ^ 1;  // lane 1 to the first v row's first padding word
  const u32 v_scale_dst = smem_u32(ring + (KEYS + swapped / 4) * ROW_BYTES + HEAD + 4 * (swapped % 4));
  const int k_block_shift = shift_of(p.k_scale_block), v_block_shift = shift_of(p.v_scale_block);
  bool in_cache = true;
  // Copy this warp's keys at `pos` (rows at `at`) into stage `stage`: codes past the sequence's end, before the
  // first key any row sees (the plan's begin is rounded down to a multiple of 16; a NaN value there must not reach
  // P v through a zero probability) and past D or Dv as zeros, and their descales (zeros for keys all past the end).
  const int first_seen = length > 0 ? key_begin(p, length) : 0;
  auto load = [&](int stage, int pos, CacheRow at) {
    const u32 offset = stage * STAGE_BYTES;
    in_cache &= at.page >= 0;
    const bool ok = at.row >= 0 && at.page >= 0;
    const unsigned char* k_src = k_lane + at.page * p.k_stride[0] + at.row * p.k_stride[2];
    const unsigned char* v_src = v_lane + at.page * p.v_stride[0] + at.row * p.v_stride[2];
#pragma unroll
    for (int j = 0; j < KEYS / PASS_ROWS; ++j) {
      const int key = pos + r0 + j * PASS_ROWS;
      const bool row_ok = ok && key < length && key >= first_seen;
      const u32 dst = k_dst + offset + j * PASS_ROWS * ROW_BYTES;
      cp_async_stream(dst, k_src + j * k_pass, row_ok && k_col);
      cp_async_stream(dst + KEYS * ROW_BYTES, v_src + j * v_pass, row_ok && v_col);
    }
    const CacheRow first = ok ? at : CacheRow{0, 0};
    cp_async_small<4>(k_scale_dst + offset,
                      scale_at(p.k_scale, p.k_scale_stride, p.k_scale_block, hk, first, k_block_shift),
                      ok && lane == 0);
    cp_async_small<4>(v_scale_dst + offset,
                      scale_at(p.v_scale, p.v_scale_stride, p.v_scale_block, hk, first, v_block_shift),
                      ok && lane == 1);
  };

  // The ring: tile n goes to stage (n - tile_begin) % STAGES, STAGES - 1 tiles ahead of the one computed.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (tile_begin + s < tile_end) load(s, first_key(tile_begin + s), lookup(tile_begin + s));
    cp_async_commit();
  }
  CacheRow ahead_at = lookup(tile_begin + STAGES - 1);
  int stage = 0, ahead_stage = STAGES - 1;  // the stages of tile n and of tile n + STAGES - 1

  // q^T's B fragments, float16, for the whole split: column g is packed row g (zeros past G * Nq and past D);
  // slab s holds dims (HEAD / 4) t + 4 s + 0, 1 (reduction indices 2t, 2t+1) and + 2, 3 (2t+8, 2t+9). A row
  // whose largest element exceeds 2^15 would overflow float16: q is divided by the power of two q_unscale first
  // (every warp loads all the rows, so each finds the same q_unscale), and the k descales multiply it back.
  u32 qf[HEAD / 16][2];
  float q_unscale = 1.0f;
  {
    float x[HEAD / 4];
    const bool row_ok = g < packed_rows;
    const PackedRow row(p, b, hk, row_ok ? g : 0);
    const T* q_row = static_cast<const T*>(p.q) + b * p.q_stride[0] + row.h * p.q_stride[1] + row.i * p.q_stride[2];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < HEAD / 4; ++e) {
      const int c = (HEAD / 4) * t + e;
      x[e] = row_ok && c < p.d ? Elem<T>::to_acc(q_row[c]) : 0.0f;
      amax = fmaxf(amax, fabsf(x[e]));
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    if (amax > 32768.0f && amax <= 3.402823466e38f) {
      int exponent;
      frexpf(amax / 32768.0f, &exponent);
      q_unscale = ldexpf(1.0f, exponent);
    }
    const float q_scale = 1.0f / q_unscale;  // a power of two: exact
#pragma unroll
    for (int s = 0; s < HEAD / 16; ++s) {
      qf[s][0] = Elem<half_t>::pack2(x[4 * s] * q_scale, x[4 * s + 1] * q_scale);
      qf[s][1] = Elem<half_t>::pack2(x[4 * s + 2] * q_scale, x[4 * s + 3] * q_scale);
    }
  }

  // This thread's two columns: packed rows 2t and 2t + 1, their queries' positions and ALiBi slopes.
  int query_pos[2];
  float slope_log2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // (Padding rows past G * Nq take the last packed row's position and slope: finite, and never stored.)
    const PackedRow row(p, b, hk, min(2 * t + h, packed_rows - 1));
    query_pos[h] = length - p.nq + row.i;
    slope_log2[h] =
        p.alibi_on ? p.alibi_slopes[b * p.alibi_stride[0] + row.h * p.alibi_stride[1]] * log2e<float>() : 0.0f;
  }
  const float scale_log2 = p.scale_log2, softcap_log2 = p.softcap * log2e<float>();
  const SoftcapTanh<T, float> softcap(p);

  // O^T: o[m] holds dims (HEAD / 8) g + 2m (o[m][0], o[m][1]) and the next (o[m][2], o[m][3]), of rows 2t and
  // 2t + 1 (o[m][0], o[m][2] and o[m][1], o[m][3]).
  float o[HEAD / 16][4];
#pragma unroll
  for (int m = 0; m < HEAD / 16; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.0f, 0.0f};
  float v_ref = 0.0f, v_ref_inv = 0.0f;  // the largest v descale among this warp's keys so far

  for (int n = tile_begin; n < tile_end; ++n) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // tile n has landed for every lane; this warp is done with the stage the copy below refills
    const int ahead = n + STAGES - 1;
    if (ahead < tile_end) load(ahead_stage, first_key(ahead), ahead_at);
    cp_async_commit();
    ahead_at = lookup(ahead + 1);
    ahead_stage = ahead_stage == STAGES - 1 ? 0 : ahead_stage + 1;
    const unsigned char* k_rows = ring + stage * STAGE_BYTES;
    const unsigned char* v_rows = k_rows + KEYS * ROW_BYTES;
    const float k_scale = *reinterpret_cast<const float*>(k_rows + HEAD) * q_unscale;
    const float v_scale = *reinterpret_cast<const float*>(v_rows + HEAD);
    stage = stage == STAGES - 1 ? 0 : stage + 1;

    // S^T: keys g and g + 8 (c[0], c[1] and c[2], c[3]) against rows 2t and 2t + 1.
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      u32 lo[Tr::K_WORDS], hi[Tr::K_WORDS];
      load_words(lo, k_rows + g * ROW_BYTES + (HEAD / 4) * t);
      load_words(hi, k_rows + (g + 8) * ROW_BYTES + (HEAD / 4) * t);
#pragma unroll
      for (int s = 0; s < HEAD / 16; ++s) {
        const u32 a[4] = {widen_e4m3x2(lo[s]), widen_e4m3x2(hi[s]), widen_e4m3x2_hi(lo[s]), widen_e4m3x2_hi(hi[s])};
        mma16_op<half_t>(c, a, qf[s]);
      }
    }

    // Scores (times the keys' k descale) in log2 units, hidden keys at -inf. A warp's 16 keys that every row sees
    // whole, without softcap or ALiBi (most of a decode step's keys), skip the per-key tests.
    const int key0 = first_key(n);
    const bool plain = !(p.softcap_on | p.alibi_on) && key0 + KEYS <= length &&
                       (p.window_right < 0 || key0 + KEYS - 1 <= length - p.nq + p.window_right) &&
                       (p.window_left < 0 || key0 >= length - 1 - p.window_left);
    if (plain) {
      const float factor = k_scale * scale_log2;
#pragma unroll
      for (int e = 0; e < 4; ++e) c[e] *= factor;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e & 1, key = key0 + g + 8 * (e / 2), qp = query_pos[h];
        const float raw = c[e] * k_scale;
        float x = p.softcap_on ? softcap_log2 * softcap.tanh_of(raw) : raw * scale_log2;
        if (p.alibi_on) x -= slope_log2[h] * static_cast<float>(qp > key ? qp - key : key - qp);
        const bool hidden = key >= length || !in_window(key, qp, p.window_left, p.window_right);
        c[e] = hidden ? neg_inf() : x;
      }
    }

    // The online softmax of rows 2t and 2t + 1, over the 8 lanes that hold their keys (lanes t, t + 4, ...).
    float tile_max[2] = {fmaxf(c[0], c[2]), fmaxf(c[1], c[3])};
#pragma unroll
    for (int offset = 4; offset < WARP_SIZE; offset *= 2) {
      tile_max[0] = fmaxf(tile_max[0], __shfl_xor_sync(0xffffffffu, tile_max[0], offset));
      tile_max[1] = fmaxf(tile_max[1], __shfl_xor_sync(0xffffffffu, tile_max[1], offset));
    }
    float base[2];
    bool grew = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float new_max = fmaxf(row_max[h], tile_max[h]);
      grew |= new_max != row_max[h];
      // A row that has seen no key keeps max -inf; its exponentials are then taken against 0 (all zero).
      base[h] = new_max == neg_inf() ? 0.0f : new_max;
      tile_max[h] = new_max;
    }
    // Rescaled only when a row's max grew (by exactly 1 otherwise); after a long cache's first tiles it rarely does.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float rescale = fast_exp2(row_max[h] - base[h]);
        row_sum[h] *= rescale;
#pragma unroll
        for (int m = 0; m < HEAD / 16; ++m) {
          o[m][h] *= rescale;
          o[m][h + 2] *= rescale;
        }
      }
    }
    row_max[0] = tile_max[0];
    row_max[1] = tile_max[1];
    float prob[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) prob[e] = fast_exp2(c[e] - base[e & 1]);
    row_sum[0] += prob[0] + prob[2];
    row_sum[1] += prob[1] + prob[3];

    // P times the keys' v descale over v_ref (P stays at most 1, in float16's range); out is rescaled when v_ref
    // grows and multiplied by it at the end.
    if (v_scale > v_ref) {  // the same for every lane of the warp
      const float rescale = v_ref / v_scale;
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[m][e] *= rescale;
      }
      v_ref = v_scale;
      v_ref_inv = 1.0f / v_scale;
    }
    const float weight = v_scale * v_ref_inv;
    const u32 pb[2] = {movmatrix_trans(Elem<half_t>::pack2(prob[0] * weight, prob[1] * weight)),
                       movmatrix_trans(Elem<half_t>::pack2(prob[2] * weight, prob[3] * weight))};

    // O^T += V^T P^T: keys 2t, 2t+1 (a[0], a[1]) and 2t+8, 2t+9 (a[2], a[3]) of dims (HEAD / 8) g + 2m, + 1.
    {
      const unsigned char* at = v_rows + (2 * t) * ROW_BYTES + (HEAD / 8) * g;
      u32 w0[Tr::V_WORDS], w1[Tr::V_WORDS], w8[Tr::V_WORDS], w9[Tr::V_WORDS];
      load_words(w0, at);
      load_words(w1, at + ROW_BYTES);
      load_words(w8, at + 8 * ROW_BYTES);
      load_words(w9, at + 9 * ROW_BYTES);
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
        // Bytes 2m % 4 and the next of the two keys' words, interleaved: (key, key + 1) of dim 2m, then of 2m + 1.
        const u32 select = m % 2 ? 0x7362u : 0x5140u;
        const u32 lo = __byte_perm(w0[m / 2], w1[m / 2], select), hi = __byte_perm(w8[m / 2], w9[m / 2], select);
        const u32 a[4] = {widen_e4m3x2(lo), widen_e4m3x2_hi(lo), widen_e4m3x2(hi), widen_e4m3x2_hi(hi)};
        mma16_op<half_t>(o[m], a, pb);
      }
    }
  }
  cp_async_wait<0>();
  in_cache = __syncthreads_and(in_cache);  // every copy has landed and every warp is done with the ring

  // Merge the 4 warps' states: max M and sum over the warps, each warp's out weighted by v_ref 2^(m_w - M) / sum.
  float* maxes = states;
  float* sums = states + Tr::WARPS * Tr::ROWS;
  float* lse_rows = states + 2 * Tr::WARPS * Tr::ROWS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int offset = 4; offset < WARP_SIZE; offset *= 2)
      row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], offset);
  }
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      maxes[warp * Tr::ROWS + 2 * t + h] = row_max[h];
      sums[warp * Tr::ROWS + 2 * t + h] = row_sum[h];
    }
  }
  __syncthreads();
  float weight[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 2 * t + h;
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < Tr::WARPS; ++w) m = fmaxf(m, maxes[w * Tr::ROWS + r]);
    const float base = m == neg_inf() ? 0.0f : m;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < Tr::WARPS; ++w) total += sums[w * Tr::ROWS + r] * fast_exp2(maxes[w * Tr::ROWS + r] - base);
    // No key seen: a sum of 0 (out 0, lse -inf); a NaN score seen: a NaN sum, kept NaN in lse as in out.
    const bool seen = !(total <= 0.0f);
    weight[h] = seen ? v_ref * fast_exp2(row_max[h] - base) / total : 0.0f;
    if (warp == 0 && g == 0) lse_rows[r] = seen ? (m + log2_of(total)) * ln2<float>() : neg_inf();
  }
  // The warps add their weighted out into `merged` one after another (a fixed order: deterministic).
#pragma unroll 1
  for (int w = 0; w < Tr::WARPS; ++w) {
    if (warp == w) {
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * t + (e & 1), col = (HEAD / 8) * g + 2 * m + e / 2;
          const float x = o[m][e] * weight[e & 1];
          merged[r * Tr::OUT_STRIDE + col] = w == 0 ? x : merged[r * Tr::OUT_STRIDE + col] + x;
        }
      }
    }
    __syncthreads();
  }
  store_or_merge<Tr>(p, plan.splits, split, b, hk, 0, packed_rows, merged, Tr::OUT_STRIDE, lse_rows,
                     length < 0 || !in_cache, merged, states);
}
