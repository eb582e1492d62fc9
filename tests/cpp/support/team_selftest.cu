// The team barrier exercised on its own: many rounds, random delays, and a payload check that
// shows whether release/acquire ordered the data with the flags.
#include "support/team_selftest.hpp"

#include <algorithm>
#include <vector>

#include "cuda/comm/team.cuh"

namespace mok::test {
namespace {

constexpr int kThreads = 256;
constexpr int kProbeBlocks = 64;  // blocks per rank the test can check
constexpr int kProbeWords = 16;   // payload words a block writes each round

__device__ __forceinline__ std::uint32_t payload(int round, int rank, int block, int word) {
  return (static_cast<std::uint32_t>(round) * 2654435761u) ^
         (static_cast<std::uint32_t>(rank) << 20) ^ (static_cast<std::uint32_t>(block) << 8) ^
         static_cast<std::uint32_t>(word);
}

template <ptx::Scope Scope>
__global__ void __launch_bounds__(kThreads)
    team_selftest_kernel(const __grid_constant__ comm::TeamArgs args, int rounds,
                         const std::uint32_t* delays_ns, int missing_rank, std::uint32_t* probe,
                         unsigned long long* mismatches) {
  comm::RankTeam<Scope> team(args);
  if (team.rank() == missing_rank) return;  // the deliberately absent rank
  // probe[rank][parity][block][word]: every rank's payload, in one allocation all ranks see (one
  // process, one device).
  auto payload_of = [&](int rank) { return probe + rank * 2 * kProbeBlocks * kProbeWords; };
  const int blocks = static_cast<int>(gridDim.x);
  for (int round = 1; round <= rounds; ++round) {
    if (threadIdx.x == 0) {
      // delays_ns: [rank][round][block]
      const std::uint32_t delay =
          delays_ns[(static_cast<std::int64_t>(team.rank()) * rounds + (round - 1)) * blocks +
                    blockIdx.x];
      const std::uint64_t until = ptx::global_timer_ns() + delay;
      while (ptx::global_timer_ns() < until) {
      }
    }
    __syncthreads();
    // payload[parity][block][word]: a peer can be at most one round ahead, so parity suffices.
    const int parity = round & 1;
    std::uint32_t* mine =
        payload_of(team.rank()) + (parity * kProbeBlocks + blockIdx.x) * kProbeWords;
    if (threadIdx.x < kProbeWords)
      mine[threadIdx.x] = payload(round, team.rank(), blockIdx.x, threadIdx.x);
    if (!team.team_barrier()) return;
    unsigned long long bad = 0;
    const int words = args.world_size * blocks * kProbeWords;
    for (int i = threadIdx.x; i < words; i += kThreads) {
      const int peer = i / (blocks * kProbeWords);
      const int block = (i / kProbeWords) % blocks;
      const int word = i % kProbeWords;
      if (peer == missing_rank) continue;
      const volatile std::uint32_t* theirs =
          payload_of(peer) + (parity * kProbeBlocks + block) * kProbeWords;
      bad += theirs[word] != payload(round, peer, block, word);
    }
    if (bad) atomicAdd(mismatches, bad);
  }
  team.finish(/*count_launch=*/false);
}

}  // namespace

std::int64_t team_selftest(Team& team, int rounds, int blocks_per_rank, std::uint32_t max_delay_ns,
                           std::uint64_t seed, int missing_rank) {
  Team::Impl& t = team.impl();
  t.make_current();
  t.raise_device_errors(nullptr);
  if (blocks_per_rank < 1 || blocks_per_rank > kProbeBlocks) {
    throw Error("blocks_per_rank", "in [1, " + to_text(kProbeBlocks) + "]",
                to_text(blocks_per_rank));
  }
  if (rounds < 1) throw Error("rounds", "at least 1", to_text(rounds));
  // Delays: splitmix64 stream, [rank][round][block].
  std::vector<std::uint32_t> delays(static_cast<std::size_t>(t.world_size) * rounds *
                                    blocks_per_rank);
  std::uint64_t state = seed;
  for (auto& d : delays) {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    d = max_delay_ns ? static_cast<std::uint32_t>(z % (std::uint64_t{max_delay_ns} + 1)) : 0u;
  }
  std::uint32_t* d_delays = nullptr;
  std::uint32_t* d_probe = nullptr;
  unsigned long long* d_bad = nullptr;
  const std::size_t probe_words = std::size_t(t.world_size) * 2 * kProbeBlocks * kProbeWords;
  cuda_check(cudaMalloc(&d_delays, delays.size() * sizeof(std::uint32_t)), "cudaMalloc");
  cuda_check(cudaMalloc(&d_probe, probe_words * sizeof(std::uint32_t)), "cudaMalloc");
  cuda_check(cudaMalloc(&d_bad, sizeof(unsigned long long)), "cudaMalloc");
  cudaError_t err = cudaMemcpy(d_delays, delays.data(), delays.size() * sizeof(std::uint32_t),
                               cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemset(d_probe, 0, probe_words * sizeof(std::uint32_t));
  if (err == cudaSuccess) err = cudaMemset(d_bad, 0, sizeof(unsigned long long));

  const comm::TeamArgs args = t.team_args();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks_per_rank, t.num_local_ranks, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  if (err == cudaSuccess) {
    err = t.virtual_ranks ? cudaLaunchKernelEx(&config, team_selftest_kernel<ptx::Scope::gpu>, args,
                                               rounds, static_cast<const std::uint32_t*>(d_delays),
                                               missing_rank, d_probe, d_bad)
                          : cudaLaunchKernelEx(&config, team_selftest_kernel<ptx::Scope::sys>, args,
                                               rounds, static_cast<const std::uint32_t*>(d_delays),
                                               missing_rank, d_probe, d_bad);
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  unsigned long long bad = 0;
  if (err == cudaSuccess) err = cudaMemcpy(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost);
  cudaFree(d_delays);
  cudaFree(d_probe);
  cudaFree(d_bad);
  cuda_check(err, "team self-test");
  t.raise_device_errors(nullptr);
  return static_cast<std::int64_t>(bad);
}

}  // namespace mok::test
