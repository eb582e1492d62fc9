// One team barrier as a launch of its own: the ordering point between a call's phases when the
// ranks are in different processes (src/cuda/layer/layer.cu says which phases).
#include "cuda/comm/team.cuh"
#include "cuda/comm/team.hpp"

namespace mok {
namespace {

// One block per local rank. NOTES: the fence makes every write the previous launches of this
// stream made (rows pushed into peers' regions over NVLink, staged rows) visible at system scope
// before this rank's arrival; the barrier's release reduction then publishes them with it.
template <ptx::Scope Scope>
__global__ void __launch_bounds__(32)
    team_barrier_kernel(const __grid_constant__ comm::TeamArgs args) {
  comm::RankTeam<Scope> team(args);
  if (threadIdx.x == 0) __threadfence_system();
  if (!team.team_barrier()) return;  // timed out: recorded, the host raises it
  team.finish(/*count_launch=*/false);
}

}  // namespace

cudaError_t launch_team_barrier(const Team::Impl& t, cudaStream_t stream) {
  const comm::TeamArgs args = t.team_args();
  const dim3 grid(1, static_cast<unsigned>(t.num_local_ranks), 1);
  if (t.virtual_ranks) {
    team_barrier_kernel<ptx::Scope::gpu><<<grid, 32, 0, stream>>>(args);
  } else {
    team_barrier_kernel<ptx::Scope::sys><<<grid, 32, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace mok
