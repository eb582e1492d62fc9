// The FP8 layer on the CUDA backend (docs/architecture.md, "The FP8 layer") end to end: every
// output and gradient against the CPU FP8 reference and against the f64 layer of the unquantized
// bf16 values (MoK's MXFP8 bounds, mok's errors printed), bitwise across runs, ring sizes and W
// virtual ranks, the shared expert bitwise the bf16 layer's, a captured step (weight quantization
// included) replayed with new inputs, and the calls it refuses. Skipped without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/bf16.hpp"
#include "core/schedule_check.hpp"
#include "core/workspace_plan.hpp"
#include "cuda/layer/layer.hpp"
#include "external_team.hpp"
#include "fp8_layer_helpers.hpp"
#include "gpu_buffer.hpp"
#include "layer_gpu_helpers.hpp"
#include "layer_helpers.hpp"
#include "mok/fp8.hpp"
#include "synthetic/device_layer.hpp"

namespace mok::test {
namespace {

using cuda::DeviceContext;
using cuda::DeviceLayer;
using cuda::DeviceTensor;

// A routed weight [E, N, K] quantized on the device (mok::quantize_weights on CUDA views, on the
// legacy default stream), as a training step quantizes it.
class DeviceQuantized {
 public:
  explicit DeviceQuantized(const TensorView& w)
      : layout_(quantized_weights_layout(w.shape[0], w.shape[1], w.shape[2])),
        buffer_(layout_.bytes),
        q_(quantized_weights_views(layout_, buffer_.get(), w.device)) {
    quantize(w);
  }
  void quantize(const TensorView& w, cudaStream_t stream = nullptr) const {
    quantize_weights(w, q_, stream);
  }
  const QuantizedWeights& get() const { return q_; }
  // Its four tensors' bytes (data, scales, data_t, scales_t), without the padding between them.
  std::vector<std::uint8_t> bytes() const {
    const std::vector<std::uint8_t> all = buffer_.download();
    return fields_of(q_, buffer_.get(), all.data());
  }
  static std::vector<std::uint8_t> fields_of(const QuantizedWeights& q, const void* base,
                                             const std::uint8_t* bytes) {
    std::vector<std::uint8_t> out;
    for (const TensorView* v : {&q.data, &q.scales, &q.data_t, &q.scales_t}) {
      const auto at =
          static_cast<const std::uint8_t*>(v->data) - static_cast<const std::uint8_t*>(base);
      out.insert(out.end(), bytes + at, bytes + at + v->numel() * dtype_size(v->dtype));
    }
    return out;
  }

