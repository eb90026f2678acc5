"""A decode step with the keys as the products' rows: the premise of the plan in docs/design/fp8_kvcache.md
("The kernel that would be fast"), measured on a prototype before any library kernel is written.

The prototype (source below; the library's device pieces: common.cuh, mma.cuh, copy.cuh) attends one query row per
query head (Nq = 1) of bf16 q, k, v, contiguous caches, D = 128, G = Hq / Hk <= 8, no mask (every key seen), split
along the keys; it writes each split's normalized out and lse, and the host merges them (the library's kernel
merges in its last CTA: a few µs on these sizes, left out of the prototype's time). Per tile of 64 keys each of 4
warps takes 16 keys: S^T = K Q^T (m16n8k16: K's rows by ldmatrix, q^T's fragments in registers for the whole
split), the online softmax per query row across the 8 lanes of a column, P^T into the B operand by movmatrix.trans,
O^T += V^T P^T (V^T by ldmatrix.trans). 16 products per warp and tile against the library kernel's 24 per warp over
twice the warps.

Prints, for B = 8 and 64 at Nk = 32k (32/8 heads): the prototype's error against the library's out, and the GPU
time per call of both (CUDA events over back-to-back calls, median of 7 runs of 20), with the read rate.

    PYTHONPATH=. python bench/exp/26_decode_keys_as_rows.py
"""

import math
import re
import statistics

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash._cuda.source import source_dir

BF16 = ml_dtypes.bfloat16
HEAD, BLOCK_N, THREADS, STAGES = 128, 64, 128, 3
STRIDE = HEAD + 8
SMEM = STAGES * 2 * BLOCK_N * STRIDE * 2

