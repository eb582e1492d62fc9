// Activation rows -> FP8, 1x128 blocks along K (core/fp8_layout.hpp: data [M, K], scales
// [K/128, M]). One warp per block, blocks in scale order (kb * M + m), so consecutive warps write
// consecutive scales; a lane reads 4 consecutive values (8 or 16 bytes) and writes their 4 bytes.
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/fp8_quantize.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <fp8::Source kSource>
__global__ void __launch_bounds__(kThreads) quantize_rows_fp8_kernel(fp8::ActivationParams p) {
  const int lane = threadIdx.x % 32;
  const std::int64_t blocks = p.M * (p.K / fp8::kBlock);
  for (std::int64_t b = blockIdx.x * std::int64_t{kWarps} + threadIdx.x / 32; b < blocks;
       b += std::int64_t{gridDim.x} * kWarps) {
    const std::int64_t m = b % p.M, kb = b / p.M;
    const std::int64_t at = m * p.K + kb * fp8::kBlock + lane * 4;
    float v[4];
    if constexpr (kSource == fp8::Source::bf16) {
      const uint2 raw =
          *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(p.x) + at);
      v[0] = bf16_bits_to_float(raw.x & 0xffffu);
      v[1] = bf16_bits_to_float(raw.x >> 16);
      v[2] = bf16_bits_to_float(raw.y & 0xffffu);
      v[3] = bf16_bits_to_float(raw.y >> 16);
    } else {
      const float4 raw = *reinterpret_cast<const float4*>(static_cast<const float*>(p.x) + at);
      v[0] = raw.x;
      v[1] = raw.y;
      v[2] = raw.z;
      v[3] = raw.w;
    }
    float scale;
    const std::uint32_t q = warp_quantize_block128(v, &scale);
    *reinterpret_cast<std::uint32_t*>(p.data + at) = q;
    if (lane == 0) p.scales[b] = scale;  // fp8::row_scale_index(m, kb, M) == b
  }
}

}  // namespace

void launch_quantize_rows_fp8(const fp8::ActivationParams& p, int device, void* stream) {
  require_current_device(device);
  if (p.M == 0 || p.K == 0) return;
  const unsigned grid = grid_for(p.M * (p.K / fp8::kBlock), kWarps);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.source == fp8::Source::bf16) {
    quantize_rows_fp8_kernel<fp8::Source::bf16><<<grid, kThreads, 0, s>>>(p);
  } else {
    quantize_rows_fp8_kernel<fp8::Source::f32><<<grid, kThreads, 0, s>>>(p);
  }
  check_launch("quantize_rows_fp8");
}

}  // namespace mok::cuda
