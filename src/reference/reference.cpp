#include "reference/reference.hpp"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/bf16.hpp"
#include "core/numerics.hpp"
#include "reference/cpu_gemm.hpp"

namespace mok::reference {
namespace {

// bf16 mode computes in float and rounds where a bf16 tensor would be stored; f64 mode never
// rounds.
template <typename Real>
Real store_round(Real v) {
  if constexpr (std::is_same_v<Real, float>) {
    return round_to_bf16(v);
  } else {
    return v;
  }
}

template <typename Real>
Real load(const TensorView& v, std::int64_t i) {
  switch (v.dtype) {
    case DType::bf16:
      return static_cast<Real>(bf16_to_float(v.ptr<const bf16_t>()[i]));
    case DType::f32:
      return static_cast<Real>(v.ptr<const float>()[i]);
    case DType::f64:
      return static_cast<Real>(v.ptr<const double>()[i]);
    default:
      throw Error("internal: load from a non-floating view");
  }
}

template <typename Real>
void store(const TensorView& v, std::int64_t i, Real value, bool accumulate = false) {
  switch (v.dtype) {
    case DType::bf16:
      v.ptr<bf16_t>()[i] = float_to_bf16(static_cast<float>(value));
      return;
    case DType::f32: {
      float* p = v.ptr<float>() + i;
      *p = accumulate ? *p + static_cast<float>(value) : static_cast<float>(value);
      return;
    }
    case DType::f64: {
      double* p = v.ptr<double>() + i;
      *p = accumulate ? *p + static_cast<double>(value) : static_cast<double>(value);
      return;
    }
    default:
      throw Error("internal: store to a non-floating view");
  }
}

// `count` elements of `v` from `offset`, as Real.
template <typename Real>
std::vector<Real> load_range(const TensorView& v, std::int64_t offset, std::int64_t count) {
  std::vector<Real> out(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) out[i] = load<Real>(v, offset + i);
  return out;
}

// Each local expert's slots (t*k + j), in the canonical order: t, then j.
std::vector<std::vector<std::int64_t>> group_slots(const Problem& p, const TensorView& ids_view) {
  std::vector<std::vector<std::int64_t>> groups(p.num_local_experts());
  const auto* ids = ids_view.ptr<const std::int64_t>();
  const std::int64_t first = p.first_local_expert();
  for (std::int64_t s = 0; s < p.num_tokens * p.topk; ++s) {
    const std::int64_t e = ids[s] - first;
    if (ids[s] >= 0 && e >= 0 && e < p.num_local_experts()) groups[e].push_back(s);
  }
  return groups;
}

template <typename Real>
Context<Real>& context_of(State& st) {
  if constexpr (std::is_same_v<Real, float>) {
    return st.f32;
  } else {
    return st.f64;
  }
}

// Row-major [rows, in] x [out, in]^T -> [rows, out]: the Linear layer form.
template <typename Real>
void linear(ThreadPool& pool, std::int64_t rows, std::int64_t out, std::int64_t in, const Real* x,
            const Real* weight, Real* y) {
  gemm<Real>(pool, {rows, out, in, x, in, 1, weight, 1, in, y, out});
}

// One SwiGLU expert's forward over `rows` gathered rows `xr` [rows, H]:
// g, u [rows, N] rounded, h [rows, N], y [rows, H] rounded.
template <typename Real>
void expert_forward(ThreadPool& pool, std::int64_t rows, std::int64_t H, std::int64_t N,
                    const Real* xr, const Real* w_gate, const Real* w_up, const Real* w_down,
                    Real* g, Real* u, Real* h, Real* y) {
  linear<Real>(pool, rows, N, H, xr, w_gate, g);
  linear<Real>(pool, rows, N, H, xr, w_up, u);
  for (std::int64_t i = 0; i < rows * N; ++i) {
    g[i] = store_round(g[i]);
    u[i] = store_round(u[i]);
    h[i] = store_round(numerics::swiglu(g[i], u[i]));
  }
  linear<Real>(pool, rows, H, N, h, w_down, y);
  for (std::int64_t i = 0; i < rows * H; ++i) y[i] = store_round(y[i]);
}

// One expert's backward. Inputs: xr [rows, H], g/u [rows, N] from the context, dy [rows, H].
// Outputs: dx [rows, H] (rounded), and the three weight gradients in Real (unrounded).
template <typename Real>
void expert_backward(ThreadPool& pool, std::int64_t rows, std::int64_t H, std::int64_t N,
                     const Real* xr, const Real* g, const Real* u, const Real* dy,
                     const Real* w_gate, const Real* w_up, const Real* w_down, Real* dx,
                     Real* d_gate, Real* d_up, Real* d_down) {
  std::vector<Real> h(rows * N), dh(rows * N), dg(rows * N), du(rows * N);
  for (std::int64_t i = 0; i < rows * N; ++i) h[i] = store_round(numerics::swiglu(g[i], u[i]));
  // dh = dy W_down: A = dy [rows, H], B(k = h, n = i) = W_down[h, i].
  gemm<Real>(pool, {rows, N, H, dy, H, 1, w_down, N, 1, dh.data(), N});
  for (std::int64_t i = 0; i < rows * N; ++i) {
    Real a, b;
    numerics::swiglu_backward(g[i], u[i], dh[i], &a, &b);
    dg[i] = store_round(a);
    du[i] = store_round(b);
  }
  // dx = dg W_gate + du W_up, one accumulator: gate part, then up part.
  gemm<Real>(pool, {rows, H, N, dg.data(), N, 1, w_gate, H, 1, dx, H});
  gemm<Real>(pool, {rows, H, N, du.data(), N, 1, w_up, H, 1, dx, H, /*accumulate=*/true});
  for (std::int64_t i = 0; i < rows * H; ++i) dx[i] = store_round(dx[i]);
  // Weight gradients, reduced over rows in order: dW_down = dy^T h, dW_gate = dg^T x, dW_up = du^T
  // x.
  gemm<Real>(pool, {H, N, rows, dy, 1, H, h.data(), N, 1, d_down, N});
  gemm<Real>(pool, {N, H, rows, dg.data(), 1, N, xr, H, 1, d_gate, H});
  gemm<Real>(pool, {N, H, rows, du.data(), 1, N, xr, H, 1, d_up, H});
}

template <typename Real>
void write_weight_grad(const TensorView& v, std::int64_t offset, const std::vector<Real>& g,
                       bool accumulate) {
  for (std::size_t i = 0; i < g.size(); ++i) store<Real>(v, offset + i, g[i], accumulate);
}

template <typename Real>
void zero_weight_grad(const TensorView& v, std::int64_t offset, std::int64_t count,
                      bool accumulate) {
  if (accumulate) return;
  for (std::int64_t i = 0; i < count; ++i) store<Real>(v, offset + i, Real(0));
}

constexpr std::int64_t kTokensPerTask = 16;

template <typename Real>
void forward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                  const TensorView* out) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size;
  Context<Real>& ctx = context_of<Real>(st);
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const auto groups = group_slots(p, in.topk_experts);

