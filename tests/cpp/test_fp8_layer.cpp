// The FP8 layer on the CPU reference (api.hpp, Fp8Weights; docs/architecture.md, "The FP8 layer"):
// bitwise against the layer written out directly from its definition in this file (dequantized
// operands, block sums in f64), against the f64 layer of the unquantized bf16 values within MoK's
// MXFP8 tolerances (with mok's own errors printed), bitwise across runs, thread counts, ring and
// minibatch sizes and W = 2 ranks of host expert parallelism, and its argument checks.
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "core/bf16.hpp"
#include "core/fp8.hpp"
#include "core/numerics.hpp"
#include "fp8_layer_helpers.hpp"
#include "layer_helpers.hpp"
#include "mok/fp8.hpp"
#include "mok/host_ep.hpp"

namespace mok::test {
namespace {

constexpr std::int64_t B = 128;

TensorView rows_of(const TensorView& v, std::int64_t first, std::int64_t count) {
  TensorView r = v;
  std::int64_t row_elems = 1;
  for (int dim = 1; dim < v.ndim; ++dim) row_elems *= v.shape[dim];
  r.data = static_cast<char*>(v.data) + first * row_elems * dtype_size(v.dtype);
  r.shape[0] = count;
  return r;
}

bool same_view_bits(const TensorView& a, const TensorView& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data, b.data, a.numel() * dtype_size(a.dtype)) == 0;
}

// ---- the layer written out from its definition (no shared expert) ----

float bf16_round(float v) {
  return round_to_bf16(v);
}

// x [M, K] quantized in rows of 1x128 along K (mok::quantize_rows), dequantized.
std::vector<double> dequantized_rows(const std::vector<float>& x, std::int64_t M, std::int64_t K) {
  std::vector<fp8::e4m3_t> q(M * K);
  std::vector<float> s(K / B * M);
  std::vector<float> xs = x;
  quantize_rows(TensorView::contiguous(xs.data(), DType::f32, {M, K}),
                TensorView::contiguous(q.data(), DType::fp8_e4m3, {M, K}),
                TensorView::contiguous(s.data(), DType::f32, {K / B, M}));
  std::vector<double> out(M * K);
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t k = 0; k < K; ++k) {
      out[m * K + k] = double{fp8::e4m3_to_float(q[m * K + k])} * s[(k / B) * M + m];
    }
  }
  return out;
}

// x [M, N] (M rows of an expert, in order) quantized along the token axis in 128-row blocks, the
// last padded with zero rows (mok::quantize_token_axis), dequantized back to [M, N].
std::vector<double> dequantized_tokens(const std::vector<float>& x, std::int64_t M,
                                       std::int64_t N) {
  const std::int64_t Mp = (M + B - 1) / B * B;
  std::vector<float> xs(Mp * N, 0.0f);
  std::copy(x.begin(), x.end(), xs.begin());
  std::vector<fp8::e4m3_t> q(N * Mp);
  std::vector<float> s(Mp / B * N);
  quantize_token_axis(TensorView::contiguous(xs.data(), DType::f32, {Mp, N}),
                      TensorView::contiguous(q.data(), DType::fp8_e4m3, {N, Mp}),
                      TensorView::contiguous(s.data(), DType::f32, {Mp / B, N}));
  std::vector<double> out(M * N);
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t n = 0; n < N; ++n) {
      out[m * N + n] = double{fp8::e4m3_to_float(q[n * Mp + m])} * s[(m / B) * N + n];
    }
  }
  return out;
}

// Expert e's [N, K] matrix of one orientation of a quantized weight, dequantized.
std::vector<double> dequantized_weight(const TensorView& data, const TensorView& scales,
                                       std::int64_t e) {
  const std::int64_t N = data.shape[1], K = data.shape[2];
  std::vector<double> out(N * K);
  for (std::int64_t n = 0; n < N; ++n) {
    for (std::int64_t k = 0; k < K; ++k) {
      const auto q = data.ptr<const fp8::e4m3_t>()[(e * N + n) * K + k];
      const float s = scales.ptr<const float>()[(e * (N / B) + n / B) * (K / B) + k / B];
      out[n * K + k] = double{fp8::e4m3_to_float(q)} * s;
    }
  }
  return out;
}

