// The backend interface's defaults (backend.hpp): what a backend without host expert parallelism
// says when asked for it.
#include "core/backend.hpp"

namespace mok {
namespace {

Error no_host_ep() {
  return Error("backend", "cpu (host expert parallelism runs on the CPU reference)",
               "a backend without it");
}

}  // namespace

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
