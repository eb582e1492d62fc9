// The expert segments of one ring pass, relative to the ring (docs/architecture.md, "The schedule
// table"): the schedule's segments are in table rows; pass p holds table rows [p*M, (p+1)*M) in
// ring rows [0, M). The GEMMs of a pass take ring-relative segments, computed here on the device
// (no host synchronization):
//   starts_p[e] = clamp(segment_starts[e] - p*M, 0, M)
//   rows_p[e]   = clamp(segment_starts[e] + expert_counts[e] - p*M, 0, M) - starts_p[e], >= 0
//   starts_p[E] = clamp(segment_starts[E] - p*M, 0, M)
// Every starts_p entry stays a multiple of the segment alignment when M is one.
//
// With `steps`, also the pass plan of the weight gradients (gemm::PassPlan): expert e's rows lie in
// passes first(e) .. last(e) (an expert without rows: the pass holding its segment start), so in
// pass p it is kSkip outside them, kWhole when first = last = p, else kOpen / kCarry / kClose. The
// segments are in expert order, so at most one expert spans each pass boundary: carry slot
// first(e) (< passes - 1) is its own; with more boundaries than experts, slot e. Either way the
// slots are below plan::carry_slots(passes, E_local).
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
  // Optional: the pass plan (gemm::PassPlan steps) of pass `pass` of `passes`.
  std::int32_t* steps = nullptr;  // [E_local]
  std::int32_t pass = 0;
  std::int32_t passes = 1;
};
cudaError_t launch_pass_segments(const PassSegmentsParams& p, cudaStream_t stream);

}  // namespace mok::cuda
