// The forward megakernel as the library launches it: the kernel of fused_forward.cuh without
// test hooks.
#include "cuda/kernels/fused_forward.cuh"

namespace mok::cuda {

void launch_fused_forward(const FusedForwardParams& p, bool clamped, cudaStream_t stream) {
  if (p.trace != nullptr || p.withhold_block >= 0) {
    throw Error("forward megakernel: test hooks (trace, withheld block)",
                "a launcher built with them (tests/cpp, ForwardHooks::launcher)",
                "the library's launcher, built without them");
  }
  if (clamped) {
    launch_fused_forward_kernel<true, FusedNoHooks>(p, stream);
  } else {
    launch_fused_forward_kernel<false, FusedNoHooks>(p, stream);
  }
}

}  // namespace mok::cuda
