// The CUDA runtime facts for a build without CUDA: no devices.
#include "cuda/runtime.hpp"
#include "mok/error.hpp"

namespace mok::cuda {

bool compiled() {
  return false;
}
int device_count() {
  return 0;
}
std::string device_summary(int) {
  return "this build of mok has no CUDA support";
}
std::string smoke_test(int) {
  return "this build of mok has no CUDA support";
}
bool layer_available() {
  return false;
}
StepTimes run_synthetic_step(LayerData&, const Config&, int, int, int) {
  throw Error("the CUDA backend is not available (this build has no CUDA support)");
}
std::unique_ptr<Layer> make_layer(const Problem&, const Config&, int) {
  throw Error("the CUDA backend is not available (this build has no CUDA support)");
}

}  // namespace mok::cuda
