#include "synthetic/check_fp8.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>

#include "core/bf16.hpp"
#include "core/numerics.hpp"
#include "core/thread_pool.hpp"
#include "reference/fp8_layer.hpp"

namespace mok {

bool mxfp8_abs_max_applies(const std::string& name) {
  return name == "out" || name == "d_x";
}

bool within_mxfp8_bounds(const ErrorEntry& e) {
  return (!mxfp8_abs_max_applies(e.name) || e.abs_max <= kMxfp8AbsMax) &&
         e.rel_sum <= kMxfp8RelSum && e.cosine >= kMxfp8Cosine;  // false for NaN
}

bool within_mxfp8_bounds(const CheckReport& r) {
  return !r.entries.empty() &&
         std::all_of(r.entries.begin(), r.entries.end(),
                     [](const ErrorEntry& e) { return within_mxfp8_bounds(e); });
}

bool Fp8ReferenceEntry::passed() const {
  if (bitwise) return differing == 0;
  return rel_sum <= kFp8ReferenceRelSum && bad_rows == 0;  // false for NaN
}

bool Fp8ReferenceReport::passed() const {
  return !entries.empty() && std::all_of(entries.begin(), entries.end(),
                                         [](const Fp8ReferenceEntry& e) { return e.passed(); });
}

const Fp8ReferenceEntry* Fp8ReferenceReport::find(const std::string& name) const {
  for (const Fp8ReferenceEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

namespace {

using reference::Fp8BlockMatrix;
using reference::Fp8Expert;
using reference::Fp8Products;

std::vector<double> values(const HostTensor& t) {
  std::vector<double> v(t.numel());
  for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = t.get(i);
  return v;
}

// sum |diff| / sum |ref| (0 / 0 = 0; NaN stays NaN).
double relative(double diff, double sum) {
  return sum > 0 ? diff / sum : (diff == 0 ? 0.0 : diff / sum);
}

// got against ref, in rows of `row` values (the last may be shorter).
Fp8ReferenceEntry compare(const char* name, const std::vector<double>& got,
                          const std::vector<double>& ref, std::int64_t row, bool bitwise) {
  Fp8ReferenceEntry e;
  e.name = name;
  e.bitwise = bitwise;
  e.compared = static_cast<std::int64_t>(got.size());
  double diff = 0, sum = 0;
  for (std::int64_t r0 = 0; r0 < e.compared; r0 += row) {
    double d = 0, s = 0;
    for (std::int64_t i = r0; i < std::min(e.compared, r0 + row); ++i) {
      if (std::bit_cast<std::uint64_t>(got[i]) != std::bit_cast<std::uint64_t>(ref[i])) {
        ++e.differing;
      }
      d += std::fabs(got[i] - ref[i]);
      s += std::fabs(ref[i]);
    }
    diff += d;
    sum += s;
    const double rel = relative(d, s);
    if (!(rel <= kFp8ReferenceRowRelSum)) ++e.bad_rows;
    if (rel > e.worst_row || (std::isnan(rel) && !std::isnan(e.worst_row))) {
      e.worst_row = rel;
      e.worst_row_index = r0 / row;
    }
  }
  e.rel_sum = relative(diff, sum);
  return e;
}

// A tensor shaped like t (absent if t is), NaN-filled.
HostTensor like(const HostTensor& t) {
  if (!t.defined()) return {};
  const TensorView& v = t.view();
  HostTensor h = v.ndim == 1   ? HostTensor(v.dtype, {v.shape[0]})
                 : v.ndim == 2 ? HostTensor(v.dtype, {v.shape[0], v.shape[1]})
                               : HostTensor(v.dtype, {v.shape[0], v.shape[1], v.shape[2]});
  h.fill_bytes(0xff);
  return h;
}

// ---- Full: the CPU backend's FP8 layer over the whole problem ----

Fp8ReferenceReport check_full(const LayerData& got, bool bitwise, bool fp8_weight_grads,
                              const CheckOptions& o) {
  const Problem& p = got.problem;
  const std::int64_t H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size;
  HostTensor out = like(got.out), d_x = like(got.d_x), d_w = like(got.d_topk_weights),
             d_gate = like(got.d_gate), d_up = like(got.d_up), d_down = like(got.d_down),
             d_sg = like(got.d_shared_gate), d_su = like(got.d_shared_up),
             d_sd = like(got.d_shared_down);
  const HostFp8Weights q(got);
  Workspace ws(p, Config{}, {.backend = Backend::cpu, .num_threads = o.num_threads});
  HostContext ctx(ws);
  BackwardOptions options;
  options.fp8_weight_grads = fp8_weight_grads;
  forward(ws, got.inputs(), got.weights(), q.get(), out.view(), ctx.get());
  backward(ws, got.inputs(), got.weights(), q.get(), ctx.get(), got.d_out.view(),
           {d_x.view(), d_w.view(), d_gate.view(), d_up.view(), d_down.view(), d_sg.view(),
            d_su.view(), d_sd.view()},
           options);
  Fp8ReferenceReport r;
  r.bitwise = bitwise;
  auto add = [&](const char* name, const HostTensor& g, const HostTensor& f, std::int64_t row) {
    r.entries.push_back(compare(name, values(g), values(f), row, bitwise));
  };
  add("out", got.out, out, H);
  add("d_x", got.d_x, d_x, H);
  add("d_topk_weights", got.d_topk_weights, d_w, k);
  add("d_routed_gate_weights", got.d_gate, d_gate, H);
  add("d_routed_up_weights", got.d_up, d_up, H);
  add("d_routed_down_weights", got.d_down, d_down, I);
  if (S > 0) {
    add("d_shared_gate_weights", got.d_shared_gate, d_sg, H);
    add("d_shared_up_weights", got.d_shared_up, d_su, H);
    add("d_shared_down_weights", got.d_shared_down, d_sd, S);
  }
  return r;
}

// ---- Sampled: the reference's products and roundings over the sampled rows and columns ----
//
// What follows repeats the reference's expert_forward / expert_backward (src/reference/
// reference.cpp) for the FP8 layer's products in float, rounding where it rounds: any difference
// in the order of an operation would show as a bit difference on the CPU backend.

// Expert e's [1, N, K] slab of an [E, N, K] tensor.
TensorView expert_slab(const HostTensor& t, std::int64_t e) {
  TensorView v = t.view();
  v.data = static_cast<char*>(v.data) + e * v.shape[1] * v.shape[2] * dtype_size(v.dtype);
  v.shape[0] = 1;
  return v;
}

// One local expert's routed weights quantized on the host (a slab quantizes into the blocks the
// whole tensor's quantization has for it).
struct ExpertFp8 {
  ExpertFp8(const LayerData& d, std::int64_t e)
      : gate(expert_slab(d.gate, e)), up(expert_slab(d.up, e)), down(expert_slab(d.down, e)) {}
  Fp8Expert get() const {
    return reference::fp8_expert(Fp8Weights{gate.get(), up.get(), down.get()}, 0);
  }
  HostQuantizedWeights gate, up, down;
};

// Rows [first, first + count) of an [N, K] block matrix, inside one 128-row block.
Fp8BlockMatrix rows_of(const Fp8BlockMatrix& m, std::int64_t first, std::int64_t count) {
  return {m.data + first * m.K, m.scales + (first / 128) * (m.K / 128), count, m.K};
}

float activation(const std::optional<float>& limit, float g, float u) {
  return limit ? numerics::swiglu_clamped(g, u, *limit) : numerics::swiglu(g, u);
}

void activation_backward(const std::optional<float>& limit, float g, float u, float dh, float* dg,
                         float* du) {
  if (limit) {
    numerics::swiglu_backward_clamped(g, u, dh, *limit, dg, du);
  } else {
    numerics::swiglu_backward(g, u, dh, dg, du);
  }
}

// The rows of `slots` (one expert's): their x, d_out and router weights, as floats.
struct Rows {
  std::int64_t n = 0;
  std::vector<float> x, d_out, weight;
  Rows(const LayerData& d, const std::vector<std::int64_t>& slots)
      : n(static_cast<std::int64_t>(slots.size())) {
    const std::int64_t H = d.problem.hidden_size, k = d.problem.topk;
    x.resize(n * H);
    d_out.resize(n * H);
    weight.resize(n);
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t t = slots[r] / k;
      for (std::int64_t c = 0; c < H; ++c) {
        x[r * H + c] = static_cast<float>(d.x.get(t * H + c));
        d_out[r * H + c] = static_cast<float>(d.d_out.get(t * H + c));
      }
      weight[r] = static_cast<float>(d.topk_weights.get(slots[r]));
    }
  }
};

// g, u rounded, h (from gate_up), then dh = bf16(w dh_u) with d_w = <dh_u, h> (from down_dgrad),
// then dg, du rounded: expert_forward's first half and expert_backward's, for N columns.
struct Activations {
  std::vector<float> g, u, h, dh, dg, du, dw;
  Activations(const Fp8Products& mm, const Rows& rows, const std::optional<float>& limit) {
    const std::int64_t n = rows.n, N = mm.N;
    g.resize(n * N), u.resize(n * N), h.resize(n * N), dh.resize(n * N), dg.resize(n * N);
    du.resize(n * N), dw.resize(n);
    mm.gate_up(rows.x.data(), g.data(), u.data());
    for (std::int64_t i = 0; i < n * N; ++i) {
      g[i] = round_to_bf16(g[i]);
      u[i] = round_to_bf16(u[i]);
      h[i] = round_to_bf16(activation(limit, g[i], u[i]));
    }
    mm.down_dgrad(rows.d_out.data(), dh.data());
    for (std::int64_t r = 0; r < n; ++r) {
      float dot = 0;
      for (std::int64_t i = r * N; i < (r + 1) * N; ++i) {
        dot += dh[i] * h[i];
        dh[i] = round_to_bf16(rows.weight[r] * dh[i]);
      }
      dw[r] = dot;
    }
    for (std::int64_t i = 0; i < n * N; ++i) {
      float a, b;
      activation_backward(limit, g[i], u[i], dh[i], &a, &b);
      dg[i] = round_to_bf16(a);
      du[i] = round_to_bf16(b);
    }
  }
};

// The sampled tokens' rows on one expert: y, dx [n, H] rounded and d_w [n].
void token_rows(const LayerData& d, const Fp8Expert& w, ThreadPool& pool, const Rows& rows,
                std::vector<float>& y, std::vector<float>& dx, std::vector<float>& dw) {
  const std::int64_t H = d.problem.hidden_size, I = d.problem.intermediate_size;
  const Fp8Products mm{pool, rows.n, H, I, w};
  const Activations a(mm, rows, d.swiglu_limit);
  y.resize(rows.n * H);
  dx.resize(rows.n * H);
  mm.down(a.h.data(), y.data());
  mm.gate_up_dgrad(a.dg.data(), a.du.data(), dx.data());
  for (std::int64_t i = 0; i < rows.n * H; ++i) {
    y[i] = round_to_bf16(y[i]);
    dx[i] = round_to_bf16(dx[i]);
  }
  dw = a.dw;
}

// One expert's weight gradients in columns [i0, i0 + n) of I, over all its rows: d_gate and d_up
// rows [n, H], d_down columns [H, n]. A column's g, u, h, dh, dg, du depend on that column of the
// weights only, and its token-axis blocks are quantized by themselves (or, `fp8_weight_grads`
// false, each element is a sum over the rows of that column alone).
struct ColumnGrads {
  std::int64_t expert = 0, i0 = 0, n = 0;
  std::vector<float> d_gate, d_up, d_down;
};

ColumnGrads column_grads(const LayerData& d, const Fp8Expert& w, ThreadPool& pool, const Rows& rows,
                         std::int64_t expert, std::int64_t i0, std::int64_t n,
                         bool fp8_weight_grads) {
  const std::int64_t H = d.problem.hidden_size;
  ColumnGrads c{expert,
                i0,
                n,
                std::vector<float>(n * H, 0.0f),
                std::vector<float>(n * H, 0.0f),
                std::vector<float>(H * n, 0.0f)};
  if (rows.n == 0) return c;  // the reference writes zeros
  Fp8Expert slice;
  slice.gate = rows_of(w.gate, i0, n);
  slice.up = rows_of(w.up, i0, n);
  slice.down_t = rows_of(w.down_t, i0, n);
  const Fp8Products mm{pool, rows.n, H, n, slice, fp8_weight_grads};
  const Activations a(mm, rows, d.swiglu_limit);
  std::vector<float> dy(rows.n * H);
  for (std::int64_t r = 0; r < rows.n; ++r) {
    for (std::int64_t col = 0; col < H; ++col) {
      dy[r * H + col] = round_to_bf16(rows.weight[r] * rows.d_out[r * H + col]);
    }
  }
  mm.weight_grads(dy.data(), a.h.data(), a.dg.data(), a.du.data(), rows.x.data(), c.d_down.data(),
                  c.d_gate.data(), c.d_up.data());
  return c;
}

// The shared expert's bf16 y and dx rows for `tokens`: the CPU bf16 layer over those tokens with
// every routed slot unused. Its rows are computed one by one (the same bits as in the whole
// layer), and with no routed slot its out and d_x are exactly y and dx.
void shared_rows(const LayerData& d, const std::vector<std::int64_t>& tokens, int threads,
                 std::vector<float>& y, std::vector<float>& dx) {
  const Problem& p = d.problem;
  const std::int64_t n = static_cast<std::int64_t>(tokens.size()), H = p.hidden_size,
                     I = p.intermediate_size;
  Problem sp = p;
  sp.num_tokens = n;
  sp.num_experts = 1;
  sp.topk = 1;
  sp.ep_size = 1;
  sp.ep_rank = 0;
  HostTensor x(DType::bf16, {n, H}), d_out(DType::bf16, {n, H}), ids(DType::i64, {n, 1}),
      w(DType::f32, {n, 1});
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t c = 0; c < H; ++c) {
      x.set(i * H + c, d.x.get(tokens[i] * H + c));
      d_out.set(i * H + c, d.d_out.get(tokens[i] * H + c));
    }
  }
  ids.fill(-1);
  w.fill(0);
  const Weights weights{expert_slab(d.gate, 0), expert_slab(d.up, 0), expert_slab(d.down, 0),
                        d.shared_gate.view(),   d.shared_up.view(),   d.shared_down.view(),
                        d.swiglu_limit};
  HostTensor out(DType::bf16, {n, H}), d_x(DType::bf16, {n, H}), d_w(DType::f32, {n, 1}),
      d_gate(DType::bf16, {1, I, H}), d_up(DType::bf16, {1, I, H}), d_down(DType::bf16, {1, H, I});
  HostTensor d_sg = like(d.d_shared_gate), d_su = like(d.d_shared_up), d_sd = like(d.d_shared_down);
  Workspace ws(sp, Config{}, {.backend = Backend::cpu, .num_threads = threads});
  HostContext ctx(ws);
  const Inputs in{x.view(), ids.view(), w.view()};
  forward(ws, in, weights, out.view(), ctx.get());
  backward(ws, in, weights, ctx.get(), d_out.view(),
           {d_x.view(), d_w.view(), d_gate.view(), d_up.view(), d_down.view(), d_sg.view(),
            d_su.view(), d_sd.view()});
  y.resize(n * H);
  dx.resize(n * H);
  for (std::int64_t i = 0; i < n * H; ++i) {
    y[i] = static_cast<float>(out.get(i));
    dx[i] = static_cast<float>(d_x.get(i));
  }
}

// A reference weight gradient as the gradient tensor stores it.
double stored(float v, const HostTensor& like) {
  return like.view().dtype == DType::bf16 ? double{round_to_bf16(v)} : double{v};
}

Fp8ReferenceReport check_sampled(const LayerData& d, bool bitwise, bool fp8_weight_grads,
                                 const CheckOptions& o) {
  const Problem& p = d.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     E = p.num_local_experts(), n_cols = kFp8SampleColumns;
  ThreadPool pool(o.num_threads);
  const std::vector<std::int64_t> tokens = sample_indices(T, o.sample_tokens, o.seed);
  const auto n_tok = static_cast<std::int64_t>(tokens.size());
  const std::vector<std::vector<std::int64_t>> slots_of = slots_by_local_expert(d);
  const std::vector<std::int64_t> experts = sampled_experts(slots_of, o);

  // The sampled tokens' slots by local expert; position ti * k + j in the per-slot results.
  std::vector<std::vector<std::int64_t>> token_slots(E), token_pos(E);
  for (std::int64_t ti = 0; ti < n_tok; ++ti) {
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = tokens[ti] * k + j;
      const double id = d.topk_experts.get(s);
      const auto e = static_cast<std::int64_t>(id) - p.first_local_expert();
      if (id < 0 || e < 0 || e >= E) continue;
      token_slots[e].push_back(s);
      token_pos[e].push_back(ti * k + j);
    }
  }
  std::vector<std::int64_t> needed = experts;
  for (std::int64_t e = 0; e < E; ++e) {
    if (!token_slots[e].empty()) needed.push_back(e);
  }
  std::sort(needed.begin(), needed.end());
  needed.erase(std::unique(needed.begin(), needed.end()), needed.end());

