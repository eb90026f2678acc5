// softmax.cuh — the online-softmax state of FlashAttention, for the two query rows (g and g+8)
// that one thread holds in an m16n8 accumulator tile.
//
// For each key tile j:  m_new = max(m_i, rowmax(S_ij));  P_ij = exp2(c * S_ij - c * m_new);
// l_i = exp2(c * (m_i - m_new)) * l_i + rowsum(P_ij);  O_i is rescaled by the same factor;
// with c = scale * log2(e) folded in, so every exponential is one ex2 instruction.
// The reference m_i only moves when the row max grows by more than RESCALE_SLACK (in exp2 units):
// otherwise P_ij (then at most 2^RESCALE_SLACK) and l_i stay relative to the old m_i, which is exact
// (out = O / l and lse = c * m + log2(l) do not depend on the reference), and O_i needs no rescaling,
// a multiply per output element saved on most tiles (FlashAttention-4's conditional rescaling).
// A row whose scores are all -inf so far keeps m = -inf; it uses 0 as its reference so that
// -inf - -inf never produces NaN, and ends with l = 0: out = 0, lse = -inf.
#pragma once
#include "common.cuh"

constexpr float RESCALE_SLACK = 8.f;  // P <= 2^8 between rescalings: far from overflow in any type P is rounded to

// The identity, as update_bounded's default score and hide steps.
struct Unchanged {
  template <typename X>
  __device__ __forceinline__ X&& operator()(X&& x) const {
    return static_cast<X&&>(x);
  }
};

// A: the accumulator type (float; double for float64 inputs, with libdevice's exp2 and log2). Its tile
// functions take any number N of n-tiles (a warp-specialized forward's half-width first block: half of them).
// FULL_RANGE (the FP8 forward, which rounds P to e4m3): the reference follows every rise of the row max (no
// slack) and P = exp2(c * S - c * m + P_OFFSET), so every row's largest probability is 2^P_OFFSET = 256, the
// top of e4m3's range (max 448), and the small ones keep 8 more binades before they fall below its smallest
// subnormal (2^-9). l carries the same factor (out = O / l cancels it); finalize takes it out of lse.
template <typename A = float, bool FULL_RANGE = false>
struct OnlineSoftmax {
  static constexpr float SLACK = FULL_RANGE ? 0.f : RESCALE_SLACK;
  static constexpr float P_OFFSET = FULL_RANGE ? 8.f : 0.f;

  A row_max[2];  // m_i, in raw score units (q . k, before the scale)
  A row_sum[2];  // this thread's part of l_i; the quad's parts are added in finalize

  __device__ __forceinline__ void init() {
    row_max[0] = row_max[1] = neg_inf();
    row_sum[0] = row_sum[1] = A(0);
  }

