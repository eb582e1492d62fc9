// Reference row transfers (transfers.hpp): a grid-stride loop of warps over the rows of a pass.
#include "support/transfers.hpp"

#include "cuda/kernels/transfer.cuh"

namespace mok::test {
namespace {

constexpr int kWarpsPerBlock = 8;

template <class Params, class Row>
__device__ __forceinline__ void each_row(const Params& p, Row row) {
  const std::int64_t rows = cuda::transfer::rows_in_pass(p.pass);
  const std::int64_t vectors = p.geo.hidden / cuda::transfer::kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t i = warp; i < rows; i += warps) row(p, i, lane, vectors);
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) pull_rows_kernel(cuda::PullParams p) {
  each_row(p, [](const cuda::PullParams& q, std::int64_t i, int lane, std::int64_t vectors) {
    cuda::transfer::pull_row(q, i, lane, vectors);
  });
}

// Ring row i into its slot of the home rank's buffer; padding rows go nowhere.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) push_rows_kernel(PushParams p) {
  each_row(p, [](const PushParams& q, std::int64_t i, int lane, std::int64_t vectors) {
    const std::int32_t src = q.pass.table[q.pass.row_offset + i];
    if (src < 0) return;
    const cuda::transfer::RowSource s = cuda::transfer::decode(src, q.geo);
    const uint4* from = reinterpret_cast<const uint4*>(q.ring) + i * vectors;
    uint4* dst = reinterpret_cast<uint4*>(q.dst_peers[s.rank]) + s.slot * vectors;
    for (std::int64_t v = lane; v < vectors; v += 32) dst[v] = from[v];
  });
}

int grid_for(std::int64_t ring_rows) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const std::int64_t blocks = (ring_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const std::int64_t cap = std::int64_t{sms} * 8;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

}  // namespace

cudaError_t launch_pull_rows(const cuda::PullParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  pull_rows_kernel<<<grid_for(p.pass.ring_rows), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_push_rows(const PushParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  push_rows_kernel<<<grid_for(p.pass.ring_rows), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::test
