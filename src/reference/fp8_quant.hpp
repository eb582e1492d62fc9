// The FP8 quantizers on the host: the CPU backend's implementation and the reference the CUDA
// kernels are checked against bit for bit (both evaluate core/fp8.hpp's functions in the same
// order). Arguments and layouts: core/fp8_params.hpp, core/fp8_layout.hpp. Every pointer is host
// memory; sizes are checked by the caller (src/api/fp8.cpp).
#pragma once

#include <cstdint>

#include "core/fp8_params.hpp"

namespace mok::reference {

// Rows form: x [M, K] -> data [M, K], scales [K/128, M].
void quantize_rows_fp8(const fp8::ActivationParams& p);

// Token-axis form: x [M, K] -> data [K, M], scales [M/128, K].
void quantize_token_axis_fp8(const fp8::ActivationParams& p);

// Weights [E, N, K] -> both orientations of 128x128 blocks.
void quantize_weights_fp8(const fp8::WeightParams& p);

// MoK's mxfp8_quantize (1x32 blocks along the last axis, E8M0 scales in MoK's layout).
void mxfp8_quantize(const fp8::MxParams& p);

// An MX weight into 128x128 blocks; writes *p.inexact. Returns the same count.
std::int64_t mx_weights_to_blocks(const fp8::MxToBlocksParams& p);

}  // namespace mok::reference
