// The standalone row-transfer kernels: a grid-stride loop of warps over the rows of a pass, each
// row moved by transfer.cuh's device function.
#include "cuda/kernels/transfer.cuh"

namespace mok::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// Row i = every (gridDim.x * kWarpsPerBlock)-th row from this warp's, through `row`.
template <class Params, class Row>
__device__ __forceinline__ void each_row(const Params& p, Row row) {
  const std::int64_t rows = transfer::rows_in_pass(p.pass);
  const std::int64_t vectors = p.geo.hidden / transfer::kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t i = warp; i < rows; i += warps) row(p, i, lane, vectors);
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) pull_rows_kernel(PullParams p) {
  each_row(p, [](const PullParams& q, std::int64_t i, int lane, std::int64_t vectors) {
    transfer::pull_row(q, i, lane, vectors);
  });
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) push_rows_kernel(PushParams p) {
  each_row(p, [](const PushParams& q, std::int64_t i, int lane, std::int64_t vectors) {
    transfer::push_row(q, i, lane, vectors);
  });
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) scale_rows_kernel(ScaleRowsParams p) {
  each_row(p, [](const ScaleRowsParams& q, std::int64_t i, int lane, std::int64_t vectors) {
    transfer::scale_row(q, i, lane, vectors);
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

cudaError_t launch_pull_rows(const PullParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  pull_rows_kernel<<<grid_for(p.pass.ring_rows), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_scale_rows(const ScaleRowsParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  scale_rows_kernel<<<grid_for(p.pass.ring_rows), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_push_rows(const PushParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  push_rows_kernel<<<grid_for(p.pass.ring_rows), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
