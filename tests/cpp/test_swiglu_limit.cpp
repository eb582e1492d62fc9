// Clamped SwiGLU (Weights::swiglu_limit, core/numerics.hpp) on the CPU reference: the scalar
// semantics at and around the clamp, exact gradients of the f64 layer (finite differences), the
// bf16 layer against the f64 layer with limits that clamp both sides, a limit too large to act
// giving the unclamped bits, thread-count determinism, and the errors.
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "core/bf16.hpp"
#include "core/numerics.hpp"
#include "layer_helpers.hpp"

namespace mok::test {
namespace {

// ---- the scalar function ----

TEST(SwigluLimit, ScalarForwardClampsGateAboveAndUpBothSides) {
  const double L = 1.0;
  // gate below L and u inside: the plain form.
  EXPECT_EQ(numerics::swiglu_clamped(0.25, 0.5, L), numerics::swiglu(0.25, 0.5));
  // gate above L: silu(L).
  EXPECT_EQ(numerics::swiglu_clamped(3.0, 0.5, L), numerics::swiglu(1.0, 0.5));
  // a very negative gate is not clamped from below.
  EXPECT_EQ(numerics::swiglu_clamped(-9.0, 0.5, L), numerics::swiglu(-9.0, 0.5));
  // up clamped to [-L, L].
  EXPECT_EQ(numerics::swiglu_clamped(0.25, 5.0, L), numerics::swiglu(0.25, 1.0));
  EXPECT_EQ(numerics::swiglu_clamped(0.25, -5.0, L), numerics::swiglu(0.25, -1.0));
  EXPECT_EQ(numerics::swiglu_clamped(2.0, -5.0, L), numerics::swiglu(1.0, -1.0));
}

TEST(SwigluLimit, ScalarGradientsZeroOutsideAndFlowingAtTheBoundary) {
  const double L = 1.0, dh = 0.75;
  auto grads = [&](double g, double u) {
    std::pair<double, double> r;
    numerics::swiglu_backward_clamped(g, u, dh, L, &r.first, &r.second);
    return r;
  };
  auto plain = [&](double g, double u) {
    std::pair<double, double> r;
    numerics::swiglu_backward(g, u, dh, &r.first, &r.second);
    return r;
  };
  EXPECT_EQ(grads(0.25, 0.5), plain(0.25, 0.5));    // inside: unchanged
  EXPECT_EQ(grads(1.0, 0.5), plain(1.0, 0.5));      // g == L: gradient flows (torch.clamp's rule)
  EXPECT_EQ(grads(0.25, 1.0), plain(0.25, 1.0));    // u == L
  EXPECT_EQ(grads(0.25, -1.0), plain(0.25, -1.0));  // u == -L
  // g > L: no gate gradient; du uses silu(L).
  EXPECT_EQ(grads(1.5, 0.5).first, 0.0);
  EXPECT_EQ(grads(1.5, 0.5).second, plain(1.0, 0.5).second);
  // |u| > L: no up gradient; dg uses the clamped u.
  EXPECT_EQ(grads(0.25, 4.0).second, 0.0);
  EXPECT_EQ(grads(0.25, 4.0).first, plain(0.25, 1.0).first);
  EXPECT_EQ(grads(0.25, -4.0).second, 0.0);
  EXPECT_EQ(grads(0.25, -4.0).first, plain(0.25, -1.0).first);
  // both clamped: both zero.
  EXPECT_EQ(grads(2.0, 3.0), std::make_pair(0.0, 0.0));
  // float: the same rules.
  float dg, du;
  numerics::swiglu_backward_clamped(7.0f, -7.0f, 1.0f, 7.0f, &dg, &du);
  EXPECT_NE(dg, 0.0f);
  EXPECT_NE(du, 0.0f);
  numerics::swiglu_backward_clamped(7.0625f, -7.0625f, 1.0f, 7.0f, &dg, &du);
  EXPECT_EQ(dg, 0.0f);
  EXPECT_EQ(du, 0.0f);
}

// ---- the layer ----

// Gate and up weights (routed and shared) scaled by 4: g and u ~ N(0, 16), so limits from 0.5 to
// 7 clamp a good share of the values on every side. 4 is a power of two: bf16 stays exact.
LayerData wide_layer(const Problem& p, DType act, std::uint64_t seed, Routing r) {
  LayerData d = make_layer_data(p, act, seed, r);
  for (HostTensor* t : {&d.gate, &d.up, &d.shared_gate, &d.shared_up}) {
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 4.0 * t->get(i));
  }
  return d;
}

struct ClampCounts {
  std::int64_t gate_above = 0, gate_at = 0, up_above = 0, up_below = 0, up_at = 0, total = 0;
};

// Runs forward and backward on the CPU backend and counts, in the context's g and u of every
// used routed row and of the shared expert, how many the clamp acts on.
ClampCounts run_and_count(LayerData& d, int threads = 0) {
  Workspace ws(d.problem, Config{},
               {.backend = Backend::cpu, .activation_dtype = d.act, .num_threads = threads});
  HostContext ctx(ws);
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads());
  ClampCounts c;
  if (!d.swiglu_limit) return c;
  const double L = *d.swiglu_limit;
  auto count = [&](const TensorView& gv, const TensorView& uv, std::int64_t row, std::int64_t n) {
    for (std::int64_t i = row * n; i < (row + 1) * n; ++i) {
      const double g = d.act == DType::f64 ? gv.ptr<const double>()[i]
                                           : bf16_to_float(gv.ptr<const bf16_t>()[i]);
      const double u = d.act == DType::f64 ? uv.ptr<const double>()[i]
                                           : bf16_to_float(uv.ptr<const bf16_t>()[i]);
      c.gate_above += g > L;
      c.gate_at += g == L;
      c.up_above += u > L;
      c.up_below += u < -L;
      c.up_at += u == L || u == -L;
      ++c.total;
    }
  };
  const Problem& p = d.problem;
  for (std::int64_t s = 0; s < p.num_tokens * p.topk; ++s) {
    if (d.topk_experts.get(s) >= 0) {
      count(ctx.get().gate_routed, ctx.get().up_routed, s, p.intermediate_size);
    }
  }
  for (std::int64_t t = 0; t < p.num_tokens && p.has_shared_expert(); ++t) {
    count(ctx.get().gate_shared, ctx.get().up_shared, t, p.shared_intermediate_size);
  }
  return c;
}

