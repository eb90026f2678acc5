// copy.cuh — shared-memory tile layouts, and moving tiles between global and shared memory.
//
// A shared tile holds ROWS x COLS elements in one of two layouts:
//  - PaddedTile (the mma.sync path): row-major, each row padded by 16 bytes (32 for float64), so
//    ldmatrix (float64: 8-byte loads, mma.cuh) and the row-wise copies are free of bank conflicts.
//  - SwizzledTile (the wgmma path, Hopper): the columns split into "atoms" of ATOM_COLS elements
//    (128, 64 or 32 bytes per row); each atom stores its ROWS rows back to back, and the 16-byte chunk c
//    of a row lands at chunk c ^ (row bits): the canonical swizzled layout that wgmma's shared-memory
//    descriptors describe (wgmma.cuh). The swizzle is a function of the address, so every atom starts
//    on a 1024-byte boundary (kernels align the dynamic shared memory they carve tiles from).
// Global rows are read in 16-byte chunks with cp.async (no register staging); rows past the end of
// the sequence and columns past the head dim are zero-filled, which keeps padding out of every dot
// product. The host guarantees 16-byte aligned rows and a head dim that is a whole number of 16-byte
// chunks.
#pragma once
#include "common.cuh"
#include "mma.cuh"

template <typename T, int ROWS, int COLS>
struct PaddedTile {
  static constexpr bool SWIZZLED = false;
  static constexpr int NUM_ROWS = ROWS, NUM_COLS = COLS;
  static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte chunk
  static constexpr int STRIDE = COLS + smem_pad_bytes<T>() / sizeof(T);
  static constexpr int SIZE = ROWS * STRIDE;  // elements
  static_assert(COLS % VEC == 0, "rows must be whole 16-byte chunks");
  static constexpr int ROW_PERIOD = 1;  // offset(r + n, c) = offset(r, c) + n * STRIDE
  __device__ __forceinline__ static int offset(int r, int c) { return r * STRIDE + c; }
  __host__ __device__ static constexpr int row_shift(int n) { return n * STRIDE; }
};

template <typename T, int ROWS, int COLS>
struct SwizzledTile {
  static constexpr bool SWIZZLED = true;
  static constexpr int NUM_ROWS = ROWS, NUM_COLS = COLS;
  static constexpr int VEC = 16 / sizeof(T), VEC_BYTES = 16;
  static constexpr int ATOM_BYTES = (COLS * sizeof(T)) % 128 == 0 ? 128 : (COLS * sizeof(T)) % 64 == 0 ? 64 : 32;
  static constexpr int ATOM_COLS = ATOM_BYTES / sizeof(T);
  static constexpr int ATOM_SIZE = ROWS * ATOM_COLS;  // elements of one atom column
  static constexpr int SIZE = ROWS * COLS;
  static constexpr int SWIZZLE_BITS = ATOM_BYTES == 128 ? 3 : ATOM_BYTES == 64 ? 2 : 1;
  static_assert((COLS * sizeof(T)) % 32 == 0, "swizzled rows are whole 32-byte units");
  static_assert((ROWS * ATOM_BYTES) % 1024 == 0, "every atom starts on a 1024-byte boundary");
  static constexpr int ROW_PERIOD = 8;  // the swizzle repeats every 8 rows: offset(r + 8n, c) = offset(r, c) + shift
  __host__ __device__ static constexpr int row_shift(int n) { return n * ATOM_COLS; }
  // Chunk bits [4, 4 + SWIZZLE_BITS) of the byte offset are XORed with bits [7, 7 + SWIZZLE_BITS).
  __device__ __forceinline__ static int offset(int r, int c) {
    const int byte = ((c / ATOM_COLS) * ATOM_SIZE + r * ATOM_COLS + c % ATOM_COLS) * static_cast<int>(sizeof(T));
    return (byte ^ (((byte >> 7) & ((1 << SWIZZLE_BITS) - 1)) << 4)) / static_cast<int>(sizeof(T));
  }
};

