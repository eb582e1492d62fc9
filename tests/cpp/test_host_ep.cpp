// Host expert parallelism (include/mok/host_ep.hpp), with W ranks simulated in one process: the
// gathers are the global tensors themselves (every rank's concatenated in rank order), the
// all-to-all is a copy of rows. Every output and gradient must equal, bit for bit, the W = 1 run
// over all tokens and all experts; the shared expert's weight gradients those of a W = 1 run over
// the rank's own tokens.
#include <cstring>
#include <numeric>
#include <vector>

#include "layer_helpers.hpp"
#include "mok/host_ep.hpp"

namespace mok::test {
namespace {

// Rows [first, first + count) of a row-major view (the first dimension).
TensorView rows_of(const TensorView& v, std::int64_t first, std::int64_t count) {
  TensorView r = v;
  std::int64_t row_elems = 1;
  for (int d = 1; d < v.ndim; ++d) row_elems *= v.shape[d];
  r.data = static_cast<char*>(v.data) + first * row_elems * dtype_size(v.dtype);
  r.shape[0] = count;
  return r;
}

// A poisoned host buffer: NaN in floating dtypes, so a row nobody wrote shows.
HostTensor poisoned(DType dtype, std::initializer_list<std::int64_t> shape) {
  HostTensor t(dtype, shape);
  t.fill_bytes(0xff);
  return t;
}

bool same_bits(const TensorView& a, const TensorView& b) {
  return a.numel() == b.numel() && a.dtype == b.dtype &&
         std::memcmp(a.data, b.data, a.numel() * dtype_size(a.dtype)) == 0;
}

// One rank's tensors that are not views of the global data.
struct Rank {
  Problem p;
  std::unique_ptr<Workspace> ws;
  std::unique_ptr<HostContext> ctx;
  host_ep::ExchangeCounts counts;
  HostTensor send, dw_send, received, dw_received;
  HostTensor out, d_x, d_topk_weights, d_gate, d_up, d_down, d_shared_gate, d_shared_up,
      d_shared_down;
};

// The all-to-all: rank r receives, from each q in order, the rows q's send buffer holds for r.
void all_to_all(std::vector<Rank>& ranks, HostTensor Rank::*send, HostTensor Rank::*received,
                std::int64_t row_elems) {
  const int W = static_cast<int>(ranks.size());
  for (int r = 0; r < W; ++r) {
    std::int64_t at = 0;
    for (int q = 0; q < W; ++q) {
      const auto& sq = ranks[q].counts.send;
      const std::int64_t first = std::accumulate(sq.begin(), sq.begin() + r, std::int64_t{0});
      ASSERT_EQ(sq[r], ranks[r].counts.receive[q]) << "rank " << q << " -> rank " << r;
      const TensorView from = (ranks[q].*send).view();
      const std::size_t bytes = row_elems * dtype_size(from.dtype);
      std::memcpy(static_cast<char*>((ranks[r].*received).view().data) + at * bytes,
                  static_cast<const char*>(from.data) + first * bytes, sq[r] * bytes);
      at += sq[r];
    }
  }
}

struct Case {
  std::int64_t T, H, I, E, k, S;
  int W;
  DType act;
  Routing routing;
  bool unused_slots;
};

void run_case(const Case& c) {
  SCOPED_TRACE(testing::Message() << "W=" << c.W << " T=" << c.T << " E=" << c.E << " k=" << c.k
                                  << " S=" << c.S << " " << dtype_name(c.act) << " "
                                  << routing_name(c.routing));
  const std::int64_t T = c.T, H = c.H, I = c.I, E = c.E, k = c.k, S = c.S, W = c.W;
  const std::int64_t El = E / W;
  const std::uint64_t seed = test_seed();
  // The global problem, run on one rank with every expert: the expected bits.
  LayerData g = make_layer_data(layer_shape(W * T, H, I, E, k, S), c.act, seed, c.routing);
  if (c.unused_slots) {
    for (std::int64_t s = 2; s < W * T * k; s += 5) g.topk_experts.set(s, -1);
  }
  run_layer(g, 2);

  std::vector<Rank> ranks(W);
  auto own = [&](const HostTensor& t, int r) { return rows_of(t.view(), r * T, T); };
  auto local = [&](const HostTensor& t, int r) { return rows_of(t.view(), r * El, El); };
  auto weights_of = [&](int r) {
    Weights w = g.weights();
    w.gate = local(g.gate, r);
    w.up = local(g.up, r);
    w.down = local(g.down, r);
    return w;
  };
  const Inputs gathered = g.inputs();
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    rk.p = layer_shape(T, H, I, E, k, S);
    rk.p.ep_size = c.W;
    rk.p.ep_rank = r;
    rk.ws = std::make_unique<Workspace>(
        rk.p, Config{},
        WorkspaceOptions{.backend = Backend::cpu, .activation_dtype = c.act, .num_threads = 2});
    rk.ctx = std::make_unique<HostContext>(*rk.ws);
    rk.counts = host_ep::exchange_counts(*rk.ws, gathered.topk_experts);
    const std::int64_t n_send = std::accumulate(rk.counts.send.begin(), rk.counts.send.end(), 0L);
    const std::int64_t n_recv =
        std::accumulate(rk.counts.receive.begin(), rk.counts.receive.end(), 0L);
    const DType rd = c.act == DType::f64 ? DType::f64 : DType::f32;
    rk.send = poisoned(c.act, {n_send, H});
    rk.dw_send = poisoned(rd, {n_send});
    rk.received = poisoned(c.act, {n_recv, H});
    rk.dw_received = poisoned(rd, {n_recv});
    rk.out = poisoned(c.act, {T, H});
    rk.d_x = poisoned(c.act, {T, H});
    rk.d_topk_weights = poisoned(rd, {T, k});
    rk.d_gate = poisoned(c.act, {El, I, H});
    rk.d_up = poisoned(c.act, {El, I, H});
    rk.d_down = poisoned(c.act, {El, H, I});
    if (S > 0) {
      rk.d_shared_gate = poisoned(c.act, {S, H});
      rk.d_shared_up = poisoned(c.act, {S, H});
      rk.d_shared_down = poisoned(c.act, {H, S});
    }
    host_ep::expert_forward(*rk.ws, gathered, weights_of(r), rk.send.view(), rk.ctx->get());
  }
  all_to_all(ranks, &Rank::send, &Rank::received, H);
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    const Inputs in{own(g.x, r), own(g.topk_experts, r), own(g.topk_weights, r)};
    host_ep::home_forward(*rk.ws, in, weights_of(r), rk.received.view(), rk.out.view(),
                          rk.ctx->get());
    EXPECT_TRUE(same_bits(rk.out.view(), own(g.out, r))) << "out of rank " << r;
  }

