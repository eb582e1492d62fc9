// The expert segments of one ring pass, relative to the ring (DESIGN.md section 3): the schedule's
// segments are in table rows; pass p holds table rows [p*M, (p+1)*M) in ring rows [0, M). The GEMMs
// of a pass take ring-relative segments, computed here on the device (no host synchronization):
//   starts_p[e] = clamp(segment_starts[e] - p*M, 0, M)
//   rows_p[e]   = clamp(segment_starts[e] + expert_counts[e] - p*M, 0, M) - starts_p[e], >= 0
//   starts_p[E] = clamp(segment_starts[E] - p*M, 0, M)
// Every starts_p entry stays a multiple of the segment alignment when M is one.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::cuda {

struct PassSegmentsParams {
  const std::int32_t* segment_starts = nullptr;  // [E_local + 1]
  const std::int32_t* expert_counts = nullptr;   // [E_local]
  std::int32_t num_experts = 0;                  // E_local
  std::int64_t row_offset = 0;                   // p * M
  std::int64_t ring_rows = 0;                    // M
  std::int32_t* pass_starts = nullptr;           // [E_local + 1]
  std::int32_t* pass_rows = nullptr;             // [E_local]
};
cudaError_t launch_pass_segments(const PassSegmentsParams& p, cudaStream_t stream);

}  // namespace mok::cuda
