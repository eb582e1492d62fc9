// The router-weight gradient, computed where the expert runs (MoK's form, reference.hpp):
//   d_w[t, j] = <dh_u, h>,  dh_u = d_out[t] W_down[e] (fp32), h the forward's hidden row
// The down dgrad's epilogue leaves one fp32 partial per row and 128-column chunk
// (gemm::SwigluBackwardEpilogue::dot); the expert rank sums them here and pushes the result into
// the home rank's slot t*k+j; the home rank copies its slots out, 0 for an unused slot.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/transfer.hpp"

namespace mok::cuda {

// Expert side, after a pass's down dgrad: for every kept ring row i,
//   dst_peers[src_rank][t*k+j] = dot[i][0] + dot[i][1] + ... (fp32, increasing chunk).
struct RouterGradPushParams {
  PassRows pass;
  RowGeometry geo;
  const float* dot = nullptr;  // [ring_rows, chunks]
  int chunks = 0;
  float* const* dst_peers = nullptr;  // W pointers to [T*k] fp32
};
cudaError_t launch_router_grad_push(const RouterGradPushParams& p, cudaStream_t stream);

// Home side: d_topk_weights[s] = slots[s] for a slot whose id is in [0, E), else 0.
struct RouterGradGatherParams {
  std::int64_t tokens = 0, topk = 0, num_experts = 0;
  const std::int64_t* topk_experts = nullptr;  // [T, k]
  const float* slots = nullptr;                // [T*k]
  float* d_topk_weights = nullptr;             // [T, k]
};
cudaError_t launch_router_grad_gather(const RouterGradGatherParams& p, cudaStream_t stream);

}  // namespace mok::cuda
