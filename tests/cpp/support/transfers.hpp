// Reference row transfers for the tests and the dispatch benchmark: the row-order dispatch (one
// warp per ring row, transfer.cuh's pull_row: the order the forward megakernel pulls in) and a
// standalone combine push. The layer's launches dispatch in token order (cuda::launch_pull_tokens)
// and combine in the GEMM epilogues; these are what both are checked against.
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels/transfer.hpp"

namespace mok::test {

// ring[i] = the source row of every kept row i of the pass (zeros in its padding rows), scaled
// by its router weight with `pull.scale_peers` / `pull.scale_own`, or unscaled with the weight
// written beside it with `pull.row_weights` too.
cudaError_t launch_pull_rows(const cuda::PullParams& pull, cudaStream_t stream);

// Combine (forward) and backward combine: dst[src_rank][t*k+j] = ring[i] for every kept row.
// `dst_peers`: W pointers to [T*k, H] bf16 slot buffers. Padding rows are not sent.
struct PushParams {
  cuda::PassRows pass;
  cuda::RowGeometry geo;
  const void* ring = nullptr;  // [ring_rows, H] bf16
  void* const* dst_peers = nullptr;
};
cudaError_t launch_push_rows(const PushParams& push, cudaStream_t stream);

}  // namespace mok::test