  // Turns the score tile S into P in place; returns the factor for the output accumulator.
  // TILE_FACTOR: the tile's raw scores are tile_factor times smaller than the other tiles' (a power of two:
  // float32 pieces whose keys carry their own row block's scaling, pieces.cuh); its max and its exponents
  // take the factor on the way, so row_max stays in one unit for every tile.
  // SHIFTED: row r of the tile holds its scores minus shift[r] (ALiBi's row term, ScoreMods::alibi_log2): the
  // shift goes into the tile's max and comes out of the exponentials' reference, a few operations per row
  // instead of one per score.
  template <bool TILE_FACTOR = false, bool SHIFTED = false, int N>
  __device__ __forceinline__ void update(A (&s)[N][4], A scale_log2, A (&rescale)[2], A tile_factor = A(1),
                                         const A* shift = nullptr) {
    const A tile_scale = TILE_FACTOR ? scale_log2 * tile_factor : scale_log2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      A tile_max = row_tile_max(s, r);
      if constexpr (TILE_FACTOR) tile_max *= tile_factor;
      tile_max = quad_max(tile_max);
      if constexpr (SHIFTED) tile_max += shift[r];
      const A new_max = max_of(row_max[r], tile_max);
      // A row's first finite max always becomes the reference (-inf + slack is -inf).
      if (new_max * scale_log2 > row_max[r] * scale_log2 + A(SLACK)) {
        rescale[r] = fast_exp2(mul_rn(row_max[r], scale_log2) - new_max * scale_log2);
        row_max[r] = new_max;
      } else {
        rescale[r] = A(1);  // exactly: a tile with every key hidden then changes nothing, bit for bit
      }
      A ref = (row_max[r] == neg_inf() ? A(0) : row_max[r] * scale_log2) - A(P_OFFSET);
      if constexpr (SHIFTED) ref -= shift[r] * scale_log2;
      row_sum[r] = row_sum[r] * rescale[r] + exponentials(s, r, tile_scale, ref);
    }
  }

  // The max of row r (of the thread's two) over the tile, as a tree: one or two computing warps share an SM
  // sub-partition in these kernels, so little hides the latency of a chain of N dependent maxes
  // (docs/design/forward.md).
  template <int N>
  __device__ __forceinline__ static A row_tile_max(const A (&s)[N][4], int r) {
    A m[N];
#pragma unroll
    for (int j = 0; j < N; ++j) m[j] = max_of(s[j][2 * r], s[j][2 * r + 1]);
#pragma unroll
    for (int w = 1; w < N; w *= 2)
#pragma unroll
      for (int j = 0; j + w < N; j += 2 * w) m[j] = max_of(m[j], m[j + w]);
    return m[0];
  }

  // The sum of row r over the tile, in four independent partial sums (the same reason).
  template <int N>
  __device__ __forceinline__ static A row_tile_sum(const A (&s)[N][4], int r) {
    A part[4] = {A(0), A(0), A(0), A(0)};
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) part[2 * (j & 1) + c] += s[j][2 * r + c];
    return (part[0] + part[1]) + (part[2] + part[3]);
  }

  // update() for scores known to be at most max_bound, whose exponentials relative to it stay normal
  // floats (ScoreMods::scores_within_one): max_bound is every row's reference from the start, so no row
  // max is taken and nothing is rescaled, which takes the max's reductions and their latency off the path
  // from S to P. P carries a constant factor against update()'s, which out = O / l cancels and lse = c *
  // max_bound + log2(l) accounts for. (A row's largest P is then not exactly 1 and is rounded to 16 bits
  // like the others: the callers keep it to bfloat16, whose range holds every P down to 2^-126.)
  // score(s) turns each element into its score first (the warp-specialized forward passes the softcap's
  // tanh, so that the special-function unit's tanh and the FMA units' poly_exp2 interleave in one block of
  // straight-line code), and hide(P) runs on the probabilities before the sums (there: hidden keys' P -> 0).
  // POLY_TILES: a bit per n-tile j of S whose exponentials take poly_exp2 instead of the special-function
  // unit; those must see no -inf (poly_exp2 takes inputs >= -127), so hidden keys then come through hide.
  template <unsigned POLY_TILES = 0u, class Score = Unchanged, class Hide = Unchanged, int N>
  __device__ __forceinline__ void update_bounded(A (&s)[N][4], A scale_log2, A (&rescale)[2], A max_bound,
                                                 Score score = {}, Hide hide = {}) {
    static_assert(POLY_TILES == 0u || sizeof(A) == 4, "poly_exp2 is float32's");
    const A ref = max_bound * scale_log2;
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const A x = score(s[j][e]) * scale_log2 - ref;
        s[j][e] = (POLY_TILES >> j & 1u) ? poly_exp2(x) : fast_exp2(x);
      }
    hide(s);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[r] = max_bound;
      rescale[r] = A(1);
      row_sum[r] += row_tile_sum(s, r);
    }
  }

  // P = exp2(scale * S - ref) in place over row r (of the thread's two) of the tile; returns their sum.
  template <int N>
  __device__ __forceinline__ static A exponentials(A (&s)[N][4], int r, A scale, A ref) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) s[j][2 * r + c] = fast_exp2(s[j][2 * r + c] * scale - ref);
    return row_tile_sum(s, r);
  }

  // 1 / l_i (0 when the row saw no key) and lse_i = scale * m_i + log(l_i) in natural log. row_sums (where
  // given): the rounded P's row sums from the tensor cores (wgmma.cuh, wg_issue_pb_sum), whose every column holds
  // its row's sum, each thread's whole; out divides by them instead, so that it is v's mean weighted as O weighs
  // it, and lse keeps l.
  __device__ __forceinline__ void finalize(A scale_log2, A (&inv_sum)[2], A (&lse)[2],
                                           const A (*row_sums)[4] = nullptr) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const A l = quad_sum(row_sum[r]);
      const bool empty = l == A(0);  // a NaN sum (NaN or +inf among the inputs) is not empty: it propagates
      inv_sum[r] = empty ? A(0) : A(1) / (row_sums != nullptr ? row_sums[0][2 * r] : l);
      lse[r] = empty ? A(neg_inf()) : (row_max[r] * scale_log2 + log2_of(l) - A(P_OFFSET)) * ln2<A>();
    }
  }
};

// Scale every element of an accumulator row pair: rows g by f[0], g+8 by f[1].
template <int N_TILES, typename A>
__device__ __forceinline__ void scale_rows(A (&acc)[N_TILES][4], const A (&f)[2]) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
    acc[j][0] *= f[0];
    acc[j][1] *= f[0];
    acc[j][2] *= f[1];
    acc[j][3] *= f[1];
  }
}

// Whether OnlineSoftmax::update's factors rescale any row of the warp (a warp-uniform answer). Once a row's
// max has settled they are all 1: the common case, whose multiplies are then skipped.
template <typename A>
__device__ __forceinline__ bool any_rescaled(const A (&f)[2]) {
  return __any_sync(0xffffffffu, f[0] != A(1) || f[1] != A(1));
}

// The output accumulator's rescaling by OnlineSoftmax::update's factors (skipped as any_rescaled says).
template <int N_TILES, typename A>
__device__ __forceinline__ void rescale_rows(A (&acc)[N_TILES][4], const A (&f)[2]) {
  if (any_rescaled(f)) scale_rows(acc, f);
}

// The output accumulator and its row sums (finalize's row_sums), rescaled together (skipped as any_rescaled says).
template <bool WITH_SUMS, int N_TILES, typename A>
__device__ __forceinline__ void rescale_rows(A (&acc)[N_TILES][4], A (&sums)[1][4], const A (&f)[2]) {
  if (any_rescaled(f)) {
    scale_rows(acc, f);
    if constexpr (WITH_SUMS) scale_rows(sums, f);
  }
}

// O = (O + B) * f over O's n-tiles [first, first + N_TILES), rows g by f[0] and g + 8 by f[1]: a key block's
// products B, summed apart from O, join it before the softmax's factor for O applies (the multiply skipped as
// any_rescaled says).
template <int N_TILES, int O_TILES, typename A>
__device__ __forceinline__ void add_rescaled(A (&acc)[O_TILES][4], int first, const A (&block)[N_TILES][4],
                                             const A (&f)[2]) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[first + j][e] += block[j][e];
  if (any_rescaled(f)) {
#pragma unroll
    for (int j = 0; j < N_TILES; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[first + j][e] *= f[e >> 1];
  }
}
