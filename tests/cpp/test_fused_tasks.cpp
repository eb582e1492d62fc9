// The forward megakernel's ticket order (src/cuda/kernels/fused_tasks.hpp), on the CPU: every
// GEMM tile of a launch has exactly one ticket, and every dependency between tiles is on a smaller
// ticket (a down tile after all its block's gate/up tiles, a shared down tile after its block's
// shared gate/up tiles). The kernel's freedom from deadlock rests on the second (each CTA runs its
// tickets in order, so the smallest unfinished one can always run; the pulls a gate/up tile waits
// for are not tickets and wait for nothing). Also: minibatches' gate/up tiles come in minibatch
// order, the order the pulling warps draw rows in, so a tile rarely waits for rows behind others.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/kernels/fused_tasks.hpp"
#include "test_seed.hpp"

namespace mok::test {
namespace {

using fused::BlockGroups;
using fused::decode;
using fused::NoGroups;
using fused::Task;
using fused::TaskKind;
using fused::TicketPlan;

TicketPlan plan_of(int blocks, int per_minibatch, int n_up, int n_down, int shared_blocks,
                   int n_shared_up, int n_shared_down) {
  TicketPlan p;
  p.blocks = blocks;
  p.per_minibatch = per_minibatch;
  p.minibatches = (blocks + per_minibatch - 1) / per_minibatch;
  p.n_up = n_up;
  p.n_down = n_down;
  p.shared_up = shared_blocks * n_shared_up;
  p.shared_down = shared_blocks * n_shared_down;
  return p;
}

template <class Groups>
void expect_complete_and_ordered(int blocks, int per_minibatch, int n_up, int n_down,
                                 int shared_blocks, int n_shared_up, int n_shared_down,
                                 const Groups& groups) {
  const TicketPlan p =
      plan_of(blocks, per_minibatch, n_up, n_down, shared_blocks, n_shared_up, n_shared_down);
  const std::string what = "B " + std::to_string(blocks) + ", per minibatch " +
                           std::to_string(per_minibatch) + ", n " + std::to_string(n_up) + "/" +
                           std::to_string(n_down) + ", shared " + std::to_string(shared_blocks);
  const int expected = blocks * (n_up + n_down) + p.shared_up + p.shared_down;
  ASSERT_EQ(p.tickets(), expected) << what;
  // ticket of every (kind, block, n); each seen once, each in range.
  std::map<std::tuple<int, int, int>, int> ticket_of;
  for (int t = 0; t < p.tickets(); ++t) {
    const Task task = decode(p, shared_blocks, t, groups);
    const bool shared = task.kind == TaskKind::shared_gate_up || task.kind == TaskKind::shared_down;
    const int n_max = task.kind == TaskKind::gate_up          ? n_up
                      : task.kind == TaskKind::down           ? n_down
                      : task.kind == TaskKind::shared_gate_up ? n_shared_up
                                                              : n_shared_down;
    ASSERT_GE(task.block, 0) << what << ", ticket " << t;
    ASSERT_LT(task.block, shared ? shared_blocks : blocks) << what << ", ticket " << t;
    ASSERT_GE(task.n, 0) << what << ", ticket " << t;
    ASSERT_LT(task.n, n_max) << what << ", ticket " << t;
    const auto key = std::make_tuple(static_cast<int>(task.kind), task.block, task.n);
    ASSERT_EQ(ticket_of.count(key), 0u) << what << ": ticket " << t << " repeats a task";
    ticket_of[key] = t;
  }
  ASSERT_EQ(static_cast<int>(ticket_of.size()), expected) << what;
  auto ticket = [&](TaskKind k, int b, int n) {
    return ticket_of.at(std::make_tuple(static_cast<int>(k), b, n));
  };
  for (int b = 0; b < blocks; ++b) {
    // Gate/up tiles of a later minibatch after every gate/up tile of an earlier one.
    if (b + 1 < blocks && (b + 1) % per_minibatch == 0) {
      for (int n = 0; n < n_up; ++n) {
        for (int m = 0; m < n_up; ++m) {
          EXPECT_LT(ticket(TaskKind::gate_up, b, n), ticket(TaskKind::gate_up, b + 1, m))
              << what << ", block " << b;
        }
      }
    }
    int last_up = -1;
    for (int n = 0; n < n_up; ++n) last_up = std::max(last_up, ticket(TaskKind::gate_up, b, n));
    for (int n = 0; n < n_down; ++n) {
      EXPECT_LT(last_up, ticket(TaskKind::down, b, n)) << what << ", block " << b;
    }
  }
  for (int b = 0; b < shared_blocks; ++b) {
    int last_up = -1;
    for (int n = 0; n < n_shared_up; ++n) {
      last_up = std::max(last_up, ticket(TaskKind::shared_gate_up, b, n));
    }
    for (int n = 0; n < n_shared_down; ++n) {
      EXPECT_LT(last_up, ticket(TaskKind::shared_down, b, n)) << what << ", shared block " << b;
    }
  }
}

TEST(FusedTasks, EveryTaskOnceAndEveryDependencyOnASmallerTicket) {
  for (int blocks : {0, 1, 2, 5, 33, 257})
    for (int per_minibatch : {1, 2, 32})
      for (auto [n_up, n_down] : {std::pair{1, 1}, std::pair{6, 8}, std::pair{16, 28}})
        for (auto [shared, su, sd] : {std::tuple{0, 0, 0}, std::tuple{1, 1, 1},
                                      std::tuple{3, 16, 28}, std::tuple{32, 4, 2}}) {
          expect_complete_and_ordered(blocks, per_minibatch, n_up, n_down, shared, su, sd,
                                      NoGroups{});
        }
}

// Expert groups of random sizes (some empty, some not a multiple of 128 rows, some spanning
// minibatches), and one group per block (dsv3-ep1's uniform case).
std::vector<int> random_starts(int blocks, int groups, std::mt19937& rng) {
  std::vector<int> starts(static_cast<std::size_t>(groups), 0);
  std::uniform_int_distribution<int> row(0, 128 * blocks);
  for (int& s : starts) s = row(rng);
  std::sort(starts.begin(), starts.end());
  starts[0] = 0;
  return starts;
}

TEST(FusedTasks, GroupPanelsKeepEveryTaskOnceAndTheOrder) {
  std::mt19937 rng(static_cast<std::uint32_t>(test_seed()));
  for (int blocks : {1, 5, 33, 257})
    for (int groups : {1, 3, 40})
      for (int per_minibatch : {1, 32}) {
        const std::vector<int> starts = random_starts(blocks, groups, rng);
        expect_complete_and_ordered(blocks, per_minibatch, 16, 28, 3, 16, 28,
                                    BlockGroups{starts.data(), groups});
        expect_complete_and_ordered(blocks, per_minibatch, 1, 1, 0, 0, 0,
                                    BlockGroups{starts.data(), groups});
      }
  std::vector<int> one_per_block(64);
  for (int b = 0; b < 64; ++b) one_per_block[b] = 128 * b;
  expect_complete_and_ordered(64, 32, 16, 28, 32, 16, 28, BlockGroups{one_per_block.data(), 64});
}

// Within a stage, tile_task visits the groups in order, each group's tiles back to back, in panels
// of at most 16 blocks, N outer within a panel: what the unfused scheduler's raster does per group.
TEST(FusedTasks, PanelsStayWithinOneGroup) {
  std::mt19937 rng(static_cast<std::uint32_t>(test_seed()));
  for (int trial = 0; trial < 50; ++trial) {
    const int blocks = 1 + static_cast<int>(rng() % 70), groups = 1 + static_cast<int>(rng() % 9);
    const int first = static_cast<int>(rng() % 5), n_tiles = 1 + static_cast<int>(rng() % 7);
    std::vector<int> starts = random_starts(first + blocks, groups, rng);
    const BlockGroups g{starts.data(), groups};
    int last_group = -1;
    std::vector<int> seen(static_cast<std::size_t>(blocks * n_tiles), 0);
    for (int o = 0; o < blocks * n_tiles; ++o) {
      const Task t = fused::tile_task(TaskKind::gate_up, first, blocks, n_tiles, o, g);
      ASSERT_GE(t.block, first);
      ASSERT_LT(t.block, first + blocks);
      ASSERT_LT(t.n, n_tiles);
      ++seen[static_cast<std::size_t>((t.block - first) * n_tiles + t.n)];
      const int group = g.group_of(t.block);
      ASSERT_GE(group, last_group) << "o " << o << ": groups out of order";
      last_group = group;
    }
    for (int v : seen) ASSERT_EQ(v, 1) << "a tile twice or never";
  }
  // One group per block: each block's tiles back to back (N inner), as the launches run them.
  std::vector<int> one_per_block(8);
  for (int b = 0; b < 8; ++b) one_per_block[b] = 128 * b;
  const BlockGroups g{one_per_block.data(), 8};
  for (int o = 0; o < 8 * 16; ++o) {
    const Task t = fused::tile_task(TaskKind::gate_up, 0, 8, 16, o, g);
    EXPECT_EQ(t.block, o / 16);
    EXPECT_EQ(t.n, o % 16);
  }
}

// The megakernel's table of every block's group (BlockGroups::of_block, filled with search once a
// launch) decodes every ticket as the search does: for ascending starts, for starts that are not
// (corrupt tables must still decode alike in every CTA), and for blocks past the table's room.
TEST(FusedTasks, TheGroupTableDecodesAsTheSearch) {
  std::mt19937 rng(static_cast<std::uint32_t>(test_seed()));
  for (int trial = 0; trial < 40; ++trial) {
    const int blocks = 1 + static_cast<int>(rng() % 90), groups = 1 + static_cast<int>(rng() % 12);
    std::vector<int> starts = random_starts(blocks, groups, rng);
    if (trial % 4 == 3) std::shuffle(starts.begin(), starts.end(), rng);  // not ascending
    const BlockGroups searched{starts.data(), groups};
    std::vector<std::uint16_t> table(static_cast<std::size_t>(blocks));
    for (int q = 0; q < blocks; ++q) table[q] = static_cast<std::uint16_t>(searched.search(q));
    const int tabled = trial % 2 == 0 ? blocks : blocks / 2;  // the rest past the table's room
    const BlockGroups tabled_groups{starts.data(), groups, table.data(), tabled};
    const TicketPlan p = plan_of(blocks, 1 + static_cast<int>(rng() % 8), 3, 5, 2, 2, 3);
    for (int ticket = 0; ticket < p.tickets(); ++ticket) {
      const Task a = decode(p, 2, ticket, searched), b = decode(p, 2, ticket, tabled_groups);
      ASSERT_EQ(std::make_tuple(a.kind, a.block, a.n), std::make_tuple(b.kind, b.block, b.n))
          << "trial " << trial << ", ticket " << ticket;
    }
    for (int q = 0; q < blocks + 3; ++q) {
      ASSERT_EQ(tabled_groups.group_of(q), searched.search(q)) << "trial " << trial << ", q " << q;
    }
  }
}

// The shared expert's down tiles come last, block by block (N inner), after every routed tile.
TEST(FusedTasks, TheSharedDownTilesComeLastBlockByBlock) {
  const TicketPlan p = plan_of(5, 2, 2, 3, 4, 2, 3);
  const int first = p.tickets() - p.shared_down;
  for (int t = 0; t < first; ++t) {
    EXPECT_NE(decode(p, 4, t, NoGroups{}).kind, TaskKind::shared_down) << "ticket " << t;
  }
  for (int o = 0; o < p.shared_down; ++o) {
    const Task task = decode(p, 4, first + o, NoGroups{});
    EXPECT_EQ(task.kind, TaskKind::shared_down) << "ticket " << first + o;
    EXPECT_EQ(task.block, o / 3) << "ticket " << first + o;
    EXPECT_EQ(task.n, o % 3) << "ticket " << first + o;
  }
}

// PERF.md's shapes at the default minibatch (4096 rows: 32 blocks): dsv3-ep8slice (32768 rows,
// I 2048, H 7168, a shared expert of S 2048 over 4096 tokens) and qwen3-30b-a3b (131072 rows and
// padding, I 768, H 2048).
TEST(FusedTasks, PerfShapes) {
  expect_complete_and_ordered(256 + 31, 32, 2048 / 128, 7168 / 256, 32, 2048 / 128, 7168 / 256,
                              NoGroups{});
  expect_complete_and_ordered(1024 + 127, 32, 768 / 128, 2048 / 256, 0, 0, 0, NoGroups{});
}

}  // namespace
}  // namespace mok::test
