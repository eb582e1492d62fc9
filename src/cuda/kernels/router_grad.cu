// The router-weight gradient's two kernels (router_grad.hpp): the expert side's push, one thread
// per kept ring row, which sums the row's chunk partials in increasing order and stores the sum in
// its home slot; and the home side's gather, one thread per slot.
#include "cuda/kernels/router_grad.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline std::int64_t kept_rows(const PassRows& pass) {
  const std::int64_t left = static_cast<std::int64_t>(*pass.total_rows) - pass.row_offset;
  return left < 0 ? 0 : (left < pass.ring_rows ? left : pass.ring_rows);
}

// One thread per ring row: the chunks in increasing order (a fixed order, whoever runs it).
__global__ void __launch_bounds__(kThreads) router_grad_push_kernel(RouterGradPushParams p) {
  const std::int64_t rows = kept_rows(p.pass);
  const auto per_rank = static_cast<std::uint32_t>(p.geo.tokens * p.geo.topk);
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < rows;
       i += std::int64_t{gridDim.x} * kThreads) {
    const std::int32_t src = p.pass.table[p.pass.row_offset + i];
    if (src < 0) continue;
    const float* partial = p.dot + i * p.chunks;
    float sum = 0.0f;
    for (int c = 0; c < p.chunks; ++c) sum = __fadd_rn(sum, partial[c]);
    const auto u = static_cast<std::uint32_t>(src);
    p.dst_peers[u / per_rank][u % per_rank] = sum;
  }
}

__global__ void __launch_bounds__(kThreads) router_grad_gather_kernel(RouterGradGatherParams p) {
  const std::int64_t n = p.tokens * p.topk;
  for (std::int64_t s = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; s < n;
       s += std::int64_t{gridDim.x} * kThreads) {
    const std::int64_t id = p.topk_experts[s];
    p.d_topk_weights[s] = id >= 0 && id < p.num_experts ? p.slots[s] : 0.0f;
  }
}

int blocks_for(std::int64_t work) {
  const std::int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

}  // namespace

cudaError_t launch_router_grad_push(const RouterGradPushParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  router_grad_push_kernel<<<blocks_for(p.pass.ring_rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_router_grad_gather(const RouterGradGatherParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  router_grad_gather_kernel<<<blocks_for(p.tokens * p.topk), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
