// Weight gradients reduced in fp32 over several ring passes end here: written to the caller's
// bf16 or fp32 gradient, or added to an fp32 main gradient (one rounding, at the end).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::cuda {

struct FinalizeGradParams {
  const float* partial = nullptr;  // [n] fp32, the full reduction
  void* out = nullptr;             // [n] bf16 (out_fp32 false) or fp32
  bool out_fp32 = false;
  bool accumulate = false;  // fp32 only: out += partial
  std::int64_t n = 0;       // a multiple of 8
};
cudaError_t launch_finalize_grad(const FinalizeGradParams& p, cudaStream_t stream);

}  // namespace mok::cuda
