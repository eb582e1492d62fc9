// The CPU reference: exact gradients (finite differences in f64), bf16 accuracy against f64,
// bitwise determinism, and the edge cases of DESIGN.md section 1.
#include <functional>
#include <memory>
#include <vector>

#include "layer_helpers.hpp"

namespace mok::test {
namespace {

Problem tiny_f64(std::int64_t T, std::int64_t E, std::int64_t k, std::int64_t S) {
  return {.num_tokens = T,
          .hidden_size = 5,
          .intermediate_size = 4,
          .num_experts = E,
          .topk = k,
          .shared_intermediate_size = S};
}

// loss = <out, d_out> in f64.
double loss_of(LayerData& d) {
  run_layer(d, 1, /*backward_too=*/false);
  double l = 0;
  for (std::int64_t i = 0; i < d.out.numel(); ++i) l += d.out.get(i) * d.d_out.get(i);
  return l;
}

// Every entry of `param`'s gradient against a central difference of the loss. Central
// differences in f64 are accurate to ~eps^2 * f(3) + 1e-16 / eps: 1e-8 relative.
void check_gradient(LayerData& d, HostTensor& param, const HostTensor& grad, const char* name) {
  check_gradient_by_differences(param, grad, name, [&] { return loss_of(d); }, 1e-7);
}

void finite_difference_case(const Problem& p, Routing routing, bool drop_some_slots) {
  LayerData d = make_layer_data(p, DType::f64, test_seed(), routing);
  if (drop_some_slots) {
    for (std::int64_t s = 1; s < p.num_tokens * p.topk; s += 3) d.topk_experts.set(s, -1);
  }
  run_layer(d, 1);
  LayerData probe = d;  // the gradients above stay in d; probe re-runs forward only
  check_gradient(probe, probe.x, d.d_x, "d_x");
  check_gradient(probe, probe.topk_weights, d.d_topk_weights, "d_topk_weights");
  check_gradient(probe, probe.gate, d.d_gate, "d_routed_gate_weights");
  check_gradient(probe, probe.up, d.d_up, "d_routed_up_weights");
  check_gradient(probe, probe.down, d.d_down, "d_routed_down_weights");
  if (p.has_shared_expert()) {
    check_gradient(probe, probe.shared_gate, d.d_shared_gate, "d_shared_gate_weights");
    check_gradient(probe, probe.shared_up, d.d_shared_up, "d_shared_up_weights");
    check_gradient(probe, probe.shared_down, d.d_shared_down, "d_shared_down_weights");
  }
  if (drop_some_slots) {  // an unused slot's weight gets exactly zero gradient
    for (std::int64_t s = 1; s < p.num_tokens * p.topk; s += 3) {
      EXPECT_EQ(d.d_topk_weights.get(s), 0.0) << "slot " << s;
    }
  }
}

TEST(ReferenceGradients, FiniteDifferencesWithSharedExpert) {
  finite_difference_case(tiny_f64(6, 3, 2, 3), Routing::softmax, false);
}

TEST(ReferenceGradients, FiniteDifferencesNoSharedUnusedSlots) {
  finite_difference_case(tiny_f64(5, 4, 3, 0), Routing::softmax, true);
}

TEST(ReferenceGradients, FiniteDifferencesRepeatedExpertIds) {
  // Skewed routing sends every other slot to expert 0, so tokens repeat expert 0 across slots.
  finite_difference_case(tiny_f64(4, 3, 3, 2), Routing::skewed, false);
}

TEST(ReferenceGradients, FiniteDifferencesOneTokenTopOne) {
  finite_difference_case(tiny_f64(1, 1, 1, 2), Routing::softmax, false);
}

// ---- bf16 against f64 ----

struct Bf16Case {
  const char* name;
  Problem problem;
  Routing routing;
  bool drop_slots;
};

void PrintTo(const Bf16Case& c, std::ostream* os) {
  *os << c.name;
}

class ReferenceBf16 : public ::testing::TestWithParam<Bf16Case> {};

TEST_P(ReferenceBf16, MatchesF64WithinBf16Tolerance) {
  const Bf16Case& c = GetParam();
  LayerData d = make_layer_data(c.problem, DType::bf16, test_seed(), c.routing);
  if (c.drop_slots) {
    for (std::int64_t s = 0; s < c.problem.num_tokens * c.problem.topk; s += 5)
      d.topk_experts.set(s, -1);
  }
  run_layer(d);
  for (const HostTensor* t : {&d.out, &d.d_x, &d.d_topk_weights, &d.d_gate, &d.d_up, &d.d_down}) {
    EXPECT_TRUE(all_finite(*t)) << "an output was left unwritten (poison) or overflowed";
  }
  const CheckReport full = check_against_f64(d);
  EXPECT_FALSE(full.sampled);
  EXPECT_TRUE(full.passed()) << full.summary();
  // The sampled checker, an independent evaluation, agrees on the same data.
  CheckOptions sampled;
  sampled.max_full_flops = 0;
  const CheckReport part = check_against_f64(d, sampled);
  EXPECT_TRUE(part.sampled);
  EXPECT_TRUE(part.passed()) << part.summary();
  std::printf("[ mok ] %s: out %.2e, grads max %.2e (tolerances %.2e / %.2e)\n", c.name,
              full.out_rel_err(), full.grad_rel_err_max(), kForwardTolerance, kGradientTolerance);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ReferenceBf16,
    ::testing::Values(
        Bf16Case{"uniform_shared", layer_shape(257, 128, 192, 8, 2, 64), Routing::softmax, false},
        Bf16Case{"skewed_no_shared", layer_shape(131, 192, 128, 6, 3, 0), Routing::skewed, false},
        Bf16Case{"one_expert", layer_shape(64, 128, 64, 5, 2, 64), Routing::one_expert, false},
        Bf16Case{"unused_slots", layer_shape(97, 64, 128, 4, 4, 128), Routing::softmax, true},
        Bf16Case{"one_token", layer_shape(1, 64, 64, 3, 1, 64), Routing::softmax, false},
        Bf16Case{"top1_one_expert", layer_shape(33, 64, 64, 1, 1, 0), Routing::softmax, false}),
    [](const auto& info) { return std::string(info.param.name); });

// A broken layer must fail the check: the tolerances are tight enough to catch a wrong result.
// The row (of `cols` values) with the largest norm: zeroing it changes the tensor by at least
// 1/sqrt(rows) of its norm, above every tolerance here whatever the seed (a fixed row may be tiny).
std::int64_t largest_row(const HostTensor& t, std::int64_t cols) {
  std::int64_t best = 0;
  double best_norm = -1;
  for (std::int64_t r = 0; r < t.numel() / cols; ++r) {
    double n = 0;
    for (std::int64_t c = 0; c < cols; ++c) n += t.get(r * cols + c) * t.get(r * cols + c);
    if (n > best_norm) best = r, best_norm = n;
  }
  return best;
}

TEST(ReferenceCheck, DetectsACorruptedResult) {
  LayerData d = make_layer_data(layer_shape(64, 64, 64, 4, 2, 64), DType::bf16, test_seed());
  run_layer(d);
  const std::int64_t token = largest_row(d.out, 64);  // 64 tokens: at least 1/8 of out's norm
  for (std::int64_t c = 0; c < 64; ++c) d.out.set(token * 64 + c, 0.0);  // lose one token's output
  const CheckReport r = check_against_f64(d);
  EXPECT_FALSE(r.passed()) << r.summary();
  LayerData e = make_layer_data(layer_shape(64, 64, 64, 4, 2, 64), DType::bf16, test_seed());
  run_layer(e);
  // One row of d_gate [E * I, H] lost: 256 rows, so at least 1/16 of its norm (tolerance 6/256).
  const std::int64_t row = largest_row(e.d_gate, 64);
  for (std::int64_t c = 0; c < 64; ++c) e.d_gate.set(row * 64 + c, 0.0);
  CheckOptions sampled;
  sampled.max_full_flops = 0;
  sampled.sample_columns = 64;  // every column, so the wrong element is seen
  EXPECT_FALSE(check_against_f64(e, sampled).passed());
  EXPECT_FALSE(check_against_f64(e).passed());
}

// ---- determinism ----

TEST(ReferenceDeterminism, BitwiseAcrossThreadCountsAndRuns) {
  const Problem p = layer_shape(203, 128, 128, 7, 3, 64);
  const std::uint64_t seed = test_seed();
  LayerData base = make_layer_data(p, DType::bf16, seed, Routing::skewed);
  run_layer(base, 1);
  for (int threads : {1, 2, 3, 8}) {
    LayerData d = make_layer_data(p, DType::bf16, seed, Routing::skewed);
    run_layer(d, threads);
    EXPECT_TRUE(all_outputs_same(base, d)) << "threads " << threads;
  }
}

// ---- edge cases ----

TEST(ReferenceEdgeCases, EmptyExpertsGetExactlyZeroGradients) {
  const Problem p = layer_shape(40, 64, 64, 6, 2, 0);
  LayerData d = make_layer_data(p, DType::bf16, test_seed());
  for (std::int64_t s = 0; s < 80; ++s) d.topk_experts.set(s, s % 2 == 0 ? 1 : 4);  // only 1 and 4
  run_layer(d);
  for (std::int64_t e : {0, 2, 3, 5}) {
    for (std::int64_t i = 0; i < 64 * 64; ++i) {
      ASSERT_EQ(d.d_gate.get(e * 4096 + i), 0.0);
      ASSERT_EQ(d.d_up.get(e * 4096 + i), 0.0);
      ASSERT_EQ(d.d_down.get(e * 4096 + i), 0.0);
    }
  }
  EXPECT_TRUE(check_against_f64(d).passed());
}

TEST(ReferenceEdgeCases, AllSlotsUnusedLeavesOnlyTheSharedExpert) {
  const Problem p = layer_shape(9, 64, 64, 3, 2, 64);
  LayerData with = make_layer_data(p, DType::bf16, test_seed());
  with.topk_experts.fill(-1);
  run_layer(with);
  EXPECT_TRUE(check_against_f64(with).passed());
  for (std::int64_t i = 0; i < with.d_topk_weights.numel(); ++i)
    EXPECT_EQ(with.d_topk_weights.get(i), 0.0);
}

TEST(ReferenceEdgeCases, Fp32MainGradAccumulation) {
  const Problem p = layer_shape(50, 64, 64, 4, 2, 64);
  const std::uint64_t seed = test_seed();
  LayerData fresh = make_layer_data(p, DType::bf16, seed, Routing::softmax, DType::f32);
  run_layer(fresh);
  LayerData acc = make_layer_data(p, DType::bf16, seed, Routing::softmax, DType::f32);
  for (HostTensor* t : {&acc.d_gate, &acc.d_up, &acc.d_down, &acc.d_shared_gate, &acc.d_shared_up,
                        &acc.d_shared_down}) {
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 0.25 * (i % 7));
  }
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  HostContext ctx(ws);
  forward(ws, acc.inputs(), acc.weights(), acc.out.view(), ctx.get());
  backward(ws, acc.inputs(), acc.weights(), ctx.get(), acc.d_out.view(), acc.grads(),
           {.accumulate_weight_grads = true});
  // Every one of the six buffers: what it held plus the fresh gradient, in fp32.
  const std::pair<const char*, std::pair<HostTensor*, HostTensor*>> grads[] = {
      {"d_gate", {&acc.d_gate, &fresh.d_gate}},
      {"d_up", {&acc.d_up, &fresh.d_up}},
      {"d_down", {&acc.d_down, &fresh.d_down}},
      {"d_shared_gate", {&acc.d_shared_gate, &fresh.d_shared_gate}},
      {"d_shared_up", {&acc.d_shared_up, &fresh.d_shared_up}},
      {"d_shared_down", {&acc.d_shared_down, &fresh.d_shared_down}}};
  for (const auto& [name, pair] : grads) {
    const auto& [got, alone] = pair;
    ASSERT_EQ(got->numel(), alone->numel()) << name;
    for (std::int64_t i = 0; i < alone->numel(); ++i) {
      const float want = static_cast<float>(0.25 * (i % 7)) + static_cast<float>(alone->get(i));
      ASSERT_EQ(static_cast<float>(got->get(i)), want) << name << " " << i;
    }
  }
}

TEST(ReferenceContext, BackwardNeedsAForwardOverTheSameTensors) {
  const Problem p = layer_shape(8, 64, 64, 2, 1, 64);
  LayerData d = make_layer_data(p, DType::bf16, 1);
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  HostContext ctx(ws);
  LayerData other = make_layer_data(p, DType::bf16, 2);
  forward(ws, other.inputs(), other.weights(), other.out.view(), ctx.get());
  // Every tensor backward reads is covered by the context's key, not only x.
  expect_error(
      [&] { backward(ws, d.inputs(), other.weights(), ctx.get(), d.d_out.view(), d.grads()); },
      {"forward context", "another x"});
  Weights mixed = other.weights();
  mixed.shared_down = d.shared_down.view();
  expect_error(
      [&] { backward(ws, other.inputs(), mixed, ctx.get(), d.d_out.view(), d.grads()); },
      {"forward context", "another shared_down_weights"});
  Inputs w_other = other.inputs();
  w_other.topk_weights = d.topk_weights.view();
  expect_error(
      [&] { backward(ws, w_other, other.weights(), ctx.get(), d.d_out.view(), d.grads()); },
      {"forward context", "another topk_weights"});
  // recompute_forward_context writes the forward's context bit for bit, without the down
  // weights or the router weights; backward from it gives the same gradients.
  LayerData a = make_layer_data(p, DType::bf16, 3), b = make_layer_data(p, DType::bf16, 3);
  HostContext ca(ws), cb(ws);
  forward(ws, a.inputs(), a.weights(), a.out.view(), ca.get());
  backward(ws, a.inputs(), a.weights(), ca.get(), a.d_out.view(), a.grads());
  Inputs no_weights = b.inputs();
  no_weights.topk_weights = TensorView{};
  Weights no_down = b.weights();
  no_down.down = no_down.shared_down = TensorView{};
  recompute_forward_context(ws, no_weights, no_down, cb.get());
  backward(ws, b.inputs(), b.weights(), cb.get(), b.d_out.view(), b.grads());
  EXPECT_TRUE(same_bits(a.d_x, b.d_x));
  EXPECT_TRUE(same_bits(a.d_topk_weights, b.d_topk_weights));
  EXPECT_TRUE(same_bits(a.d_gate, b.d_gate));
  EXPECT_TRUE(same_bits(a.d_up, b.d_up));
  EXPECT_TRUE(same_bits(a.d_down, b.d_down));
  EXPECT_TRUE(same_bits(a.d_shared_gate, b.d_shared_gate));
  EXPECT_TRUE(same_bits(a.d_shared_up, b.d_shared_up));
  EXPECT_TRUE(same_bits(a.d_shared_down, b.d_shared_down));
  EXPECT_EQ(ws.call_counts().forward, 2);
  EXPECT_EQ(ws.call_counts().recompute, 1);
  EXPECT_EQ(ws.call_counts().backward, 2);
}

// One workspace, several layers: forward all, then backward all in reverse (each from its own
// context) gives the bits of running each layer alone, and never recomputes a forward.
TEST(ReferenceContext, LayersShareOneWorkspace) {
  const Problem p = layer_shape(12, 64, 64, 4, 2, 64);
  const std::uint64_t seed = test_seed();
  constexpr int kLayers = 3;
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  std::vector<LayerData> shared, alone;
  std::vector<std::unique_ptr<HostContext>> contexts;
  for (int l = 0; l < kLayers; ++l) {
    shared.push_back(make_layer_data(p, DType::bf16, seed + l));
    alone.push_back(make_layer_data(p, DType::bf16, seed + l));
    run_layer(alone.back());
    contexts.push_back(std::make_unique<HostContext>(ws));
    forward(ws, shared[l].inputs(), shared[l].weights(), shared[l].out.view(),
            contexts[l]->get());
  }
  for (int l = kLayers - 1; l >= 0; --l) {
    backward(ws, shared[l].inputs(), shared[l].weights(), contexts[l]->get(),
             shared[l].d_out.view(), shared[l].grads());
  }
  for (int l = 0; l < kLayers; ++l) EXPECT_TRUE(all_outputs_same(shared[l], alone[l])) << l;
  EXPECT_EQ(ws.call_counts().recompute, 0);
}

}  // namespace
}  // namespace mok::test

