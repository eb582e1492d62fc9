// The CUDA layer (unfused path) end to end: forward and every gradient against the exact f64
// layer, bitwise determinism, bitwise invariance to the ring size, a whole step in a CUDA graph,
// and device-side validation of expert ids. Skipped without a GPU.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/schedule_check.hpp"
#include "core/workspace_plan.hpp"
#include "cuda/comm/team.hpp"
#include "cuda/kernels/fused_trace.hpp"
#include "cuda/layer/layer.hpp"
#include "external_team.hpp"
#include "gpu_buffer.hpp"
#include "layer_gpu_helpers.hpp"
#include "layer_helpers.hpp"
#include "support/kernel_hooks.hpp"
#include "synthetic/device_layer.hpp"

namespace mok::test {
namespace {

using cuda::DeviceContext;
using cuda::DeviceLayer;
using cuda::DeviceTensor;

struct GpuCase {
  const char* name;
  Problem problem;
  Routing routing;
  bool drop_slots;
};
void PrintTo(const GpuCase& c, std::ostream* os) {
  *os << c.name;
}

LayerData make_case(const GpuCase& c, std::uint64_t seed, DType grad_dtype = DType::bf16) {
  LayerData d = make_layer_data(c.problem, DType::bf16, seed, c.routing, grad_dtype);
  if (c.drop_slots) {
    for (std::int64_t s = 0; s < c.problem.num_tokens * c.problem.topk; s += 5) {
      d.topk_experts.set(s, -1);
    }
  }
  return d;
}

// One forward + backward on the GPU; results copied into `d`'s outputs.
class LayerGpu : public ::testing::TestWithParam<GpuCase> {};

TEST_P(LayerGpu, MatchesTheF64LayerAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER();
  const GpuCase& c = GetParam();
  const std::uint64_t seed = test_seed();
  LayerData d = make_case(c, seed);
  run_gpu(d);
  // Every element against the f64 layer, the largest case ("wide", 2.2e10 FLOPs of f64 work)
  // included: a sample of its rows would leave most of them unchecked.
  CheckOptions full;
  full.max_full_flops = 1e11;
  const CheckReport r = check_against_f64(d, full);
  EXPECT_FALSE(r.sampled);
  EXPECT_TRUE(r.passed()) << r.summary();
  std::printf("[ mok ] %s: out %.2e, grads max %.2e\n", c.name, r.out_rel_err(),
              r.grad_rel_err_max());
  for (int run = 1; run < test_runs(); ++run) {  // each from fresh buffers
    LayerData again = make_case(c, seed);
    run_gpu(again);
    EXPECT_TRUE(all_outputs_same(d, again)) << "run " << run << " differs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LayerGpu,
    ::testing::Values(
        GpuCase{"uniform_shared", layer_shape(257, 128, 192, 8, 2, 64), Routing::softmax, false},
        GpuCase{"skewed_no_shared", layer_shape(131, 192, 128, 6, 3, 0), Routing::skewed, false},
        GpuCase{"one_expert", layer_shape(64, 128, 64, 5, 2, 64), Routing::one_expert, false},
        GpuCase{"unused_slots", layer_shape(97, 64, 128, 4, 4, 128), Routing::softmax, true},
        GpuCase{"one_token", layer_shape(1, 64, 64, 3, 1, 64), Routing::softmax, false},
        GpuCase{"top1_one_expert", layer_shape(33, 64, 64, 1, 1, 0), Routing::softmax, false},
        GpuCase{"wide", layer_shape(512, 1024, 512, 16, 4, 256), Routing::softmax, false}),
    [](const auto& info) { return std::string(info.param.name); });

// Experts (W = 1) whose padded segments of the schedule table span more than one pass of
// `pass_rows` rows, and those that do not (experts without rows among them).
std::pair<int, int> spanning_experts(const LayerData& d, std::int64_t pass_rows) {
  const std::int64_t E = d.problem.num_experts, slots = d.problem.num_tokens * d.problem.topk;
  std::vector<std::int64_t> counts(E, 0);
  for (std::int64_t s = 0; s < slots; ++s) {
    const auto e = static_cast<std::int64_t>(d.topk_experts.get(s));
    if (e >= 0 && e < E) ++counts[e];
  }
  int spanning = 0, within = 0;
  std::int64_t start = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const bool spans = counts[e] > 0 && start / pass_rows != (start + counts[e] - 1) / pass_rows;
    spans ? ++spanning : ++within;
    start += (counts[e] + 127) / 128 * 128;
  }
  return {spanning, within};
}

// Several ring passes (backward replays every pass but the first) give the bits of one pass, and
// of the default config; in each run some experts' weight gradients are carried in fp32 across
// passes and others are stored in the pass that holds all their rows (the pass plan).
TEST(LayerGpuRing, SeveralPassesGiveTheBitsOfOne) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"passes", layer_shape(300, 128, 128, 5, 3, 64), Routing::skewed, false};
  const std::uint64_t seed = test_seed();
  LayerData one = make_case(c, seed);
  Config one_pass;
  one_pass.minibatch_size = 128;
  one_pass.macrobatch_size = 4096;  // more than the worst case: one pass
  run_gpu(one, one_pass);
  LayerData defaults = make_case(c, seed);
  run_gpu(defaults);
  EXPECT_TRUE(all_outputs_same(one, defaults)) << "default config";
  // Skewed: expert 0 takes at least half the 900 rows (it spans 128-row passes), so the other
  // four share at most 450 and one of them fits a 128-row pass: both kinds at 128 at least.
  int runs_with_both = 0;
  for (std::int64_t macro : {128, 256, 384, 640}) {
    Config small;
    small.minibatch_size = 128;
    small.macrobatch_size = macro;
    LayerData many = make_case(c, seed);
    const auto [spanning, within] = spanning_experts(many, macro);
    runs_with_both += spanning > 0 && within > 0;
    run_gpu(many, small);
    EXPECT_TRUE(all_outputs_same(one, many)) << "macrobatch_size " << macro;
  }
  EXPECT_GT(runs_with_both, 0) << "no run had an expert spanning passes and one within a pass";
  EXPECT_TRUE(check_against_f64(one).passed());
}

