// Thin wrappers over mbarrier: init, arrive, expect-tx, and a bounded parity wait.
//
// Phase tracking follows the usual convention: a waiter passes `parity` = the phase it expects to
// complete (0 first, then 1, 0, ...). Waiting on parity 1 of a fresh barrier returns at once (the
// phase "before" the first counts as complete): producers wait on empty slots with parity ^ 1.
#pragma once

#include <cstdint>

#include "cuda/ptx/fence.cuh"

namespace mok::ptx {

// NOTES: long enough that no legitimate wait (a whole expert's K loop under compute-sanitizer)
// reaches it, short enough that a protocol bug fails a test instead of hanging the machine.
inline constexpr std::uint64_t kBarrierTimeoutNs = 20ull * 1000 * 1000 * 1000;

__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
}

// One arrival that also announces `bytes` of transactions (TMA) that will complete this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait_parity(std::uint64_t* bar, std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Where a timed-out wait reports itself before trapping. NOTES: no printf here: a function call
// inside the consumer loop makes ptxas serialize every wgmma (warning C7510). The launcher points
// this at mapped pinned host memory, which the host can still read after the trap.
struct WaitTimeoutReport {
  int timed_out;  // 1 once a wait gave up
  int barrier_id;
  unsigned parity;
  int block;
  int thread;
  unsigned smem_address;
};

// Waits until the phase with `parity` completes. Bounded: after kBarrierTimeoutNs it records which
// barrier (its id and shared address), the parity, block and thread in `report` (if not null) and
// traps, so the launch fails instead of hanging.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, std::uint32_t parity, int id,
                                              WaitTimeoutReport* report) {
  if (mbarrier_try_wait_parity(bar, parity)) return;
  const std::uint64_t start = global_timer_ns();
  for (std::uint32_t spins = 1;; ++spins) {
    if (mbarrier_try_wait_parity(bar, parity)) return;
    if ((spins & 255u) == 0 && global_timer_ns() - start > kBarrierTimeoutNs) {
      if (report != nullptr) {
        volatile WaitTimeoutReport* r = report;
        r->barrier_id = id;
        r->parity = parity;
        r->block = static_cast<int>(blockIdx.x);
        r->thread = static_cast<int>(threadIdx.x);
        r->smem_address = smem_addr(bar);
        __threadfence_system();
        r->timed_out = 1;
        __threadfence_system();
      }
      __trap();
    }
  }
}

}  // namespace mok::ptx
