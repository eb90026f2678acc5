// dropout.cuh — the dropout keep mask Z, regenerated wherever a kernel needs it (HAS_DROPOUT kernels).
//
// Semantics (cupyflash/_dropout.py is the authority): Z_ij of flat batch entry b, query i, key j is the
// 16-bit value u of Philox 4x32-10 with
//   counter = ((j >> 4) * 4 + ((j >> 1) & 3), (i >> 4) * 8 + (i & 7), b, 0),  key = the 64-bit seed,
//   slot = ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1), u = half (slot & 1) of word (slot >> 1),
// kept iff u < threshold. Nothing is stored between passes: the forward and both backward passes call
// the generator again, so the mask costs no memory and is the same whatever the tiles.
// One call covers 8 elements that one thread holds in the forward's (and the dQ pass's) accumulator
// layout: rows g and g + 8, columns 2t, 2t + 1 of two adjacent n8 tiles. In the dK/dV pass's transposed
// tiles (keys along the rows) a thread holds 4 of each call's 8, and its neighbour lane ^ 4 the other 4:
// each of the two makes one of their two calls and they swap halves (one shuffle).
// The forward and the dQ pass apply each call's values to their elements at once (drop_rows); the dK/dV
// pass needs Z for both dS and dV (attention_bwd.cu applies it to P^T, whose product with dP^T then
// gives dS), so it first packs a tile's keep bits into one 64-bit register (bit 4 * j + e for
// accumulator element [j][e], keep_cols) and draws the numbers once.
#pragma once
#include "common.cuh"
#include "params.cuh"

struct Dropout {
  const AttnParams& p;  // the round keys, read as constant operands (p.dropout_keys)
  u32 batch;            // flat batch index b: the third counter word
  u32 threshold;        // keep iff u < threshold (<= 65536)

  __device__ __forceinline__ Dropout(const AttnParams& params, int b)
      : p(params), batch(static_cast<u32>(b)), threshold(params.dropout_threshold) {}

  // Philox 4x32-10 of counter (c0, c1, batch, 0). Each round is two 32 x 32 -> 64-bit multiplies and two
  // three-way xors; its key words come from the host's key schedule in the parameters, so they cost
  // neither registers nor the two adds per round of an in-kernel schedule.
  __device__ __forceinline__ uint4 philox(u32 c0, u32 c1) const {
    u32 c2 = batch, c3 = 0;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
      const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
      const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
      c0 = hi1 ^ c1 ^ p.dropout_keys[2 * r];
      c1 = lo1;
      c2 = hi0 ^ c3 ^ p.dropout_keys[2 * r + 1];
      c3 = lo0;
    }
    return make_uint4(c0, c1, c2, c3);
  }

  // x -> Z ? x * scale : 0 in place on an accumulator tile with queries along the rows (the forward's P,
  // the dQ pass's dP): this warp's rows start at query row0, its columns at key col0 (multiples of 16).
  // Fully unrolled, every call's 8 values go straight to their elements (a compare and a select each):
  // no bit packing, and the calls are independent chains the scheduler can interleave with each other
  // and with the softmax.
  template <int N, typename A>
  __device__ __forceinline__ void drop_rows(A (&s)[N][4], int row0, int col0, int lane, A scale = A(1)) const {
    static_assert(N % 2 == 0, "whole 16-key blocks");
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int jj = 0; jj < N / 2; ++jj) {
      const uint4 u = philox(static_cast<u32>(((col0 >> 4) + jj) * 4 + t), static_cast<u32>((row0 >> 4) * 8 + g));
      const u32 words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // element [2 jj + h][e] is slot (e >> 1) * 4 + h * 2 + (e & 1)
          const int slot = (e >> 1) * 4 + h * 2 + (e & 1);
          const u32 value = (slot & 1) ? words[slot >> 1] >> 16 : words[slot >> 1] & 0xffffu;
          s[2 * jj + h][e] = value < threshold ? s[2 * jj + h][e] * scale : A(0);
        }
    }
  }

  // Keep bits of a transposed tile (dK/dV pass: keys along the rows), bit 4j + e for element [j][e];
  // this warp's rows start at key key_row0, its columns at query query_col0 (multiples of 16).
  // A thread's keys g, g + 8 take half (g & 1) of each word of the calls for queries 2t and 2t + 1 of
  // every 8; its partner (lane ^ 4: key g ^ 1) needs the same two calls' other halves. So each of the
  // two draws one call (query 2t + (g & 1)), keeps its own half's 4 bits and hands the other 4 over.
  template <int N, int UNROLL = 1>
  __device__ __forceinline__ u64 keep_cols(int key_row0, int query_col0, int lane) const {
    static_assert(N % 2 == 0 && N <= 16, "whole 16-query blocks, at most 64 bits");
    const int g = lane >> 2, t = lane & 3;
    const int c = g & 1;            // the query (2t + c) this thread draws for
    const int mine = 16 * (g & 1);  // the half of each word this thread's keys take
    u64 bits = 0;
    // UNROLL calls at a time: the callers unroll 16-bit inputs' tiles fully (independent chains for the
    // scheduler, and the bits go in by constant shifts; docs/design/dropout.md), float32 and float64 not at
    // all (their passes spill with two).
#pragma unroll UNROLL
    for (int jj = 0; jj < N / 2; ++jj) {
      // Query 16 jj + 8 h + 2t + c, key g + 8 r: slot h * 4 + r * 2 + (g & 1), word h * 2 + r, element
      // [2 jj + h][2 r + c]: bit 4 h + 2 r + c of this byte.
      const uint4 u = philox(static_cast<u32>((key_row0 >> 4) * 4 + (g >> 1)),
                             static_cast<u32>(((query_col0 >> 4) + jj) * 8 + 2 * t + c));
      const u32 words[4] = {u.x, u.y, u.z, u.w};
      u32 own = 0, other = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const u32 w = words[h * 2 + r];
          const int bit = 4 * h + 2 * r + c;
          own |= static_cast<u32>(((w >> mine) & 0xffffu) < threshold) << bit;
          other |= static_cast<u32>(((w >> (16 - mine)) & 0xffffu) < threshold) << bit;
        }
      const u32 byte = own | __shfl_xor_sync(0xffffffffu, other, 4);
      bits |= static_cast<u64>(byte) << (8 * jj);
    }
    return bits;
  }
};

// x = Z ? x * scale : 0, element by element (scale 1: the dropped elements only).
template <int N, typename A>
__device__ __forceinline__ void apply_keep(A (&x)[N][4], u64 bits, A scale = A(1)) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[j][e] = (bits >> (4 * j + e)) & 1u ? x[j][e] * scale : A(0);
}
