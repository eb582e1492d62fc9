// Between the host launchers (launch.cu: argument checks, tensor maps, descriptors, timeout
// reports) and the kernel files (kernels/sm90_*_gemm.cu, over the kernel template of
// kernels/sm90_grouped_gemm.cuh), which instantiate the kernel for the (form, epilogue) pairs
// the launchers pick.
#pragma once

#include <cuda_runtime.h>

#include <optional>

#include "cuda/gemm/descriptor.cuh"
#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/forms.cuh"

namespace mok::gemm {

// Devices whose launcher state is cached (kernel attributes, timeout reports); a device past them
// still runs, setting its kernel attribute at every launch and without a timeout report.
inline constexpr int kMaxDevices = 64;

// The current CUDA device (throws mok::Error when it cannot be queried).
int current_device();

// Launches the persistent grouped GEMM kernel of form F with epilogue E over `d` (one CTA per SM
// of the current device) on `stream`; `fp8`: the e4m3 forms' scales. Throws mok::Error when the
// launch fails. Instantiated for the lists in the kernel files (bf16: sm90_bf16_grouped_gemm.cu;
// e4m3: sm90_fp8_grouped_gemm.cu, sm90_fp8_input_grad_gemm.cu, sm90_fp8_weight_grad_gemm.cu); the
// launchers call no other.
template <class F, class E>
void launch_grouped_gemm(const GemmDescriptor& d, cudaStream_t stream, const Fp8Params& fp8 = {});

// One GEMM's descriptor, checked and built as its launcher does it, for a kernel that runs the
// GEMM itself (the forward megakernel's task loop, kernels/fused_forward.cuh, whose descriptors
// layer.cu's fused_pass builds; the stall kernels of tests/cpp/support/kernel_hooks.cu); nullopt
// when the segments hold no rows (capacity 0). Instantiated for every form.
template <class F>
std::optional<GemmDescriptor> describe_gate_up_forward(const GateUpForwardArgs& args);
template <class F>
std::optional<GemmDescriptor> describe_rows_times_weight_t(const RowsTimesWeightTArgs& args);
template <class F>
std::optional<GemmDescriptor> describe_rows_times_weight(const RowsTimesWeightArgs& args);
// The K-grouped forms always have a descriptor (an empty reduction still writes its zeros).
template <class F>
std::optional<GemmDescriptor> describe_weight_grad(const WeightGradArgs& args);

}  // namespace mok::gemm
