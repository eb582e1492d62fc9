// The CPU reference backend: the layer (out = shared(x) + sum_j w_j expert_j(x), SwiGLU experts)
// computed directly, expert by expert.
//
// Precision model (bf16 mode; f64 mode is the same with no rounding and f64 everywhere):
//   forward, per routed row (t, j) with expert e, and likewise for the shared expert (w = 1):
//     g = bf16(x W_gate[e]^T), u = bf16(x W_up[e]^T)      fp32 accumulation, kept as context
//     h = bf16(silu(g) * u)                                from the rounded g and u, kept
//       (with Weights::swiglu_limit L: h = bf16(silu(min(g, L)) * clamp(u, -L, L)), g and u kept
//       unclamped; numerics::swiglu_clamped)
//     y = bf16(h W_down[e]^T)                              the "combine" row
//     out[t] = bf16(s[t] + sum_j w[t,j] * y[t,j])          fp32, fma, increasing j; s =
//     bf16(shared)
//   backward (the shared expert: w = 1, no d_w):
//     dh_u = d_out[t] W_down[e]                            fp32 accumulation, not rounded
//     d_w[t,j] = <dh_u, h>                                 fp32, increasing i (= <d_out, y>
//                                                          before rounding; MoK's expert-side form)
//     dh = bf16(w[t,j] * dh_u)
//     dg, du = bf16(swiglu_backward(g, u, dh))           (clamped: swiglu_backward_clamped)
//     dx_row = bf16(dg W_gate[e] + du W_up[e])             one fp32 accumulator over gate then up
//     d_x[t] = bf16(ds_x[t] + sum_j dx_row[t,j])           fp32, increasing j
//     dy = bf16(w[t,j] * d_out[t])
//     dW_down[e] = dy^T h, dW_gate[e] = dg^T x, dW_up[e] = du^T x   fp32 over rows in schedule
//     order
//     (the CUDA backend, where I <= H, rounds the other factor of dW_down instead:
//     d_out^T bf16(w h), plan::scaled_hidden_in_backward; one rounding of the same product either
//     way, so the same precision, other bits)
// Every reduction runs in a fixed order, so results are bitwise reproducible and independent of
// the thread count.
//
// The forward context (ForwardContext, caller-owned) holds g, u, h per slot t*k + j (rows
// [T*k, I], slots of other ranks' experts and unused slots left as they are) and the shared
// expert's g, u, h [T, S]; x_routed has no rows: backward gathers x again. With host expert
// parallelism (W ranks) the routed rows are one per gathered slot of every rank: [W*T*k, I].
#pragma once

#include "core/thread_pool.hpp"
#include "mok/api.hpp"

namespace mok::reference {

struct State {
  explicit State(DType act, int num_threads) : act(act), pool(num_threads) {}
  DType act;
  ThreadPool pool;
  std::size_t bytes() const { return 0; }  // nothing kept between calls
};

// `out` may be null (recompute_forward_context: the context only). `fp8` (bf16 mode only): the
// FP8 layer, its routed GEMMs on quantized operands (fp8_layer.hpp; docs/architecture.md, "The
// FP8 layer"); w's routed views are then not read. Null: the bf16 (or f64) layer.
void forward(State& st, const Problem& p, const Inputs& in, const Weights& w, const TensorView* out,
             const ForwardContext& ctx, const Fp8Weights* fp8 = nullptr);
void backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
              const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
              const BackwardOptions& options, const Fp8Weights* fp8 = nullptr);

// Host expert parallelism (include/mok/host_ep.hpp), `p` of rank p.ep_rank of p.ep_size: the
// pieces above over every rank's gathered inputs (expert side) and this rank's own (home side),
// with the exchange rows of core/host_ep_layout.hpp. The expert side writes the context's routed
// rows (one per gathered slot) and the local experts' weight gradients; the home side the shared
// expert's context rows and gradients, out, d_x and d_topk_weights. `combine_send` null: the
// context only (recompute); `out` null likewise (then `combine_received` is not read).
void ep_expert_forward(State& st, const Problem& p, const Inputs& gathered, const Weights& w,
                       const TensorView* combine_send, const ForwardContext& ctx,
                       const Fp8Weights* fp8 = nullptr);
void ep_home_forward(State& st, const Problem& p, const Inputs& in, const Weights& w,
                     const TensorView* combine_received, const TensorView* out,
                     const ForwardContext& ctx);
void ep_expert_backward(State& st, const Problem& p, const Inputs& gathered, const Weights& w,
                        const ForwardContext& ctx, const TensorView& d_out_all,
                        const TensorView& dx_send, const TensorView& dw_send, const Grads& grads,
                        const BackwardOptions& options, const Fp8Weights* fp8 = nullptr);
void ep_home_backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
                      const ForwardContext& ctx, const TensorView& d_out,
                      const TensorView& dx_received, const TensorView& dw_received,
                      const Grads& grads, const BackwardOptions& options);

}  // namespace mok::reference
