// The schedule's host side: layout, workspace plan, ring plan, the host twin against a direct
// re-derivation over the grid of routings, and the CPU entry point.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <tuple>

#include "core/schedule_host.hpp"
#include "core/workspace_plan.hpp"
#include "layer_helpers.hpp"
#include "mok/schedule.hpp"
#include "schedule_test_helpers.hpp"

namespace mok::test {
namespace {

using namespace mok::schedule;

// The layout is constexpr: these hold at compile time.
static_assert(kExpertSegmentAlignment == 128);
static_assert(padded_rows(0) == 0 && padded_rows(1) == 128 && padded_rows(128) == 128 &&
              padded_rows(129) == 256);
static_assert(max_schedule_rows(Shape{4096, 8, 256, 8}) == 8 * 4096 * 8 + 32 * 127);
static_assert(encode_row(3, 17, 100) == 317 && row_src_rank(317, 100) == 3 &&
              row_slot(317, 100) == 17);
static_assert(staged_expert_id(-1, 8) == -1 && staged_expert_id(7, 8) == 7 &&
              staged_expert_id(8, 8) == kUnusedSlot && staged_expert_id(-2, 8) == kUnusedSlot &&
              staged_expert_id((std::int64_t{1} << 32) + 1, 8) == kUnusedSlot);
static_assert(local_expert_of(5, 1, 4) == 1 && local_expert_of(3, 1, 4) == -1 &&
              local_expert_of(-1, 0, 4) == -1);
static_assert(make_ring_plan(0, 1024, 256).num_passes == 0);
static_assert(make_ring_plan(2560, 1024, 256).num_passes == 3 &&
              make_ring_plan(2560, 1024, 256).last_pass_rows == 512 &&
              make_ring_plan(2560, 1024, 256).num_minibatches == 10);
static_assert(plan::make_workspace_plan({.num_tokens = 4096,
                                         .hidden_size = 7168,
                                         .topk = 8,
                                         .num_experts = 256,
                                         .ep_size = 8,
                                         .macrobatch_size = 131072,
                                         .minibatch_size = 4096})
                  .combine.bytes == std::int64_t{4096} * 8 * 7168 * 2);

// The megakernel's counters, one layout for the allocation and the kernel: each range right
// after the one before, the exit count last, every other word zeroed between launches.
constexpr plan::FusedCounterLayout kCounters{5, 3};
static_assert(kCounters.ready() == 0 && kCounters.done() == 5 && kCounters.shared_done() == 10 &&
              kCounters.tickets() == 13 && kCounters.pulls() == 14 && kCounters.exit() == 15 &&
              kCounters.zeroed_words() == 15 && kCounters.words() == 16);
static_assert(plan::fused_counter_words(5 * 128 - 1, 3 * 128) == kCounters.words());

TEST(ScheduleLayout, RingPlanCoversEveryRowOnce) {
  for (std::int64_t total : {0, 1, 127, 128, 1000, 4096, 40000}) {
    for (auto [macro, mini] : {std::pair<std::int64_t, std::int64_t>{1024, 256},
                               {384, 128},
                               {300, 100},
                               {131072, 4096}}) {
      const RingPlan p = make_ring_plan(total, macro, mini);
      EXPECT_TRUE(same_ring_plan(p, derive_ring_plan(total, macro, mini))) << total << " " << macro;
      std::int64_t next = 0, minibatches = 0;
      for (int pass = 0; pass < p.num_passes; ++pass) {
        const RowRange pr = pass_rows(p, pass);
        EXPECT_EQ(pr.begin, next);
        EXPECT_GT(pr.size(), 0);
        for (int m = 0; m < minibatches_in_pass(p, pass); ++m) {
          const RowRange mr = minibatch_rows(p, pass, m);
          EXPECT_EQ(mr.begin, next);
          EXPECT_GT(mr.size(), 0);
          for (std::int32_t row : {mr.begin, mr.end - 1}) {
            const RingPosition at = ring_position(p, row);
            EXPECT_EQ(at.pass, pass);
            EXPECT_EQ(at.minibatch, m);
            EXPECT_EQ(at.ring_row, row - pr.begin);
          }
          next = mr.end;
          ++minibatches;
        }
        EXPECT_EQ(next, pr.end);
      }
      EXPECT_EQ(next, total);
      EXPECT_EQ(minibatches, p.num_minibatches);
    }
  }
}

TEST(ScheduleLayout, ExpertOfRow) {
  const std::int32_t starts[] = {0, 128, 128, 384, 512};
  EXPECT_EQ(expert_of_row(starts, 4, 0), 0);
  EXPECT_EQ(expert_of_row(starts, 4, 127), 0);
  EXPECT_EQ(expert_of_row(starts, 4, 128), 2);  // expert 1 is empty
  EXPECT_EQ(expert_of_row(starts, 4, 383), 2);
  EXPECT_EQ(expert_of_row(starts, 4, 511), 3);
}

TEST(WorkspacePlan, BuffersAlignedDisjointAndSized) {
  const plan::PlanShape s{.num_tokens = 7,
                          .hidden_size = 128,
                          .topk = 3,
                          .num_experts = 12,
                          .ep_size = 3,
                          .macrobatch_size = 1024,
                          .minibatch_size = 256};
  const plan::WorkspacePlan p = plan::make_workspace_plan(s);
  for (plan::Region region : {plan::Region::symmetric, plan::Region::local, plan::Region::layer}) {
    std::int64_t end = 0;
    for (const plan::BufferInfo& b : plan::kBuffers) {
      if (b.region != region) continue;
      const plan::Buffer buf = p.*(b.member);
      EXPECT_EQ(buf.offset % plan::kBufferAlignment, 0) << b.name;
      EXPECT_GE(buf.offset, end) << b.name << " overlaps the buffer before it";
      end = buf.offset + buf.bytes;
    }
    EXPECT_LE(end, region == plan::Region::symmetric ? p.symmetric_bytes
                   : region == plan::Region::local   ? p.local_bytes
                                                     : p.layer_bytes);
  }
  EXPECT_EQ(p.x_staging.bytes, 7 * 128 * 2);
  EXPECT_EQ(p.combine.bytes, 7 * 3 * 128 * 2);
  EXPECT_EQ(p.dx_routed.bytes, 7 * 3 * 128 * 2);
  EXPECT_EQ(p.router_weights.bytes, 7 * 3 * 4);
  EXPECT_EQ(p.expert_ids.bytes, 2 * 7 * 3 * 4);
  EXPECT_EQ(p.schedule_table.bytes, (3 * 7 * 3 + 4 * 127) * 4);
  EXPECT_EQ(p.segment_starts.bytes, 5 * 4);
  // The ring: the 571-row table rounded up to whole minibatches (256 rows), under macrobatch 1024.
  EXPECT_EQ(p.ring_rows, 768);
  // No intermediate sizes given: the layer region holds only what does not depend on them.
  EXPECT_EQ(p.max_passes, 1);
  EXPECT_EQ(p.carry_slots, 0);
  EXPECT_EQ(p.pass_gate.bytes + p.pass_x.bytes, 0);
  EXPECT_EQ(p.rows_d_out.bytes, 768 * 128 * 2);
  EXPECT_EQ(p.total_bytes(), p.symmetric_bytes + p.local_bytes + p.layer_bytes);
}

// The layer region: passes and carry slots follow the worst-case table and the macrobatch; the
// pass scratch, pass plan and carries exist only with several passes, the shared expert's buffers
// only with one.
TEST(WorkspacePlan, LayerRegionFollowsPassesAndSharedExpert) {
  plan::PlanShape s{.num_tokens = 300,
                    .hidden_size = 128,
                    .topk = 3,
                    .num_experts = 5,
                    .ep_size = 1,
                    .macrobatch_size = 1 << 20,
                    .minibatch_size = 128,
                    .intermediate_size = 192,
                    .shared_intermediate_size = 64};
  // 900 rows + 5 * 127 padding = 1535 rows worst case.
  const plan::WorkspacePlan one = plan::make_workspace_plan(s);
  EXPECT_EQ(one.max_passes, 1);
  EXPECT_EQ(one.carry_slots, 0);
  EXPECT_EQ(one.pass_gate.bytes + one.pass_up.bytes + one.pass_hidden.bytes, 0);
  EXPECT_EQ(one.pass_steps.bytes + one.carry_gate.bytes + one.carry_down.bytes, 0);
  EXPECT_EQ(one.rows_d_gate.bytes, 1536 * 192 * 2);
  EXPECT_EQ(one.row_dots.bytes, 1536 * 2 * 4);  // ceil(192 / 128) chunks
  EXPECT_EQ(one.rows_scaled_hidden.bytes, 0);    // I 192 > H 128: d_out's rows are scaled
  {
    plan::PlanShape narrow = s;  // I <= H: the down dgrad writes bf16(w h), [R, I]
    for (std::int64_t I : {64, 128}) {
      narrow.intermediate_size = I;
      EXPECT_TRUE(plan::scaled_hidden_in_backward(narrow)) << I;
      EXPECT_EQ(plan::make_workspace_plan(narrow).rows_scaled_hidden.bytes, 1536 * I * 2) << I;
    }
    EXPECT_FALSE(plan::scaled_hidden_in_backward(s));
  }
  EXPECT_EQ(one.shared_out.bytes, 300 * 128 * 2);
  EXPECT_EQ(one.shared_d_gate.bytes, 300 * 64 * 2);
  EXPECT_EQ(one.peers.bytes, 6 * 8);
  for (auto [macro, passes, slots] :
       {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1024, 2, 1}, {512, 3, 2},
        {256, 6, 5}, {128, 12, 5}}) {
    s.macrobatch_size = macro;
    const plan::WorkspacePlan p = plan::make_workspace_plan(s);
    EXPECT_EQ(p.max_passes, passes) << macro;
    EXPECT_EQ(p.carry_slots, slots) << macro;  // min(passes - 1, E_local)
    EXPECT_EQ(p.ring_rows, macro) << macro;
    EXPECT_EQ(p.pass_x.bytes, macro * 128 * 2) << macro;
    EXPECT_EQ(p.pass_gate.bytes, macro * 192 * 2) << macro;
    EXPECT_EQ(p.pass_steps.bytes, 5 * 4) << macro;
    EXPECT_EQ(p.carry_gate.bytes, slots * 192 * 128 * 4) << macro;
    EXPECT_EQ(p.carry_down.bytes, slots * 128 * 192 * 4) << macro;
  }
  s.shared_intermediate_size = 0;
  const plan::WorkspacePlan no_shared = plan::make_workspace_plan(s);
  EXPECT_EQ(no_shared.shared_out.bytes + no_shared.shared_d_gate.bytes, 0);
}

// The automatic ring (Config::macrobatch_size 0): kAutoRoutedRows routed rows plus a partial tile
// per local expert, so the worst case of a rank that receives 131072 rows (qwen3-30b-a3b: T 16384,
// k 8, 128 experts, 147328 rows) is one pass, and only more routed rows than that start a second.
TEST(WorkspacePlan, TheAutomaticRingHoldsItsRoutedRowsAndTheirPadding) {
  const Config defaults;
  EXPECT_EQ(defaults.macrobatch_size, 0);
  EXPECT_NO_THROW(defaults.validate());
  const auto plan_of = [&](std::int64_t T, std::int64_t k, std::int64_t E, int W) {
    return plan::make_workspace_plan({.num_tokens = T,
                                      .hidden_size = 2048,
                                      .topk = k,
                                      .num_experts = E,
                                      .ep_size = W,
                                      .macrobatch_size = macrobatch_rows(
                                          {T, k, E, W}, 0, defaults.minibatch_size),
                                      .minibatch_size = defaults.minibatch_size,
                                      .intermediate_size = 768});
  };
  EXPECT_EQ(macrobatch_rows({16384, 8, 128, 1}, 0, 4096), 147456);  // 131072 + 128 * 127, rounded
  EXPECT_EQ(macrobatch_rows({16384, 8, 128, 1}, 8192, 4096), 8192);  // as given
  const plan::WorkspacePlan qwen3 = plan_of(16384, 8, 128, 1);
  EXPECT_EQ(qwen3.max_passes, 1);
  EXPECT_EQ(qwen3.ring_rows, 147456);  // 147328 rounded to whole minibatches
  EXPECT_EQ(qwen3.carry_gate.bytes, 0);
  const plan::WorkspacePlan more = plan_of(16384 + 512, 8, 128, 1);  // 135168 routed rows
  EXPECT_EQ(more.max_passes, 2);
  EXPECT_EQ(more.ring_rows, 147456);
  // EP 8: each rank's worst case is every rank's rows on it; the padding is per local expert.
  EXPECT_EQ(macrobatch_rows({4096, 8, 256, 8}, 0, 4096), 135168);  // 131072 + 32 * 127
  EXPECT_EQ(plan_of(4096, 8, 256, 8).max_passes, 2);                // 262144 + 4064 rows
  // The host twin's ring plan resolves the same automatic macrobatch: a table of all 131072 rows
  // under skew (every row on 3 experts, the rest 1 each: 125 partial tiles) stays one pass.
  std::vector<std::int64_t> ids(16384 * 8);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i % 8 < 3 ? i % 8 : 3 + i % 125;
  const std::int64_t* ptr = ids.data();
  const HostSchedule s = build_schedule_host({16384, 8, 128, 1}, 0, 4096, 0, {&ptr, 1});
  EXPECT_EQ(s.ring_plan.macrobatch_rows, 147456);
  EXPECT_EQ(s.ring_plan.num_passes, 1);
  EXPECT_GT(s.ring_plan.total_rows, 131072);
}

// Host twin vs direct re-derivation, every rank, over the whole grid.
TEST(ScheduleHost, TwinMatchesDirectDerivation) {
  std::mt19937_64 rng(test_seed());
  int checked = 0;
  for (const GridCase& c : schedule_grid()) {
    for (RoutingKind kind : kAllRoutings) {
      const std::int64_t one = std::uniform_int_distribution<std::int64_t>(0, c.E - 1)(rng);
      std::vector<std::vector<std::int64_t>> ids;
      std::vector<const std::int64_t*> ptrs;
      for (int r = 0; r < c.W; ++r) ids.push_back(make_routing(kind, c.T, c.k, c.E, one, rng));
      for (auto& v : ids) ptrs.push_back(v.data());
      const Shape shape{c.T, c.k, c.E, c.W};
      for (int rank = 0; rank < c.W; ++rank) {
        const HostSchedule s = build_schedule_host(shape, c.macrobatch, c.minibatch, rank, ptrs);
        const DirectSchedule d = derive_schedule(ids, c.T, c.k, c.E, rank);
        const std::string what = case_name(c, kind) + " rank " + std::to_string(rank);
        ASSERT_EQ(first_difference(s.table, d.table), "") << what << ": table";
        ASSERT_EQ(s.expert_counts, d.expert_counts) << what;
        ASSERT_EQ(s.expert_src_counts, d.expert_src_counts) << what;
        ASSERT_EQ(s.segment_starts, d.segment_starts) << what;
        ASSERT_TRUE(
            same_ring_plan(s.ring_plan, derive_ring_plan(d.total_rows, c.macrobatch, c.minibatch)))
            << what;
        ASSERT_FALSE(s.first_bad.has_value()) << what;
        ++checked;
      }
    }
  }
  std::printf("[ mok ] %d (case, routing, rank) schedules checked\n", checked);
}

// Bad ids: treated as unused slots; the first one (smallest rank, t, j) is reported.
TEST(ScheduleHost, BadIdsAreUnusedAndReported) {
  const std::int64_t T = 5, k = 2, E = 8;
  std::vector<std::vector<std::int64_t>> ids = {{0, 1, 2, 3, 4, 5, 6, 7, 0, 1},
                                                {7, 6, 5, 4, 3, 2, 1, 0, 7, 6}};
  ids[1][3] = 300;
  ids[1][6] = (std::int64_t{1} << 32) + 1;  // would alias expert 1 if truncated to int32
  ids[0][9] = -2;
  std::vector<std::vector<std::int64_t>> as_unused = ids;
  for (auto& v : as_unused) {
    for (auto& id : v) id = id < -1 || id >= E ? -1 : id;
  }
  std::vector<const std::int64_t*> ptrs = {ids[0].data(), ids[1].data()};
  for (int rank = 0; rank < 2; ++rank) {
    const HostSchedule s = build_schedule_host({T, k, E, 2}, 1024, 256, rank, ptrs);
    const DirectSchedule d = derive_schedule(as_unused, T, k, E, rank);
    EXPECT_EQ(first_difference(s.table, d.table), "");
    ASSERT_TRUE(s.first_bad.has_value());
    EXPECT_EQ(s.first_bad->rank, 0);
    EXPECT_EQ(s.first_bad->token, 4);
    EXPECT_EQ(s.first_bad->slot, 1);
    EXPECT_EQ(s.first_bad->value, -2);
  }
}

struct CpuSchedule {
  HostTensor table, counts, src_counts, starts, ring;
  CpuSchedule(const Problem& p)
      : table(DType::i32, {schedule_capacity_rows(p)}),
        counts(DType::i32, {p.num_local_experts()}),
        src_counts(DType::i32, {p.num_local_experts(), std::int64_t{p.ep_size}}),
        starts(DType::i32, {p.num_local_experts() + 1}),
        ring(DType::i32, {kRingPlanInts}) {}
  ScheduleViews views() {
    return {table.view(), counts.view(), src_counts.view(), starts.view(), ring.view()};
  }
};

TEST(ScheduleCpu, PublicEntryPointWritesViews) {
  std::mt19937_64 rng(test_seed() + 1);
  Problem p{.num_tokens = 33,
            .hidden_size = 64,
            .intermediate_size = 64,
            .num_experts = 12,
            .topk = 3,
            .ep_size = 3,
            .ep_rank = 2};
  Config config;
  config.macrobatch_size = 256;
  config.minibatch_size = 128;
  std::vector<std::vector<std::int64_t>> ids;
  std::vector<HostTensor> tensors;
  std::vector<TensorView> views;
  for (int r = 0; r < 3; ++r) {
    ids.push_back(make_routing(RoutingKind::zipf, p.num_tokens, p.topk, p.num_experts, 0, rng));
    tensors.emplace_back(DType::i64, std::initializer_list<std::int64_t>{p.num_tokens, p.topk});
    std::memcpy(tensors.back().view().data, ids.back().data(), ids.back().size() * 8);
  }
  for (auto& t : tensors) views.push_back(t.view());
  CpuSchedule out(p);
  out.table.fill_bytes(0x7f);  // poison
  build_schedule_cpu(p, config, views, out.views());
  const DirectSchedule d = derive_schedule(ids, p.num_tokens, p.topk, p.num_experts, 2);
  std::vector<std::int32_t> table(out.table.view().ptr<std::int32_t>(),
                                  out.table.view().ptr<std::int32_t>() + d.table.size());
  EXPECT_EQ(first_difference(table, d.table), "");
  RingPlan ring;
  std::memcpy(&ring, out.ring.view().data, sizeof(ring));
  EXPECT_TRUE(same_ring_plan(ring, derive_ring_plan(d.total_rows, 256, 128)));
  EXPECT_EQ(out.starts.view().ptr<std::int32_t>()[4], d.total_rows);

  // Argument errors name the argument and the value.
  std::vector<HostTensor> bad_tensors = tensors;
  bad_tensors[1].view().ptr<std::int64_t>()[7] = 12;  // t = 2, j = 1 on rank 1
  std::vector<TensorView> bad_views;
  for (auto& t : bad_tensors) bad_views.push_back(t.view());
  expect_error([&] { build_schedule_cpu(p, config, bad_views, out.views()); },
               {"topk_experts[2, 1] of rank 1", "[-1, 12)", "got 12"});
  expect_error([&] { build_schedule_cpu(p, config, std::span(views).first(2), out.views()); },
               {"topk_experts", "3 tensors", "got 2"});
  ScheduleViews wrong = out.views();
  wrong.table.shape[0] -= 1;
  expect_error([&] { build_schedule_cpu(p, config, views, wrong); }, {"schedule.table.shape"});
  Problem huge = p;
  huge.ep_size = 65;
  huge.num_experts = 65 * 4;
  expect_error([&] { (void)local_workspace_bytes(huge, config); }, {"ep_size", "at most 64"});
}

#if !defined(MOK_HAVE_CUDA)
// Without CUDA the GPU tests (test_schedule_gpu.cpp, test_team.cpp) are not built: say so.
TEST(ScheduleGpu, SkippedWithoutCuda) {
  expect_error(
      [] {
        (void)Team::local_virtual(Problem{.num_tokens = 1,
                                          .hidden_size = 64,
                                          .intermediate_size = 64,
                                          .num_experts = 2,
                                          .topk = 1},
                                  Config{});
      },
      {"no CUDA support", "build_schedule_cpu"});
  GTEST_SKIP() << "this build has no CUDA support: the GPU schedule and team tests are not built";
}
#endif

}  // namespace
}  // namespace mok::test