  std::vector<float> y(n_tok * k * H, 0.0f), dx(n_tok * k * H, 0.0f), dw(n_tok * k, 0.0f);
  std::vector<ColumnGrads> columns;
  // A pool's worth of experts at a time: their quantization, one expert a task; then every token
  // row on them, one row a task (a row is computed by itself; the reference's products split
  // their work by rows only, and the sampled tokens leave one or two rows on most experts); then
  // the sampled experts' columns, over all their rows, on the whole pool.
  const auto batch = static_cast<std::size_t>(pool.size());
  for (std::size_t b0 = 0; b0 < needed.size(); b0 += batch) {
    const std::size_t nb = std::min(batch, needed.size() - b0);
    std::vector<std::unique_ptr<ExpertFp8>> q(nb);
    pool.run(static_cast<std::int64_t>(nb),
             [&](std::int64_t i) { q[i] = std::make_unique<ExpertFp8>(d, needed[b0 + i]); });
    std::vector<std::pair<std::size_t, std::size_t>> rows;  // (expert of the batch, row)
    for (std::size_t i = 0; i < nb; ++i) {
      for (std::size_t r = 0; r < token_slots[needed[b0 + i]].size(); ++r) rows.push_back({i, r});
    }
    pool.run(static_cast<std::int64_t>(rows.size()), [&](std::int64_t task) {
      const auto [i, r] = rows[task];
      const std::int64_t e = needed[b0 + i], at = token_pos[e][r];
      ThreadPool one(1);
      std::vector<float> ye, dxe, dwe;
      token_rows(d, q[i]->get(), one, Rows(d, {token_slots[e][r]}), ye, dxe, dwe);
      std::copy_n(ye.data(), H, &y[at * H]);
      std::copy_n(dxe.data(), H, &dx[at * H]);
      dw[at] = dwe[0];
    });
    for (std::size_t i = 0; i < nb; ++i) {
      const std::int64_t e = needed[b0 + i];
      if (std::find(experts.begin(), experts.end(), e) == experts.end()) continue;
      const Rows expert_rows(d, slots_of[e]);
      for (std::int64_t group : sample_indices(I / n_cols, 3, o.seed + 2 + e)) {
        columns.push_back(column_grads(d, q[i]->get(), pool, expert_rows, e, group * n_cols, n_cols,
                                       fp8_weight_grads));
      }
    }
  }
  std::vector<float> shared_y, shared_dx;
  if (p.has_shared_expert()) shared_rows(d, tokens, o.num_threads, shared_y, shared_dx);