template <bool COND, class A, class B>
struct Select {
  using type = A;
};
template <class A, class B>
struct Select<false, A, B> {
  using type = B;
};
// The layout of a ROWS x COLS tile: swizzled for wgmma, padded for mma.sync.
template <typename T, int ROWS, int COLS, bool WGMMA>
using SmemTile = typename Select<WGMMA, SwizzledTile<T, ROWS, COLS>, PaddedTile<T, ROWS, COLS>>::type;

// The first 1024-byte boundary at or after the dynamic shared memory's start (kernels ask the host for
// 1024 bytes more than their tiles need: _cuda/tiles.py, SMEM_ALIGN).
__device__ __forceinline__ unsigned char* smem_aligned(unsigned char* raw) {
  const u32 misalign = static_cast<u32>(__cvta_generic_to_shared(raw)) & 1023u;
  return raw + (misalign ? 1024u - misalign : 0u);
}

// One 16-byte chunk, or zeros when !valid: cp.async's ignore-src predicate then reads nothing from src
// (which may point past the tensor). So the swizzled copies below pass each chunk's own address, with no
// select of address or size per chunk (fewer instructions per copy: docs/design/forward.md). The padded
// (mma.sync) copies still select the address: without it some sm_80 variants spilled.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  asm volatile(
      "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, ignore;\n}\n" ::
          "r"(dst),
      "l"(src), "r"(static_cast<u32>(valid)));
}
// BYTES (4 or 8: one float or double) into shared memory, or zeros when !valid (as cp_async_16).
template <int BYTES>
__device__ __forceinline__ void cp_async_small(u32 dst, const void* src, bool valid) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile(
      "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n cp.async.ca.shared.global [%0], [%1], %3, ignore;\n}\n" ::
          "r"(dst),
      "l"(src), "r"(static_cast<u32>(valid)), "n"(BYTES));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// Before the barrier that publishes tiles this thread copied (or stored) to the CTA: wgmma reads shared
