// copy.cuh — moving tiles between global and shared memory.
//
// Shared tiles are ROWS x HEAD_DIM, row-major, each row padded by 16 bytes
// (stride = HEAD_DIM + 16 / sizeof(T) elements) so ldmatrix and the row-wise copies are free of
// bank conflicts. Global rows are read in 16-byte chunks with cp.async (no register staging);
// rows past the end of the sequence and columns past the head dim are zero-filled, which keeps
// padding out of every dot product. The host guarantees 16-byte aligned rows and a head dim
// that is a whole number of 16-byte chunks.
#pragma once
#include "common.cuh"
#include "mma.cuh"

template <typename T, int HEAD_DIM>
struct SmemTile {
  static constexpr int VEC = 16 / sizeof(T);                  // elements per 16-byte chunk
  static constexpr int CHUNKS = HEAD_DIM / VEC;               // chunks per row
  static constexpr int STRIDE = HEAD_DIM + SMEM_PAD_BYTES / sizeof(T);
  static_assert(HEAD_DIM % VEC == 0, "head dim must be whole 16-byte chunks");
};

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;  // 0 bytes read: the destination is zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

// Start copying rows [0, ROWS) x cols [0, HEAD_DIM) of a global tile into shared memory.
template <typename T, int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, i64 row_stride, int valid_rows, int valid_cols) {
  using Tile = SmemTile<T, HEAD_DIM>;
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * Tile::CHUNKS; i += THREADS) {
    const int r = i / Tile::CHUNKS;
    const int c = (i % Tile::CHUNKS) * Tile::VEC;
    const bool valid = r < valid_rows && c < valid_cols;
    cp_async_16(smem_u32(smem + r * Tile::STRIDE + c), valid ? gmem + r * row_stride + c : gmem, valid);
  }
}

// Copy rows [0, ROWS) x cols [0, COLS) of a shared tile (stride STRIDE) to global memory,
// skipping rows >= valid_rows and chunks at or past valid_cols.
template <typename T, int ROWS, int COLS, int STRIDE, int THREADS>
__device__ __forceinline__ void store_tile(T* gmem, i64 row_stride, const T* smem, int valid_rows, int valid_cols) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = COLS / VEC;
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS;
    const int c = (i % CHUNKS) * VEC;
    if (r < valid_rows && c < valid_cols) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c) = *reinterpret_cast<const uint4*>(smem + r * STRIDE + c);
    }
  }
}

// Write one warp's accumulator tile (16 rows x 8*N_TILES cols) into shared memory as T, at
// rows row0.. of a tile with stride STRIDE; row g is multiplied by row_scale[0], row g+8 by [1].
template <typename T, int N_TILES, int STRIDE>
__device__ __forceinline__ void acc_to_smem(T* smem, int row0, const float (&acc)[N_TILES][4],
                                            const float (&row_scale)[2], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
    T* p = smem + (row0 + g) * STRIDE + j * 8 + 2 * t;
    Elem<T>::store2(p, acc[j][0] * row_scale[0], acc[j][1] * row_scale[0]);
    Elem<T>::store2(p + 8 * STRIDE, acc[j][2] * row_scale[1], acc[j][3] * row_scale[1]);
  }
}

template <int N_TILES>
__device__ __forceinline__ void zero_acc(float (&acc)[N_TILES][4]) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.f;
  }
}