KERNEL = r"""
constexpr int HEAD = 128, BLOCK_N = 64, THREADS = 128, STAGES = 3, STRIDE = HEAD + 8, TILE = BLOCK_N * STRIDE;

struct Args {
  const bfloat16_t* q;  // (B, Hq, 1, D)
  const bfloat16_t* k;  // (B, Hk, N, D)
  const bfloat16_t* v;
  float* out_part;  // (splits, B, Hk, 8, D)
  float* lse_part;  // (splits, B, Hk, 8)
  int batch, n, hk, group, splits, tiles_per_split;
  float scale_log2;
};

__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) decode_keys_as_rows(const Args a) {
  extern __shared__ __align__(16) unsigned char smem[];
  bfloat16_t* ring = reinterpret_cast<bfloat16_t*>(smem);
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tiles = (a.n + BLOCK_N - 1) / BLOCK_N;
  const int t0 = split * a.tiles_per_split, t1 = min(tiles, t0 + a.tiles_per_split);
  const i64 head = static_cast<i64>(b) * a.hk + hk;
  const bfloat16_t* kb = a.k + head * a.n * HEAD;
  const bfloat16_t* vb = a.v + head * a.n * HEAD;
  auto load = [&](int tile, int stage) {
    bfloat16_t* kt = ring + stage * 2 * TILE;
    bfloat16_t* vt = kt + TILE;
#pragma unroll
    for (int i = threadIdx.x; i < BLOCK_N * HEAD / 8; i += THREADS) {
      const int r = i / (HEAD / 8), c = (i % (HEAD / 8)) * 8, pos = tile * BLOCK_N + r;
      const bool ok = pos < a.n;
      const i64 at = static_cast<i64>(ok ? pos : 0) * HEAD + c;
      cp_async_16(smem_u32(kt + r * STRIDE + c), kb + at, ok);
      cp_async_16(smem_u32(vt + r * STRIDE + c), vb + at, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (t0 + s < t1) load(t0 + s, s);
    cp_async_commit();
  }
  // q^T's B fragments: column g of the products is query head hk * G + g (zeros past G).
  u32 qf[HEAD / 16][2];
  {
    const bool ok = g < a.group;
    const bfloat16_t* qr = a.q + (head * a.group + (ok ? g : 0)) * HEAD;
#pragma unroll
    for (int s = 0; s < HEAD / 16; ++s) {
      qf[s][0] = ok ? *reinterpret_cast<const u32*>(qr + 16 * s + 2 * t) : 0u;
      qf[s][1] = ok ? *reinterpret_cast<const u32*>(qr + 16 * s + 2 * t + 8) : 0u;
    }
  }
  float o[HEAD / 16][4];
#pragma unroll
  for (int m = 0; m < HEAD / 16; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.0f, 0.0f};  // rows 2t, 2t + 1
  for (int n = t0; n < t1; ++n) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (n + STAGES - 1 < t1) load(n + STAGES - 1, (n + STAGES - 1 - t0) % STAGES);
    cp_async_commit();
    const bfloat16_t* kt = ring + ((n - t0) % STAGES) * 2 * TILE;
    const bfloat16_t* vt = kt + TILE;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // S^T: keys g, g + 8 of the warp's 16; rows 2t, 2t + 1
#pragma unroll
    for (int s = 0; s < HEAD / 16; ++s) {
      u32 af[4];
      ldsm_x4(af, smem_u32(a_lane_ptr(kt, STRIDE, warp * 16, 16 * s, lane)));
      mma16_op<bfloat16_t>(c, af, qf[s]);
    }
    const int key = n * BLOCK_N + warp * 16 + g;
    c[0] = key < a.n ? c[0] * a.scale_log2 : neg_inf();
    c[1] = key < a.n ? c[1] * a.scale_log2 : neg_inf();
    c[2] = key + 8 < a.n ? c[2] * a.scale_log2 : neg_inf();
    c[3] = key + 8 < a.n ? c[3] * a.scale_log2 : neg_inf();
    float m0 = fmaxf(c[0], c[2]), m1 = fmaxf(c[1], c[3]);
#pragma unroll
    for (int off = 4; off < 32; off *= 2) {
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, off));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, off));
    }
    const float n0 = fmaxf(row_max[0], m0), n1 = fmaxf(row_max[1], m1);
    const float base0 = n0 == neg_inf() ? 0.0f : n0, base1 = n1 == neg_inf() ? 0.0f : n1;
    if (n0 != row_max[0] || n1 != row_max[1]) {
      const float r0 = fast_exp2(row_max[0] - base0), r1 = fast_exp2(row_max[1] - base1);
      row_sum[0] *= r0;
      row_sum[1] *= r1;
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
        o[m][0] *= r0;
        o[m][2] *= r0;
        o[m][1] *= r1;
        o[m][3] *= r1;
      }
      row_max[0] = n0;
      row_max[1] = n1;
    }
    const float p0 = fast_exp2(c[0] - base0), p1 = fast_exp2(c[1] - base1);
    const float p2 = fast_exp2(c[2] - base0), p3 = fast_exp2(c[3] - base1);
    row_sum[0] += p0 + p2;
    row_sum[1] += p1 + p3;
    const u32 pb[2] = {movmatrix_trans(Elem<bfloat16_t>::pack2(p0, p1)),
                       movmatrix_trans(Elem<bfloat16_t>::pack2(p2, p3))};
#pragma unroll
    for (int m = 0; m < HEAD / 16; ++m) {
      u32 af[4];
      const bfloat16_t* at =
          vt + (warp * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * STRIDE + 16 * m + ((lane >> 3) & 1) * 8;
      ldsm_x4_trans(af, smem_u32(at));
      mma16_op<bfloat16_t>(o[m], af, pb);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    row_sum[0] += __shfl_xor_sync(0xffffffffu, row_sum[0], off);
    row_sum[1] += __shfl_xor_sync(0xffffffffu, row_sum[1], off);
  }
  __syncthreads();
  // The 4 warps' states merged through shared memory: maxes[w][row], sums[w][row], then out [row][d].
  float* maxes = reinterpret_cast<float*>(smem);
  float* sums = maxes + 4 * 8;
  float* merged = sums + 4 * 8;
  if (g == 0) {
    maxes[warp * 8 + 2 * t] = row_max[0];
    maxes[warp * 8 + 2 * t + 1] = row_max[1];
    sums[warp * 8 + 2 * t] = row_sum[0];
    sums[warp * 8 + 2 * t + 1] = row_sum[1];
  }
  for (int i = threadIdx.x; i < 8 * HEAD; i += THREADS) merged[i] = 0.0f;
  __syncthreads();
  float weight[2], lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 2 * t + h;
    float m = neg_inf();
    for (int w = 0; w < 4; ++w) m = fmaxf(m, maxes[w * 8 + row]);
    const float base = m == neg_inf() ? 0.0f : m;
    float total = 0.0f;
    for (int w = 0; w < 4; ++w) total += sums[w * 8 + row] * fast_exp2(maxes[w * 8 + row] - base);
    weight[h] = total > 0.0f ? fast_exp2(row_max[h] - base) / total : 0.0f;
    lse[h] = total > 0.0f ? (m + log2f(total)) * 0.6931471805599453f : neg_inf();
  }
  for (int w = 0; w < 4; ++w) {
    if (warp == w) {
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
        merged[(2 * t) * HEAD + 16 * m + g] += o[m][0] * weight[0];
        merged[(2 * t + 1) * HEAD + 16 * m + g] += o[m][1] * weight[1];
        merged[(2 * t) * HEAD + 16 * m + g + 8] += o[m][2] * weight[0];
        merged[(2 * t + 1) * HEAD + 16 * m + g + 8] += o[m][3] * weight[1];
      }
    }
    __syncthreads();
  }
  const i64 part = (static_cast<i64>(split) * a.batch * a.hk + head) * 8;
  for (int i = threadIdx.x; i < 8 * HEAD; i += THREADS) a.out_part[part * HEAD + i] = merged[i];
  if (warp == 0 && g == 0) {
    a.lse_part[part + 2 * t] = lse[0];
    a.lse_part[part + 2 * t + 1] = lse[1];
  }
}
"""

