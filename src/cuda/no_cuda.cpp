// The CUDA runtime facts for a build without CUDA: no devices.
#include "core/backend.hpp"
#include "core/gemm_ops.hpp"
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

}  // namespace mok::cuda

namespace mok {

std::unique_ptr<LayerBackend> make_cuda_backend(const Problem&, const Config&, int,
                                                const std::vector<void*>&, std::uint64_t, bool,
                                                bool) {
  throw Error("the CUDA backend is not available (this build has no CUDA support)");
}

}  // namespace mok

namespace mok::gemm_ops {

namespace {
[[noreturn]] void no_cuda() {
  throw Error("the grouped GEMM forms need the CUDA backend (this build has no CUDA support)");
}
}  // namespace

void gate_up(const TensorView&, const TensorView&, const TensorView&, const Groups&,
             const TensorView&, const TensorView&, const TensorView&, void*) {
  no_cuda();
}
void rows_times_weight_t(const TensorView&, const TensorView&, const Groups&, const TensorView&,
                         const TensorView&, void*) {
  no_cuda();
}
void rows_times_weight(const TensorView&, const TensorView&, const Groups&, const TensorView&,
                       void*) {
  no_cuda();
}
void weight_grad(const TensorView&, const TensorView&, const Groups&, const TensorView&,
                 const TensorView&, bool, void*) {
  no_cuda();
}

}  // namespace mok::gemm_ops
