// params.cuh — the flat parameter struct every kernel receives, and where one CTA's batch entry lives in
// each tensor.
//
// Layout: every tensor is (batch..., rows, cols) with a unit stride on cols (the score modifiers' arrays
// carry a column stride too). The leading ("batch") dims are collapsed on the host into at most three,
// b = (b0 * batch1 + b1) * batch2 + b2, and each input carries its own strides for them (0 for a
// broadcast dim: GQA/MQA without copies). Outputs and workspaces the library allocates (out, lse, dq,
// dk, dv, lse_log2, delta) are contiguous in the flat batch index b.
// Variable-length (packed) batches: with cu_seqlens_q / cu_seqlens_k set, b0 is the sequence (its
// batch strides are 0) and (b1, b2) the head; sequence s owns rows [cu_seqlens_q[s], cu_seqlens_q[s + 1])
// of q, out, dout and [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of k, v, and its per-row arrays (lse, delta,
// lse_log2, dq; dk, dv) are laid out (head, packed row): see seq_info.cuh.
// The host mirrors this struct as an aligned NumPy dtype (cupyflash/_cuda/params.py, PARAMS_DTYPE): keep
// the two in the same order.
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
  // The per-row arrays are in the accumulator type: float32, or float64 for float64 inputs.
  void* lse;        // natural-log LSE, (b, nq)
  void* lse_log2;   // backward workspace: lse * log2(e), +inf for rows that see no key
  void* delta;      // backward workspace: rowsum(dout * out)
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
  int d_qk;          // head dim of q and k (a multiple of 16 bytes' worth of elements, <= HEAD_DIM)
  int d_v;           // head dim of v and out (likewise)
  float scale;       // softmax scale applied to q . k
  float scale_log2;  // scale * log2(e), folded so the softmax runs on exp2
  // Score modifiers, read by HAS_MODS kernels only (score_mods.cuh, mods.cuh); null pointers / zeros = off.
  const void* bias;                 // (b, nq, nk), T or float32 (bias_f32), any strides
  void* dbias;                      // the bias's own shape: an accumulator in the kernel's accumulator type
                                    // (atomic adds; stride 0 = summed), or with dbias_pairs the result
                                    // itself, in the bias's dtype
  const unsigned char* mask;        // bool (b, nq, nk): true = the key takes part
  const unsigned char* block_mask;  // bool (b, ceil(nq / 128), ceil(nk / 128))
  const float* alibi_slopes;        // (b), one slope per flat batch entry (alibi_stride)
  i64 bias_stride[5];               // [b0, b1, b2, row, col], in elements
  i64 dbias_stride[5];
  i64 mask_stride[5];
  i64 block_mask_stride[5];
  i64 alibi_stride[3];  // [b0, b1, b2] of alibi_slopes, in elements (0 along a broadcast dim)
  int window_left;      // keys j >= i + nk - nq - left are seen; -1 = unbounded
  int window_right;     // keys j <= i + nk - nq + right are seen; -1 = unbounded; causal = 0
  int bias_f32;         // bias is float32 (else the inputs' type)
  int bias_pairs;       // bias has unit column stride and pairs of columns are aligned for one load
  int dbias_pairs;      // dbias is broadcast along no dim (one writer per element): aligned pair stores
  int dbias_f32;        // dbias is float32 (else the inputs' type; an accumulator: the accumulator type)
  float softcap;        // > 0: scores become softcap * tanh(score / softcap)
  float softcap_inv;    // 1 / softcap (0 when off)
  // Backward passes: the rows of the streamed axis this launch sums over, [stream_begin, stream_end):
  // queries for the dK/dV pass, keys for the dQ pass. The host splits long sequences into several
  // launches (cupyflash/_cuda/launch.py, CHAIN_ROWS); block boundaries line up with BLOCK_M and BLOCK_N.
  int stream_begin;
  int stream_end;
  // Dropout, read by HAS_DROPOUT kernels only (dropout.cuh): Philox's ten round keys of the seed (round
  // r's two words at [2r], [2r + 1]; the host runs the key schedule once per call, so the kernels read
  // each key as a constant operand instead of holding or recomputing it), the 16-bit keep threshold and
  // 1 / (1 - p), by which the kept probabilities are scaled.
  u32 dropout_keys[20];
  u32 dropout_threshold;
  float dropout_scale;
  // Variable-length batches (null = every batch entry has nq queries and nk keys; then nq, nk are the
  // lengths, else the longest ones, which size the grid).
  const int* cu_seqlens_q;  // (sequences + 1) offsets of the sequences' rows in the packed q, out, dout
  const int* cu_seqlens_k;  // likewise in k, v
  int heads;                // batch entries per sequence: batch1 * batch2
  int total_q;              // packed rows: the head stride of the per-row arrays
  int total_k;
  // The real-valued parameters above in float64, read by the float64 kernels instead (Reals<double>).
  double scale_f64;
  double scale_log2_f64;
  double softcap_f64;
  double softcap_inv_f64;
  double dropout_scale_f64;
  // float32 inputs on the wgmma path arrive split into float16 pieces (split_f32.cu), scaled by powers of
  // two: per flat batch entry and block of SPLIT_BLOCK_ROWS rows, (e_q, e_k, e_v, e_dout) as four int32
  // (pieces.cuh, Pieces; the forward reads e_k and e_v only, it splits q itself). Unused (null) elsewhere.
  const int* split_exponents;
  // e4m3 inputs (the warp-specialized forward's FP8 form): the descales of q, k, v (real value = stored value *
  // descale), per flat batch entry (contiguous) and per block of R rows, fp8_descale_blocks of them per entry.
  // A row's block, row / R, is (row * fp8_descale_magic) >> fp8_descale_shift in 64 bits (exact for rows below
  // 2^31, cupyflash/_cuda/fp8.py: division_magic), so that the loop over key blocks divides in two instructions,
  // not a division's dependent chain of about 25. Unused (null) elsewhere.
  const float* fp8_descale[3];
  int fp8_descale_blocks[3];
  u32 fp8_descale_magic[3];
  int fp8_descale_shift[3];
};