// sum over 128-blocks (increasing) of the block's sum of products of dequantized values (exact:
// within a block every product is a multiple of the same power of two), accumulated in f64.
double block_sum(const double* a, std::int64_t a_step, const double* b, std::int64_t b_step,
                 std::int64_t K, double acc = 0.0) {
  for (std::int64_t k0 = 0; k0 < K; k0 += B) {
    double part = 0.0;
    for (std::int64_t k = k0; k < k0 + B; ++k) part += a[k * a_step] * b[k * b_step];
    acc += part;
  }
  return acc;
}

struct Model {
  std::vector<float> out, d_x, d_w, d_gate, d_up, d_down;
};

// `fp8_wgrads` false (BackwardOptions::fp8_weight_grads): the weight gradients are fp32 sums, over
// the expert's rows in order, of products of the bf16 operands (exact in fp32), as the bf16
// layer's.
Model fp8_model(const LayerData& d, const Fp8Weights& q, bool fp8_wgrads = true) {
  const Problem& p = d.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size,
                     E = p.num_experts, k = p.topk;
  EXPECT_EQ(p.shared_intermediate_size, 0);
  Model m;
  m.out.assign(T * H, 0.0f);
  m.d_x.assign(T * H, 0.0f);
  m.d_w.assign(T * k, 0.0f);
  m.d_gate.assign(E * I * H, 0.0f);
  m.d_up.assign(E * I * H, 0.0f);
  m.d_down.assign(E * H * I, 0.0f);
  std::vector<float> y(T * k * H, 0.0f), dx(T * k * H, 0.0f);
  auto row = [](const HostTensor& t, std::int64_t r, std::int64_t n) {
    std::vector<float> v(n);
    for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(t.get(r * n + i));
    return v;
  };
  for (std::int64_t e = 0; e < E; ++e) {
    std::vector<std::int64_t> slots;
    for (std::int64_t s = 0; s < T * k; ++s) {
      if (d.topk_experts.get(s) == e) slots.push_back(s);
    }
    const auto rows = static_cast<std::int64_t>(slots.size());
    const auto wg = dequantized_weight(q.gate.data, q.gate.scales, e);        // [I, H]
    const auto wu = dequantized_weight(q.up.data, q.up.scales, e);            // [I, H]
    const auto wd = dequantized_weight(q.down.data, q.down.scales, e);        // [H, I]
    const auto wg_t = dequantized_weight(q.gate.data_t, q.gate.scales_t, e);  // [H, I]
    const auto wu_t = dequantized_weight(q.up.data_t, q.up.scales_t, e);      // [H, I]
    const auto wd_t = dequantized_weight(q.down.data_t, q.down.scales_t, e);  // [I, H]
    std::vector<float> xr, hr, dyr, dgr, dur;  // the expert's rows, for the weight gradients
    for (std::int64_t s : slots) {
      const std::int64_t t = s / k;
      const float w = static_cast<float>(d.topk_weights.get(s));
      const std::vector<float> x = row(d.x, t, H), d_out = row(d.d_out, t, H);
      // forward
      const auto xq = dequantized_rows(x, 1, H);
      std::vector<float> g(I), u(I), h(I);
      for (std::int64_t i = 0; i < I; ++i) {
        g[i] = bf16_round(static_cast<float>(block_sum(xq.data(), 1, &wg[i * H], 1, H)));
        u[i] = bf16_round(static_cast<float>(block_sum(xq.data(), 1, &wu[i * H], 1, H)));
        h[i] = bf16_round(numerics::swiglu(g[i], u[i]));
      }
      const auto hq = dequantized_rows(h, 1, I);
      for (std::int64_t c = 0; c < H; ++c) {
        y[s * H + c] = bf16_round(static_cast<float>(block_sum(hq.data(), 1, &wd[c * I], 1, I)));
      }
      // backward
      const auto dq = dequantized_rows(d_out, 1, H);
      std::vector<float> dg(I), du(I);
      float dot = 0.0f;
      for (std::int64_t i = 0; i < I; ++i) {
        const float dh_u = static_cast<float>(block_sum(dq.data(), 1, &wd_t[i * H], 1, H));
        dot += dh_u * h[i];
        const float dh = bf16_round(w * dh_u);
        float a, b;
        numerics::swiglu_backward(g[i], u[i], dh, &a, &b);
        dg[i] = bf16_round(a);
        du[i] = bf16_round(b);
      }
      m.d_w[s] = dot;
      const auto dgq = dequantized_rows(dg, 1, I), duq = dequantized_rows(du, 1, I);
      for (std::int64_t c = 0; c < H; ++c) {
        const double acc = block_sum(dgq.data(), 1, &wg_t[c * I], 1, I);
        dx[s * H + c] =
            bf16_round(static_cast<float>(block_sum(duq.data(), 1, &wu_t[c * I], 1, I, acc)));
      }
      xr.insert(xr.end(), x.begin(), x.end());
      hr.insert(hr.end(), h.begin(), h.end());
      dgr.insert(dgr.end(), dg.begin(), dg.end());
      dur.insert(dur.end(), du.begin(), du.end());
      for (std::int64_t c = 0; c < H; ++c) dyr.push_back(bf16_round(w * d_out[c]));
    }
    if (rows == 0) continue;
    if (!fp8_wgrads) {
      for (std::int64_t i = 0; i < I; ++i) {
        for (std::int64_t c = 0; c < H; ++c) {
          float gate = 0.0f, up = 0.0f, down = 0.0f;
          for (std::int64_t r = 0; r < rows; ++r) {
            gate += dgr[r * I + i] * xr[r * H + c];
            up += dur[r * I + i] * xr[r * H + c];
            down += dyr[r * H + c] * hr[r * I + i];
          }
          m.d_gate[(e * I + i) * H + c] = gate;
          m.d_up[(e * I + i) * H + c] = up;
          m.d_down[(e * H + c) * I + i] = down;
        }
      }
      continue;
    }
    const auto tx = dequantized_tokens(xr, rows, H), th = dequantized_tokens(hr, rows, I),
               tdy = dequantized_tokens(dyr, rows, H), tdg = dequantized_tokens(dgr, rows, I),
               tdu = dequantized_tokens(dur, rows, I);
    for (std::int64_t i = 0; i < I; ++i) {
      for (std::int64_t c = 0; c < H; ++c) {
        // Token blocks of 128 rows: block_sum over the padded length (padded values are 0).
        const std::int64_t Mp = (rows + B - 1) / B * B;
        auto sum = [&](const std::vector<double>& a, std::int64_t na, std::int64_t ia,
                       const std::vector<double>& b, std::int64_t nb, std::int64_t ib) {
          std::vector<double> ca(Mp, 0.0), cb(Mp, 0.0);
          for (std::int64_t r = 0; r < rows; ++r) ca[r] = a[r * na + ia], cb[r] = b[r * nb + ib];
          return static_cast<float>(block_sum(ca.data(), 1, cb.data(), 1, Mp));
        };
        m.d_gate[(e * I + i) * H + c] = sum(tdg, I, i, tx, H, c);
        m.d_up[(e * I + i) * H + c] = sum(tdu, I, i, tx, H, c);
        m.d_down[(e * H + c) * I + i] = sum(tdy, H, c, th, I, i);
      }
    }
  }
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t c = 0; c < H; ++c) {
      float acc = 0.0f, acc_dx = 0.0f;
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t s = t * k + j;
        if (d.topk_experts.get(s) < 0) continue;
        acc = std::fma(static_cast<float>(d.topk_weights.get(s)), y[s * H + c], acc);
        acc_dx += dx[s * H + c];
      }
      m.out[t * H + c] = bf16_round(acc);
      m.d_x[t * H + c] = bf16_round(acc_dx);
    }
  }
  return m;
}

