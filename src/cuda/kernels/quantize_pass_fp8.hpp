// The FP8 layer's quantization of a ring pass (cuda/layer/layer.cu; docs/architecture.md, "The FP8
// layer"): bf16 rows the layer already holds -> the e4m3 operands of the pass's GEMMs, with
// core/fp8.hpp's bits (the same maths as the API's quantize_rows and quantize_token_axis, which
// take whole tensors; these take the pass's extent and segments from device memory, so no host
// synchronization and no work for rows the pass does not have).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::cuda {

// Rows form, 1x128 blocks along K: data[m * ld + k] = e4m3(x[m, k] / s), scales[kb * scale_ld +
// m] = s, for rows m < min(*row_end, rows) (row_end null: every row). K a multiple of 128.
struct QuantizePassRowsParams {
  const std::uint16_t* x = nullptr;  // bf16 bits [rows, K], ld_x
  std::int64_t ld_x = 0;
  std::int64_t rows = 0, K = 0;
  const std::int32_t* row_end = nullptr;  // device scalar, or null
  std::uint8_t* data = nullptr;           // [rows, ld]
  std::int64_t ld = 0;
  float* scales = nullptr;  // [K / 128, scale_ld]
  std::int64_t scale_ld = 0;
};
cudaError_t launch_quantize_pass_rows(const QuantizePassRowsParams& p, cudaStream_t stream);

// Token-axis form of a pass's grouped rows (what the FP8 weight gradients read): per group g (its
// rows [starts[g], starts[g] + counts[g]), starts on multiples of 128), 128-row blocks from the
// group's first row; a block's scale per column from the group's rows only (rows past the group's
// count are taken as 0 and stored as 0). data[k * ld + m] (the transpose), scales[(m / 128) *
// scale_ld + k]. Blocks at or past starts[groups] are not touched. rows a multiple of 128. With
// row_weights, row m is taken as bf16(row_weights[m] * x[m, :]) (the reference's dy from the
// d_out rows: the scaled rows are never written).
struct QuantizePassTokenAxisParams {
  const std::uint16_t* x = nullptr;  // bf16 bits [rows, K], ld_x
  std::int64_t ld_x = 0;
  std::int64_t rows = 0, K = 0;
  const std::int32_t* starts = nullptr;  // [groups + 1], device
  const std::int32_t* counts = nullptr;  // [groups], device
  int groups = 0;
  std::uint8_t* data = nullptr;  // [K, ld], ld >= rows
  std::int64_t ld = 0;
  float* scales = nullptr;  // [rows / 128, scale_ld], scale_ld >= K
  std::int64_t scale_ld = 0;
  const float* row_weights = nullptr;  // [rows], device, or null
  // The kernel (the same bits either way): true, fp8_quantize.cuh's quantize_token_tile_rows (a
  // warp loads whole 128-byte rows and transposes them in shared memory: 0.88-0.94 of a device
  // copy's rate on an H100, NOTES "2026-12-06, 48dbb95"); false, its quantize_token_tile (a warp
  // loads 32-byte pieces of 32 rows: 0.68-0.74).
  bool row_loads = true;
};
cudaError_t launch_quantize_pass_token_axis(const QuantizePassTokenAxisParams& p,
                                            cudaStream_t stream);

}  // namespace mok::cuda
