// fp8_values.cu — V^T for the FP8 forward: the e4m3 bytes of v (batch, nk, dv) as (batch, dv, nk_pad), keys
// as the K-major columns that 8-bit wgmma needs for P V (it has no transposed B), listed within every 32 in
// the order the P fragments hold them (wgmma.cuh, pack_e4m3_fragments; cupyflash/_cuda/fp8.py, KEY_ORDER),
// zeros past nk.
//
// Layout: v through three collapsed batch dims (sizes batch1, batch2 and byte strides s0, s1, s2; 0 along a
// broadcast dim) and a row stride s_row, rows of dv_w bytes (a multiple of 16, 16-byte aligned; dv_w
// >= dv); vt contiguous, nk_pad a multiple of 32. One CTA moves a tile of 64 keys x 64 head dims through
// shared memory: 16-byte loads of v's rows, 16-byte stores of vt's. Saves nothing.
#include "common.cuh"

constexpr int VALUES_THREADS = 256;
constexpr int VALUES_TILE = 64;  // keys and head dims per CTA

// Position c of a 32-key k-step -> its key: c = 4t + i holds key 2t + (i & 1) + 8 (i >> 1), +16 in the
// second half.
__device__ __forceinline__ int key_at(int c) {
  const int half = c >> 4, t = (c & 15) >> 2, i = c & 3;
  return 16 * half + 2 * t + (i & 1) + 8 * (i >> 1);
}

extern "C" __global__ void __launch_bounds__(VALUES_THREADS) fp8_values_transposed(
    const unsigned char* v, unsigned char* vt, long long s0, long long s1, long long s2, long long s_row, int batch1,
    int batch2, int b_first, int nk, int nk_pad, int dv, int dv_w) {
  __shared__ __align__(16) unsigned char tile[VALUES_TILE][VALUES_TILE + 16];  // [key][dim], rows 16-byte aligned
  // Batch entry b_first + blockIdx.z (the host launches at most 65535 entries at a time).
  const int key0 = blockIdx.x * VALUES_TILE, dim0 = blockIdx.y * VALUES_TILE, b = b_first + blockIdx.z;
  const int b2 = b % batch2, b1 = (b / batch2) % batch1, b0 = b / batch2 / batch1;
  const unsigned char* src = v + b0 * s0 + b1 * s1 + b2 * s2;
  // Load: thread -> (key, 16-byte chunk of dims); keys past nk and dims past dv_w read as zeros.
  {
    const int key = threadIdx.x / 4, chunk = threadIdx.x % 4;
    const int dim = dim0 + 16 * chunk;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (key0 + key < nk && dim < dv_w)
      x = *reinterpret_cast<const uint4*>(src + static_cast<long long>(key0 + key) * s_row + dim);
    *reinterpret_cast<uint4*>(&tile[key][16 * chunk]) = x;
  }
  __syncthreads();
  // Store: thread -> (dim, 16 consecutive key positions).
  const int dim = threadIdx.x / 4, pos0 = 16 * (threadIdx.x % 4);
  if (dim0 + dim >= dv || key0 + pos0 >= nk_pad) return;
  u32 words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    u32 word = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int pos = pos0 + 4 * w + j;  // within the tile; its 32-key step starts at pos & ~31
      word |= static_cast<u32>(tile[(pos & ~31) + key_at(pos & 31)][dim]) << (8 * j);
    }
    words[w] = word;
  }
  unsigned char* dst = vt + (static_cast<long long>(b) * dv + dim0 + dim) * nk_pad + key0 + pos0;
  *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
}
