// The CLI's GPU step: synthetic host data through the CUDA backend, timed with CUDA events.
#include <algorithm>
#include <vector>

#include "core/workspace.hpp"
#include "cuda/comm/team.hpp"  // cuda_check
#include "mok/fp8.hpp"
#include "synthetic/device_layer.hpp"
#include "synthetic/synthetic_step.hpp"

namespace mok::cuda {
namespace {

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CUDA events, destroyed with it.
struct Events {
  explicit Events(int n) : marks(n) {
    for (auto& e : marks) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~Events() {
    for (auto& e : marks) cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  void record(int i) { cuda_check(cudaEventRecord(marks[i]), "cudaEventRecord"); }
  float ms(int from, int to) const {
    float t = 0;
    cudaEventElapsedTime(&t, marks[from], marks[to]);
    return t;
  }
  std::vector<cudaEvent_t> marks;
};

// `warmup` untimed steps, then `reps` timed ones (outputs poisoned before each): the median
// forward and backward milliseconds. Device-side errors of the steps (bad ids, timeouts) are
// raised before their outputs are trusted.
template <typename Forward, typename Backward>
StepTimes timed_steps(Workspace& ws, DeviceLayer& g, int warmup, int reps, Forward&& fwd,
                      Backward&& bwd) {
  Events ev(3);
  std::vector<float> f, b;
  for (int i = 0; i < warmup + reps; ++i) {
    g.poison();
    ev.record(0);
    fwd();
    ev.record(1);
    bwd();
    ev.record(2);
    cuda_check(cudaEventSynchronize(ev.marks[2]), "the layer step");
    if (i < warmup) continue;
    f.push_back(ev.ms(0, 1));
    b.push_back(ev.ms(1, 2));
  }
  ws.impl().layer->check_errors(nullptr);
  return {median(f), median(b)};
}

// Device memory of `bytes` bytes, freed with it.
class DeviceBytes {
 public:
  explicit DeviceBytes(std::size_t bytes) {
    cuda_check(cudaMalloc(&data_, bytes > 0 ? bytes : 16), "cudaMalloc of quantized weights");
  }
  ~DeviceBytes() { cudaFree(data_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

}  // namespace

StepTimes run_synthetic_step(LayerData& data, const Config& config, int device, int warmup,
                             int reps) {
  if (reps < 1) throw Error("reps", "at least 1", to_text(reps));
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  DeviceLayer g(data);
  Workspace ws(data.problem, config, {.backend = Backend::cuda, .device_index = device});
  DeviceContext ctx(ws);
  const StepTimes t = timed_steps(
      ws, g, warmup, reps, [&] { forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get()); },
      [&] { backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), g.grads()); });
  g.download(data);
  return t;
}

StepTimes run_synthetic_step_fp8(LayerData& data, const Config& config,
                                 const BackwardOptions& options, int device, int warmup, int reps) {
  if (reps < 1) throw Error("reps", "at least 1", to_text(reps));
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  const Problem& p = data.problem;
  // bf16 weight gradients need no token-axis copies (WorkspaceOptions::fp8_token_axis).
  Workspace ws(p, config,
               {.backend = Backend::cuda,
                .device_index = device,
                .fp8 = true,
                .fp8_token_axis = options.fp8_weight_grads});
  DeviceContext ctx(ws);
  DeviceLayer g(data);
  const std::int64_t E = p.num_local_experts(), H = p.hidden_size, I = p.intermediate_size;
  const QuantizedWeightsLayout gate_up = quantized_weights_layout(E, I, H);
  const QuantizedWeightsLayout down = quantized_weights_layout(E, H, I);
  DeviceBytes gate_bytes(gate_up.bytes), up_bytes(gate_up.bytes), down_bytes(down.bytes);
  const Device on{DeviceKind::cuda, device};
  const Fp8Weights q{quantized_weights_views(gate_up, gate_bytes.get(), on),
                     quantized_weights_views(gate_up, up_bytes.get(), on),
                     quantized_weights_views(down, down_bytes.get(), on)};
  // The weights' quantization, on the legacy default stream as the steps: timed on its own.
  Events ev(2);
  std::vector<float> quant;
  for (int i = 0; i < warmup + reps; ++i) {
    ev.record(0);
    quantize_weights(g.gate.view(), q.gate);
    quantize_weights(g.up.view(), q.up);
    quantize_weights(g.down.view(), q.down);
    ev.record(1);
    cuda_check(cudaEventSynchronize(ev.marks[1]), "the weights' quantization");
    if (i >= warmup) quant.push_back(ev.ms(0, 1));
  }
  StepTimes t = timed_steps(
      ws, g, warmup, reps,
      [&] { forward(ws, g.inputs(), g.weights(), q, g.out.view(), ctx.get()); },
      [&] {
        backward(ws, g.inputs(), g.weights(), q, ctx.get(), g.d_out.view(), g.grads(), options);
      });
  t.quant_ms = median(quant);
  g.download(data);
  return t;
}

}  // namespace mok::cuda