// Every element of `got` equals the model's (stored in got's dtype); the first mismatch printed.
void expect_same(const HostTensor& got, const std::vector<float>& want, const char* name) {
  ASSERT_EQ(got.numel(), static_cast<std::int64_t>(want.size())) << name;
  const bool bf16 = got.view().dtype == DType::bf16;
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double w = bf16 ? bf16_round(want[i]) : want[i];
    if (got.get(i) == w || (std::isnan(got.get(i)) && std::isnan(w))) continue;
    if (bad++ == 0) {
      ADD_FAILURE() << name << "[" << i << "] = " << got.get(i) << ", the definition gives " << w;
    }
  }
  EXPECT_EQ(bad, 0) << name << ": elements that differ from the definition";
}

struct DefinitionCase {
  const char* name;
  Problem problem;
  Routing routing;
  bool unused_slots;
};

void PrintTo(const DefinitionCase& c, std::ostream* os) {
  *os << c.name;
}

// The case's bf16 inputs (every fourth slot unused where it says so), outputs poisoned.
LayerData definition_case_data(const DefinitionCase& c) {
  LayerData d = make_layer_data(c.problem, DType::bf16, test_seed(), c.routing);
  if (c.unused_slots) {
    for (std::int64_t s = 1; s < d.topk_experts.numel(); s += 4) d.topk_experts.set(s, -1);
  }
  d.poison_outputs();
  return d;
}

