// The device error record: what a kernel leaves behind instead of writing out of bounds or hanging
// (bad ids, timed-out waits: raised by the next call; docs/architecture.md, "Rules the code
// keeps"). Plain C++, shared by the kernels and the host that reports it.
//
// One record per rank lives in that rank's local workspace; a copy is published to host-mapped
// pinned memory (the "mirror"), which the host reads on every mok call without synchronizing.
// The record is sticky: the first error of a kind wins until the host has reported it.
#pragma once

#include <cstdint>

namespace mok::comm {

enum class ErrorKind : std::uint32_t {
  none = 0,
  bad_expert_id = 1,    // topk_experts held an id outside [-1, E); the slot was treated as unused
  barrier_timeout = 2,  // a bounded wait gave up; the launch returned early, its outputs are void
};

// Which flag a timed-out wait was watching.
enum class FlagId : std::uint32_t {
  none = 0,
  team_barrier = 1,  // flags[index] of the waiting rank: arrivals from rank `index`
  rank_grid = 2,     // the rank-local grid barrier counter (blocks of one rank)
  // The forward megakernel's counters (rank-local, reset by the launch itself: a timeout leaves
  // nothing inconsistent behind):
  fused_ready = 3,  // ready[index]: the pull of the pass's ring rows [128 index, 128 index + 128)
  fused_done = 4,   // done[index]: the gate/up tiles of those rows
  fused_shared_done = 5,  // shared_done[index]: the shared expert's gate/up tiles of its tokens
                          // [128 index, 128 index + 128)
};

struct DeviceErrorRecord {
  std::uint32_t kind;  // ErrorKind; written last when published
  std::int32_t rank;   // rank that found the error
  // bad_expert_id: the smallest bad slot of that rank's topk_experts in this launch
  std::int64_t token;
  std::int64_t value;
  std::int32_t slot;  // j
  // barrier_timeout
  std::uint32_t flag;       // FlagId
  std::int32_t flag_index;  // peer rank for team_barrier, 0 for rank_grid
  std::uint32_t expected;   // the wait ends when flag - expected >= 0 (mod 2^32)
  std::uint32_t seen;       // the flag's value at the timeout
  std::uint32_t block;      // blockIdx.x of the waiting block
  std::uint64_t waited_ns;  // how long it waited
  // Device-only bookkeeping: min over this launch's bad slots of (slot index t*k+j); ~0 = none.
  std::uint64_t bad_slot_key;
  std::uint64_t reserved[8];
};
static_assert(sizeof(DeviceErrorRecord) == 128);

inline constexpr std::uint64_t kNoBadSlot = ~std::uint64_t{0};

}  // namespace mok::comm
