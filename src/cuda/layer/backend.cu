// The CUDA layer as a Workspace backend (core/backend.hpp): one GPU running one rank (the whole
// layer at ep_size 1, or one rank of a team across processes), the unfused path.
#include <array>

#include "core/backend.hpp"
#include "cuda/layer/layer.hpp"

namespace mok::cuda {
namespace {

class SingleRank final : public LayerBackend {
 public:
  SingleRank(const Problem& p, const Config& c, int device, const ExternalRank& external, bool fp8,
             bool fp8_token_axis)
      : layer_(p, c, device, external, fp8, fp8_token_axis) {}

  void forward(const Inputs& in, const Weights& w, const TensorView* out, const ForwardContext& ctx,
               void* stream) override {
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
  void forward_fp8(const Inputs& in, const Weights& w, const Fp8Weights& q, const TensorView* out,
                   const ForwardContext& ctx, void* stream) override {
    RankTensors t{in, w, out ? *out : TensorView{}, {}, {}, ctx};
    t.q = &q;
    layer_.forward({&t, 1}, out != nullptr, static_cast<cudaStream_t>(stream));
  }
  void backward_fp8(const Inputs& in, const Weights& w, const Fp8Weights& q,
                    const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
                    const BackwardOptions& options, void* stream) override {
    RankTensors t{in, w, {}, d_out, grads, ctx};
    t.q = &q;
    layer_.backward({&t, 1}, options, static_cast<cudaStream_t>(stream));
  }
  void check_errors(void* stream) override {
    layer_.check_errors(static_cast<cudaStream_t>(stream));
  }
  std::int64_t context_rows() const override { return layer_.ring_rows(); }
  std::size_t bytes() const override { return layer_.bytes(); }
  int num_threads() const override { return 0; }

 private:
  Layer layer_;
};

}  // namespace

bool layer_available() {
  return true;
}

}  // namespace mok::cuda

namespace mok {

std::unique_ptr<LayerBackend> make_cuda_backend(const Problem& p, const Config& config, int device,
                                                const std::vector<void*>& symmetric_bases,
                                                std::uint64_t barrier_timeout_ms, bool fp8,
                                                bool fp8_token_axis) {
  return std::make_unique<cuda::SingleRank>(
      p, config, device, cuda::ExternalRank{symmetric_bases, barrier_timeout_ms}, fp8,
      fp8_token_axis);
}

}  // namespace mok