 private:
  QuantizedWeightsLayout layout_;
  DeviceBuffer<std::uint8_t> buffer_;
  QuantizedWeights q_;
};

struct DeviceFp8Weights {
  explicit DeviceFp8Weights(const DeviceLayer& g)
      : gate(g.gate.view()), up(g.up.view()), down(g.down.view()) {}
  Fp8Weights get() const { return {gate.get(), up.get(), down.get()}; }
  void quantize(const DeviceLayer& g, cudaStream_t stream) const {
    gate.quantize(g.gate.view(), stream);
    up.quantize(g.up.view(), stream);
    down.quantize(g.down.view(), stream);
  }
  DeviceQuantized gate, up, down;
};

// `token_axis` false: without the token-axis copies (WorkspaceOptions::fp8_token_axis).
WorkspaceOptions fp8_options(bool token_axis = true) {
  return {.backend = Backend::cuda, .fp8 = true, .fp8_token_axis = token_axis};
}

// One FP8 training step on the GPU through the public API over `g`'s tensors, the weights
// quantized on the device.
void run_fp8_step(DeviceLayer& g, const Problem& p, const Config& config = {},
                  BackwardOptions options = {}, bool token_axis = true) {
  const DeviceFp8Weights q(g);
  Workspace ws(p, config, fp8_options(token_axis));
  DeviceContext ctx(ws);
  forward(ws, g.inputs(), g.weights(), q.get(), g.out.view(), ctx.get());
  backward(ws, g.inputs(), g.weights(), q.get(), ctx.get(), g.d_out.view(), g.grads(), options);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// One FP8 training step of `d`; every output and gradient back in `d`.
void run_fp8_gpu(LayerData& d, const Config& config = {}, const BackwardOptions& options = {},
                 bool token_axis = true) {
  DeviceLayer g(d);
  run_fp8_step(g, d.problem, config, options, token_axis);
  g.download(d);
}

struct Fp8Case {
  const char* name;
  Problem problem;
  Routing routing;
  bool drop_slots;
};
void PrintTo(const Fp8Case& c, std::ostream* os) {
  *os << c.name;
}

LayerData make_case(const Fp8Case& c, std::uint64_t seed, DType grad_dtype = DType::bf16) {
  LayerData d = make_layer_data(c.problem, DType::bf16, seed, c.routing, grad_dtype);
  if (c.drop_slots) {
    for (std::int64_t s = 0; s < c.problem.num_tokens * c.problem.topk; s += 5) {
      d.topk_experts.set(s, -1);
    }
  }
  d.poison_outputs();
  return d;
}

using Field = HostTensor LayerData::*;
struct NamedField {
  const char* name;
  Field field;
  std::int64_t row;      // elements of a row: the per-row check's unit
  bool cancels = false;  // a row is a few sums of terms of either sign (expect_close_to_reference)
};
std::vector<NamedField> routed_fields(const Problem& p) {
  return {{"out", &LayerData::out, p.hidden_size},
          {"d_x", &LayerData::d_x, p.hidden_size},
          {"d_topk_weights", &LayerData::d_topk_weights, p.topk, true},
          {"d_routed_gate_weights", &LayerData::d_gate, p.hidden_size},
          {"d_routed_up_weights", &LayerData::d_up, p.hidden_size},
          {"d_routed_down_weights", &LayerData::d_down, p.intermediate_size}};
}

// The GPU's FP8 layer against the CPU's. They differ where wgmma's sum of a K block's e4m3
// products (fp32, with Hopper's truncation: mok's GEMM tests bound it by 2^-9 of the block's sum
// of |products|) and the reference's exact one fall on two sides of a bf16 rounding: that value
// then differs by one bf16 ulp (2^-8 relative), and an operand quantized from it may round to the
// neighbouring e4m3 value, 2^-3 of one term of the next GEMM. Such flips are scattered, so whole
// tensors agree far better than either agrees with the f64 layer (about 5%): sum|diff| / sum|ref|
// within 2^-5. And no row strays: a row of the wrong expert, a missing block scale or a block
// read from the wrong place is off by 50% or more, while a flip moves an element by at most one
// e4m3 step (2^-3 of it) and a row holds many: every row within 1/4 (a weight gradient's row of
// an expert with one token is one product per element), and a row the reference leaves at zero
// (unused slots) is zero here too. `cancels` (d_topk_weights: a row is k dot products over I of
// either sign): such a sum can cancel far below its terms, and then a flip in one term is a large
// part of it (2 of 64 rows over 1/4, seen on an H100 with MOK_TEST_SEED=2378784551): its rows
// are measured against the larger of their own sum and a quarter of the tensor's mean row sum,
// which a row of the wrong expert or a lost block still misses by far.
void expect_close_to_reference(const HostTensor& got, const HostTensor& ref, std::int64_t row,
                               const std::string& name, bool cancels = false) {
  ASSERT_EQ(got.numel(), ref.numel()) << name;
  double ref_sum = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) ref_sum += std::fabs(ref.get(i));
  const double floor = cancels ? ref_sum / std::max<std::int64_t>(1, ref.numel() / row) / 4 : 0.0;
  double diff = 0, sum = 0, worst = 0;
  std::int64_t worst_row = -1, bad_rows = 0;
  for (std::int64_t r0 = 0; r0 < got.numel(); r0 += row) {
    double d = 0, s = 0;
    for (std::int64_t i = r0; i < r0 + row; ++i) {
      d += std::fabs(got.get(i) - ref.get(i));  // NaN: the comparisons below fail
      s += std::fabs(ref.get(i));
    }
    diff += d, sum += s;
    const double rel = s > 0 ? d / std::max(s, floor) : (d == 0 ? 0.0 : INFINITY);
    if (!(rel <= 0.25)) ++bad_rows;
    if (!(rel <= worst)) worst = rel, worst_row = r0 / row;
  }
  const double rel = diff / sum;
  std::printf("[ mok ]   %-22s gpu vs cpu fp8: rel %.3e, worst row %lld at %.3e\n", name.c_str(),
              rel, static_cast<long long>(worst_row), worst);
  EXPECT_LE(rel, 1.0 / 32) << name;
  EXPECT_EQ(bad_rows, 0) << name << ": rows off by more than 1/4 (worst row " << worst_row << ", "
                         << worst << ")";
}

class Fp8LayerGpu : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8LayerGpu, MatchesTheCpuFp8LayerAndTheF64BoundsAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER();
  const Fp8Case& c = GetParam();
  const std::uint64_t seed = test_seed();
  LayerData gpu = make_case(c, seed);
  run_fp8_gpu(gpu);
  // The CPU FP8 layer over host-quantized weights (the same bits as the device's: checked here).
  LayerData cpu = make_case(c, seed);
  const HostFp8Weights hq(cpu);
  {
    DeviceLayer g(cpu);
    const DeviceFp8Weights dq(g);
    const std::pair<const HostQuantized*, const DeviceQuantized*> pairs[] = {
        {&hq.gate, &dq.gate}, {&hq.up, &dq.up}, {&hq.down, &dq.down}};
    for (const auto& [h, d] : pairs) {
      const QuantizedWeights& v = h->get();
      const auto* base = static_cast<const std::uint8_t*>(v.data.data);  // the layout's first
      EXPECT_TRUE(d->bytes() == DeviceQuantized::fields_of(v, base, base))
          << "the device's quantized weights differ from the host's";
    }
  }
  run_fp8(cpu, hq.get());
  LayerData bf16 = make_case(c, seed);
  run_gpu(bf16);
  LayerData f64 = convert_layer_data(make_case(c, seed), DType::f64);
  run_layer(f64);
  const Problem& p = c.problem;
  std::printf("[ mok ] %s (T %lld H %lld I %lld E %lld k %lld S %lld)\n", c.name,
              static_cast<long long>(p.num_tokens), static_cast<long long>(p.hidden_size),
              static_cast<long long>(p.intermediate_size), static_cast<long long>(p.num_experts),
              static_cast<long long>(p.topk), static_cast<long long>(p.shared_intermediate_size));
  for (const auto& [name, field, row, cancels] : routed_fields(p)) {
    expect_close_to_reference(gpu.*field, cpu.*field, row, name, cancels);
    const Errors e = errors_of(gpu.*field, f64.*field), b = errors_of(bf16.*field, f64.*field);
    std::printf("[ mok ]   %-22s vs f64: fp8 abs max %.3e rel %.3e cos %.6f | bf16 rel %.3e\n",
                name, e.abs_max, e.rel_sum, e.cosine, b.rel_sum);
    // MoK's bounds are statistical (sums over many elements): on a tensor of a few rows one
    // element's FP8 rounding decides them (one token's d_topk_weights is one sum of 128 products
    // of either sign, its relative error about Cauchy with scale 0.05: over 10% on about a third
    // of draws). They apply from 16 rows on; the CPU FP8 layer bounds every tensor above.
    if (c.problem.num_tokens < 16) continue;
    if (field == &LayerData::out || field == &LayerData::d_x) EXPECT_LE(e.abs_max, 1.0) << name;
    EXPECT_LE(e.rel_sum, 0.1) << name;
    EXPECT_GE(e.cosine, 0.996) << name;
  }
  // The FP8 GEMMs ran (the bf16 layer's output is other numbers), and the shared expert is the
  // bf16 layer's, bit for bit.
  if (cpu.topk_experts.numel() > 0) EXPECT_FALSE(same_bits(gpu.out, bf16.out));
  EXPECT_TRUE(same_bits(gpu.d_shared_gate, bf16.d_shared_gate));
  EXPECT_TRUE(same_bits(gpu.d_shared_up, bf16.d_shared_up));
  EXPECT_TRUE(same_bits(gpu.d_shared_down, bf16.d_shared_down));
  for (int run = 1; run < std::min(3, test_runs()); ++run) {
    LayerData again = make_case(c, seed);
    run_fp8_gpu(again);
    EXPECT_TRUE(all_outputs_same(gpu, again)) << "run " << run << " differs";
  }
}

// Skewed routing gives expert 0 several 128-row token blocks (the last partial); odd token counts;
// unused slots; one token; the wide case has 8 K blocks per GEMM.
INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8LayerGpu,
    ::testing::Values(
        Fp8Case{"uniform_shared", layer_shape(257, 256, 384, 8, 2, 128), Routing::softmax, false},
        Fp8Case{"skewed_no_shared", layer_shape(131, 128, 256, 6, 3, 0), Routing::skewed, false},
        Fp8Case{"one_expert", layer_shape(64, 128, 128, 5, 2, 64), Routing::one_expert, false},
        Fp8Case{"unused_slots", layer_shape(97, 128, 128, 4, 4, 128), Routing::softmax, true},
        Fp8Case{"one_token", layer_shape(1, 128, 128, 3, 1, 128), Routing::softmax, false},
        Fp8Case{"wide", layer_shape(512, 1024, 512, 16, 4, 256), Routing::softmax, false}),
    [](const auto& info) { return std::string(info.param.name); });

