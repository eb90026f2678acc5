"""The keys-as-rows decode step with both caches' fragments read straight from the e4m3 codes: the next step of
bench/exp/26 (where V was widened to float16 in shared memory first, at 0.69x the bf16 step).

Prediction (from 26's ncu: 64 M instructions, issue slots 40% busy, 2.97 TB/s, so neither issue nor DRAM bound;
the widening pass costs 8 stores, 8 ldmatrix and a barrier per thread and tile): without the pass, about 35 M
instructions, one barrier per tile, a ring of stages a third smaller (4 CTAs per SM fit), and a read rate near
the bf16 kernel's 4.1 TB/s, which is 0.5x the bf16 step.

How the fragments come from the codes (m16n8k16, float16 operands; the reduction index k may be permuted as long
as both operands agree):
- S^T = K q^T: the head dims are permuted so that thread t's k-indices (2t, 2t+1, 2t+8, 2t+9) of slab s are dims
  32t + 4s + (0..3): a key row's 32 codes for thread t are one 32-byte run (two 16-byte loads); q^T alike.
- O^T += V^T P^T: the products' rows are dims, permuted so that row g of fragment m is dim 16g + 2m and row g + 8
  is 16g + 2m + 1: for each of its four keys (2t, 2t+1, 2t+8, 2t+9) thread (g, t) reads one 16-byte run, and one
  byte permute per key pair and fragment pairs two keys' codes of one dim for cvt.rn.f16x2.e4m3x2.

    PYTHONPATH=. python bench/exp/27_decode_codes_as_fragments.py [B ...]
"""

import importlib
import math
import os
import pathlib
import sys

import cupy
import ml_dtypes
import numpy as np

import cupyflash

sys.path.insert(0, str(pathlib.Path(__file__).parent))
exp26 = importlib.import_module("26_decode_keys_as_rows")

BF16 = ml_dtypes.bfloat16
HEAD, BLOCK_N, THREADS = 128, 64, 128
RAW_STRIDE = HEAD + 16

