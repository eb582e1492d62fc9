// Thin wrappers over thread-block clusters (sm_90): the CTA's rank, the cluster-wide barrier, and
// arrivals on an mbarrier in another CTA of the cluster.
#pragma once

#include <cstdint>

#include "cuda/ptx/fence.cuh"

namespace mok::ptx {

__device__ __forceinline__ std::uint32_t cluster_ctarank() {
  std::uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster arrives, then waits for all of them; orders shared
// memory (barrier initialisation, and every access before a CTA's exit) at cluster scope. All
// threads of each warp execute it together.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// One arrival on the mbarrier at the same shared-memory offset as `bar` in the cluster's CTA
// `cta_rank`, with the default semantics (release at CTA scope), as CUTLASS's ClusterBarrier does.
// NOTES: `.release.cluster` compiles to MEMBAR.ALL.GPU before every arrival, which made a
// clustered kernel's K loop 1.3-1.6x slower (NOTES.md, gemm v3a). What an arrival orders here is
// the completion of wgmma reads (wgmma.wait_group) or a Producer's passing of its own wait,
// neither of which needs a memory fence.
__device__ __forceinline__ void mbarrier_arrive_cluster(std::uint64_t* bar,
                                                        std::uint32_t cta_rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(cta_rank)
      : "memory");
}

}  // namespace mok::ptx
