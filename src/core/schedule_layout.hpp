// The schedule table's format and the ring plan (docs/architecture.md, "The schedule table"): one
// definition, shared by the host twin (src/core/schedule_host.cpp), the device kernel
// (src/cuda/kernels/schedule.cu) and every kernel that reads the table (dispatch, grouped GEMM,
// combine). Everything here is `constexpr` and callable on both sides.
//
// The schedule of rank r, for its E_local = E / W local experts (global ids
// [r * E_local, (r + 1) * E_local)):
//
//   table           int32 [max_schedule_rows]   row -> source of the row, in the canonical order
//                                               expert-major, then src_rank, then t, then j:
//                     src = src_rank * T * k + t * k + j   (encode_row)
//                     -1  = padding (segment ends, and every row at or after total_rows)
//   expert_counts   int32 [E_local]             unpadded rows of each local expert
//   expert_src_counts int32 [E_local, W]        rows of expert e that come from src_rank s
//   segment_starts  int32 [E_local + 1]         first row of each expert's segment; every entry is
//   a
//                                               multiple of kExpertSegmentAlignment;
//                                               segment_starts[E_local] = total_rows
//   ring_plan       RingPlan                    total rows, passes and minibatches (below)
//
// Expert e's rows are [segment_starts[e], segment_starts[e] + expert_counts[e]); the rest of its
// segment, up to segment_starts[e + 1], is padding, so every GEMM tile of kExpertSegmentAlignment
// rows belongs to exactly one expert.
#pragma once

#include <cstdint>

#include "core/numerics.hpp"  // MOK_HOST_DEVICE

namespace mok::schedule {

// GEMM tile height (rows): every expert segment starts at a multiple of this. The grouped GEMM
// relies on exactly this value.
inline constexpr std::int32_t kExpertSegmentAlignment = 128;

// A table row that computes nothing that is kept.
inline constexpr std::int32_t kPaddingRow = -1;

// An unused top-k slot (the router's -1; also what an invalid id is treated as).
inline constexpr std::int32_t kUnusedSlot = -1;

// Largest EP group a launch can address (peer-pointer arrays are kernel parameters).
inline constexpr int kMaxRanks = 64;

// Slots per tile of the device kernel's counting sort (a tile is one warp's unit of work). The
// result does not depend on it; the workspace plan sizes the kernel's scratch from it.
inline constexpr std::int64_t kTileSlots = 512;

// The shapes every rank of the team agrees on.
struct Shape {
  std::int64_t num_tokens = 0;   // T, per rank
  std::int64_t topk = 0;         // k
  std::int64_t num_experts = 0;  // E, global
  int ep_size = 1;               // W

