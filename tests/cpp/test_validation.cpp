// Bad input: every check raises mok::Error naming the argument and the bad value.
#include <functional>
#include <tuple>
#include "layer_helpers.hpp"
#include "mok/schedule.hpp"

namespace mok::test {
namespace {

Problem small() {
  return {.num_tokens = 10,
          .hidden_size = 64,
          .intermediate_size = 128,
          .num_experts = 4,
          .topk = 2,
          .shared_intermediate_size = 64};
}

void run_forward(const LayerData& d) {
  Workspace ws(d.problem, Config{}, {.backend = Backend::cpu, .activation_dtype = d.act});
  HostContext ctx(ws);
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
}

TEST(Validation, ProblemSizes) {
  const std::pair<const char*, std::function<void(Problem&)>> cases[] = {
      {"num_tokens", [](Problem& p) { p.num_tokens = 0; }},
      {"hidden_size", [](Problem& p) { p.hidden_size = -64; }},
      {"intermediate_size", [](Problem& p) { p.intermediate_size = 0; }},
      {"num_experts", [](Problem& p) { p.num_experts = 0; }},
      {"topk", [](Problem& p) { p.topk = -1; }},
      {"shared_intermediate_size", [](Problem& p) { p.shared_intermediate_size = -2; }},
      {"ep_size", [](Problem& p) { p.ep_size = 0; }},
      {"ep_rank", [](Problem& p) { p.ep_size = 2, p.ep_rank = 2; }},
  };
  for (const auto& [name, mutate] : cases) {
    Problem p = small();
    mutate(p);
    expect_error([&] { p.validate(DType::bf16); }, {std::string("invalid ") + name});
  }
}

TEST(Validation, SizeBoundsAndProducts) {
  // Each size and each product the code computes in a fixed width, past its bound: the error
  // names the size (or the product) and the bound, and no product overflows on the way.
  const std::int64_t big = kMaxSize + 1;
  const std::tuple<const char*, const char*, std::function<void(Problem&)>> cases[] = {
      {"invalid num_tokens", "at most 2147483647", [&](Problem& p) { p.num_tokens = big; }},
      {"invalid hidden_size", "at most 2147483647", [&](Problem& p) { p.hidden_size = big; }},
      {"invalid intermediate_size", "at most 2147483647",
       [&](Problem& p) { p.intermediate_size = std::int64_t{1} << 62; }},
      {"invalid topk", "at most 2147483647", [&](Problem& p) { p.topk = big; }},
      {"invalid num_experts", "at most 1048576",
       [](Problem& p) { p.num_experts = std::int64_t{1} << 26; }},
      {"invalid num_experts", "at most 1048576",
       [](Problem& p) { p.num_experts = std::int64_t{1} << 62; }},
      {"invalid ep_size * num_tokens * topk (with each local expert's padding)",
       "the schedule table's row ids are 32-bit",
       [](Problem& p) { p.num_tokens = std::int64_t{1} << 30, p.topk = 2; }},
      {"invalid ep_size * num_tokens * topk (with each local expert's padding)", "got 2279604224",
       [](Problem& p) {  // 2^31 - 2^20 rows and 2^20 experts' padding: too many together only
         p.num_tokens = (std::int64_t{1} << 31) - (std::int64_t{1} << 20), p.topk = 1;
         p.num_experts = std::int64_t{1} << 20, p.intermediate_size = p.hidden_size = 64;
       }},
      {"invalid num_local_experts * max(hidden_size, intermediate_size)", "32-bit coordinates",
       [](Problem& p) { p.num_experts = 1024, p.intermediate_size = std::int64_t{1} << 22; }},
      {"invalid num_local_experts * intermediate_size * hidden_size", "fit an int64",
       [](Problem& p) {
         p.num_experts = 1, p.topk = 1, p.intermediate_size = std::int64_t{1} << 30;
         p.hidden_size = std::int64_t{1} << 30;
       }},
  };
  for (const auto& [argument, bound, mutate] : cases) {
    Problem p = small();
    mutate(p);
    expect_error([&] { p.validate(DType::f64); }, {argument, bound});
  }
  Problem p = small();
  p.num_experts = kMaxExperts;  // the bounds themselves are fine
  p.num_tokens = 1 << 20;
  EXPECT_NO_THROW(p.validate(DType::bf16));
}

TEST(Validation, ScheduleSizesAreBoundedBeforeAnyAllocation) {
  // schedule_capacity_rows / symmetric_workspace_bytes validate first: a huge expert count is
  // named, never turned into a negative or wrapped size.
  Problem p = small();
  p.num_experts = std::int64_t{1} << 62;
  expect_error([&] { symmetric_workspace_bytes(p, Config{}); },
               {"invalid num_experts", "at most 1048576"});
}

TEST(Validation, TopkLargerThanExperts) {
  Problem p = small();
  p.num_experts = 4;
  p.topk = 5;
  expect_error([&] { p.validate(DType::bf16); },
               {"invalid topk", "at most num_experts = 4", "got 5"});
}

TEST(Validation, Bf16Alignment) {
  Problem p = small();
  p.hidden_size = 100;
  expect_error([&] { p.validate(DType::bf16); }, {"hidden_size", "multiple of 64", "got 100"});
  p = small();
  p.intermediate_size = 96;
  expect_error([&] { p.validate(DType::bf16); }, {"intermediate_size", "got 96"});
  p = small();
  p.shared_intermediate_size = 32;
  expect_error([&] { p.validate(DType::bf16); }, {"shared_intermediate_size", "got 32"});
  p = small();
  p.hidden_size = 100;
  EXPECT_NO_THROW(p.validate(DType::f64));  // the exact CPU mode takes any size
  p = small();
  p.num_experts = 6;
  p.ep_size = 4;
  expect_error([&] { p.validate(DType::bf16); },
               {"num_experts", "multiple of ep_size = 4", "got 6"});
}

TEST(Validation, ConfigKnobs) {
  const std::pair<const char*, std::function<void(Config&)>> cases[] = {
      {"config.fwd_num_comm_sms", [](Config& c) { c.fwd_num_comm_sms = 0; }},
      {"config.bwd_num_comm_sms", [](Config& c) { c.bwd_num_comm_sms = -3; }},
      {"config.minibatch_size", [](Config& c) { c.minibatch_size = 0; }},
      {"config.minibatch_size", [](Config& c) { c.minibatch_size = 100; }},
      {"config.macrobatch_size", [](Config& c) { c.macrobatch_size = 100; }},
      {"config.macrobatch_size", [](Config& c) { c.macrobatch_size = 4096 * 3 + 1; }},
      {"config.schedule_capacity_multiplier",
       [](Config& c) { c.schedule_capacity_multiplier = 0; }},
      {"config.forward_path", [](Config& c) { c.forward_path = static_cast<ForwardPath>(7); }},
      {"config.fused_stage_rows", [](Config& c) { c.fused_stage_rows = -128; }},
      {"config.fused_stage_rows", [](Config& c) { c.fused_stage_rows = 100; }},
  };
  for (const auto& [name, mutate] : cases) {
    Config c;
    mutate(c);
    expect_error([&] { c.validate(); }, {name});
    expect_error([&] { Workspace ws(small(), c, {.backend = Backend::cpu}); }, {name});
  }
}

// The fused forward's stage: 0 resolves to the larger of the minibatch and kFusedStageRows.
TEST(Validation, FusedStageRowsResolve) {
  Config c;
  EXPECT_EQ(c.forward_path, ForwardPath::launches);
  EXPECT_EQ(c.resolved_fused_stage_rows(), kFusedStageRows);
  c.minibatch_size = 4 * kFusedStageRows;
  EXPECT_EQ(c.resolved_fused_stage_rows(), 4 * kFusedStageRows);
  c.fused_stage_rows = 256;
  c.validate();
  EXPECT_EQ(c.resolved_fused_stage_rows(), 256);
  EXPECT_NE(c.to_string().find("forward_path=launches fused_stage_rows=256"), std::string::npos)
      << c.to_string();
}

// The CPU backend computes the same function on either forward path (it has one).
TEST(Validation, TheCpuBackendAcceptsEitherForwardPath) {
  Config c;
  c.forward_path = ForwardPath::fused;
  Workspace ws(small(), c, {.backend = Backend::cpu});
  EXPECT_EQ(ws.config().forward_path, ForwardPath::fused);
}

TEST(Validation, ExpertIdsOutOfRange) {
  for (std::int64_t bad : {4, 1000, -2}) {
    LayerData d = make_layer_data(small(), DType::bf16, 1);
    d.topk_experts.set(7 * 2 + 1, static_cast<double>(bad));
    expect_error([&] { run_forward(d); },
                 {"topk_experts[7, 1]", "[-1, 4)", "got " + std::to_string(bad)});
  }
}

TEST(Validation, ShapesDtypesStridesDevices) {
  LayerData d = make_layer_data(small(), DType::bf16, 1);
  {
    LayerData e = d;
    e.x.view().shape[1] = 32;
    expect_error([&] { run_forward(e); }, {"x.shape", "[10, 64]", "[10, 32]"});
  }
  {
    LayerData e = d;
    e.x = HostTensor(DType::f32, {10, 64});
    expect_error([&] { run_forward(e); }, {"x.dtype", "bfloat16", "float32"});
  }
  {
    LayerData e = d;
    e.topk_weights = HostTensor(DType::bf16, {10, 2});
    expect_error([&] { run_forward(e); }, {"topk_weights.dtype", "float32", "bfloat16"});
  }
  {
    LayerData e = d;
    e.topk_experts = HostTensor(DType::i32, {10, 2});
    expect_error([&] { run_forward(e); }, {"topk_experts.dtype", "int64", "int32"});
  }
  {
    LayerData e = d;
    e.down.view().shape[1] = 128;
    e.down.view().shape[2] = 64;
    expect_error([&] { run_forward(e); },
                 {"routed_down_weights.shape", "[4, 64, 128]", "[4, 128, 64]"});
  }
  {
    LayerData e = d;
    std::swap(e.gate.view().strides[1], e.gate.view().strides[2]);  // a transposed view
    expect_error([&] { run_forward(e); }, {"routed_gate_weights.strides", "contiguous"});
  }
  {
    LayerData e = d;  // rows that overlap: row stride below H
    e.gate.view().strides[1] = e.gate.view().shape[2] / 2;
    expect_error([&] { run_forward(e); },
                 {"routed_gate_weights.strides", "row-strided", "row >= 64"});
  }
  {
    LayerData e = d;  // experts that overlap: expert stride below I * row stride
    e.up.view().strides[0] = e.up.view().strides[1];
    expect_error([&] { run_forward(e); }, {"routed_up_weights.strides", "expert >= 128 * row"});
  }
  {
    LayerData e = d;
    e.up.view().device = {DeviceKind::cuda, 0};
    expect_error([&] { run_forward(e); }, {"routed_up_weights.device", "cpu", "cuda:0"});
  }
  {
    LayerData e = d;
    e.shared_down = HostTensor();
    expect_error([&] { run_forward(e); }, {"shared_down_weights", "none"});
  }
  {
    Problem p = small();
    p.shared_intermediate_size = 0;
    LayerData e = make_layer_data(p, DType::bf16, 1);
    e.shared_gate = d.shared_gate;
    expect_error([&] { run_forward(e); }, {"shared_gate_weights", "no shared expert"});
  }
  {
    LayerData e = d;
    e.out.view().shape[0] = 11;
    expect_error([&] { run_forward(e); }, {"out.shape", "[10, 64]", "[11, 64]"});
  }
}

TEST(Validation, GradientViews) {
  LayerData d = make_layer_data(small(), DType::bf16, 1);
  Workspace ws(d.problem, Config{}, {.backend = Backend::cpu});
  HostContext ctx(ws);
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  auto run_backward = [&](const Grads& g, BackwardOptions o = {}) {
    backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), g, o);
  };
  {
    LayerData e = d;
    e.d_up = HostTensor(DType::f64, {4, 128, 64});
    expect_error([&] { run_backward(e.grads()); },
                 {"d_routed_up_weights.dtype", "bfloat16 or float32", "float64"});
  }
  expect_error([&] { run_backward(d.grads(), {.accumulate_weight_grads = true}); },
               {"accumulate_weight_grads", "float32"});
  {
    LayerData e = d;
    e.d_topk_weights.view().shape[1] = 3;
    expect_error([&] { run_backward(e.grads()); }, {"d_topk_weights.shape", "[10, 2]", "[10, 3]"});
  }
}

