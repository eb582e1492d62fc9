// The whole layer on the GPU as a sequence of launches (the unfused path, DESIGN.md sections 1-3):
// schedule -> per ring pass: dispatch, gate/up + SwiGLU GEMM, down GEMM whose epilogue is the
// combine (rows stored into their home slots) -> home reduction; backward: dispatch of d_out, down
// dgrad, SwiGLU backward, gate/up dgrad whose epilogue is the combine of d_x, the three routed
// weight gradients; the shared expert through the dense forms.
//
// It runs every rank of a local virtual team (W ranks on one GPU, DESIGN.md section 8); W = 1 is
// the single-GPU layer behind mok::forward / mok::backward. Launches only enqueue work on the given
// stream: no host synchronization, no allocation after construction, so a whole step can be
// captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>

#include "mok/api.hpp"

namespace mok::cuda {

// One rank's tensors for a call (CUDA views; `out`, `d_out` and `grads` only where the call uses
// them). `ctx` is the rank's forward context: forward writes it, backward reads it.
struct RankTensors {
  Inputs in;
  Weights w;
  TensorView out;
  TensorView d_out;
  Grads grads;
  ForwardContext ctx;
};

class UnfusedLayer {
 public:
  // `p.ep_size` ranks, all in this process on `device`.
  UnfusedLayer(const Problem& p, const Config& config, int device);
  ~UnfusedLayer();
  UnfusedLayer(const UnfusedLayer&) = delete;
  UnfusedLayer& operator=(const UnfusedLayer&) = delete;

  // Every rank's forward (`write_output` false: recompute_forward_context, which writes the same
  // context, the first ring pass's gate/up only, without the down projection or `out`).
  void forward(std::span<const RankTensors> ranks, bool write_output, cudaStream_t stream);
  void backward(std::span<const RankTensors> ranks, const BackwardOptions& options,
                cudaStream_t stream);

  // Raises a device-side error (a bad expert id, a timed-out wait) reported so far; the
  // device-side clear of the record is ordered on `stream`.
  void check_errors(cudaStream_t stream = nullptr);

  std::int64_t ring_rows() const;  // rows of a pass: the forward context's routed rows
  int max_passes() const;
  std::size_t bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok::cuda
