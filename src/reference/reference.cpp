#include "reference/reference.hpp"

#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#include "core/bf16.hpp"
#include "core/host_ep_layout.hpp"
#include "core/numerics.hpp"
#include "reference/cpu_gemm.hpp"
#include "reference/fp8_layer.hpp"

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

// Each local expert's slots among `num_slots` slots, in increasing slot order (t, then j; over
// gathered inputs the source rank first): the schedule table's canonical order
// (docs/architecture.md, "The schedule table").
std::vector<std::vector<std::int64_t>> group_slots(const Problem& p, const std::int64_t* ids,
                                                   std::int64_t num_slots) {
  std::vector<std::vector<std::int64_t>> groups(p.num_local_experts());
  const std::int64_t first = p.first_local_expert();
  for (std::int64_t s = 0; s < num_slots; ++s) {
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

// The GEMMs of one expert over `rows` rows, unrounded (fp32 or f64 results), with the bf16
// master weights: w_gate, w_up [N, H], w_down [H, N]. expert_forward and expert_backward do the
// rest (rounding, SwiGLU, scaling), the same for the FP8 layer's products (fp8_layer.hpp), so the
// two layers round at the same places by construction.
template <typename Real>
struct DenseProducts {
  ThreadPool& pool;
  std::int64_t rows, H, N;
  const Real *w_gate, *w_up, *w_down;

  // g, u [rows, N] = xr W_gate^T, xr W_up^T.
  void gate_up(const Real* xr, Real* g, Real* u) const {
    linear<Real>(pool, rows, N, H, xr, w_gate, g);
    linear<Real>(pool, rows, N, H, xr, w_up, u);
  }
  // y [rows, H] = h W_down^T.
  void down(const Real* h, Real* y) const { linear<Real>(pool, rows, H, N, h, w_down, y); }
  // dh [rows, N] = d_outr W_down: A = d_outr [rows, H], B(k = h, n = i) = W_down[h, i].
  void down_dgrad(const Real* d_outr, Real* dh) const {
    gemm<Real>(pool, {rows, N, H, d_outr, H, 1, w_down, N, 1, dh, N});
  }
  // dx [rows, H] = dg W_gate + du W_up, one accumulator: gate part, then up part.
  void gate_up_dgrad(const Real* dg, const Real* du, Real* dx) const {
    gemm<Real>(pool, {rows, H, N, dg, N, 1, w_gate, H, 1, dx, H});
    gemm<Real>(pool, {rows, H, N, du, N, 1, w_up, H, 1, dx, H, /*accumulate=*/true});
  }
  // dW_down = dy^T h, dW_gate = dg^T x, dW_up = du^T x, over the rows in order.
  void weight_grads(const Real* dy, const Real* h, const Real* dg, const Real* du, const Real* xr,
                    Real* d_down, Real* d_gate, Real* d_up) const {
    weight_grad_products<Real>(pool, rows, H, N, dy, h, dg, du, xr, d_down, d_gate, d_up);
  }
};

// One SwiGLU expert's forward over `rows` gathered rows `xr` [rows, H] through `mm` (its GEMMs:
// DenseProducts, or the FP8 layer's Fp8Products): g, u [rows, N] rounded, h [rows, N], and (when
// `y` is not null) y [rows, H] rounded. `limit`: Weights::swiglu_limit. Clamped, h =
// bf16(silu(min(g, L)) * clamp(u, -L, L)) from the rounded g and u, which stay unclamped in the
// context (numerics::swiglu_clamped has the semantics and the gradients).
template <typename Real, typename Products>
void expert_forward(const Products& mm, std::int64_t rows, std::int64_t N, const Real* xr, Real* g,
                    Real* u, Real* h, Real* y, std::optional<float> limit) {
  mm.gate_up(xr, g, u);
  for (std::int64_t i = 0; i < rows * N; ++i) {
    g[i] = store_round(g[i]);
    u[i] = store_round(u[i]);
  }
  if (limit) {
    const Real L = static_cast<Real>(*limit);
    for (std::int64_t i = 0; i < rows * N; ++i) {
      h[i] = store_round(numerics::swiglu_clamped(g[i], u[i], L));
    }
  } else {
    for (std::int64_t i = 0; i < rows * N; ++i) h[i] = store_round(numerics::swiglu(g[i], u[i]));
  }
  if (y == nullptr) return;
  mm.down(h, y);
  for (std::int64_t i = 0; i < rows * mm.H; ++i) y[i] = store_round(y[i]);
}

// One expert's backward (reference.hpp, precision model) through `mm`. Inputs: xr [rows, H],
// g/u/h [rows, N] from the context, d_outr [rows, H] (the unscaled output gradient of each row's
// token) and the rows' router weights `row_w` (null: all 1, the shared expert). Outputs: dx
// [rows, H] (rounded), the three weight gradients in Real (unrounded) and, when `dw` is not null,
// d_w per row.
template <typename Real, typename Products>
void expert_backward(const Products& mm, std::int64_t rows, std::int64_t N, const Real* xr,
                     const Real* g, const Real* u, const Real* h, const Real* d_outr,
                     const Real* row_w, Real* dx, Real* d_gate, Real* d_up, Real* d_down, Real* dw,
                     std::optional<float> limit) {
  const std::int64_t H = mm.H;
  std::vector<Real> dh(rows * N), dg(rows * N), du(rows * N);
  mm.down_dgrad(d_outr, dh.data());  // dh_u = d_out W_down
  for (std::int64_t r = 0; r < rows; ++r) {
    const Real weight = row_w != nullptr ? row_w[r] : Real(1);
    Real dot = 0;
    for (std::int64_t i = r * N; i < (r + 1) * N; ++i) {
      dot += dh[i] * h[i];
      dh[i] = store_round(weight * dh[i]);
    }
    if (dw != nullptr) dw[r] = dot;
  }
  // Clamped (`limit`): dg, du = bf16(swiglu_backward_clamped(g, u, dh, L)), zero where the
  // clamp was active (g > L; |u| > L).
  for (std::int64_t i = 0; i < rows * N; ++i) {
    Real a, b;
    if (limit) {
      numerics::swiglu_backward_clamped(g[i], u[i], dh[i], static_cast<Real>(*limit), &a, &b);
    } else {
      numerics::swiglu_backward(g[i], u[i], dh[i], &a, &b);
    }
    dg[i] = store_round(a);
    du[i] = store_round(b);
  }
  mm.gate_up_dgrad(dg.data(), du.data(), dx);  // dx = dg W_gate + du W_up
  for (std::int64_t i = 0; i < rows * H; ++i) dx[i] = store_round(dx[i]);
  // dy = bf16(w d_out) (the rows as the expert rank scales them), then the weight gradients,
  // reduced over rows in order: dW_down = dy^T h, dW_gate = dg^T x, dW_up = du^T x.
  std::vector<Real> dy(d_outr, d_outr + rows * H);
  if (row_w != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < H; ++c) dy[r * H + c] = store_round(row_w[r] * dy[r * H + c]);
    }
  }
  mm.weight_grads(dy.data(), h, dg.data(), du.data(), xr, d_down, d_gate, d_up);
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

// Weights and weight gradients, one matrix at a time: matrix `m` of an [M, R, C] view (routed
// experts) or the one matrix of an [R, C] view (shared expert, m = 0), through the view's
// strides. NOTES: routed weights and gradients may be row-strided views (validate.cpp), e.g. the
// gate and up halves of one [E, 2I, H] tensor; element i is the matrix's i-th in row-major order.
std::int64_t matrix_element(const TensorView& v, std::int64_t m, std::int64_t i) {
  const int d = v.ndim - 2;
  const std::int64_t cols = v.shape[d + 1];
  return (d > 0 ? m * v.strides[0] : 0) + (i / cols) * v.strides[d] + (i % cols) * v.strides[d + 1];
}

template <typename Real>
std::vector<Real> load_matrix(const TensorView& v, std::int64_t m) {
  const int d = v.ndim - 2;
  const std::int64_t count = v.shape[d] * v.shape[d + 1];
  std::vector<Real> out(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) out[i] = load<Real>(v, matrix_element(v, m, i));
  return out;
}

template <typename Real>
void write_weight_grad(const TensorView& v, std::int64_t m, const std::vector<Real>& g,
                       bool accumulate) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    store<Real>(v, matrix_element(v, m, static_cast<std::int64_t>(i)), g[i], accumulate);
  }
}