// Several ring passes (backward replays every pass but the first, and carries the weight
// gradients of experts that span passes in fp32) give the bits of one pass.
TEST(Fp8LayerGpuRing, SeveralPassesGiveTheBitsOfOne) {
  MOK_REQUIRE_HOPPER();
  const Fp8Case c{"passes", layer_shape(300, 128, 128, 5, 3, 64), Routing::skewed, false};
  const std::uint64_t seed = test_seed();
  LayerData one = make_case(c, seed);
  Config one_pass;
  one_pass.minibatch_size = 128;
  one_pass.macrobatch_size = 4096;
  run_fp8_gpu(one, one_pass);
  for (std::int64_t macro : {128, 256, 384, 640}) {
    Config small;
    small.minibatch_size = 128;
    small.macrobatch_size = macro;
    LayerData many = make_case(c, seed);
    run_fp8_gpu(many, small);
    EXPECT_TRUE(all_outputs_same(one, many)) << "macrobatch_size " << macro;
  }
}

// BackwardOptions::fp8_weight_grads false: the routed weight gradients are bf16 products of the
// bf16 rows (no token-axis copy), everything else the default FP8 step's bits. Against the CPU
// FP8 layer with the same option (its bf16 operands dg, du, h differ from the GPU's only by the
// FP8 GEMMs' bf16 flips, as in expect_close_to_reference), closer to the f64 layer than the e4m3
// weight gradients, bitwise run to run, and the bits of one ring pass in several (the fp32 carry of
// experts spanning passes), uniform and skewed.
TEST(Fp8LayerGpuWeightGrads, Bf16WeightGradsMatchTheCpuLayerAndTheBitsOfOnePass) {
  MOK_REQUIRE_HOPPER();
  const std::uint64_t seed = test_seed();
  BackwardOptions bf16_wgrads;
  bf16_wgrads.fp8_weight_grads = false;
  const Fp8Case cases[] = {
      {"uniform_shared", layer_shape(257, 256, 384, 8, 2, 128), Routing::softmax, false},
      {"skewed_unused_slots", layer_shape(300, 128, 256, 5, 3, 64), Routing::skewed, true},
      // I <= H: dW_down = d_out^T bf16(w h), bf16(w h) from the e4m3 down dgrad's epilogue (the
      // reference rounds bf16(w d_out) instead: the same precision, other bits).
      {"narrow_experts", layer_shape(193, 384, 256, 6, 2, 0), Routing::softmax, true}};
  for (const Fp8Case& c : cases) {
    LayerData gpu = make_case(c, seed);
    run_fp8_gpu(gpu, {}, bf16_wgrads);
    LayerData fp8 = make_case(c, seed);
    run_fp8_gpu(fp8);
    LayerData cpu = make_case(c, seed);
    const HostFp8Weights hq(cpu);
    run_fp8(cpu, hq.get(), 0, {}, true, bf16_wgrads);
    LayerData f64 = convert_layer_data(make_case(c, seed), DType::f64);
    run_layer(f64);
    std::printf("[ mok ] %s, bf16 weight gradients\n", c.name);
    EXPECT_TRUE(same_bits(gpu.out, fp8.out)) << c.name;
    EXPECT_TRUE(same_bits(gpu.d_x, fp8.d_x)) << c.name;
    EXPECT_TRUE(same_bits(gpu.d_topk_weights, fp8.d_topk_weights)) << c.name;
    EXPECT_TRUE(same_bits(gpu.d_shared_gate, fp8.d_shared_gate)) << c.name;
    EXPECT_TRUE(same_bits(gpu.d_shared_down, fp8.d_shared_down)) << c.name;
    for (const auto& [name, field, row, cancels] : routed_fields(c.problem)) {
      if (field != &LayerData::d_gate && field != &LayerData::d_up && field != &LayerData::d_down) {
        continue;
      }
      expect_close_to_reference(gpu.*field, cpu.*field, row, name, cancels);
      const Errors e = errors_of(gpu.*field, f64.*field), f = errors_of(fp8.*field, f64.*field);
      std::printf("[ mok ]   %-22s vs f64: bf16 wgrad rel %.3e cos %.6f | e4m3 wgrad rel %.3e\n",
                  name, e.rel_sum, e.cosine, f.rel_sum);
      EXPECT_LT(e.rel_sum, f.rel_sum) << name;
      EXPECT_GE(e.cosine, 0.996) << name;
    }
    for (int run = 1; run < std::min(3, test_runs()); ++run) {
      LayerData again = make_case(c, seed);
      run_fp8_gpu(again, {}, bf16_wgrads);
      EXPECT_TRUE(all_outputs_same(gpu, again)) << c.name << ": run " << run << " differs";
    }
    Config one_pass, passes;
    one_pass.minibatch_size = passes.minibatch_size = 128;
    one_pass.macrobatch_size = 4096;
    passes.macrobatch_size = 256;
    LayerData one = make_case(c, seed), many = make_case(c, seed);
    run_fp8_gpu(one, one_pass, bf16_wgrads);
    run_fp8_gpu(many, passes, bf16_wgrads);
    EXPECT_TRUE(all_outputs_same(one, many)) << c.name << ": several passes";
  }
}