class Fp8LayerDefinition : public ::testing::TestWithParam<DefinitionCase> {};

TEST_P(Fp8LayerDefinition, BitwiseEqualsTheLayerWrittenOut) {
  LayerData d = definition_case_data(GetParam());
  const HostFp8Weights q(d);
  run_fp8(d, q.get(), 3);
  const Model m = fp8_model(d, q.get());
  expect_same(d.out, m.out, "out");
  expect_same(d.d_x, m.d_x, "d_x");
  expect_same(d.d_topk_weights, m.d_w, "d_topk_weights");
  expect_same(d.d_gate, m.d_gate, "d_routed_gate_weights");
  expect_same(d.d_up, m.d_up, "d_routed_up_weights");
  expect_same(d.d_down, m.d_down, "d_routed_down_weights");
}

// BackwardOptions::fp8_weight_grads false: the weight gradients are the bf16 products of the
// written-out layer's bf16 operands, bit for bit, and everything else is the FP8 layer's, bit for
// bit.
TEST_P(Fp8LayerDefinition, Bf16WeightGradsEqualTheLayerWrittenOut) {
  LayerData d = definition_case_data(GetParam());
  LayerData fp8_wgrads = d;
  const HostFp8Weights q(d);
  BackwardOptions options;
  options.fp8_weight_grads = false;
  run_fp8(d, q.get(), 3, {}, true, options);
  run_fp8(fp8_wgrads, q.get(), 3);
  const Model m = fp8_model(d, q.get(), /*fp8_wgrads=*/false);
  expect_same(d.d_gate, m.d_gate, "d_routed_gate_weights");
  expect_same(d.d_up, m.d_up, "d_routed_up_weights");
  expect_same(d.d_down, m.d_down, "d_routed_down_weights");
  EXPECT_TRUE(same_view_bits(d.out.view(), fp8_wgrads.out.view()));
  EXPECT_TRUE(same_view_bits(d.d_x.view(), fp8_wgrads.d_x.view()));
  EXPECT_TRUE(same_view_bits(d.d_topk_weights.view(), fp8_wgrads.d_topk_weights.view()));
  // The two recipes' weight gradients are different numbers (e4m3 against bf16 operands).
  EXPECT_FALSE(same_view_bits(d.d_gate.view(), fp8_wgrads.d_gate.view()));
}

