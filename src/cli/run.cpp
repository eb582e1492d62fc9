// `mok run`: one training step of one layer on synthetic data, timed and checked.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "cli/cli.hpp"
#include "core/schedule_check.hpp"
#include "core/workspace_plan.hpp"
#include "mok/fp8.hpp"
#include "core/backend.hpp"
#include "synthetic/check.hpp"
#include "synthetic/check_fp8.hpp"
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

// The FP8 layer quantizes in 128-wide blocks along H and I: checked before any allocation.
void require_fp8_shape(const Problem& p, Precision precision) {
  const std::pair<const char*, std::int64_t> sizes[] = {{"hidden_size", p.hidden_size},
                                                        {"intermediate_size", p.intermediate_size}};
  for (const auto& [name, size] : sizes) {
    if (size % 128 != 0) {
      throw Error(name,
                  std::string("a multiple of 128 for --precision ") + precision_name(precision),
                  to_text(size));
    }
  }
}

std::string json_entry(const ErrorEntry& e, bool fp8) {
  std::ostringstream j;
  j << "{\"name\": " << json_string(e.name) << ", \"rel_err\": " << json_number(e.rel_err)
    << ", \"tolerance\": " << (fp8 ? std::string("null") : json_number(e.tolerance))
    << ", \"compared\": " << e.compared << ", \"abs_max\": " << json_number(e.abs_max)
    << ", \"rel_sum\": " << json_number(e.rel_sum) << ", \"cosine\": " << json_number(e.cosine)
    << ", \"passed\": " << ((fp8 ? within_mxfp8_bounds(e) : e.passed()) ? "true" : "false") << "}";
  return j.str();
}

std::string json_fp8_reference(const Fp8ReferenceReport& r) {
  std::ostringstream j;
  j << "{\"passed\": " << (r.passed() ? "true" : "false")
    << ", \"sampled\": " << (r.sampled ? "true" : "false")
    << ", \"bitwise\": " << (r.bitwise ? "true" : "false")
    << ", \"rel_sum_bound\": " << json_number(kFp8ReferenceRelSum)
    << ", \"row_rel_sum_bound\": " << json_number(kFp8ReferenceRowRelSum) << ", \"entries\": [";
  for (std::size_t i = 0; i < r.entries.size(); ++i) {
    const Fp8ReferenceEntry& e = r.entries[i];
    j << (i ? ", " : "") << "{\"name\": " << json_string(e.name) << ", \"compared\": " << e.compared
      << ", \"differing\": " << e.differing << ", \"rel_sum\": " << json_number(e.rel_sum)
      << ", \"worst_row\": " << json_number(e.worst_row) << ", \"bad_rows\": " << e.bad_rows
      << ", \"passed\": " << (e.passed() ? "true" : "false") << "}";
  }
  j << "]}";
  return j.str();
}

}  // namespace

