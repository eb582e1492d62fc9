// The workspace plan: every buffer of one rank's layer state, as byte offsets into two regions,
// defined once for host and device (DESIGN.md sections 2, 3, 7). Sizes follow from the shape and
// the Config only, never from the routing (DESIGN.md rule 1).
//
//   symmetric region   same size and layout on every rank; peers read or write it
//     x_staging            bf16 [T, H]       forward dispatch pulls x[src_rank][t] from here
//     combine              bf16 [T*k, H]     expert ranks push output rows into slot t*k+j
//     d_out_staging        bf16 [T, H]       backward dispatch pulls d_out[src_rank][t]
//     dx_routed            bf16 [T*k, H]     expert ranks push d_x rows into slot t*k+j
//     router_weights       f32  [T*k]        backward pulls w[src_rank][t*k+j]
//     router_weight_grads  f32  [T*k]        expert ranks push d_w[t*k+j]
//     expert_ids           i32  [2, T*k]     the id exchange, double-buffered by launch parity
//     team_flags           u32  [kMaxRanks]  team barrier: flags[q] counts arrivals from rank q
//     team_probe           u32  [2, 64, 16]  the team self-test's payload (src/cuda/comm)
//   local region       this rank only
//     schedule_table       i32  [max_schedule_rows]   (src/core/schedule_layout.hpp)
//     expert_counts        i32  [E_local]
//     expert_src_counts    i32  [E_local, W]
//     segment_starts       i32  [E_local + 1]
//     ring_plan            RingPlan
//     schedule_scratch     i32  [E_local, W * tiles_per_rank]   per-tile counts, then offsets
//     ring_buffer          bf16 [ring_rows, H]   pass 0's dispatched x rows (the forward context)
//     ready_counters       u32  [2, macrobatch_size / minibatch_size]   forward, backward
//     sync_state           SyncState (rank-local barrier counters and the bases of every counter)
//     error_record         DeviceErrorRecord
//
// Every buffer starts at a multiple of kBufferAlignment bytes (TMA and 16-byte vector accesses).
#pragma once

#include <cstdint>

#include "core/schedule_layout.hpp"
#include "cuda/comm/error_record.hpp"

namespace mok::plan {

inline constexpr std::int64_t kBufferAlignment = 256;
inline constexpr std::int64_t kProbeBlocks = 64;  // team self-test: blocks per rank it can check
inline constexpr std::int64_t kProbeWords = 16;

// Counters that let device barriers run without any host reset between launches. Each counter
// only grows; a launch reads the bases at its start, and the block that passes its last barrier
// stores the new bases. Peers' arrivals are counted in team_flags (symmetric region).
struct SyncState {
  std::uint32_t grid_arrive;   // rank-local grid barrier: +1 per block per barrier
  std::uint32_t grid_base;     // grid_arrive when the current launch began
  std::uint32_t team_base;     // every team_flags[q] when the current launch began
  std::uint32_t launch_count;  // launches that used the id exchange (its parity picks the buffer)
  std::uint32_t reserved[12];
};
static_assert(sizeof(SyncState) == 64);

struct PlanShape {
  std::int64_t num_tokens = 0;       // T
  std::int64_t hidden_size = 0;      // H
  std::int64_t topk = 0;             // k
  std::int64_t num_experts = 0;      // E
  int ep_size = 1;                   // W
  std::int64_t macrobatch_size = 0;  // ring rows
  std::int64_t minibatch_size = 0;   // rows per minibatch

