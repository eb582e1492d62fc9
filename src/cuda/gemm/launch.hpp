// Between the host launchers (launch.cu: argument checks, tensor maps, descriptors, environment
// overrides, timeout reports) and the kernel file (kernels/sm90_bf16_grouped_gemm.cu), which
// instantiates the kernel for the (form, epilogue) pairs the launchers pick.
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

// Launches the persistent grouped GEMM kernel of Form<kKind, ping_pong> with epilogue E over `d`
// (one CTA per SM of the current device) on `stream`. Throws mok::Error when the launch fails.
// Instantiated for the list in the kernel file; the launchers call no other.
template <FormKind kKind, class E>
void launch_grouped_gemm(const GemmDescriptor& d, bool ping_pong, cudaStream_t stream);

// One GEMM's descriptor, checked and built as its launcher does it, for a kernel that runs the
// GEMM inside a task loop of its own (kernels/fused_forward.cu); nullopt when the segments hold no
// rows (capacity 0). Instantiated for the cooperative forms, Form<kind, false>, only.
template <class F>
std::optional<GemmDescriptor> describe_gate_up_forward(const GateUpForwardArgs& args);
template <class F>
std::optional<GemmDescriptor> describe_rows_times_weight_t(const RowsTimesWeightTArgs& args);

}  // namespace mok::gemm