template <typename Real>
void zero_weight_grad(const TensorView& v, std::int64_t m, bool accumulate) {
  if (accumulate) return;
  const int d = v.ndim - 2;
  const std::int64_t count = v.shape[d] * v.shape[d + 1];
  for (std::int64_t i = 0; i < count; ++i) store<Real>(v, matrix_element(v, m, i), Real(0));
}

constexpr std::int64_t kTokensPerTask = 16;

// Calls f(mm) with local expert e's GEMMs over `rows` rows: the FP8 layer's (fp8_layer.hpp) when
// `fp8` is given, else the bf16 layer's over the master weights (W_down read when `with_down`).
template <typename Real, typename F>
void with_routed_products(State& st, const Problem& p, const Weights& w, const Fp8Weights* fp8,
                          std::int64_t e, std::int64_t rows, bool with_down, F&& f,
                          bool fp8_weight_grads = true) {
  const std::int64_t H = p.hidden_size, I = p.intermediate_size;
  if (fp8 != nullptr) {
    if constexpr (std::is_same_v<Real, float>) {
      f(Fp8Products{st.pool, rows, H, I, fp8_expert(*fp8, e), fp8_weight_grads});
      return;
    }
    throw Error("internal: the FP8 layer runs on bf16 activations only");
  }
  const auto wg = load_matrix<Real>(w.gate, e);
  const auto wu = load_matrix<Real>(w.up, e);
  const auto wd = with_down ? load_matrix<Real>(w.down, e) : std::vector<Real>();
  f(DenseProducts<Real>{st.pool, rows, H, I, wg.data(), wu.data(), wd.data()});
}

