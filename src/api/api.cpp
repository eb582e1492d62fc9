// The public entry points: validate, then hand over to the backend.
#include "mok/api.hpp"

#include <cstdint>

#include "core/schedule_check.hpp"
#include "core/validate.hpp"
#include "core/workspace.hpp"
#include "core/workspace_plan.hpp"

namespace mok {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::automatic:
      return "auto";
    case Backend::cpu:
      return "cpu";
    case Backend::cuda:
      return "cuda";
  }
  return "unknown";
}

bool backend_available(Backend b) {
  switch (b) {
    case Backend::automatic:
    case Backend::cpu:
      return true;
    case Backend::cuda:
      return cuda::layer_available() && cuda::device_count() > 0;
  }
  return false;
}

Backend resolve_backend(Backend b) {
  if (b != Backend::automatic) return b;
  return backend_available(Backend::cuda) ? Backend::cuda : Backend::cpu;
}

void require_backend(Backend b) {
  if (b != Backend::cuda || backend_available(b)) return;
  std::string why = !cuda::compiled()           ? "this build has no CUDA support"
                    : cuda::device_count() == 0 ? "no CUDA device is visible"
                                                : "its layer kernels are not available yet";
  throw Error("the CUDA backend is not available (" + why +
              "); use the cpu backend (Backend::cpu, --backend cpu)");
}

Workspace::Workspace(const Problem& problem, const Config& config, const WorkspaceOptions& options)
    : impl_(std::make_unique<Impl>()) {
  problem.validate(options.activation_dtype);
  config.validate();
  if (options.num_threads < 0) {
    throw Error("WorkspaceOptions.num_threads", "0 (all hardware threads) or a positive count",
                to_text(options.num_threads));
  }
  const Backend backend = resolve_backend(options.backend);
  require_backend(backend);
  if (options.activation_dtype == DType::f64 && backend != Backend::cpu) {
    throw Error("WorkspaceOptions.activation_dtype", "bfloat16 on the cuda backend",
                "float64 (the exact mode runs on the cpu backend only)");
  }
  const std::size_t bases = options.symmetric_bases.size();
  if (backend == Backend::cuda && problem.ep_size != 1 &&
      bases != static_cast<std::size_t>(problem.ep_size)) {
    throw Error("WorkspaceOptions.symmetric_bases",
                "ep_size = " + to_text(problem.ep_size) +
                    " pointers (every rank's symmetric region) for a cuda Workspace of several "
                    "ranks",
                to_text(bases) + " pointers");
  }
  if (bases != 0 && backend != Backend::cuda) {
    throw Error("WorkspaceOptions.symmetric_bases",
                "none on the cpu backend (its expert parallelism moves rows through the caller: "
                "mok::host_ep)",
                to_text(bases) + " pointers");
  }
  if (options.barrier_timeout_ms == 0) {
    throw Error("WorkspaceOptions.barrier_timeout_ms", "a positive bound", "0");
  }
  impl_->problem = problem;
  impl_->config = config;
  impl_->options = options;
  impl_->backend = backend;
  impl_->layer =
      backend == Backend::cpu
          ? make_cpu_backend(problem, options.activation_dtype, options.num_threads)
          : make_cuda_backend(problem, config, options.device_index, options.symmetric_bases,
                              options.barrier_timeout_ms, options.fp8,
                              options.fp8_token_axis);
}

Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;

const Problem& Workspace::problem() const {
  return impl_->problem;
}
const Config& Workspace::config() const {
  return impl_->config;
}
Backend Workspace::backend() const {
  return impl_->backend;
}
DType Workspace::activation_dtype() const {
  return impl_->options.activation_dtype;
}
int Workspace::num_threads() const {
  return impl_->layer->num_threads();
}
std::size_t Workspace::bytes() const {
  return impl_->layer->bytes();
}
void Workspace::set_stream(void* stream) {
  impl_->stream = stream;
}
Workspace::Impl& Workspace::impl() {
  return *impl_;
}

Device device_of(const Workspace::Impl& ws) {
  return ws.backend == Backend::cpu ? Device{DeviceKind::cpu, 0}
                                    : Device{DeviceKind::cuda, ws.options.device_index};
}

Workspace::CallCounts Workspace::call_counts() const {
  return impl_->calls;
}