// The forward context's views: shapes from the workspace, the backend's device and dtype.
TEST(Validation, ForwardContextViews) {
  LayerData d = make_layer_data(small(), DType::bf16, 1);
  Workspace ws(d.problem, Config{}, {.backend = Backend::cpu});
  const ForwardContextLayout l = forward_context_layout(ws);
  EXPECT_EQ(l.routed_rows, 10 * 2);  // one row per slot on the CPU backend
  EXPECT_EQ(l.x_rows, 0);
  {
    HostContext ctx(ws);
    ctx.get().gate_routed.shape[0] = 19;
    expect_error([&] { forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get()); },
                 {"forward_context.gate_routed.shape", "[20, 128]", "[19, 128]"});
  }
  {
    HostContext ctx(ws);
    ctx.get().hidden_shared.dtype = DType::f32;
    expect_error([&] { forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get()); },
                 {"forward_context.hidden_shared.dtype", "bfloat16", "float32"});
  }
  {
    HostContext ctx(ws);
    ctx.get().up_shared = TensorView{};
    expect_error([&] { forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get()); },
                 {"forward_context.up_shared", "none"});
  }
  expect_error([&] { forward_context_views(l, reinterpret_cast<void*>(8)); },
               {"forward context buffer", "16-byte alignment"});
}