// `mok run --plan` is what the CUDA layer allocates: the layer's bytes are the plan's three
// regions for every rank plus the team's guard zones, and the device's free memory drops by that
// much (up to the driver's page rounding of the two allocations); a Workspace holds one such
// layer. With one pass no pass scratch and no fp32 carries, with several the carries of
// min(passes - 1, E_local) experts only.
TEST(LayerGpuMemory, ThePlanIsWhatTheLayerAllocates) {
  MOK_REQUIRE_HOPPER();
  struct Case {
    Problem problem;
    Config config;
  };
  Config many;
  many.minibatch_size = 128;
  many.macrobatch_size = 512;
  Problem ep2 = layer_shape(300, 256, 192, 8, 3, 64);
  ep2.ep_size = 2;  // a local virtual team: both ranks' regions in this process
  const Case cases[] = {{layer_shape(300, 256, 192, 5, 3, 64), {}},
                        {layer_shape(300, 256, 192, 5, 3, 0), many},
                        {ep2, many},
                        {layer_shape(4096, 1024, 512, 64, 6, 0), {}}};
  { cuda::Layer warm(cases[0].problem, cases[0].config, 0); }
  for (const Case& c : cases) {
    const plan::WorkspacePlan pl = plan::make_workspace_plan(plan_shape_of(c.problem, c.config));
    const std::int64_t W = c.problem.ep_size;
    const std::int64_t guards = (2 * W + 1) * Team::Impl::kGuardBytes;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::size_t free0 = 0, free1 = 0, total = 0;
    ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
    cuda::Layer layer(c.problem, c.config, 0);
    ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
    const std::string name = c.problem.to_string();
    EXPECT_EQ(static_cast<std::int64_t>(layer.bytes()), W * pl.total_bytes() + guards) << name;
    const std::int64_t drop = static_cast<std::int64_t>(free0) - static_cast<std::int64_t>(free1);
    constexpr std::int64_t kPage = 2 << 20;  // the driver rounds each allocation to 2 MiB pages
    EXPECT_GE(drop, W * pl.total_bytes()) << name;
    EXPECT_LE(drop, W * pl.total_bytes() + guards + 2 * kPage) << name;
    EXPECT_EQ(layer.max_passes(), pl.max_passes) << name;
    EXPECT_EQ(layer.ring_rows(), pl.ring_rows) << name;
    if (pl.max_passes == 1) {
      EXPECT_EQ(pl.carry_slots, 0) << name;
      EXPECT_EQ(pl.pass_x.bytes + pl.pass_gate.bytes + pl.carry_gate.bytes, 0) << name;
    } else {
      EXPECT_EQ(pl.carry_slots, std::min(pl.max_passes - 1, c.problem.num_local_experts())) << name;
      EXPECT_GT(pl.carry_gate.bytes, 0) << name;
    }
    if (W == 1) {
      const Workspace ws(c.problem, c.config, {.backend = Backend::cuda});
      EXPECT_EQ(ws.bytes(), layer.bytes()) << name;
    }
  }
}

// fp32 weight gradients, written and accumulated (main-grad): accumulate = old + fresh.
TEST(LayerGpuGrads, Fp32MainGradAccumulation) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"fp32", layer_shape(200, 128, 128, 4, 2, 64), Routing::softmax, false};
  const std::uint64_t seed = test_seed();
  for (std::int64_t macro : {4096, 128}) {
    Config config;
    config.minibatch_size = 128;
    config.macrobatch_size = macro;
    LayerData fresh = make_case(c, seed, DType::f32);
    run_gpu(fresh, config);
    EXPECT_TRUE(check_against_f64(fresh).passed());
    LayerData acc = make_case(c, seed, DType::f32);
    DeviceLayer g(acc);
    for (HostTensor* t : {&acc.d_gate, &acc.d_up, &acc.d_down, &acc.d_shared_gate, &acc.d_shared_up,
                          &acc.d_shared_down}) {
      for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 0.5 * (i % 5) - 1.0);
    }
    g.d_gate.upload(acc.d_gate), g.d_up.upload(acc.d_up), g.d_down.upload(acc.d_down);
    g.d_sg.upload(acc.d_shared_gate), g.d_su.upload(acc.d_shared_up),
        g.d_sd.upload(acc.d_shared_down);
    Workspace ws(c.problem, config, {.backend = Backend::cuda});
    DeviceContext ctx(ws);
    forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
    backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), g.grads(),
             {.accumulate_weight_grads = true});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    g.download(acc);
    // Every one of the six buffers: what it held plus the fresh gradient, in fp32.
    const char* const names[] = {"d_gate",        "d_up",        "d_down",
                                 "d_shared_gate", "d_shared_up", "d_shared_down"};
    int n = 0;
    for (auto [f, a] : {std::pair{&fresh.d_gate, &acc.d_gate},
                        {&fresh.d_up, &acc.d_up},
                        {&fresh.d_down, &acc.d_down},
                        {&fresh.d_shared_gate, &acc.d_shared_gate},
                        {&fresh.d_shared_up, &acc.d_shared_up},
                        {&fresh.d_shared_down, &acc.d_shared_down}}) {
      for (std::int64_t i = 0; i < f->numel(); ++i) {
        const float want = static_cast<float>(0.5 * (i % 5) - 1.0) + static_cast<float>(f->get(i));
        ASSERT_EQ(static_cast<float>(a->get(i)), want)
            << names[n] << ", macrobatch " << macro << ", element " << i;
      }
      ++n;
    }
  }
}

// `v`, a view into `host`'s storage, moved to the same place in `dev` (a copy of that storage).
TensorView on_device(TensorView v, const HostTensor& host, const DeviceTensor& dev) {
  const std::ptrdiff_t offset =
      static_cast<const char*>(v.data) - static_cast<const char*>(host.view().data);
  v.data = static_cast<char*>(dev.view().data) + offset;
  v.device = dev.view().device;
  return v;
}

// Row-strided routed weight gradients (core/validate.cpp) on the CUDA backend: the gate and up
// halves of one packed [E, 2I, H] gradient (concatenated or interleaved rows, Hugging Face's
// gate_up_proj) and W_down's gradient in rows padded by 64 columns, stored in place through their
// strides. In one ring pass and in several (experts whose sums are carried across passes are
// stored at their last), bf16 (every element written over NaN) and fp32 added to (main-grad
// accumulation): bitwise the dense gradients, the padding untouched.
TEST(LayerGpuGrads, RowStridedWeightGradsAreBitwiseTheDense) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"strided", layer_shape(300, 128, 192, 5, 3, 64), Routing::skewed, false};
  const std::uint64_t seed = test_seed();
  constexpr std::int64_t kPad = 64;
  constexpr double kPadding = 3.0;  // no gradient of the case is exactly 3
  for (const bool fp32 : {false, true}) {
    for (const std::int64_t macro : {4096, 128}) {
      for (const bool interleaved : {false, true}) {
        SCOPED_TRACE(std::string(fp32 ? "fp32 accumulated" : "bf16") + ", macrobatch " +
                     std::to_string(macro) + (interleaved ? ", interleaved" : ", concatenated"));
        Config config;
        config.minibatch_size = 128;
        config.macrobatch_size = macro;
        const BackwardOptions options{.accumulate_weight_grads = fp32};
        // Each gradient before the call: NaN (bf16), or values the fp32 accumulation adds to.
        auto start = [&](LayerData& d) {
          for (HostTensor* t : {&d.d_gate, &d.d_up, &d.d_down, &d.d_shared_gate, &d.d_shared_up,
                                &d.d_shared_down}) {
            if (!fp32) {
              t->fill_bytes(0xff);
              continue;
            }
            for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 0.5 * (i % 5) - 1.0);
          }
        };
        auto step = [&](DeviceLayer& g, const Grads& grads) {
          Workspace ws(c.problem, config, {.backend = Backend::cuda});
          DeviceContext ctx(ws);
          forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
          backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), grads, options);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        };
        LayerData dense = make_case(c, seed, fp32 ? DType::f32 : DType::bf16);
        start(dense);
        DeviceLayer gd(dense);
        gd.d_gate.upload(dense.d_gate), gd.d_up.upload(dense.d_up), gd.d_down.upload(dense.d_down);
        gd.d_sg.upload(dense.d_shared_gate), gd.d_su.upload(dense.d_shared_up);
        gd.d_sd.upload(dense.d_shared_down);
        step(gd, gd.grads());
        gd.download(dense);

        LayerData strided = make_case(c, seed, fp32 ? DType::f32 : DType::bf16);
        start(strided);
        Packed gate_up = pack(strided.d_gate, strided.d_up, interleaved);
        if (!fp32) gate_up.storage.fill_bytes(0xff);
        Padded down = pad_rows(strided.d_down, kPad, kPadding);
        DeviceTensor gate_up_dev(gate_up.storage), down_dev(down.storage);
        DeviceLayer gs(strided);
        gs.d_sg.upload(strided.d_shared_gate), gs.d_su.upload(strided.d_shared_up);
        gs.d_sd.upload(strided.d_shared_down);
        Grads grads = gs.grads();
        grads.d_gate = on_device(gate_up.gate, gate_up.storage, gate_up_dev);
        grads.d_up = on_device(gate_up.up, gate_up.storage, gate_up_dev);
        grads.d_down = on_device(down.view, down.storage, down_dev);
        step(gs, grads);
        gs.download(strided);
        gate_up_dev.download(gate_up.storage);
        down_dev.download(down.storage);

        EXPECT_TRUE(same_bits(dense.out, strided.out));
        EXPECT_TRUE(same_bits(dense.d_x, strided.d_x));
        EXPECT_TRUE(same_bits(dense.d_topk_weights, strided.d_topk_weights));
        EXPECT_TRUE(same_bits(dense.d_shared_gate, strided.d_shared_gate));
        EXPECT_TRUE(same_bits(dense.d_shared_up, strided.d_shared_up));
        EXPECT_TRUE(same_bits(dense.d_shared_down, strided.d_shared_down));
        EXPECT_TRUE(same_bits(pack(dense.d_gate, dense.d_up, interleaved).storage,
                              gate_up.storage))
            << "the packed gate/up gradient";
        EXPECT_TRUE(same_bits(pad_rows(dense.d_down, kPad, kPadding).storage, down.storage))
            << "the padded down gradient (or its padding)";
        if (!fp32) EXPECT_TRUE(all_finite(dense.d_gate) && all_finite(dense.d_down));
      }
    }
  }
}

