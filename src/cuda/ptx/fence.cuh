// Thin wrappers (sm_90a): proxy fences, register reallocation, named barriers, and two small
// helpers: a pointer's shared-memory address (smem_addr) and the global timer (global_timer_ns).
#pragma once

#include <cstdint>

namespace mok::ptx {

// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses (TMA,
// wgmma) to shared memory; pair it with a barrier that the async-proxy users wait on.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Orders this thread's generic-proxy global-memory accesses with its later async-proxy accesses
// (TMA) to global memory: after writing rows that a TMA load will read (with a release/acquire
// pair between the writer and the thread that issues the load), and before that load.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Makes mbarrier initialisation visible to the async proxy (TMA complete_tx).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Warpgroup register budgets. Needs a register cap at kernel entry (__launch_bounds__(n, 1)).
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// bar.sync on a named hardware barrier among `num_threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Nanoseconds since an arbitrary origin, the same for every SM (in steps of 32 ns on an H100,
// NOTES 2026-12-06, 6b922ca).
__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

}  // namespace mok::ptx
