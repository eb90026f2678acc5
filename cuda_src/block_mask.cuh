// block_mask.cuh — walking a block mask: which BLOCK_MASK_TILE x BLOCK_MASK_TILE tiles of the score matrix
// are on, along the axis a kernel streams. Kernels skip the tiles that are off whole, never reading their
// k, v (or q, dout) rows.
//
// Two forms of one walk over the same words (bit t % 32 of word t / 32: tile t is on). TileBitmap: the CTA
// loads its line into shared memory at the start and scans the words for the next tile on (the mma.sync
// and wgmma kernels). The warp-specialized forward's tables (ws_*): its copier fills a line per tile as the
// tile starts, and beside the bits a table of the last tile on at or below each tile, so that its computing
// warps look the next one up instead of scanning (a scan held across their loop made the ALiBi form spill).
#pragma once
#include "common.cuh"
#include "params.cuh"

constexpr int BLOCK_MASK_TILE = 128;  // must match cupyflash/_modifiers.py

// The block mask along the axis a kernel streams (keys for the forward and dQ, queries for dK/dV), as
// a bitmap in shared memory: finding the next tile that is on is then a word scan, not a chain of
// dependent global loads. Longer axes than the bitmap holds read global memory tile by tile.
// The TileBitmap object itself (where the words are, the line, its stride and count) lives in registers
// in the Mods::all kernels and in shared memory in the Mods::scalars ones (tile_bitmap_for): held in
// registers through their loops it made the scalars' HEAD_DIM 128 dK/dV pass spill, and moving it for
// Mods::all too made eighteen of those kernels, already at 255 registers, spill on sm_90.
constexpr int TILE_BITMAP_WORDS = 64;  // 2048 tiles of 128: 262,144 keys (or queries)

struct TileBitmap {
  const u32* words;           // shared memory, or null: no block mask (every tile on)
  const unsigned char* line;  // the block-mask line in global memory (fallback), with its stride
  i64 stride;
  int count;  // block-mask tiles along the axis

  // Fill `smem_words` (TILE_BITMAP_WORDS) from block-mask line `line`; every thread of the CTA calls it.
  // Until the barrier each thread reads only its arguments, never the members: in shared memory (the
  // scalars' object) other warps may still be writing them (the same values).
  template <int NUM_WARPS>
  __device__ __forceinline__ void load(u32* smem_words, const unsigned char* line_, i64 stride_, int count_) {
    const bool in_words = count_ <= 32 * TILE_BITMAP_WORDS;
    line = line_;
    stride = stride_;
    count = count_;
    words = in_words ? smem_words : nullptr;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (in_words) {
      for (int base = warp * WARP_SIZE; base < count_; base += NUM_WARPS * WARP_SIZE) {
        const bool on = base + lane < count_ && line_[(base + lane) * stride_];
        const u32 word = __ballot_sync(0xffffffffu, on);
        if (lane == 0) smem_words[base / WARP_SIZE] = word;
      }
    }
    __syncthreads();
  }
  // Largest tile <= t that is on, or -1.
  __device__ __forceinline__ int prev_on(int t) const {
    if (!words) {
      while (t >= 0 && !line[t * stride]) --t;
      return t;
    }
    if (t < 0) return -1;
    int w = t / 32;
    u32 bits = words[w] & (2u << (t % 32)) - 1u;  // bits 0 .. t % 32
    while (bits == 0) {
      if (--w < 0) return -1;
      bits = words[w];
    }
    return w * 32 + 31 - __clz(bits);
  }
  // Smallest tile >= t that is on, or count.
  __device__ __forceinline__ int next_on(int t) const {
    if (!words) {
      while (t < count && !line[t * stride]) ++t;
      return t;
    }
    if (t >= count) return count;
    int w = t / 32;
    u32 bits = words[w] & (~0u << (t % 32));
    while (bits == 0) {
      if (++w * 32 >= count) return count;
      bits = words[w];
    }
    return w * 32 + __ffs(bits) - 1;
  }
};

// The Mods::scalars kernels' TileBitmap (module-scope shared memory is allocated only for the kernels that
// use it). Every thread of the CTA writes the same final values into it (load_tile_bitmap) and reads it
// only after TileBitmap::load's barrier.
__shared__ TileBitmap scalars_tile_bitmap;

// The TileBitmap a MODS kernel works with: `in_registers` (its own local object) or the shared one.
template <Mods MODS, class Bitmap>
__device__ __forceinline__ Bitmap& tile_bitmap_for(Bitmap& in_registers) {
  if constexpr (MODS == Mods::scalars) {
    return scalars_tile_bitmap;
  } else {
    return in_registers;
  }
}

// The warp-specialized forward's walk: which of a tile's key blocks [lo, end) have their block-mask tile on
// (a key block is one block-mask tile), one set per q buffer, which the copier fills per tile
// (fill_on_blocks) and every warp of the CTA walks: as bits (bit n % 32 of word n / 32 from a base word),
// which count_on_blocks counts, and as the largest block on at or below each block (-1 or a block below lo
// if none), which prev_on_block looks up. At module scope, so only the kernels that use them allocate them,
// and indexed from offsets: a bit scan in the computing warps' loop, or a pointer held across it, made the
// ALiBi form spill.
__shared__ u32 ws_on_words[2 * TILE_BITMAP_WORDS];
__shared__ short ws_prev_on[2 * 32 * TILE_BITMAP_WORDS];
// The largest block in [lo, n] that is on, or a value below lo.
__device__ __forceinline__ int prev_on_block(int base, int n, int lo) {
  return n >= lo ? ws_prev_on[base + n] : lo - 1;
}
// How many blocks in [lo, hi] are on.
__device__ __forceinline__ int count_on_blocks(int base, int lo, int hi) {
  int count = 0;
  for (int w = lo / 32; lo <= hi && w <= hi / 32; ++w) {
    u32 bits = ws_on_words[base + w];
    if (w == lo / 32) bits &= ~0u << (lo % 32);
    if (w == hi / 32) bits &= (2u << (hi % 32)) - 1u;
    count += __popc(bits);
  }
  return count;
}
// The copier's fill for blocks [lo, end) from batch entry b's block-mask line of query tile m0 /
// BLOCK_MASK_TILE (a key block is a block-mask tile), at base words (base * 32 entries). One thread, eight
// independent loads in flight (a line of 128 tiles is one trip to L2, then L1 hits); all 32 of a word
// spilled the copier's registers.
__device__ __forceinline__ void fill_on_blocks(int base, const AttnParams& p, int b, int m0, int lo, int end) {
  const unsigned char* line =
      p.block_mask + batch_offset(p.block_mask_stride, b, p) + (m0 / BLOCK_MASK_TILE) * p.block_mask_stride[3];
  int last = -1;
  for (int w = lo / 32; w * 32 < end; ++w) {
    u32 bits = 0u;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
      const int n = w * 32 + i;
      if (n >= lo && n < end) {
        if (line[n * p.block_mask_stride[4]]) {
          bits |= 1u << i;
          last = n;
        }
        ws_prev_on[base * 32 + n] = static_cast<short>(last);
      }
    }
    ws_on_words[base + w] = bits;
  }
}
