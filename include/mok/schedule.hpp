// The expert-parallel schedule table and the symmetric-memory team it is exchanged through
// (docs/architecture.md, "The schedule table" and "Expert parallelism").
//
// CPU (always built; the oracle, and what `mok.ops.build_schedule` runs on CPU tensors):
//
//   mok::ScheduleViews out = ...;   // int32 CPU tensors, shaped as ScheduleViews' comment says
//   mok::build_schedule_cpu(problem, config, {ids_rank0, ids_rank1, ...}, out);  // rank = ep_rank
//
// CUDA: a Team holds every rank's workspace (or this rank's, with peers' symmetric pointers):
//
//   auto team = mok::Team::local_virtual(problem, config);     // W ranks on one GPU, one launch
//   mok::build_schedule(team, {ids_rank0, ..., ids_rank{W-1}}, {.stream = s});
//   mok::ScheduleViews v = team.schedule(rank);                // device int32 views
//
//   auto team = mok::Team::external(problem, config, {.rank = r, .symmetric_bases = peers});
//   mok::build_schedule(team, {ids_this_rank}, {.stream = s});
//
// Nothing in build_schedule synchronizes with the host or allocates: it can be captured in a CUDA
// graph. Ids outside [-1, E) are treated as unused slots; the device records the first one
// (rank, token, slot, value) and the next call on the team raises it as a mok::Error, or the
// faulty call itself with ScheduleOptions::synchronous_validation.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/problem.hpp"
#include "mok/tensor.hpp"

namespace mok {

// GEMM tile height: every expert segment of the table starts at a multiple of this.
int schedule_segment_alignment();

// Rows of the schedule table for `p` (worst case: ep_size * T * k + E_local * (alignment - 1)).
std::int64_t schedule_capacity_rows(const Problem& p);

// One rank's schedule, all int32, row-major contiguous (src/core/schedule_layout.hpp has the
// format):
//   table [capacity rows], expert_counts [E_local], expert_src_counts [E_local, W],
//   segment_starts [E_local + 1], ring_plan [8] = {total_rows, num_passes, macrobatch_rows,
//   minibatch_rows, minibatches_per_pass, num_minibatches, last_pass_rows, 0}.
struct ScheduleViews {
  TensorView table;
  TensorView expert_counts;
  TensorView expert_src_counts;
  TensorView segment_starts;
  TensorView ring_plan;
};
inline constexpr int kRingPlanInts = 8;

// Schedule of rank `p.ep_rank` from every rank's topk_experts (int64 [T, k], on the CPU; one view
// per rank, in rank order). Raises mok::Error naming rank, token, slot and value for an id
// outside [-1, E).
void build_schedule_cpu(const Problem& p, const Config& config,
                        std::span<const TensorView> topk_experts_per_rank,
                        const ScheduleViews& out);

// Bytes of one rank's two workspace regions (src/core/workspace_plan.hpp lists the buffers).
std::int64_t symmetric_workspace_bytes(const Problem& p, const Config& config);
std::int64_t local_workspace_bytes(const Problem& p, const Config& config);

struct TeamOptions {
  int device_index = 0;
  // Every device-side wait gives up after this long and reports which flag stalled.
  std::uint64_t barrier_timeout_ms = 10000;
};

// Peer addresses for a team whose ranks live in different processes (e.g. PyTorch symmetric
// memory). Each rank's symmetric region must be symmetric_workspace_bytes() long; this rank's
// team_flags must not be signalled by a peer before this rank's Team exists (construct every
// rank's Team, then barrier on the host, then call build_schedule).
struct ExternalTeamPointers {
  int rank = 0;
  std::vector<void*> symmetric_bases;  // ep_size entries; [rank] is this rank's own region
};

// A symmetric-memory team: rank(s), world size, peer base addresses, the workspaces of the ranks
// this process runs, and their device error records.
class Team {
 public:
  // W = problem.ep_size ranks in this process on one GPU; their "peer" addresses point into the
  // same device, and every launch covers all of them (a grid dimension per rank).
  static Team local_virtual(const Problem& p, const Config& config,
                            const TeamOptions& options = {});
  // One rank (problem.ep_rank must equal pointers.rank); peers' regions given by the caller.
  // Allocates this rank's local region.
  static Team external(const Problem& p, const Config& config, const ExternalTeamPointers& pointers,
                       const TeamOptions& options = {});

  Team(Team&&) noexcept;
  Team& operator=(Team&&) noexcept;
  ~Team();

  const Problem& problem() const;
  const Config& config() const;
  int world_size() const;
  int first_rank() const;       // the first rank this process runs
  int num_local_ranks() const;  // ranks this process runs: W (virtual) or 1 (external)

  // Device views of the schedule of rank `rank` (one of this process's ranks).
  ScheduleViews schedule(int rank) const;

  // Raises the first device error (bad expert id, barrier timeout) that the mirror shows, then
  // clears it (the device-side record in the order of `stream`, a cudaStream_t: the caller's, so
  // the clear never waits for or races with work on other streams). Every team call does this
  // first. After a timeout, the barrier counters of every rank are inconsistent: the team refuses
  // further calls until reset() (on every rank).
  void check_errors(void* stream = nullptr);
  // Zeroes this process's barrier state and error records (waits for the device).
  void reset();

  struct Impl;
  Impl& impl();
  const Impl& impl() const;

 private:
  explicit Team(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct ScheduleOptions {
  void* stream = nullptr;  // cudaStream_t; null = the legacy default stream
  // Wait for the kernel and raise a bad id at this call (not allowed during graph capture).
  bool synchronous_validation = false;
};

// Builds the schedule of every rank this process runs, from their topk_experts (int64 [T, k],
// CUDA tensors on the team's device, one per local rank in rank order).
void build_schedule(Team& team, std::span<const TensorView> topk_experts,
                    const ScheduleOptions& options = {});

}  // namespace mok
