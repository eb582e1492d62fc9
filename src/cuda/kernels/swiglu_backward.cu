#include <cuda_bf16.h>

#include "core/numerics.hpp"
#include "cuda/kernels/swiglu_backward.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float2 unpack(std::uint32_t v) {
  __nv_bfloat162 h;
  memcpy(&h, &v, sizeof h);
  return __bfloat1622float2(h);
}

__device__ inline std::uint32_t pack(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  std::uint32_t v;
  memcpy(&v, &h, sizeof v);
  return v;
}

// One thread per 8 elements (16 bytes of each operand).
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(SwigluBackwardParams p) {
  const std::int64_t left = static_cast<std::int64_t>(*p.total_rows) - p.row_offset;
  const std::int64_t rows = left < 0 ? 0 : (left < p.ring_rows ? left : p.ring_rows);
  const std::int64_t n = rows * p.width / 8;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * kThreads) {
    const uint4 dh = reinterpret_cast<const uint4*>(p.dh)[i];
    const uint4 g = reinterpret_cast<const uint4*>(p.gate)[i];
    const uint4 u = reinterpret_cast<const uint4*>(p.up)[i];
    const std::uint32_t dh_w[4] = {dh.x, dh.y, dh.z, dh.w}, g_w[4] = {g.x, g.y, g.z, g.w},
                        u_w[4] = {u.x, u.y, u.z, u.w};
    std::uint32_t dg_w[4], du_w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 a = unpack(dh_w[e]), gg = unpack(g_w[e]), uu = unpack(u_w[e]);
      float dg0, du0, dg1, du1;
      numerics::swiglu_backward(gg.x, uu.x, a.x, &dg0, &du0);
      numerics::swiglu_backward(gg.y, uu.y, a.y, &dg1, &du1);
      dg_w[e] = pack(dg0, dg1);
      du_w[e] = pack(du0, du1);
    }
    reinterpret_cast<uint4*>(p.d_gate)[i] = make_uint4(dg_w[0], dg_w[1], dg_w[2], dg_w[3]);
    reinterpret_cast<uint4*>(p.d_up)[i] = make_uint4(du_w[0], du_w[1], du_w[2], du_w[3]);
  }
}

}  // namespace

cudaError_t launch_swiglu_backward(const SwigluBackwardParams& p, cudaStream_t stream) {
  if (p.ring_rows <= 0) return cudaSuccess;
  const std::int64_t work = p.ring_rows * p.width / 8;
  const std::int64_t blocks = (work + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks));
  swiglu_backward_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