// A workspace made without the token-axis copies (WorkspaceOptions::fp8_token_axis false: what
// bf16 weight gradients need): their bits are the full workspace's, in one ring pass and in
// several; it holds exactly the copies' bytes less (plan::make_fp8_plan); a backward asking for
// e4m3 weight gradients on it is refused before any work, naming the option, and the workspace
// then runs the next call to the same bits.
TEST(Fp8LayerGpuWeightGrads, WithoutTheTokenAxisCopies) {
  MOK_REQUIRE_HOPPER();
  const std::uint64_t seed = test_seed();
  BackwardOptions bf16_wgrads;
  bf16_wgrads.fp8_weight_grads = false;
  const Fp8Case c{"uniform_shared", layer_shape(257, 256, 384, 8, 2, 128), Routing::softmax,
                  false};
  Config passes;  // experts' rows spread over several ring passes
  passes.minibatch_size = 128;
  passes.macrobatch_size = 256;
  for (const Config& config : {Config{}, passes}) {
    LayerData full = make_case(c, seed), lean = make_case(c, seed);
    run_fp8_gpu(full, config, bf16_wgrads);
    run_fp8_gpu(lean, config, bf16_wgrads, /*token_axis=*/false);
    EXPECT_TRUE(all_outputs_same(full, lean))
        << (config.macrobatch_size == passes.macrobatch_size ? "several passes" : "one pass");
  }
  LayerData want = make_case(c, seed);
  run_fp8_gpu(want, Config{}, bf16_wgrads);
  Workspace with(c.problem, Config{}, fp8_options());
  Workspace without(c.problem, Config{}, fp8_options(/*token_axis=*/false));
  const plan::PlanShape shape = plan_shape_of(c.problem, Config{});
  const std::int64_t copies =
      plan::make_fp8_plan(shape).bytes - plan::make_fp8_plan(shape, /*token_axis=*/false).bytes;
  EXPECT_GT(copies, 0);
  EXPECT_EQ(static_cast<std::int64_t>(with.bytes() - without.bytes()), copies);

  LayerData d = make_case(c, seed);
  DeviceLayer g(d);
  const DeviceFp8Weights q(g);
  DeviceContext ctx(without);
  forward(without, g.inputs(), g.weights(), q.get(), g.out.view(), ctx.get());
  expect_error(
      [&] {
        backward(without, g.inputs(), g.weights(), q.get(), ctx.get(), g.d_out.view(), g.grads(),
                 BackwardOptions{});
      },
      {"WorkspaceOptions.fp8_token_axis"});
  backward(without, g.inputs(), g.weights(), q.get(), ctx.get(), g.d_out.view(), g.grads(),
           bf16_wgrads);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  g.download(d);
  EXPECT_TRUE(all_outputs_same(want, d)) << "the call after the refusal";
}