  MOK_HOST_DEVICE constexpr std::int64_t slots_per_rank() const { return num_tokens * topk; }
  MOK_HOST_DEVICE constexpr std::int64_t num_local_experts() const { return num_experts / ep_size; }
  MOK_HOST_DEVICE constexpr std::int64_t tiles_per_rank() const {
    return (slots_per_rank() + kTileSlots - 1) / kTileSlots;
  }
};

MOK_HOST_DEVICE constexpr std::int64_t round_up(std::int64_t v, std::int64_t m) {
  return (v + m - 1) / m * m;
}

// Rows an expert's segment occupies for `count` routed rows (padding included).
MOK_HOST_DEVICE constexpr std::int64_t padded_rows(std::int64_t count) {
  return round_up(count, kExpertSegmentAlignment);
}

// Worst case: every slot of every rank on this rank, plus a partial tile of padding per expert.
MOK_HOST_DEVICE constexpr std::int64_t max_schedule_rows(const Shape& s) {
  return std::int64_t{s.ep_size} * s.slots_per_rank() +
         s.num_local_experts() * (kExpertSegmentAlignment - 1);
}

// Config::macrobatch_size 0 (the default) asks for a ring of kAutoRoutedRows routed rows: that
// many rows plus a partial tile of padding per local expert, in whole minibatches. Then a layer
// whose rank receives at most kAutoRoutedRows rows runs in one pass whatever the routing, and the
// table's padding alone never starts a second pass. Any other value is the ring's rows as given.
inline constexpr std::int64_t kAutoRoutedRows = 131072;

MOK_HOST_DEVICE constexpr std::int64_t macrobatch_rows(const Shape& s,
                                                       std::int64_t macrobatch_size,
                                                       std::int64_t minibatch_size) {
  if (macrobatch_size != 0) return macrobatch_size;
  return round_up(kAutoRoutedRows + s.num_local_experts() * (kExpertSegmentAlignment - 1),
                  minibatch_size);
}

// Row encoding. `slot` = t * k + j inside the source rank's [T, k] routing.
MOK_HOST_DEVICE constexpr std::int32_t encode_row(int src_rank, std::int64_t slot,
                                                  std::int64_t slots_per_rank) {
  return static_cast<std::int32_t>(src_rank * slots_per_rank + slot);
}
MOK_HOST_DEVICE constexpr int row_src_rank(std::int32_t row, std::int64_t slots_per_rank) {
  return static_cast<int>(row / slots_per_rank);
}
MOK_HOST_DEVICE constexpr std::int64_t row_slot(std::int32_t row, std::int64_t slots_per_rank) {
  return row % slots_per_rank;
}

// Ids outside [-1, E) are invalid (-1 marks an unused slot). The schedule treats invalid ids as
// unused slots too (and the device records them, for the next call to raise); this is the one
// test of validity.
MOK_HOST_DEVICE constexpr bool is_valid_expert_id(std::int64_t id, std::int64_t num_experts) {
  return id >= -1 && id < num_experts;
}

// What the exchange area holds for one slot: the id as int32, or kUnusedSlot when invalid.
MOK_HOST_DEVICE constexpr std::int32_t staged_expert_id(std::int64_t id, std::int64_t num_experts) {
  return is_valid_expert_id(id, num_experts) ? static_cast<std::int32_t>(id) : kUnusedSlot;
}

// The local expert index of a staged id on `rank`, or -1 when the slot is not computed there.
MOK_HOST_DEVICE constexpr std::int32_t local_expert_of(std::int32_t staged_id, int rank,
                                                       std::int32_t num_local_experts) {
  const std::int32_t e = staged_id - rank * num_local_experts;
  return staged_id >= 0 && e >= 0 && e < num_local_experts ? e : -1;
}

// Local expert of table row `row` (< total rows): the last e with segment_starts[e] <= row.
MOK_HOST_DEVICE inline std::int32_t expert_of_row(const std::int32_t* segment_starts,
                                                  std::int32_t num_local_experts,
                                                  std::int32_t row) {
  std::int32_t lo = 0, hi = num_local_experts - 1;
  while (lo < hi) {
    const std::int32_t mid = (lo + hi + 1) / 2;
    if (segment_starts[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------
// Ring plan (docs/architecture.md, "The schedule table"). The table's rows [0, total_rows) go
// through the ring buffer of macrobatch_rows rows in passes; pass p covers rows
// [p * macrobatch_rows, ...), and inside a pass, minibatch m covers the next minibatch_rows rows.
// Everything follows from total_rows and the Config, so the device derives it without the host.
//
// NOTES: padding rows travel through the ring like routed rows (their GEMM tiles are computed and
// discarded), so a tile never straddles a pass when macrobatch_rows is a multiple of
// kExpertSegmentAlignment, and never straddles a minibatch when minibatch_rows is one too.
struct RingPlan {
  std::int32_t total_rows = 0;            // segment_starts[E_local]
  std::int32_t num_passes = 0;            // ceil(total_rows / macrobatch_rows); 0 when no rows
  std::int32_t macrobatch_rows = 0;       // macrobatch_rows(shape, Config)
  std::int32_t minibatch_rows = 0;        // Config::minibatch_size
  std::int32_t minibatches_per_pass = 0;  // macrobatch_rows / minibatch_rows (a full pass)
  std::int32_t num_minibatches = 0;       // over all passes (the last ones may be short)
  std::int32_t last_pass_rows = 0;        // rows of the last pass (0 when no rows)
  std::int32_t reserved = 0;
};
static_assert(sizeof(RingPlan) == 32);

struct RowRange {
  std::int32_t begin = 0, end = 0;
  MOK_HOST_DEVICE constexpr std::int32_t size() const { return end - begin; }
};

MOK_HOST_DEVICE constexpr std::int32_t min_i32(std::int64_t a, std::int64_t b) {
  return static_cast<std::int32_t>(a < b ? a : b);
}

MOK_HOST_DEVICE constexpr RingPlan make_ring_plan(std::int64_t total_rows,
                                                  std::int64_t macrobatch_rows,
                                                  std::int64_t minibatch_rows) {
  RingPlan p;
  p.total_rows = static_cast<std::int32_t>(total_rows);
  p.macrobatch_rows = static_cast<std::int32_t>(macrobatch_rows);
  p.minibatch_rows = static_cast<std::int32_t>(minibatch_rows);
  p.minibatches_per_pass = static_cast<std::int32_t>(macrobatch_rows / minibatch_rows);
  p.num_passes = static_cast<std::int32_t>((total_rows + macrobatch_rows - 1) / macrobatch_rows);
  const std::int64_t full = total_rows / macrobatch_rows;
  const std::int64_t rest = total_rows - full * macrobatch_rows;
  p.last_pass_rows = total_rows == 0 ? 0 : static_cast<std::int32_t>(rest ? rest : macrobatch_rows);
  p.num_minibatches = static_cast<std::int32_t>(full * p.minibatches_per_pass +
                                                (rest + minibatch_rows - 1) / minibatch_rows);
  return p;
}

MOK_HOST_DEVICE constexpr RowRange pass_rows(const RingPlan& p, std::int32_t pass) {
  const std::int64_t begin = std::int64_t{pass} * p.macrobatch_rows;
  return {min_i32(begin, p.total_rows), min_i32(begin + p.macrobatch_rows, p.total_rows)};
}

MOK_HOST_DEVICE constexpr std::int32_t minibatches_in_pass(const RingPlan& p, std::int32_t pass) {
  const RowRange r = pass_rows(p, pass);
  return static_cast<std::int32_t>((r.size() + p.minibatch_rows - 1) / p.minibatch_rows);
}

// Rows of minibatch `m` of pass `pass` (empty past the pass's end).
MOK_HOST_DEVICE constexpr RowRange minibatch_rows(const RingPlan& p, std::int32_t pass,
                                                  std::int32_t m) {
  const RowRange r = pass_rows(p, pass);
  const std::int64_t begin = std::int64_t{r.begin} + std::int64_t{m} * p.minibatch_rows;
  return {min_i32(begin, r.end), min_i32(begin + p.minibatch_rows, r.end)};
}

// Where table row `row` sits in the ring: its pass, its minibatch in that pass, its ring slot.
struct RingPosition {
  std::int32_t pass = 0, minibatch = 0, ring_row = 0;
};
MOK_HOST_DEVICE constexpr RingPosition ring_position(const RingPlan& p, std::int32_t row) {
  RingPosition r;
  r.pass = row / p.macrobatch_rows;
  r.ring_row = row - r.pass * p.macrobatch_rows;
  r.minibatch = r.ring_row / p.minibatch_rows;
  return r;
}

}  // namespace mok::schedule