  for (std::int64_t e = 0; e < p.num_local_experts(); ++e) {
    const auto& slots = groups[e];
    const auto rows = static_cast<std::int64_t>(slots.size());
    if (rows == 0) continue;
    std::vector<Real> xr(rows * H), g(rows * I), u(rows * I), h(rows * I), y(rows * H);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(&x[(slots[r] / k) * H], H, &xr[r * H]);
    }
    const auto wg = load_range<Real>(w.gate, e * I * H, I * H);
    const auto wu = load_range<Real>(w.up, e * I * H, I * H);
    const auto wd = load_range<Real>(w.down, e * H * I, H * I);
    expert_forward<Real>(st.pool, rows, H, I, xr.data(), wg.data(), wu.data(), wd.data(), g.data(),
                         u.data(), h.data(), y.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(&g[r * I], I, &ctx.gate[slots[r] * I]);
      std::copy_n(&u[r * I], I, &ctx.up[slots[r] * I]);
      std::copy_n(&y[r * H], H, &ctx.y[slots[r] * H]);
    }
  }

  std::vector<Real> shared_out;
  if (S > 0) {
    std::vector<Real> h(T * S);
    shared_out.resize(T * H);
    const auto wg = load_range<Real>(w.shared_gate, 0, S * H);
    const auto wu = load_range<Real>(w.shared_up, 0, S * H);
    const auto wd = load_range<Real>(w.shared_down, 0, H * S);
    expert_forward<Real>(st.pool, T, H, S, x.data(), wg.data(), wu.data(), wd.data(),
                         ctx.shared_gate.data(), ctx.shared_up.data(), h.data(), shared_out.data());
  }
  if (out == nullptr) return;

  const auto* ids = in.topk_experts.ptr<const std::int64_t>();
  st.pool.run((T + kTokensPerTask - 1) / kTokensPerTask, [&](std::int64_t task) {
    const std::int64_t t_end = std::min(T, (task + 1) * kTokensPerTask);
    for (std::int64_t t = task * kTokensPerTask; t < t_end; ++t) {
      for (std::int64_t c = 0; c < H; ++c) {
        Real acc = S > 0 ? shared_out[t * H + c] : Real(0);
        for (std::int64_t j = 0; j < k; ++j) {
          if (ids[t * k + j] < 0) continue;
          acc = std::fma(load<Real>(in.topk_weights, t * k + j), ctx.y[(t * k + j) * H + c], acc);
        }
        store<Real>(*out, t * H + c, store_round(acc));
      }
    }
  });
}