// The expert side of a forward: each local expert over its slots among `num_slots` slots
// (`ids`, tokens of `x` [num_slots / k, H]: this rank's own, or every rank's gathered). Writes g,
// u and h into the context row of each slot and, with `with_y`, hands each slot's y row to
// emit(slot, y_row). `fp8`: the FP8 layer's routed weights (null: the bf16 layer).
template <typename Real, typename Emit>
void routed_forward(State& st, const Problem& p, const std::vector<Real>& x,
                    const std::int64_t* ids, std::int64_t num_slots, const Weights& w,
                    const Fp8Weights* fp8, bool with_y, const ForwardContext& ctx, Emit&& emit) {
  const std::int64_t H = p.hidden_size, I = p.intermediate_size, k = p.topk;
  const auto groups = group_slots(p, ids, num_slots);
  for (std::int64_t e = 0; e < p.num_local_experts(); ++e) {
    const auto& slots = groups[e];
    const auto rows = static_cast<std::int64_t>(slots.size());
    if (rows == 0) continue;
    std::vector<Real> xr(rows * H), g(rows * I), u(rows * I), h(rows * I), y(with_y ? rows * H : 0);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(&x[(slots[r] / k) * H], H, &xr[r * H]);
    }
    with_routed_products<Real>(st, p, w, fp8, e, rows, with_y, [&](const auto& mm) {
      expert_forward<Real>(mm, rows, I, xr.data(), g.data(), u.data(), h.data(),
                           with_y ? y.data() : nullptr, w.swiglu_limit);
    });
    for (std::int64_t r = 0; r < rows; ++r) {
      store_rows<Real>(ctx.gate_routed, slots[r], I, &g[r * I]);
      store_rows<Real>(ctx.up_routed, slots[r], I, &u[r * I]);
      store_rows<Real>(ctx.hidden_routed, slots[r], I, &h[r * I]);
      if (with_y) emit(slots[r], &y[r * H]);
    }
  }
}

