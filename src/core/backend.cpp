// The backend interface's defaults (backend.hpp): what a backend without host expert parallelism,
// or without the FP8 layer, says when asked for it.
#include "core/backend.hpp"

namespace mok {
namespace {

Error no_host_ep() {
  return Error("backend", "cpu (host expert parallelism runs on the CPU reference)",
               "a backend without it");
}

}  // namespace

Error fp8_layer_not_here() {
  return Error("backend", "cpu for the FP8 layer (Fp8Weights, precision=\"fp8\")",
               "cuda: the FP8 layer is not yet on the CUDA backend");
}

void LayerBackend::forward_fp8(const Inputs&, const Weights&, const Fp8Weights&, const TensorView*,
                               const ForwardContext&, void*) {
  throw fp8_layer_not_here();
}
void LayerBackend::backward_fp8(const Inputs&, const Weights&, const Fp8Weights&,
                                const ForwardContext&, const TensorView&, const Grads&,
                                const BackwardOptions&, void*) {
  throw fp8_layer_not_here();
}
void LayerBackend::ep_expert_forward_fp8(const Inputs&, const Weights&, const Fp8Weights&,
                                         const TensorView*, const ForwardContext&) {
  throw no_host_ep();
}
void LayerBackend::ep_expert_backward_fp8(const Inputs&, const Weights&, const Fp8Weights&,
                                          const ForwardContext&, const TensorView&,
                                          const TensorView&, const TensorView&, const Grads&,
                                          const BackwardOptions&) {
  throw no_host_ep();
}

void LayerBackend::ep_expert_forward(const Inputs&, const Weights&, const TensorView*,
                                     const ForwardContext&) {
  throw no_host_ep();
}
void LayerBackend::ep_home_forward(const Inputs&, const Weights&, const TensorView*,
                                   const TensorView*, const ForwardContext&) {
  throw no_host_ep();
}
void LayerBackend::ep_expert_backward(const Inputs&, const Weights&, const ForwardContext&,
                                      const TensorView&, const TensorView&, const TensorView&,
                                      const Grads&, const BackwardOptions&) {
  throw no_host_ep();
}
void LayerBackend::ep_home_backward(const Inputs&, const Weights&, const ForwardContext&,
                                    const TensorView&, const TensorView&, const TensorView&,
                                    const Grads&, const BackwardOptions&) {
  throw no_host_ep();
}

}  // namespace mok
