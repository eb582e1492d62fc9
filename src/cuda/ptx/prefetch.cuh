// Cache prefetch (sm_90a).
#pragma once

namespace mok::ptx {

// Brings the 128-byte line that holds `addr` (global memory) into L2; nothing waits for it.
__device__ __forceinline__ void prefetch_l2(const void* addr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(addr));
}

}  // namespace mok::ptx
