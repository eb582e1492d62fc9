#include "cuda/kernels/pass_segments.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline std::int64_t clamp_row(std::int64_t v, std::int64_t hi) {
  return v < 0 ? 0 : (v > hi ? hi : v);
}

__global__ void __launch_bounds__(kThreads) pass_segments_kernel(PassSegmentsParams p) {
  for (std::int32_t e = blockIdx.x * kThreads + threadIdx.x; e <= p.num_experts;
       e += gridDim.x * kThreads) {
    const std::int64_t start = clamp_row(p.segment_starts[e] - p.row_offset, p.ring_rows);
    p.pass_starts[e] = static_cast<std::int32_t>(start);
    if (e == p.num_experts) continue;
    const std::int64_t end = clamp_row(
        std::int64_t{p.segment_starts[e]} + p.expert_counts[e] - p.row_offset, p.ring_rows);
    p.pass_rows[e] = static_cast<std::int32_t>(end - start);
  }
}

}  // namespace

cudaError_t launch_pass_segments(const PassSegmentsParams& p, cudaStream_t stream) {
  const int blocks = (p.num_experts + 1 + kThreads - 1) / kThreads;
  pass_segments_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
