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

// Row-major [rows, in] x [out, in]^T -> [rows, out]: the Linear layer form.
template <typename Real>
void linear(ThreadPool& pool, std::int64_t rows, std::int64_t out, std::int64_t in, const Real* x,
            const Real* weight, Real* y) {
  gemm<Real>(pool, {rows, out, in, x, in, 1, weight, 1, in, y, out});
}

// One SwiGLU expert's forward over `rows` gathered rows `xr` [rows, H]:
// g, u [rows, N] rounded, h [rows, N], and (when `y` is not null) y [rows, H] rounded.
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
  if (y == nullptr) return;
  linear<Real>(pool, rows, H, N, h, w_down, y);
  for (std::int64_t i = 0; i < rows * H; ++i) y[i] = store_round(y[i]);
}

// One expert's backward (reference.hpp, precision model). Inputs: xr [rows, H], g/u/h [rows, N]
// from the context, d_outr [rows, H] (the unscaled output gradient of each row's token) and the
// rows' router weights `row_w` (null: all 1, the shared expert). Outputs: dx [rows, H] (rounded),
// the three weight gradients in Real (unrounded) and, when `dw` is not null, d_w per row.
template <typename Real>
void expert_backward(ThreadPool& pool, std::int64_t rows, std::int64_t H, std::int64_t N,
                     const Real* xr, const Real* g, const Real* u, const Real* h,
                     const Real* d_outr, const Real* row_w, const Real* w_gate, const Real* w_up,
                     const Real* w_down, Real* dx, Real* d_gate, Real* d_up, Real* d_down,
                     Real* dw) {
  std::vector<Real> dh(rows * N), dg(rows * N), du(rows * N);
  // dh_u = d_out W_down: A = d_outr [rows, H], B(k = h, n = i) = W_down[h, i].
  gemm<Real>(pool, {rows, N, H, d_outr, H, 1, w_down, N, 1, dh.data(), N});
  for (std::int64_t r = 0; r < rows; ++r) {
    const Real weight = row_w != nullptr ? row_w[r] : Real(1);
    Real dot = 0;
    for (std::int64_t i = r * N; i < (r + 1) * N; ++i) {
      dot += dh[i] * h[i];
      dh[i] = store_round(weight * dh[i]);
    }
    if (dw != nullptr) dw[r] = dot;
  }
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
  // dy = bf16(w d_out) (the rows as the expert rank scales them), then the weight gradients,
  // reduced over rows in order: dW_down = dy^T h, dW_gate = dg^T x, dW_up = du^T x.
  std::vector<Real> dy(d_outr, d_outr + rows * H);
  if (row_w != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < H; ++c) dy[r * H + c] = store_round(row_w[r] * dy[r * H + c]);
    }
  }
  gemm<Real>(pool, {H, N, rows, dy.data(), 1, H, h, N, 1, d_down, N});
  gemm<Real>(pool, {N, H, rows, dg.data(), 1, N, xr, H, 1, d_gate, H});
  gemm<Real>(pool, {N, H, rows, du.data(), 1, N, xr, H, 1, d_up, H});
}