// A whole step (schedule, forward, backward) captured once, replayed with new inputs and
// routings: proves that nothing in the step synchronizes with the host.
// A whole step of case `c` under `config`, captured once in a CUDA graph (after an eager warm-up:
// one-time set-up stays out of the capture) and replayed with new inputs and the three routings
// (unused slots in the replay `drop_at`): each replay against the f64 layer, and bitwise against
// an eager step of the unfused path.
void expect_captured_step_replays(const GpuCase& c, const Config& config,
                                  const Routing (&routings)[3], int drop_at) {
  const std::uint64_t seed = test_seed();
  LayerData first = make_case(c, seed);
  DeviceLayer g(first);
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Workspace ws(c.problem, config, {.backend = Backend::cuda});
  DeviceContext ctx(ws);
  ws.set_stream(stream);
  auto step = [&] {
    forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
    backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), g.grads());
  };
  step();
  MOK_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step();
  MOK_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) {
    const GpuCase replay{c.name, c.problem, routings[i], i == drop_at};
    LayerData d = make_case(replay, seed + 1 + i);
    g.upload_inputs(d);
    g.poison();
    MOK_CUDA_OK(cudaGraphLaunch(exec, stream));
    MOK_CUDA_OK(cudaStreamSynchronize(stream));
    g.download(d);
    const CheckReport r = check_against_f64(d);
    EXPECT_TRUE(r.passed()) << "replay " << i << "\n" << r.summary();
    LayerData eager = make_case(replay, seed + 1 + i);
    Config launches = config;
    launches.forward_path = ForwardPath::launches;
    run_gpu(eager, launches);
    EXPECT_TRUE(all_outputs_same(d, eager)) << "replay " << i << " differs from an eager step";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(LayerGpuGraph, CapturedStepReplaysWithNewInputsAndRoutings) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"graph", layer_shape(150, 128, 128, 6, 2, 64), Routing::softmax, false};
  expect_captured_step_replays(c, Config{},
                               {Routing::softmax, Routing::skewed, Routing::one_expert}, 1);
}

// An id outside [-1, E) never writes out of bounds; the call after it raises an error naming it.
TEST(LayerGpuValidation, BadExpertIdIsReportedByTheNextCall) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"bad", layer_shape(40, 64, 64, 4, 2, 0), Routing::softmax, false};
  LayerData d = make_case(c, test_seed());
  d.topk_experts.set(13 * 2 + 1, 4);  // E = 4: out of range
  DeviceLayer g(d);
  Workspace ws(c.problem, Config{}, {.backend = Backend::cuda});
  DeviceContext ctx(ws);
  forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_error([&] { forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get()); },
               {"topk_experts[13, 1]", "got 4"});
  // The error was consumed: the next call with good ids runs and is right.
  LayerData good = make_case(c, test_seed() + 1);
  DeviceLayer h(good);
  forward(ws, h.inputs(), h.weights(), h.out.view(), ctx.get());
  backward(ws, h.inputs(), h.weights(), ctx.get(), h.d_out.view(), h.grads());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  h.download(good);
  EXPECT_TRUE(check_against_f64(good).passed());
}

// Workspaces of different shapes share the schedule kernel: one made later (fewer experts, less
// shared memory) must not break the earlier one's launches.
TEST(LayerGpuValidation, WorkspacesOfOtherShapesDoNotBreakEachOther) {
  MOK_REQUIRE_HOPPER();
  const GpuCase wide{"many", layer_shape(40, 64, 64, 64, 4, 0), Routing::softmax, false};
  const GpuCase narrow{"few", layer_shape(40, 64, 64, 2, 1, 0), Routing::softmax, false};
  LayerData a = make_case(wide, test_seed()), b = make_case(narrow, test_seed());
  DeviceLayer ga(a), gb(b);
  Workspace wa(wide.problem, Config{}, {.backend = Backend::cuda});
  DeviceContext ca(wa);
  forward(wa, ga.inputs(), ga.weights(), ga.out.view(), ca.get());
  Workspace wb(narrow.problem, Config{}, {.backend = Backend::cuda});
  DeviceContext cb(wb);
  forward(wb, gb.inputs(), gb.weights(), gb.out.view(), cb.get());
  forward(wa, ga.inputs(), ga.weights(), ga.out.view(), ca.get());
  backward(wa, ga.inputs(), ga.weights(), ca.get(), ga.d_out.view(), ga.grads());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ga.download(a);
  EXPECT_TRUE(check_against_f64(a).passed());
}

