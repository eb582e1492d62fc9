// `mok run --backend cuda` in a build without CUDA.
#include "mok/error.hpp"
#include "synthetic/synthetic_step.hpp"

namespace mok::cuda {

StepTimes run_synthetic_step(LayerData&, const Config&, int, int, int) {
  throw Error("the CUDA backend is not available (this build has no CUDA support)");
}

StepTimes run_synthetic_step_fp8(LayerData&, const Config&, const BackwardOptions&, int, int, int) {
  throw Error("the CUDA backend is not available (this build has no CUDA support)");
}

}  // namespace mok::cuda
