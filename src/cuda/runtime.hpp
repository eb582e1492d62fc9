// The few CUDA runtime facts the host side needs, available whether or not CUDA is compiled in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mok/api.hpp"
#include "reference/synthetic.hpp"

namespace mok::cuda {

bool compiled();                        // this build has the CUDA backend's sources
int device_count();                     // 0 when not compiled or no device
std::string device_summary(int index);  // "NVIDIA H200, sm_90, 132 SMs" or the reason it failed

// Launches one small kernel on `index` and checks its result: the GPU smoke test.
// Returns an empty string on success, else what went wrong.
std::string smoke_test(int index);

// The CUDA layer behind mok::forward / mok::backward for one GPU (ep_size 1). Defined with the
// CUDA sources; a build without CUDA cannot make one.
class Layer {
 public:
  virtual ~Layer() = default;
  // `out` null: recompute_forward_context (the context only).
  virtual void forward(const Inputs& in, const Weights& w, const TensorView* out,
                       const ForwardContext& ctx, void* stream) = 0;
  virtual void backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                        const TensorView& d_out, const Grads& grads,
                        const BackwardOptions& options, void* stream) = 0;
  // Raises the device-side errors reported so far (bad expert ids, timed-out waits); the
  // device-side clear is ordered on `stream`.
  virtual void check_errors(void* stream) = 0;
  virtual std::int64_t context_rows() const = 0;  // rows of the forward context's routed tensors
  virtual std::size_t bytes() const = 0;
};
std::unique_ptr<Layer> make_layer(const Problem& p, const Config& config, int device);

// Whether the CUDA layer kernels are part of this build.
bool layer_available();

// `mok run --backend cuda`: the step on the GPU. Uploads `data`, runs `warmup` untimed steps, then
// `reps` steps timed with CUDA events (median forward and backward milliseconds), and copies the
// last step's outputs back into `data` for the check.
struct StepTimes {
  double fwd_ms = 0, bwd_ms = 0;
};
StepTimes run_synthetic_step(LayerData& data, const Config& config, int device, int warmup,
                             int reps);

}  // namespace mok::cuda
