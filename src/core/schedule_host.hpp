// The host twin of build_schedule: the same function as the device kernel, computed directly on
// the CPU (counting sort in the canonical order). It is the oracle of the device tests and the CPU
// backend of build_schedule.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/schedule_layout.hpp"

namespace mok::schedule {

struct BadSlot {
  int rank = 0;
  std::int64_t token = 0;
  std::int32_t slot = 0;
  std::int64_t value = 0;
};

struct HostSchedule {
  std::vector<std::int32_t> table;              // [max_schedule_rows]
  std::vector<std::int32_t> expert_counts;      // [E_local]
  std::vector<std::int32_t> expert_src_counts;  // [E_local, W]
  std::vector<std::int32_t> segment_starts;     // [E_local + 1]
  RingPlan ring_plan;
  // The first bad id (smallest rank, then t, then j) among all ranks' inputs, if any: it was
  // treated as an unused slot, as the device does.
  std::optional<BadSlot> first_bad;
};

// Rank `rank`'s schedule from every rank's expert ids (`ids_per_rank[s]` points at rank s's
// [T, k] int64 ids). `macrobatch_size` is the Config's (0: automatic, macrobatch_rows).
HostSchedule build_schedule_host(const Shape& shape, std::int64_t macrobatch_size,
                                 std::int64_t minibatch_size, int rank,
                                 std::span<const std::int64_t* const> ids_per_rank);

}  // namespace mok::schedule