int run(const RunArgs& args) {
  const Problem& p = args.problem;
  p.validate(DType::bf16);  // before any allocation, so bad shapes fail fast with their name
  const bool fp8 = is_fp8(args.precision);
  if (fp8) require_fp8_shape(p, args.precision);
  // The FP8 layer's backward: fp8_weight_grads false for fp8-bf16-wgrad (both backends, and the
  // CPU FP8 layer the check compares with).
  const BackwardOptions backward_opts = backward_options(args.precision);
  const Backend backend = resolve_backend(args.backend);
  require_backend(backend);
  args.config.validate();

  LayerData data = make_layer_data(p, DType::bf16, args.seed, args.routing);
  data.swiglu_limit = args.swiglu_limit;
  std::int64_t routed_rows = 0;
  for (std::int64_t s = 0; s < p.num_tokens * p.topk; ++s)
    routed_rows += data.topk_experts.get(s) >= 0;

  double fwd_ms = 0, bwd_ms = 0, quant_ms = 0;
  int threads = 0;
  if (backend == Backend::cuda) {
    // One untimed step, then the median of three timed with CUDA events (FP8: the weights'
    // quantization likewise, on its own).
    const cuda::StepTimes t =
        fp8 ? cuda::run_synthetic_step_fp8(data, args.config, backward_opts, 0, 1, 3)
            : cuda::run_synthetic_step(data, args.config, 0, 1, 3);
    fwd_ms = t.fwd_ms;
    bwd_ms = t.bwd_ms;
    quant_ms = t.quant_ms;
  } else {
    Workspace ws(p, args.config, {.backend = backend, .num_threads = args.threads});
    threads = ws.num_threads();
    using clock = std::chrono::steady_clock;
    auto ms = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    HostContext ctx(ws);
    std::optional<HostFp8Weights> q;  // the FP8 layer's routed weights, quantized on the host
    if (fp8) {
      const auto q0 = clock::now();
      q.emplace(data);
      quant_ms = ms(q0, clock::now());
    }
    const auto t0 = clock::now();
    if (fp8) {
      forward(ws, data.inputs(), data.weights(), q->get(), data.out.view(), ctx.get());
    } else {
      forward(ws, data.inputs(), data.weights(), data.out.view(), ctx.get());
    }
    const auto t1 = clock::now();
    if (fp8) {
      backward(ws, data.inputs(), data.weights(), q->get(), ctx.get(), data.d_out.view(),
               data.grads(), backward_opts);
    } else {
      backward(ws, data.inputs(), data.weights(), ctx.get(), data.d_out.view(), data.grads());
    }
    const auto t2 = clock::now();
    fwd_ms = ms(t0, t1);
    bwd_ms = ms(t1, t2);
  }
  const double fwd_flops = p.forward_flops(routed_rows), bwd_flops = 2 * fwd_flops;

  CheckOptions check_options;
  check_options.num_threads = args.threads;
  check_options.seed = args.seed;
  if (args.check == CheckSize::full) check_options.max_full_flops = INFINITY;
  if (args.check == CheckSize::sampled) check_options.max_full_flops = -1;
  const CheckReport report = check_against_f64(data, check_options);
  std::optional<Fp8ReferenceReport> reference;
  if (fp8) {
    reference = check_against_fp8_reference(data, backend == Backend::cpu,
                                            backward_opts.fp8_weight_grads, check_options);
  }
  const bool passed = fp8 ? within_mxfp8_bounds(report) && reference->passed() : report.passed();

  if (args.json) {
    std::ostringstream j;
    j << "{\"backend\": " << json_string(backend_name(backend))
      << ", \"preset\": " << json_string(args.preset)
      << ", \"precision\": " << json_string(precision_name(args.precision))
      << ", \"routing\": " << json_string(routing_name(args.routing)) << ", \"seed\": " << args.seed
      << ", \"swiglu_limit\": "
      << (args.swiglu_limit ? json_number(*args.swiglu_limit) : std::string("null"))
      << ", \"threads\": " << threads << ", \"shape\": {\"T\": " << p.num_tokens
      << ", \"H\": " << p.hidden_size << ", \"I\": " << p.intermediate_size
      << ", \"E\": " << p.num_experts << ", \"k\": " << p.topk
      << ", \"S\": " << p.shared_intermediate_size << "}, \"routed_rows\": " << routed_rows;
    if (fp8) j << ", \"quant_ms\": " << json_number(quant_ms);
    j << ", \"fwd_ms\": " << json_number(fwd_ms) << ", \"bwd_ms\": " << json_number(bwd_ms)
      << ", \"fwd_tflops\": " << json_number(fwd_flops / (fwd_ms * 1e9))
      << ", \"bwd_tflops\": " << json_number(bwd_flops / (bwd_ms * 1e9))
      << ", \"check\": {\"passed\": " << (passed ? "true" : "false")
      << ", \"sampled\": " << (report.sampled ? "true" : "false")
      << ", \"out_rel_err\": " << json_number(report.out_rel_err())
      << ", \"grad_rel_err_max\": " << json_number(report.grad_rel_err_max()) << ", \"entries\": [";
    for (std::size_t i = 0; i < report.entries.size(); ++i) {
      j << (i ? ", " : "") << json_entry(report.entries[i], fp8);
    }
    j << "]";
    if (fp8) {
      j << ", \"mxfp8_bounds\": {\"abs_max\": " << json_number(kMxfp8AbsMax)
        << ", \"rel_sum\": " << json_number(kMxfp8RelSum)
        << ", \"cosine\": " << json_number(kMxfp8Cosine)
        << "}, \"fp8_reference\": " << json_fp8_reference(*reference);
    }
    j << "}}";
    std::printf("%s\n", j.str().c_str());
  } else {
    const std::string where =
        backend == Backend::cuda ? cuda::device_summary(0) : std::to_string(threads) + " threads";
    std::printf("mok run: preset %s, backend %s (%s), %s routing, seed %llu%s%s\n",
                args.preset.c_str(), backend_name(backend), where.c_str(),
                routing_name(args.routing), static_cast<unsigned long long>(args.seed),
                fp8 ? ", precision " : "", fp8 ? precision_name(args.precision) : "");
    std::printf("  shape     %s, %lld routed rows\n", p.to_string().c_str(),
                static_cast<long long>(routed_rows));
    if (fp8) {
      std::printf("  quantize  %10.3f ms  the routed weights to e4m3 with block scales (once per "
                  "weight version; not in the times below)\n",
                  quant_ms);
    }
    std::printf("  forward   %10.3f ms  %8.4f TFLOP/s\n", fwd_ms, fwd_flops / (fwd_ms * 1e9));
    std::printf("  backward  %10.3f ms  %8.4f TFLOP/s\n", bwd_ms, bwd_flops / (bwd_ms * 1e9));
    if (fp8) {
      std::printf("  %s", fp8_summary(report, *reference).c_str());
    } else {
      std::printf("  %s", report.summary().c_str());
    }
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

namespace {

// The FP8 layer's scratch (plan::Fp8Plan), for printing beside plan::kBuffers.
struct Fp8BufferInfo {
  const char* name;
  plan::Buffer plan::Fp8Plan::*member;
  const char* what;
};

constexpr Fp8BufferInfo kFp8Buffers[] = {
    {"rows_a", &plan::Fp8Plan::rows_a, "e4m3 [R, max(H, I)]"},
    {"rows_a_scales", &plan::Fp8Plan::rows_a_scales, "f32 [max(H, I)/128, R]"},
    {"rows_b", &plan::Fp8Plan::rows_b, "e4m3 [R, I]"},
    {"rows_b_scales", &plan::Fp8Plan::rows_b_scales, "f32 [I/128, R]"},
    {"rows_c", &plan::Fp8Plan::rows_c, "e4m3 [R, I]"},
    {"rows_c_scales", &plan::Fp8Plan::rows_c_scales, "f32 [I/128, R]"},
    {"t_x", &plan::Fp8Plan::t_x, "e4m3 [H, R]"},
    {"t_x_scales", &plan::Fp8Plan::t_x_scales, "f32 [R/128, H]"},
    {"t_dy", &plan::Fp8Plan::t_dy, "e4m3 [H, R]"},
    {"t_dy_scales", &plan::Fp8Plan::t_dy_scales, "f32 [R/128, H]"},
    {"t_dg", &plan::Fp8Plan::t_dg, "e4m3 [I, R]"},
    {"t_dg_scales", &plan::Fp8Plan::t_dg_scales, "f32 [R/128, I]"},
    {"t_du", &plan::Fp8Plan::t_du, "e4m3 [I, R]"},
    {"t_du_scales", &plan::Fp8Plan::t_du_scales, "f32 [R/128, I]"},
    {"t_h", &plan::Fp8Plan::t_h, "e4m3 [I, R]"},
    {"t_h_scales", &plan::Fp8Plan::t_h_scales, "f32 [R/128, I]"},
};

// What the FP8 layer holds beyond the bf16 layer's workspace: its scratch (without the token-axis
// copies for bf16 weight gradients: WorkspaceOptions::fp8_token_axis), and per layer the
// quantized routed weights; and the forward context, the bf16 layer's.
struct Fp8Memory {
  plan::Fp8Plan scratch;
  std::int64_t gate = 0, up = 0, down = 0;  // quantized weights, both orientations and scales
  std::int64_t context = 0;                 // the CUDA layer's forward context
  std::int64_t weights() const { return gate + up + down; }
};

Fp8Memory fp8_memory(const Problem& p, const Config& c, bool token_axis) {
  const std::int64_t E = p.num_local_experts(), H = p.hidden_size, I = p.intermediate_size;
  Fp8Memory m;
  m.scratch = plan::make_fp8_plan(plan_shape_of(p, c), token_axis);
  m.gate = m.up = static_cast<std::int64_t>(quantized_weights_layout(E, I, H).bytes);
  m.down = static_cast<std::int64_t>(quantized_weights_layout(E, H, I).bytes);
  m.context =
      static_cast<std::int64_t>(forward_context_layout(p, c, Backend::cuda, DType::bf16).bytes);
  return m;
}

}  // namespace

int print_plan(const RunArgs& args) {
  const Problem& p = args.problem;
  p.validate(DType::bf16);
  // fp8-bf16-wgrad's workspace is fp8's without the token-axis copies (WorkspaceOptions::
  // fp8_token_axis false), which only the e4m3 weight gradients read.
  const bool fp8 = is_fp8(args.precision);
  if (fp8) require_fp8_shape(p, args.precision);
  validate_schedule_problem(p, args.config);
  const plan::WorkspacePlan wp = plan::make_workspace_plan(plan_shape_of(p, args.config));
  const bool token_axis = backward_options(args.precision).fp8_weight_grads;
  const Fp8Memory f = fp8 ? fp8_memory(p, args.config, token_axis) : Fp8Memory{};
  auto mib = [](std::int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  if (args.json) {
    std::ostringstream j;
    j << "{\"preset\": " << json_string(args.preset)
      << ", \"precision\": " << json_string(precision_name(args.precision))
      << ", \"shape\": {\"T\": " << p.num_tokens
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
    j << "]";
    if (fp8) {
      j << ", \"fp8_scratch_bytes\": " << f.scratch.bytes << ", \"fp8_buffers\": [";
      first = true;
      for (const Fp8BufferInfo& b : kFp8Buffers) {
        const plan::Buffer buf = f.scratch.*(b.member);
        if (buf.bytes == 0) continue;  // not carved (fp8-bf16-wgrad: no token-axis copies)
        j << (first ? "" : ", ") << "{\"name\": " << json_string(b.name)
          << ", \"region\": \"fp8\", \"offset\": " << buf.offset << ", \"bytes\": " << buf.bytes
          << "}";
        first = false;
      }
      j << "], \"workspace_bytes\": " << wp.total_bytes() + f.scratch.bytes
        << ", \"fp8_weights\": {\"gate\": " << f.gate << ", \"up\": " << f.up
        << ", \"down\": " << f.down << "}, \"forward_context_bytes\": " << f.context
        << ", \"per_layer_bytes\": " << f.weights() + f.context;
    }
    j << "}";
    std::printf("%s\n", j.str().c_str());
    return 0;
  }
  std::printf("mok workspace plan: preset %s, %s%s%s\n", args.preset.c_str(), p.to_string().c_str(),
              fp8 ? ", precision " : "", fp8 ? precision_name(args.precision) : "");
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
  if (fp8) {
    for (const Fp8BufferInfo& b : kFp8Buffers) {
      const plan::Buffer buf = f.scratch.*(b.member);
      if (buf.bytes == 0) continue;  // not carved (fp8-bf16-wgrad: no token-axis copies)
      std::printf("  %-10s %-20s %-34s %14lld %14lld %10.3f\n", "fp8", b.name, b.what,
                  static_cast<long long>(buf.offset), static_cast<long long>(buf.bytes),
                  mib(buf.bytes));
    }
  }
  std::printf("  symmetric region %lld bytes (%.3f MiB) per rank, same on every rank\n",
              static_cast<long long>(wp.symmetric_bytes), mib(wp.symmetric_bytes));
  std::printf("  local region     %lld bytes (%.3f MiB) per rank\n",
              static_cast<long long>(wp.local_bytes), mib(wp.local_bytes));
  std::printf("  layer region     %lld bytes (%.3f MiB) per rank (%lld ring passes at most, %lld "
              "fp32 carry slots)\n",
              static_cast<long long>(wp.layer_bytes), mib(wp.layer_bytes),
              static_cast<long long>(wp.max_passes), static_cast<long long>(wp.carry_slots));
  if (!fp8) {
    std::printf("  workspace        %lld bytes (%.3f MiB) per rank, what the CUDA layer allocates "
                "(the forward context is the caller's)\n",
                static_cast<long long>(wp.total_bytes()), mib(wp.total_bytes()));
    if (const std::int64_t bytes = fp8_weight_bytes(p); bytes >= 0) {
      std::printf("  FP8 weights      %lld bytes (%.3f MiB) per rank: routed gate, up, down in "
                  "e4m3, both orientations, 128x128 block scales (the caller's, as the bf16 "
                  "weights; --precision fp8 prints the FP8 layer's memory)\n",
                  static_cast<long long>(bytes), mib(bytes));
    } else {
      std::printf("  FP8 weights      n/a (FP8 needs H and I multiples of 128)\n");
    }
    return 0;
  }
  const std::int64_t workspace = wp.total_bytes() + f.scratch.bytes;
  std::printf("  fp8 scratch      %lld bytes (%.3f MiB) per rank: the e4m3 operands of a ring pass "
              "and their scales (WorkspaceOptions::fp8, an allocation of its own%s)\n",
              static_cast<long long>(f.scratch.bytes), mib(f.scratch.bytes),
              token_axis ? "" : "; fp8_token_axis false: no token-axis copies");
  std::printf("  workspace        %lld bytes (%.3f MiB) per rank, what the CUDA layer allocates "
              "with WorkspaceOptions::fp8%s; one workspace serves every layer of its shape\n",
              static_cast<long long>(workspace), mib(workspace),
              token_axis ? "" : " and fp8_token_axis false");
  std::printf("  FP8 weights      %lld bytes (%.3f MiB) per rank and layer: gate %lld, up %lld, "
              "down %lld (e4m3, both orientations, 128x128 block scales; the caller's, beside "
              "the bf16 master weights)\n",
              static_cast<long long>(f.weights()), mib(f.weights()),
              static_cast<long long>(f.gate), static_cast<long long>(f.up),
              static_cast<long long>(f.down));
  std::printf("  forward context  %lld bytes (%.3f MiB) per rank and layer: the bf16 layer's "
              "(x, g, u, h of the first ring pass, the shared expert's g, u, h, in bf16; the "
              "caller's)\n",
              static_cast<long long>(f.context), mib(f.context));
  std::printf("  per layer        %lld bytes (%.3f MiB) per rank: FP8 weights + forward "
              "context, beside the bf16 master weights and their gradients\n",
              static_cast<long long>(f.weights() + f.context), mib(f.weights() + f.context));
  return 0;
}

}  // namespace mok::cli
