// Thin wrappers over the tensor copy engine (cp.async.bulk.tensor). Tensor maps are built on the
// host (src/cuda/gemm/tensor_map.hpp) and passed as __grid_constant__ kernel parameters.
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
// shared-memory offsets in every CTA of the cluster whose bit is set in `cta_mask` (TMA multicast).
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

// Stores the box at (c0, c1) from `src` (rows written by ordinary stores need
// fence_proxy_async_shared() and a barrier first). Out-of-bounds elements are not written.
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

}  // namespace mok::ptx