// The real-valued parameters in a kernel's accumulator type A (float; double for float64 inputs), from any
// parameter struct that carries them under these names (AttnParams, KVCacheParams).
template <typename A>
struct Reals;
template <>
struct Reals<float> {
  template <class P>
  __device__ __forceinline__ static float scale(const P& p) {
    return p.scale;
  }
  template <class P>
  __device__ __forceinline__ static float scale_log2(const P& p) {
    return p.scale_log2;
  }
  template <class P>
  __device__ __forceinline__ static float softcap(const P& p) {
    return p.softcap;
  }
  template <class P>
  __device__ __forceinline__ static float softcap_inv(const P& p) {
    return p.softcap_inv;
  }
  template <class P>
  __device__ __forceinline__ static float dropout_scale(const P& p) {
    return p.dropout_scale;
  }
};
template <>
struct Reals<double> {
  template <class P>
  __device__ __forceinline__ static double scale(const P& p) {
    return p.scale_f64;
  }
  template <class P>
  __device__ __forceinline__ static double scale_log2(const P& p) {
    return p.scale_log2_f64;
  }
  template <class P>
  __device__ __forceinline__ static double softcap(const P& p) {
    return p.softcap_f64;
  }
  template <class P>
  __device__ __forceinline__ static double softcap_inv(const P& p) {
    return p.softcap_inv_f64;
  }
  template <class P>
  __device__ __forceinline__ static double dropout_scale(const P& p) {
    return p.dropout_scale_f64;
  }
};

// Flat batch index of this CTA: blockIdx.y, extended by blockIdx.z past the 65535 limit of y.
__device__ __forceinline__ int batch_index() {
  return blockIdx.z * gridDim.y + blockIdx.y;
}

template <int N>
__device__ __forceinline__ i64 batch_offset(const i64 (&stride)[N], int b, const AttnParams& p) {
  const int b2 = b % p.batch2;
  const int rest = b / p.batch2;
  const int b1 = rest % p.batch1;
  const int b0 = rest / p.batch1;
  return b0 * stride[0] + b1 * stride[1] + b2 * stride[2];
}
