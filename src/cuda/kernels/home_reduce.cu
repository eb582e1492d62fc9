// The standalone home reductions: one thread per (token, 8 columns), home_reduce.cuh's
// reduce_vector.
#include "cuda/kernels/home_reduce.cuh"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBf16PerVector = home::kBf16PerVector;

template <bool kWeighted>
__global__ void __launch_bounds__(kThreads) home_reduce_kernel(HomeReduceParams p) {
  const std::int64_t n = p.tokens * (p.hidden / kBf16PerVector);
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * kThreads) {
    home::reduce_vector<kWeighted>(p, i);
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