// Experts [first, first + count) of a quantized weight (views into it).
QuantizedWeights experts_of(const QuantizedWeights& q, std::int64_t first, std::int64_t count) {
  auto rows = [&](TensorView v) {
    v.data = static_cast<char*>(v.data) + first * v.strides[0] * dtype_size(v.dtype);
    v.shape[0] = count;
    return v;
  };
  return {rows(q.data), rows(q.scales), rows(q.data_t), rows(q.scales_t)};
}

// Rank r's quantized weights (of W, E_l experts each): its experts' slice of the whole layer's.
std::vector<Fp8Weights> rank_slices(const DeviceFp8Weights& q, int W, std::int64_t E_l) {
  std::vector<Fp8Weights> local(W);
  for (int r = 0; r < W; ++r) {
    local[r] = {experts_of(q.gate.get(), r * E_l, E_l), experts_of(q.up.get(), r * E_l, E_l),
                experts_of(q.down.get(), r * E_l, E_l)};
  }
  return local;
}

// W virtual ranks on one GPU, each rank's experts' quantized weights a slice of the whole layer's:
// every routed output and gradient is bitwise one GPU running the whole layer (each expert sees
// its rows in the same order, so the same 128-row token blocks).
TEST(Fp8LayerGpuExpertParallel, VirtualRanksGiveTheSingleGpuBits) {
  MOK_REQUIRE_HOPPER();
  const std::int64_t T = 64, H = 128, I = 128, E = 16, k = 4, S = 64;
  const std::uint64_t seed = test_seed();
  for (int W : {2, 4, 8}) {
    for (Routing routing : {Routing::softmax, Routing::skewed}) {
      const Problem global = layer_shape(W * T, H, I, E, k, S);
      LayerData one = make_layer_data(global, DType::bf16, seed + W, routing);
      for (std::int64_t s = 3; s < W * T * k; s += 11) one.topk_experts.set(s, -1);
      LayerData many = one;
      run_fp8_gpu(one);
      Problem p = global;
      p.num_tokens = T;
      p.ep_size = W;
      DeviceLayer g(many);
      const DeviceFp8Weights q(g);
      cuda::Layer layer(p, Config{}, 0, {}, /*fp8=*/true);
      ASSERT_TRUE(layer.has_fp8());
      std::vector<std::unique_ptr<DeviceTensor>> scratch;
      std::vector<std::unique_ptr<DeviceContext>> contexts;
      std::vector<cuda::RankTensors> ranks = split_into_ranks(g, p, scratch, contexts);
      const std::int64_t E_l = E / W;
      std::vector<Fp8Weights> local = rank_slices(q, W, E_l);
      for (int r = 0; r < W; ++r) ranks[r].q = &local[r];
      layer.forward(ranks, true, nullptr);
      layer.backward(ranks, BackwardOptions{}, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      layer.check_errors(nullptr);
      g.download(many);
      const std::string what =
          "W " + std::to_string(W) + (routing == Routing::softmax ? " uniform" : " skewed");
      expect_single_gpu_bits(one, many, what);
      // A call with quantized weights for some ranks only is refused before any work.
      ranks[W - 1].q = nullptr;
      expect_error([&] { layer.forward(ranks, true, nullptr); }, {"RankTensors.q"});
    }
  }
}

// The FP8 layer as a team across processes (cuda::ExternalRank; external_team.hpp runs the ranks
// as host threads, on one GPU with its stall rules, or one rank per GPU): every output and
// gradient bitwise one GPU running the whole FP8 layer, as over virtual ranks above. The device
// code a CUDA team of processes runs.
void run_fp8_team(int W, std::int64_t E, Routing routing, std::uint64_t seed, int devices) {
  constexpr int kRepetitions = 5;
  const std::uint64_t timeout_ms = devices == 1 ? 2000 : 5000;
  const std::int64_t T = 48, H = 128, I = 128, k = 4, S = 64;
  const Problem global = layer_shape(W * T, H, I, E, k, S);
  LayerData one = make_layer_data(global, DType::bf16, seed, routing);
  for (std::int64_t s = 3; s < W * T * k; s += 13) one.topk_experts.set(s, -1);
  const LayerData many = one;
  run_fp8_gpu(one);
  Problem p = global;
  p.num_tokens = T;
  p.ep_size = W;
  const std::int64_t E_l = E / W;
  // Each repetition's weights quantized on each GPU, each rank given its experts' slice.
  struct Quantized {
    explicit Quantized(const DeviceLayer& g) : q(g) {}
    DeviceFp8Weights q;
    std::vector<Fp8Weights> local;
  };
  const PrepareRanks quantize = [&](DeviceLayer& g, std::vector<cuda::RankTensors>& ranks) {
    auto held = std::make_shared<Quantized>(g);
    held->local = rank_slices(held->q, W, E_l);
    for (int r = 0; r < W; ++r) ranks[r].q = &held->local[r];
    return std::shared_ptr<void>(held);
  };
  const std::string what = "FP8, W " + std::to_string(W) +
                           (devices > 1 ? " on " + std::to_string(devices) + " GPUs" : "") +
                           (routing == Routing::softmax ? " uniform" : " skewed");
  run_external_team(p, one, many, what, kRepetitions, timeout_ms, /*fp8=*/true, quantize, devices);
}

TEST(Fp8LayerGpuExpertParallel, ExternalRanksGiveTheSingleGpuBits) {
  MOK_REQUIRE_HOPPER();
  for (int W : {2, 4}) {
    for (Routing routing : {Routing::softmax, Routing::skewed}) {
      run_fp8_team(W, 16, routing, test_seed() + 91 + W, 1);
    }
  }
}

// The same with one rank per GPU (W = 2 and every GPU the machine has, up to 8); with fewer than
// two GPUs it skips, saying so (scripts/gpu-suite expects that).
TEST(Fp8LayerGpuExpertParallel, RanksOnSeveralGpusGiveTheSingleGpuBits) {
  MOK_REQUIRE_HOPPER();
  std::string why;
  const std::vector<int> teams = several_gpu_teams(why);
  if (teams.empty()) GTEST_SKIP() << why;
  for (int W : teams) {
    for (Routing routing : {Routing::softmax, Routing::skewed}) {
      run_fp8_team(W, 4 * W, routing, test_seed() + 93 + W, W);
    }
  }
}

// The FP8 layer's kernel choices (cuda::Layer::Fp8Kernels) give the defaults' bits on every
// output and gradient: the down dgrad's quantizing epilogue (its q(du) in the bf16 du scratch),
// 128 x 128 instead of 128 x 256 tiles (H and I multiples of 256, so that every M-grouped form
// takes the wide ones), both together, the M-grouped overlap, the plain wgrad loop, the wgrad's
// store, the token-axis quantizer's row loads, the rows epilogues (q(h), and q(dg) and q(du), from
// the GEMMs that write h, dg and du: each flipped alone, both with 128 x 128 tiles, where the
// gate/up form leaves q(h) to its pass, and both beside the quantizing epilogue, which takes
// precedence); in one ring pass and
// in several (experts spanning passes), uniform and skewed, with e4m3 and with bf16 weight
// gradients (BackwardOptions::fp8_weight_grads); and wide with overlap refused, naming the
// option.
TEST(Fp8LayerGpuKernels, EveryChoiceGivesTheDefaultsBits) {
  MOK_REQUIRE_HOPPER();
  using Kernels = cuda::Layer::Fp8Kernels;
  const Problem p = layer_shape(300, 512, 256, 8, 4, 128);
  const std::uint64_t seed = test_seed();
  struct Choice {
    const char* name;
    Kernels k;
  };
  const Kernels d{};
  // Each away from the defaults (cuda::Layer::Fp8Kernels), alone and where two interact.
  const Choice choices[] = {
      {"wide flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, !d.wide, d.quantizing_epilogue}},
      {"quantizing_epilogue flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, d.wide, !d.quantizing_epilogue}},
      {"both flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, !d.wide, !d.quantizing_epilogue}},
      {"overlap (128 x 128 tiles), plain wgrad loop",
       {true, !d.wgrad_overlap, d.wgrad_tma_store, false, d.quantizing_epilogue}},
      {"wgrad_tma_store flipped",
       {d.overlap, d.wgrad_overlap, !d.wgrad_tma_store, d.wide, d.quantizing_epilogue}},
      {"token_axis_row_loads flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, d.wide, d.quantizing_epilogue,
        !d.token_axis_row_loads}},
      {"hidden_epilogue flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, d.wide, d.quantizing_epilogue,
        d.token_axis_row_loads, !d.hidden_epilogue, d.dgrad_rows_epilogue}},
      {"dgrad_rows_epilogue flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, d.wide, d.quantizing_epilogue,
        d.token_axis_row_loads, d.hidden_epilogue, !d.dgrad_rows_epilogue}},
      {"dgrad_rows_wide flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, d.wide, d.quantizing_epilogue,
        d.token_axis_row_loads, d.hidden_epilogue, d.dgrad_rows_epilogue, !d.dgrad_rows_wide}},
      {"both rows epilogues on, wide flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, !d.wide, d.quantizing_epilogue,
        d.token_axis_row_loads, true, true}},
      {"both rows epilogues on, quantizing_epilogue flipped",
       {d.overlap, d.wgrad_overlap, d.wgrad_tma_store, d.wide, !d.quantizing_epilogue,
        d.token_axis_row_loads, true, true}},
  };
  // One training step through cuda::Layer with the given choices.
  const auto step = [&](LayerData& data, const Config& config, const Kernels& k,
                        bool fp8_weight_grads) {
    DeviceLayer g(data);
    const DeviceFp8Weights q(g);
    cuda::Layer layer(p, config, 0, {}, /*fp8=*/true);
    layer.set_fp8_kernels(k);
    std::vector<std::unique_ptr<DeviceTensor>> scratch;
    std::vector<std::unique_ptr<DeviceContext>> contexts;
    std::vector<cuda::RankTensors> ranks = split_into_ranks(g, p, scratch, contexts);
    const Fp8Weights w = q.get();
    ranks[0].q = &w;
    layer.forward(ranks, true, nullptr);
    BackwardOptions options;
    options.fp8_weight_grads = fp8_weight_grads;
    layer.backward(ranks, options, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    layer.check_errors(nullptr);
    g.download(data);
  };
  Config passes;  // experts' rows spread over several ring passes
  passes.minibatch_size = 128;
  passes.macrobatch_size = 512;
  for (Routing routing : {Routing::softmax, Routing::skewed}) {
    for (const Config& config : {Config{}, passes}) {
      for (const bool fp8_weight_grads : {true, false}) {
        const Fp8Case c{"kernels", p, routing, false};
        LayerData want = make_case(c, seed);
        step(want, config, d, fp8_weight_grads);
        for (const Choice& choice : choices) {
          LayerData got = make_case(c, seed);
          step(got, config, choice.k, fp8_weight_grads);
          EXPECT_TRUE(all_outputs_same(want, got))
              << choice.name << (routing == Routing::softmax ? ", uniform" : ", skewed")
              << (config.macrobatch_size == passes.macrobatch_size ? ", several passes" : "")
              << (fp8_weight_grads ? "" : ", bf16 weight gradients");
        }
      }
    }
  }
  cuda::Layer layer(p, Config{}, 0, {}, /*fp8=*/true);
  expect_error(
      [&] {
        layer.set_fp8_kernels({true, d.wgrad_overlap, false, true, false});
      },
      {"fp8_kernels.wide"});
  EXPECT_FALSE(layer.fp8_kernels().overlap) << "a refused choice was kept";
}

