// The non-bulk asynchronous copy (cp.async, sm_80+) with an mbarrier completion: small global ->
// shared copies that no bulk copy can make (4-byte aligned), landed by an mbarrier phase like the
// tensor copies beside them.
#pragma once

#include <cstdint>

#include "cuda/ptx/fence.cuh"

namespace mok::ptx {

// Copies 4 bytes from global `src` to shared `dst` (both 4-byte aligned).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)),
               "l"(reinterpret_cast<std::uint64_t>(src))
               : "memory");
}

// One arrival on `bar` once every cp.async this thread issued so far has landed. .noinc: the
// arrival is one of the barrier's initial count (mbarrier_init), not an extra one.
__device__ __forceinline__ void cp_async_arrive_noinc(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
}

}  // namespace mok::ptx