namespace {

// The context's fields one after another in one buffer, each at a multiple of
// plan::kBufferAlignment bytes (the workspace plan's rule); returns the views and, in `end`, the
// bytes they take. With `base` null only `end` means anything.
ForwardContext carve_context(const ForwardContextLayout& l, std::uint8_t* base, std::int64_t& end) {
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(l.dtype));
  end = 0;
  auto take = [&](std::int64_t rows, std::int64_t cols) {
    const plan::Buffer b = plan::carve(end, rows * cols * e);
    return TensorView::contiguous(base != nullptr ? base + b.offset : nullptr, l.dtype,
                                  {rows, cols}, l.device);
  };
  ForwardContext c;
  c.x_routed = take(l.x_rows, l.hidden_size);
  c.gate_routed = take(l.routed_rows, l.intermediate_size);
  c.up_routed = take(l.routed_rows, l.intermediate_size);
  c.hidden_routed = take(l.routed_rows, l.intermediate_size);
  if (l.shared_intermediate_size > 0) {
    c.gate_shared = take(l.num_tokens, l.shared_intermediate_size);
    c.up_shared = take(l.num_tokens, l.shared_intermediate_size);
    c.hidden_shared = take(l.num_tokens, l.shared_intermediate_size);
  }
  return c;
}

}  // namespace

ForwardContextLayout forward_context_layout(const Problem& p, const Config& c, Backend backend,
                                            DType activation_dtype, int device_index) {
  if (backend == Backend::automatic) {
    throw Error("backend", "cpu or cuda (a resolved backend)", "auto");
  }
  ForwardContextLayout l;
  l.dtype = activation_dtype;
  l.device =
      backend == Backend::cpu ? Device{DeviceKind::cpu, 0} : Device{DeviceKind::cuda, device_index};
  l.hidden_size = p.hidden_size;
  l.intermediate_size = p.intermediate_size;
  l.num_tokens = p.num_tokens;
  l.shared_intermediate_size = p.shared_intermediate_size;
  if (backend == Backend::cpu) {
    l.x_rows = 0;  // the reference gathers x again
    // One row per slot (with host expert parallelism: per slot of every rank, host_ep.hpp).
    l.routed_rows = std::int64_t{p.ep_size} * p.num_tokens * p.topk;
  } else {
    // The first ring pass: the rows of the ring (core/workspace_plan.hpp).
    l.x_rows = l.routed_rows = plan::ring_rows(plan_shape_of(p, c));
  }
  std::int64_t end = 0;
  carve_context(l, nullptr, end);
  l.bytes = static_cast<std::size_t>(end);
  return l;
}

ForwardContextLayout forward_context_layout(const Workspace& ws_) {
  const Workspace::Impl& ws = const_cast<Workspace&>(ws_).impl();
  const ForwardContextLayout l = forward_context_layout(
      ws.problem, ws.config, ws.backend, ws.options.activation_dtype, ws.options.device_index);
  if (ws.layer->context_rows() != l.routed_rows) {
    throw Error("internal: the backend's context rows differ from the context layout's");
  }
  return l;
}

ForwardContext forward_context_views(const ForwardContextLayout& l, void* buffer) {
  if (buffer == nullptr && l.bytes > 0) {
    throw Error("forward context buffer", "a pointer to " + to_text(l.bytes) + " bytes", "null");
  }
  if (reinterpret_cast<std::uintptr_t>(buffer) % 16 != 0) {
    throw Error("forward context buffer", "16-byte alignment", to_text(buffer));
  }
  std::int64_t end = 0;
  return carve_context(l, static_cast<std::uint8_t*>(buffer), end);
}

namespace {

// `q` (the FP8 layer): its quantized weights stand in for the routed ones.
ContextKey key_of(const Inputs& in, const Weights& w, const Fp8Weights* q) {
  ContextKey k;
  k.tensors = {in.x.data,         in.topk_experts.data, in.topk_weights.data, w.gate.data,
               w.up.data,         w.down.data,          w.shared_gate.data,   w.shared_up.data,
               w.shared_down.data};
  if (q != nullptr) {
    k.tensors[3] = q->gate.data.data;
    k.tensors[4] = q->up.data.data;
    k.tensors[5] = q->down.data.data;
  }
  k.swiglu_limit = w.swiglu_limit;
  k.fp8 = q != nullptr;
  k.recorded = true;
  return k;
}

constexpr const char* kKeyNames[ContextKey::kTensors] = {"x",
                                                         "topk_experts",
                                                         "topk_weights",
                                                         "routed_gate_weights",
                                                         "routed_up_weights",
                                                         "routed_down_weights",
                                                         "shared_gate_weights",
                                                         "shared_up_weights",
                                                         "shared_down_weights"};
constexpr const char* kFp8KeyNames[3] = {"gate", "up", "down"};

// Backward's inputs against the tensors the context was computed from (entries the recording
// call did not read are null and not compared).
void check_key(const ContextKey& recorded, const Inputs& in, const Weights& w,
               const Fp8Weights* q) {
  if (!recorded.recorded) return;
  const ContextKey now = key_of(in, w, q);
  auto layer = [](bool fp8) { return fp8 ? "FP8" : "bf16"; };
  if (recorded.fp8 != now.fp8) {
    throw Error("forward context",
                std::string("the context of a ") + layer(now.fp8) + " layer's forward",
                std::string("a context recorded by the ") + layer(recorded.fp8) + " layer");
  }
  for (int i = 0; i < ContextKey::kTensors; ++i) {
    if (recorded.tensors[i] == nullptr || recorded.tensors[i] == now.tensors[i]) continue;
    const std::string name = now.fp8 && i >= 3 && i <= 5
                                 ? std::string("fp8_weights.") + kFp8KeyNames[i - 3]
                                 : std::string(kKeyNames[i]);
    throw Error("forward context",
                "the context of a forward (or recompute_forward_context) over this " + name,
                "a context computed from another " + name + " (" + to_text(recorded.tensors[i]) +
                    ", not " + to_text(now.tensors[i]) + ")");
  }
  // The context keeps g and u unclamped and h clamped: gradients under another limit would be
  // silently wrong.
  if (recorded.swiglu_limit != now.swiglu_limit) {
    auto text = [](const std::optional<float>& l) { return l ? to_text(*l) : std::string("None"); };
    throw Error("swiglu_limit",
                "the forward context's swiglu_limit = " + text(recorded.swiglu_limit),
                text(now.swiglu_limit));
  }
}

}  // namespace

