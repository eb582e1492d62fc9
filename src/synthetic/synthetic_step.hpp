// `mok run --backend cuda`: one step of the layer on the GPU over synthetic host data. Uploads
// `data`, runs `warmup` untimed steps, then `reps` steps timed with CUDA events (median forward
// and backward milliseconds), and copies the last step's outputs back into `data` for the check.
// A build without CUDA throws.
#pragma once

#include "mok/api.hpp"
#include "synthetic/synthetic.hpp"

namespace mok::cuda {

struct StepTimes {
  double fwd_ms = 0, bwd_ms = 0;
  double quant_ms = 0;  // the FP8 step: quantizing the routed weights (median of `reps`)
};
StepTimes run_synthetic_step(LayerData& data, const Config& config, int device, int warmup,
                             int reps);

// The same for the FP8 layer (api.hpp, Fp8Weights): the routed weights are quantized on the device
// (mok::quantize_weights, as a training step quantizes them once per weight version), timed on
// their own, `warmup` + `reps` times; then the steps, on a workspace made with
// WorkspaceOptions::fp8, read the quantized weights. `options` goes to every step's backward
// (fp8_weight_grads false: bf16 routed weight gradients, `mok run --precision fp8-bf16-wgrad`).
StepTimes run_synthetic_step_fp8(LayerData& data, const Config& config,
                                 const BackwardOptions& options, int device, int warmup, int reps);

}  // namespace mok::cuda