// With every slot unused only the shared expert remains: the FP8 layer is the bf16 layer's bits.
TEST(Fp8LayerGpuSharedExpert, IsTheBf16LayersBitForBit) {
  MOK_REQUIRE_HOPPER();
  const Problem p = layer_shape(33, 128, 128, 3, 2, 64);
  LayerData a = make_layer_data(p, DType::bf16, test_seed());
  a.topk_experts.fill(-1);
  LayerData b = a;
  run_fp8_gpu(a);
  run_gpu(b);
  EXPECT_TRUE(all_outputs_same(a, b));
}

// recompute_forward_context (no router weights, no down weights) writes the FP8 forward's context
// bytes, and a bf16 backward refuses that context.
TEST(Fp8LayerGpuRecompute, SameContextAsTheForward) {
  MOK_REQUIRE_HOPPER();
  const Problem p = layer_shape(150, 256, 128, 6, 2, 64);
  LayerData d = make_layer_data(p, DType::bf16, test_seed(), Routing::skewed);
  DeviceLayer g(d);
  const DeviceFp8Weights q(g);
  Workspace ws(p, Config{}, fp8_options());
  DeviceContext a(ws), b(ws);
  forward(ws, g.inputs(), g.weights(), q.get(), g.out.view(), a.get());
  Inputs in = g.inputs();
  in.topk_weights = TensorView{};
  Fp8Weights no_down = q.get();
  no_down.down = QuantizedWeights{};
  // No bf16 routed weights (the FP8 layer reads its blocks), no down projections; the shared
  // expert's gate and up are read.
  Weights w = g.weights();
  w.gate = w.up = w.down = w.shared_down = TensorView{};
  recompute_forward_context(ws, in, w, no_down, b.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(a.download() == b.download());
  expect_error([&] { backward(ws, g.inputs(), g.weights(), a.get(), g.d_out.view(), g.grads()); },
               {"forward context", "bf16 layer's forward", "recorded by the FP8 layer"});
}

// A whole FP8 step, the weights' quantization included (a training step changes the weights), in
// a CUDA graph: replays with new inputs, weights and routings give an eager step's bits.
TEST(Fp8LayerGpuGraph, CapturedStepReplaysWithNewInputsAndRoutings) {
  MOK_REQUIRE_HOPPER();
  const Fp8Case c{"graph", layer_shape(150, 128, 256, 6, 2, 64), Routing::softmax, false};
  const std::uint64_t seed = test_seed();
  LayerData first = make_case(c, seed);
  DeviceLayer g(first);
  const DeviceFp8Weights q(g);
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Workspace ws(c.problem, Config{}, fp8_options());
  DeviceContext ctx(ws);
  ws.set_stream(stream);
  auto step = [&] {
    q.quantize(g, stream);
    forward(ws, g.inputs(), g.weights(), q.get(), g.out.view(), ctx.get());
    backward(ws, g.inputs(), g.weights(), q.get(), ctx.get(), g.d_out.view(), g.grads());
  };
  step();
  MOK_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step();
  MOK_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const Routing routings[] = {Routing::softmax, Routing::skewed, Routing::one_expert};
  for (int i = 0; i < 3; ++i) {
    const Fp8Case replay{c.name, c.problem, routings[i], i == 1};
    LayerData d = make_case(replay, seed + 1 + i);
    g.upload_inputs(d);
    g.poison();
    MOK_CUDA_OK(cudaGraphLaunch(exec, stream));
    MOK_CUDA_OK(cudaStreamSynchronize(stream));
    g.download(d);
    LayerData eager = make_case(replay, seed + 1 + i);
    run_fp8_gpu(eager);
    EXPECT_TRUE(all_outputs_same(d, eager)) << "replay " << i << " differs from an eager step";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// fp32 weight gradients of the FP8 layer, written and accumulated (main grads): written, they
// round to the bf16 gradients' bits; accumulated, old + fresh exactly; over one pass and several
// (the carried experts' sums too).
TEST(Fp8LayerGpuGrads, Fp32MainGradAccumulation) {
  MOK_REQUIRE_HOPPER();
  const Fp8Case c{"fp32", layer_shape(200, 128, 256, 4, 2, 64), Routing::skewed, false};
  const std::uint64_t seed = test_seed();
  for (std::int64_t macro : {4096, 128}) {
    Config config;
    config.minibatch_size = 128;
    config.macrobatch_size = macro;
    LayerData bf16 = make_case(c, seed);
    run_fp8_gpu(bf16, config);
    LayerData fresh = make_case(c, seed, DType::f32);
    run_fp8_gpu(fresh, config);
    LayerData acc = make_case(c, seed, DType::f32);
    DeviceLayer g(acc);
    for (HostTensor* t : {&acc.d_gate, &acc.d_up, &acc.d_down, &acc.d_shared_gate, &acc.d_shared_up,
                          &acc.d_shared_down}) {
      for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 0.5 * (i % 5) - 1.0);
    }
    g.d_gate.upload(acc.d_gate), g.d_up.upload(acc.d_up), g.d_down.upload(acc.d_down);
    g.d_sg.upload(acc.d_shared_gate), g.d_su.upload(acc.d_shared_up),
        g.d_sd.upload(acc.d_shared_down);
    run_fp8_step(g, c.problem, config, {.accumulate_weight_grads = true});
    g.download(acc);
    const std::string at = "macrobatch " + std::to_string(macro);
    for (auto [b, f, a] : {std::tuple{&bf16.d_gate, &fresh.d_gate, &acc.d_gate},
                           {&bf16.d_up, &fresh.d_up, &acc.d_up},
                           {&bf16.d_down, &fresh.d_down, &acc.d_down}}) {
      for (std::int64_t i = 0; i < f->numel(); ++i) {
        const float v = static_cast<float>(f->get(i));
        ASSERT_EQ(static_cast<double>(round_to_bf16(v)), b->get(i)) << at << ", element " << i;
        const float want = static_cast<float>(0.5 * (i % 5) - 1.0) + v;
        ASSERT_EQ(static_cast<float>(a->get(i)), want) << at << ", element " << i;
      }
    }
  }
}

// What the CUDA backend refuses, by name, before any work; the next good call works.
TEST(Fp8LayerGpuValidation, RefusalsNameTheOptionAndTheNextCallWorks) {
  MOK_REQUIRE_HOPPER();
  const Problem p = layer_shape(40, 128, 128, 4, 2, 64);
  LayerData d = make_layer_data(p, DType::bf16, test_seed());
  DeviceLayer g(d);
  const DeviceFp8Weights q(g);
  {  // a workspace made without the FP8 scratch
    Workspace ws(p, Config{}, {.backend = Backend::cuda});
    DeviceContext ctx(ws);
    expect_error([&] { forward(ws, g.inputs(), g.weights(), q.get(), g.out.view(), ctx.get()); },
                 {"WorkspaceOptions.fp8", "false"});
    forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());  // bf16 still runs
  }
  {  // the forward megakernel has no FP8 form
    Config fused;
    fused.forward_path = ForwardPath::fused;
    Workspace ws(p, fused, fp8_options());
    DeviceContext ctx(ws);
    expect_error([&] { forward(ws, g.inputs(), g.weights(), q.get(), g.out.view(), ctx.get()); },
                 {"config.forward_path", "fused"});
    // recompute_forward_context runs the launches' gate/up on any path.
    recompute_forward_context(ws, g.inputs(), g.weights(), q.get(), ctx.get());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // H not a multiple of 128: the FP8 scratch cannot be made.
  expect_error([&] { Workspace ws(layer_shape(40, 192, 128, 4, 2, 0), Config{}, fp8_options()); },
               {"hidden_size", "multiple of 128", "192"});
  // And the next good call works.
  LayerData good = make_layer_data(p, DType::bf16, test_seed());
  good.poison_outputs();
  run_fp8_gpu(good);
  EXPECT_TRUE(all_finite(good.out));
  EXPECT_TRUE(all_finite(good.d_gate));
}

}  // namespace
}  // namespace mok::test
