// Token transfers driven by the schedule table (docs/architecture.md, "The schedule table"): the
// expert rank pulls rows into its ring (dispatch) and pushes expert outputs into their slot on the
// home rank (combine).
// Torch-free launchers; peer addresses come as device arrays of W pointers (symmetric buffers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::cuda {

// Which table rows one pass covers: ring row i <-> table row row_offset + i, for
// i < min(ring_rows, *total_rows - row_offset). The total lives in device memory (no host sync);
// a pass that starts past it does nothing.
struct PassRows {
  const std::int32_t* table = nullptr;       // schedule rows: src = rank*T*k + t*k + j, or -1
  const std::int32_t* total_rows = nullptr;  // device scalar: rows in the table, padding included
  std::int64_t row_offset = 0;
  std::int64_t ring_rows = 0;
};

struct RowGeometry {
  std::int64_t tokens = 0;  // T per rank
  std::int64_t topk = 0;    // k
  std::int64_t hidden = 0;  // H, a multiple of 64
  int ranks = 1;            // W
};

// Forward dispatch: ring[i] = x[src_rank][t]. With scale_peers: ring[i] =
// bf16(w[src_rank][t*k+j] * d_out[src_rank][t]), or, when row_weights is given too, the row
// unscaled and its weight in row_weights[i] (backward: the down dgrad scales in its epilogue).
// Padding rows are written as zeros (weight 0).
// `src_peers`: W pointers to [T, H] bf16; `scale_peers`: W pointers to [T, k] fp32, or null.
// `src_own`, `scale_own`: with one rank (W = 1), the rank's own tensors, read where they are
// instead of through the peer arrays (no staging copy); `scale_own` stands for `scale_peers`.
struct PullParams {
  PassRows pass;
  RowGeometry geo;
  const void* const* src_peers = nullptr;
  const float* const* scale_peers = nullptr;
  void* ring = nullptr;          // [ring_rows, H] bf16
  float* row_weights = nullptr;  // [ring_rows] fp32, with scale_peers (or scale_own) only
  const void* src_own = nullptr;
  const float* scale_own = nullptr;
  // Optional, the token-order pull only (the FP8 layer): each kept row also quantized in 1x128
  // blocks along H (core/fp8.hpp's bits, those of kernels/quantize_pass_fp8.hpp's rows form)
  // into fp8_rows [ring_rows, H] e4m3 with fp8_scales [H / 128, ring_rows], padding rows as
  // zeros (scale 2^-39); H a multiple of 128. Both or neither.
  std::uint8_t* fp8_rows = nullptr;
  float* fp8_scales = nullptr;
};

// In place, for the pass's kept rows: ring[i] = bf16(row_weights[i] * ring[i]) (the same
// rounding as the scaled pull).
struct ScaleRowsParams {
  PassRows pass;
  RowGeometry geo;
  const float* row_weights = nullptr;  // [ring_rows]
  void* ring = nullptr;                // [ring_rows, H] bf16
};
cudaError_t launch_scale_rows(const ScaleRowsParams& p, cudaStream_t stream);

// The dispatch in row order is pull_row's (transfer.cuh, one warp per ring row), the order the
// forward megakernel pulls in; tests/cpp/support/transfers.hpp launches it on its own as the
// tests' reference for both orders.

// The dispatch in token order, the layer's launches' (x forward, d_out backward): the bits of
// the row-order pull without scale (ring[i] = the source row of every kept row i of the pass, zeros
// in its padding rows), where each source token
// is read once and copied to every ring row of the pass that holds one of its slots, so a token
// routed to several of this rank's experts costs one read, where the row order reads it once per
// row. `row_of_slot`: the schedule's inverse of the same table
// (WorkspacePlan::row_of_slot: slot -> row, or -1). Weights (`pull.scale_peers` or
// `pull.scale_own`) only with `pull.row_weights`: the rows unscaled and each row's weight beside
// it, as the row-order pull does (the scaled copy is the row order's only: cudaErrorInvalidValue).
cudaError_t launch_pull_tokens(const PullParams& pull, const std::int32_t* row_of_slot,
                               cudaStream_t stream);

}  // namespace mok::cuda
