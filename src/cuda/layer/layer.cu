// mok::cuda::Layer: the single-GPU layer (one rank) on the unfused path.
#include <array>

#include "cuda/layer/unfused_layer.hpp"
#include "cuda/runtime.hpp"

namespace mok::cuda {
namespace {

class UnfusedSingleRank final : public Layer {
 public:
  UnfusedSingleRank(const Problem& p, const Config& c, int device) : layer_(p, c, device) {}

  void forward(const Inputs& in, const Weights& w, const TensorView* out, void* stream) override {
    const std::array<RankTensors, 1> ranks{RankTensors{in, w, out ? *out : TensorView{}, {}, {}}};
    layer_.forward(ranks, out != nullptr, static_cast<cudaStream_t>(stream));
  }
  void backward(const Inputs& in, const Weights& w, const TensorView& d_out, const Grads& grads,
                const BackwardOptions& options, void* stream) override {
    const std::array<RankTensors, 1> ranks{RankTensors{in, w, {}, d_out, grads}};
    layer_.backward(ranks, options, static_cast<cudaStream_t>(stream));
  }
  void check_errors() override { layer_.check_errors(); }
  std::size_t bytes() const override { return layer_.bytes(); }

 private:
  UnfusedLayer layer_;
};

}  // namespace

bool layer_available() {
  return true;
}

std::unique_ptr<Layer> make_layer(const Problem& p, const Config& config, int device) {
  return std::make_unique<UnfusedSingleRank>(p, config, device);
}

}  // namespace mok::cuda
