// block_info.cuh — the flat parameter struct every kernel receives, and where one CTA's
// batch entry lives in each tensor.
//
// Layout: every tensor is (batch..., rows, cols) with a unit stride on cols (the score modifiers' arrays
// carry a column stride too). The leading ("batch") dims are collapsed on the host into at most three,
// b = (b0 * batch1 + b1) * batch2 + b2, and each input carries its own strides for them (0 for a
// broadcast dim: GQA/MQA without copies). Outputs and workspaces the library allocates (out, lse, dq,
// dk, dv, lse_log2, delta) are contiguous in the flat batch index b.
// Variable-length (packed) batches: with cu_seqlens_q / cu_seqlens_k set, b0 is the sequence (its
// batch strides are 0) and (b1, b2) the head; sequence s owns rows [cu_seqlens_q[s], cu_seqlens_q[s + 1])
// of q, out, dout and [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of k, v, and its per-row arrays (lse, delta,
// lse_log2, dq; dk, dv) are laid out (head, packed row): see SeqInfo. Packed batches run the HAS_MODS
// instantiations (causal as the window's right edge): only they read cu_seqlens, so that the plain
// kernels keep nq and nk as constants, not registers (their tightest variants have none to spare); the
// HAS_MODS ones keep them in shared memory, read where used.
// The host mirrors this struct as an aligned NumPy dtype (cupyflash/_kernels.py, PARAMS_DTYPE): keep the
// two in the same order.
#pragma once
#include "common.cuh"

// Which score modifiers a kernel is instantiated for. none: the plain and causal kernels. scalars: window
// (causal travels in it), softcap and ALiBi, whose terms come from a few numbers per batch entry, and in
// the backward the block mask, which skips whole tiles and touches no score. all: also the per-element
// arrays (bias and its gradient, mask) and the forward's block mask. Each of those two still checks at run
// time which of its options are on; leaving the arrays out of `scalars` frees the registers their
// addresses and index math hold, so those kernels can take larger tiles. softcap: the scalars' backward
// passes for a softcap alone, causal or not (IS_CAUSAL, as the plain kernels), on dense batches: the
// window, ALiBi, block mask and packed lengths are compile-time constants there, so none of the scalars'
// per-tile tests and shared-memory lengths remain (the softcapped backward ran 6% faster: bench/NOTES.md, v16).
// window: the scalars' forward and backward for a window alone (causal travels in it, as in scalars), on
// dense batches: softcap, ALiBi, block mask and packed lengths are compile-time constants likewise.
// dense_scalars: the scalars' forward on dense batches (the warp-specialized forward, whose warpgroups share
// no barrier after the start, and so cannot keep a packed entry's lengths in shared memory as SeqInfo does).
enum class Mods { none, softcap, window, scalars, all, dense_scalars };

// Whether a MODS kernel reads cu_seqlens (packed batches; SeqInfo's MAY_BE_PACKED).
__host__ __device__ constexpr bool may_be_packed(Mods mods) { return mods == Mods::scalars || mods == Mods::all; }

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
  int d_qk;  // head dim of q and k (a multiple of 16 bytes' worth of elements, <= HEAD_DIM)
  int d_v;   // head dim of v and out (likewise)
  float scale;       // softmax scale applied to q . k
  float scale_log2;  // scale * log2(e), folded so the softmax runs on exp2
  // Score modifiers, read by HAS_MODS kernels only (score_mods.cuh, Mods below); null pointers / zeros = off.
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
  i64 alibi_stride[3];              // [b0, b1, b2] of alibi_slopes, in elements (0 along a broadcast dim)
  int window_left;   // keys j >= i + nk - nq - left are seen; -1 = unbounded
  int window_right;  // keys j <= i + nk - nq + right are seen; -1 = unbounded; causal = 0
  int bias_f32;      // bias is float32 (else the inputs' type)
  int bias_pairs;    // bias has unit column stride and pairs of columns are aligned for one load
  int dbias_pairs;   // dbias is broadcast along no dim (one writer per element): aligned pair stores
  int dbias_f32;     // dbias is float32 (else the inputs' type; an accumulator: the accumulator type)
  float softcap;     // > 0: scores become softcap * tanh(score / softcap)
  float softcap_inv; // 1 / softcap (0 when off)
  // Backward passes: the rows of the streamed axis this launch sums over, [stream_begin, stream_end):
  // queries for the dK/dV pass, keys for the dQ pass. The host splits long sequences into several
  // launches (cupyflash/_config.py, CHAIN_ROWS); block boundaries line up with BLOCK_M and BLOCK_N.
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
};

