// Thin wrappers over the bulk copy engine: tensor copies (cp.async.bulk.tensor: the map prefetch,
// 2-D loads, multicast loads, 2-D stores with their commit and waits), the plain bulk copy
// (bulk_load); and the shared-memory matrix moves that stage tiles for them (stmatrix_x4,
// ldmatrix_x4_trans). Tensor maps are built on the host (src/cuda/gemm/tensor_map.hpp) and passed
// as __grid_constant__ kernel parameters.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/ptx/fence.cuh"

namespace mok::ptx {

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}

// Loads the box at (c0 inner, c1 outer) into `dst`; completes `bytes` of transactions on `bar`.
// Out-of-bounds elements are filled with zeros (and still count as transferred bytes).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, std::uint64_t* bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// The same box, written to `dst` (and its transactions completed on `bar`) at the same
// shared-memory offsets in every CTA of the cluster whose bit is set in `cta_mask` (multicast).
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map,
                                                      std::uint64_t* bar, int c0, int c1,
                                                      std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%4, %5}], [%2], %3;\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_addr(bar)), "h"(cta_mask), "r"(c0),
      "r"(c1)
      : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to `dst`;
// completes `bytes` of transactions on `bar` (the non-tensor bulk copy: no map, no bounds).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, std::uint32_t bytes,
                                          std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Stores the box at (c0, c1) from `src` (rows written by ordinary stores need
// fence_proxy_async_shared() and a barrier first). Out-of-bounds elements past the tensor's end
// are not written; c0 and c1 must be >= 0 (a negative start traps: tests/cpp/test_ptx.cu).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0,
                                             int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<std::uint64_t>(map)),
      "r"(smem_addr(src)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until at most kPending committed store groups still read shared memory.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until at most kPending committed store groups are still in flight (writes done).
template <int kPending>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Stores four 8 x 8 b16 matrices to shared memory (stmatrix .x4): register i of lane l holds row
// l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i (the wgmma accumulator layout of an
// 8 x 8 block, packed to bf16 pairs); lanes 8i .. 8i + 7 give the addresses of matrix i's rows.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t row_address, std::uint32_t r0,
                                            std::uint32_t r1, std::uint32_t r2, std::uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_address),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// Loads four 8 x 8 b16 matrices from shared memory transposed (ldmatrix .x4 .trans): lanes
// 8i .. 8i + 7 give the addresses of matrix i's rows (16 bytes each), and register i of lane l
// receives column l / 4 of matrix i, its rows 2 (l % 4) (low half) and 2 (l % 4) + 1.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t row_address, std::uint32_t& r0,
                                                  std::uint32_t& r1, std::uint32_t& r2,
                                                  std::uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(row_address)
               : "memory");
}

}  // namespace mok::ptx
