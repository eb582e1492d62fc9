// The team on the device: one rank's view of the symmetric regions inside a launch, the barriers
// across ranks and across the blocks of one rank, and the error record they report to.
//
// A launch runs `gridDim.y` ranks (all W local virtual ranks, or this process's one rank), each
// with `gridDim.x` blocks. Every block of every rank must be resident (cooperative launch): a
// barrier waits for all of them. Every wait is bounded by TeamArgs::timeout_ns; a wait that gives
// up records rank, flag, expected and seen, and the caller returns instead of hanging.
//
// Barrier counters only grow (no reset between launches, so graph replays need no host work):
//   team barrier   each block adds 1 to flags[my_rank] in every peer's team_flags; a round is
//                  complete when all W of my flags reach team_base + round * gridDim.x
//   grid barrier   each block of a rank adds 1 to that rank's sync_state.grid_arrive; complete at
//                  grid_base + round * gridDim.x
// A launch reads the bases at its start; finish() (called by every block after its last
// barrier) lets block 0 store the advanced bases. A launch that timed out leaves the counters
// inconsistent: the host then refuses the team until Team::reset().
#pragma once

#include <cstdint>

#include "core/workspace_plan.hpp"
#include "core/error_record.hpp"
#include "cuda/comm/team_args.hpp"
#include "cuda/ptx/flags.cuh"

namespace mok::comm {

// Copies `r` into the device record and the host mirror (null: none); the mirror's `kind` is
// written last (after a system fence), so the host never reads a half-written record. The caller
// owns the record: it won the compare-and-swap of `record->kind` from 0.
__device__ inline void publish_record(DeviceErrorRecord* record, DeviceErrorRecord* mirror,
                                      const DeviceErrorRecord& r) {
  DeviceErrorRecord* d = record;
  d->rank = r.rank, d->token = r.token, d->value = r.value, d->slot = r.slot;
  d->flag = r.flag, d->flag_index = r.flag_index, d->expected = r.expected, d->seen = r.seen;
  d->block = r.block, d->waited_ns = r.waited_ns;
  if (mirror == nullptr) return;
  volatile DeviceErrorRecord* m = mirror;
  m->rank = r.rank, m->token = r.token, m->value = r.value, m->slot = r.slot;
  m->flag = r.flag, m->flag_index = r.flag_index, m->expected = r.expected, m->seen = r.seen;
  m->block = r.block, m->waited_ns = r.waited_ns;
  __threadfence_system();
  m->kind = r.kind;
  __threadfence_system();
}

// A bounded wait on `flag`[index] gave up after `waited` ns, having seen `seen` where it waited
// for `expected`: the rank's record says so, unless an earlier error is still unreported.
__device__ inline void report_flag_timeout(DeviceErrorRecord* record, DeviceErrorRecord* mirror,
                                           int rank, FlagId flag, int index,
                                           std::uint32_t expected, std::uint32_t seen,
                                           std::uint64_t waited) {
  if (atomicCAS(&record->kind, 0u, static_cast<std::uint32_t>(ErrorKind::barrier_timeout)) != 0u) {
    return;
  }
  DeviceErrorRecord r{};
  r.kind = static_cast<std::uint32_t>(ErrorKind::barrier_timeout);
  r.rank = rank;
  r.flag = static_cast<std::uint32_t>(flag);
  r.flag_index = index;
  r.expected = expected;
  r.seen = seen;
  r.block = blockIdx.x;
  r.waited_ns = waited;
  publish_record(record, mirror, r);
}

template <ptx::Scope Scope>
class RankTeam {
 public:
  __device__ explicit RankTeam(const TeamArgs& args)
      : args_(args),
        rank_(args.first_rank + static_cast<int>(blockIdx.y)),
        local_(args.local[blockIdx.y]),
        mirror_(args.mirror[blockIdx.y]) {
    sync_ = reinterpret_cast<plan::SyncState*>(local_ + args.plan.sync_state.offset);
    record_ = reinterpret_cast<DeviceErrorRecord*>(local_ + args.plan.error_record.offset);
    // NOTES: read before this block's first barrier; block 0 rewrites them only after the last
    // barrier, which every block must have reached, so all blocks see the same bases.
    grid_base_ = sync_->grid_base;
    team_base_ = sync_->team_base;
    launch_count_ = sync_->launch_count;
  }

  __device__ int rank() const { return rank_; }
  __device__ int world_size() const { return args_.world_size; }
  __device__ std::uint32_t launch_count() const { return launch_count_; }
  __device__ DeviceErrorRecord* record() const { return record_; }

  template <typename T>
  __device__ T* local(const plan::Buffer& b) const {
    return reinterpret_cast<T*>(local_ + b.offset);
  }
  template <typename T>
  __device__ T* symmetric(int peer, const plan::Buffer& b) const {
    return reinterpret_cast<T*>(args_.symmetric[peer] + b.offset);
  }