// loss = <out, d_out> in f64 (forward only).
double loss_of(LayerData& d) {
  Workspace ws(d.problem, Config{},
               {.backend = Backend::cpu, .activation_dtype = DType::f64, .num_threads = 1});
  HostContext ctx(ws);
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  double l = 0;
  for (std::int64_t i = 0; i < d.out.numel(); ++i) l += d.out.get(i) * d.d_out.get(i);
  return l;
}

// Central differences in f64: truncation ~eps^2 relative, rounding ~1e-16 |loss| / eps in
// absolute terms. The clamp zeroes many gradient entries, so a gradient's norm can be 10-100x
// below the loss's scale and the rounding term reaches ~1e-7 of it (seen: 1.4e-7); 1e-6 keeps
// a margin, and any wrong rule at the clamp is an O(1) error. Random normal data puts no g or u
// within eps of a kink of the clamp (probability ~1e-5 per layer).
void check_gradient(LayerData& d, HostTensor& param, const HostTensor& grad, const char* name) {
  check_gradient_by_differences(param, grad, name, [&] { return loss_of(d); }, 1e-6);
}

TEST(SwigluLimit, F64LayerGradientsMatchFiniteDifferences) {
  const Problem p = {.num_tokens = 6,
                     .hidden_size = 5,
                     .intermediate_size = 4,
                     .num_experts = 3,
                     .topk = 2,
                     .shared_intermediate_size = 3};
  for (float limit : {0.5f, 1.0f, 7.0f}) {
    LayerData d = wide_layer(p, DType::f64, test_seed(), Routing::softmax);
    d.swiglu_limit = limit;
    const ClampCounts c = run_and_count(d);
    if (limit < 7.0f) {  // random N(0, 16) values: both sides clamp at 0.5 and 1 for sure
      EXPECT_GT(c.gate_above, 0) << limit;
      EXPECT_GT(c.up_above + c.up_below, 0) << limit;
    }
    LayerData probe = d;
    check_gradient(probe, probe.x, d.d_x, "d_x");
    check_gradient(probe, probe.topk_weights, d.d_topk_weights, "d_topk_weights");
    check_gradient(probe, probe.gate, d.d_gate, "d_routed_gate_weights");
    check_gradient(probe, probe.up, d.d_up, "d_routed_up_weights");
    check_gradient(probe, probe.down, d.d_down, "d_routed_down_weights");
    check_gradient(probe, probe.shared_gate, d.d_shared_gate, "d_shared_gate_weights");
    check_gradient(probe, probe.shared_up, d.d_shared_up, "d_shared_up_weights");
    check_gradient(probe, probe.shared_down, d.d_shared_down, "d_shared_down_weights");
  }
}

