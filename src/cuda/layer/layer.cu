// mok::cuda::Layer: the single-GPU layer (one rank) on the unfused path.
#include <array>

#include "cuda/layer/unfused_layer.hpp"
#include "cuda/runtime.hpp"

namespace mok::cuda {
namespace {

class UnfusedSingleRank final : public Layer {
 public:
  UnfusedSingleRank(const Problem& p, const Config& c, int device) : layer_(p, c, device) {}

  void forward(const Inputs& in, const Weights& w, const TensorView* out,
               const ForwardContext& ctx, void* stream) override {
    const std::array<RankTensors, 1> ranks{
        RankTensors{in, w, out ? *out : TensorView{}, {}, {}, ctx}};
    layer_.forward(ranks, out != nullptr, static_cast<cudaStream_t>(stream));
  }
  void backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                const TensorView& d_out, const Grads& grads, const BackwardOptions& options,
                void* stream) override {
    const std::array<RankTensors, 1> ranks{RankTensors{in, w, {}, d_out, grads, ctx}};
    layer_.backward(ranks, options, static_cast<cudaStream_t>(stream));
  }
  void check_errors(void* stream) override {
    layer_.check_errors(static_cast<cudaStream_t>(stream));
  }
  std::int64_t context_rows() const override { return layer_.ring_rows(); }
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