// A view that is not 16-byte aligned (the kernels move 16-byte vectors) is refused by name before
// any launch; the workspace and the process go on working.
TEST(LayerGpuValidation, MisalignedViewsAreRefusedByName) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"align", layer_shape(24, 64, 64, 4, 2, 64), Routing::softmax, false};
  LayerData d = make_case(c, test_seed());
  DeviceLayer g(d);
  Workspace ws(c.problem, Config{}, {.backend = Backend::cuda});
  DeviceContext ctx(ws);
  // A second buffer one row longer, viewed from its second element: 2 bytes past alignment.
  HostTensor spare(DType::bf16, {25, 64});
  DeviceTensor shifted(spare);
  auto misaligned = [&](const TensorView& like) {
    TensorView v = like;
    v.data = static_cast<char*>(shifted.view().data) + 2;
    return v;
  };
  expect_error([&] { forward(ws, g.inputs(), g.weights(), misaligned(g.out.view()), ctx.get()); },
               {"invalid out:", "16 bytes", "2 bytes past"});
  Inputs bad_x = g.inputs();
  bad_x.x = misaligned(g.x.view());
  expect_error([&] { forward(ws, bad_x, g.weights(), g.out.view(), ctx.get()); },
               {"invalid x:", "16 bytes"});
  forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
  expect_error(
      [&] {
        backward(ws, g.inputs(), g.weights(), ctx.get(), misaligned(g.d_out.view()), g.grads());
      },
      {"invalid d_out:", "16 bytes"});
  Grads bad_dx = g.grads();
  bad_dx.d_x = misaligned(g.d_x.view());
  expect_error([&] { backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), bad_dx); },
               {"invalid d_x:", "16 bytes"});
  ForwardContext bad_ctx = ctx.get();
  bad_ctx.hidden_shared.data = static_cast<char*>(bad_ctx.hidden_shared.data) + 2;
  expect_error([&] { backward(ws, g.inputs(), g.weights(), bad_ctx, g.d_out.view(), g.grads()); },
               {"forward_context.hidden_shared", "16 bytes"});
  backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), g.grads());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  g.download(d);
  EXPECT_TRUE(check_against_f64(d).passed());
}

// The forward context is the caller's: layers that share one workspace keep their own contexts.
// Forward every layer, then backward every layer in reverse: the bits of each layer run alone,
// with no recompute; recompute_forward_context writes the forward's context bit for bit.
TEST(LayerGpuContext, LayersShareOneWorkspaceAndRecomputeIsBitwise) {
  MOK_REQUIRE_HOPPER();
  const std::uint64_t seed = test_seed();
  for (std::int64_t macro : {4096, 128}) {  // one ring pass, and several
    const GpuCase c{"shared_ws", layer_shape(150, 128, 128, 5, 3, 64), Routing::skewed, false};
    Config config;
    config.minibatch_size = 128;
    config.macrobatch_size = macro;
    constexpr int kLayers = 3;
    Workspace ws(c.problem, config, {.backend = Backend::cuda});
    std::vector<LayerData> data, alone;
    std::vector<std::unique_ptr<DeviceLayer>> dev;
    std::vector<std::unique_ptr<DeviceContext>> ctx;
    for (int l = 0; l < kLayers; ++l) {
      data.push_back(make_case(c, seed + l));
      alone.push_back(make_case(c, seed + l));
      run_gpu(alone.back(), config);
      dev.push_back(std::make_unique<DeviceLayer>(data.back()));
      ctx.push_back(std::make_unique<DeviceContext>(ws));
      forward(ws, dev[l]->inputs(), dev[l]->weights(), dev[l]->out.view(), ctx[l]->get());
    }
    for (int l = kLayers - 1; l >= 0; --l) {
      backward(ws, dev[l]->inputs(), dev[l]->weights(), ctx[l]->get(), dev[l]->d_out.view(),
               dev[l]->grads());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int l = 0; l < kLayers; ++l) {
      dev[l]->download(data[l]);
      EXPECT_TRUE(all_outputs_same(data[l], alone[l])) << "layer " << l << " macro " << macro;
    }
    EXPECT_EQ(ws.call_counts().recompute, 0);
    EXPECT_EQ(ws.call_counts().forward, kLayers);
    // recompute_forward_context (no router weights, no down weights) into a context poisoned
    // like the forward's: every byte equal, filled rows and untouched ones alike.
    DeviceContext again(ws);
    Inputs in = dev[0]->inputs();
    in.topk_weights = TensorView{};
    Weights w = dev[0]->weights();
    w.down = w.shared_down = TensorView{};
    recompute_forward_context(ws, in, w, again.get());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<char> a(ctx[0]->bytes()), b(again.bytes());
    ASSERT_EQ(cudaMemcpy(a.data(), ctx[0]->get().x_routed.data, a.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.data(), again.get().x_routed.data, b.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_TRUE(a == b) << "recomputed context differs, macro " << macro;
    // The key covers every tensor backward reads.
    expect_error(
        [&] {
          backward(ws, dev[1]->inputs(), dev[0]->weights(), ctx[0]->get(), dev[0]->d_out.view(),
                   dev[0]->grads());
        },
        {"forward context", "another x"});
  }
}

// `call` (work queued on the device) has finished within 5 s, its waits' bound included: no hang,
// and the device is still usable.
template <class Call>
void expect_bounded_call(Call&& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
}

// Expert parallelism over W virtual ranks on one GPU (one launch covers every rank wherever ranks
// wait on each other): every rank's output and gradients are bitwise those of one GPU running the
// whole layer. NOTES: bitwise, because each expert sees its rows in the same order either way
// (src_rank, t, j) = (global token, j), every GEMM row and every reduction runs the same
// operations in the same order, and segments start on tile boundaries in both layouts.
TEST(LayerGpuExpertParallel, VirtualRanksGiveTheSingleGpuBits) {
  MOK_REQUIRE_HOPPER();
  const std::int64_t T = 64, H = 128, I = 128, E = 16, k = 4, S = 64;
  const std::uint64_t seed = test_seed();
  for (int W : {2, 4, 8}) {
    for (Routing routing : {Routing::softmax, Routing::skewed}) {
      EpCase c = ep_case(W, T, layer_shape(T, H, I, E, k, S), seed + W, routing, 11);
      LayerData &one = c.one, &many = c.many;
      const Problem& p = c.rank;
      DeviceLayer g(many);
      cuda::Layer layer(p, Config{}, 0);
      std::vector<std::unique_ptr<DeviceTensor>> scratch;
      std::vector<std::unique_ptr<DeviceContext>> contexts;
      std::vector<cuda::RankTensors> ranks = split_into_ranks(g, p, scratch, contexts);
      layer.forward(ranks, true, nullptr);
      layer.backward(ranks, BackwardOptions{}, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      layer.check_errors(nullptr);
      g.download(many);
      const char* what = routing == Routing::softmax ? "uniform" : "skewed";
      expect_single_gpu_bits(one, many, "W " + std::to_string(W) + " " + what);
      // Rank 0's shared-expert gradients: those of one GPU running rank 0's tokens alone.
      LayerData rank0 =
          make_layer_data(layer_shape(T, H, I, E, k, S), DType::bf16, seed + W, routing);
      for (HostTensor* t : {&rank0.x, &rank0.topk_experts, &rank0.topk_weights, &rank0.d_out}) {
        const HostTensor& src = t == &rank0.x              ? one.x
                                : t == &rank0.topk_experts ? one.topk_experts
                                : t == &rank0.topk_weights ? one.topk_weights
                                                           : one.d_out;
        for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, src.get(i));
      }
      rank0.gate = one.gate, rank0.up = one.up, rank0.down = one.down;
      rank0.shared_gate = one.shared_gate, rank0.shared_up = one.shared_up;
      rank0.shared_down = one.shared_down;
      run_gpu(rank0);
      EXPECT_TRUE(same_bits(rank0.d_shared_gate, many.d_shared_gate)) << "W " << W << ": shared";
      EXPECT_TRUE(same_bits(rank0.d_shared_down, many.d_shared_down)) << "W " << W << ": shared";
    }
  }
}

// A team across processes, its ranks simulated in one process on one GPU: each rank an
// Layer of an external team (cuda::ExternalRank) over symmetric regions this test
// allocates, called from its own host thread on its own stream, so the ranks meet only through
// the device-side team barriers at system scope (the schedule's, and the layer's between
// staging and pulls, pushes and home reductions). Bitwise one GPU running the whole layer.
//
// NOTES: CUDA does not promise that kernels of different streams run at the same time. The
// driver maps a process's streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (8 by
// default); two ranks' streams on one queue make a false dependency: a rank's kernel queued behind
// another rank's work that waits, in stream order, for a barrier that needs the first rank. The
// waits then time out with "rank r did not arrive" while that rank's calls had returned in under
// 1 ms (3b3e41b on the H200, per-rank launch times): 1 queue, every attempt stalled; 8 queues, a
// W 4 case stalled on all 4 of its attempts; with 32 queues, 3 of 20 W 4 repetitions (2e52e9d).
// And CUDA's lazy loading loads a kernel at its first launch, which can wait for kernels already
// running. So this binary asks for 32 queues and eager loading (below, before CUDA starts), and
// every case makes its team once (streams first, then regions and layers, as a job's layer lives
// across steps) and runs it kRepetitions times on fresh outputs, with no retry. A stall passes
// only when the test proves it is the driver's queue: each rank records an event on its stream
// (empty until then) before its first call, and an event reaches the GPU when its hardware queue
// does, so a straggler whose event was processed at least half the timeout after the others'
// while its calls had returned at once sat behind another stream's work in a shared queue (the
// GPU had room: the waiting kernels are one small CTA each). Any other stall, or any error, fails
// the test, with each rank's launch time, start delay and report. One process per GPU, a real
// job's layout, gives each rank its own device and queues.
[[maybe_unused]] const bool kMoreHardwareQueues = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);  // the user's setting wins
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  return true;
}();