struct LimitCase {
  const char* name;
  float limit;
  Routing routing;
};

void PrintTo(const LimitCase& c, std::ostream* os) {
  *os << c.name;
}

class SwigluLimitBf16 : public ::testing::TestWithParam<LimitCase> {};

TEST_P(SwigluLimitBf16, MatchesF64EveryOutputAndGradient) {
  const LimitCase& c = GetParam();
  const Problem p = layer_shape(97, 64, 128, 5, 2, 64);
  LayerData d = grid_layer(p, test_seed(), c.routing);
  d.swiglu_limit = c.limit;
  const ClampCounts n = run_and_count(d);
  // The clamp really acts, on both sides, and some values sit exactly on the limit.
  EXPECT_GT(n.gate_above, n.total / 50) << "gate above L";
  EXPECT_GT(n.up_above, n.total / 100) << "u above L";
  EXPECT_GT(n.up_below, n.total / 100) << "u below -L";
  EXPECT_GT(n.gate_at + n.up_at, 0) << "values exactly at the limit";
  for (const HostTensor* t : {&d.out, &d.d_x, &d.d_topk_weights, &d.d_gate, &d.d_up, &d.d_down,
                              &d.d_shared_gate, &d.d_shared_up, &d.d_shared_down}) {
    EXPECT_TRUE(all_finite(*t));
  }
  // check_against_f64 runs the f64 layer with the same limit (convert_layer_data keeps it).
  const CheckReport full = check_against_f64(d);
  EXPECT_FALSE(full.sampled);
  EXPECT_TRUE(full.passed()) << full.summary();
  CheckOptions sampled;
  sampled.max_full_flops = 0;
  const CheckReport part = check_against_f64(d, sampled);
  EXPECT_TRUE(part.passed()) << part.summary();
  // And the clamp matters: the unclamped f64 layer is far from this result.
  LayerData plain = d;
  plain.swiglu_limit.reset();
  EXPECT_FALSE(check_against_f64(plain).passed()) << "the limit changed nothing?";
  std::printf(
      "[ mok ] L = %g: %lld of %lld g above L, %lld u outside [-L, L], %lld at +-L; "
      "out %.2e, grads max %.2e\n",
      c.limit, static_cast<long long>(n.gate_above), static_cast<long long>(n.total),
      static_cast<long long>(n.up_above + n.up_below), static_cast<long long>(n.gate_at + n.up_at),
      full.out_rel_err(), full.grad_rel_err_max());
}