// Skewed routing puts more than 128 rows on expert 0 (two token blocks, the second partial);
// odd token counts; an expert with no rows (E = 4, one_expert).
INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8LayerDefinition,
    ::testing::Values(DefinitionCase{"skewed", layer_shape(151, 128, 256, 3, 2, 0), Routing::skewed,
                                     false},
                      DefinitionCase{"softmax_unused_slots", layer_shape(45, 256, 128, 4, 3, 0),
                                     Routing::softmax, true},
                      DefinitionCase{"one_expert", layer_shape(7, 128, 128, 4, 1, 0),
                                     Routing::one_expert, false}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- against the f64 layer of the unquantized values ----

// MoK's MXFP8 tolerances (its tests: abs max 1.0 and rel sum|diff| / sum|ref| 0.1 on the layer's
// outputs, cosine >= 0.996 on gradients): abs max on out and d_x (a weight gradient's size grows
// with its expert's rows, so an absolute bound says nothing there), rel and cosine on everything.
// mok's own errors are printed beside them and beside the bf16 layer's.
// NOTES: e4m3 keeps 3 mantissa bits (relative rounding error up to 2^-4, about 3.6% rms per
// operand), so one FP8 GEMM's result is off by about 5% relative whatever the block size; a
// gradient passes through two or three of them (d_gate: d_out, then dg and x): 6-7% rel and a
// cosine near 1 - 0.07^2 / 2 = 0.9976 are what e4m3 gives, and MoK's MXFP8 sees the same.
TEST(Fp8LayerAccuracy, WithinMoKsMxfp8TolerancesOfTheF64Layer) {
  for (const Problem& p :
       {layer_shape(257, 256, 384, 8, 2, 128), layer_shape(131, 128, 256, 6, 3, 0)}) {
    LayerData d = make_layer_data(p, DType::bf16, test_seed(), Routing::skewed);
    d.poison_outputs();
    LayerData b = d;
    LayerData hp = d;  // the FP8 layer with bf16 weight gradients
    LayerData x = convert_layer_data(d, DType::f64);
    const HostFp8Weights q(d);
    run_fp8(d, q.get(), 0, {}, /*routed_masters=*/false);
    BackwardOptions bf16_wgrads;
    bf16_wgrads.fp8_weight_grads = false;
    run_fp8(hp, q.get(), 0, {}, /*routed_masters=*/false, bf16_wgrads);
    run_layer(b);
    run_layer(x);
    std::printf("[ mok ] T %lld H %lld I %lld E %lld k %lld S %lld, against the f64 layer:\n",
                static_cast<long long>(p.num_tokens), static_cast<long long>(p.hidden_size),
                static_cast<long long>(p.intermediate_size), static_cast<long long>(p.num_experts),
                static_cast<long long>(p.topk), static_cast<long long>(p.shared_intermediate_size));
    const std::vector<std::pair<const char*, HostTensor LayerData::*>> fields = {
        {"out", &LayerData::out},
        {"d_x", &LayerData::d_x},
        {"d_topk_weights", &LayerData::d_topk_weights},
        {"d_routed_gate_weights", &LayerData::d_gate},
        {"d_routed_up_weights", &LayerData::d_up},
        {"d_routed_down_weights", &LayerData::d_down},
        {"d_shared_gate_weights", &LayerData::d_shared_gate}};
    for (const auto& [name, field] : fields) {
      if (!(d.*field).defined()) continue;
      const Errors f = errors_of(d.*field, x.*field), g = errors_of(b.*field, x.*field);
      std::printf(
          "[ mok ]   %-22s fp8 abs max %.3e rel %.3e cos %.6f | bf16 abs max %.3e rel "
          "%.3e cos %.6f\n",
          name, f.abs_max, f.rel_sum, f.cosine, g.abs_max, g.rel_sum, g.cosine);
      if (field == &LayerData::out || field == &LayerData::d_x) EXPECT_LE(f.abs_max, 1.0) << name;
      EXPECT_LE(f.rel_sum, 0.1) << name;
      EXPECT_GE(f.cosine, 0.996) << name;
      // bf16 weight gradients (BackwardOptions::fp8_weight_grads false): their operands' error
      // only (dg and du come from the FP8 dgrads), none of the token-axis quantization's.
      const bool routed_wgrad = field == &LayerData::d_gate || field == &LayerData::d_up ||
                                field == &LayerData::d_down;
      if (routed_wgrad) {
        const Errors h = errors_of(hp.*field, x.*field);
        std::printf("[ mok ]   %-22s fp8 with bf16 weight grads: rel %.3e cos %.6f\n", name,
                    h.rel_sum, h.cosine);
        EXPECT_LT(h.rel_sum, f.rel_sum) << name;
        EXPECT_GE(h.cosine, 0.996) << name;
      } else {
        EXPECT_TRUE(same_view_bits((hp.*field).view(), (d.*field).view())) << name;
      }
    }
  }
}

// ---- determinism and the knobs that must not change the bits ----

TEST(Fp8LayerDeterminism, BitwiseAcrossRunsThreadsRingAndMinibatch) {
  const Problem p = layer_shape(203, 128, 256, 5, 3, 64);
  const std::uint64_t seed = test_seed();
  LayerData base = make_layer_data(p, DType::bf16, seed, Routing::skewed);
  const HostFp8Weights q(base);
  run_fp8(base, q.get(), 1);
  for (int threads : {1, 2, 5}) {
    for (std::int64_t minibatch : {std::int64_t{4096}, std::int64_t{128}}) {
      Config config;
      config.minibatch_size = minibatch;
      config.macrobatch_size = minibatch == 128 ? 256 : 0;
      LayerData d = make_layer_data(p, DType::bf16, seed, Routing::skewed);
      d.poison_outputs();
      run_fp8(d, q.get(), threads, config);
      EXPECT_TRUE(all_outputs_same(base, d)) << "threads " << threads << " minibatch " << minibatch;
    }
  }
}

// The shared expert, the router weights' use in the combine and the home reductions are the bf16
// layer's: with every slot unused only the shared expert remains, and both layers give the same
// bits.
TEST(Fp8LayerSharedExpert, IsTheBf16LayersBitForBit) {
  const Problem p = layer_shape(33, 128, 128, 3, 2, 64);
  LayerData a = make_layer_data(p, DType::bf16, test_seed());
  a.topk_experts.fill(-1);
  LayerData b = a;
  const HostFp8Weights q(a);
  run_fp8(a, q.get());
  run_layer(b);
  EXPECT_TRUE(all_outputs_same(a, b));
}

// recompute_forward_context writes the forward's context bits.
TEST(Fp8LayerRecompute, SameContextAsTheForward) {
  const Problem p = layer_shape(70, 128, 128, 3, 2, 64);
  LayerData d = make_layer_data(p, DType::bf16, test_seed(), Routing::skewed);
  const HostFp8Weights q(d);
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  const ForwardContextLayout l = forward_context_layout(ws);
  std::vector<std::uint64_t> a(l.bytes / 8 + 1), b(l.bytes / 8 + 1, ~0ull);
  ForwardContext ca = forward_context_views(l, a.data()), cb = forward_context_views(l, b.data());
  forward(ws, d.inputs(), d.weights(), q.get(), d.out.view(), ca);
  Fp8Weights no_down = q.get();
  no_down.down = QuantizedWeights{};
  Inputs in = d.inputs();
  in.topk_weights = TensorView{};
  recompute_forward_context(ws, in, d.weights(), no_down, cb);
  const std::vector<std::pair<TensorView, TensorView>> pairs = {
      {ca.gate_routed, cb.gate_routed},     {ca.up_routed, cb.up_routed},
      {ca.hidden_routed, cb.hidden_routed}, {ca.gate_shared, cb.gate_shared},
      {ca.up_shared, cb.up_shared},         {ca.hidden_shared, cb.hidden_shared}};
  for (const auto& [va, vb] : pairs) EXPECT_TRUE(same_view_bits(va, vb));
  // The FP8 context differs from the bf16 layer's (its g are other numbers), and backward knows
  // which layer wrote it.
  EXPECT_EQ(ca.key.fp8, true);
  expect_error([&] { backward(ws, d.inputs(), d.weights(), ca, d.d_out.view(), d.grads()); },
               {"forward context", "bf16 layer's forward", "recorded by the FP8 layer"});
}

// ---- host expert parallelism: W = 2 ranks in one process ----

TEST(Fp8LayerHostEp, TwoRanksGiveTheOneRankBits) {
  constexpr int W = 2;
  const std::int64_t T = 61, H = 128, I = 128, E = 4, k = 2, El = E / W;
  LayerData g =
      make_layer_data(layer_shape(W * T, H, I, E, k, 0), DType::bf16, test_seed(), Routing::skewed);
  const HostFp8Weights q(g);
  run_fp8(g, q.get(), 2);
  struct Rank {
    std::unique_ptr<Workspace> ws;
    std::unique_ptr<HostContext> ctx;
    host_ep::ExchangeCounts counts;
    HostTensor send, dw_send, received, dw_received, out, d_x, d_w, d_gate, d_up, d_down;
  };
  std::vector<Rank> ranks(W);
  auto own = [&](const HostTensor& t, int r) { return rows_of(t.view(), r * T, T); };
  auto local_q = [&](const QuantizedWeights& w, int r) {
    return QuantizedWeights{rows_of(w.data, r * El, El), rows_of(w.scales, r * El, El),
                            rows_of(w.data_t, r * El, El), rows_of(w.scales_t, r * El, El)};
  };
  auto fp8_of = [&](int r) {
    const Fp8Weights all = q.get();
    return Fp8Weights{local_q(all.gate, r), local_q(all.up, r), local_q(all.down, r)};
  };
  auto weights_of = [&](int r) {
    Weights w;
    w.gate = rows_of(g.gate.view(), r * El, El);
    w.up = rows_of(g.up.view(), r * El, El);
    w.down = rows_of(g.down.view(), r * El, El);
    return w;
  };
  auto sum = [](const std::vector<std::int64_t>& v) {
    return std::accumulate(v.begin(), v.end(), std::int64_t{0});
  };
  // The all-to-all: rank r receives, from each q in order, the rows q's send buffer holds for r.
  auto all_to_all = [&](HostTensor Rank::*send, HostTensor Rank::*recv, std::int64_t cols) {
    for (int r = 0; r < W; ++r) {
      std::int64_t at = 0;
      for (int s = 0; s < W; ++s) {
        const auto& c = ranks[s].counts.send;
        const std::int64_t first = std::accumulate(c.begin(), c.begin() + r, std::int64_t{0});
        const std::size_t bytes = cols * dtype_size((ranks[s].*send).view().dtype);
        std::memcpy(static_cast<char*>((ranks[r].*recv).view().data) + at * bytes,
                    static_cast<const char*>((ranks[s].*send).view().data) + first * bytes,
                    c[r] * bytes);
        at += c[r];
      }
    }
  };
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    Problem p = layer_shape(T, H, I, E, k, 0);
    p.ep_size = W;
    p.ep_rank = r;
    rk.ws = std::make_unique<Workspace>(p, Config{}, WorkspaceOptions{.backend = Backend::cpu});
    rk.ctx = std::make_unique<HostContext>(*rk.ws);
    rk.counts = host_ep::exchange_counts(*rk.ws, g.topk_experts.view());
    const std::int64_t ns = sum(rk.counts.send), nr = sum(rk.counts.receive);
    rk.send = HostTensor(DType::bf16, {ns, H});
    rk.dw_send = HostTensor(DType::f32, {ns});
    rk.received = HostTensor(DType::bf16, {nr, H});
    rk.dw_received = HostTensor(DType::f32, {nr});
    rk.out = HostTensor(DType::bf16, {T, H});
    rk.d_x = HostTensor(DType::bf16, {T, H});
    rk.d_w = HostTensor(DType::f32, {T, k});
    rk.d_gate = HostTensor(DType::bf16, {El, I, H});
    rk.d_up = HostTensor(DType::bf16, {El, I, H});
    rk.d_down = HostTensor(DType::bf16, {El, H, I});
    host_ep::expert_forward(*rk.ws, g.inputs(), Weights{}, fp8_of(r), rk.send.view(),
                            rk.ctx->get());
  }
  all_to_all(&Rank::send, &Rank::received, H);
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    const Inputs in{own(g.x, r), own(g.topk_experts, r), own(g.topk_weights, r)};
    host_ep::home_forward(*rk.ws, in, weights_of(r), rk.received.view(), rk.out.view(),
                          rk.ctx->get());
    EXPECT_TRUE(same_view_bits(rk.out.view(), own(g.out, r))) << "out of rank " << r;
    const Grads grads{rk.d_x.view(), rk.d_w.view(), rk.d_gate.view(), rk.d_up.view(),
                      rk.d_down.view()};
    host_ep::expert_backward(*rk.ws, g.inputs(), Weights{}, fp8_of(r), rk.ctx->get(),
                             g.d_out.view(), rk.send.view(), rk.dw_send.view(), grads);
    EXPECT_TRUE(same_view_bits(rk.d_gate.view(), rows_of(g.d_gate.view(), r * El, El)));
    EXPECT_TRUE(same_view_bits(rk.d_up.view(), rows_of(g.d_up.view(), r * El, El)));
    EXPECT_TRUE(same_view_bits(rk.d_down.view(), rows_of(g.d_down.view(), r * El, El)));
  }
  all_to_all(&Rank::send, &Rank::received, H);
  all_to_all(&Rank::dw_send, &Rank::dw_received, 1);
  for (int r = 0; r < W; ++r) {
    Rank& rk = ranks[r];
    const Inputs in{own(g.x, r), own(g.topk_experts, r), own(g.topk_weights, r)};
    const Grads grads{rk.d_x.view(), rk.d_w.view(), rk.d_gate.view(), rk.d_up.view(),
                      rk.d_down.view()};
    host_ep::home_backward(*rk.ws, in, weights_of(r), rk.ctx->get(), own(g.d_out, r),
                           rk.received.view(), rk.dw_received.view(), grads);
    EXPECT_TRUE(same_view_bits(rk.d_x.view(), own(g.d_x, r))) << "d_x of rank " << r;
    EXPECT_TRUE(same_view_bits(rk.d_w.view(), own(g.d_topk_weights, r))) << "d_w of rank " << r;
  }
}

