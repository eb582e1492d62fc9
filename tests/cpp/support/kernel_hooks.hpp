// Test hooks for the library's kernels, compiled only here (tests/cpp/support): the kernels the
// library ships have none of their code (their instantiations are built without them).
//
//   launch_fused_forward_with_hooks: the forward megakernel honouring FusedForwardParams'
//     withhold_block (the rows of that block are never pulled) and trace (globaltimer stamps);
//     give it to cuda::Layer::set_forward_hooks as ForwardHooks::launcher (a cuda::FusedLauncher).
//   launch_*_stalled: one grouped GEMM launch whose CTA `stall_block` never loads its first K
//     block, so its Consumers wait until the launch's timeout and the launch gives up with a
//     report in args.waits.report.
#pragma once

#include <cuda_runtime.h>

#include "cuda/gemm/grouped_gemm.hpp"

namespace mok::cuda {
struct FusedForwardParams;  // cuda/kernels/fused_forward.hpp
}  // namespace mok::cuda

namespace mok::test {

void launch_fused_forward_with_hooks(const cuda::FusedForwardParams& p, bool clamped,
                                     cudaStream_t stream);

// The plain bf16 dgrad (no SwiGLU epilogue, no scatter, bf16 output).
void launch_rows_times_weight_stalled(const gemm::RowsTimesWeightArgs& args, int stall_block);
// A plain weight gradient, bf16 or fp32 (no accumulate, no pass plan, no continued reduction).
void launch_weight_grad_stalled(const gemm::WeightGradArgs& args, int stall_block);

}  // namespace mok::test