INSTANTIATE_TEST_SUITE_P(Limits, SwigluLimitBf16,
                         ::testing::Values(LimitCase{"half", 0.5f, Routing::softmax},
                                           LimitCase{"one", 1.0f, Routing::skewed},
                                           LimitCase{"seven", 7.0f, Routing::softmax},
                                           LimitCase{"seven_one_expert", 7.0f,
                                                     Routing::one_expert}),
                         [](const auto& info) { return std::string(info.param.name); });

// A limit no value reaches gives the unclamped layer's bits, in both precisions.
TEST(SwigluLimit, InactiveLimitIsBitwiseTheUnclampedLayer) {
  const Problem p = layer_shape(61, 64, 128, 4, 3, 64);
  const std::uint64_t seed = test_seed();
  for (DType act : {DType::bf16, DType::f64}) {
    LayerData plain = wide_layer(p, act, seed, Routing::softmax);
    run_layer(plain);
    for (float limit : {1.0e6f, std::numeric_limits<float>::max()}) {
      LayerData clamped = wide_layer(p, act, seed, Routing::softmax);
      clamped.swiglu_limit = limit;
      const ClampCounts c = run_and_count(clamped);
      EXPECT_EQ(c.gate_above + c.up_above + c.up_below, 0);
      EXPECT_TRUE(all_outputs_same(plain, clamped)) << dtype_name(act) << " L = " << limit;
    }
  }
}

TEST(SwigluLimit, BitwiseAcrossThreadCountsAndRuns) {
  const Problem p = layer_shape(131, 64, 128, 6, 3, 64);
  const std::uint64_t seed = test_seed();
  LayerData base = wide_layer(p, DType::bf16, seed, Routing::skewed);
  base.swiglu_limit = 1.0f;
  run_and_count(base, 1);
  for (int threads : {2, 3, 8}) {
    LayerData d = wide_layer(p, DType::bf16, seed, Routing::skewed);
    d.swiglu_limit = 1.0f;
    run_and_count(d, threads);
    EXPECT_TRUE(all_outputs_same(base, d)) << "threads " << threads;
  }
}

TEST(SwigluLimit, BadLimitsRaiseNamingTheValue) {
  const Problem p = layer_shape(8, 64, 64, 2, 1, 64);
  LayerData d = make_layer_data(p, DType::bf16, test_seed());
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  HostContext ctx(ws);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {-1.0f, 0.0f, -0.0f, nan, inf, -inf}) {
    d.swiglu_limit = bad;
    const std::string value = to_text(bad);
    expect_error([&] { forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get()); },
                 {"swiglu_limit", "finite positive", value});
    expect_error([&] { recompute_forward_context(ws, d.inputs(), d.weights(), ctx.get()); },
                 {"swiglu_limit", value});
    expect_error(
        [&] { backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads()); },
        {"swiglu_limit", value});
  }
  // The workspace is fine afterwards.
  d.swiglu_limit = 2.0f;
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads());
}

// The context holds unclamped g and u and a clamped h: a backward under another limit (or none)
// would be silently wrong, so it is refused.
TEST(SwigluLimit, BackwardRefusesAContextOfAnotherLimit) {
  const Problem p = layer_shape(8, 64, 64, 2, 1, 64);
  LayerData d = make_layer_data(p, DType::bf16, test_seed());
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  HostContext ctx(ws);
  d.swiglu_limit = 7.0f;
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  d.swiglu_limit = 1.0f;
  expect_error([&] { backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads()); },
               {"swiglu_limit", "forward context's swiglu_limit = 7", "got 1"});
  d.swiglu_limit.reset();
  expect_error([&] { backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads()); },
               {"swiglu_limit", "= 7", "got None"});
  d.swiglu_limit = 7.0f;
  backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads());
  // recompute_forward_context records its limit too.
  d.swiglu_limit.reset();
  recompute_forward_context(ws, d.inputs(), d.weights(), ctx.get());
  d.swiglu_limit = 7.0f;
  expect_error([&] { backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads()); },
               {"swiglu_limit", "= None", "got 7"});
}

}  // namespace
}  // namespace mok::test
