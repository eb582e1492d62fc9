// The home reductions as a device function over one (token, 8 columns) vector (home_reduce.hpp
// says which operations, in which order). Only the standalone kernel (home_reduce.cu) calls it:
// the forward megakernel ends at the combine, so both forward paths reduce with that launch.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/kernels/home_reduce.hpp"

namespace mok::cuda::home {

inline constexpr int kBf16PerVector = 8;

__device__ inline void load8(const void* base, std::int64_t vector, float (&f)[8]) {
  const uint4 v = reinterpret_cast<const uint4*>(base)[vector];
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = __bfloat1622float2(h[e]);
    f[2 * e] = x.x;
    f[2 * e + 1] = x.y;
  }
}

__device__ inline void store8(void* base, std::int64_t vector, const float (&f)[8]) {
  uint4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
  reinterpret_cast<uint4*>(base)[vector] = v;
}

__device__ inline bool used(std::int64_t id, std::int64_t num_experts) {
  return id >= 0 && id < num_experts;
}

// Vector i of `out` ([T, H] as T * H / 8 vectors of 8 bf16): the shared expert's value (if any)
// plus each used slot's, in increasing j; weighted (fp32 fma by the router weight) for the
// forward combine, plain fp32 adds for d_x.
template <bool kWeighted>
__device__ inline void reduce_vector(const HomeReduceParams& p, std::int64_t i) {
  const std::int64_t vectors = p.hidden / kBf16PerVector;
  const std::int64_t t = i / vectors, v = i % vectors;
  float acc[8] = {};
  if (p.shared) load8(p.shared, i, acc);
  for (std::int64_t j = 0; j < p.topk; ++j) {
    const std::int64_t s = t * p.topk + j;
    if (!used(p.topk_experts[s], p.num_experts)) continue;
    float y[8];
    load8(p.slots, s * vectors + v, y);
    if constexpr (kWeighted) {
      const float w = p.topk_weights[s];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = __fmaf_rn(w, y[e], acc[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], y[e]);
    }
  }
  store8(p.out, i, acc);
}

}  // namespace mok::cuda::home
