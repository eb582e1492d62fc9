// The FP8 quantization kernels (one per file in this folder), on the arguments of
// core/fp8_params.hpp: the same bits as the CPU reference (src/reference/fp8_quant.cpp), both
// evaluating core/fp8.hpp. Each enqueues one launch on `stream` (a cudaStream_t) on the current
// CUDA device, which must be `device` (else mok::Error naming it), and raises mok::Error if the
// launch fails. Pointers are device memory, 16-byte aligned (checked by src/api/fp8.cpp, which
// validates every size). The device functions the layer's epilogues call: fp8_quantize.cuh.
//
// No CUDA types here: the API layer includes this in builds without CUDA too, where the stubs of
// src/cuda/fp8_no_cuda.cpp raise mok::Error instead.
#pragma once

#include "core/fp8_params.hpp"

namespace mok::cuda {

void launch_quantize_rows_fp8(const fp8::ActivationParams& p, int device, void* stream);
void launch_quantize_token_axis_fp8(const fp8::ActivationParams& p, int device, void* stream);
void launch_quantize_weights_fp8(const fp8::WeightParams& p, int device, void* stream);
void launch_mxfp8_quantize(const fp8::MxParams& p, int device, void* stream);
// p.inexact (device memory) receives the count of changed elements (set, not added to).
void launch_mx_weights_to_blocks(const fp8::MxToBlocksParams& p, int device, void* stream);

}  // namespace mok::cuda
