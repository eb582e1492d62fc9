// The FP8 quantizers' arguments: plain pointers and sizes, the boundary between the validated API
// (src/api/fp8.cpp) and the two implementations, the CPU reference (src/reference/fp8_quant.cpp)
// and the CUDA kernels (src/cuda/kernels/*quantize*.cu, mx_weights_to_blocks.cu), which compute
// the same bits. Layouts: core/fp8_layout.hpp; the maths: core/fp8.hpp.
#pragma once

#include <cstdint>

#include "core/fp8.hpp"

namespace mok::fp8 {

enum class Source : std::uint8_t { bf16, f32 };  // the element type of an activation source

// Activations [M, K] (bf16 or fp32) -> rows form (data [M, K], scales [K/128, M]; K a multiple of
// 128) or token-axis form (data [K, M], scales [M/128, K]; M a multiple of 128).
struct ActivationParams {
  const void* x = nullptr;
  Source source = Source::bf16;
  std::int64_t M = 0, K = 0;
  e4m3_t* data = nullptr;
  float* scales = nullptr;
};

// Both orientations of a quantized [E, N, K] weight (N and K multiples of 128).
struct BlockWeights {
  e4m3_t* data = nullptr;     // [E, N, K]
  float* scales = nullptr;    // [E, N/128, K/128]
  e4m3_t* data_t = nullptr;   // [E, K, N]
  float* scales_t = nullptr;  // [E, K/128, N/128]
};

// bf16 weights [E, N, K] -> BlockWeights, every 128x128 block read once.
struct WeightParams {
  const std::uint16_t* w = nullptr;  // bf16 bits
  std::int64_t E = 0, N = 0, K = 0;
  BlockWeights out;
};

// MoK's mxfp8_quantize: bf16 x [E, M, N] (M, N multiples of 128) -> the normal and/or the
// transposed MX tensors (a null pair is not requested).
struct MxParams {
  const std::uint16_t* x = nullptr;
  std::int64_t E = 0, M = 0, N = 0;
  e4m3_t* data = nullptr;            // [E, M, N]
  std::uint8_t* scales = nullptr;    // [E*M/128, N/128, 32, 16]
  e4m3_t* data_t = nullptr;          // [E, N, M]
  std::uint8_t* scales_t = nullptr;  // [E*N/128, M/128, 32, 16]
};

// An MX weight (data [E, N, K] e4m3, scales [E*N/128, K/128, 32, 16] E8M0) -> BlockWeights.
// `inexact` receives the count of elements whose value changed (int64, set, not added to).
struct MxToBlocksParams {
  const e4m3_t* data = nullptr;
  const std::uint8_t* scales = nullptr;
  std::int64_t E = 0, N = 0, K = 0;
  BlockWeights out;
  std::int64_t* inexact = nullptr;
};

}  // namespace mok::fp8