// Rows of a [rows, cols] context view, read as or written from Real.
template <typename Real>
void load_rows(const TensorView& v, std::int64_t row, std::int64_t cols, Real* dst) {
  for (std::int64_t c = 0; c < cols; ++c) dst[c] = load<Real>(v, row * cols + c);
}
template <typename Real>
void store_rows(const TensorView& v, std::int64_t row, std::int64_t cols, const Real* src) {
  for (std::int64_t c = 0; c < cols; ++c) store<Real>(v, row * cols + c, src[c]);
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
                  const TensorView* out, const ForwardContext& ctx) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size;
  const bool with_out = out != nullptr;
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const auto groups = group_slots(p, in.topk_experts);
  std::vector<Real> y_slots(with_out ? T * k * H : 0);  // the combine buffer: one row per slot

  for (std::int64_t e = 0; e < p.num_local_experts(); ++e) {
    const auto& slots = groups[e];
    const auto rows = static_cast<std::int64_t>(slots.size());
    if (rows == 0) continue;
    std::vector<Real> xr(rows * H), g(rows * I), u(rows * I), h(rows * I),
        y(with_out ? rows * H : 0);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(&x[(slots[r] / k) * H], H, &xr[r * H]);
    }
    const auto wg = load_range<Real>(w.gate, e * I * H, I * H);
    const auto wu = load_range<Real>(w.up, e * I * H, I * H);
    const auto wd = with_out ? load_range<Real>(w.down, e * H * I, H * I) : std::vector<Real>();
    expert_forward<Real>(st.pool, rows, H, I, xr.data(), wg.data(), wu.data(), wd.data(), g.data(),
                         u.data(), h.data(), with_out ? y.data() : nullptr);
    for (std::int64_t r = 0; r < rows; ++r) {
      store_rows<Real>(ctx.gate_routed, slots[r], I, &g[r * I]);
      store_rows<Real>(ctx.up_routed, slots[r], I, &u[r * I]);
      store_rows<Real>(ctx.hidden_routed, slots[r], I, &h[r * I]);
      if (with_out) std::copy_n(&y[r * H], H, &y_slots[slots[r] * H]);
    }
  }

  std::vector<Real> shared_out;
  if (S > 0) {
    std::vector<Real> g(T * S), u(T * S), h(T * S);
    if (with_out) shared_out.resize(T * H);
    const auto wg = load_range<Real>(w.shared_gate, 0, S * H);
    const auto wu = load_range<Real>(w.shared_up, 0, S * H);
    const auto wd =
        with_out ? load_range<Real>(w.shared_down, 0, H * S) : std::vector<Real>();
    expert_forward<Real>(st.pool, T, H, S, x.data(), wg.data(), wu.data(), wd.data(), g.data(),
                         u.data(), h.data(), with_out ? shared_out.data() : nullptr);
    for (std::int64_t t = 0; t < T; ++t) {
      store_rows<Real>(ctx.gate_shared, t, S, &g[t * S]);
      store_rows<Real>(ctx.up_shared, t, S, &u[t * S]);
      store_rows<Real>(ctx.hidden_shared, t, S, &h[t * S]);
    }
  }
  if (!with_out) return;

  const auto* ids = in.topk_experts.ptr<const std::int64_t>();
  st.pool.run((T + kTokensPerTask - 1) / kTokensPerTask, [&](std::int64_t task) {
    const std::int64_t t_end = std::min(T, (task + 1) * kTokensPerTask);
    for (std::int64_t t = task * kTokensPerTask; t < t_end; ++t) {
      for (std::int64_t c = 0; c < H; ++c) {
        Real acc = S > 0 ? shared_out[t * H + c] : Real(0);
        for (std::int64_t j = 0; j < k; ++j) {
          if (ids[t * k + j] < 0) continue;
          acc = std::fma(load<Real>(in.topk_weights, t * k + j), y_slots[(t * k + j) * H + c], acc);
        }
        store<Real>(*out, t * H + c, store_round(acc));
      }
    }
  });
}

