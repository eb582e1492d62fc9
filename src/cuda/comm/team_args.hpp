// The arguments of every team launch (host and device; plain C++).
#pragma once

#include <cstdint>

#include "core/schedule_layout.hpp"
#include "core/workspace_plan.hpp"
#include "core/error_record.hpp"

namespace mok::comm {

using schedule::kMaxRanks;

// Everything a team launch needs, passed by value as a kernel parameter (about 2 KB).
struct TeamArgs {
  int world_size = 1;
  int first_rank = 0;  // rank of blockIdx.y == 0
  std::uint64_t timeout_ns = 0;
  plan::WorkspacePlan plan;
  std::uint8_t* symmetric[kMaxRanks] = {};    // every rank's symmetric region, by rank
  std::uint8_t* local[kMaxRanks] = {};        // local regions, by blockIdx.y
  DeviceErrorRecord* mirror[kMaxRanks] = {};  // host-mapped error mirrors, by blockIdx.y
};

}  // namespace mok::comm
