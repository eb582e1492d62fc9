// The public entry points: validate, then hand over to the backend.
#include "mok/api.hpp"

#include "core/validate.hpp"
#include "core/workspace.hpp"
#include "cuda/runtime.hpp"

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
  if (problem.ep_size != 1) {
    throw Error("ep_size",
                "1 for a Workspace (it computes one whole layer; expert parallelism runs through "
                "mok::Team)",
                to_text(problem.ep_size));
  }
  impl_->problem = problem;
  impl_->config = config;
  impl_->options = options;
  impl_->backend = backend;
  if (backend == Backend::cpu) {
    impl_->cpu =
        std::make_unique<reference::State>(problem, options.activation_dtype, options.num_threads);
  } else {
    impl_->gpu = cuda::make_layer(problem, config, options.device_index);
  }
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
  return impl_->cpu ? impl_->cpu->pool.size() : 0;
}
std::size_t Workspace::bytes() const {
  return impl_->cpu ? impl_->cpu->bytes() : impl_->gpu->bytes();
}
void Workspace::set_stream(void* stream) {
  impl_->stream = stream;
}
Workspace::Impl& Workspace::impl() {
  return *impl_;
}

static Device device_of(const Workspace::Impl& ws) {
  return ws.backend == Backend::cpu ? Device{DeviceKind::cpu, 0}
                                    : Device{DeviceKind::cuda, ws.options.device_index};
}

static Workspace::Impl::ContextKey key_of(const Inputs& in, const Weights& w) {
  return {in.x.data, in.topk_experts.data, w.gate.data};
}

static void run_forward(Workspace::Impl& ws, const Inputs& in, const Weights& w,
                        const TensorView* out) {
  const DType act = ws.options.activation_dtype;
  check_inputs(ws.problem, act, device_of(ws), in, w);
  if (out)
    check_view("out", *out, act, {ws.problem.num_tokens, ws.problem.hidden_size}, device_of(ws));
  ws.has_context = false;
  if (ws.cpu) {
    check_expert_ids_host(ws.problem, in.topk_experts);
    reference::forward(*ws.cpu, ws.problem, in, w, out);
  } else {
    // Ids are checked on the device (no host synchronization); a bad one from an earlier call
    // is raised here, at the latest.
    ws.gpu->check_errors();
    ws.gpu->forward(in, w, out, ws.stream);
  }
  ws.has_context = true;
  ws.context_key = key_of(in, w);
}

void forward(Workspace& ws, const Inputs& in, const Weights& w, const TensorView& out) {
  run_forward(ws.impl(), in, w, &out);
}

void recompute_forward_context(Workspace& ws, const Inputs& in, const Weights& w) {
  run_forward(ws.impl(), in, w, nullptr);
}

void backward(Workspace& ws_, const Inputs& in, const Weights& w, const TensorView& d_out,
              const Grads& grads, const BackwardOptions& options) {
  Workspace::Impl& ws = ws_.impl();
  const DType act = ws.options.activation_dtype;
  check_inputs(ws.problem, act, device_of(ws), in, w);
  check_view("d_out", d_out, act, {ws.problem.num_tokens, ws.problem.hidden_size}, device_of(ws));
  check_grads(ws.problem, act, device_of(ws), grads, options);
  if (ws.cpu) check_expert_ids_host(ws.problem, in.topk_experts);
  if (!ws.has_context || !(ws.context_key == key_of(in, w))) {
    throw Error("forward context",
                "the context of a forward (or recompute_forward_context) over these x, "
                "topk_experts and weights",
                ws.has_context ? "a context from other tensors" : "no forward run yet");
  }
  if (ws.cpu) {
    reference::backward(*ws.cpu, ws.problem, in, w, d_out, grads, options);
  } else {
    ws.gpu->check_errors();
    ws.gpu->backward(in, w, d_out, grads, options, ws.stream);
  }
}

}  // namespace mok