// The real-valued parameters in a kernel's accumulator type A (float; double for float64 inputs).
template <typename A> struct Reals;
template <> struct Reals<float> {
  __device__ __forceinline__ static float scale(const AttnParams& p) { return p.scale; }
  __device__ __forceinline__ static float scale_log2(const AttnParams& p) { return p.scale_log2; }
  __device__ __forceinline__ static float softcap(const AttnParams& p) { return p.softcap; }
  __device__ __forceinline__ static float softcap_inv(const AttnParams& p) { return p.softcap_inv; }
  __device__ __forceinline__ static float dropout_scale(const AttnParams& p) { return p.dropout_scale; }
};
template <> struct Reals<double> {
  __device__ __forceinline__ static double scale(const AttnParams& p) { return p.scale_f64; }
  __device__ __forceinline__ static double scale_log2(const AttnParams& p) { return p.scale_log2_f64; }
  __device__ __forceinline__ static double softcap(const AttnParams& p) { return p.softcap_f64; }
  __device__ __forceinline__ static double softcap_inv(const AttnParams& p) { return p.softcap_inv_f64; }
  __device__ __forceinline__ static double dropout_scale(const AttnParams& p) { return p.dropout_scale_f64; }
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

// The lengths (nq, nk) of a MAY_BE_PACKED kernel's batch entry, written once by its SeqInfo. Shared memory,
// read through volatile loads where they are used: in registers they would live through the main loop,
// and the modifiers' kernels, whose tightest variants are at 255 registers, would spill.
__shared__ int seq_lengths[2];
__device__ __forceinline__ int shared_nq() { return *static_cast<volatile const int*>(&seq_lengths[0]); }
__device__ __forceinline__ int shared_nk() { return *static_cast<volatile const int*>(&seq_lengths[1]); }

// The sequence of batch entry b: its lengths nq(), nk(), where its rows start in the strided tensors (added
// to the batch offset), and where they start in the library's per-row arrays: lse, delta, lse_log2, dq at
// q_flat (+ row), dk, dv at k_flat. Dense batches: (nq, nk, 0, 0, b * nq, b * nk). MAY_BE_PACKED: the
// kernel reads cu_seqlens when set (HAS_MODS kernels; the constructor then synchronizes the CTA, so every
// thread of it must construct one); otherwise the batch is dense and nq, nk are the parameters' constants.
template <bool MAY_BE_PACKED>
struct SeqInfo {
  const AttnParams& p;
  i64 q_row, k_row;
  i64 q_flat, k_flat;

  __device__ __forceinline__ SeqInfo(const AttnParams& params, int b) : p(params) {
    if (MAY_BE_PACKED && p.cu_seqlens_q) {
      const int s = b / p.heads, h = b % p.heads;
      const int q0 = p.cu_seqlens_q[s], k0 = p.cu_seqlens_k[s];
      if (threadIdx.x == 0) {
        seq_lengths[0] = p.cu_seqlens_q[s + 1] - q0;
        seq_lengths[1] = p.cu_seqlens_k[s + 1] - k0;
      }
      q_row = q0;
      k_row = k0;
      q_flat = static_cast<i64>(h) * p.total_q + q0;
      k_flat = static_cast<i64>(h) * p.total_k + k0;
    } else {
      if (MAY_BE_PACKED && threadIdx.x == 0) {
        seq_lengths[0] = p.nq;
        seq_lengths[1] = p.nk;
      }
      q_row = k_row = 0;
      q_flat = static_cast<i64>(b) * p.nq;
      k_flat = static_cast<i64>(b) * p.nk;
    }
    if (MAY_BE_PACKED) __syncthreads();
  }

  __device__ __forceinline__ int nq() const {
    if constexpr (MAY_BE_PACKED) return shared_nq();
    return p.nq;
  }
  __device__ __forceinline__ int nk() const {
    if constexpr (MAY_BE_PACKED) return shared_nk();
    return p.nk;
  }

  // Bottom-right causal alignment (FlashAttention-2): query row i sees key j iff j <= i + nk - nq.
  __device__ __forceinline__ int causal_offset() const { return nk() - nq(); }
};
