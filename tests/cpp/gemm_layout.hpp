// The row layout of a grouped-GEMM test (the schedule's: each group's rows padded to the tile
// height), shared by the bf16 and e4m3 GEMM tests.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "cuda/gemm/grouped_gemm.hpp"
#include "gpu_buffer.hpp"

namespace mok::test {

// Rows [r0, r1) of a [rows, cols] matrix set to all-ones bytes (NaN in bf16 and fp32, NaN in
// e4m3): padding must never leak into kept values.
template <class T>
void poison_rows(DeviceBuffer<T>& b, int cols, int r0, int r1) {
  if (r1 > r0) {
    cudaMemset(b.get() + static_cast<std::size_t>(r0) * cols, 0xff,
               std::size_t(r1 - r0) * cols * sizeof(T));
  }
}

// Padded segment starts and unpadded counts, on host and device; `extra_rows` rows past the last
// segment (the capacity the row buffers have beyond the groups').
struct Layout {
  static constexpr int kAlign = gemm::kExpertSegmentAlignment;
  std::vector<int> counts, starts;
  int capacity = 0;
  DeviceBuffer<int> d_starts, d_counts;
  explicit Layout(const std::vector<int>& c, int extra_rows = 64)
      : counts(c), starts(c.size() + 1, 0), d_starts(c.size() + 1), d_counts(c.size()) {
    for (std::size_t g = 0; g < c.size(); ++g) {
      starts[g + 1] = starts[g] + (c[g] + kAlign - 1) / kAlign * kAlign;
    }
    capacity = starts.back() + extra_rows;
    d_starts.upload(starts);
    d_counts.upload(counts);
  }
  int groups() const { return static_cast<int>(counts.size()); }
  gemm::RowSegments segments() const {
    return gemm::RowSegments{d_starts.get(), d_counts.get(), groups(), capacity, 0};
  }
  // Poison every padding row (and the rows past the last segment) of a row buffer.
  template <class T>
  void poison_padding(DeviceBuffer<T>& b, int cols) const {
    for (int g = 0; g < groups(); ++g) poison_rows(b, cols, starts[g] + counts[g], starts[g + 1]);
    poison_rows(b, cols, starts.back(), capacity);
  }
};

// The pass plan of a group whose rows are [start, start + count) in pass `pass` of `passes` of
// `pass_rows` rows each, and its slot: the rule pass_segments.cu applies on the device, written
// out again here from PassPlan's definition (grouped_gemm.hpp).
inline int host_pass_step(int start, int count, int g, int groups, int pass, int passes,
                          int pass_rows) {
  auto pass_of = [&](int row) { return std::min(row / pass_rows, passes - 1); };
  const int first = pass_of(start), last = count > 0 ? pass_of(start + count - 1) : first;
  if (pass < first || pass > last) return mok::gemm::kSkip;
  if (first == last) return mok::gemm::kWhole;
  const int slot = passes - 1 <= groups ? first : g;
  const int step = pass == first  ? mok::gemm::kOpen
                   : pass == last ? mok::gemm::kClose
                                  : mok::gemm::kCarry;
  return step | slot << mok::gemm::kPassSlotShift;
}

// Pass `pass` of `l`'s rows cut into passes of `pass_rows`: each group's start and row count
// clipped to the pass (relative to its first row), and its pass-plan step.
struct HostPass {
  std::vector<int> starts, rows, steps;
};
inline HostPass host_pass(const Layout& l, int pass, int passes, int pass_rows) {
  const int G = l.groups(), r0 = pass * pass_rows;
  HostPass h{std::vector<int>(G + 1), std::vector<int>(G), std::vector<int>(G)};
  for (int g = 0; g <= G; ++g) {
    h.starts[g] = std::clamp(l.starts[g] - r0, 0, pass_rows);
    if (g == G) break;
    h.rows[g] = std::clamp(l.starts[g] + l.counts[g] - r0, 0, pass_rows) - h.starts[g];
    h.steps[g] = host_pass_step(l.starts[g], l.counts[g], g, G, pass, passes, pass_rows);
  }
  return h;
}

}  // namespace mok::test
