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
};
StepTimes run_synthetic_step(LayerData& data, const Config& config, int device, int warmup,
                             int reps);

}  // namespace mok::cuda
