// Row transfers: one warp per row, 16-byte vectors (H is a multiple of 64, so a row is a
// multiple of 128 bytes and every vector is aligned).
#include <cuda_bf16.h>

#include "cuda/kernels/transfer.hpp"

namespace mok::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kBf16PerVector = 8;  // 16 bytes

struct RowSource {
  int rank;
  std::int64_t slot;  // t*k + j on the source rank
};

// NOTES: 32-bit arithmetic: src is an int32 by the table's format, and 64-bit division would
// call a runtime routine with a stack frame.
__device__ inline RowSource decode(std::int32_t src, const RowGeometry& g) {
  const auto per_rank = static_cast<std::uint32_t>(g.tokens * g.topk);
  const auto u = static_cast<std::uint32_t>(src);
  return {static_cast<int>(u / per_rank), static_cast<std::int64_t>(u % per_rank)};
}

// Two bf16 values packed in 32 bits, each scaled by w: bf16(w * v), one multiply then one rounding
// (the reference's dy exactly).
__device__ inline std::uint32_t scale_pair(std::uint32_t packed, float w) {
  __nv_bfloat162 h;
  memcpy(&h, &packed, sizeof h);
  const float2 f = __bfloat1622float2(h);
  const __nv_bfloat162 r = __floats2bfloat162_rn(__fmul_rn(w, f.x), __fmul_rn(w, f.y));
  std::uint32_t out;
  memcpy(&out, &r, sizeof out);
  return out;
}

__device__ inline std::int64_t rows_in_pass(const PassRows& pass) {
  const std::int64_t left = static_cast<std::int64_t>(*pass.total_rows) - pass.row_offset;
  return left < 0 ? 0 : (left < pass.ring_rows ? left : pass.ring_rows);
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) pull_rows_kernel(PullParams p) {
  const std::int64_t rows = rows_in_pass(p.pass);
  const std::int64_t vectors = p.geo.hidden / kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t i = warp; i < rows; i += warps) {
    uint4* dst = reinterpret_cast<uint4*>(p.ring) + i * vectors;
    const std::int32_t src = p.pass.table[p.pass.row_offset + i];
    if (src < 0) {  // padding: zeros, so nothing downstream ever reads stale data
      for (std::int64_t v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
      if (p.row_weights != nullptr && lane == 0) p.row_weights[i] = 0.0f;
      continue;
    }
    const RowSource s = decode(src, p.geo);
    const std::int64_t t =
        static_cast<std::uint32_t>(s.slot) / static_cast<std::uint32_t>(p.geo.topk);
    const void* source = p.src_own != nullptr ? p.src_own : p.src_peers[s.rank];
    const uint4* from = reinterpret_cast<const uint4*>(source) + t * vectors;
    const float* weights = p.scale_own;
    if (weights == nullptr && p.scale_peers != nullptr) weights = p.scale_peers[s.rank];
    if (weights == nullptr || p.row_weights != nullptr) {
      if (p.row_weights != nullptr && lane == 0) p.row_weights[i] = weights[s.slot];
      for (std::int64_t v = lane; v < vectors; v += 32) dst[v] = from[v];
      continue;
    }
    const float w = weights[s.slot];
    for (std::int64_t v = lane; v < vectors; v += 32) {
      const uint4 in = from[v];
      dst[v] = make_uint4(scale_pair(in.x, w), scale_pair(in.y, w), scale_pair(in.z, w),
                          scale_pair(in.w, w));
    }
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) push_rows_kernel(PushParams p) {
  const std::int64_t rows = rows_in_pass(p.pass);
  const std::int64_t vectors = p.geo.hidden / kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t i = warp; i < rows; i += warps) {
    const std::int32_t src = p.pass.table[p.pass.row_offset + i];
    if (src < 0) continue;
    const RowSource s = decode(src, p.geo);
    const uint4* from = reinterpret_cast<const uint4*>(p.ring) + i * vectors;
    uint4* dst = reinterpret_cast<uint4*>(p.dst_peers[s.rank]) + s.slot * vectors;
    for (std::int64_t v = lane; v < vectors; v += 32) dst[v] = from[v];
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) scale_rows_kernel(ScaleRowsParams p) {
  const std::int64_t rows = rows_in_pass(p.pass);
  const std::int64_t vectors = p.geo.hidden / kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t i = warp; i < rows; i += warps) {
    if (p.pass.table[p.pass.row_offset + i] < 0) continue;  // padding stays zero
    const float w = p.row_weights[i];
    uint4* row = reinterpret_cast<uint4*>(p.ring) + i * vectors;
    for (std::int64_t v = lane; v < vectors; v += 32) {
      const uint4 in = row[v];
      row[v] = make_uint4(scale_pair(in.x, w), scale_pair(in.y, w), scale_pair(in.z, w),
                          scale_pair(in.w, w));
    }
  }
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
