// Flag signal/wait primitives: release/acquire loads, stores and reductions at an explicit scope,
// fences, and one bounded wait built from them. Thin wrappers (the ptx layer of
// docs/architecture.md, "The layers of the code").
//
// Scope: `gpu` when every party is on this GPU (one process's virtual ranks, or the blocks of one
// rank), `sys` when a peer on another GPU reads or writes the flag.
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

// Returns *p and adds one to it, relaxed, gpu scope, for counters below 2^31 - 1 (it wraps to 0
// there): one atom instruction whose result the thread waits for only where it uses it. NOTES:
// atomicAdd, atom.add in inline PTX, and atom.inc wrapping at 2^32 - 1 (which ptxas reads as an
// add) all become a warp-aggregated sequence whose shuffle waits for the result at once, a round
// trip of ~1-2 us under load (the megakernel's trace at f09c8ab); an atom.inc that wraps elsewhere stays one
// instruction.
__device__ __forceinline__ std::uint32_t atom_inc_relaxed_gpu(std::uint32_t* p) {
  std::uint32_t old;
  asm volatile("atom.relaxed.gpu.global.inc.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(0x7ffffffeu));
  return old;
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

// The bounded flag wait: spins with acquire loads at scope S until *flag has reached `target`
// (wrap-safe: the counters only grow, by far less than 2^31 between a signal and its wait) and
// returns true; returns false once `timeout_ns` have passed or `give_up()` says so (checked every
// 32 loads, backing off with sleeps after 1024). `seen` and `waited_ns` tell the caller what it
// last read and how long it waited, for its report.
template <Scope S, class GiveUp>
__device__ bool wait_at_least(const std::uint32_t* flag, std::uint32_t target,
                              std::uint64_t timeout_ns, GiveUp&& give_up, std::uint32_t& seen,
                              std::uint64_t& waited_ns) {
  const std::uint64_t start = global_timer_ns();
  waited_ns = 0;
  for (std::uint32_t spin = 0;; ++spin) {
    seen = ld_acquire<S>(flag);
    if (static_cast<std::int32_t>(seen - target) >= 0) return true;
    if ((spin & 31u) == 31u) {
      waited_ns = global_timer_ns() - start;
      if (waited_ns > timeout_ns || give_up()) return false;
      if (spin > 1024) sleep_ns(128);
    }
  }
}

}  // namespace mok::ptx
