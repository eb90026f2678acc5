// block_info.cuh — the flat parameter struct every kernel receives, and where one CTA's
// batch entry lives in each tensor.
//
// Layout: every tensor is (batch..., rows, cols) with a unit stride on cols (the score modifiers' arrays
// carry a column stride too). The leading
// ("batch") dims are collapsed on the host into at most three, b = (b0 * batch1 + b1) * batch2 + b2,
// and each input carries its own strides for them (0 for a broadcast dim: GQA/MQA without copies).
// Outputs and workspaces the library allocates (out, lse, dq, dk, dv, lse_log2, delta) are
// contiguous in the flat batch index b. The host mirrors this struct as an aligned NumPy
// dtype (cupyflash/_kernels.py, PARAMS_DTYPE): keep the two in the same order.
#pragma once
#include "common.cuh"

struct AttnParams {
  void* q;
  void* k;
  void* v;
  void* out;
  void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* lse;       // natural-log LSE, (b, nq)
  float* lse_log2;  // backward workspace: lse * log2(e), +inf for rows that see no key
  float* delta;     // backward workspace: rowsum(dout * out)
  i64 q_stride[4];  // [b0, b1, b2, row], in elements
  i64 k_stride[4];
  i64 v_stride[4];
  i64 out_stride[4];
  i64 dout_stride[4];
  int batch;   // number of flat batch entries
  int batch1;  // sizes of the two inner collapsed batch dims
  int batch2;
  int nq;
  int nk;
  int d_qk;  // head dim of q and k (a multiple of 16 bytes' worth of elements, <= HEAD_DIM)
  int d_v;   // head dim of v and out (likewise)
  float scale;       // softmax scale applied to q . k
  float scale_log2;  // scale * log2(e), folded so the softmax runs on exp2
  // Score modifiers, read by HAS_MODS kernels only (score_mods.cuh); null pointers / zeros = off.
  const void* bias;                 // (b, nq, nk), T or float32 (bias_f32), any strides
  void* dbias;                      // the bias's own shape: a float32 accumulator (atomic adds; stride 0 =
                                    // summed), or with dbias_pairs the result itself, in the bias's dtype
  const unsigned char* mask;        // bool (b, nq, nk): true = the key takes part
  const unsigned char* block_mask;  // bool (b, ceil(nq / 128), ceil(nk / 128))
  const float* alibi_slopes;        // (b), one slope per flat batch entry
  i64 bias_stride[5];               // [b0, b1, b2, row, col], in elements
  i64 dbias_stride[5];
  i64 mask_stride[5];
  i64 block_mask_stride[5];
  int window_left;   // keys j >= i + nk - nq - left are seen; -1 = unbounded
  int window_right;  // keys j <= i + nk - nq + right are seen; -1 = unbounded; causal = 0
  int bias_f32;      // bias is float32 (else the inputs' type)
  int bias_pairs;    // bias has unit column stride and pairs of columns are aligned for one load
  int dbias_pairs;   // dbias is broadcast along no dim (one writer per element): aligned pair stores
  int dbias_f32;     // with dbias_pairs: dbias is float32 (else the inputs' type)
  float softcap;     // > 0: scores become softcap * tanh(score / softcap)
  float softcap_inv; // 1 / softcap (0 when off)
  // Backward passes: the rows of the streamed axis this launch sums over, [stream_begin, stream_end):
  // queries for the dK/dV pass, keys for the dQ pass. The host splits long sequences into several
  // launches (cupyflash/_config.py, CHAIN_ROWS); block boundaries line up with BLOCK_M and BLOCK_N.
  int stream_begin;
  int stream_end;
  // Dropout, read by HAS_DROPOUT kernels only (dropout.cuh): the seed's two words, the 16-bit keep
  // threshold and 1 / (1 - p), by which the kept probabilities are scaled.
  u32 dropout_key0;
  u32 dropout_key1;
  u32 dropout_threshold;
  float dropout_scale;
};

// Flat batch index of this CTA: blockIdx.y, extended by blockIdx.z past the 65535 limit of y.
__device__ __forceinline__ int batch_index() { return blockIdx.z * gridDim.y + blockIdx.y; }

template <int N>
__device__ __forceinline__ i64 batch_offset(const i64 (&stride)[N], int b, const AttnParams& p) {
  const int b2 = b % p.batch2;
  const int rest = b / p.batch2;
  const int b1 = rest % p.batch1;
  const int b0 = rest / p.batch1;
  return b0 * stride[0] + b1 * stride[1] + b2 * stride[2];
}

// Bottom-right causal alignment (FlashAttention-2): query row i sees key j iff j <= i + nk - nq.
__device__ __forceinline__ int causal_offset(const AttnParams& p) { return p.nk - p.nq; }