// The shared expert over this rank's T tokens: its context rows, and (with `with_out`) its output
// [T, H]; empty without a shared expert.
template <typename Real>
std::vector<Real> shared_forward(State& st, const Problem& p, const std::vector<Real>& x,
                                 const Weights& w, bool with_out, const ForwardContext& ctx) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, S = p.shared_intermediate_size;
  std::vector<Real> shared_out;
  if (S == 0) return shared_out;
  std::vector<Real> g(T * S), u(T * S), h(T * S);
  if (with_out) shared_out.resize(T * H);
  const auto wg = load_matrix<Real>(w.shared_gate, 0);
  const auto wu = load_matrix<Real>(w.shared_up, 0);
  const auto wd = with_out ? load_matrix<Real>(w.shared_down, 0) : std::vector<Real>();
  const DenseProducts<Real> mm{st.pool, T, H, S, wg.data(), wu.data(), wd.data()};
  expert_forward<Real>(mm, T, S, x.data(), g.data(), u.data(), h.data(),
                       with_out ? shared_out.data() : nullptr, w.swiglu_limit);
  for (std::int64_t t = 0; t < T; ++t) {
    store_rows<Real>(ctx.gate_shared, t, S, &g[t * S]);
    store_rows<Real>(ctx.up_shared, t, S, &u[t * S]);
    store_rows<Real>(ctx.hidden_shared, t, S, &h[t * S]);
  }
  return shared_out;
}

// The home reduction of a forward: out[t] = bf16(s[t] + sum_j w[t,j] * y[t,j]) in fp32, fma,
// increasing j. The y row of slot t*k + j is row row_of_slot[t*k + j] of `rows` [*, H].
template <typename Real>
void combine(State& st, const Problem& p, const Inputs& in, const std::vector<Real>& shared_out,
             const Real* rows, const std::vector<std::int64_t>& row_of_slot,
             const TensorView& out) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk;
  const bool shared = p.has_shared_expert();
  const auto* ids = in.topk_experts.ptr<const std::int64_t>();
  st.pool.run((T + kTokensPerTask - 1) / kTokensPerTask, [&](std::int64_t task) {
    const std::int64_t t_end = std::min(T, (task + 1) * kTokensPerTask);
    for (std::int64_t t = task * kTokensPerTask; t < t_end; ++t) {
      for (std::int64_t c = 0; c < H; ++c) {
        Real acc = shared ? shared_out[t * H + c] : Real(0);
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t s = t * k + j;
          if (ids[s] < 0) continue;
          acc = std::fma(load<Real>(in.topk_weights, s), rows[row_of_slot[s] * H + c], acc);
        }
        store<Real>(out, t * H + c, store_round(acc));
      }
    }
  });
}

std::vector<std::int64_t> identity_rows(std::int64_t n) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) rows[i] = i;
  return rows;
}

template <typename Real>
void forward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                  const Fp8Weights* fp8, const TensorView* out, const ForwardContext& ctx) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk;
  const bool with_out = out != nullptr;
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  std::vector<Real> y_slots(with_out ? T * k * H : 0);  // the combine buffer: one row per slot
  routed_forward<Real>(st, p, x, in.topk_experts.ptr<const std::int64_t>(), T * k, w, fp8, with_out,
                       ctx,
                       [&](std::int64_t s, const Real* y) { std::copy_n(y, H, &y_slots[s * H]); });
  const std::vector<Real> shared_out = shared_forward<Real>(st, p, x, w, with_out, ctx);
  if (!with_out) return;
  combine<Real>(st, p, in, shared_out, y_slots.data(), identity_rows(T * k), *out);
}

