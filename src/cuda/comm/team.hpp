// The team on the host: workspace allocation for local virtual ranks, external peer pointers,
// the host-mapped error mirrors and their reporting. Internal (the public face is mok::Team in
// include/mok/schedule.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/error_record.hpp"
#include "core/workspace_plan.hpp"
#include "cuda/comm/team_args.hpp"
#include "mok/schedule.hpp"

namespace mok {

// Throws mok::Error naming `what` and the CUDA error.
void cuda_check(cudaError_t e, const char* what);

struct Team::Impl {
  // Guard zones around every region this process allocates: tests check them for stray writes.
  static constexpr std::int64_t kGuardBytes = 64 * 1024;
  static constexpr unsigned char kGuardByte = 0xA5;

  Problem problem;
  Config config;
  TeamOptions options;
  bool virtual_ranks = true;
  int world_size = 1;
  int first_rank = 0;
  int num_local_ranks = 1;
  int device = 0;
  int sm_count = 0;
  plan::WorkspacePlan plan;

  void* allocation = nullptr;  // owned device memory (regions and guards)
  std::int64_t allocation_bytes = 0;
  std::vector<std::uint8_t*> symmetric;        // world_size: every rank's symmetric region
  std::vector<std::uint8_t*> local;            // num_local_ranks: this process's local regions
  comm::DeviceErrorRecord* mirrors = nullptr;  // host-mapped, num_local_ranks
  struct Guard {
    const void* ptr;
    std::int64_t bytes;
  };
  std::vector<Guard> guards;

  bool broken = false;                // a barrier timed out: the counters are inconsistent
  bool pending_device_clear = false;  // a reported error whose device record is not yet cleared
  int schedule_blocks_per_rank = 0;   // chosen when the team is created

  ~Impl();

  // Makes the team's device current (only when it is not: no call during graph capture).
  void make_current() const;

  // Arguments of a team launch covering every local rank.
  comm::TeamArgs team_args() const;

  // Raises (and clears) the first reported device error, if any; refuses a broken team.
  // `stream` orders the device-side clear; during graph capture the clear is deferred.
  void raise_device_errors(cudaStream_t stream);

  // Zeroes the barrier state, error records and mirrors of this process's ranks.
  void reset_state();

  // Whether every guard zone still holds kGuardByte (waits for the device).
  bool guards_intact() const;
};

// Configures the build_schedule kernel for this team (shared memory, blocks per rank); called
// once, when the team is created (src/cuda/kernels/schedule.cu).
void prepare_build_schedule(Team::Impl& t);

// A description of the device error for the host (one line).
std::string describe_device_error(const comm::DeviceErrorRecord& r, std::uint64_t timeout_ns);

// Enqueues one team barrier on `stream`: every local rank waits (bounded, reported) until every
// rank of the team has arrived, each after all its earlier work on its stream. Capturable.
cudaError_t launch_team_barrier(const Team::Impl& t, cudaStream_t stream);

}  // namespace mok