KERNEL = r"""
template <int STAGES, int MIN_BLOCKS, bool OWN>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) decode_codes(const ArgsE4M3 a) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* ring = smem;
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
    // OWN: each warp loads (and later reads) only its own 16 keys of the tile, so it waits for no other warp.
    const int first = OWN ? lane : threadIdx.x, count = OWN ? 16 * HEAD / 16 : BLOCK_N * HEAD / 16;
#pragma unroll
    for (int i = first; i < count; i += OWN ? 32 : THREADS) {
      const int r = i / (HEAD / 16) + (OWN ? 16 * warp : 0), c = (i % (HEAD / 16)) * 16, pos = tile * BLOCK_N + r;
      const bool ok = pos < a.n;
      const i64 at = static_cast<i64>(ok ? pos : 0) * HEAD + c;
      cp_async_16(smem_u32(kt + r * RAW_STRIDE + c), kb + at, ok);
      cp_async_16(smem_u32(vt + r * RAW_STRIDE + c), vb + at, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (t0 + s < t1) load(t0 + s, s);
    cp_async_commit();
  }
  u32 qf[HEAD / 16][2];  // slab s, k-indices 2t, 2t+1 | 2t+8, 2t+9 = dims 32t + 4s + 0, 1 | 2, 3
  {
    const bool ok = g < a.group;
    const bfloat16_t* qr = a.q + (head * a.group + (ok ? g : 0)) * HEAD + 32 * t;
#pragma unroll
    for (int s = 0; s < HEAD / 16; ++s) {
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = ok ? Elem<bfloat16_t>::to_acc(qr[4 * s + i]) : 0.0f;
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
    cp_async_wait<STAGES - 2>();
    if (OWN)
      __syncwarp();
    else
      __syncthreads();
    if (n + STAGES - 1 < t1) load(n + STAGES - 1, (n + STAGES - 1 - t0) % STAGES);
    cp_async_commit();
    const unsigned char* kt = ring + ((n - t0) % STAGES) * 2 * RAW_TILE;
    const unsigned char* vt = kt + RAW_TILE;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      const uint4* lo = reinterpret_cast<const uint4*>(kt + (warp * 16 + g) * RAW_STRIDE + 32 * t);
      const uint4* hi = reinterpret_cast<const uint4*>(kt + (warp * 16 + g + 8) * RAW_STRIDE + 32 * t);
      const uint4 l0 = lo[0], l1 = lo[1], h0 = hi[0], h1 = hi[1];
      const u32 lw[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
      const u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
      for (int s = 0; s < HEAD / 16; ++s) {
        const u32 af[4] = {e4m3x2_to_f16x2(lw[s] & 0xFFFF), e4m3x2_to_f16x2(hw[s] & 0xFFFF),
                           e4m3x2_to_f16x2(lw[s] >> 16), e4m3x2_to_f16x2(hw[s] >> 16)};
        mma16_op<half_t>(c, af, qf[s]);
      }
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
    {
      const unsigned char* vr = vt + (warp * 16 + 2 * t) * RAW_STRIDE + 16 * g;
      const uint4 k0 = *reinterpret_cast<const uint4*>(vr);
      const uint4 k1 = *reinterpret_cast<const uint4*>(vr + RAW_STRIDE);
      const uint4 k8 = *reinterpret_cast<const uint4*>(vr + 8 * RAW_STRIDE);
      const uint4 k9 = *reinterpret_cast<const uint4*>(vr + 9 * RAW_STRIDE);
      const u32 w0[4] = {k0.x, k0.y, k0.z, k0.w}, w1[4] = {k1.x, k1.y, k1.z, k1.w};
      const u32 w8[4] = {k8.x, k8.y, k8.z, k8.w}, w9[4] = {k9.x, k9.y, k9.z, k9.w};
#pragma unroll
      for (int m = 0; m < HEAD / 16; ++m) {
        const u32 sel = (m % 2) ? 0x7362u : 0x5140u;
        const u32 lo = __byte_perm(w0[m / 2], w1[m / 2], sel), hi = __byte_perm(w8[m / 2], w9[m / 2], sel);
        const u32 af[4] = {e4m3x2_to_f16x2(lo & 0xFFFF), e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi & 0xFFFF),
                           e4m3x2_to_f16x2(hi >> 16)};
        mma16_op<half_t>(o[m], af, pb);
      }
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
      for (int m = 0; m < HEAD / 16; ++m) {  // O^T's rows: dims 16g + 2m (c0, c1) and 16g + 2m + 1 (c2, c3)
        merged[(2 * t) * HEAD + 16 * g + 2 * m] += o[m][0] * weight[0];
        merged[(2 * t + 1) * HEAD + 16 * g + 2 * m] += o[m][1] * weight[1];
        merged[(2 * t) * HEAD + 16 * g + 2 * m + 1] += o[m][2] * weight[0];
        merged[(2 * t + 1) * HEAD + 16 * g + 2 * m + 1] += o[m][3] * weight[1];
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

# (stages, CTAs per SM, per-warp pipelines, splits for B = 8: None for whole waves)
VARIANTS = ((3, 4, 0, None), (3, 4, 0, 8), (3, 4, 0, 16), (3, 4, 1, None), (3, 4, 1, 8), (3, 4, 1, 16), (4, 3, 1, 8),
            (4, 3, 1, None), (6, 2, 1, None))  # fmt: skip


def main(batches=(8, 64)):
    names = sorted({f"decode_codes<{s}, {m}, {bool(o)}>".lower() for s, m, o, _ in VARIANTS})
    module = cupy.RawModule(code=exp26.library_source() + KERNEL, options=("-std=c++17",), name_expressions=names)
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    rng = np.random.default_rng(0)
    hq, hk, nk = 32, 8, 32768
    for batch in batches:
        q = cupy.asarray(rng.standard_normal((batch, hq, 1, HEAD), dtype=np.float32).astype(BF16))
        k, v = (cupy.random.standard_normal((batch, hk, nk, HEAD), dtype=np.float32).astype(BF16) for _ in "kv")
        k8, v8 = cupyflash.quantize_kvcache(k, "tensor"), cupyflash.quantize_kvcache(v, "tensor")
        ref = cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk).astype(np.float32)
        lib8 = exp26.timed_us(lambda: cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk))
        lib16 = exp26.timed_us(lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=nk))
        tiles = math.ceil(nk / BLOCK_N)
        only = os.environ.get("ONLY")  # one variant's index, for ncu
        for stages, ctas, own, forced in [VARIANTS[int(only)]] if only else VARIANTS:
            kernel = module.get_function(f"decode_codes<{stages}, {ctas}, {bool(own)}>".lower())
            smem = max(stages * 2 * BLOCK_N * RAW_STRIDE, 4 * 8 * 2 * 4 + 8 * HEAD * 4)
            kernel.max_dynamic_shared_size_bytes = smem
            waves = next(w for w in range(1, 64) if (w * ctas * sms) % (batch * hk) <= 0.05 * batch * hk or w == 63)
            splits = forced if forced and batch == 8 else max(1, round(waves * ctas * sms / (batch * hk)))
            per = math.ceil(tiles / splits)
            splits = math.ceil(tiles / per)
            out_part = cupy.empty((splits, batch, hk, 8, HEAD), np.float32)
            lse_part = cupy.empty((splits, batch, hk, 8), np.float32)
            params = exp26.args_bytes(
                dict(q=q.data.ptr, k=k8.data.data.ptr, v=v8.data.data.ptr, out_part=out_part.data.ptr,
                     lse_part=lse_part.data.ptr, batch=batch, n=nk, hk=hk, group=hq // hk, splits=splits,
                     tiles_per_split=per, scale_log2=math.log2(math.e) / math.sqrt(HEAD),
                     k_scale=float(k8.scale.get()[0, 0, 0]), v_scale=float(v8.scale.get()[0, 0, 0]))
            )  # fmt: skip

            def run():
                kernel((splits, hk, batch), (THREADS,), (params,), shared_mem=smem)

            out_part.fill(np.nan)
            run()
            lse = lse_part[..., : hq // hk]
            w = cupy.exp(lse - lse.max(axis=0))
            out = (out_part[..., : hq // hk, :] * w[..., None]).sum(axis=0) / w.sum(axis=0)[..., None]
            error = float(cupy.linalg.norm(out.reshape(ref.shape) - ref) / cupy.linalg.norm(ref))
            us = exp26.timed_us(run)
            print(
                f"B{batch:<3} Nk{nk // 1024}k stages {stages} ctas/SM {ctas} own {own} splits {splits:3}: error vs "
                f"library FP8 {error:.2e} | {us:8.1f} us ({k8.data.nbytes * 2 / us / 1e6:.2f} TB/s) | / library bf16 "
                f"{us / lib16:.3f} | / library FP8 {us / lib8:.3f} (bf16 {lib16:.1f} us, FP8 {lib8:.1f} us)",
                flush=True,
            )
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(tuple(int(x) for x in sys.argv[1:]) or (8, 64))