// ---- bad arguments: mok::Error naming the argument ----

TEST(Fp8LayerValidation, BadArgumentsNameTheArgument) {
  const Problem p = layer_shape(16, 128, 128, 2, 2, 0);
  LayerData d = make_layer_data(p, DType::bf16, test_seed());
  const HostFp8Weights q(d);
  Workspace ws(p, Config{}, {.backend = Backend::cpu});
  HostContext ctx(ws);
  auto run_with = [&](const Fp8Weights& w) {
    forward(ws, d.inputs(), d.weights(), w, d.out.view(), ctx.get());
  };
  Fp8Weights bad = q.get();
  bad.gate.data_t = TensorView{};
  expect_error([&] { run_with(bad); }, {"fp8_weights.gate.data_t", "none"});
  bad = q.get();
  bad.down.scales.dtype = DType::bf16;
  expect_error([&] { run_with(bad); }, {"fp8_weights.down.scales.dtype", "float32"});
  bad = q.get();
  bad.up.data.shape[1] = 64;
  expect_error([&] { run_with(bad); }, {"fp8_weights.up.data.shape", "[2, 128, 128]"});
  bad = q.get();
  bad.gate.data.dtype = DType::bf16;
  expect_error([&] { run_with(bad); }, {"fp8_weights.gate.data.dtype", "fp8_e4m3"});
  // Present master weights are checked for shape though not read.
  Weights w = d.weights();
  w.down.shape[1] = 64;
  expect_error([&] { forward(ws, d.inputs(), w, q.get(), d.out.view(), ctx.get()); },
               {"routed_down_weights.shape"});
  // H and I multiples of 128.
  const Problem odd = layer_shape(16, 192, 128, 2, 2, 0);
  LayerData o = make_layer_data(odd, DType::bf16, test_seed());
  Workspace ws_odd(odd, Config{}, {.backend = Backend::cpu});
  HostContext ctx_odd(ws_odd);
  expect_error(
      [&] { forward(ws_odd, o.inputs(), Weights{}, q.get(), o.out.view(), ctx_odd.get()); },
      {"hidden_size", "multiple of 128", "192"});
  // The exact mode has no FP8 layer.
  LayerData x = convert_layer_data(d, DType::f64);
  Workspace ws64(p, Config{}, {.backend = Backend::cpu, .activation_dtype = DType::f64});
  HostContext ctx64(ws64);
  expect_error([&] { forward(ws64, x.inputs(), Weights{}, q.get(), x.out.view(), ctx64.get()); },
               {"activation_dtype", "bfloat16 for the FP8 layer"});
  // A context of the bf16 layer, or of other quantized weights, is refused by the FP8 backward.
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  expect_error(
      [&] { backward(ws, d.inputs(), d.weights(), q.get(), ctx.get(), d.d_out.view(), d.grads()); },
      {"forward context", "FP8 layer's forward", "recorded by the bf16 layer"});
  const HostFp8Weights other(d);
  forward(ws, d.inputs(), d.weights(), q.get(), d.out.view(), ctx.get());
  expect_error(
      [&] {
        backward(ws, d.inputs(), d.weights(), other.get(), ctx.get(), d.d_out.view(), d.grads());
      },
      {"forward context", "fp8_weights.gate"});
  // And the next good call works.
  backward(ws, d.inputs(), d.weights(), q.get(), ctx.get(), d.d_out.view(), d.grads());
  EXPECT_TRUE(all_finite(d.d_x));
}

}  // namespace
}  // namespace mok::test
