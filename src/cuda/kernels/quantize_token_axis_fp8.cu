// Activations -> FP8 in the token-axis form, 128x1 blocks down each column (core/fp8_layout.hpp:
// x [M, K] -> data [K, M], scales [M/128, K]), what the weight gradients read (both operands
// 1x128 along the tokens). A CTA takes a 128 x 32 tile: coalesced loads of its rows into shared
// memory, then each warp quantizes 4 columns, one 128-row block each (lane l holds rows l, l+32,
// l+64, l+96: conflict-free reads of a column), writing 32 consecutive bytes of data[k] per row
// group.
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/fp8_quantize.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 32;  // columns of a tile
constexpr int kPad = 1;    // an odd row stride (in words): column reads hit 32 banks

template <fp8::Source kSource>
__global__ void __launch_bounds__(kThreads)
    quantize_token_axis_fp8_kernel(fp8::ActivationParams p) {
  __shared__ float tile[fp8::kBlock][kCols + kPad];
  const std::int64_t col_tiles = (p.K + kCols - 1) / kCols;
  const std::int64_t mb = blockIdx.x / col_tiles, k0 = (blockIdx.x % col_tiles) * kCols;
  const std::int64_t m0 = mb * fp8::kBlock;
  for (int idx = threadIdx.x; idx < fp8::kBlock * kCols; idx += kThreads) {
    const int r = idx / kCols, c = idx % kCols;
    float v = 0.0f;  // columns past K are never stored
    if (k0 + c < p.K) {
      const std::int64_t at = (m0 + r) * p.K + k0 + c;
      if constexpr (kSource == fp8::Source::bf16) {
        v = bf16_bits_to_float(static_cast<const std::uint16_t*>(p.x)[at]);
      } else {
        v = static_cast<const float*>(p.x)[at];
      }
    }
    tile[r][c] = v;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int c = warp; c < kCols; c += kThreads / 32) {
    const std::int64_t k = k0 + c;
    if (k >= p.K) break;  // the same for the whole warp
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = tile[lane + 32 * i][c];
    float scale;
    const std::uint32_t q = warp_quantize_block128(v, &scale);
    std::uint8_t* row = p.data + k * p.M + m0;
#pragma unroll
    for (int i = 0; i < 4; ++i) row[lane + 32 * i] = static_cast<std::uint8_t>(q >> (8 * i));
    if (lane == 0) p.scales[fp8::token_scale_index(mb, k, p.K)] = scale;
  }
}

}  // namespace

void launch_quantize_token_axis_fp8(const fp8::ActivationParams& p, int device, void* stream) {
  require_current_device(device);
  if (p.M == 0 || p.K == 0) return;
  const std::int64_t tiles = (p.M / fp8::kBlock) * ((p.K + kCols - 1) / kCols);
  const auto grid = static_cast<unsigned>(tiles);  // bounded by the API (below 2^31 tiles)
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.source == fp8::Source::bf16) {
    quantize_token_axis_fp8_kernel<fp8::Source::bf16><<<grid, kThreads, 0, s>>>(p);
  } else {
    quantize_token_axis_fp8_kernel<fp8::Source::f32><<<grid, kThreads, 0, s>>>(p);
  }
  check_launch("quantize_token_axis_fp8");
}

}  // namespace mok::cuda