TEST(LayerGpuExpertParallel, ExternalRanksGiveTheSingleGpuBits) {
  MOK_REQUIRE_HOPPER();
  constexpr int kRepetitions = 20;
  constexpr std::uint64_t kTimeoutMs = 2000;  // a passing run takes about 0.1 s
  const std::int64_t T = 48, H = 128, I = 128, E = 16, k = 4, S = 64;
  const std::uint64_t seed = test_seed() + 77;
  for (int W : {2, 4}) {
    for (Routing routing : {Routing::softmax, Routing::skewed}) {
      const std::string what =
          "W " + std::to_string(W) + (routing == Routing::softmax ? " uniform" : " skewed");
      EpCase c = ep_case(W, T, layer_shape(T, H, I, E, k, S), seed + W, routing, 13);
      run_external_team(c.rank, c.one, c.many, what, kRepetitions, kTimeoutMs);
    }
  }
}

// The same team with its ranks on several GPUs (rank r on GPU r % W, the layer's tensors copied to
// each; the peers' regions reached through peer access, as a process reaches them through
// PyTorch's symmetric memory), with the launches and with the forward megakernel, whose
// cross-GPU waits a team across processes refuses until this test has passed on a machine with
// several GPUs (ForwardHooks::untested_team lets it run here). W = 2 and every GPU the machine
// has, up to 8. With fewer than two GPUs it skips, saying so (scripts/gpu-suite expects that).
TEST(LayerGpuExpertParallel, RanksOnSeveralGpusGiveTheSingleGpuBits) {
  MOK_REQUIRE_HOPPER();
  std::string why;
  const std::vector<int> teams = several_gpu_teams(why);
  if (teams.empty()) GTEST_SKIP() << why;
  constexpr int kRepetitions = 5;
  constexpr std::uint64_t kTimeoutMs = 5000;
  const std::int64_t T = 48, H = 128, I = 128, k = 4, S = 64;
  const std::uint64_t seed = test_seed() + 79;
  for (int W : teams) {
    for (bool fused : {false, true}) {
      for (Routing routing : {Routing::softmax, Routing::skewed}) {
        const std::string what = "W " + std::to_string(W) + " on " + std::to_string(W) + " GPUs, " +
                                 (fused ? "fused" : "launches") +
                                 (routing == Routing::softmax ? ", uniform" : ", skewed");
        EpCase c = ep_case(W, T, layer_shape(T, H, I, 4 * W, k, S), seed + W, routing, 13);
        run_external_team(c.rank, c.one, c.many, what, kRepetitions, kTimeoutMs, false, {}, W,
                          fused);
      }
    }
  }
}

// A rank that never calls: the others' first wait for it gives up within the bound, and the next
// call raises mok::Error naming the rank and the flag it waited for, instead of hanging.
TEST(LayerGpuExpertParallel, ARankThatNeverCallsTimesOutWithAReport) {
  MOK_REQUIRE_HOPPER();
  const std::int64_t T = 16, H = 64, I = 64, E = 4, k = 2, S = 0;
  const Problem global = layer_shape(2 * T, H, I, E, k, S);
  LayerData data = make_layer_data(global, DType::bf16, test_seed() + 5, Routing::softmax);
  DeviceLayer g(data);
  Problem p = global;
  p.num_tokens = T;
  p.ep_size = 2;
  std::vector<std::unique_ptr<DeviceTensor>> scratch;
  std::vector<std::unique_ptr<DeviceContext>> contexts;
  std::vector<cuda::RankTensors> ranks = split_into_ranks(g, p, scratch, contexts);
  const std::int64_t bytes = symmetric_workspace_bytes(p, Config{});
  DeviceBuffer<std::uint8_t> region0(static_cast<std::size_t>(bytes));
  DeviceBuffer<std::uint8_t> region1(static_cast<std::size_t>(bytes));
  const std::vector<void*> bases{region0.get(), region1.get()};
  cuda::Layer rank0(p, Config{}, 0, cuda::ExternalRank{bases, 200});
  Problem p1 = p;
  p1.ep_rank = 1;
  cuda::Layer rank1(p1, Config{}, 0, cuda::ExternalRank{bases, 200});  // never called
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_bounded_call(
      [&] { rank0.forward(std::span<const cuda::RankTensors>(&ranks[0], 1), true, nullptr); });
  expect_error([&] { rank0.check_errors(nullptr); },
               {"timed out on rank 0", "arrivals from rank 1"});
}

// The forward megakernel (Config::forward_path = ForwardPath::fused) against the launches.

struct ForwardBits {
  HostTensor out;
  std::vector<std::uint8_t> ctx;  // the whole forward context, poisoned before the call
};

// One forward of `d` through the public API on `path`: out (poisoned first) and the context.
// `stage_rows`: the megakernel's stage (Config::fused_stage_rows; 0: the default).
ForwardBits forward_bits(const LayerData& d, Config config, ForwardPath path,
                         std::int64_t stage_rows = 0) {
  config.forward_path = path;
  config.fused_stage_rows = stage_rows;
  DeviceLayer g(d);
  Workspace ws(d.problem, config, {.backend = Backend::cuda});
  DeviceContext ctx(ws);
  forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ForwardBits b{d.out, ctx.download()};
  g.out.download(b.out);
  return b;
}

Config fused_config(int comm, std::int64_t minibatch, std::int64_t macrobatch) {
  Config c;
  c.fwd_num_comm_sms = comm;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  return c;
}