KERNEL_E4M3 = r"""
// The same with e4m3 caches (one descale per tensor here: the scales' handling is not what this measures): K's A
// fragments straight from the codes, the head dims permuted within every 16 so that a thread's fragment of a key row
// is 4 consecutive codes (dim 16s + 4t + i is k-index 2t, 2t + 1, 2t + 8, 2t + 9 for i = 0..3; q's fragments
// alike); V widened to float16 in shared memory for ldmatrix.trans; products in float16.
constexpr int RAW_STRIDE = HEAD + 16, RAW_TILE = BLOCK_N * RAW_STRIDE;  // bytes
constexpr int E_STAGES = 3;

struct ArgsE4M3 {
  const bfloat16_t* q;
  const unsigned char* k;  // codes (B, Hk, N, D)
  const unsigned char* v;
  float* out_part;
  float* lse_part;
  int batch, n, hk, group, splits, tiles_per_split;
  float scale_log2, k_scale, v_scale;
};

__device__ __forceinline__ u32 e4m3x2_to_f16x2(unsigned short two) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(two));
  return r;
}

extern "C" __global__ void __launch_bounds__(THREADS, 3) decode_keys_as_rows_e4m3(const ArgsE4M3 a) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* ring = smem;                                                 // E_STAGES x (k codes, v codes)
  half_t* wide_v = reinterpret_cast<half_t*>(smem + E_STAGES * 2 * RAW_TILE);  // [key][dv], STRIDE
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tiles = (a.n + BLOCK_N - 1) / BLOCK_N;
  const int t0 = split * a.tiles_per_split, t1 = min(tiles, t0 + a.tiles_per_split);
  const i64 head = static_cast<i64>(b) * a.hk + hk;
  const unsigned char* kb = a.k + head * a.n * HEAD;
  const unsigned char* vb = a.v + head * a.n * HEAD;
  auto load = [&](int tile, int stage) {
    unsigned char* kt = ring + stage * 2 * RAW_TILE;
    unsigned char* vt = kt + RAW_TILE;
#pragma unroll
    for (int i = threadIdx.x; i < BLOCK_N * HEAD / 16; i += THREADS) {
      const int r = i / (HEAD / 16), c = (i % (HEAD / 16)) * 16, pos = tile * BLOCK_N + r;
      const bool ok = pos < a.n;
      const i64 at = static_cast<i64>(ok ? pos : 0) * HEAD + c;
      cp_async_16(smem_u32(kt + r * RAW_STRIDE + c), kb + at, ok);
      cp_async_16(smem_u32(vt + r * RAW_STRIDE + c), vb + at, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < E_STAGES - 1; ++s) {
    if (t0 + s < t1) load(t0 + s, s);
    cp_async_commit();
  }
  u32 qf[HEAD / 16][2];  // q^T's B fragments in float16, head dims permuted as K's
  {
    const bool ok = g < a.group;
    const bfloat16_t* qr = a.q + (head * a.group + (ok ? g : 0)) * HEAD;
#pragma unroll
    for (int s = 0; s < HEAD / 16; ++s) {
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = ok ? Elem<bfloat16_t>::to_acc(qr[16 * s + 4 * t + i]) : 0.0f;
      qf[s][0] = Elem<half_t>::pack2(x[0], x[1]);
      qf[s][1] = Elem<half_t>::pack2(x[2], x[3]);
    }
  }
  float o[HEAD / 16][4];
#pragma unroll
  for (int m = 0; m < HEAD / 16; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.0f, 0.0f};
  const float k_factor = a.scale_log2 * a.k_scale;
  for (int n = t0; n < t1; ++n) {
    cp_async_wait<E_STAGES - 2>();
    __syncthreads();
    if (n + E_STAGES - 1 < t1) load(n + E_STAGES - 1, (n + E_STAGES - 1 - t0) % E_STAGES);
    cp_async_commit();
    const unsigned char* kt = ring + ((n - t0) % E_STAGES) * 2 * RAW_TILE;
    const unsigned char* vt = kt + RAW_TILE;
    // V's codes to float16 (every thread), for ldmatrix.trans after the barrier below.
#pragma unroll
    for (int i = threadIdx.x; i < BLOCK_N * HEAD / 16; i += THREADS) {
      const int r = i / (HEAD / 16), c = (i % (HEAD / 16)) * 16;
      const uint4 codes = *reinterpret_cast<const uint4*>(vt + r * RAW_STRIDE + c);
      uint4 lo, hi;
      lo.x = e4m3x2_to_f16x2(codes.x & 0xFFFF);
      lo.y = e4m3x2_to_f16x2(codes.x >> 16);
      lo.z = e4m3x2_to_f16x2(codes.y & 0xFFFF);
      lo.w = e4m3x2_to_f16x2(codes.y >> 16);
      hi.x = e4m3x2_to_f16x2(codes.z & 0xFFFF);
      hi.y = e4m3x2_to_f16x2(codes.z >> 16);
      hi.z = e4m3x2_to_f16x2(codes.w & 0xFFFF);
      hi.w = e4m3x2_to_f16x2(codes.w >> 16);
      uint4* dst = reinterpret_cast<uint4*>(wide_v + r * STRIDE + c);
      dst[0] = lo;
      dst[1] = hi;
    }
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const unsigned char* row_lo = kt + (warp * 16 + g) * RAW_STRIDE + 4 * t;
    const unsigned char* row_hi = row_lo + 8 * RAW_STRIDE;
#pragma unroll
    for (int s = 0; s < HEAD / 16; ++s) {
      const u32 lo = *reinterpret_cast<const u32*>(row_lo + 16 * s);
      const u32 hi = *reinterpret_cast<const u32*>(row_hi + 16 * s);
      const u32 af[4] = {e4m3x2_to_f16x2(lo & 0xFFFF), e4m3x2_to_f16x2(hi & 0xFFFF), e4m3x2_to_f16x2(lo >> 16),
                         e4m3x2_to_f16x2(hi >> 16)};
      mma16_op<half_t>(c, af, qf[s]);
    }
    const int key = n * BLOCK_N + warp * 16 + g;
    c[0] = key < a.n ? c[0] * k_factor : neg_inf();
    c[1] = key < a.n ? c[1] * k_factor : neg_inf();
    c[2] = key + 8 < a.n ? c[2] * k_factor : neg_inf();
    c[3] = key + 8 < a.n ? c[3] * k_factor : neg_inf();
    float m0 = fmaxf(c[0], c[2]), m1 = fmaxf(c[1], c[3]);
#pragma unroll
    for (int off = 4; off < 32; off *= 2) {
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, off));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, off));
    }
    const float n0 = fmaxf(row_max[0], m0), n1 = fmaxf(row_max[1], m1);
    const float base0 = n0 == neg_inf() ? 0.0f : n0, base1 = n1 == neg_inf() ? 0.0f : n1;
    if (n0 != row_max[0] || n1 != row_max[1]) {
      const float r0 = fast_exp2(row_max[0] - base0), r1 = fast_exp2(row_max[1] - base1);
      row_sum[0] *= r0;
      row_sum[1] *= r1;
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
        o[m][0] *= r0;
        o[m][2] *= r0;
        o[m][1] *= r1;
        o[m][3] *= r1;
      }
      row_max[0] = n0;
      row_max[1] = n1;
    }
    const float p0 = fast_exp2(c[0] - base0), p1 = fast_exp2(c[1] - base1);
    const float p2 = fast_exp2(c[2] - base0), p3 = fast_exp2(c[3] - base1);
    row_sum[0] += p0 + p2;
    row_sum[1] += p1 + p3;
    const u32 pb[2] = {movmatrix_trans(Elem<half_t>::pack2(p0, p1)), movmatrix_trans(Elem<half_t>::pack2(p2, p3))};
    __syncthreads();  // V's float16 tile is whole
#pragma unroll
    for (int m = 0; m < HEAD / 16; ++m) {
      u32 af[4];
      const half_t* at =
          wide_v + (warp * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * STRIDE + 16 * m + ((lane >> 3) & 1) * 8;
      ldsm_x4_trans(af, smem_u32(at));
      mma16_op<half_t>(o[m], af, pb);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    row_sum[0] += __shfl_xor_sync(0xffffffffu, row_sum[0], off);
    row_sum[1] += __shfl_xor_sync(0xffffffffu, row_sum[1], off);
  }
  __syncthreads();
  float* maxes = reinterpret_cast<float*>(smem);
  float* sums = maxes + 4 * 8;
  float* merged = sums + 4 * 8;
  if (g == 0) {
    maxes[warp * 8 + 2 * t] = row_max[0];
    maxes[warp * 8 + 2 * t + 1] = row_max[1];
    sums[warp * 8 + 2 * t] = row_sum[0];
    sums[warp * 8 + 2 * t + 1] = row_sum[1];
  }
  for (int i = threadIdx.x; i < 8 * HEAD; i += THREADS) merged[i] = 0.0f;
  __syncthreads();
  float weight[2], lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 2 * t + h;
    float m = neg_inf();
    for (int w = 0; w < 4; ++w) m = fmaxf(m, maxes[w * 8 + row]);
    const float base = m == neg_inf() ? 0.0f : m;
    float total = 0.0f;
    for (int w = 0; w < 4; ++w) total += sums[w * 8 + row] * fast_exp2(maxes[w * 8 + row] - base);
    weight[h] = total > 0.0f ? a.v_scale * fast_exp2(row_max[h] - base) / total : 0.0f;
    lse[h] = total > 0.0f ? (m + log2f(total)) * 0.6931471805599453f : neg_inf();
  }
  for (int w = 0; w < 4; ++w) {
    if (warp == w) {
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
        merged[(2 * t) * HEAD + 16 * m + g] += o[m][0] * weight[0];
        merged[(2 * t + 1) * HEAD + 16 * m + g] += o[m][1] * weight[1];
        merged[(2 * t) * HEAD + 16 * m + g + 8] += o[m][2] * weight[0];
        merged[(2 * t + 1) * HEAD + 16 * m + g + 8] += o[m][3] * weight[1];
      }
    }
    __syncthreads();
  }
  const i64 part = (static_cast<i64>(split) * a.batch * a.hk + head) * 8;
  for (int i = threadIdx.x; i < 8 * HEAD; i += THREADS) a.out_part[part * HEAD + i] = merged[i];
  if (warp == 0 && g == 0) {
    a.lse_part[part + 2 * t] = lse[0];
    a.lse_part[part + 2 * t + 1] = lse[1];
  }
}
"""
E4M3_SMEM = 3 * 2 * BLOCK_N * (HEAD + 16) + BLOCK_N * STRIDE * 2