template <typename Real>
void backward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                   const TensorView& d_out_view, const Grads& grads,
                   const BackwardOptions& options) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size;
  const bool acc_w = options.accumulate_weight_grads;
  Context<Real>& ctx = context_of<Real>(st);
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const std::vector<Real> d_out = load_range<Real>(d_out_view, 0, T * H);
  const auto* ids = in.topk_experts.ptr<const std::int64_t>();
  const auto groups = group_slots(p, in.topk_experts);
  std::vector<Real> dx_slots(T * k * H);  // dx_routed: one row per slot

  for (std::int64_t e = 0; e < p.num_local_experts(); ++e) {
    const auto& slots = groups[e];
    const auto rows = static_cast<std::int64_t>(slots.size());
    if (rows == 0) {
      zero_weight_grad<Real>(grads.d_gate, e * I * H, I * H, acc_w);
      zero_weight_grad<Real>(grads.d_up, e * I * H, I * H, acc_w);
      zero_weight_grad<Real>(grads.d_down, e * H * I, H * I, acc_w);
      continue;
    }
    std::vector<Real> xr(rows * H), g(rows * I), u(rows * I), dy(rows * H), dx(rows * H);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t s = slots[r], t = s / k;
      std::copy_n(&x[t * H], H, &xr[r * H]);
      std::copy_n(&ctx.gate[s * I], I, &g[r * I]);
      std::copy_n(&ctx.up[s * I], I, &u[r * I]);
      const Real weight = load<Real>(in.topk_weights, s);
      for (std::int64_t c = 0; c < H; ++c) dy[r * H + c] = store_round(weight * d_out[t * H + c]);
    }
    const auto wg = load_range<Real>(w.gate, e * I * H, I * H);
    const auto wu = load_range<Real>(w.up, e * I * H, I * H);
    const auto wd = load_range<Real>(w.down, e * H * I, H * I);
    std::vector<Real> d_gate(I * H), d_up(I * H), d_down(H * I);
    expert_backward<Real>(st.pool, rows, H, I, xr.data(), g.data(), u.data(), dy.data(), wg.data(),
                          wu.data(), wd.data(), dx.data(), d_gate.data(), d_up.data(),
                          d_down.data());
    for (std::int64_t r = 0; r < rows; ++r) std::copy_n(&dx[r * H], H, &dx_slots[slots[r] * H]);
    write_weight_grad<Real>(grads.d_gate, e * I * H, d_gate, acc_w);
    write_weight_grad<Real>(grads.d_up, e * I * H, d_up, acc_w);
    write_weight_grad<Real>(grads.d_down, e * H * I, d_down, acc_w);
  }

  std::vector<Real> shared_dx;
  if (S > 0) {
    shared_dx.resize(T * H);
    const auto wg = load_range<Real>(w.shared_gate, 0, S * H);
    const auto wu = load_range<Real>(w.shared_up, 0, S * H);
    const auto wd = load_range<Real>(w.shared_down, 0, H * S);
    std::vector<Real> d_gate(S * H), d_up(S * H), d_down(H * S);
    expert_backward<Real>(st.pool, T, H, S, x.data(), ctx.shared_gate.data(), ctx.shared_up.data(),
                          d_out.data(), wg.data(), wu.data(), wd.data(), shared_dx.data(),
                          d_gate.data(), d_up.data(), d_down.data());
    write_weight_grad<Real>(grads.d_shared_gate, 0, d_gate, acc_w);
    write_weight_grad<Real>(grads.d_shared_up, 0, d_up, acc_w);
    write_weight_grad<Real>(grads.d_shared_down, 0, d_down, acc_w);
  }

  // Home reductions: d_x over slots in increasing j; d_w as one dot product per slot.
  st.pool.run((T + kTokensPerTask - 1) / kTokensPerTask, [&](std::int64_t task) {
    const std::int64_t t_end = std::min(T, (task + 1) * kTokensPerTask);
    for (std::int64_t t = task * kTokensPerTask; t < t_end; ++t) {
      for (std::int64_t c = 0; c < H; ++c) {
        Real acc = S > 0 ? shared_dx[t * H + c] : Real(0);
        for (std::int64_t j = 0; j < k; ++j) {
          if (ids[t * k + j] >= 0) acc += dx_slots[(t * k + j) * H + c];
        }
        store<Real>(grads.d_x, t * H + c, store_round(acc));
      }
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t s = t * k + j;
        Real dw = 0;
        if (ids[s] >= 0) {
          for (std::int64_t c = 0; c < H; ++c) dw += d_out[t * H + c] * ctx.y[s * H + c];
        }
        store<Real>(grads.d_topk_weights, s, dw);
      }
    }
  });
}

}  // namespace