#include "reference/cpu_gemm.hpp"

namespace mok::test {
namespace {

// The AVX2 path of the reference GEMM must give the baseline path's bits (same operations per
// element, only wider vectors).
TEST(ReferenceGemm, Avx2PathIsBitwiseTheBaseline) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (!reference::cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2";
  using namespace reference;
  const std::int64_t M = 37, K = 300, N = 64;
  std::vector<float> a(M * K), packed(kTileK * kTileN);
  std::uint64_t s = test_seed();
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return float(int(s >> 40) % 2001 - 1000) / 977.0f;
  };
  for (auto& v : a) v = next();
  for (auto& v : packed) v = next();
  GemmArgs<float> g{M, N, K, a.data(), K, 1, nullptr, 0, 0, nullptr, 0};
  alignas(64) float base[kTileM][kTileN] = {}, wide[kTileM][kTileN] = {};
  TileKernel<float>::run(base, g, 0, M, 0, std::min(K, kTileK), packed.data());
  tile_kernel_avx2<float>(wide, g, 0, M, 0, std::min(K, kTileK), packed.data());
  EXPECT_EQ(std::memcmp(base, wide, sizeof base), 0);
#else
  GTEST_SKIP() << "no x86-64 AVX2 path in this build";
#endif
}

// ---- row-strided routed weights (validate.cpp: e.g. the halves of one packed [E, 2I, H] tensor)

TEST(ReferenceStrides, PackedGateUpViewsAreBitwiseTheContiguousLayer) {
  const Problem p = layer_shape(37, 128, 64, 5, 3, 64);
  for (DType act : {DType::bf16, DType::f64}) {
    for (bool interleaved : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(act)) + (interleaved ? " interleaved" : " concatenated"));
      const std::uint64_t seed = test_seed();
      LayerData base = convert_layer_data(make_layer_data(p, DType::bf16, seed), act);
      run_layer(base);
      LayerData d = convert_layer_data(make_layer_data(p, DType::bf16, seed), act);
      const Packed w = pack(d.gate, d.up, interleaved);
      Packed grad = pack(d.d_gate, d.d_up, interleaved);  // the packed gradient's views
      grad.storage.fill_bytes(0xff);                       // NaN: every element must be written
      Weights weights = d.weights();
      weights.gate = w.gate;
      weights.up = w.up;
      Grads grads = d.grads();
      grads.d_gate = grad.gate;
      grads.d_up = grad.up;
      Workspace ws(p, Config{}, {.backend = Backend::cpu, .activation_dtype = act});
      HostContext ctx(ws);
      forward(ws, d.inputs(), weights, d.out.view(), ctx.get());
      backward(ws, d.inputs(), weights, ctx.get(), d.d_out.view(), grads);
      EXPECT_TRUE(same_bits(base.out, d.out));
      EXPECT_TRUE(same_bits(base.d_x, d.d_x));
      EXPECT_TRUE(same_bits(base.d_topk_weights, d.d_topk_weights));
      EXPECT_TRUE(same_bits(base.d_down, d.d_down));
      const Packed want = pack(base.d_gate, base.d_up, interleaved);
      EXPECT_TRUE(same_bits(want.storage, grad.storage));
    }
  }
}

}  // namespace
}  // namespace mok::test
