// The symmetric-memory team's device barrier: many rounds with random per-rank delays and a payload
// check (release/acquire ordering), and a deliberately missing rank that must end in a readable
// timeout report, not a hang. Skipped (visibly) without a GPU.
#include <chrono>

#include "layer_helpers.hpp"
#include "schedule_gpu_helpers.hpp"
#include "support/team_selftest.hpp"

namespace mok::test {
namespace {

using TeamGpu = GpuTest;

TEST_F(TeamGpu, BarrierManyRoundsWithRandomDelays) {
  for (int W : {1, 3, 8}) {
    Team team = Team::local_virtual(schedule_problem(W, 64, 2, 2 * W), Config{});
    for (int blocks : {1, 4}) {
      const std::int64_t bad = team_selftest(team, /*rounds=*/300, blocks, /*max_delay_ns=*/20000,
                                             test_seed() + W * 10 + blocks);
      EXPECT_EQ(bad, 0) << "W" << W << ", " << blocks << " blocks per rank: payload mismatches";
    }
    // The barrier state carries over between launches of different kernels and grid sizes.
    const std::int64_t bad = team_selftest(team, 50, 2, 0, test_seed());
    EXPECT_EQ(bad, 0);
    EXPECT_TRUE(team.impl().guards_intact());
  }
}

TEST_F(TeamGpu, MissingRankTimesOutWithReport) {
  const Problem p = schedule_problem(4, 64, 2, 8);
  Team team = Team::local_virtual(p, Config{}, {.barrier_timeout_ms = 200});
  const auto start = std::chrono::steady_clock::now();
  std::string report;
  try {
    (void)team_selftest(team, 10, 2, 0, test_seed(), /*missing_rank=*/2);
  } catch (const Error& e) {
    report = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ mok ] after %.2f s the report reads: %s\n", seconds, report.c_str());
  for (const char* part :
       {"timed out on rank 0", "team barrier flag[2]", "arrivals from rank 2", "expected >= 2",
        "seen 0", "timeout 200.0 ms", "rank 2 did not arrive", "2 more rank"}) {
    EXPECT_NE(report.find(part), std::string::npos) << "'" << part << "' not in: " << report;
  }
  EXPECT_LT(seconds, 5.0) << "the timeout must end the wait promptly";
  // The team now refuses work until reset, then works again.
  DeviceIds ids(4, 64, 2);
  expect_error([&] { build_schedule(team, ids.views()); }, {"Team::reset()"});
  team.reset();
  EXPECT_EQ(team_selftest(team, 100, 2, 5000, test_seed()), 0);
  std::mt19937_64 rng(test_seed());
  std::vector<std::vector<std::int64_t>> host;
  for (int r = 0; r < 4; ++r) host.push_back(make_routing(RoutingKind::uniform, 64, 2, 8, 0, rng));
  ids.upload(host);
  build_schedule(team, ids.views());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(compare_with_twin(team, host), "");
  EXPECT_TRUE(team.impl().guards_intact());
}

}  // namespace
}  // namespace mok::test
