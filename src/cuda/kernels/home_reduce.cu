#include <cuda_bf16.h>

#include "cuda/kernels/home_reduce.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBf16PerVector = 8;

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

// One thread per (token, 8 columns).
template <bool kWeighted>
__global__ void __launch_bounds__(kThreads) home_reduce_kernel(HomeReduceParams p) {
  const std::int64_t vectors = p.hidden / kBf16PerVector;
  const std::int64_t n = p.tokens * vectors;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * kThreads) {
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
}

int blocks_for(std::int64_t work, std::int64_t per_block) {
  const std::int64_t b = (work + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

}  // namespace

cudaError_t launch_combine_reduce(const HomeReduceParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  home_reduce_kernel<true>
      <<<blocks_for(p.tokens * p.hidden / kBf16PerVector, kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_dx_reduce(const HomeReduceParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  home_reduce_kernel<false>
      <<<blocks_for(p.tokens * p.hidden / kBf16PerVector, kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