TEST(Validation, BackendChoices) {
  if (backend_available(Backend::cuda)) {
    EXPECT_EQ(resolve_backend(Backend::automatic), Backend::cuda);
    Workspace ws(small(), Config{}, {.backend = Backend::cuda});
    EXPECT_EQ(ws.backend(), Backend::cuda);
    // bf16 only on the GPU: the exact f64 mode is the CPU reference's.
    expect_error(
        [&] {
          Workspace f64(small(), Config{},
                        {.backend = Backend::cuda, .activation_dtype = DType::f64});
        },
        {"activation_dtype", "float64"});
  } else {
    EXPECT_EQ(resolve_backend(Backend::automatic), Backend::cpu);
    expect_error([&] { Workspace ws(small(), Config{}, {.backend = Backend::cuda}); },
                 {"CUDA backend is not available", "cpu"});
  }
  Problem p = small();
  p.ep_size = 2;
  // A CPU workspace of several ranks runs host expert parallelism (test_host_ep.cpp).
  EXPECT_EQ(Workspace(p, Config{}, {.backend = Backend::cpu}).problem().ep_size, 2);
  expect_error(
      [&] { Workspace ws(small(), Config{}, {.backend = Backend::cpu, .num_threads = -1}); },
      {"num_threads", "got -1"});
}

}  // namespace
}  // namespace mok::test
