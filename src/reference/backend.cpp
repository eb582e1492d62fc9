// The CPU reference as a Workspace backend (core/backend.hpp).
#include "core/backend.hpp"
#include "reference/reference.hpp"

namespace mok {
namespace {

class CpuLayer final : public LayerBackend {
 public:
  CpuLayer(const Problem& p, DType act, int num_threads) : problem_(p), state_(act, num_threads) {}

  void forward(const Inputs& in, const Weights& w, const TensorView* out, const ForwardContext& ctx,
               void*) override {
    reference::forward(state_, problem_, in, w, out, ctx);
  }
  void backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                const TensorView& d_out, const Grads& grads, const BackwardOptions& options,
                void*) override {
    reference::backward(state_, problem_, in, w, ctx, d_out, grads, options);
  }
  void forward_fp8(const Inputs& in, const Weights& w, const Fp8Weights& q, const TensorView* out,
                   const ForwardContext& ctx, void*) override {
    reference::forward(state_, problem_, in, w, out, ctx, &q);
  }
  void backward_fp8(const Inputs& in, const Weights& w, const Fp8Weights& q,
                    const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
                    const BackwardOptions& options, void*) override {
    reference::backward(state_, problem_, in, w, ctx, d_out, grads, options, &q);
  }
  void ep_expert_forward_fp8(const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                             const TensorView* combine_send, const ForwardContext& ctx) override {
    reference::ep_expert_forward(state_, problem_, gathered, w, combine_send, ctx, &q);
  }
  void ep_expert_backward_fp8(const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                              const ForwardContext& ctx, const TensorView& d_out_all,
                              const TensorView& dx_send, const TensorView& dw_send,
                              const Grads& grads, const BackwardOptions& options) override {
    reference::ep_expert_backward(state_, problem_, gathered, w, ctx, d_out_all, dx_send, dw_send,
                                  grads, options, &q);
  }
  void ep_expert_forward(const Inputs& gathered, const Weights& w, const TensorView* combine_send,
                         const ForwardContext& ctx) override {
    reference::ep_expert_forward(state_, problem_, gathered, w, combine_send, ctx);
  }
  void ep_home_forward(const Inputs& in, const Weights& w, const TensorView* combine_received,
                       const TensorView* out, const ForwardContext& ctx) override {
    reference::ep_home_forward(state_, problem_, in, w, combine_received, out, ctx);
  }
  void ep_expert_backward(const Inputs& gathered, const Weights& w, const ForwardContext& ctx,
                          const TensorView& d_out_all, const TensorView& dx_send,
                          const TensorView& dw_send, const Grads& grads,
                          const BackwardOptions& options) override {
    reference::ep_expert_backward(state_, problem_, gathered, w, ctx, d_out_all, dx_send, dw_send,
                                  grads, options);
  }
  void ep_home_backward(const Inputs& in, const Weights& w, const ForwardContext& ctx,
                        const TensorView& d_out, const TensorView& dx_received,
                        const TensorView& dw_received, const Grads& grads,
                        const BackwardOptions& options) override {
    reference::ep_home_backward(state_, problem_, in, w, ctx, d_out, dx_received, dw_received,
                                grads, options);
  }
  void check_errors(void*) override {}
  // One row per slot t*k + j of every rank of the EP group (reference.hpp).
  std::int64_t context_rows() const override {
    return std::int64_t{problem_.ep_size} * problem_.num_tokens * problem_.topk;
  }
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