// The expert side of a backward: each local expert over its slots among `num_slots` slots (`ids`,
// with their tokens' x and d_out rows and their router weights `topk_weights`), from the context
// rows of those slots. Writes the local experts' weight gradients and hands each slot's dx row and
// d_w entry to emit(slot, dx_row, dw). `fp8`: the FP8 layer's routed weights (null: bf16).
template <typename Real, typename Emit>
void routed_backward(State& st, const Problem& p, const std::vector<Real>& x,
                     const std::vector<Real>& d_out, const std::int64_t* ids,
                     const TensorView& topk_weights, std::int64_t num_slots, const Weights& w,
                     const Fp8Weights* fp8, const ForwardContext& ctx, const Grads& grads,
                     const BackwardOptions& options, Emit&& emit) {
  const std::int64_t H = p.hidden_size, I = p.intermediate_size, k = p.topk;
  const bool acc_w = options.accumulate_weight_grads;
  const auto groups = group_slots(p, ids, num_slots);
  for (std::int64_t e = 0; e < p.num_local_experts(); ++e) {
    const auto& slots = groups[e];
    const auto rows = static_cast<std::int64_t>(slots.size());
    if (rows == 0) {
      zero_weight_grad<Real>(grads.d_gate, e, acc_w);
      zero_weight_grad<Real>(grads.d_up, e, acc_w);
      zero_weight_grad<Real>(grads.d_down, e, acc_w);
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
      row_w[r] = load<Real>(topk_weights, s);
    }
    std::vector<Real> d_gate(I * H), d_up(I * H), d_down(H * I);
    with_routed_products<Real>(
        st, p, w, fp8, e, rows, true,
        [&](const auto& mm) {
          expert_backward<Real>(mm, rows, I, xr.data(), g.data(), u.data(), h.data(),
                                d_outr.data(), row_w.data(), dx.data(), d_gate.data(),
                                d_up.data(), d_down.data(), dw.data(), w.swiglu_limit);
        },
        options.fp8_weight_grads);
    for (std::int64_t r = 0; r < rows; ++r) emit(slots[r], &dx[r * H], dw[r]);
    write_weight_grad<Real>(grads.d_gate, e, d_gate, acc_w);
    write_weight_grad<Real>(grads.d_up, e, d_up, acc_w);
    write_weight_grad<Real>(grads.d_down, e, d_down, acc_w);
  }
}

// The shared expert's backward over this rank's T tokens: writes its weight gradients, returns its
// d_x part [T, H] (empty without a shared expert).
template <typename Real>
std::vector<Real> shared_backward(State& st, const Problem& p, const std::vector<Real>& x,
                                  const std::vector<Real>& d_out, const Weights& w,
                                  const ForwardContext& ctx, const Grads& grads, bool acc_w) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, S = p.shared_intermediate_size;
  std::vector<Real> shared_dx;
  if (S == 0) return shared_dx;
  shared_dx.resize(T * H);
  std::vector<Real> g(T * S), u(T * S), h(T * S);
  for (std::int64_t t = 0; t < T; ++t) {
    load_rows<Real>(ctx.gate_shared, t, S, &g[t * S]);
    load_rows<Real>(ctx.up_shared, t, S, &u[t * S]);
    load_rows<Real>(ctx.hidden_shared, t, S, &h[t * S]);
  }
  const auto wg = load_matrix<Real>(w.shared_gate, 0);
  const auto wu = load_matrix<Real>(w.shared_up, 0);
  const auto wd = load_matrix<Real>(w.shared_down, 0);
  std::vector<Real> d_gate(S * H), d_up(S * H), d_down(H * S);
  const DenseProducts<Real> mm{st.pool, T, H, S, wg.data(), wu.data(), wd.data()};
  expert_backward<Real>(mm, T, S, x.data(), g.data(), u.data(), h.data(), d_out.data(), nullptr,
                        shared_dx.data(), d_gate.data(), d_up.data(), d_down.data(), nullptr,
                        w.swiglu_limit);
  write_weight_grad<Real>(grads.d_shared_gate, 0, d_gate, acc_w);
  write_weight_grad<Real>(grads.d_shared_up, 0, d_up, acc_w);
  write_weight_grad<Real>(grads.d_shared_down, 0, d_down, acc_w);
  return shared_dx;
}

// The home reductions of a backward: d_x[t] = bf16(ds_x[t] + sum_j dx[t,j]) in increasing j;
// d_w as the expert side computed it (0 for an unused slot). Slot t*k + j's dx row and d_w entry
// are row row_of_slot[t*k + j] of `dx_rows` [*, H] and `dw_rows`.
template <typename Real>
void home_backward(State& st, const Problem& p, const Inputs& in,
                   const std::vector<Real>& shared_dx, const Real* dx_rows, const Real* dw_rows,
                   const std::vector<std::int64_t>& row_of_slot, const Grads& grads) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk;
  const bool shared = p.has_shared_expert();
  const auto* ids = in.topk_experts.ptr<const std::int64_t>();
  st.pool.run((T + kTokensPerTask - 1) / kTokensPerTask, [&](std::int64_t task) {
    const std::int64_t t_end = std::min(T, (task + 1) * kTokensPerTask);
    for (std::int64_t t = task * kTokensPerTask; t < t_end; ++t) {
      for (std::int64_t c = 0; c < H; ++c) {
        Real acc = shared ? shared_dx[t * H + c] : Real(0);
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t s = t * k + j;
          if (ids[s] >= 0) acc += dx_rows[row_of_slot[s] * H + c];
        }
        store<Real>(grads.d_x, t * H + c, store_round(acc));
      }
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t s = t * k + j;
        store<Real>(grads.d_topk_weights, s, ids[s] >= 0 ? dw_rows[row_of_slot[s]] : Real(0));
      }
    }
  });
}