template <typename Real>
void Context<Real>::allocate(const Problem& p) {
  const std::int64_t slots = p.num_tokens * p.topk;
  gate.assign(slots * p.intermediate_size, Real(0));
  up.assign(slots * p.intermediate_size, Real(0));
  y.assign(slots * p.hidden_size, Real(0));
  shared_gate.assign(p.num_tokens * p.shared_intermediate_size, Real(0));
  shared_up.assign(p.num_tokens * p.shared_intermediate_size, Real(0));
}

template <typename Real>
std::size_t Context<Real>::bytes() const {
  return sizeof(Real) *
         (gate.size() + up.size() + y.size() + shared_gate.size() + shared_up.size());
}

template struct Context<float>;
template struct Context<double>;

State::State(const Problem& p, DType act_dtype, int num_threads)
    : act(act_dtype), pool(num_threads) {
  if (act == DType::f64) {
    f64.allocate(p);
  } else {
    f32.allocate(p);
  }
}

void forward(State& st, const Problem& p, const Inputs& in, const Weights& w,
             const TensorView* out) {
  if (st.act == DType::f64) {
    forward_impl<double>(st, p, in, w, out);
  } else {
    forward_impl<float>(st, p, in, w, out);
  }
}

void backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
              const TensorView& d_out, const Grads& grads, const BackwardOptions& options) {
  if (st.act == DType::f64) {
    backward_impl<double>(st, p, in, w, d_out, grads, options);
  } else {
    backward_impl<float>(st, p, in, w, d_out, grads, options);
  }
}

}  // namespace mok::reference
