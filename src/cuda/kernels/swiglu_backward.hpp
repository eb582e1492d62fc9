// SwiGLU backward on routed rows, between the down dgrad (dh) and the gate/up dgrad:
//   dg, du = bf16(swiglu_backward(g, u, dh))   (core/numerics.hpp, the reference's expression)
// Elementwise over the rows of one pass; the row count is read from device memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::cuda {

struct SwigluBackwardParams {
  const std::int32_t* total_rows = nullptr;  // device scalar: rows in the table
  std::int64_t row_offset = 0;               // first table row of this pass
  std::int64_t ring_rows = 0;                // rows in the pass buffers
  std::int64_t width = 0;                    // I (a multiple of 64)
  const void* dh = nullptr;                  // [ring_rows, I] bf16
  const void* gate = nullptr;                // [ring_rows, I] bf16 pre-activations
  const void* up = nullptr;                  // [ring_rows, I] bf16
  void* d_gate = nullptr;                    // [ring_rows, I] bf16
  void* d_up = nullptr;                      // [ring_rows, I] bf16
};
cudaError_t launch_swiglu_backward(const SwigluBackwardParams& p, cudaStream_t stream);

}  // namespace mok::cuda
