// build_schedule on the GPU: bitwise equal to the host twin for W virtual ranks over the issue's
// grid, under CUDA-graph capture and replay, with external peer pointers, and with bad ids
// (recorded, raised, never written out of bounds). Skipped (visibly) without a GPU.
#include <chrono>
#include <cstring>

#include "layer_helpers.hpp"
#include "schedule_gpu_helpers.hpp"

namespace mok::test {
namespace {

using ScheduleGpu = GpuTest;

// Poisons every output of every rank, so an entry the kernel forgot shows up.
void poison(const Team& team, cudaStream_t stream = nullptr) {
  for (int r = team.first_rank(); r < team.first_rank() + team.num_local_ranks(); ++r) {
    const ScheduleViews v = team.schedule(r);
    for (const TensorView* t :
         {&v.table, &v.expert_counts, &v.expert_src_counts, &v.segment_starts, &v.ring_plan}) {
      EXPECT_EQ(cudaMemsetAsync(t->data, 0x7f, static_cast<std::size_t>(t->numel()) * 4, stream),
                cudaSuccess);
    }
  }
}

std::vector<std::vector<std::int64_t>> routings(RoutingKind kind, const Problem& p,
                                                std::mt19937_64& rng) {
  const std::int64_t one = std::uniform_int_distribution<std::int64_t>(0, p.num_experts - 1)(rng);
  std::vector<std::vector<std::int64_t>> ids;
  for (int r = 0; r < p.ep_size; ++r) {
    ids.push_back(make_routing(kind, p.num_tokens, p.topk, p.num_experts, one, rng));
  }
  return ids;
}

TEST_F(ScheduleGpu, MatchesHostTwinOverGrid) {
  std::mt19937_64 rng(test_seed() + 10);
  int checked = 0;
  for (const GridCase& c : schedule_grid()) {
    const Problem p = schedule_problem(c.W, c.T, c.k, c.E);
    Config config;
    config.macrobatch_size = c.macrobatch;
    config.minibatch_size = c.minibatch;
    Team team = Team::local_virtual(p, config);
    DeviceIds ids(c.W, c.T, c.k);
    for (RoutingKind kind : kAllRoutings) {
      const auto host = routings(kind, p, rng);
      ids.upload(host);
      poison(team);
      build_schedule(team, ids.views());
      MOK_CUDA_OK(cudaDeviceSynchronize());
      ASSERT_EQ(compare_with_twin(team, host), "") << case_name(c, kind);
      ++checked;
    }
    team.check_errors();
    ASSERT_TRUE(team.impl().guards_intact()) << case_name(c, RoutingKind::uniform);
    ASSERT_TRUE(ids.guards_intact());
  }
  std::printf("[ mok ] %d (case, routing) launches checked bitwise, all ranks\n", checked);
}

// Nothing in build_schedule synchronizes with the host: it captures into a graph (global capture
// mode refuses any synchronizing call), and replays of that graph over new routings stay equal.
TEST_F(ScheduleGpu, GraphCaptureAndReplayWithNewRoutings) {
  std::mt19937_64 rng(test_seed() + 20);
  for (auto [W, T, k, E] :
       {std::tuple<int, std::int64_t, std::int64_t, std::int64_t>{4, 4096, 8, 64},
        {3, 7, 2, 6},
        {8, 4096, 8, 256}}) {
    const Problem p = schedule_problem(W, T, k, E);
    Config config;
    config.macrobatch_size = 2048;
    config.minibatch_size = 512;
    Team team = Team::local_virtual(p, config);
    DeviceIds ids(W, T, k);
    cudaStream_t stream;
    MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    MOK_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    build_schedule(team, ids.views(), {.stream = stream});
    MOK_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    int replay = 0;
    for (RoutingKind kind : kAllRoutings) {
      const auto host = routings(kind, p, rng);
      ids.upload(host, stream);
      poison(team, stream);
      MOK_CUDA_OK(cudaGraphLaunch(exec, stream));
      MOK_CUDA_OK(cudaStreamSynchronize(stream));
      ASSERT_EQ(compare_with_twin(team, host), "")
          << "W" << W << " T" << T << " replay " << replay << " " << routing_kind_name(kind);
      // Interleave a direct call: graph replays and calls share the device-side barrier state.
      if (replay++ % 2 == 1) {
        build_schedule(team, ids.views(), {.stream = stream});
        MOK_CUDA_OK(cudaStreamSynchronize(stream));
        ASSERT_EQ(compare_with_twin(team, host), "") << "direct call after replay " << replay;
      }
    }
    team.check_errors();
    MOK_CUDA_OK(cudaGraphExecDestroy(exec));
    MOK_CUDA_OK(cudaGraphDestroy(graph));
    MOK_CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Ids outside [-1, E): treated as unused, never written out of bounds, recorded on the device and
// raised by the next call on the team (or at the call with synchronous validation).
TEST_F(ScheduleGpu, BadIdsAreRecordedAndRaised) {
  std::mt19937_64 rng(test_seed() + 30);
  const Problem p = schedule_problem(2, 7, 2, 8);
  Team team = Team::local_virtual(p, Config{});
  DeviceIds ids(2, 7, 2);
  const auto good = routings(RoutingKind::uniform, p, rng);
  auto bad = good;
  bad[1][3 * 2 + 1] = 300;
  bad[1][5 * 2 + 0] = (std::int64_t{1} << 32) + 1;  // aliases expert 1 if truncated to int32
  bad[0][6 * 2 + 1] = 8;
  auto bad_rank1 = good;
  bad_rank1[1][3 * 2 + 1] = 300;
  bad_rank1[1][5 * 2 + 0] = std::numeric_limits<std::int64_t>::min();

  ids.upload(bad);
  poison(team);
  build_schedule(team, ids.views());  // asynchronous: nothing known yet
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(compare_with_twin(team, bad), "") << "bad slots must be treated as unused";
  EXPECT_TRUE(team.impl().guards_intact());
  EXPECT_TRUE(ids.guards_intact());
  expect_error([&] { team.check_errors(); }, {"topk_experts[6, 1] of rank 0", "[-1, 8)", "got 8",
                                              "found on the device", "1 more rank"});
  EXPECT_NO_THROW(team.check_errors());  // reported once

  // The next call raises it.
  ids.upload(bad_rank1);
  build_schedule(team, ids.views());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  ids.upload(good);
  expect_error([&] { build_schedule(team, ids.views()); },
               {"topk_experts[3, 1] of rank 1", "got 300"});
  build_schedule(team, ids.views());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(compare_with_twin(team, good), "");
  EXPECT_NO_THROW(team.check_errors());

  // Synchronous validation raises at the faulty call itself.
  ids.upload(bad_rank1);
  expect_error([&] { build_schedule(team, ids.views(), {.synchronous_validation = true}); },
               {"topk_experts[3, 1] of rank 1", "got 300"});
  ids.upload(good);
  EXPECT_NO_THROW(build_schedule(team, ids.views(), {.synchronous_validation = true}));
  EXPECT_EQ(compare_with_twin(team, good), "");
  EXPECT_TRUE(team.impl().guards_intact());
  EXPECT_TRUE(ids.guards_intact());

  // Argument errors name the argument.
  expect_error([&] { build_schedule(team, ids.views(0, 1)); },
               {"topk_experts", "2 tensors", "got 1"});
}

// The external-pointer backend: two "processes" (two teams of one rank each) on one GPU, whose
// symmetric regions the caller allocated, launched on two streams at once.
TEST_F(ScheduleGpu, ExternalPointersTwoRanks) {
  std::mt19937_64 rng(test_seed() + 40);
  Config config;
  const Problem p0 = schedule_problem(2, 4096, 8, 32, 0), p1 = schedule_problem(2, 4096, 8, 32, 1);
  const auto bytes = static_cast<std::size_t>(symmetric_workspace_bytes(p0, config));
  DeviceBuffer<std::uint8_t> region0(bytes), region1(bytes);
  void* const regions[2] = {region0.get(), region1.get()};
  TeamOptions options{.barrier_timeout_ms = 5000};
  {
    Team t0 = Team::external(p0, config, {.rank = 0, .symmetric_bases = {regions[0], regions[1]}},
                             options);
    Team t1 = Team::external(p1, config, {.rank = 1, .symmetric_bases = {regions[0], regions[1]}},
                             options);
    DeviceIds ids(2, 4096, 8);
    cudaStream_t s[2];
    MOK_CUDA_OK(cudaStreamCreateWithFlags(&s[0], cudaStreamNonBlocking));
    MOK_CUDA_OK(cudaStreamCreateWithFlags(&s[1], cudaStreamNonBlocking));
    for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::zipf, RoutingKind::unused_slots}) {
      const auto host = routings(kind, p0, rng);
      ids.upload(host);
      MOK_CUDA_OK(cudaDeviceSynchronize());
      build_schedule(t0, ids.views(0, 1), {.stream = s[0]});
      build_schedule(t1, ids.views(1, 1), {.stream = s[1]});
      MOK_CUDA_OK(cudaDeviceSynchronize());
      ASSERT_EQ(compare_with_twin(t0, host), "") << routing_kind_name(kind);
      ASSERT_EQ(compare_with_twin(t1, host), "") << routing_kind_name(kind);
    }
    t0.check_errors();
    t1.check_errors();
    EXPECT_TRUE(t0.impl().guards_intact());
    MOK_CUDA_OK(cudaStreamDestroy(s[0]));
    MOK_CUDA_OK(cudaStreamDestroy(s[1]));
    expect_error(
        [&] { (void)Team::external(p0, config, {.rank = 0, .symmetric_bases = {regions[0]}}); },
        {"ExternalTeamPointers.symmetric_bases", "2 pointers", "got 1"});
    expect_error(
        [&] {
          (void)Team::external(
              p0, config,
              {.rank = 0, .symmetric_bases = {static_cast<char*>(regions[0]) + 16, regions[1]}});
        },
        {"symmetric_bases[0]", "aligned to 256"});
    expect_error(
        [&] {
          (void)Team::external(p0, config,
                               {.rank = 1, .symmetric_bases = {regions[0], regions[1]}});
        },
        {"ExternalTeamPointers.rank", "problem.ep_rank = 0"});
  }
}

}  // namespace
}  // namespace mok::test
