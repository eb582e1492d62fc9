// Thin wrappers over mbarrier: init, arrive, expect-tx, probes, and a bounded parity wait that
// gives up (returns) instead of trapping.
//
// Phase tracking follows the usual convention: a waiter passes `parity` = the phase it expects to
// complete (0 first, then 1, 0, ...). Waiting on parity 1 of a fresh barrier returns at once (the
// phase "before" the first counts as complete): producers wait on empty slots with parity ^ 1.
#pragma once

#include <cstdint>

#include "cuda/ptx/fence.cuh"

namespace mok::ptx {

// NOTES: the default deadline of a wait: long enough that no legitimate wait (a whole expert's K
// loop under compute-sanitizer) reaches it, short enough that a protocol bug fails a test instead
// of hanging the machine.
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

// Non-blocking probe: whether the phase with `parity` has completed.
__device__ __forceinline__ bool mbarrier_test_wait_parity(std::uint64_t* bar,
                                                          std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Potentially blocking probe: the thread may be suspended until the phase completes or a
// system-dependent time limit passes.
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

// A bounded wait shorter than this probes without blocking until its deadline, so that it gives
// up once its phase has stayed incomplete for a tick of the global timer (32 ns on an H100),
// whatever the hardware does with a blocking probe. NOTES (2026-12-06, H100): how long a blocking
// probe sleeps is the hardware's choice: with a suspend-time hint it slept 3.9 us whatever the
// hint (0 to 100 us), and with a 1 ns deadline no wait of a pairs GEMM launch gave up. Waits this
// long or longer (the production kernels') keep the blocking probe.
inline constexpr std::uint64_t kShortWaitNs = 1'000'000;

// How a bounded wait ended.
enum class WaitStatus : int { complete, aborted, timed_out };

// Waits until the phase with `parity` completes (`complete`), or gives up: `aborted` as soon as
// `*abort` is nonzero (null: never), `timed_out` once `timeout_ns` have passed. NOTES: a phase
// already complete costs one non-blocking probe; the abort flag and the clock are read only on
// the slow path, before each blocking probe, and the first probe does not block, so once a CTA
// has aborted each of its waits on a phase that will not complete returns at once. A wait
// shorter than kShortWaitNs gives up by its deadline (within a tick of the global timer, 32 ns
// on an H100) even when the phase completes soon after. Never traps: the caller decides what
// giving up means (a trap would kill the CUDA context, and the training job with it).
__device__ __forceinline__ WaitStatus mbarrier_wait(std::uint64_t* bar, std::uint32_t parity,
                                                    std::uint64_t timeout_ns,
                                                    const volatile int* abort) {
  if (mbarrier_test_wait_parity(bar, parity)) return WaitStatus::complete;
  const std::uint64_t start = global_timer_ns();
  for (;;) {
    if (abort != nullptr && *abort != 0) return WaitStatus::aborted;
    const bool done = timeout_ns < kShortWaitNs ? mbarrier_test_wait_parity(bar, parity)
                                                : mbarrier_try_wait_parity(bar, parity);
    if (done) return WaitStatus::complete;
    if (global_timer_ns() - start > timeout_ns) return WaitStatus::timed_out;
  }
}

}  // namespace mok::ptx