template <typename Real>
void backward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                   const Fp8Weights* fp8, const ForwardContext& ctx, const TensorView& d_out_view,
                   const Grads& grads, const BackwardOptions& options) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk;
  const bool acc_w = options.accumulate_weight_grads;
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const std::vector<Real> d_out = load_range<Real>(d_out_view, 0, T * H);
  std::vector<Real> dx_slots(T * k * H);  // dx_routed: one row per slot
  std::vector<Real> dw_slots(T * k, Real(0));
  routed_backward<Real>(st, p, x, d_out, in.topk_experts.ptr<const std::int64_t>(), in.topk_weights,
                        T * k, w, fp8, ctx, grads, options,
                        [&](std::int64_t s, const Real* dx, Real dw) {
                          std::copy_n(dx, H, &dx_slots[s * H]);
                          dw_slots[s] = dw;
                        });
  const std::vector<Real> shared_dx = shared_backward<Real>(st, p, x, d_out, w, ctx, grads, acc_w);
  home_backward<Real>(st, p, in, shared_dx, dx_slots.data(), dw_slots.data(), identity_rows(T * k),
                      grads);
}

// Host expert parallelism (include/mok/host_ep.hpp): the same pieces over the gathered inputs,
// with the exchange rows of core/host_ep_layout.hpp in place of the one-row-per-slot buffers.
template <typename Real>
void ep_expert_forward_impl(State& st, const Problem& p, const Inputs& gathered, const Weights& w,
                            const Fp8Weights* fp8, const TensorView* send,
                            const ForwardContext& ctx) {
  const std::int64_t slots = std::int64_t{p.ep_size} * p.num_tokens * p.topk, H = p.hidden_size;
  const std::vector<Real> x = load_range<Real>(gathered.x, 0, slots / p.topk * H);
  const auto* ids = gathered.topk_experts.ptr<const std::int64_t>();
  const std::vector<std::int64_t> row_of_slot = host_ep::send_rows(p, ids);
  routed_forward<Real>(
      st, p, x, ids, slots, w, fp8, send != nullptr, ctx,
      [&](std::int64_t s, const Real* y) { store_rows<Real>(*send, row_of_slot[s], H, y); });
}

template <typename Real>
void ep_home_forward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                          const TensorView* received, const TensorView* out,
                          const ForwardContext& ctx) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size;
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const std::vector<Real> shared_out = shared_forward<Real>(st, p, x, w, out != nullptr, ctx);
  if (out == nullptr) return;
  const std::vector<Real> rows = load_range<Real>(*received, 0, received->numel());
  combine<Real>(st, p, in, shared_out, rows.data(),
                host_ep::receive_rows(p, in.topk_experts.ptr<const std::int64_t>()), *out);
}

template <typename Real>
void ep_expert_backward_impl(State& st, const Problem& p, const Inputs& gathered, const Weights& w,
                             const Fp8Weights* fp8, const ForwardContext& ctx,
                             const TensorView& d_out_all, const TensorView& dx_send,
                             const TensorView& dw_send, const Grads& grads,
                             const BackwardOptions& options) {
  const std::int64_t slots = std::int64_t{p.ep_size} * p.num_tokens * p.topk, H = p.hidden_size;
  const std::vector<Real> x = load_range<Real>(gathered.x, 0, slots / p.topk * H);
  const std::vector<Real> d_out = load_range<Real>(d_out_all, 0, slots / p.topk * H);
  const auto* ids = gathered.topk_experts.ptr<const std::int64_t>();
  const std::vector<std::int64_t> row_of_slot = host_ep::send_rows(p, ids);
  routed_backward<Real>(st, p, x, d_out, ids, gathered.topk_weights, slots, w, fp8, ctx, grads,
                        options,
                        [&](std::int64_t s, const Real* dx, Real dw) {
                          store_rows<Real>(dx_send, row_of_slot[s], H, dx);
                          store<Real>(dw_send, row_of_slot[s], dw);
                        });
}

