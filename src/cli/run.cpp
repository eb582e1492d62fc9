// `mok run`: one training step of one layer on synthetic data, timed and checked.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>

#include "cli/cli.hpp"
#include "core/schedule_check.hpp"
#include "core/workspace_plan.hpp"
#include "mok/fp8.hpp"
#include "core/backend.hpp"
#include "synthetic/check.hpp"
#include "synthetic/synthetic_step.hpp"

namespace mok::cli {
namespace {

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

std::string json_string(const std::string& v) {
  std::string s = "\"";
  for (char c : v) {
    if (c == '"' || c == '\\') s += '\\';
    s += c;
  }
  return s + "\"";
}

}  // namespace

int run(const RunArgs& args) {
  const Problem& p = args.problem;
  p.validate(DType::bf16);  // before any allocation, so bad shapes fail fast with their name
  const Backend backend = resolve_backend(args.backend);
  require_backend(backend);
  args.config.validate();

  LayerData data = make_layer_data(p, DType::bf16, args.seed, args.routing);
  data.swiglu_limit = args.swiglu_limit;
  std::int64_t routed_rows = 0;
  for (std::int64_t s = 0; s < p.num_tokens * p.topk; ++s)
    routed_rows += data.topk_experts.get(s) >= 0;

  double fwd_ms = 0, bwd_ms = 0;
  int threads = 0;
  if (backend == Backend::cuda) {
    // One untimed step, then the median of three timed with CUDA events.
    const cuda::StepTimes t = cuda::run_synthetic_step(data, args.config, 0, 1, 3);
    fwd_ms = t.fwd_ms;
    bwd_ms = t.bwd_ms;
  } else {
    Workspace ws(p, args.config, {.backend = backend, .num_threads = args.threads});
    threads = ws.num_threads();
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    HostContext ctx(ws);
    forward(ws, data.inputs(), data.weights(), data.out.view(), ctx.get());
    const auto t1 = clock::now();
    backward(ws, data.inputs(), data.weights(), ctx.get(), data.d_out.view(), data.grads());
    const auto t2 = clock::now();
    fwd_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    bwd_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  }
  const double fwd_flops = p.forward_flops(routed_rows), bwd_flops = 2 * fwd_flops;

  CheckOptions check_options;
  check_options.num_threads = args.threads;
  check_options.seed = args.seed;
  const CheckReport report = check_against_f64(data, check_options);
  const bool passed = report.passed();

  if (args.json) {
    std::ostringstream j;
    j << "{\"backend\": " << json_string(backend_name(backend))
      << ", \"preset\": " << json_string(args.preset)
      << ", \"routing\": " << json_string(routing_name(args.routing)) << ", \"seed\": " << args.seed
      << ", \"swiglu_limit\": "
      << (args.swiglu_limit ? json_number(*args.swiglu_limit) : std::string("null"))
      << ", \"threads\": " << threads << ", \"shape\": {\"T\": " << p.num_tokens
      << ", \"H\": " << p.hidden_size << ", \"I\": " << p.intermediate_size
      << ", \"E\": " << p.num_experts << ", \"k\": " << p.topk
      << ", \"S\": " << p.shared_intermediate_size << "}, \"routed_rows\": " << routed_rows
      << ", \"fwd_ms\": " << json_number(fwd_ms) << ", \"bwd_ms\": " << json_number(bwd_ms)
      << ", \"fwd_tflops\": " << json_number(fwd_flops / (fwd_ms * 1e9))
      << ", \"bwd_tflops\": " << json_number(bwd_flops / (bwd_ms * 1e9))
      << ", \"check\": {\"passed\": " << (passed ? "true" : "false")
      << ", \"sampled\": " << (report.sampled ? "true" : "false")
      << ", \"out_rel_err\": " << json_number(report.out_rel_err())
      << ", \"grad_rel_err_max\": " << json_number(report.grad_rel_err_max()) << ", \"entries\": [";
    for (std::size_t i = 0; i < report.entries.size(); ++i) {
      const ErrorEntry& e = report.entries[i];
      j << (i ? ", " : "") << "{\"name\": " << json_string(e.name)
        << ", \"rel_err\": " << json_number(e.rel_err)
        << ", \"tolerance\": " << json_number(e.tolerance) << ", \"compared\": " << e.compared
        << "}";
    }
    j << "]}}";
    std::printf("%s\n", j.str().c_str());
  } else {
    const std::string where =
        backend == Backend::cuda ? cuda::device_summary(0) : std::to_string(threads) + " threads";
    std::printf("mok run: preset %s, backend %s (%s), %s routing, seed %llu\n", args.preset.c_str(),
                backend_name(backend), where.c_str(), routing_name(args.routing),
                static_cast<unsigned long long>(args.seed));
    std::printf("  shape     %s, %lld routed rows\n", p.to_string().c_str(),
                static_cast<long long>(routed_rows));
    std::printf("  forward   %10.3f ms  %8.4f TFLOP/s\n", fwd_ms, fwd_flops / (fwd_ms * 1e9));
    std::printf("  backward  %10.3f ms  %8.4f TFLOP/s\n", bwd_ms, bwd_flops / (bwd_ms * 1e9));
    std::printf("  %s", report.summary().c_str());
    std::printf("  check %s\n", passed ? "passed" : "FAILED");
  }
  return passed ? 0 : 1;
}

// Bytes of this rank's routed weights in FP8 (gate, up [E_local, I, H], down [E_local, H, I],
// each in both orientations with its 128x128 block scales: mok/fp8.hpp), or -1 where H or I is
// not a multiple of 128. The caller owns them, as it owns the bf16 weights.
std::int64_t fp8_weight_bytes(const Problem& p) {
  try {
    const std::int64_t E = p.num_local_experts(), H = p.hidden_size, I = p.intermediate_size;
    return static_cast<std::int64_t>(2 * quantized_weights_layout(E, I, H).bytes +
                                     quantized_weights_layout(E, H, I).bytes);
  } catch (const Error&) {
    return -1;
  }
}

int print_plan(const RunArgs& args) {
  const Problem& p = args.problem;
  p.validate(DType::bf16);
  validate_schedule_problem(p, args.config);
  const plan::WorkspacePlan wp = plan::make_workspace_plan(plan_shape_of(p, args.config));
  auto mib = [](std::int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  if (args.json) {
    std::ostringstream j;
    j << "{\"preset\": " << json_string(args.preset) << ", \"shape\": {\"T\": " << p.num_tokens
      << ", \"H\": " << p.hidden_size << ", \"E\": " << p.num_experts << ", \"k\": " << p.topk
      << ", \"W\": " << p.ep_size << "}, \"minibatch_size\": " << args.config.minibatch_size
      << ", \"macrobatch_size\": " << args.config.macrobatch_size
      << ", \"symmetric_bytes\": " << wp.symmetric_bytes << ", \"local_bytes\": " << wp.local_bytes
      << ", \"layer_bytes\": " << wp.layer_bytes << ", \"total_bytes\": " << wp.total_bytes()
      << ", \"max_passes\": " << wp.max_passes << ", \"carry_slots\": " << wp.carry_slots
      << ", \"fp8_weight_bytes\": " << fp8_weight_bytes(p) << ", \"buffers\": [";
    bool first = true;
    for (const plan::BufferInfo& b : plan::kBuffers) {
      const plan::Buffer buf = wp.*(b.member);
      j << (first ? "" : ", ") << "{\"name\": " << json_string(b.name) << ", \"region\": "
        << json_string(plan::region_name(b.region))
        << ", \"offset\": " << buf.offset << ", \"bytes\": " << buf.bytes << "}";
      first = false;
    }
    j << "]}";
    std::printf("%s\n", j.str().c_str());
    return 0;
  }
  std::printf("mok workspace plan: preset %s, %s\n", args.preset.c_str(), p.to_string().c_str());
  std::printf(
      "  config: minibatch_size=%lld macrobatch_size=%lld (a ring of %lld rows); schedule "
      "capacity %lld rows, segments aligned to %d rows\n",
      static_cast<long long>(args.config.minibatch_size),
      static_cast<long long>(args.config.macrobatch_size),
      static_cast<long long>(schedule::macrobatch_rows(schedule_shape_of(p),
                                                       args.config.macrobatch_size,
                                                       args.config.minibatch_size)),
      static_cast<long long>(schedule::max_schedule_rows(schedule_shape_of(p))),
      schedule::kExpertSegmentAlignment);
  std::printf("  %-10s %-20s %-34s %14s %14s %10s\n", "region", "buffer", "layout", "offset",
              "bytes", "MiB");
  for (const plan::BufferInfo& b : plan::kBuffers) {
    const plan::Buffer buf = wp.*(b.member);
    std::printf("  %-10s %-20s %-34s %14lld %14lld %10.3f\n", plan::region_name(b.region),
                b.name, b.what,
                static_cast<long long>(buf.offset), static_cast<long long>(buf.bytes),
                mib(buf.bytes));
  }
  std::printf("  symmetric region %lld bytes (%.3f MiB) per rank, same on every rank\n",
              static_cast<long long>(wp.symmetric_bytes), mib(wp.symmetric_bytes));
  std::printf("  local region     %lld bytes (%.3f MiB) per rank\n",
              static_cast<long long>(wp.local_bytes), mib(wp.local_bytes));
  std::printf("  layer region     %lld bytes (%.3f MiB) per rank (%lld ring passes at most, %lld "
              "fp32 carry slots)\n",
              static_cast<long long>(wp.layer_bytes), mib(wp.layer_bytes),
              static_cast<long long>(wp.max_passes), static_cast<long long>(wp.carry_slots));
  std::printf("  workspace        %lld bytes (%.3f MiB) per rank, what the CUDA layer allocates "
              "(the forward context is the caller's)\n",
              static_cast<long long>(wp.total_bytes()), mib(wp.total_bytes()));
  if (const std::int64_t fp8 = fp8_weight_bytes(p); fp8 >= 0) {
    std::printf("  FP8 weights      %lld bytes (%.3f MiB) per rank: routed gate, up, down in "
                "e4m3, both orientations, 128x128 block scales (the caller's, as the bf16 "
                "weights)\n",
                static_cast<long long>(fp8), mib(fp8));
  } else {
    std::printf("  FP8 weights      n/a (FP8 needs H and I multiples of 128)\n");
  }
  return 0;
}

}  // namespace mok::cli