  // The home reductions of the sampled tokens, as the reference's combine and home_backward.
  std::vector<double> out_got, out_ref, dx_got, dx_ref, dw_got, dw_ref;
  for (std::int64_t ti = 0; ti < n_tok; ++ti) {
    const std::int64_t t = tokens[ti];
    for (std::int64_t c = 0; c < H; ++c) {
      float acc = p.has_shared_expert() ? shared_y[ti * H + c] : 0.0f;
      float acc_dx = p.has_shared_expert() ? shared_dx[ti * H + c] : 0.0f;
      for (std::int64_t j = 0; j < k; ++j) {
        if (d.topk_experts.get(t * k + j) < 0) continue;
        const auto w = static_cast<float>(d.topk_weights.get(t * k + j));
        acc = std::fma(w, y[(ti * k + j) * H + c], acc);
        acc_dx += dx[(ti * k + j) * H + c];
      }
      out_got.push_back(d.out.get(t * H + c));
      out_ref.push_back(round_to_bf16(acc));
      dx_got.push_back(d.d_x.get(t * H + c));
      dx_ref.push_back(round_to_bf16(acc_dx));
    }
    for (std::int64_t j = 0; j < k; ++j) {
      dw_got.push_back(d.d_topk_weights.get(t * k + j));
      dw_ref.push_back(stored(dw[ti * k + j], d.d_topk_weights));
    }
  }
  std::vector<double> g_got, g_ref, u_got, u_ref, dd_got, dd_ref;
  for (const ColumnGrads& c : columns) {
    for (std::int64_t i = 0; i < c.n; ++i) {
      for (std::int64_t col = 0; col < H; ++col) {
        const std::int64_t at = (c.expert * I + c.i0 + i) * H + col;
        g_got.push_back(d.d_gate.get(at));
        g_ref.push_back(stored(c.d_gate[i * H + col], d.d_gate));
        u_got.push_back(d.d_up.get(at));
        u_ref.push_back(stored(c.d_up[i * H + col], d.d_up));
      }
    }
    for (std::int64_t row = 0; row < H; ++row) {
      for (std::int64_t i = 0; i < c.n; ++i) {
        dd_got.push_back(d.d_down.get((c.expert * H + row) * I + c.i0 + i));
        dd_ref.push_back(stored(c.d_down[row * c.n + i], d.d_down));
      }
    }
  }
  Fp8ReferenceReport r;
  r.sampled = true;
  r.bitwise = bitwise;
  r.entries.push_back(compare("out", out_got, out_ref, H, bitwise));
  r.entries.push_back(compare("d_x", dx_got, dx_ref, H, bitwise));
  r.entries.push_back(compare("d_topk_weights", dw_got, dw_ref, k, bitwise));
  r.entries.push_back(compare("d_routed_gate_weights", g_got, g_ref, H, bitwise));
  r.entries.push_back(compare("d_routed_up_weights", u_got, u_ref, H, bitwise));
  r.entries.push_back(compare("d_routed_down_weights", dd_got, dd_ref, n_cols, bitwise));
  return r;
}