  // Backward: the send buffers are reused for dx rows, poisoned again.
  auto grads_of = [](Rank& rk) {
    return Grads{rk.d_x.view(),         rk.d_topk_weights.view(), rk.d_gate.view(),
                 rk.d_up.view(),        rk.d_down.view(),         rk.d_shared_gate.view(),
                 rk.d_shared_up.view(), rk.d_shared_down.view()};
  };
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    rk.send.fill_bytes(0xff);
    rk.received.fill_bytes(0xff);
    host_ep::expert_backward(*rk.ws, gathered, weights_of(r), rk.ctx->get(), g.d_out.view(),
                             rk.send.view(), rk.dw_send.view(), grads_of(rk));
  }
  all_to_all(ranks, &Rank::send, &Rank::received, H);
  all_to_all(ranks, &Rank::dw_send, &Rank::dw_received, 1);
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    const Inputs in{own(g.x, r), own(g.topk_experts, r), own(g.topk_weights, r)};
    host_ep::home_backward(*rk.ws, in, weights_of(r), rk.ctx->get(), own(g.d_out, r),
                           rk.received.view(), rk.dw_received.view(), grads_of(rk));
    EXPECT_TRUE(same_bits(rk.d_x.view(), own(g.d_x, r))) << "d_x of rank " << r;
    EXPECT_TRUE(same_bits(rk.d_topk_weights.view(), own(g.d_topk_weights, r)))
        << "d_topk_weights of rank " << r;
    EXPECT_TRUE(same_bits(rk.d_gate.view(), local(g.d_gate, r))) << "d_gate of rank " << r;
    EXPECT_TRUE(same_bits(rk.d_up.view(), local(g.d_up, r))) << "d_up of rank " << r;
    EXPECT_TRUE(same_bits(rk.d_down.view(), local(g.d_down, r))) << "d_down of rank " << r;
    EXPECT_EQ(rk.ws->call_counts().forward, 1);
    EXPECT_EQ(rk.ws->call_counts().backward, 1);
    if (S == 0) continue;
    // The shared expert is a data-parallel replica: its gradients are those of this rank's tokens.
    LayerData mine = make_layer_data(layer_shape(T, H, I, E, k, S), c.act, seed + 1);
    for (auto [dst, src] : {std::pair{&mine.x, &g.x},
                            {&mine.topk_experts, &g.topk_experts},
                            {&mine.topk_weights, &g.topk_weights},
                            {&mine.d_out, &g.d_out}}) {
      const TensorView from = own(*src, r);
      std::memcpy(dst->view().data, from.data, from.numel() * dtype_size(from.dtype));
    }
    for (auto [dst, src] : {std::pair{&mine.gate, &g.gate},
                            {&mine.up, &g.up},
                            {&mine.down, &g.down},
                            {&mine.shared_gate, &g.shared_gate},
                            {&mine.shared_up, &g.shared_up},
                            {&mine.shared_down, &g.shared_down}}) {
      std::memcpy(dst->view().data, src->view().data, src->numel() * dtype_size(c.act));
    }
    run_layer(mine, 2);
    EXPECT_TRUE(same_bits(rk.d_shared_gate.view(), mine.d_shared_gate.view())) << "rank " << r;
    EXPECT_TRUE(same_bits(rk.d_shared_up.view(), mine.d_shared_up.view())) << "rank " << r;
    EXPECT_TRUE(same_bits(rk.d_shared_down.view(), mine.d_shared_down.view())) << "rank " << r;
  }
}