template <typename Real>
void backward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                   const ForwardContext& ctx, const TensorView& d_out_view, const Grads& grads,
                   const BackwardOptions& options) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size;
  const bool acc_w = options.accumulate_weight_grads;
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const std::vector<Real> d_out = load_range<Real>(d_out_view, 0, T * H);
  const auto* ids = in.topk_experts.ptr<const std::int64_t>();
  const auto groups = group_slots(p, in.topk_experts);
  std::vector<Real> dx_slots(T * k * H);  // dx_routed: one row per slot
  std::vector<Real> dw_slots(T * k, Real(0));

  for (std::int64_t e = 0; e < p.num_local_experts(); ++e) {
    const auto& slots = groups[e];
    const auto rows = static_cast<std::int64_t>(slots.size());
    if (rows == 0) {
      zero_weight_grad<Real>(grads.d_gate, e * I * H, I * H, acc_w);
      zero_weight_grad<Real>(grads.d_up, e * I * H, I * H, acc_w);
      zero_weight_grad<Real>(grads.d_down, e * H * I, H * I, acc_w);
      continue;
    }
    std::vector<Real> xr(rows * H), g(rows * I), u(rows * I), h(rows * I), d_outr(rows * H),
        row_w(rows), dx(rows * H), dw(rows);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t s = slots[r], t = s / k;
      std::copy_n(&x[t * H], H, &xr[r * H]);
      std::copy_n(&d_out[t * H], H, &d_outr[r * H]);
      load_rows<Real>(ctx.gate_routed, s, I, &g[r * I]);
      load_rows<Real>(ctx.up_routed, s, I, &u[r * I]);
      load_rows<Real>(ctx.hidden_routed, s, I, &h[r * I]);
      row_w[r] = load<Real>(in.topk_weights, s);
    }
    const auto wg = load_range<Real>(w.gate, e * I * H, I * H);
    const auto wu = load_range<Real>(w.up, e * I * H, I * H);
    const auto wd = load_range<Real>(w.down, e * H * I, H * I);
    std::vector<Real> d_gate(I * H), d_up(I * H), d_down(H * I);
    expert_backward<Real>(st.pool, rows, H, I, xr.data(), g.data(), u.data(), h.data(),
                          d_outr.data(), row_w.data(), wg.data(), wu.data(), wd.data(), dx.data(),
                          d_gate.data(), d_up.data(), d_down.data(), dw.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(&dx[r * H], H, &dx_slots[slots[r] * H]);
      dw_slots[slots[r]] = dw[r];
    }
    write_weight_grad<Real>(grads.d_gate, e * I * H, d_gate, acc_w);
    write_weight_grad<Real>(grads.d_up, e * I * H, d_up, acc_w);
    write_weight_grad<Real>(grads.d_down, e * H * I, d_down, acc_w);
  }

  std::vector<Real> shared_dx;
  if (S > 0) {
    shared_dx.resize(T * H);
    std::vector<Real> g(T * S), u(T * S), h(T * S);
    for (std::int64_t t = 0; t < T; ++t) {
      load_rows<Real>(ctx.gate_shared, t, S, &g[t * S]);
      load_rows<Real>(ctx.up_shared, t, S, &u[t * S]);
      load_rows<Real>(ctx.hidden_shared, t, S, &h[t * S]);
    }
    const auto wg = load_range<Real>(w.shared_gate, 0, S * H);
    const auto wu = load_range<Real>(w.shared_up, 0, S * H);
    const auto wd = load_range<Real>(w.shared_down, 0, H * S);
    std::vector<Real> d_gate(S * H), d_up(S * H), d_down(H * S);
    expert_backward<Real>(st.pool, T, H, S, x.data(), g.data(), u.data(), h.data(), d_out.data(),
                          nullptr, wg.data(), wu.data(), wd.data(), shared_dx.data(),
                          d_gate.data(), d_up.data(), d_down.data(), nullptr);
    write_weight_grad<Real>(grads.d_shared_gate, 0, d_gate, acc_w);
    write_weight_grad<Real>(grads.d_shared_up, 0, d_up, acc_w);
    write_weight_grad<Real>(grads.d_shared_down, 0, d_down, acc_w);
  }

  // Home reductions: d_x over slots in increasing j; d_w as the expert side computed it (0 for an
  // unused slot).
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
        store<Real>(grads.d_topk_weights, s, ids[s] >= 0 ? dw_slots[s] : Real(0));
      }
    }
  });
}

}  // namespace

void forward(State& st, const Problem& p, const Inputs& in, const Weights& w,
             const TensorView* out, const ForwardContext& ctx) {
  if (st.act == DType::f64) {
    forward_impl<double>(st, p, in, w, out, ctx);
  } else {
    forward_impl<float>(st, p, in, w, out, ctx);
  }
}

void backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
              const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
              const BackwardOptions& options) {
  if (st.act == DType::f64) {
    backward_impl<double>(st, p, in, w, ctx, d_out, grads, options);
  } else {
    backward_impl<float>(st, p, in, w, ctx, d_out, grads, options);
  }
}

}  // namespace mok::reference
