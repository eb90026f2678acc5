// score_mods.cuh — the score modifiers, for kernels instantiated with HAS_MODS = true.
//
// Semantics (cupyflash/_modifiers.py is the authority; off = offset = nk - nq):
//   x_ij = scale * q_i . k_j
//   x_ij = softcap * tanh(x_ij / softcap)          softcap > 0
//   x_ij -= slope_b * |i + off - j|                 ALiBi
//   x_ij += bias[b, i, j]                           additive bias (T or float32, any strides)
//   x_ij = -inf  when j >= nk, i >= nq, j is outside the window band
//                [i + off - left, i + off + right] (-1 = unbounded; causal arrives as right = 0),
//                or mask[b, i, j] is false.
// The block mask is not applied per element: kernels skip its false tiles whole (tile_on), which
// needs each kernel tile to lie inside one BLOCK_MASK_TILE x BLOCK_MASK_TILE block (tiles are powers
// of two <= 128, aligned). Logits come back in natural units; kernels then run the softmax with
// log2(e) as the exponent's scale instead of scale * log2(e).
// Every option is a uniform run-time branch; the plain kernels (HAS_MODS = false) never see this file's
// code, so options that are off cost them nothing.
#pragma once
#include "common.cuh"
#include "block_info.cuh"

constexpr int BLOCK_MASK_TILE = 128;  // must match cupyflash/_modifiers.py

// tanh for the softcap. float32 takes the accurate libdevice tanhf (float32 accuracy is the point of
// that dtype); 16-bit types take 1 - 2 / (exp(2x) + 1) on the special-function unit, whose ~1e-7
// absolute error is far below their rounding, and which saturates cleanly to +-1.
template <typename T>
__device__ __forceinline__ float softcap_tanh(float x) {
  return 1.f - 2.f * __frcp_rn(fast_exp2(2.f * LOG2E * x) + 1.f);
}
template <>
__device__ __forceinline__ float softcap_tanh<float>(float x) { return tanhf(x); }

// Per CTA it keeps only its batch entry's base pointers and slope in registers; sizes, strides and
// flags are read from the kernel's parameter struct (constant memory operands, no registers), which
// keeps the modifier kernels' register footprint close to the plain ones'.
template <typename T>
struct ScoreMods {
  const AttnParams& p;
  const void* bias;
  float* dbias;
  const unsigned char* mask;
  const unsigned char* block_mask;
  float slope;

  __device__ __forceinline__ ScoreMods(const AttnParams& params, int b) : p(params) {
    slope = p.alibi_slopes ? p.alibi_slopes[b] : 0.f;
    bias = p.bias ? static_cast<const char*>(p.bias) + batch_offset(p.bias_stride, b, p) * (p.bias_f32 ? 4 : sizeof(T)) : nullptr;
    dbias = p.dbias ? p.dbias + batch_offset(p.dbias_stride, b, p) : nullptr;
    mask = p.mask ? p.mask + batch_offset(p.mask_stride, b, p) : nullptr;
    block_mask = p.block_mask ? p.block_mask + batch_offset(p.block_mask_stride, b, p) : nullptr;
  }

  // Keys [first, last] that some query of rows [r0, r1] may see through the window band and nk.
  __device__ __forceinline__ int first_key(int r0) const { return p.window_left < 0 ? 0 : max(0, r0 + p.nk - p.nq - p.window_left); }
  __device__ __forceinline__ int last_key(int r1) const { return p.window_right < 0 ? p.nk - 1 : min(p.nk - 1, r1 + p.nk - p.nq + p.window_right); }
  // Queries [first, last] that may see some key of columns [c0, c1] (clipped to [0, nq - 1]).
  __device__ __forceinline__ int first_query(int c0) const { return p.window_right < 0 ? 0 : max(0, c0 - (p.nk - p.nq) - p.window_right); }
  __device__ __forceinline__ int last_query(int c1) const { return p.window_left < 0 ? p.nq - 1 : min(p.nq - 1, c1 - (p.nk - p.nq) + p.window_left); }

  // Does the tile rows [r0, r1] x cols [c0, c1] need per-element bound checks? Interior tiles of the
  // band that lie inside nq x nk do not.
  __device__ __forceinline__ bool needs_bounds(int r0, int r1, int c0, int c1) const {
    const int offset = p.nk - p.nq, left = p.window_left, right = p.window_right;
    return r1 >= p.nq || c1 >= p.nk || (right >= 0 && c1 > r0 + offset + right) || (left >= 0 && c0 < r1 + offset - left);
  }

  // Is the block-mask tile holding query row i and key j on?
  __device__ __forceinline__ bool tile_on(int i, int j) const {
    return !block_mask ||
           block_mask[(i / BLOCK_MASK_TILE) * p.block_mask_stride[3] + (j / BLOCK_MASK_TILE) * p.block_mask_stride[4]];
  }

  // The logit of raw score q_i . k_j (natural units), or -inf when hidden; dcap = d(logit)/d(scaled
  // score) of the softcap, 1 - tanh^2 (1 without softcap), for the backward.
  __device__ __forceinline__ float logit(float raw, int i, int j, bool check, float& dcap) const {
    const int offset = p.nk - p.nq, left = p.window_left, right = p.window_right;
    float x = raw * p.scale;
    dcap = 1.f;
    if (p.softcap > 0.f) {
      const float t = softcap_tanh<T>(x * p.softcap_inv);
      x = p.softcap * t;
      dcap = 1.f - t * t;
    }
    if (slope != 0.f) x -= slope * fabsf(static_cast<float>(i + offset - j));
    if (check && (i >= p.nq || j >= p.nk || (left >= 0 && j < i + offset - left) || (right >= 0 && j > i + offset + right)))
      return neg_inf();
    if (mask && !mask[i * p.mask_stride[3] + j * p.mask_stride[4]]) return neg_inf();
    if (bias) {
      const i64 at = i * p.bias_stride[3] + j * p.bias_stride[4];
      x += p.bias_f32 ? static_cast<const float*>(bias)[at] : Elem<T>::to_float(static_cast<const T*>(bias)[at]);
    }
    return x;
  }

  // Raw scores -> logits over a warp's accumulator tile. TRANSPOSED tiles (the dK/dV pass's S^T)
  // hold keys along the rows and queries along the columns.
  template <bool TRANSPOSED, int N_TILES>
  __device__ __forceinline__ void apply(float (&s)[N_TILES][4], int row0, int col0, int lane, bool check) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + g + 8 * (e >> 1), col = col0 + j * 8 + 2 * t + (e & 1);
        float dcap;
        s[j][e] = TRANSPOSED ? logit(s[j][e], col, row, check, dcap) : logit(s[j][e], row, col, check, dcap);
      }
    }
  }

  // Backward, one element: from raw score and dP, P = exp(logit - lse) and the gradient of the scaled
  // score, dS * dcap with dS = P * (dP - delta); dS itself (the bias gradient) is added into dbias.
  __device__ __forceinline__ void backward(float& s, float& dp, int i, int j, bool check, float lse_log2,
                                           float delta, bool write_dbias) const {
    float dcap;
    const float x = logit(s, i, j, check, dcap);
    const float prob = fast_exp2(x * LOG2E - lse_log2);
    const float ds = prob * (dp - delta);
    if (write_dbias && dbias && x != neg_inf()) atomicAdd(dbias + i * p.dbias_stride[3] + j * p.dbias_stride[4], ds);
    s = prob;
    dp = ds * dcap;
  }
};
