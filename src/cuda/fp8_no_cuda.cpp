// The FP8 quantization launches in a build without CUDA: each raises mok::Error saying so (the
// API reaches them only for views on a CUDA device).
#include "cuda/kernels/fp8_quantize.hpp"
#include "mok/error.hpp"

namespace mok::cuda {
namespace {
[[noreturn]] void no_cuda() {
  throw Error(
      "the FP8 quantization kernels need the CUDA backend (this build has no CUDA "
      "support)");
}
}  // namespace

void launch_quantize_rows_fp8(const fp8::ActivationParams&, int, void*) {
  no_cuda();
}
void launch_quantize_token_axis_fp8(const fp8::ActivationParams&, int, void*) {
  no_cuda();
}
void launch_quantize_weights_fp8(const fp8::WeightParams&, int, void*) {
  no_cuda();
}
void launch_mxfp8_quantize(const fp8::MxParams&, int, void*) {
  no_cuda();
}
void launch_mx_weights_to_blocks(const fp8::MxToBlocksParams&, int, void*) {
  no_cuda();
}

}  // namespace mok::cuda