  // All blocks of all ranks. Call from every thread of every block; false: a wait timed out (or
  // another block of this rank gave up) and the caller must return.
  __device__ bool team_barrier() {
    ++team_rounds_;
    __syncthreads();
    int ok = 1;
    if (threadIdx.x == 0) {
      // NOTES: the release reduction orders every write this block made before bar.sync (the
      // barrier makes them visible to thread 0 first; release is cumulative).
      for (int q = 0; q < args_.world_size; ++q) {
        ptx::red_release_add<Scope>(team_flag(q, rank_), 1u);
      }
      const std::uint32_t target = team_base_ + team_rounds_ * gridDim.x;
      for (int q = 0; q < args_.world_size && ok; ++q) {
        ok = wait_at_least<Scope>(team_flag(rank_, q), target, FlagId::team_barrier, q);
      }
    }
    return __syncthreads_and(ok) != 0;
  }

  // All blocks of this rank (one GPU: gpu scope).
  __device__ bool grid_barrier() {
    ++grid_rounds_;
    __syncthreads();
    int ok = 1;
    if (threadIdx.x == 0) {
      ptx::red_release_add<ptx::Scope::gpu>(&sync_->grid_arrive, 1u);
      const std::uint32_t target = grid_base_ + grid_rounds_ * gridDim.x;
      ok = wait_at_least<ptx::Scope::gpu>(&sync_->grid_arrive, target, FlagId::rank_grid, 0);
    }
    return __syncthreads_and(ok) != 0;
  }

  // After this block's last barrier: block 0 stores the advanced bases (and counts a launch that
  // used the id exchange).
  __device__ void finish(bool count_launch) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    sync_->grid_base = grid_base_ + grid_rounds_ * gridDim.x;
    sync_->team_base = team_base_ + team_rounds_ * gridDim.x;
    if (count_launch) sync_->launch_count = launch_count_ + 1;
  }

  // A bad expert id at `slot_index` (t * k + j) of this rank's input: keep the smallest.
  __device__ void note_bad_slot(std::int64_t slot_index) {
    atomicMin(reinterpret_cast<unsigned long long*>(&record_->bad_slot_key),
              static_cast<unsigned long long>(slot_index));
  }

  // After a barrier that follows every note_bad_slot of this launch, by one thread of one block:
  // turn the smallest bad slot into the (sticky) record and publish it to the host.
  __device__ void publish_bad_slot(const std::int64_t* ids, std::int64_t topk) {
    // NOTES: an atomic read: the other blocks' atomicMin results, ordered before this by the team
    // barrier, without relying on a plain load missing a stale L1 line.
    const std::uint64_t key =
        atomicOr(reinterpret_cast<unsigned long long*>(&record_->bad_slot_key), 0ull);
    if (key == kNoBadSlot) return;
    record_->bad_slot_key = kNoBadSlot;  // the next launch starts clean
    if (atomicCAS(&record_->kind, 0u, static_cast<std::uint32_t>(ErrorKind::bad_expert_id)) != 0u) {
      return;  // an earlier error is still unreported: it wins
    }
    DeviceErrorRecord r{};
    r.kind = static_cast<std::uint32_t>(ErrorKind::bad_expert_id);
    r.rank = rank_;
    r.token = static_cast<std::int64_t>(key) / topk;
    r.slot = static_cast<std::int32_t>(static_cast<std::int64_t>(key) % topk);
    r.value = ids[key];
    r.block = blockIdx.x;
    publish(r);
  }

 private:
  __device__ std::uint32_t* team_flag(int owner, int index) const {
    return symmetric<std::uint32_t>(owner, args_.plan.team_flags) + index;
  }

  __device__ bool aborted() const {
    return ptx::ld_relaxed<ptx::Scope::gpu>(&record_->kind) ==
           static_cast<std::uint32_t>(ErrorKind::barrier_timeout);
  }

  template <ptx::Scope WaitScope>
  __device__ bool wait_at_least(const std::uint32_t* flag, std::uint32_t target, FlagId id,
                                int index) {
    std::uint32_t seen = 0;
    std::uint64_t waited = 0;
    if (ptx::wait_at_least<WaitScope>(
            flag, target, args_.timeout_ns, [&] { return aborted(); }, seen, waited)) {
      return true;
    }
    if (waited > args_.timeout_ns) report_timeout(id, index, target, seen, waited);
    return false;
  }

  __device__ void report_timeout(FlagId id, int index, std::uint32_t expected, std::uint32_t seen,
                                 std::uint64_t waited) {
    report_flag_timeout(record_, mirror_, rank_, id, index, expected, seen, waited);
  }

  __device__ void publish(const DeviceErrorRecord& r) { publish_record(record_, mirror_, r); }

  const TeamArgs& args_;
  int rank_;
  std::uint8_t* local_;
  DeviceErrorRecord* mirror_;
  plan::SyncState* sync_;
  DeviceErrorRecord* record_;
  std::uint32_t grid_base_, team_base_, launch_count_;
  std::uint32_t grid_rounds_ = 0, team_rounds_ = 0;
};

}  // namespace mok::comm