// The context's views: shapes from the workspace, on its device, in its dtype, 16-byte aligned
// on the CUDA backend (vector accesses).
void check_context(const Workspace& ws_, const ForwardContext& c) {
  const ForwardContextLayout l = forward_context_layout(ws_);
  const std::int64_t R = l.routed_rows, X = l.x_rows, H = l.hidden_size, I = l.intermediate_size,
                     T = l.num_tokens, S = l.shared_intermediate_size;
  check_view("forward_context.x_routed", c.x_routed, l.dtype, {X, H}, l.device);
  check_view("forward_context.gate_routed", c.gate_routed, l.dtype, {R, I}, l.device);
  check_view("forward_context.up_routed", c.up_routed, l.dtype, {R, I}, l.device);
  check_view("forward_context.hidden_routed", c.hidden_routed, l.dtype, {R, I}, l.device);
  if (S > 0) {
    check_view("forward_context.gate_shared", c.gate_shared, l.dtype, {T, S}, l.device);
    check_view("forward_context.up_shared", c.up_shared, l.dtype, {T, S}, l.device);
    check_view("forward_context.hidden_shared", c.hidden_shared, l.dtype, {T, S}, l.device);
  } else {
    const char* why = "the problem has no shared expert (shared_intermediate_size = 0)";
    check_absent("forward_context.gate_shared", c.gate_shared, why);
    check_absent("forward_context.up_shared", c.up_shared, why);
    check_absent("forward_context.hidden_shared", c.hidden_shared, why);
  }
  if (l.device.kind == DeviceKind::cuda) {
    check_aligned_16("forward_context.x_routed", c.x_routed);
    check_aligned_16("forward_context.gate_routed", c.gate_routed);
    check_aligned_16("forward_context.up_routed", c.up_routed);
    check_aligned_16("forward_context.hidden_routed", c.hidden_routed);
    check_aligned_16("forward_context.gate_shared", c.gate_shared);
    check_aligned_16("forward_context.up_shared", c.up_shared);
    check_aligned_16("forward_context.hidden_shared", c.hidden_shared);
  }
}

void check_fp8_call(const Workspace::Impl& ws, const Fp8Weights& q, InputUse use) {
  if (ws.backend == Backend::cuda) {
    if (!ws.options.fp8) {
      throw Error("WorkspaceOptions.fp8",
                  "true for the FP8 layer on the cuda backend (it reserves the FP8 scratch)",
                  "false");
    }
  }
  check_fp8_layer(ws.problem, ws.options.activation_dtype, device_of(ws), q, use);
}

// The FP8 backward's weight gradients against the workspace's scratch: e4m3 ones read the
// token-axis copies, which a cuda workspace made without them lacks.
void check_fp8_weight_grads(const Workspace::Impl& ws, const BackwardOptions& options) {
  if (ws.backend == Backend::cuda && options.fp8_weight_grads && !ws.options.fp8_token_axis) {
    throw Error("WorkspaceOptions.fp8_token_axis",
                "true for e4m3 weight gradients (BackwardOptions::fp8_weight_grads; false: bf16 "
                "weight gradients need no token-axis copies)",
                "false");
  }
}

void require_one_rank(const Workspace::Impl& ws, const char* call) {
  // A cuda workspace of several ranks is one rank of a team across processes: the device moves
  // the rows (WorkspaceOptions::symmetric_bases).
  if (ws.problem.ep_size == 1 || ws.backend == Backend::cuda) return;
  throw Error("ep_size",
              std::string("1 for mok::") + call +
                  " (a workspace of several ranks runs its calls through mok::host_ep: the "
                  "caller moves the rows between ranks)",
              to_text(ws.problem.ep_size));
}

