// The CPU reference as a Workspace backend (core/backend.hpp).
#include "core/backend.hpp"
#include "reference/reference.hpp"

namespace mok {
namespace {

class CpuLayer final : public LayerBackend {
 public:
  CpuLayer(const Problem& p, DType act, int num_threads) : problem_(p), state_(act, num_threads) {}

  void forward(const Inputs& in, const Weights& w, const TensorView* out,
               const ForwardContext& ctx, void*) override {
    reference::forward(state_, problem_, in, w, out, ctx);
  }
  void backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                const TensorView& d_out, const Grads& grads, const BackwardOptions& options,
                void*) override {
    reference::backward(state_, problem_, in, w, ctx, d_out, grads, options);
  }
  void check_errors(void*) override {}
  // One row per slot t*k + j (reference.hpp).
  std::int64_t context_rows() const override { return problem_.num_tokens * problem_.topk; }
  std::size_t bytes() const override { return state_.bytes(); }
  int num_threads() const override { return state_.pool.size(); }

 private:
  Problem problem_;
  reference::State state_;
};

}  // namespace

std::unique_ptr<LayerBackend> make_cpu_backend(const Problem& p, DType act, int num_threads) {
  return std::make_unique<CpuLayer>(p, act, num_threads);
}

}  // namespace mok