TEST(HostEp, BitwiseTheOneRankLayer) {
  for (int W : {1, 2, 4}) {
    run_case({37, 64, 64, 8, 3, 64, W, DType::bf16, Routing::softmax, false});
    run_case({16, 64, 128, 8, 2, 0, W, DType::bf16, Routing::skewed, true});
  }
}

TEST(HostEp, AllRowsToOneRanksExpert) {
  // Every slot on expert 0: rank 0 computes everything, the other ranks' experts are empty.
  run_case({21, 64, 64, 8, 2, 64, 4, DType::bf16, Routing::one_expert, false});
}

TEST(HostEp, ExactModeAndOneToken) {
  run_case({1, 8, 4, 6, 2, 4, 3, DType::f64, Routing::softmax, true});
}

TEST(HostEp, ErrorsNameTheRankAndTheBuffer) {
  Problem p = layer_shape(4, 64, 64, 4, 2, 0);
  p.ep_size = 2;
  p.ep_rank = 1;
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  LayerData g = make_layer_data(layer_shape(8, 64, 64, 4, 2, 0), DType::bf16, test_seed());
  g.topk_experts.set(4 * 2 + 3, 9);  // rank 1, token 1, slot 1
  expect_error([&] { host_ep::exchange_counts(ws, g.topk_experts.view()); },
               {"topk_experts[1, 1] of rank 1", "[-1, 4)", "got 9"});
  g.topk_experts.set(4 * 2 + 3, 0);
  HostContext ctx(ws);
  HostTensor wrong(DType::bf16, {3, 32});  // never [rows sent, H]: its width is not H
  Weights w = g.weights();
  w.gate = rows_of(w.gate, 2, 2);
  w.up = rows_of(w.up, 2, 2);
  w.down = rows_of(w.down, 2, 2);
  expect_error([&] { host_ep::expert_forward(ws, g.inputs(), w, wrong.view(), ctx.get()); },
               {"combine_send.shape"});
  Inputs own = g.inputs();
  own.x = rows_of(own.x, 0, 4);
  expect_error([&] { host_ep::expert_forward(ws, own, w, wrong.view(), ctx.get()); },
               {"x_all.shape", "[8, 64]"});
  // The one-rank entry points refuse a workspace of several ranks.
  HostTensor out(DType::bf16, {4, 64});
  expect_error([&] { forward(ws, own, w, out.view(), ctx.get()); },
               {"ep_size", "mok::host_ep", "got 2"});
}

}  // namespace
}  // namespace mok::test
