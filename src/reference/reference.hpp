// The CPU reference backend: DESIGN.md section 1 computed directly, expert by expert.
//
// Precision model (bf16 mode; f64 mode is the same with no rounding and f64 everywhere):
//   forward, per routed row (t, j) with expert e, and likewise for the shared expert (w = 1):
//     g = bf16(x W_gate[e]^T), u = bf16(x W_up[e]^T)      fp32 accumulation, kept as context
//     h = bf16(silu(g) * u)                                from the rounded g and u
//     y = bf16(h W_down[e]^T)                              kept as context (the "combine" row)
//     out[t] = bf16(s[t] + sum_j w[t,j] * y[t,j])          fp32, fma, increasing j; s =
//     bf16(shared)
//   backward:
//     dy = bf16(w[t,j] * d_out[t]);  dh = dy W_down[e]     fp32 accumulation
//     dg, du = bf16(swiglu_backward(g, u, dh))
//     dx_row = bf16(dg W_gate[e] + du W_up[e])             one fp32 accumulator over gate then up
//     d_x[t] = bf16(ds_x[t] + sum_j dx_row[t,j])           fp32, increasing j
//     d_w[t,j] = <d_out[t], y[t,j]>                        fp32, increasing h
//     dW_down[e] = dy^T h, dW_gate[e] = dg^T x, dW_up[e] = du^T x   fp32 over rows in schedule
//     order
// Every reduction runs in a fixed order, so results are bitwise reproducible and independent of
// the thread count.
#pragma once

#include <memory>
#include <vector>

#include "core/thread_pool.hpp"
#include "mok/api.hpp"

namespace mok::reference {

template <typename Real>
struct Context {
  std::vector<Real> gate, up;                // [T*k, I]: rounded pre-activations per slot
  std::vector<Real> y;                       // [T*k, H]: expert output per slot
  std::vector<Real> shared_gate, shared_up;  // [T, S]
  void allocate(const Problem& p);
  std::size_t bytes() const;
};

struct State {
  explicit State(const Problem& p, DType act, int num_threads);
  DType act;
  ThreadPool pool;
  Context<float> f32;   // bf16 mode
  Context<double> f64;  // f64 mode
  std::size_t bytes() const { return f32.bytes() + f64.bytes(); }
};

// `out` may be null (recompute_forward_context).
void forward(State& st, const Problem& p, const Inputs& in, const Weights& w,
             const TensorView* out);
void backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
              const TensorView& d_out, const Grads& grads, const BackwardOptions& options);

}  // namespace mok::reference
