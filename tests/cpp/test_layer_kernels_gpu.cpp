// GPU transfers (pull/push over W virtual ranks on one device) and home reductions, against host
// computations of the same formulas. Copies and the fixed-order reductions are checked bitwise.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "core/bf16.hpp"
#include "core/numerics.hpp"
#include "core/workspace_plan.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/kernels/home_reduce.hpp"
#include "cuda/kernels/pass_segments.hpp"
#include "cuda/kernels/quantize_pass_fp8.hpp"
#include "cuda/kernels/router_grad.hpp"
#include "cuda/kernels/transfer.hpp"
#include "gpu_buffer.hpp"
#include "layer_helpers.hpp"
#include "mok/fp8.hpp"
#include "schedule_test_helpers.hpp"
#include "support/transfers.hpp"

namespace mok::test {
namespace {

using cuda::HomeReduceParams;
using cuda::PassRows;
using cuda::PullParams;
using cuda::RowGeometry;
using test::PushParams;

// Random finite bf16 bit patterns: any misrouted row or element shows as a mismatch.
std::vector<bf16_t> random_bf16(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = float_to_bf16(dist(rng));
  return v;
}

// A table over W ranks: every (rank, t, j) slot with probability `keep`, grouped into segments
// padded to `align` rows with -1, in random order (transfers must not care about the order).
std::vector<std::int32_t> random_table(const RowGeometry& g, double keep, int align,
                                       std::mt19937_64& rng) {
  std::vector<std::int32_t> srcs;
  std::bernoulli_distribution take(keep);
  for (std::int64_t s = 0; s < g.ranks * g.tokens * g.topk; ++s) {
    if (take(rng)) srcs.push_back(static_cast<std::int32_t>(s));
  }
  std::shuffle(srcs.begin(), srcs.end(), rng);
  std::vector<std::int32_t> table;
  std::uniform_int_distribution<int> seg(0, 3 * align);
  std::size_t i = 0;
  while (i < srcs.size()) {
    const std::size_t n = std::min<std::size_t>(seg(rng), srcs.size() - i);
    table.insert(table.end(), srcs.begin() + i, srcs.begin() + i + n);
    i += n;
    while (table.size() % align) table.push_back(-1);
  }
  return table;
}

struct Ranks {  // W virtual ranks' [T, H] bf16 buffers and their peer-pointer array
  std::vector<std::unique_ptr<DeviceBuffer<bf16_t>>> bufs;
  std::vector<std::vector<bf16_t>> host;
  DeviceBuffer<void*> peers;
  Ranks(int W, std::size_t elems, std::mt19937_64& rng, bool poison = false) : peers(W) {
    std::vector<void*> ptrs;
    for (int r = 0; r < W; ++r) {
      host.push_back(random_bf16(elems, rng));
      bufs.push_back(std::make_unique<DeviceBuffer<bf16_t>>(host.back()));
      if (poison) bufs.back()->poison();
      ptrs.push_back(bufs.back()->get());
    }
    peers.upload(ptrs);
  }
};

// How the pull moves rows: forward (copies), backward scaled (bf16(w * row)), or backward with
// the row weights beside the unscaled rows, scaled in place afterwards (launch_scale_rows): the
// last two must give the same bits.
enum class PullMode { forward, scaled, row_weights };

class TransferGpu : public ::testing::TestWithParam<std::tuple<int, PullMode>> {};

TEST_P(TransferGpu, PullThenPushOverPassesMatchesTheTable) {
  MOK_REQUIRE_HOPPER();
  const auto [W, mode] = GetParam();
  const bool backward = mode != PullMode::forward;
  std::mt19937_64 rng(test_seed() + W);
  const RowGeometry g{.tokens = 37, .topk = 3, .hidden = 192, .ranks = W};
  const std::vector<std::int32_t> table = random_table(g, 0.8, 128, rng);
  const std::int64_t total = static_cast<std::int64_t>(table.size());
  const std::int64_t ring_rows = 128 * 2;  // several passes
  Ranks x(W, g.tokens * g.hidden, rng);
  // Router weights per rank (backward scales rows by them).
  std::vector<std::vector<float>> w_host(W);
  std::vector<std::unique_ptr<DeviceBuffer<float>>> w_bufs;
  std::vector<const float*> w_ptrs;
  for (int r = 0; r < W; ++r) {
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    w_host[r].resize(g.tokens * g.topk);
    for (auto& v : w_host[r]) v = u(rng);
    w_bufs.push_back(std::make_unique<DeviceBuffer<float>>(w_host[r]));
    w_ptrs.push_back(w_bufs.back()->get());
  }
  DeviceBuffer<const float*> w_peers(w_ptrs);
  Ranks combine(W, g.tokens * g.topk * g.hidden, rng, /*poison=*/true);
  DeviceBuffer<std::int32_t> d_table(table),
      d_total(std::vector<std::int32_t>{std::int32_t(total)});
  DeviceBuffer<bf16_t> ring(ring_rows * g.hidden);
  DeviceBuffer<float> row_weights(ring_rows);

  std::vector<bool> written(W * g.tokens * g.topk, false);
  for (std::int64_t offset = 0; offset < total + ring_rows;
       offset += ring_rows) {  // one pass past the end
    ring.poison();
    row_weights.poison();
    PassRows pass{d_table.get(), d_total.get(), offset, ring_rows};
    PullParams pull{pass,
                    g,
                    reinterpret_cast<const void* const*>(x.peers.get()),
                    backward ? w_peers.get() : nullptr,
                    ring.get(),
                    mode == PullMode::row_weights ? row_weights.get() : nullptr};
    if (W == 1 && (offset / ring_rows) % 2 == 0) {
      // One rank, every other pass: its own tensors read in place, no peer arrays at all.
      pull.src_peers = nullptr;
      pull.scale_peers = nullptr;
      pull.src_own = x.bufs[0]->get();
      pull.scale_own = backward ? w_ptrs[0] : nullptr;
    }
    MOK_CUDA_OK(test::launch_pull_rows(pull, nullptr));
    const std::int64_t rows = std::clamp<std::int64_t>(total - offset, 0, ring_rows);
    if (mode == PullMode::row_weights) {
      MOK_CUDA_OK(cudaDeviceSynchronize());
      const auto got_w = row_weights.download();
      const auto unscaled = ring.download();
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::int32_t src = table[offset + i];
        const std::int64_t slot = src % (g.tokens * g.topk), t = slot / g.topk;
        const int r = src / (g.tokens * g.topk);
        ASSERT_EQ(got_w[i], src >= 0 ? w_host[r][slot] : 0.0f) << "row weight " << i;
        ASSERT_EQ(unscaled[i * g.hidden + 5], src >= 0 ? x.host[r][t * g.hidden + 5] : bf16_t(0))
            << "unscaled row " << i;
      }
      cuda::ScaleRowsParams scale{pass, g, row_weights.get(), ring.get()};
      MOK_CUDA_OK(cuda::launch_scale_rows(scale, nullptr));
    }
    MOK_CUDA_OK(cudaDeviceSynchronize());
    const auto got = ring.download();
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int32_t src = table[offset + i];
      for (std::int64_t c = 0; c < g.hidden; ++c) {
        bf16_t want = 0;
        if (src >= 0) {
          const int r = src / (g.tokens * g.topk);
          const std::int64_t slot = src % (g.tokens * g.topk), t = slot / g.topk;
          want = x.host[r][t * g.hidden + c];
          if (backward) want = float_to_bf16(w_host[r][slot] * bf16_to_float(want));
        }
        ASSERT_EQ(got[i * g.hidden + c], want)
            << "pass at " << offset << " ring row " << i << " col " << c;
      }
    }
    for (std::int64_t i = rows * g.hidden; i < ring_rows * g.hidden; ++i) {
      ASSERT_EQ(got[i], 0xffff) << "a ring row past the pass was written";
    }
    PushParams push{pass, g, ring.get(), combine.peers.get()};
    MOK_CUDA_OK(test::launch_push_rows(push, nullptr));
    MOK_CUDA_OK(cudaDeviceSynchronize());
    for (std::int64_t i = 0; i < rows; ++i) {
      if (table[offset + i] >= 0) written[table[offset + i]] = true;
    }
  }
  // Every slot in the table now holds its row; every other slot is untouched poison.
  for (int r = 0; r < W; ++r) {
    const auto got = combine.bufs[r]->download();
    for (std::int64_t slot = 0; slot < g.tokens * g.topk; ++slot) {
      const std::int64_t t = slot / g.topk;
      const bool kept = written[r * g.tokens * g.topk + slot];
      for (std::int64_t c = 0; c < g.hidden; ++c) {
        bf16_t want = 0xffff;
        if (kept) {
          want = x.host[r][t * g.hidden + c];
          if (backward) want = float_to_bf16(w_host[r][slot] * bf16_to_float(want));
        }
        ASSERT_EQ(got[slot * g.hidden + c], want)
            << "rank " << r << " slot " << slot << " col " << c;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TransferGpu,
                         ::testing::Combine(::testing::Values(1, 3, 8),
                                            ::testing::Values(PullMode::forward, PullMode::scaled,
                                                              PullMode::row_weights)));

// The dispatch in token order (launch_pull_tokens per pass, given the table's inverse as the
// schedule writes it; ScheduleGpu checks the schedule's) writes the ring that the row order
// writes, bit for bit, rows past the pass untouched: over W ranks, several passes and one past
// the end, every slot kept or a random 80%, rows of fewer and of more vectors than a warp's
// batch, with and without the rank's own x read in place; and the backward's form, the rows
// unscaled with their router weights beside them (row_weights), likewise.
TEST(TransferGpu, TokenOrderPullIsTheRowOrderPullBitwise) {
  MOK_REQUIRE_HOPPER();
  for (bool with_weights : {false, true})
    for (int W : {1, 3, 8})
      for (std::int64_t hidden : {192, 2112})
        for (double keep : {1.0, 0.8}) {
          std::mt19937_64 rng(test_seed() + 17 * W + hidden);
          const RowGeometry g{.tokens = 45, .topk = 4, .hidden = hidden, .ranks = W};
          const std::vector<std::int32_t> table = random_table(g, keep, 128, rng);
          const std::int64_t total = static_cast<std::int64_t>(table.size());
          const std::int64_t ring_rows = 128 * 3;
          const std::int64_t slots = W * g.tokens * g.topk;
          Ranks x(W, g.tokens * g.hidden, rng);
          std::vector<std::unique_ptr<DeviceBuffer<float>>> w_bufs;
          std::vector<const float*> w_ptrs;
          for (int r = 0; r < W; ++r) {
            std::uniform_real_distribution<float> u(0.01f, 1.0f);
            std::vector<float> w(g.tokens * g.topk);
            for (auto& v : w) v = u(rng);
            w_bufs.push_back(std::make_unique<DeviceBuffer<float>>(w));
            w_ptrs.push_back(w_bufs.back()->get());
          }
          DeviceBuffer<const float*> w_peers(w_ptrs);
          DeviceBuffer<float> weights_by_rows(ring_rows), weights_by_tokens(ring_rows);
          DeviceBuffer<std::int32_t> d_table(table),
              d_total(std::vector<std::int32_t>{std::int32_t(total)}),
              row_of_slot(inverse_of(table, slots));
          DeviceBuffer<bf16_t> by_rows(ring_rows * g.hidden), by_tokens(ring_rows * g.hidden);
          const std::string what = "W " + std::to_string(W) + ", H " + std::to_string(hidden) +
                                   ", keep " + std::to_string(keep) +
                                   (with_weights ? ", row weights" : "");
          for (std::int64_t offset = 0; offset < total + ring_rows; offset += ring_rows) {
            by_rows.poison();
            by_tokens.poison();
            weights_by_rows.poison();
            weights_by_tokens.poison();
            PullParams pull{{d_table.get(), d_total.get(), offset, ring_rows},
                            g,
                            reinterpret_cast<const void* const*>(x.peers.get()),
                            with_weights ? w_peers.get() : nullptr,
                            by_rows.get(),
                            with_weights ? weights_by_rows.get() : nullptr};
            if (W == 1 && (offset / ring_rows) % 2 == 1) {
              pull.src_peers = nullptr;
              pull.scale_peers = nullptr;
              pull.src_own = x.bufs[0]->get();
              pull.scale_own = with_weights ? w_ptrs[0] : nullptr;
            }
            MOK_CUDA_OK(test::launch_pull_rows(pull, nullptr));
            pull.ring = by_tokens.get();
            if (with_weights) pull.row_weights = weights_by_tokens.get();
            MOK_CUDA_OK(cuda::launch_pull_tokens(pull, row_of_slot.get(), nullptr));
            MOK_CUDA_OK(cudaDeviceSynchronize());
            const auto want = by_rows.download(), got = by_tokens.download();
            for (std::size_t i = 0; i < want.size(); ++i) {
              ASSERT_EQ(got[i], want[i]) << what << ", pass at " << offset << ", ring row "
                                         << i / g.hidden << ", col " << i % g.hidden;
            }
            const auto want_w = weights_by_rows.download(), got_w = weights_by_tokens.download();
            for (std::int64_t i = 0; i < ring_rows; ++i) {
              // Bit patterns (the poison is a NaN).
              std::uint32_t a = 0, b = 0;
              std::memcpy(&a, &want_w[i], 4);
              std::memcpy(&b, &got_w[i], 4);
              ASSERT_EQ(b, a) << what << ", pass at " << offset << ", row weight " << i;
            }
          }
        }
  // Scaled copies stay in row order; row weights need weights to read.
  PullParams scaled{};
  scaled.pass.ring_rows = 128;
  scaled.scale_own = reinterpret_cast<const float*>(16);
  EXPECT_EQ(cuda::launch_pull_tokens(scaled, nullptr, nullptr), cudaErrorInvalidValue);
  PullParams unweighted{};
  unweighted.pass.ring_rows = 128;
  unweighted.row_weights = reinterpret_cast<float*>(16);
  EXPECT_EQ(cuda::launch_pull_tokens(unweighted, nullptr, nullptr), cudaErrorInvalidValue);
}

// The row count is read on the device: a captured graph replayed after the count changed moves
// exactly the new rows.
TEST(TransferGpu, RowCountComesFromDeviceMemoryInsideAGraph) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(test_seed());
  const RowGeometry g{.tokens = 64, .topk = 2, .hidden = 64, .ranks = 1};
  std::vector<std::int32_t> table(128);
  std::iota(table.begin(), table.end(), 0);
  Ranks x(1, g.tokens * g.hidden, rng);
  DeviceBuffer<std::int32_t> d_table(table), d_total(1);
  DeviceBuffer<bf16_t> ring(128 * g.hidden);
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  PullParams pull{{d_table.get(), d_total.get(), 0, 128},
                  g,
                  reinterpret_cast<const void* const*>(x.peers.get()),
                  nullptr,
                  ring.get()};
  MOK_CUDA_OK(test::launch_pull_rows(pull, stream));
  MOK_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (std::int32_t total : {5, 128, 0, 77}) {
    ring.poison();
    d_total.upload({total});
    MOK_CUDA_OK(cudaGraphLaunch(exec, stream));
    MOK_CUDA_OK(cudaStreamSynchronize(stream));
    const auto got = ring.download();
    for (std::int64_t i = 0; i < 128 * g.hidden; ++i) {
      const std::int64_t row = i / g.hidden;
      const bf16_t want =
          row < total ? x.host[0][(row / 2) * g.hidden + i % g.hidden] : bf16_t(0xffff);
      ASSERT_EQ(got[i], want) << "total " << total << " element " << i;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- home reductions ----

struct HomeCase {
  std::int64_t T, k, H, E;
  bool shared;
};

void PrintTo(const HomeCase& c, std::ostream* os) {
  *os << "T" << c.T << "_k" << c.k << "_H" << c.H << "_E" << c.E << (c.shared ? "_shared" : "");
}

class HomeReduceGpu : public ::testing::TestWithParam<HomeCase> {};

TEST_P(HomeReduceGpu, BitwiseTheReferenceOrder) {
  MOK_REQUIRE_HOPPER();
  const HomeCase c = GetParam();
  std::mt19937_64 rng(test_seed() + c.T);
  std::vector<std::int64_t> ids(c.T * c.k);
  std::uniform_int_distribution<std::int64_t> id(-1, c.E);  // includes -1 and the invalid E
  for (auto& v : ids) v = id(rng);
  std::vector<float> w(c.T * c.k);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : w) v = u(rng);
  const auto slots = random_bf16(c.T * c.k * c.H, rng);
  const auto shared = random_bf16(c.T * c.H, rng);
  DeviceBuffer<std::int64_t> d_ids(ids);
  DeviceBuffer<float> d_w(w);
  DeviceBuffer<bf16_t> d_slots(slots), d_shared(shared), out(c.T * c.H), dx(c.T * c.H);
  out.poison();
  dx.poison();
  HomeReduceParams p{c.T,         c.k,       c.H,           c.E,
                     d_ids.get(), d_w.get(), d_slots.get(), c.shared ? d_shared.get() : nullptr,
                     out.get()};
  MOK_CUDA_OK(cuda::launch_combine_reduce(p, nullptr));
  p.topk_weights = nullptr;
  p.out = dx.get();
  MOK_CUDA_OK(cuda::launch_dx_reduce(p, nullptr));
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto got_out = out.download(), got_dx = dx.download();
  for (std::int64_t t = 0; t < c.T; ++t) {
    for (std::int64_t h = 0; h < c.H; ++h) {
      float acc = c.shared ? bf16_to_float(shared[t * c.H + h]) : 0.0f;
      float sum = acc;
      for (std::int64_t j = 0; j < c.k; ++j) {
        const std::int64_t s = t * c.k + j;
        if (ids[s] < 0 || ids[s] >= c.E) continue;
        acc = std::fma(w[s], bf16_to_float(slots[s * c.H + h]), acc);
        sum = sum + bf16_to_float(slots[s * c.H + h]);
      }
      ASSERT_EQ(got_out[t * c.H + h], float_to_bf16(acc)) << "out t " << t << " h " << h;
      ASSERT_EQ(got_dx[t * c.H + h], float_to_bf16(sum)) << "d_x t " << t << " h " << h;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, HomeReduceGpu,
                         ::testing::Values(HomeCase{1, 1, 64, 1, false},
                                           HomeCase{257, 8, 192, 16, true},
                                           HomeCase{33, 2, 7168, 4, true},
                                           HomeCase{100, 3, 64, 2, false}));

// The router-weight gradient over W virtual ranks and several passes: each kept row's partials
// summed in chunk order on the expert side and pushed into its home slot, then copied out at home
// (0 for unused and invalid slots). Bitwise the host's float sum in the same order.
TEST(RouterGradGpu, PushOverPassesThenGatherIsTheChunkOrderSum) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(test_seed());
  for (int W : {1, 3}) {
    const RowGeometry g{.tokens = 45, .topk = 4, .hidden = 64, .ranks = W};
    const std::int64_t E = 6, slots = g.tokens * g.topk;
    const int chunks = 7;
    std::vector<std::vector<std::int64_t>> ids(W, std::vector<std::int64_t>(slots));
    std::uniform_int_distribution<std::int64_t> id(-1, E);  // -1 and the invalid E included
    std::vector<std::int32_t> srcs;
    for (int r = 0; r < W; ++r) {
      for (std::int64_t s = 0; s < slots; ++s) {
        ids[r][s] = id(rng);
        if (ids[r][s] >= 0 && ids[r][s] < E)
          srcs.push_back(static_cast<std::int32_t>(r * slots + s));
      }
    }
    std::shuffle(srcs.begin(), srcs.end(), rng);
    std::vector<std::int32_t> table;
    for (std::size_t i = 0; i < srcs.size(); ++i) {
      table.push_back(srcs[i]);
      if (i % 50 == 49) {
        while (table.size() % 128) table.push_back(-1);
      }
    }
    while (table.size() % 128) table.push_back(-1);
    const std::int64_t total = static_cast<std::int64_t>(table.size()), ring_rows = 256;
    std::vector<float> dot(total * chunks);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& v : dot) v = n(rng);
    DeviceBuffer<std::int32_t> d_table(table),
        d_total(std::vector<std::int32_t>{std::int32_t(total)});
    std::vector<std::unique_ptr<DeviceBuffer<float>>> home;
    std::vector<float*> home_ptrs;
    for (int r = 0; r < W; ++r) {
      home.push_back(std::make_unique<DeviceBuffer<float>>(slots));
      home.back()->poison();
      home_ptrs.push_back(home.back()->get());
    }
    DeviceBuffer<float*> peers(home_ptrs);
    DeviceBuffer<float> ring_dot(ring_rows * chunks);
    for (std::int64_t offset = 0; offset < total; offset += ring_rows) {
      std::vector<float> pass_dot(ring_rows * chunks, 0.0f);
      for (std::int64_t i = 0; i < ring_rows && offset + i < total; ++i) {
        std::copy_n(&dot[(offset + i) * chunks], chunks, &pass_dot[i * chunks]);
      }
      ring_dot.upload(pass_dot);
      cuda::RouterGradPushParams p{{d_table.get(), d_total.get(), offset, ring_rows},
                                   g,
                                   ring_dot.get(),
                                   chunks,
                                   peers.get()};
      MOK_CUDA_OK(cuda::launch_router_grad_push(p, nullptr));
    }
    for (int r = 0; r < W; ++r) {
      DeviceBuffer<std::int64_t> d_ids(ids[r]);
      DeviceBuffer<float> d_w(slots);
      d_w.poison();
      cuda::RouterGradGatherParams gp{g.tokens, g.topk, E, d_ids.get(), home[r]->get(), d_w.get()};
      MOK_CUDA_OK(cuda::launch_router_grad_gather(gp, nullptr));
      MOK_CUDA_OK(cudaDeviceSynchronize());
      const auto got = d_w.download();
      for (std::int64_t s = 0; s < slots; ++s) {
        float want = 0.0f;
        if (ids[r][s] >= 0 && ids[r][s] < E) {
          const auto at = std::find(table.begin(), table.end(), r * slots + s) - table.begin();
          for (int c = 0; c < chunks; ++c) want += dot[at * chunks + c];
        }
        ASSERT_EQ(got[s], want) << "W " << W << " rank " << r << " slot " << s;
      }
    }
  }
}

// Ring-relative segments of each pass, against the direct clipping on the host; every pass's rows
// together give each expert's count exactly once.
// Each pass's segments clip the schedule's; the pass plan (gemm::PassPlan steps) is checked
// against its meaning, not its formula: an expert's rows lie in consecutive passes, kWhole when
// they are one pass (an expert without rows: kWhole in exactly one pass), else kOpen, kCarry...,
// kClose; kSkip in every other pass; the carry slots of experts whose sums are open at the same
// time differ, and stay below min(passes - 1, E).
TEST(PassSegmentsGpu, ClipsTheScheduleToEachPassAndPlansTheCarries) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(test_seed());
  for (int E : {1, 5, 300}) {
    for (const std::int64_t M : {512, 128}) {
      std::vector<std::int32_t> counts(E), starts(E + 1, 0);
      for (int e = 0; e < E; ++e) {
        counts[e] = rng() % 3 == 0 ? 0 : static_cast<std::int32_t>(rng() % 700);
        starts[e + 1] = starts[e] + (counts[e] + 127) / 128 * 128;
      }
      const int passes = static_cast<int>(std::max<std::int64_t>(1, (starts[E] + M - 1) / M));
      const int slots = static_cast<int>(plan::carry_slots(passes, E));
      DeviceBuffer<std::int32_t> d_starts(starts), d_counts(counts), p_starts(E + 1), p_rows(E),
          p_steps(E);
      std::vector<std::int64_t> seen(E, 0);
      std::vector<std::vector<int>> step_of(E);  // [expert][pass]
      for (int pass = 0; pass < passes; ++pass) {
        const std::int64_t offset = pass * M;
        p_starts.poison();
        p_rows.poison();
        p_steps.poison();
        cuda::PassSegmentsParams p;
        p.segment_starts = d_starts.get();
        p.expert_counts = d_counts.get();
        p.num_experts = E;
        p.row_offset = offset;
        p.ring_rows = M;
        p.pass_starts = p_starts.get();
        p.pass_rows = p_rows.get();
        p.steps = p_steps.get();
        p.pass = pass;
        p.passes = passes;
        MOK_CUDA_OK(cuda::launch_pass_segments(p, nullptr));
        MOK_CUDA_OK(cudaDeviceSynchronize());
        const auto got_s = p_starts.download(), got_r = p_rows.download(),
                   got_p = p_steps.download();
        auto clip = [&](std::int64_t v) { return std::clamp<std::int64_t>(v - offset, 0, M); };
        for (int e = 0; e <= E; ++e) {
          ASSERT_EQ(got_s[e], clip(starts[e])) << "E " << E << " offset " << offset << " e " << e;
          ASSERT_EQ(got_s[e] % 128, 0);
          if (e == E) break;
          ASSERT_EQ(got_r[e], clip(std::int64_t{starts[e]} + counts[e]) - clip(starts[e]));
          seen[e] += got_r[e];
          step_of[e].push_back(got_p[e]);
        }
      }
      std::vector<int> open_slot_pass(std::max(slots, 1), -1);  // last pass each slot was open
      for (int e = 0; e < E; ++e) {
        ASSERT_EQ(seen[e], counts[e]) << "expert " << e;
        const auto& st = step_of[e];
        std::vector<int> active;
        for (int pass = 0; pass < passes; ++pass) {
          if ((st[pass] & 0xff) != gemm::kSkip) active.push_back(pass);
        }
        ASSERT_FALSE(active.empty()) << "expert " << e << " is skipped in every pass";
        ASSERT_EQ(active.back() - active.front() + 1, static_cast<int>(active.size()))
            << "expert " << e << ": passes not consecutive";
        if (active.size() == 1) {
          ASSERT_EQ(st[active[0]], gemm::kWhole) << "expert " << e;
          continue;
        }
        ASSERT_GT(counts[e], 0) << "expert " << e << " has no rows but spans passes";
        const int slot = st[active[0]] >> gemm::kPassSlotShift;
        ASSERT_GE(slot, 0);
        ASSERT_LT(slot, slots) << "expert " << e;
        for (std::size_t i = 0; i < active.size(); ++i) {
          const int want = i == 0                   ? gemm::kOpen
                           : i + 1 == active.size() ? gemm::kClose
                                                    : gemm::kCarry;
          ASSERT_EQ(st[active[i]], want | slot << gemm::kPassSlotShift)
              << "expert " << e << " pass " << active[i];
          ASSERT_GT(seen[e], 0);
        }
        // Experts come in row order: a slot is free again once its last expert closed.
        ASSERT_LT(open_slot_pass[slot], active.front()) << "slot " << slot << " shared";
        open_slot_pass[slot] = active.back();
      }
    }
  }
}

// ---- The FP8 layer's quantization of a pass (fused into the pull, and the pass quantizers) ----

// Bytes of a device buffer and of the host reference compared one by one; the first mismatch
// named by `what` and its index.
template <typename T>
void expect_same_bytes(const std::vector<T>& got, const std::vector<T>& want, std::size_t n,
                       const std::string& what) {
  ASSERT_GE(got.size(), n);
  ASSERT_GE(want.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " differs";
      return;
    }
  }
}

// The token-order pull with p.fp8_rows writes the ring the plain pull writes, bit for bit, and
// beside it each row's 1x128 blocks along H with the CPU reference's bits (mok::quantize_rows over
// the ring's rows of the pass), padding rows as zero blocks; rows past the pass untouched; and
// the pass quantizer (launch_quantize_pass_rows, the FP8 layer's rows form of h, dg and du) gives
// the same bytes from the plain ring. H of one and of more than one warp batch (with a partial
// one), W 1 and 3, every slot or 80% kept, several passes and one past the end.
TEST(TransferGpu, TokenOrderPullWithFp8RowsQuantizesAsTheReference) {
  MOK_REQUIRE_HOPPER();
  for (int W : {1, 3})
    for (std::int64_t hidden : {256, 2176})
      for (double keep : {1.0, 0.8}) {
        std::mt19937_64 rng(test_seed() + 29 * W + hidden);
        const RowGeometry g{.tokens = 45, .topk = 4, .hidden = hidden, .ranks = W};
        const std::vector<std::int32_t> table = random_table(g, keep, 128, rng);
        const std::int64_t total = static_cast<std::int64_t>(table.size());
        const std::int64_t R = 128 * 3, H = hidden, KB = hidden / 128;
        const std::int64_t slots = W * g.tokens * g.topk;
        Ranks x(W, g.tokens * g.hidden, rng);
        DeviceBuffer<std::int32_t> d_table(table),
            d_total(std::vector<std::int32_t>{std::int32_t(total)}),
            row_of_slot(inverse_of(table, slots));
        DeviceBuffer<bf16_t> plain(R * H), fused(R * H);
        DeviceBuffer<std::uint8_t> q_fused(R * H), q_pass(R * H);
        DeviceBuffer<float> s_fused(KB * R), s_pass(KB * R);
        const std::string what = "W " + std::to_string(W) + ", H " + std::to_string(hidden) +
                                 ", keep " + std::to_string(keep);
        for (std::int64_t offset = 0; offset < total + R; offset += R) {
          for (auto* b : {&q_fused, &q_pass}) b->poison();
          for (auto* b : {&s_fused, &s_pass}) b->poison();
          plain.poison();
          fused.poison();
          PullParams pull{{d_table.get(), d_total.get(), offset, R},
                          g,
                          reinterpret_cast<const void* const*>(x.peers.get()),
                          nullptr,
                          plain.get(),
                          nullptr};
          MOK_CUDA_OK(cuda::launch_pull_tokens(pull, row_of_slot.get(), nullptr));
          pull.ring = fused.get();
          pull.fp8_rows = q_fused.get();
          pull.fp8_scales = s_fused.get();
          MOK_CUDA_OK(cuda::launch_pull_tokens(pull, row_of_slot.get(), nullptr));
          const std::int64_t n = std::max<std::int64_t>(0, std::min(total - offset, R));
          DeviceBuffer<std::int32_t> row_end(std::vector<std::int32_t>{std::int32_t(n)});
          cuda::QuantizePassRowsParams qp;
          qp.x = reinterpret_cast<const std::uint16_t*>(plain.get());
          qp.ld_x = H;
          qp.rows = R;
          qp.K = H;
          qp.row_end = row_end.get();
          qp.data = q_pass.get();
          qp.ld = H;
          qp.scales = s_pass.get();
          qp.scale_ld = R;
          MOK_CUDA_OK(cuda::launch_quantize_pass_rows(qp, nullptr));
          MOK_CUDA_OK(cudaDeviceSynchronize());
          const std::string at = what + ", pass at " + std::to_string(offset);
          const auto ring = plain.download();
          expect_same_bytes(fused.download(), ring, ring.size(), at + ": the bf16 ring");
          // The reference over the pass's rows, laid out as the layer's buffers (scale ld R).
          std::vector<std::uint8_t> q_want(R * H, 0xff);
          std::vector<float> s_want(KB * R);
          std::memset(s_want.data(), 0xff, s_want.size() * sizeof(float));
          if (n > 0) {
            std::vector<bf16_t> rows(ring.begin(), ring.begin() + n * H);
            std::vector<float> s(KB * n);
            quantize_rows(TensorView::contiguous(rows.data(), DType::bf16, {n, H}),
                          TensorView::contiguous(q_want.data(), DType::fp8_e4m3, {n, H}),
                          TensorView::contiguous(s.data(), DType::f32, {KB, n}));
            for (std::int64_t kb = 0; kb < KB; ++kb) {
              for (std::int64_t i = 0; i < n; ++i) s_want[kb * R + i] = s[kb * n + i];
            }
          }
          expect_same_bytes(q_fused.download(), q_want, q_want.size(), at + ": fused e4m3");
          expect_same_bytes(s_fused.download(), s_want, s_want.size(), at + ": fused scales");
          expect_same_bytes(q_pass.download(), q_want, q_want.size(), at + ": pass e4m3");
          expect_same_bytes(s_pass.download(), s_want, s_want.size(), at + ": pass scales");
        }
      }
  PullParams half{};  // the FP8 outputs come both or neither, and need H a multiple of 128
  half.pass.ring_rows = 128;
  half.geo.hidden = 128;
  half.fp8_rows = reinterpret_cast<std::uint8_t*>(16);
  EXPECT_EQ(cuda::launch_pull_tokens(half, nullptr, nullptr), cudaErrorInvalidValue);
  half.fp8_scales = reinterpret_cast<float*>(16);
  half.geo.hidden = 192;
  EXPECT_EQ(cuda::launch_pull_tokens(half, nullptr, nullptr), cudaErrorInvalidValue);
}

// The token-axis quantizer of a pass: each group's rows [start, start + count) in 128-row blocks
// from its start, each block's scales from its real rows (the rest as zeros, whatever the ring
// holds there), the CPU reference's bits (mok::quantize_token_axis over the group's rows padded
// with zero rows); blocks past the last group untouched. Groups of 0, 1, 128, 129 and more rows,
// K of a few and of many 64-column tiles, a last tile cut short (200) and rows too odd for vector
// loads (100: 200-byte rows); with row weights, of the rows bf16(w x) (the layer's dy). Both
// kernels (QuantizePassTokenAxisParams::row_loads), the same bits.
TEST(Fp8PassGpu, TokenAxisQuantizesEachGroupFromItsRows) {
  MOK_REQUIRE_HOPPER();
  struct Case {
    std::int64_t K;
    bool weighted, row_loads;
  };
  std::vector<Case> cases;
  for (const bool row_loads : {false, true}) {
    for (const auto [K, weighted] : {std::pair<std::int64_t, bool>{192, false}, {2176, false},
                                     {192, true}, {2176, true}, {200, false}, {100, true}}) {
      cases.push_back({K, weighted, row_loads});
    }
  }
  for (const auto [K, weighted, row_loads] : cases) {
    std::mt19937_64 rng(test_seed() + K + weighted);
    const std::vector<std::int32_t> counts = {0, 1, 129, 0, 128, 300, 37};
    const int G = static_cast<int>(counts.size());
    std::vector<std::int32_t> starts(G + 1, 0);
    for (int gi = 0; gi < G; ++gi) starts[gi + 1] = starts[gi] + (counts[gi] + 127) / 128 * 128;
    const std::int64_t R = starts[G] + 256;                 // two blocks past the last group
    const std::vector<bf16_t> x = random_bf16(R * K, rng);  // padding rows hold values too
    std::vector<float> w(R);
    std::uniform_real_distribution<float> weight(-2.0f, 2.0f);
    for (float& v : w) v = weight(rng);
    DeviceBuffer<bf16_t> d_x(x);
    DeviceBuffer<float> d_w(w);
    DeviceBuffer<std::int32_t> d_starts(starts), d_counts(counts);
    DeviceBuffer<std::uint8_t> data(K * R);
    DeviceBuffer<float> scales(R / 128 * K);
    data.poison();
    scales.poison();
    cuda::QuantizePassTokenAxisParams p;
    p.x = reinterpret_cast<const std::uint16_t*>(d_x.get());
    p.ld_x = K;
    p.rows = R;
    p.K = K;
    p.starts = d_starts.get();
    p.counts = d_counts.get();
    p.groups = G;
    p.data = data.get();
    p.ld = R;
    p.scales = scales.get();
    p.scale_ld = K;
    p.row_weights = weighted ? d_w.get() : nullptr;
    p.row_loads = row_loads;
    MOK_CUDA_OK(cuda::launch_quantize_pass_token_axis(p, nullptr));
    MOK_CUDA_OK(cudaDeviceSynchronize());
    std::vector<std::uint8_t> q_want(K * R, 0xff);
    std::vector<float> s_want(R / 128 * K);
    std::memset(s_want.data(), 0xff, s_want.size() * sizeof(float));
    for (int gi = 0; gi < G; ++gi) {
      const std::int64_t c = counts[gi], Mp = (c + 127) / 128 * 128, s0 = starts[gi];
      if (c == 0) continue;
      std::vector<bf16_t> rows(Mp * K, float_to_bf16(0.0f));
      std::copy(x.begin() + s0 * K, x.begin() + (s0 + c) * K, rows.begin());
      if (weighted) {  // dy = bf16(w d_out): one float multiply, one rounding
        for (std::int64_t m = 0; m < c; ++m) {
          for (std::int64_t k = 0; k < K; ++k) {
            bf16_t& v = rows[m * K + k];
            v = float_to_bf16(w[s0 + m] * bf16_to_float(v));
          }
        }
      }
      std::vector<std::uint8_t> q(K * Mp);
      std::vector<float> s(Mp / 128 * K);
      quantize_token_axis(TensorView::contiguous(rows.data(), DType::bf16, {Mp, K}),
                          TensorView::contiguous(q.data(), DType::fp8_e4m3, {K, Mp}),
                          TensorView::contiguous(s.data(), DType::f32, {Mp / 128, K}));
      for (std::int64_t k = 0; k < K; ++k) {
        for (std::int64_t m = 0; m < Mp; ++m) q_want[k * R + s0 + m] = q[k * Mp + m];
      }
      for (std::int64_t mb = 0; mb < Mp / 128; ++mb) {
        for (std::int64_t k = 0; k < K; ++k) s_want[(s0 / 128 + mb) * K + k] = s[mb * K + k];
      }
    }
    const std::string what = "K " + std::to_string(K) + (weighted ? ", row weights" : "") +
                             (row_loads ? ", row loads" : "");
    expect_same_bytes(data.download(), q_want, q_want.size(), what + ": e4m3");
    expect_same_bytes(scales.download(), s_want, s_want.size(), what + ": scales");
  }
}

// The rows quantizer of a pass: rows before *row_end in 1x128 blocks along K, the CPU
// reference's bits (mok::quantize_rows over those rows); rows from *row_end on untouched. An odd
// number of blocks, so that the last warp's second half-warp has none.
TEST(Fp8PassGpu, RowsQuantizesTheRowsBeforeTheEnd) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(test_seed());
  const std::int64_t R = 300, K = 384, ld_x = K + 64;
  const std::int32_t end = 257;  // 257 * 3 blocks
  const std::vector<bf16_t> x = random_bf16(R * ld_x, rng);
  DeviceBuffer<bf16_t> d_x(x);
  DeviceBuffer<std::int32_t> d_end(std::vector<std::int32_t>{end});
  DeviceBuffer<std::uint8_t> data(R * K);
  DeviceBuffer<float> scales(K / 128 * R);
  data.poison();
  scales.poison();
  cuda::QuantizePassRowsParams p;
  p.x = reinterpret_cast<const std::uint16_t*>(d_x.get());
  p.ld_x = ld_x;
  p.rows = R;
  p.K = K;
  p.row_end = d_end.get();
  p.data = data.get();
  p.ld = K;
  p.scales = scales.get();
  p.scale_ld = R;
  MOK_CUDA_OK(cuda::launch_quantize_pass_rows(p, nullptr));
  MOK_CUDA_OK(cudaDeviceSynchronize());
  std::vector<bf16_t> rows(end * K);
  for (std::int64_t m = 0; m < end; ++m) {
    std::copy(x.begin() + m * ld_x, x.begin() + m * ld_x + K, rows.begin() + m * K);
  }
  std::vector<std::uint8_t> q(end * K);
  std::vector<float> s(K / 128 * end);
  quantize_rows(TensorView::contiguous(rows.data(), DType::bf16, {end, K}),
                TensorView::contiguous(q.data(), DType::fp8_e4m3, {end, K}),
                TensorView::contiguous(s.data(), DType::f32, {K / 128, end}));
  std::vector<std::uint8_t> q_want(R * K, 0xff);
  std::vector<float> s_want(K / 128 * R);
  std::memset(s_want.data(), 0xff, s_want.size() * sizeof(float));
  std::copy(q.begin(), q.end(), q_want.begin());
  for (std::int64_t kb = 0; kb < K / 128; ++kb) {
    for (std::int64_t m = 0; m < end; ++m) s_want[kb * R + m] = s[kb * end + m];
  }
  expect_same_bytes(data.download(), q_want, q_want.size(), "e4m3");
  expect_same_bytes(scales.download(), s_want, s_want.size(), "scales");
}

}  // namespace
}  // namespace mok::test