namespace {

// `q` (the FP8 layer) null: the bf16 layer.
void run_forward(Workspace& ws_, const Inputs& in, const Weights& w, const Fp8Weights* q,
                 const TensorView* out, ForwardContext& ctx) {
  Workspace::Impl& ws = ws_.impl();
  require_one_rank(ws, out != nullptr ? "forward" : "recompute_forward_context");
  const DType act = ws.options.activation_dtype;
  const Device dev = device_of(ws);
  const bool recompute = out == nullptr;
  const InputUse use = recompute ? InputUse::context_only : InputUse::forward;
  if (q != nullptr) check_fp8_call(ws, *q, use);
  check_inputs(ws.problem, act, dev, in, w, use,
               q != nullptr ? RoutedWeights::not_read : RoutedWeights::read);
  if (out) {
    check_view("out", *out, act, {ws.problem.num_tokens, ws.problem.hidden_size}, dev);
    if (dev.kind == DeviceKind::cuda) check_aligned_16("out", *out);
  }
  check_context(ws_, ctx);
  ctx.key = ContextKey{};
  // The CPU checks ids on the host; the GPU on the device (no host synchronization), and a bad
  // one from an earlier call is raised here, at the latest.
  if (ws.backend == Backend::cpu) check_expert_ids_host(ws.problem, in.topk_experts);
  ws.layer->check_errors(ws.stream);
  if (q != nullptr) {
    ws.layer->forward_fp8(in, w, *q, out, ctx, ws.stream);
  } else {
    ws.layer->forward(in, w, out, ctx, ws.stream);
  }
  ctx.key = key_of(in, w, q);
  if (recompute) {
    ctx.key.tensors[2] = nullptr;  // neither topk_weights nor the down weights are read
    ctx.key.tensors[5] = ctx.key.tensors[8] = nullptr;
    ++ws.calls.recompute;
  } else {
    ++ws.calls.forward;
  }
}

void run_backward(Workspace& ws_, const Inputs& in, const Weights& w, const Fp8Weights* q,
                  const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
                  const BackwardOptions& options) {
  Workspace::Impl& ws = ws_.impl();
  require_one_rank(ws, "backward");
  const DType act = ws.options.activation_dtype;
  const Device dev = device_of(ws);
  if (q != nullptr) {
    check_fp8_call(ws, *q, InputUse::forward);
    check_fp8_weight_grads(ws, options);
  }
  check_inputs(ws.problem, act, dev, in, w, InputUse::forward,
               q != nullptr ? RoutedWeights::not_read : RoutedWeights::read);
  check_view("d_out", d_out, act, {ws.problem.num_tokens, ws.problem.hidden_size}, dev);
  check_grads(ws.problem, act, dev, grads, options);
  if (dev.kind == DeviceKind::cuda) check_aligned_16("d_out", d_out);
  check_context(ws_, ctx);
  check_key(ctx.key, in, w, q);
  if (ws.backend == Backend::cpu) check_expert_ids_host(ws.problem, in.topk_experts);
  ws.layer->check_errors(ws.stream);
  if (q != nullptr) {
    ws.layer->backward_fp8(in, w, *q, ctx, d_out, grads, options, ws.stream);
  } else {
    ws.layer->backward(in, w, ctx, d_out, grads, options, ws.stream);
  }
  ++ws.calls.backward;
}

}  // namespace

void forward(Workspace& ws, const Inputs& in, const Weights& w, const TensorView& out,
             ForwardContext& ctx) {
  run_forward(ws, in, w, nullptr, &out, ctx);
}

void recompute_forward_context(Workspace& ws, const Inputs& in, const Weights& w,
                               ForwardContext& ctx) {
  run_forward(ws, in, w, nullptr, nullptr, ctx);
}

void backward(Workspace& ws, const Inputs& in, const Weights& w, const ForwardContext& ctx,
              const TensorView& d_out, const Grads& grads, const BackwardOptions& options) {
  run_backward(ws, in, w, nullptr, ctx, d_out, grads, options);
}

void forward(Workspace& ws, const Inputs& in, const Weights& w, const Fp8Weights& q,
             const TensorView& out, ForwardContext& ctx) {
  run_forward(ws, in, w, &q, &out, ctx);
}

void recompute_forward_context(Workspace& ws, const Inputs& in, const Weights& w,
                               const Fp8Weights& q, ForwardContext& ctx) {
  run_forward(ws, in, w, &q, nullptr, ctx);
}

void backward(Workspace& ws, const Inputs& in, const Weights& w, const Fp8Weights& q,
              const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
              const BackwardOptions& options) {
  run_backward(ws, in, w, &q, ctx, d_out, grads, options);
}

}  // namespace mok
