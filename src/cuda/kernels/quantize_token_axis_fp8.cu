// Activations -> FP8 in the token-axis form, 128x1 blocks down each column (core/fp8_layout.hpp:
// x [M, K] -> data [K, M], scales [M/128, K]), what the weight gradients read (both operands
// 1x128 along the tokens): a CTA per 128 x 64 tile, fp8_quantize.cuh's quantize_token_tile.
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/fp8_quantize.hpp"

namespace mok::cuda {
namespace {

// A CTA per 128 x kTokenTileCols tile (fp8_quantize.cuh's quantize_token_tile).
template <class T>
__global__ void __launch_bounds__(kTokenTileThreads)
    quantize_token_axis_fp8_kernel(fp8::ActivationParams p, bool vectors) {
  const std::int64_t col_tiles = (p.K + kTokenTileCols - 1) / kTokenTileCols;
  const std::int64_t mb = blockIdx.x / col_tiles, k0 = (blockIdx.x % col_tiles) * kTokenTileCols;
  const std::int64_t m0 = mb * fp8::kBlock;
  quantize_token_tile(static_cast<const T*>(p.x) + m0 * p.K, p.K, fp8::kBlock, vectors, k0, p.K,
                      p.data + m0, p.M, p.scales + fp8::token_scale_index(mb, 0, p.K));
}

}  // namespace

void launch_quantize_token_axis_fp8(const fp8::ActivationParams& p, int device, void* stream) {
  require_current_device(device);
  if (p.M == 0 || p.K == 0) return;
  const std::int64_t tiles = (p.M / fp8::kBlock) * ((p.K + kTokenTileCols - 1) / kTokenTileCols);
  const auto grid = static_cast<unsigned>(tiles);  // bounded by the API (below 2^31 tiles)
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.source == fp8::Source::bf16) {
    const auto* x = static_cast<const std::uint16_t*>(p.x);
    quantize_token_axis_fp8_kernel<std::uint16_t>
        <<<grid, kTokenTileThreads, 0, s>>>(p, chunk_vectors_ok(x, p.K));
  } else {
    const auto* x = static_cast<const float*>(p.x);
    quantize_token_axis_fp8_kernel<float>
        <<<grid, kTokenTileThreads, 0, s>>>(p, chunk_vectors_ok(x, p.K));
  }
  check_launch("quantize_token_axis_fp8");
}

}  // namespace mok::cuda
