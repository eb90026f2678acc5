// tma.cuh — Hopper's tensor-memory-accelerator copies (cp.async.bulk.tensor) and the shared-memory
// mbarriers that count their bytes, for the warp-specialized forward and backward (attention_fwd_ws.cu,
// attention_bwd_ws.cu); the bulk copies from shared to global memory (plain or adding float32) and the named
// barriers the backward's warpgroups meet at.
//
// A tensor map (CUtensorMap, 128 bytes, encoded on the host by cupyflash/_cuda/tma.py) describes one input as a
// 5-d tensor (columns, rows, batch2, batch1, batch0) with the batch strides of the collapsed layout, and a
// box of one swizzle atom's columns by a tile's rows: one copy per atom column lands in SwizzledTile's
// layout (copy.cuh), swizzled by the hardware, rows and columns past the tensor's end filled with zeros.
// An mbarrier phase completes when its expected arrivals have arrived and the bytes announced with
// expect_tx have landed; waiters name the phase by its parity.
#pragma once
#include "common.cuh"
#include "mma.cuh"

struct __align__(64) TensorMap {
  u64 words[16];
};
// q, k and v's maps, one kernel parameter (__grid_constant__: the copies read it where it lies).
struct TensorMaps {
  TensorMap q, k, v;
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals));
}
// After the initializing thread's inits, before any other thread or the copies use the barriers.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` more to land in this phase.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Ordinary shared-memory accesses before this point are ordered before later copies into the same bytes.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Rows [row, row + Tile::NUM_ROWS) and columns [col, col + Tile::NUM_COLS) of batch entry (b0, b1, b2) into
// `tile`, completing on `bar`, whose phase must expect Tile::SIZE elements (the box's whole bytes count,
// zero-filled ones included).
template <class Tile, typename T>
__device__ __forceinline__ void tma_load_tile(T* tile, const TensorMap& map, int row, int b0, int b1, int b2, u32 bar,
                                              int col = 0) {
  constexpr int ATOMS = Tile::NUM_COLS / Tile::ATOM_COLS;
#pragma unroll
  for (int a = 0; a < ATOMS; ++a)
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(smem_u32(tile + a * Tile::ATOM_SIZE)),
        "l"(reinterpret_cast<u64>(&map)), "r"(col + a * Tile::ATOM_COLS), "r"(row), "r"(b2), "r"(b1), "r"(b0), "r"(bar)
        : "memory");
}

// Adds `bytes` of float32 at shared `src` into global `dst` element by element, in L2 (a bulk reduce: one
// thread issues it; the adds of different CTAs into the same elements land in no fixed order). `src` and
// `dst` 16-byte aligned, `bytes` a multiple of 16. Completes in the issuing thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
// Stores `bytes` at shared `src` to global `dst` (the same alignment; the same bulk group).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// The issuing thread's bulk groups but the last PENDING have read their shared memory (it may be written
// again); bulk_wait: ... have completed.
template <int PENDING>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
}
template <int PENDING>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(PENDING) : "memory");
}

// The THREADS threads (whole warps) that name barrier `id` (1-15; 0 is __syncthreads') wait for each other.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