std::string scientific(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.3e", v);
  return s;
}

}  // namespace

Fp8ReferenceReport check_against_fp8_reference(const LayerData& got, bool bitwise,
                                               bool fp8_weight_grads, const CheckOptions& options) {
  return uses_sample(got.problem, options) ? check_sampled(got, bitwise, fp8_weight_grads, options)
                                           : check_full(got, bitwise, fp8_weight_grads, options);
}

std::string fp8_summary(const CheckReport& f64, const Fp8ReferenceReport& reference) {
  std::ostringstream s;
  s << (f64.sampled ? "sampled" : "full") << " check against the CPU FP8 layer ("
    << (reference.bitwise ? "bitwise: the CPU backend is that layer"
                          : "sum|diff|/sum|ref| <= " + scientific(kFp8ReferenceRelSum) +
                                ", every row <= " + scientific(kFp8ReferenceRowRelSum))
    << ") and against the f64 layer of the unquantized bf16 values (MoK's MXFP8 bounds: abs max "
    << "<= " << kMxfp8AbsMax << " on out and d_x, sum|diff|/sum|ref| <= " << kMxfp8RelSum
    << ", cosine >= " << kMxfp8Cosine << "):\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-22s | %-23s | %-9s  %-9s  %-8s\n", "", "CPU FP8 layer",
                "f64 layer", "", "");
  s << line;
  std::snprintf(line, sizeof line, "  %-22s | %-10s  %-10s  | %-9s  %-9s  %-8s\n", "tensor",
                reference.bitwise ? "values" : "rel", reference.bitwise ? "" : "worst row",
                "abs max", "rel", "cosine");
  s << line;
  for (const ErrorEntry& e : f64.entries) {
    const Fp8ReferenceEntry* r = reference.find(e.name);
    std::string ref_text = "-";
    if (r && r->bitwise) {
      ref_text = r->differing == 0 ? "identical"
                                   : std::to_string(r->differing) + " of " +
                                         std::to_string(r->compared) + " differ";
    } else if (r) {
      char t[64];
      std::snprintf(t, sizeof t, "%.3e   %.3e", r->rel_sum, r->worst_row);
      ref_text = t;
    }
    const bool ok = within_mxfp8_bounds(e) && (!r || r->passed());
    std::snprintf(line, sizeof line, "  %-22s | %-23s | %-9s  %.3e  %.6f  %s\n", e.name.c_str(),
                  ref_text.c_str(),
                  mxfp8_abs_max_applies(e.name) ? scientific(e.abs_max).c_str() : "-", e.rel_sum,
                  e.cosine, ok ? "ok" : "FAILED");
    s << line;
  }
  return s.str();
}

}  // namespace mok
