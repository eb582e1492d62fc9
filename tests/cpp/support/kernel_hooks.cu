// The hooked instantiations of the library's kernel templates (kernel_hooks.hpp).
#include "support/kernel_hooks.hpp"

#include "cuda/kernels/fused_forward.cuh"
#include "cuda/kernels/sm90_grouped_gemm.cuh"
#include "mok/error.hpp"

namespace mok::test {
namespace {

struct FusedTestHooks {
  static constexpr bool kTrace = true;
  static constexpr bool kWithhold = true;
};

}  // namespace

void launch_fused_forward_with_hooks(const cuda::FusedForwardParams& p, bool clamped,
                                     cudaStream_t stream) {
  if (clamped) {
    cuda::launch_fused_forward_kernel<true, FusedTestHooks>(p, stream);
  } else {
    cuda::launch_fused_forward_kernel<false, FusedTestHooks>(p, stream);
  }
}

void launch_rows_times_weight_stalled(const gemm::RowsTimesWeightArgs& args, int stall_block) {
  if (args.swiglu.d_gate != nullptr || args.out_fp32 || args.scatter.rows != nullptr) {
    throw Error("launch_rows_times_weight_stalled", "the plain bf16 dgrad", "another form");
  }
  using F = gemm::Form<gemm::FormKind::kRowsW>;
  const std::optional<gemm::GemmDescriptor> d = gemm::describe_rows_times_weight<F>(args);
  if (!d) return;
  gemm::launch_grouped_gemm_kernel<F, gemm::epilogue::RowsBf16<false, false>, true>(*d, args.stream,
                                                                                    stall_block);
}

void launch_weight_grad_stalled(const gemm::WeightGradArgs& args, int stall_block) {
  if (args.accumulate || args.continue_reduction || args.passes.steps != nullptr) {
    throw Error("launch_weight_grad_stalled", "a plain weight gradient (bf16 or fp32)",
                "accumulate, continue_reduction or a pass plan");
  }
  using F = gemm::Form<gemm::FormKind::kWeightGrad>;
  using gemm::epilogue::GradOut;
  using gemm::epilogue::WeightGrad;
  const std::optional<gemm::GemmDescriptor> d = gemm::describe_weight_grad<F>(args);
  if (args.out_fp32) {
    gemm::launch_grouped_gemm_kernel<F, WeightGrad<GradOut::fp32>, true>(*d, args.stream,
                                                                         stall_block);
  } else {
    gemm::launch_grouped_gemm_kernel<F, WeightGrad<GradOut::bf16>, true>(*d, args.stream,
                                                                         stall_block);
  }
}

}  // namespace mok::test
