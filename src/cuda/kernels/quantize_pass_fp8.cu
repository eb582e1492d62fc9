// The FP8 layer's quantizers of a ring pass (quantize_pass_fp8.hpp): the kernels of
// quantize_rows_fp8.cu and quantize_token_axis_fp8.cu with the pass's extent and groups read on
// the device.
#include "core/fp8.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/quantize_pass_fp8.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A half-warp per 1x128 block (fp8_quantize.cuh's quantize_vector, 8 values a lane, 16-byte
// loads), blocks in scale order (kb * rows + m) over the rows that exist. NOTES: one block a warp
// with 8-byte loads ran at about 450 GB/s on an H100 (2026-12-05, 97fb378).
__global__ void __launch_bounds__(kThreads) quantize_pass_rows_kernel(QuantizePassRowsParams p) {
  std::int64_t rows = p.rows;
  if (p.row_end != nullptr) rows = min(rows, static_cast<std::int64_t>(max(*p.row_end, 0)));
  const int lane = threadIdx.x % 32, half = lane / 16;
  const std::int64_t blocks = rows * (p.K / fp8::kBlock);
  // Both halves of a warp run every iteration (quantize_vector's shuffles cross the warp); a
  // half past the last block loads nothing and stores nothing.
  for (std::int64_t pair = blockIdx.x * std::int64_t{kWarps} + threadIdx.x / 32; 2 * pair < blocks;
       pair += std::int64_t{gridDim.x} * kWarps) {
    const std::int64_t b = 2 * pair + half;
    const bool live = b < blocks;
    const std::int64_t m = live ? b % rows : 0, kb = live ? b / rows : 0;
    const std::int64_t col = kb * fp8::kBlock + (lane % 16) * 8;
    const uint4 raw =
        live ? *reinterpret_cast<const uint4*>(p.x + m * p.ld_x + col) : make_uint4(0, 0, 0, 0);
    float scale;
    const uint2 q = quantize_vector(raw, &scale);
    if (!live) continue;
    *reinterpret_cast<uint2*>(p.data + m * p.ld + col) = q;
    if (lane % 16 == 0) p.scales[kb * p.scale_ld + m] = scale;
  }
}

// The group holding row m0 (the last g whose start is at or before it), or -1 when m0 is past
// every group. Empty groups start where the next one does and are passed over.
__device__ int group_of(const std::int32_t* starts, int groups, std::int64_t m0) {
  if (m0 < starts[0] || m0 >= starts[groups]) return -1;
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= m0) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// A CTA per 128-row block of one group and kTokenTileCols columns (fp8_quantize.cuh's
// quantize_token_tile), rows past the group's count read as 0, rows scaled by their weights
// where p.row_weights is given.
// kRowLoads: quantize_token_tile_rows instead (QuantizePassTokenAxisParams::row_loads).
template <bool kRowLoads>
__global__ void __launch_bounds__(kTokenTileThreads)
    quantize_pass_token_axis_kernel(QuantizePassTokenAxisParams p, bool vectors) {
  const std::int64_t col_tiles = (p.K + kTokenTileCols - 1) / kTokenTileCols;
  const std::int64_t mb = blockIdx.x / col_tiles, k0 = (blockIdx.x % col_tiles) * kTokenTileCols;
  const std::int64_t m0 = mb * fp8::kBlock;
  const int g = group_of(p.starts, p.groups, m0);
  if (g < 0) return;  // the same for the whole CTA
  const std::int64_t end = std::int64_t{p.starts[g]} + max(p.counts[g], 0);
  const std::int64_t valid = max(std::int64_t{0}, min(std::int64_t{fp8::kBlock}, end - m0));
  const float* weights = p.row_weights != nullptr ? p.row_weights + m0 : nullptr;
  if constexpr (kRowLoads) {
    quantize_token_tile_rows(p.x + m0 * p.ld_x, p.ld_x, valid, vectors, k0, p.K, p.data + m0, p.ld,
                             p.scales + mb * p.scale_ld, weights);
  } else {
    quantize_token_tile(p.x + m0 * p.ld_x, p.ld_x, valid, vectors, k0, p.K, p.data + m0, p.ld,
                        p.scales + mb * p.scale_ld, weights);
  }
}

}  // namespace

cudaError_t launch_quantize_pass_rows(const QuantizePassRowsParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.K <= 0) return cudaSuccess;
  if (p.K % fp8::kBlock != 0) return cudaErrorInvalidValue;  // whole 1x128 blocks per row
  // quantize_vector's 16-byte loads and the 8-byte stores.
  if (!chunk_vectors_ok(p.x, p.ld_x) || reinterpret_cast<std::uintptr_t>(p.data) % 8 != 0 ||
      p.ld % 8 != 0) {
    return cudaErrorMisalignedAddress;
  }
  const unsigned grid = grid_for((p.rows * (p.K / fp8::kBlock) + 1) / 2, kWarps);
  quantize_pass_rows_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_quantize_pass_token_axis(const QuantizePassTokenAxisParams& p,
                                            cudaStream_t stream) {
  if (p.rows <= 0 || p.K <= 0 || p.groups <= 0) return cudaSuccess;
  if (p.rows % fp8::kBlock != 0) return cudaErrorInvalidValue;  // whole 128-token blocks
  // quantize_token_tile's 8-byte stores of each column's rows.
  if (reinterpret_cast<std::uintptr_t>(p.data) % 8 != 0 || p.ld % 8 != 0) {
    return cudaErrorMisalignedAddress;
  }
  const std::int64_t tiles = (p.rows / fp8::kBlock) * ((p.K + kTokenTileCols - 1) / kTokenTileCols);
  const unsigned grid = static_cast<unsigned>(tiles);
  if (p.row_loads) {
    quantize_pass_token_axis_kernel<true>
        <<<grid, kTokenTileThreads, 0, stream>>>(p, chunk_vectors_ok(p.x, p.ld_x));
  } else {
    quantize_pass_token_axis_kernel<false>
        <<<grid, kTokenTileThreads, 0, stream>>>(p, chunk_vectors_ok(p.x, p.ld_x));
  }
  return cudaGetLastError();
}

}  // namespace mok::cuda