// memory through the async proxy, which must be fenced against the ordinary (generic-proxy) writes.
template <class Tile>
__device__ __forceinline__ void smem_publish() {
  if constexpr (Tile::SWIZZLED) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Start copying a whole tile (NUM_ROWS x NUM_COLS) from global into shared memory.
// Swizzled (wgmma) tiles: fully unrolled, so ptxas sees no loop whose address arithmetic could interleave
// with the products (it would serialize them); when the CTA covers whole rows per pass, each thread keeps
// one column chunk and steps down the rows by constant offsets. Padded (mma.sync) tiles: a plain loop,
// lighter on registers, which those kernels have fewer of to spare.
// FULL_TILE_BRANCH (swizzled, whole rows per pass): a tile whose rows all lie inside the sequence (every
// tile but a sequence's last) skips the per-row test and selects, most of the copy's instructions: the
// backward's passes take it. The forward does not: that branch inside its pipelined loop makes ptxas
// serialize its warpgroup products (C7513; docs/design/compile.md).
template <class Tile, int THREADS, bool FULL_TILE_BRANCH = false, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, i64 row_stride, int valid_rows,
                                                int valid_cols) {
  constexpr int VEC = Tile::VEC, CHUNKS = Tile::NUM_COLS / VEC, ROWS = Tile::NUM_ROWS;
  constexpr int ROW_STEP = THREADS / CHUNKS;  // rows per pass
  if constexpr (!Tile::SWIZZLED) {
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
      const int r = i / CHUNKS;
      const int c = (i % CHUNKS) * VEC;
      const bool valid = r < valid_rows && c < valid_cols;
      cp_async_16(smem_u32(smem + Tile::offset(r, c)), valid ? gmem + r * row_stride + c : gmem, valid);
    }
  } else if constexpr (THREADS % CHUNKS == 0 && ROW_STEP % Tile::ROW_PERIOD == 0) {
    const int r0 = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * VEC;
    const bool col_ok = c < valid_cols;
    const u32 dst = smem_u32(smem + Tile::offset(r0, c));
    const T* src = gmem + r0 * row_stride + c;
    const i64 src_step = ROW_STEP * row_stride;
    if (FULL_TILE_BRANCH && valid_rows >= ROWS) {  // every row inside the sequence: no per-row test or select
#pragma unroll
      for (int pass = 0; pass * ROW_STEP < ROWS; ++pass) {
        if (ROWS % ROW_STEP == 0 || r0 + pass * ROW_STEP < ROWS) {
          cp_async_16(dst + pass * Tile::row_shift(ROW_STEP) * static_cast<int>(sizeof(T)), src + pass * src_step,
                      col_ok);
        }
      }
      return;
    }
#pragma unroll
    for (int pass = 0; pass * ROW_STEP < ROWS; ++pass) {
      const int r = r0 + pass * ROW_STEP;
      if (ROWS % ROW_STEP == 0 || r < ROWS) {
        cp_async_16(dst + pass * Tile::row_shift(ROW_STEP) * static_cast<int>(sizeof(T)), src + pass * src_step,
                    col_ok && r < valid_rows);
      }
    }
  } else {
#pragma unroll
    for (int pass = 0; pass < ceil_div(ROWS * CHUNKS, THREADS); ++pass) {
      const int i = threadIdx.x + pass * THREADS;
      if ((ROWS * CHUNKS) % THREADS == 0 || i < ROWS * CHUNKS) {
        const int r = i / CHUNKS;
        const int c = (i % CHUNKS) * VEC;
        const bool valid = r < valid_rows && c < valid_cols;
        cp_async_16(smem_u32(smem + Tile::offset(r, c)), valid ? gmem + r * row_stride + c : gmem, valid);
      }
    }
  }
}

// Copy rows [0, NUM_ROWS) x cols [0, COLS) of a shared tile to global memory, skipping rows >= valid_rows
// and chunks at or past valid_cols, by THREADS threads numbered `thread` (the CTA's, or one warpgroup's
// when it stores its own rows: attention_fwd_ws.cu).
// Swizzled tiles that the CTA covers in whole rows per pass: each thread keeps one column chunk and steps
// down the rows by constant offsets, as load_tile_async does (the generic loop's index math per chunk cost
// more instructions than the copy).
template <class Tile, int COLS, int THREADS, typename T>
__device__ __forceinline__ void store_tile(T* gmem, i64 row_stride, const T* smem, int valid_rows, int valid_cols,
                                           u32 thread = threadIdx.x) {
  constexpr int VEC = Tile::VEC, CHUNKS = COLS / VEC, ROWS = Tile::NUM_ROWS;
  constexpr int ROW_STEP = THREADS / CHUNKS;  // rows per pass
  if constexpr (Tile::SWIZZLED && THREADS % CHUNKS == 0 && ROW_STEP % Tile::ROW_PERIOD == 0) {
    const int r0 = thread / CHUNKS, c = (thread % CHUNKS) * VEC;
    if (c >= valid_cols) return;
    const T* from = smem + Tile::offset(r0, c);
    T* to = gmem + r0 * row_stride + c;
#pragma unroll
    for (int pass = 0; pass * ROW_STEP < ROWS; ++pass) {
      const int r = r0 + pass * ROW_STEP;
      if ((ROWS % ROW_STEP == 0 || r < ROWS) && r < valid_rows) {
        *reinterpret_cast<uint4*>(to + pass * ROW_STEP * row_stride) =
            *reinterpret_cast<const uint4*>(from + pass * Tile::row_shift(ROW_STEP));
      }
    }
    return;
  }
#pragma unroll
  for (int i = thread; i < ROWS * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS;
    const int c = (i % CHUNKS) * VEC;
    if (r < valid_rows && c < valid_cols) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c) = *reinterpret_cast<const uint4*>(smem + Tile::offset(r, c));
    }
  }
}