template <typename Real>
void ep_home_backward_impl(State& st, const Problem& p, const Inputs& in, const Weights& w,
                           const ForwardContext& ctx, const TensorView& d_out_view,
                           const TensorView& dx_received, const TensorView& dw_received,
                           const Grads& grads, const BackwardOptions& options) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size;
  const std::vector<Real> x = load_range<Real>(in.x, 0, T * H);
  const std::vector<Real> d_out = load_range<Real>(d_out_view, 0, T * H);
  const std::vector<Real> shared_dx =
      shared_backward<Real>(st, p, x, d_out, w, ctx, grads, options.accumulate_weight_grads);
  const std::vector<Real> dx_rows = load_range<Real>(dx_received, 0, dx_received.numel());
  const std::vector<Real> dw_rows = load_range<Real>(dw_received, 0, dw_received.numel());
  home_backward<Real>(st, p, in, shared_dx, dx_rows.data(), dw_rows.data(),
                      host_ep::receive_rows(p, in.topk_experts.ptr<const std::int64_t>()), grads);
}

}  // namespace

void forward(State& st, const Problem& p, const Inputs& in, const Weights& w, const TensorView* out,
             const ForwardContext& ctx, const Fp8Weights* fp8) {
  if (st.act == DType::f64) {
    forward_impl<double>(st, p, in, w, fp8, out, ctx);
  } else {
    forward_impl<float>(st, p, in, w, fp8, out, ctx);
  }
}

void backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
              const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
              const BackwardOptions& options, const Fp8Weights* fp8) {
  if (st.act == DType::f64) {
    backward_impl<double>(st, p, in, w, fp8, ctx, d_out, grads, options);
  } else {
    backward_impl<float>(st, p, in, w, fp8, ctx, d_out, grads, options);
  }
}

}  // namespace mok::reference

namespace mok::reference {

void ep_expert_forward(State& st, const Problem& p, const Inputs& gathered, const Weights& w,
                       const TensorView* combine_send, const ForwardContext& ctx,
                       const Fp8Weights* fp8) {
  if (st.act == DType::f64) {
    ep_expert_forward_impl<double>(st, p, gathered, w, fp8, combine_send, ctx);
  } else {
    ep_expert_forward_impl<float>(st, p, gathered, w, fp8, combine_send, ctx);
  }
}

void ep_home_forward(State& st, const Problem& p, const Inputs& in, const Weights& w,
                     const TensorView* combine_received, const TensorView* out,
                     const ForwardContext& ctx) {
  if (st.act == DType::f64) {
    ep_home_forward_impl<double>(st, p, in, w, combine_received, out, ctx);
  } else {
    ep_home_forward_impl<float>(st, p, in, w, combine_received, out, ctx);
  }
}

void ep_expert_backward(State& st, const Problem& p, const Inputs& gathered, const Weights& w,
                        const ForwardContext& ctx, const TensorView& d_out_all,
                        const TensorView& dx_send, const TensorView& dw_send, const Grads& grads,
                        const BackwardOptions& options, const Fp8Weights* fp8) {
  if (st.act == DType::f64) {
    ep_expert_backward_impl<double>(st, p, gathered, w, fp8, ctx, d_out_all, dx_send, dw_send,
                                    grads, options);
  } else {
    ep_expert_backward_impl<float>(st, p, gathered, w, fp8, ctx, d_out_all, dx_send, dw_send, grads,
                                   options);
  }
}

void ep_home_backward(State& st, const Problem& p, const Inputs& in, const Weights& w,
                      const ForwardContext& ctx, const TensorView& d_out,
                      const TensorView& dx_received, const TensorView& dw_received,
                      const Grads& grads, const BackwardOptions& options) {
  if (st.act == DType::f64) {
    ep_home_backward_impl<double>(st, p, in, w, ctx, d_out, dx_received, dw_received, grads,
                                  options);
  } else {
    ep_home_backward_impl<float>(st, p, in, w, ctx, d_out, dx_received, dw_received, grads,
                                 options);
  }
}

}  // namespace mok::reference
