// Flag signal/wait primitives: release/acquire loads, stores and reductions at an explicit scope,
// fences, and the global nanosecond timer. Thin wrappers, no logic (STYLE.md practice 1).
//
// Scope (DESIGN.md section 4): `gpu` when every party is on this GPU (one process's virtual ranks,
// or the blocks of one rank), `sys` when a peer on another GPU reads or writes the flag.
#pragma once

#include <cstdint>

#include "cuda/ptx/fence.cuh"  // global_timer_ns

namespace mok::ptx {

enum class Scope { gpu, sys };

template <Scope S>
__device__ __forceinline__ std::uint32_t ld_acquire(const std::uint32_t* p) {
  std::uint32_t v;
  if constexpr (S == Scope::gpu) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

template <Scope S>
__device__ __forceinline__ std::uint32_t ld_relaxed(const std::uint32_t* p) {
  std::uint32_t v;
  if constexpr (S == Scope::gpu) {
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

template <Scope S>
__device__ __forceinline__ void st_release(std::uint32_t* p, std::uint32_t v) {
  if constexpr (S == Scope::gpu) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

template <Scope S>
__device__ __forceinline__ void st_relaxed(std::uint32_t* p, std::uint32_t v) {
  if constexpr (S == Scope::gpu) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

// *p += v with release semantics (no value returned: a fire-and-forget reduction).
template <Scope S>
__device__ __forceinline__ void red_release_add(std::uint32_t* p, std::uint32_t v) {
  if constexpr (S == Scope::gpu) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

template <Scope S>
__device__ __forceinline__ void fence_acq_rel() {
  if constexpr (S == Scope::gpu) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  } else {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  }
}

__device__ __forceinline__ void sleep_ns(std::uint32_t ns) {
  __nanosleep(ns);
}

}  // namespace mok::ptx
