// The backend interface: the API layer validates every call (src/api/api.cpp), then hands it to the
// Workspace's backend. The CPU reference (src/reference/backend.cpp) and the CUDA layer
// (src/cuda/layer/backend.cu) implement it; core includes neither. Internal: users see
// mok::Workspace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mok/api.hpp"

namespace mok {

class LayerBackend {
 public:
  virtual ~LayerBackend() = default;
  // Inputs, weights and the context are validated. `out` null: recompute_forward_context (the
  // context only). `stream`: the cudaStream_t of the call (CUDA), ignored by the CPU.
  virtual void forward(const Inputs& in, const Weights& w, const TensorView* out,
                       const ForwardContext& ctx, void* stream) = 0;
  virtual void backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                        const TensorView& d_out, const Grads& grads, const BackwardOptions& options,
                        void* stream) = 0;
  // The FP8 layer (api.hpp, Fp8Weights; validated likewise): the routed GEMMs on `q`, `w`'s routed
  // views not read.
  virtual void forward_fp8(const Inputs& in, const Weights& w, const Fp8Weights& q,
                           const TensorView* out, const ForwardContext& ctx, void* stream) = 0;
  virtual void backward_fp8(const Inputs& in, const Weights& w, const Fp8Weights& q,
                            const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
                            const BackwardOptions& options, void* stream) = 0;
  // Raises the errors a device found since the last call (bad expert ids, timed-out waits); the
  // device-side clear is ordered on `stream`. The CPU checks before it computes: nothing to raise.
  virtual void check_errors(void* stream) = 0;
  virtual std::int64_t context_rows() const = 0;  // rows of the forward context's routed tensors
  virtual std::size_t bytes() const = 0;          // device memory the backend holds
  virtual int num_threads() const = 0;            // CPU threads (0: not a CPU backend)

  // Host expert parallelism (include/mok/host_ep.hpp; validated by src/api/host_ep.cpp): the
  // expert and home halves of a call whose rows the caller moves between processes. Only the
  // CPU reference has them; the defaults say so.
  virtual void ep_expert_forward(const Inputs& gathered, const Weights& w,
                                 const TensorView* combine_send, const ForwardContext& ctx);
  virtual void ep_home_forward(const Inputs& in, const Weights& w,
                               const TensorView* combine_received, const TensorView* out,
                               const ForwardContext& ctx);
  virtual void ep_expert_backward(const Inputs& gathered, const Weights& w,
                                  const ForwardContext& ctx, const TensorView& d_out_all,
                                  const TensorView& dx_send, const TensorView& dw_send,
                                  const Grads& grads, const BackwardOptions& options);
  virtual void ep_home_backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                                const TensorView& d_out, const TensorView& dx_received,
                                const TensorView& dw_received, const Grads& grads,
                                const BackwardOptions& options);
  // The expert halves of the FP8 layer's (the home halves are the bf16 layer's).
  virtual void ep_expert_forward_fp8(const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                                     const TensorView* combine_send, const ForwardContext& ctx);
  virtual void ep_expert_backward_fp8(const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                                      const ForwardContext& ctx, const TensorView& d_out_all,
                                      const TensorView& dx_send, const TensorView& dw_send,
                                      const Grads& grads, const BackwardOptions& options);
};

// The CPU reference: `act` bf16 (the GPU's precision model) or f64 (exact); `num_threads` 0: all.
std::unique_ptr<LayerBackend> make_cpu_backend(const Problem& p, DType act, int num_threads);

// The CUDA layer on `device`: the whole layer (ep_size 1), or with `symmetric_bases` (ep_size
// entries) rank p.ep_rank of a team across processes. A build without CUDA throws
// (src/cuda/no_cuda.cpp).
// `fp8`: with the FP8 layer's scratch (WorkspaceOptions::fp8); `fp8_token_axis`: and its
// token-axis copies (WorkspaceOptions::fp8_token_axis).
std::unique_ptr<LayerBackend> make_cuda_backend(const Problem& p, const Config& config, int device,
                                                const std::vector<void*>& symmetric_bases = {},
                                                std::uint64_t barrier_timeout_ms = 10000,
                                                bool fp8 = false, bool fp8_token_axis = true);

// The CUDA runtime facts core and the CLI need, in every build (src/cuda/runtime.cu, or
// src/cuda/no_cuda.cpp without CUDA).
namespace cuda {
bool compiled();                        // this build has the CUDA backend's sources
int device_count();                     // 0 when not compiled or no device
std::string device_summary(int index);  // "NVIDIA H200, sm_90, 132 SMs" or the reason it failed
// Launches one small kernel on `index` and checks its result: the GPU smoke test. Returns an
// empty string on success, else what went wrong.
std::string smoke_test(int index);
bool layer_available();  // the CUDA layer kernels are part of this build
}  // namespace cuda

}  // namespace mok