def library_source() -> str:
    """The library's common, mma and copy headers pasted once each, then the prototype."""
    root, seen = source_dir(), set()
    include = re.compile(r'#include "([^"]+)"\n')

    def inline(name):
        if name in seen:
            return ""
        seen.add(name)
        return include.sub(lambda m: inline(m.group(1)), (root / name).read_text().replace("#pragma once\n", ""))

    return "".join(inline(name) for name in ("common.cuh", "mma.cuh", "copy.cuh")) + KERNEL + KERNEL_E4M3


def args_bytes(fields):
    names = ("q", "k", "v", "out_part", "lse_part")
    layout = [(n, np.uint64) for n in names] + [
        (n, np.int32) for n in ("batch", "n", "hk", "group", "splits", "tiles_per_split")
    ]
    layout += [(n, np.float32) for n in ("scale_log2", "k_scale", "v_scale") if n in fields or n == "scale_log2"]
    dtype = np.dtype(layout, align=True)
    words = np.zeros(1, dtype)
    for name, value in fields.items():
        words[0][name] = value
    return words.view(np.dtype((np.void, dtype.itemsize)))


def timed_us(fn, calls=20, repeats=7):
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls)
    return statistics.median(times)


def main(batches=(8, 64)):
    module = cupy.RawModule(code=library_source(), options=("-std=c++17",))
    kernel = module.get_function("decode_keys_as_rows")
    kernel.max_dynamic_shared_size_bytes = SMEM
    kernel8 = module.get_function("decode_keys_as_rows_e4m3")
    kernel8.max_dynamic_shared_size_bytes = E4M3_SMEM
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    rng = np.random.default_rng(0)
    hq, hk, nk = 32, 8, 32768
    for batch in batches:
        q = cupy.asarray(rng.standard_normal((batch, hq, 1, HEAD), dtype=np.float32).astype(BF16))
        k, v = (cupy.random.standard_normal((batch, hk, nk, HEAD), dtype=np.float32).astype(BF16) for _ in "kv")
        tiles = math.ceil(nk / BLOCK_N)
        # Whole waves of two CTAs per SM: the fewest splits whose CTAs fill a whole number of waves to within 5%.
        waves = next(w for w in range(1, 64) if (w * 2 * sms) % (batch * hk) <= 0.05 * batch * hk or w == 63)
        splits = max(1, round(waves * 2 * sms / (batch * hk)))
        per = math.ceil(tiles / splits)
        splits = math.ceil(tiles / per)
        out_part = cupy.empty((splits, batch, hk, 8, HEAD), np.float32)
        lse_part = cupy.empty((splits, batch, hk, 8), np.float32)
        fields = dict(
            q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out_part=out_part.data.ptr, lse_part=lse_part.data.ptr,
            batch=batch, n=nk, hk=hk, group=hq // hk, splits=splits, tiles_per_split=per,
            scale_log2=math.log2(math.e) / math.sqrt(HEAD),
        )  # fmt: skip
        params = args_bytes(fields)

        def run():
            kernel((splits, hk, batch), (THREADS,), (params,), shared_mem=SMEM)

        def library():
            return cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=nk)

        run()
        lse = lse_part[..., : hq // hk]  # (splits, B, Hk, G)
        top = lse.max(axis=0)
        w = cupy.exp(lse - top)
        out = (out_part[..., : hq // hk, :] * w[..., None]).sum(axis=0) / w.sum(axis=0)[..., None]
        out = out.reshape(batch, hq, 1, HEAD)
        ref = library().astype(np.float32)
        error = float(cupy.linalg.norm(out - ref) / cupy.linalg.norm(ref))
        ours, lib = timed_us(run), timed_us(library)
        read = 2 * k.nbytes
        k8, v8 = cupyflash.quantize_kvcache(k, "tensor"), cupyflash.quantize_kvcache(v, "tensor")
        params8 = args_bytes(
            dict(fields, k=k8.data.data.ptr, v=v8.data.data.ptr, k_scale=float(k8.scale.get()[0, 0, 0]),
                 v_scale=float(v8.scale.get()[0, 0, 0]))
        )  # fmt: skip

        def run8():
            kernel8((splits, hk, batch), (THREADS,), (params8,), shared_mem=E4M3_SMEM)

        def library8():
            return cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk)

        run8()
        w8 = cupy.exp(lse_part[..., : hq // hk] - lse_part[..., : hq // hk].max(axis=0))
        out8 = (out_part[..., : hq // hk, :] * w8[..., None]).sum(axis=0) / w8.sum(axis=0)[..., None]
        ref8 = library8().astype(np.float32)
        error8 = float(cupy.linalg.norm(out8.reshape(ref8.shape) - ref8) / cupy.linalg.norm(ref8))
        ours8, lib8 = timed_us(run8), timed_us(library8)
        print(
            f"B{batch:<3} Nk{nk // 1024}k e4m3: error vs library FP8 {error8:.2e} | prototype {ours8:8.1f} us "
            f"({read / 2 / ours8 / 1e6:.2f} TB/s) | library FP8 {lib8:8.1f} us | prototype / library bf16 "
            f"{ours8 / lib:.3f} | prototype / library FP8 {ours8 / lib8:.3f}",
            flush=True,
        )
        print(
            f"B{batch:<3} Nk{nk // 1024}k splits {splits:3}: error vs library {error:.2e} | prototype {ours:8.1f} us "
            f"({read / ours / 1e6:.2f} TB/s) | library {lib:8.1f} us ({read / lib / 1e6:.2f} TB/s) | ratio "
            f"{ours / lib:.3f}",
            flush=True,
        )
    cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    import sys

    main(tuple(int(x) for x in sys.argv[1:]) or (8, 64))
