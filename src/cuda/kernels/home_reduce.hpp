// The home rank's reductions over its k slots per token (docs/architecture.md, "One forward call",
// step 5), in fixed j order, so results do not depend on which expert rank finished first.
//   out[t]      = bf16(shared[t] + sum_j w[t,j] * combine[t,j])   fp32 fma, increasing j
//   d_x[t]      = bf16(shared_dx[t] + sum_j dx_routed[t,j])        fp32 add, increasing j
// A slot whose id is outside [0, E) (unused, -1, or invalid) contributes nothing.
// Both are bitwise the CPU reference's (same operations in the same order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::cuda {

struct HomeReduceParams {
  std::int64_t tokens = 0, topk = 0, hidden = 0, num_experts = 0;
  const std::int64_t* topk_experts = nullptr;  // [T, k]
  const float* topk_weights = nullptr;         // [T, k]; null for the d_x reduction
  const void* slots = nullptr;                 // [T*k, H] bf16: combine or dx_routed
  const void* shared = nullptr;                // [T, H] bf16 or null (no shared expert)
  void* out = nullptr;                         // [T, H] bf16
};
cudaError_t launch_combine_reduce(const HomeReduceParams& p, cudaStream_t stream);  // out
cudaError_t launch_dx_reduce(const HomeReduceParams& p, cudaStream_t stream);       // d_x

}  // namespace mok::cuda