  constexpr schedule::Shape schedule() const { return {num_tokens, topk, num_experts, ep_size}; }
};

struct Buffer {
  std::int64_t offset = 0;
  std::int64_t bytes = 0;
};

struct WorkspacePlan {
  // symmetric region
  Buffer x_staging, combine, d_out_staging, dx_routed, router_weights, router_weight_grads,
      expert_ids, team_flags, team_probe;
  std::int64_t symmetric_bytes = 0;
  // local region
  Buffer schedule_table, expert_counts, expert_src_counts, segment_starts, ring_plan,
      schedule_scratch, ring_buffer, ready_counters, sync_state, error_record;
  std::int64_t local_bytes = 0;
};

constexpr std::int64_t align_up(std::int64_t v) {
  return (v + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
}

// Appends a buffer of `bytes` to a region whose current end is `end`.
constexpr Buffer carve(std::int64_t& end, std::int64_t bytes) {
  const Buffer b{end, bytes};
  end = align_up(end + bytes);
  return b;
}

// Rows of a ring pass: macrobatch_size, but never more than the worst-case schedule table rounded
// up to whole minibatches (so a one-pass layer holds only what it can receive).
constexpr std::int64_t ring_rows(const PlanShape& s) {
  const std::int64_t table = schedule::round_up(schedule::max_schedule_rows(s.schedule()),
                                                s.minibatch_size);
  return table < s.macrobatch_size ? table : s.macrobatch_size;
}

constexpr WorkspacePlan make_workspace_plan(const PlanShape& s) {
  const schedule::Shape sched = s.schedule();
  const std::int64_t T = s.num_tokens, H = s.hidden_size, k = s.topk, W = s.ep_size;
  const std::int64_t E_local = sched.num_local_experts();
  const std::int64_t bf16 = 2, f32 = 4, i32 = 4, u32 = 4;
  WorkspacePlan p;
  std::int64_t end = 0;
  p.x_staging = carve(end, T * H * bf16);
  p.combine = carve(end, T * k * H * bf16);
  p.d_out_staging = carve(end, T * H * bf16);
  p.dx_routed = carve(end, T * k * H * bf16);
  p.router_weights = carve(end, T * k * f32);
  p.router_weight_grads = carve(end, T * k * f32);
  p.expert_ids = carve(end, 2 * T * k * i32);
  p.team_flags = carve(end, schedule::kMaxRanks * u32);
  p.team_probe = carve(end, 2 * kProbeBlocks * kProbeWords * u32);
  p.symmetric_bytes = end;

  end = 0;
  p.schedule_table = carve(end, schedule::max_schedule_rows(sched) * i32);
  p.expert_counts = carve(end, E_local * i32);
  p.expert_src_counts = carve(end, E_local * W * i32);
  p.segment_starts = carve(end, (E_local + 1) * i32);
  p.ring_plan = carve(end, sizeof(schedule::RingPlan));
  p.schedule_scratch = carve(end, E_local * W * sched.tiles_per_rank() * i32);
  p.ring_buffer = carve(end, ring_rows(s) * H * bf16);
  p.ready_counters = carve(end, 2 * (s.macrobatch_size / s.minibatch_size) * u32);
  p.sync_state = carve(end, sizeof(SyncState));
  p.error_record = carve(end, sizeof(comm::DeviceErrorRecord));
  p.local_bytes = end;
  return p;
}

enum class Region : std::uint8_t { symmetric, local };

// For printing (`mok run --plan`) and for tests that walk every buffer.
struct BufferInfo {
  const char* name;
  Region region;
  Buffer WorkspacePlan::*member;
  const char* what;
};

inline constexpr BufferInfo kBuffers[] = {
    {"x_staging", Region::symmetric, &WorkspacePlan::x_staging, "bf16 [T, H]"},
    {"combine", Region::symmetric, &WorkspacePlan::combine, "bf16 [T*k, H]"},
    {"d_out_staging", Region::symmetric, &WorkspacePlan::d_out_staging, "bf16 [T, H]"},
    {"dx_routed", Region::symmetric, &WorkspacePlan::dx_routed, "bf16 [T*k, H]"},
    {"router_weights", Region::symmetric, &WorkspacePlan::router_weights, "f32 [T*k]"},
    {"router_weight_grads", Region::symmetric, &WorkspacePlan::router_weight_grads, "f32 [T*k]"},
    {"expert_ids", Region::symmetric, &WorkspacePlan::expert_ids, "i32 [2, T*k]"},
    {"team_flags", Region::symmetric, &WorkspacePlan::team_flags, "u32 [64]"},
    {"team_probe", Region::symmetric, &WorkspacePlan::team_probe, "u32 [2, 64, 16]"},
    {"schedule_table", Region::local, &WorkspacePlan::schedule_table, "i32 [W*T*k + E_local*127]"},
    {"expert_counts", Region::local, &WorkspacePlan::expert_counts, "i32 [E_local]"},
    {"expert_src_counts", Region::local, &WorkspacePlan::expert_src_counts, "i32 [E_local, W]"},
    {"segment_starts", Region::local, &WorkspacePlan::segment_starts, "i32 [E_local + 1]"},
    {"ring_plan", Region::local, &WorkspacePlan::ring_plan, "RingPlan (8 x i32)"},
    {"schedule_scratch", Region::local, &WorkspacePlan::schedule_scratch,
     "i32 [E_local, W * ceil(T*k/512)]"},
    {"ring_buffer", Region::local, &WorkspacePlan::ring_buffer, "bf16 [ring_rows, H]"},
    {"ready_counters", Region::local, &WorkspacePlan::ready_counters,
     "u32 [2, macrobatch/minibatch]"},
    {"sync_state", Region::local, &WorkspacePlan::sync_state, "SyncState (64 B)"},
    {"error_record", Region::local, &WorkspacePlan::error_record, "DeviceErrorRecord (128 B)"},
};

}  // namespace mok::plan