// Bitwise the unfused forward, out and the whole context, at every layer test shape and routing,
// whatever the minibatch, the megakernel's stage (the default, which holds every row of these
// shapes, and one of the minibatch's rows: many stages), the ring (one pass and several) and
// fwd_num_comm_sms (MoK's knob, which mok accepts and does not need); ten runs the same bits.
TEST(LayerGpuFused, ForwardIsBitwiseTheUnfused) {
  MOK_REQUIRE_HOPPER();
  const std::uint64_t seed = test_seed();
  const GpuCase cases[] = {
      {"uniform_shared", layer_shape(257, 128, 192, 8, 2, 64), Routing::softmax, false},
      {"skewed_no_shared", layer_shape(131, 192, 128, 6, 3, 0), Routing::skewed, false},
      {"one_expert", layer_shape(64, 128, 64, 5, 2, 64), Routing::one_expert, false},
      {"unused_slots", layer_shape(97, 64, 128, 4, 4, 128), Routing::softmax, true},
      {"one_token", layer_shape(1, 64, 64, 3, 1, 64), Routing::softmax, false},
      {"top1_one_expert", layer_shape(33, 64, 64, 1, 1, 0), Routing::softmax, false},
      {"wide", layer_shape(512, 1024, 512, 16, 4, 256), Routing::softmax, false},
      {"wide_skewed_odd", layer_shape(1001, 512, 256, 12, 6, 0), Routing::skewed, false},
  };
  const Config configs[] = {Config{},
                            fused_config(1, 4096, 0),
                            fused_config(8, 128, 0),
                            fused_config(1000, 256, 0),
                            fused_config(40, 128, 256),  // several passes
                            fused_config(3, 256, 512)};  // several passes
  for (const GpuCase& c : cases) {
    const LayerData d = make_case(c, seed);
    const HostTensor reference_out = forward_bits(d, Config{}, ForwardPath::launches).out;
    for (const Config& config : configs) {
      const std::string what = std::string(c.name) + ", " + config.to_string();
      const ForwardBits unfused = forward_bits(d, config, ForwardPath::launches);
      EXPECT_TRUE(same_bits(reference_out, unfused.out)) << what << ": unfused out";
      for (std::int64_t stage : {std::int64_t{0}, config.minibatch_size}) {
        const ForwardBits fused = forward_bits(d, config, ForwardPath::fused, stage);
        const std::string at = what + ", stage " + std::to_string(stage);
        EXPECT_TRUE(same_bits(unfused.out, fused.out)) << at << ": out";
        EXPECT_TRUE(unfused.ctx == fused.ctx) << at << ": forward context";
      }
    }
  }
  const LayerData d = make_case(cases[6], seed);
  const ForwardBits first = forward_bits(d, Config{}, ForwardPath::fused);
  for (int run = 1; run < test_runs(); ++run) {
    const ForwardBits again = forward_bits(d, Config{}, ForwardPath::fused);
    EXPECT_TRUE(same_bits(first.out, again.out) && first.ctx == again.ctx) << "run " << run;
  }
}

// One multi-tile forward each way (5 blocks of rows, 8 experts, a shared expert, minibatches and
// megakernel stages of one block): the case the sanitizers run (scripts/gpu-fused).
TEST(LayerGpuFused, OneMultiTileForward) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"sanitized", layer_shape(257, 128, 192, 8, 2, 64), Routing::softmax, false};
  const LayerData d = make_case(c, test_seed());
  const Config config = fused_config(40, 128, 0);
  const ForwardBits unfused = forward_bits(d, config, ForwardPath::launches);
  const ForwardBits fused = forward_bits(d, config, ForwardPath::fused, /*stage_rows=*/128);
  EXPECT_TRUE(same_bits(unfused.out, fused.out)) << "out";
  EXPECT_TRUE(unfused.ctx == fused.ctx) << "forward context";
}

// The clamped SwiGLU (swiglu_limit) in the megakernel: the unfused forward's bits, at limits that
// clamp many values and few.
TEST(LayerGpuFused, ClampedForwardIsBitwiseTheUnfused) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"clamped", layer_shape(300, 256, 192, 8, 3, 64), Routing::skewed, false};
  for (float limit : {0.05f, 0.5f, 7.0f}) {
    LayerData d = make_case(c, test_seed());
    d.swiglu_limit = limit;
    for (const Config& config : {Config{}, fused_config(8, 128, 256)}) {
      const ForwardBits unfused = forward_bits(d, config, ForwardPath::launches);
      const ForwardBits fused = forward_bits(d, config, ForwardPath::fused);
      const std::string what = "limit " + std::to_string(limit) + ", " + config.to_string();
      EXPECT_TRUE(same_bits(unfused.out, fused.out)) << what << ": out";
      EXPECT_TRUE(unfused.ctx == fused.ctx) << what << ": forward context";
    }
  }
}

// W virtual ranks, each rank's megakernel launch in turn: every rank's out and context are the
// unfused path's bits.
TEST(LayerGpuFused, VirtualRanksAreBitwiseTheUnfused) {
  MOK_REQUIRE_HOPPER();
  const std::int64_t T = 64, H = 128, I = 128, E = 16, k = 4, S = 64;
  const std::uint64_t seed = test_seed();
  for (int W : {2, 4, 8}) {
    for (Routing routing : {Routing::softmax, Routing::skewed}) {
      EpCase c = ep_case(W, T, layer_shape(T, H, I, E, k, S), seed + W, routing, 11);
      const std::string what =
          "W " + std::to_string(W) + (routing == Routing::softmax ? " uniform" : " skewed");
      std::vector<HostTensor> outs;
      std::vector<std::vector<std::uint8_t>> contexts_bits;
      for (ForwardPath path : {ForwardPath::launches, ForwardPath::fused}) {
        DeviceLayer g(c.many);
        cuda::Layer layer(c.rank, Config{}, 0);
        layer.set_forward_path(path);
        std::vector<std::unique_ptr<DeviceTensor>> scratch;
        std::vector<std::unique_ptr<DeviceContext>> contexts;
        std::vector<cuda::RankTensors> ranks = split_into_ranks(g, c.rank, scratch, contexts);
        layer.forward(ranks, true, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        layer.check_errors(nullptr);
        outs.push_back(c.many.out);
        g.out.download(outs.back());
        std::vector<std::uint8_t> all;
        for (const auto& ctx : contexts) {
          const std::vector<std::uint8_t> b = ctx->download();
          all.insert(all.end(), b.begin(), b.end());
        }
        contexts_bits.push_back(std::move(all));
      }
      EXPECT_TRUE(same_bits(outs[0], outs[1])) << what << ": out";
      EXPECT_TRUE(same_bits(c.one.out, outs[1])) << what << ": out against one GPU";
      EXPECT_TRUE(contexts_bits[0] == contexts_bits[1]) << what << ": forward contexts";
    }
  }
}

// One forward of `layer` over `ranks` (out poisoned first, errors checked): out is `reference`'s
// bits.
void expect_forward_gives(cuda::Layer& layer, std::span<const cuda::RankTensors> ranks,
                          DeviceLayer& g, const HostTensor& reference, const char* what) {
  g.out.poison();
  layer.forward(ranks, true, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  layer.check_errors(nullptr);
  HostTensor out = reference;
  out.fill_bytes(0xa5);  // a download that does not happen cannot pass
  g.out.download(out);
  EXPECT_TRUE(same_bits(reference, out)) << what;
}

// A block of rows that is never pulled: its gate/up tiles wait until the timeout, the call
// returns (no hang, no trap), the next check raises an error naming the counter, and the next
// call works and is right.
TEST(LayerGpuFused, AWithheldPullTimesOutWithAReport) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"withheld", layer_shape(600, 128, 128, 4, 2, 64), Routing::softmax, false};
  const LayerData d = make_case(c, test_seed());
  const HostTensor reference = forward_bits(d, fused_config(8, 128, 0), ForwardPath::launches).out;
  DeviceLayer g(d);
  std::vector<std::unique_ptr<DeviceTensor>> scratch;
  std::vector<std::unique_ptr<DeviceContext>> contexts;
  std::vector<cuda::RankTensors> ranks = split_into_ranks(g, c.problem, scratch, contexts);
  cuda::Layer layer(c.problem, fused_config(8, 128, 0), 0);
  layer.set_forward_path(ForwardPath::fused);
  // A hook needs the launcher built with the hooks: the library's kernel has none.
  expect_error([&] { layer.set_forward_hooks({.withheld_block = 3}); },
               {"ForwardHooks.launcher", "test hooks"});
  layer.set_forward_hooks(
      {.withheld_block = 3, .timeout_ms = 300, .launcher = &test::launch_fused_forward_with_hooks});
  expect_bounded_call([&] { layer.forward(ranks, true, nullptr); });
  expect_error([&] { layer.check_errors(nullptr); },
               {"timed out on rank 0", "ready[3]", "ring rows [384, 512)"});
  layer.set_forward_hooks({});
  expect_forward_gives(layer, ranks, g, reference, "the call after the timeout");
}

