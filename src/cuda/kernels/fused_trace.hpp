// The forward megakernel's trace layout (fused_forward.hpp has what each word holds), in plain
// C++ for the host code that reads it: the layer tests and bench_virtual_ranks.
#pragma once

#include <cstdint>

namespace mok::cuda {

inline constexpr int kTraceTicketWords = 8;  // words a ticket (its stamps, then its CTA and kind)

// Words of a trace of `tickets` tickets over `grid` CTAs: a 4-word header, 4 words a CTA, then
// the tickets'.
constexpr std::int64_t fused_trace_words(std::int64_t grid, std::int64_t tickets) {
  return 4 + 4 * grid + kTraceTicketWords * tickets;
}

}  // namespace mok::cuda
