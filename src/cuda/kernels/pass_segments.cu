// The pass segments kernel (pass_segments.hpp has the formulas): one thread per local expert, plus
// one for the end entry starts_p[E]; with `steps`, each thread also writes its expert's step of
// the weight gradients' pass plan (pass_step).
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/kernels/pass_segments.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline std::int64_t clamp_row(std::int64_t v, std::int64_t hi) {
  return v < 0 ? 0 : (v > hi ? hi : v);
}

// The pass plan step of one expert whose table rows are [start, start + count).
__device__ inline std::int32_t pass_step(std::int64_t start, std::int64_t count, std::int64_t e,
                                         const PassSegmentsParams& p) {
  const std::int64_t last_pass = p.passes - 1;
  auto pass_of = [&](std::int64_t row) {
    const std::int64_t q = row / p.ring_rows;
    return q < 0 ? 0 : (q > last_pass ? last_pass : q);
  };
  const std::int64_t first = pass_of(start);
  const std::int64_t last = count > 0 ? pass_of(start + count - 1) : first;
  if (p.pass < first || p.pass > last) return gemm::kSkip;
  if (first == last) return gemm::kWhole;
  // Slot `first` is this expert's alone when there are no more boundaries than experts (then
  // plan::carry_slots is the boundaries, else the experts).
  const std::int64_t slot = last_pass <= p.num_experts ? first : e;
  const int step = p.pass == first ? gemm::kOpen : p.pass == last ? gemm::kClose : gemm::kCarry;
  return static_cast<std::int32_t>(step | (slot << gemm::kPassSlotShift));
}

__global__ void __launch_bounds__(kThreads) pass_segments_kernel(PassSegmentsParams p) {
  for (std::int32_t e = blockIdx.x * kThreads + threadIdx.x; e <= p.num_experts;
       e += gridDim.x * kThreads) {
    const std::int64_t start = clamp_row(p.segment_starts[e] - p.row_offset, p.ring_rows);
    p.pass_starts[e] = static_cast<std::int32_t>(start);
    if (e == p.num_experts) continue;
    const std::int64_t end = clamp_row(
        std::int64_t{p.segment_starts[e]} + p.expert_counts[e] - p.row_offset, p.ring_rows);
    p.pass_rows[e] = static_cast<std::int32_t>(end - start);
    if (p.steps != nullptr) {
      p.steps[e] = pass_step(p.segment_starts[e], p.expert_counts[e], e, p);
    }
  }
}

}  // namespace

cudaError_t launch_pass_segments(const PassSegmentsParams& p, cudaStream_t stream) {
  const int blocks = (p.num_experts + 1 + kThreads - 1) / kThreads;
  pass_segments_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