// The fused forward on a team across processes is refused, naming the knob, until a multi-GPU
// run has tested it: when the layer is made and when a test switches an existing layer to it.
TEST(LayerGpuFused, ATeamAcrossProcessesRefusesTheFusedForward) {
  MOK_REQUIRE_HOPPER();
  Problem problem = layer_shape(64, 64, 64, 4, 2, 0);
  problem.ep_size = 2;
  problem.ep_rank = 0;
  const std::int64_t bytes = symmetric_workspace_bytes(problem, Config{});
  DeviceBuffer<std::uint8_t> region0(static_cast<std::size_t>(bytes));
  DeviceBuffer<std::uint8_t> region1(static_cast<std::size_t>(bytes));
  const cuda::ExternalRank external{{region0.get(), region1.get()}, 1000};
  Config fused;
  fused.forward_path = ForwardPath::fused;
  expect_error([&] { cuda::Layer layer(problem, fused, 0, external); },
               {"config.forward_path", "team across processes", "fused"});
  cuda::Layer layer(problem, Config{}, 0, external);
  expect_error([&] { layer.set_forward_path(ForwardPath::fused); },
               {"config.forward_path", "fused"});
  EXPECT_EQ(layer.forward_path(), ForwardPath::launches);
}

// The trace a benchmark asks for (Layer::set_forward_hooks): every tile of the launch
// stamped once, by a CTA of the grid, in order (the Producer free <= handed over <= its dependency
// met <= its first K block landed; the Consumers' start <= landed <= multiplied <= end, all within
// the launch), each kind's tile count what the shape says;
// and tracing leaves the output's bits alone (the hooked kernel is a separate instantiation, the
// library's has none of its code). A trace with room for fewer tickets than the launch has
// stamps only those: nothing is written past its words.
TEST(LayerGpuFused, TheTraceStampsEveryTileOnce) {
  MOK_REQUIRE_HOPPER();
  // I 192: 2 gate/up tiles per block; H 128: 1 down tile; S 64 over 600 tokens: 5 shared blocks.
  const GpuCase c{"traced", layer_shape(600, 128, 192, 4, 2, 64), Routing::skewed, false};
  const LayerData d = make_case(c, test_seed());
  const Config config = fused_config(8, 256, 0);
  const HostTensor reference = forward_bits(d, config, ForwardPath::launches).out;
  DeviceLayer g(d);
  std::vector<std::unique_ptr<DeviceTensor>> scratch;
  std::vector<std::unique_ptr<DeviceContext>> contexts;
  std::vector<cuda::RankTensors> ranks = split_into_ranks(g, c.problem, scratch, contexts);
  cuda::Layer layer(c.problem, config, 0);
  layer.set_forward_path(ForwardPath::fused);
  const auto hooks = [](std::uint64_t* trace, std::int64_t words) {
    return cuda::Layer::ForwardHooks{
        .trace = trace, .trace_words = words, .launcher = &test::launch_fused_forward_with_hooks};
  };
  expect_error(
      [&] {
        layer.set_forward_hooks(
            hooks(reinterpret_cast<std::uint64_t*>(16), cuda::Layer::forward_trace_words(0) - 1));
      },
      {"ForwardHooks.trace_words"});
  const std::int64_t words = cuda::Layer::forward_trace_words(4096);
  DeviceBuffer<std::uint64_t> trace(static_cast<std::size_t>(words));
  MOK_CUDA_OK(cudaMemset(trace.get(), 0, trace.size() * 8));
  layer.set_forward_hooks(hooks(trace.get(), words));
  expect_forward_gives(layer, ranks, g, reference, "a traced forward's out");

  const std::vector<std::uint64_t> w = trace.download();
  const std::int64_t blocks = static_cast<std::int64_t>(w[2]);
  const std::int64_t grid = static_cast<std::int64_t>(w[1]);
  ASSERT_EQ(words, cuda::Layer::forward_trace_words(4096)) << "grid " << grid;
  ASSERT_EQ(cuda::Layer::forward_trace_words(0), 4 + 4 * grid);
  ASSERT_GE(blocks, (600 * 2 + 127) / 128) << "the pass's blocks hold its rows";
  const std::int64_t tickets = static_cast<std::int64_t>(w[0]);
  ASSERT_EQ(tickets, blocks * (2 + 1) + 5 * (1 + 1));
  std::uint64_t start = UINT64_MAX, end = 0;
  for (std::int64_t cta = 0; cta < grid; ++cta) {
    ASSERT_NE(w[4 + 4 * cta], 0u) << "CTA " << cta << " start";
    ASSERT_LE(w[4 + 4 * cta], w[4 + 4 * cta + 2]) << "CTA " << cta;
    start = std::min(start, w[4 + 4 * cta]);
    end = std::max(end, w[4 + 4 * cta + 2]);
  }
  std::int64_t per_kind[4] = {0, 0, 0, 0};
  constexpr int kWords = cuda::kTraceTicketWords;
  for (std::int64_t t = 0; t < tickets; ++t) {
    const std::uint64_t* x = &w[4 + 4 * grid + kWords * t];
    const std::int64_t cta = static_cast<std::int64_t>(x[7] & 0xffff);
    const int kind = static_cast<int>((x[7] >> 16) & 0xffff);
    ASSERT_LT(cta, grid) << "ticket " << t;
    ASSERT_LT(kind, 4) << "ticket " << t;
    ++per_kind[kind];
    ASSERT_GE(x[0], w[4 + 4 * cta]) << "ticket " << t << ": its Producer free before its CTA began";
    EXPECT_LE(x[0], x[1]) << "ticket " << t << ": handed over before its Producer was free";
    if (x[2] != 0) EXPECT_LE(x[1], x[2]) << "ticket " << t << ": met before it was handed over";
    EXPECT_LE(x[3], x[6]) << "ticket " << t;
    if (x[2] != 0) {  // a tile with rows: its K loop's stamps, in order, within the tile
      EXPECT_LE(x[3], x[4]) << "ticket " << t << ": landed before the Consumers began";
      EXPECT_LE(x[4], x[5]) << "ticket " << t << ": multiplied before its first K block landed";
      EXPECT_LE(x[5], x[6]) << "ticket " << t << ": ended before its last wgmma was done";
      EXPECT_LE(x[2], x[4]) << "ticket " << t << ": landed before its loads were issued";
    } else {
      EXPECT_EQ(x[4], 0u) << "ticket " << t << ": an empty tile has no K loop";
      EXPECT_EQ(x[5], 0u) << "ticket " << t << ": an empty tile has no K loop";
    }
    EXPECT_LE(x[6], w[4 + 4 * cta + 2]) << "ticket " << t << ": ended after its CTA";
  }
  EXPECT_EQ(per_kind[0], blocks * 2) << "gate/up tiles";
  EXPECT_EQ(per_kind[1], blocks * 1) << "down tiles";
  EXPECT_EQ(per_kind[2], 5) << "shared gate/up tiles";
  EXPECT_EQ(per_kind[3], 5) << "shared down tiles";
  for (std::int64_t t = tickets; t < 4096; ++t) {
    ASSERT_EQ(w[4 + 4 * grid + kWords * t + 7], 0u) << "ticket " << t << " past the launch's";
  }

  // A trace with room for 3 tickets: a guard word after it stays as it was.
  const std::int64_t short_words = cuda::Layer::forward_trace_words(3);
  DeviceBuffer<std::uint64_t> short_trace(static_cast<std::size_t>(short_words + 64));
  MOK_CUDA_OK(cudaMemset(short_trace.get(), 0x5a, short_trace.size() * 8));
  layer.set_forward_hooks(hooks(short_trace.get(), short_words));
  expect_forward_gives(layer, ranks, g, reference, "a forward with a short trace");
  const std::vector<std::uint64_t> st = short_trace.download();
  for (std::int64_t i = short_words; i < short_words + 64; ++i) {
    ASSERT_EQ(st[i], 0x5a5a5a5a5a5a5a5aull) << "word " << i << " past the trace was written";
  }

  // Off again: the library's kernel, the same bits.
  layer.set_forward_hooks({});
  expect_forward_gives(layer, ranks, g, reference, "the untraced forward after a traced one");
}

