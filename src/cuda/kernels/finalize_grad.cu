#include <cuda_bf16.h>

#include "cuda/kernels/finalize_grad.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) finalize_grad_kernel(FinalizeGradParams p) {
  const std::int64_t vectors = p.n / 4;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < vectors;
       i += std::int64_t{gridDim.x} * kThreads) {
    float4 v = reinterpret_cast<const float4*>(p.partial)[i];
    if (p.out_fp32) {
      float4* out = reinterpret_cast<float4*>(p.out) + i;
      if (p.accumulate) {
        const float4 old = *out;
        v = make_float4(__fadd_rn(old.x, v.x), __fadd_rn(old.y, v.y), __fadd_rn(old.z, v.z),
                        __fadd_rn(old.w, v.w));
      }
      *out = v;
    } else {
      const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
      uint2 packed;
      memcpy(&packed.x, &a, 4);
      memcpy(&packed.y, &b, 4);
      reinterpret_cast<uint2*>(p.out)[i] = packed;
    }
  }
}

}  // namespace

cudaError_t launch_finalize_grad(const FinalizeGradParams& p, cudaStream_t stream) {
  if (p.n <= 0) return cudaSuccess;
  const std::int64_t blocks = (p.n / 4 + kThreads - 1) / kThreads;
  finalize_grad_kernel<<<static_cast<int>(blocks > 8192 ? 8192 : blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