// Write one warp's accumulator tile (16 rows x 8*N_TILES cols) into shared memory as T, at rows row0..
// and columns col0.. of a tile; row g is multiplied by row_scale[0], row g+8 by [1].
// Swizzled 16-bit tiles (col0 a multiple of 8): rows g and g + 8 share their swizzle, which repeats every 8
// rows and only flips the chunk bits (4 and up) of a byte offset within an atom row, where a thread's 4t
// sits below them. So a column tile's offset is atom base + row * ATOM_BYTES + (chunk bytes ^ (swizzle | 4t)):
// one XOR per column tile for both rows, where Tile::offset's index math per element was most of the
// epilogue's instructions.
template <class Tile, int N_TILES, typename T, typename A>
__device__ __forceinline__ void acc_to_smem(T* smem, int row0, const A (&acc)[N_TILES][4], const A (&row_scale)[2],
                                            int lane, int col0 = 0) {
  const int g = lane >> 2, t = lane & 3;
  if constexpr (Tile::SWIZZLED && sizeof(T) == 2) {
    constexpr int ATOM_COLS = Tile::ATOM_COLS, ATOM_BYTES = Tile::ATOM_BYTES;
    const int r = row0 + g;
    const int mix = (((r * ATOM_BYTES) >> 7) & ((1 << Tile::SWIZZLE_BITS) - 1)) << 4 | 4 * t;
    char* row = reinterpret_cast<char*>(smem) + r * ATOM_BYTES;
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
      const int c = col0 + j * 8;
      char* at = row + (c / ATOM_COLS) * Tile::ATOM_SIZE * 2 + (((c % ATOM_COLS) * 2) ^ mix);
      Elem<T>::store2(reinterpret_cast<T*>(at), acc[j][0] * row_scale[0], acc[j][1] * row_scale[0]);
      Elem<T>::store2(reinterpret_cast<T*>(at + 8 * ATOM_BYTES), acc[j][2] * row_scale[1], acc[j][3] * row_scale[1]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
    const int c = col0 + j * 8 + 2 * t;
    Elem<T>::store2(smem + Tile::offset(row0 + g, c), acc[j][0] * row_scale[0], acc[j][1] * row_scale[0]);
    Elem<T>::store2(smem + Tile::offset(row0 + g + 8, c), acc[j][2] * row_scale[1], acc[j][3] * row_scale[1]);
  }
}

// Write one warp's accumulator tile (16 rows x 8*N_TILES cols, row g times row_scale[0], g+8 times [1]) straight
// from the registers to rows row0.. and columns col0.. of gmem, skipping rows at or past valid_rows and columns at or
// past valid_cols: the epilogue of results wider than the inputs (float32 from 16-bit inputs), which a staging tile
// of the inputs' elements could not hold. A lane's pair is 8 bytes there, so the 4 lanes of a row fill a 32-byte
// sector per store, as the staged 16-byte copies do.
template <int N_TILES, typename Out, typename A>
__device__ __forceinline__ void acc_to_gmem(Out* gmem, i64 row_stride, int row0, const A (&acc)[N_TILES][4],
                                            const A (&row_scale)[2], int lane, int valid_rows, int valid_cols,
                                            int col0 = 0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= valid_rows) continue;
    Out* at = gmem + row * row_stride;
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
      const int c = col0 + j * 8 + 2 * t;
      if (c < valid_cols) Elem<Out>::store2(at + c, acc[j][2 * r] * row_scale[r], acc[j][2 * r + 1] * row_scale[r]);
    }
  }
}

template <int N_TILES, typename A>
__device__ __forceinline__ void zero_acc(A (&acc)[N_TILES][4]) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = A(0);
  }
}