// A whole step with the megakernel forward, captured once and replayed with new routings.
TEST(LayerGpuFused, CapturedStepReplaysWithNewRoutings) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"graph", layer_shape(300, 128, 128, 6, 2, 64), Routing::softmax, false};
  Config config = fused_config(8, 128, 256);  // several passes
  config.forward_path = ForwardPath::fused;
  expect_captured_step_replays(c, config, {Routing::skewed, Routing::one_expert, Routing::softmax},
                               2);
}

// One workspace shared by two layers (two sets of weights and inputs, their own contexts) whose
// steps alternate between two streams without any host synchronization: each call waits on the
// device for the previous call's work, so every output and gradient is bitwise what the same
// calls give on one stream, call after call (the shared scratch is never raced). The shape is
// large enough that unordered calls would overlap.
TEST(LayerGpuStreams, LayersSharingAWorkspaceOnTwoStreamsGiveTheOneStreamBits) {
  MOK_REQUIRE_HOPPER();
  const Problem p = layer_shape(2048, 512, 256, 16, 4, 128);
  const std::uint64_t seed = test_seed();
  for (ForwardPath path : {ForwardPath::launches, ForwardPath::fused}) {
    Config config;
    config.forward_path = path;
    LayerData want[2] = {make_layer_data(p, DType::bf16, seed, Routing::softmax),
                         make_layer_data(p, DType::bf16, seed + 1, Routing::skewed)};
    LayerData got[2] = {want[0], want[1]};
    // The reference: each layer's step alone on one stream.
    for (LayerData& d : want) run_gpu(d, config);

    cuda::DeviceLayer g0(got[0]), g1(got[1]);
    cuda::DeviceLayer* g[2] = {&g0, &g1};
    Workspace ws(p, config, {.backend = Backend::cuda});
    cuda::DeviceContext c0(ws), c1(ws);
    cuda::DeviceContext* ctx[2] = {&c0, &c1};
    cudaStream_t streams[2];
    for (cudaStream_t& st : streams) {
      MOK_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    }
    MOK_CUDA_OK(cudaDeviceSynchronize());
    // Three rounds: each layer's forward and backward on its own stream, the layers interleaved
    // (forward 0, forward 1, backward 0, backward 1), the outputs overwritten every round.
    for (int round = 0; round < 3; ++round) {
      for (int l = 0; l < 2; ++l) {
        ws.set_stream(streams[l]);
        forward(ws, g[l]->inputs(), g[l]->weights(), g[l]->out.view(), ctx[l]->get());
      }
      for (int l = 0; l < 2; ++l) {
        ws.set_stream(streams[l]);
        backward(ws, g[l]->inputs(), g[l]->weights(), ctx[l]->get(), g[l]->d_out.view(),
                 g[l]->grads());
      }
    }
    MOK_CUDA_OK(cudaDeviceSynchronize());
    for (int l = 0; l < 2; ++l) {
      g[l]->download(got[l]);
      EXPECT_TRUE(all_outputs_same(got[l], want[l]))
          << "layer " << l << " (" << forward_path_name(path) << "): two streams differ from one";
    }
    for (cudaStream_t st : streams) cudaStreamDestroy(st);
  }
}

// A stall is reported by the layer whose call stalled, at its next check, never by another
// layer on the same device; the other layer's results are right meanwhile.
TEST(LayerGpuFused, AStallIsReportedByTheLayerThatStalled) {
  MOK_REQUIRE_HOPPER();
  const GpuCase c{"stall", layer_shape(600, 128, 128, 4, 2, 64), Routing::softmax, false};
  const LayerData d = make_case(c, test_seed());
  const HostTensor reference = forward_bits(d, fused_config(8, 128, 0), ForwardPath::launches).out;
  DeviceLayer g(d);
  std::vector<std::unique_ptr<DeviceTensor>> scratch_a, scratch_b;
  std::vector<std::unique_ptr<DeviceContext>> contexts_a, contexts_b;
  std::vector<cuda::RankTensors> ranks_a = split_into_ranks(g, c.problem, scratch_a, contexts_a);
  std::vector<cuda::RankTensors> ranks_b = split_into_ranks(g, c.problem, scratch_b, contexts_b);
  cuda::Layer stalled(c.problem, fused_config(8, 128, 0), 0);
  cuda::Layer healthy(c.problem, fused_config(8, 128, 0), 0);
  stalled.set_forward_path(ForwardPath::fused);
  stalled.set_forward_hooks(
      {.withheld_block = 2, .timeout_ms = 300, .launcher = &test::launch_fused_forward_with_hooks});
  expect_bounded_call([&] { stalled.forward(ranks_a, true, nullptr); });
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  healthy.check_errors(nullptr);  // nothing to report: the stall was the other layer's
  expect_forward_gives(healthy, ranks_b, g, reference, "the healthy layer beside a stalled one");
  expect_error([&] { stalled.check_errors(nullptr); }, {"timed out on rank 0", "ready[2]"});
  stalled.set_forward_hooks({});
  expect_forward_gives(stalled, ranks_a, g, reference, "the stalled layer's next call");
}

}  // namespace
}  // namespace mok::test
