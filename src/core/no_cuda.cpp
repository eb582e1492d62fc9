// The CUDA runtime facts for a build without CUDA: no devices.
#include "cuda/runtime.hpp"

namespace mok::cuda {

bool compiled() { return false; }
int device_count() { return 0; }
std::string device_summary(int) { return "this build of mok has no CUDA support"; }
std::string smoke_test(int) { return "this build of mok has no CUDA support"; }

}  // namespace mok::cuda
