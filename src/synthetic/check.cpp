#include "synthetic/check.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "core/bf16.hpp"
#include "core/numerics.hpp"
#include "core/thread_pool.hpp"

namespace mok {

double relative_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - ref[i];
    diff += d * d;
    norm += ref[i] * ref[i];
  }
  if (std::isnan(diff)) return NAN;
  if (norm == 0) return diff == 0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

double scaled_error(const std::vector<double>& got, const std::vector<double>& ref,
                    double scale_norm) {
  double diff = 0;
  for (std::size_t i = 0; i < got.size(); ++i) diff += (got[i] - ref[i]) * (got[i] - ref[i]);
  if (std::isnan(diff) || std::isnan(scale_norm)) return NAN;
  if (scale_norm == 0) return diff == 0 ? 0.0 : INFINITY;
  return std::sqrt(diff) / scale_norm;
}

bool CheckReport::passed() const {
  return std::all_of(entries.begin(), entries.end(),
                     [](const ErrorEntry& e) { return e.passed(); });
}

double CheckReport::out_rel_err() const {
  for (const auto& e : entries) {
    if (e.name == "out") return e.rel_err;
  }
  return NAN;
}

double CheckReport::grad_rel_err_max() const {
  double m = 0;
  bool any = false;
  for (const auto& e : entries) {
    if (e.name == "out") continue;
    any = true;
    if (std::isnan(e.rel_err)) return NAN;
    m = std::max(m, e.rel_err);
  }
  return any ? m : NAN;
}

std::string CheckReport::summary() const {
  std::ostringstream s;
  s << (sampled ? "sampled" : "full") << " check against the f64 layer:\n";
  for (const auto& e : entries) {
    s << "  " << e.name << ": rel_err " << e.rel_err << " (tolerance " << e.tolerance << ", "
      << e.compared << " values) " << (e.passed() ? "ok" : "FAILED") << "\n";
  }
  return s.str();
}

namespace {

std::vector<double> all_values(const HostTensor& t) {
  std::vector<double> v(t.numel());
  for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = t.get(i);
  return v;
}

// An entry whose rel_err is `rel_err`, with MoK's measures of got against ref.
ErrorEntry measured(const char* name, const std::vector<double>& got,
                    const std::vector<double>& ref, double rel_err, double tolerance) {
  ErrorEntry e{name, rel_err, tolerance, static_cast<std::int64_t>(got.size())};
  double diff = 0, sum_ref = 0, dot = 0, norm_got = 0, norm_ref = 0, abs_max = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(got[i] - ref[i]);
    abs_max = std::isnan(d) ? NAN : std::max(abs_max, d);  // max() drops a NaN second argument
    diff += d;
    sum_ref += std::fabs(ref[i]);
    dot += got[i] * ref[i];
    norm_got += got[i] * got[i];
    norm_ref += ref[i] * ref[i];
  }
  e.abs_max = abs_max;
  e.rel_sum = sum_ref > 0 ? diff / sum_ref : (diff == 0 ? 0.0 : diff / sum_ref);
  const double norms = std::sqrt(norm_got * norm_ref);
  e.cosine = norms > 0 ? dot / norms : (norm_got == norm_ref ? 1.0 : dot / norms);
  return e;
}

ErrorEntry compared(const char* name, const std::vector<double>& got,
                    const std::vector<double>& ref, double tolerance) {
  return measured(name, got, ref, relative_error(got, ref), tolerance);
}

ErrorEntry compare_full(const char* name, const HostTensor& got, const HostTensor& ref,
                        double tolerance) {
  return compared(name, all_values(got), all_values(ref), tolerance);
}

double dw_scale_norm(const LayerData& d, const std::vector<std::int64_t>& tokens, int threads);

CheckReport check_full(const LayerData& got, const CheckOptions& o) {
  LayerData ref = convert_layer_data(got, DType::f64);
  Workspace ws(
      got.problem, Config{},
      {.backend = Backend::cpu, .activation_dtype = DType::f64, .num_threads = o.num_threads});
  HostContext ctx(ws);
  forward(ws, ref.inputs(), ref.weights(), ref.out.view(), ctx.get());
  CheckReport r;
  r.entries.push_back(compare_full("out", got.out, ref.out, kForwardTolerance));
  if (!o.check_backward) return r;
  backward(ws, ref.inputs(), ref.weights(), ctx.get(), ref.d_out.view(), ref.grads());
  const double tol = kGradientTolerance;
  r.entries.push_back(compare_full("d_x", got.d_x, ref.d_x, tol));
  std::vector<std::int64_t> all_tokens(got.problem.num_tokens);
  std::iota(all_tokens.begin(), all_tokens.end(), 0);
  const auto dw_got = all_values(got.d_topk_weights), dw_ref = all_values(ref.d_topk_weights);
  r.entries.push_back(
      measured("d_topk_weights", dw_got, dw_ref,
               scaled_error(dw_got, dw_ref, dw_scale_norm(got, all_tokens, o.num_threads)), tol));
  r.entries.push_back(compare_full("d_routed_gate_weights", got.d_gate, ref.d_gate, tol));
  r.entries.push_back(compare_full("d_routed_up_weights", got.d_up, ref.d_up, tol));
  r.entries.push_back(compare_full("d_routed_down_weights", got.d_down, ref.d_down, tol));
  if (got.problem.has_shared_expert()) {
    r.entries.push_back(
        compare_full("d_shared_gate_weights", got.d_shared_gate, ref.d_shared_gate, tol));
    r.entries.push_back(compare_full("d_shared_up_weights", got.d_shared_up, ref.d_shared_up, tol));
    r.entries.push_back(
        compare_full("d_shared_down_weights", got.d_shared_down, ref.d_shared_down, tol));
  }
  return r;
}

// ---- Sampled check: an independent, direct f64 evaluation of a few tokens and weight slices ----

// A [rows, cols] row-major matrix inside a tensor, read as f64.
struct Mat {
  const HostTensor* t;
  std::int64_t offset, rows, cols;
  double at(std::int64_t r, std::int64_t c) const { return t->get(offset + r * cols + c); }
};

// Reads matrices with the storage type resolved once per call: the sampled check spends most of
// its time here.
template <typename F>
void with_row(const Mat& m, std::int64_t r, F&& f) {
  const TensorView& v = m.t->view();
  const std::int64_t base = m.offset + r * m.cols;
  if (v.dtype == DType::bf16) {
    const bf16_t* p = v.ptr<const bf16_t>() + base;
    f([p](std::int64_t c) { return double(bf16_to_float(p[c])); });
  } else {
    const double* p = v.ptr<const double>() + base;
    f([p](std::int64_t c) { return p[c]; });
  }
}

// y = M v
std::vector<double> matvec(const Mat& m, const std::vector<double>& v) {
  std::vector<double> y(m.rows, 0.0);
  for (std::int64_t r = 0; r < m.rows; ++r) {
    with_row(m, r, [&](auto at) {
      double acc = 0;
      for (std::int64_t c = 0; c < m.cols; ++c) acc += at(c) * v[c];
      y[r] = acc;
    });
  }
  return y;
}

// y += M^T v
void matvec_t_add(const Mat& m, const std::vector<double>& v, std::vector<double>& y) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    if (v[r] == 0) continue;
    with_row(m, r, [&](auto at) {
      for (std::int64_t c = 0; c < m.cols; ++c) y[c] += at(c) * v[r];
    });
  }
}

struct ExpertMats {
  Mat gate, up, down;  // [N, H], [N, H], [H, N]
  std::optional<float> swiglu_limit;
};

// The layer's activation and its gradients in f64, plain or clamped (Weights::swiglu_limit).
double activation(const std::optional<float>& limit, double g, double u) {
  return limit ? numerics::swiglu_clamped(g, u, double{*limit}) : numerics::swiglu(g, u);
}
void activation_backward(const std::optional<float>& limit, double g, double u, double dh,
                         double* dg, double* du) {
  if (limit) {
    numerics::swiglu_backward_clamped(g, u, dh, double{*limit}, dg, du);
  } else {
    numerics::swiglu_backward(g, u, dh, dg, du);
  }
}

ExpertMats routed_mats(const LayerData& d, std::int64_t e) {
  const std::int64_t H = d.problem.hidden_size, I = d.problem.intermediate_size;
  return {{&d.gate, e * I * H, I, H},
          {&d.up, e * I * H, I, H},
          {&d.down, e * H * I, H, I},
          d.swiglu_limit};
}

ExpertMats shared_mats(const LayerData& d) {
  const std::int64_t H = d.problem.hidden_size, S = d.problem.shared_intermediate_size;
  return {{&d.shared_gate, 0, S, H},
          {&d.shared_up, 0, S, H},
          {&d.shared_down, 0, H, S},
          d.swiglu_limit};
}

// One expert on one row: output y, and (given dy) the row's dx contribution.
void expert_row(const ExpertMats& m, const std::vector<double>& x, const std::vector<double>* dy,
                std::vector<double>* y, std::vector<double>* dx) {
  const auto g = matvec(m.gate, x), u = matvec(m.up, x);
  std::vector<double> h(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) h[i] = activation(m.swiglu_limit, g[i], u[i]);
  if (y) *y = matvec(m.down, h);
  if (dy && dx) {
    std::vector<double> dh(g.size(), 0.0), dg(g.size()), du(g.size());
    matvec_t_add(m.down, *dy, dh);
    for (std::size_t i = 0; i < g.size(); ++i)
      activation_backward(m.swiglu_limit, g[i], u[i], dh[i], &dg[i], &du[i]);
    matvec_t_add(m.gate, dg, *dx);
    matvec_t_add(m.up, du, *dx);
  }
}

// sqrt(sum over used slots of ||d_out[t]||^2 ||y[t, j]||^2 / H), y evaluated in f64: the scale of
// d_topk_weights' rounding error (check.hpp).
double dw_scale_norm(const LayerData& d, const std::vector<std::int64_t>& tokens, int threads) {
  const std::int64_t H = d.problem.hidden_size, k = d.problem.topk;
  ThreadPool pool(threads);
  std::vector<double> part(tokens.size(), 0.0);
  pool.run(static_cast<std::int64_t>(tokens.size()), [&](std::int64_t i) {
    const std::int64_t t = tokens[i];
    std::vector<double> x(H), y;
    double dout2 = 0;
    for (std::int64_t c = 0; c < H; ++c) {
      x[c] = d.x.get(t * H + c);
      dout2 += d.d_out.get(t * H + c) * d.d_out.get(t * H + c);
    }
    for (std::int64_t j = 0; j < k; ++j) {
      const auto e = static_cast<std::int64_t>(d.topk_experts.get(t * k + j));
      if (e < 0) continue;
      expert_row(routed_mats(d, e), x, nullptr, &y, nullptr);
      double y2 = 0;
      for (double v : y) y2 += v * v;
      part[i] += dout2 * y2 / H;
    }
  });
  double sum = 0;
  for (double v : part) sum += v;  // fixed order
  return std::sqrt(sum);
}

}  // namespace

std::vector<std::int64_t> sample_indices(std::int64_t n, std::int64_t count, std::uint64_t seed) {
  std::vector<std::int64_t> out;
  if (n <= 0) return out;
  out.push_back(0);
  if (n > 1) out.push_back(n - 1);
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  while (static_cast<std::int64_t>(out.size()) < std::min(n, count)) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const auto v = static_cast<std::int64_t>(s % static_cast<std::uint64_t>(n));
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::vector<std::int64_t>> slots_by_local_expert(const LayerData& d) {
  const Problem& p = d.problem;
  std::vector<std::vector<std::int64_t>> slots_of(p.num_local_experts());
  for (std::int64_t s = 0; s < p.num_tokens * p.topk; ++s) {
    const auto e = static_cast<std::int64_t>(d.topk_experts.get(s)) - p.first_local_expert();
    if (d.topk_experts.get(s) >= 0 && e >= 0 && e < p.num_local_experts()) slots_of[e].push_back(s);
  }
  return slots_of;
}

std::vector<std::int64_t> sampled_experts(const std::vector<std::vector<std::int64_t>>& slots_of,
                                          const CheckOptions& o) {
  const auto E = static_cast<std::int64_t>(slots_of.size());
  std::vector<std::int64_t> experts = sample_indices(E, o.sample_experts, o.seed + 1);
  const auto busiest = std::max_element(slots_of.begin(), slots_of.end(),
                                        [](auto& a, auto& b) { return a.size() < b.size(); });
  const auto idlest = std::min_element(slots_of.begin(), slots_of.end(),
                                       [](auto& a, auto& b) { return a.size() < b.size(); });
  for (auto it : {busiest, idlest}) {
    const std::int64_t e = it - slots_of.begin();
    if (std::find(experts.begin(), experts.end(), e) == experts.end()) experts.push_back(e);
  }
  return experts;
}

namespace {

CheckReport check_sampled(const LayerData& d, const CheckOptions& o) {
  const Problem& p = d.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size;
  ThreadPool pool(o.num_threads);
  const auto tokens = sample_indices(T, o.sample_tokens, o.seed);
  const auto n_tok = static_cast<std::int64_t>(tokens.size());
  auto row_of = [](const HostTensor& t, std::int64_t offset, std::int64_t n) {
    std::vector<double> v(n);
    for (std::int64_t i = 0; i < n; ++i) v[i] = t.get(offset + i);
    return v;
  };

  // Per sampled token: out, d_x and d_topk_weights, reference and got.
  std::vector<std::vector<double>> out_ref(n_tok), dx_ref(n_tok), dw_ref(n_tok);
  pool.run(n_tok, [&](std::int64_t i) {
    const std::int64_t t = tokens[i];
    const auto x = row_of(d.x, t * H, H), dout = row_of(d.d_out, t * H, H);
    std::vector<double> out(H, 0.0), dx(H, 0.0), dw(k, 0.0), y;
    if (S > 0) {
      expert_row(shared_mats(d), x, o.check_backward ? &dout : nullptr, &y, &dx);
      out = y;
    }
    for (std::int64_t j = 0; j < k; ++j) {
      const auto e = static_cast<std::int64_t>(d.topk_experts.get(t * k + j));
      if (e < 0) continue;
      const double w = d.topk_weights.get(t * k + j);
      std::vector<double> dy(H);
      for (std::int64_t c = 0; c < H; ++c) dy[c] = w * dout[c];
      expert_row(routed_mats(d, e), x, o.check_backward ? &dy : nullptr, &y, &dx);
      for (std::int64_t c = 0; c < H; ++c) out[c] += w * y[c];
      for (std::int64_t c = 0; c < H; ++c) dw[j] += dout[c] * y[c];
    }
    out_ref[i] = out;
    dx_ref[i] = dx;
    dw_ref[i] = dw;
  });

  CheckReport r;
  r.sampled = true;
  auto add_tokens = [&](const char* name, const HostTensor& got,
                        const std::vector<std::vector<double>>& ref, std::int64_t width,
                        double tol) {
    std::vector<double> g, f;
    for (std::int64_t i = 0; i < n_tok; ++i) {
      const auto row = row_of(got, tokens[i] * width, width);
      g.insert(g.end(), row.begin(), row.end());
      f.insert(f.end(), ref[i].begin(), ref[i].end());
    }
    r.entries.push_back(compared(name, g, f, tol));
  };
  add_tokens("out", d.out, out_ref, H, kForwardTolerance);
  if (!o.check_backward) return r;
  add_tokens("d_x", d.d_x, dx_ref, H, kGradientTolerance);
  {
    std::vector<double> g, f;
    for (std::int64_t i = 0; i < n_tok; ++i) {
      const auto row = row_of(d.d_topk_weights, tokens[i] * k, k);
      g.insert(g.end(), row.begin(), row.end());
      f.insert(f.end(), dw_ref[i].begin(), dw_ref[i].end());
    }
    r.entries.push_back(measured("d_topk_weights", g, f,
                                 scaled_error(g, f, dw_scale_norm(d, tokens, o.num_threads)),
                                 kGradientTolerance));
  }

  // Weight gradients: for sampled (expert, column i): dW_gate[e][i, :], dW_up[e][i, :] and
  // dW_down[e][:, i], reduced over all of the expert's rows.
  const std::vector<std::vector<std::int64_t>> slots_of = slots_by_local_expert(d);
  const std::vector<std::int64_t> experts = sampled_experts(slots_of, o);

  struct Slice {  // one (expert, column) sample; expert -1 = shared
    std::int64_t expert, column;
    std::vector<double> gate_ref, up_ref, down_ref, gate_got, up_got, down_got;
  };
  std::vector<Slice> slices;
  for (std::int64_t e : experts) {
    for (std::int64_t i : sample_indices(I, o.sample_columns, o.seed + 2 + e)) {
      slices.push_back({e, i});
    }
  }
  if (S > 0) {
    for (std::int64_t i : sample_indices(S, o.sample_columns, o.seed + 3)) {
      slices.push_back({-1, i});
    }
  }
  pool.run(static_cast<std::int64_t>(slices.size()), [&](std::int64_t n) {
    Slice& sl = slices[n];
    const bool shared = sl.expert < 0;
    const ExpertMats m = shared ? shared_mats(d) : routed_mats(d, sl.expert);
    const std::int64_t N = shared ? S : I, i = sl.column;
    const HostTensor& dg_t = shared ? d.d_shared_gate : d.d_gate;
    const HostTensor& du_t = shared ? d.d_shared_up : d.d_up;
    const HostTensor& dd_t = shared ? d.d_shared_down : d.d_down;
    const std::int64_t base = shared ? 0 : sl.expert * N * H;
    sl.gate_ref.assign(H, 0.0);
    sl.up_ref.assign(H, 0.0);
    sl.down_ref.assign(H, 0.0);
    std::vector<std::int64_t> rows;
    if (shared) {
      for (std::int64_t t = 0; t < T; ++t) rows.push_back(t * k);  // slot only names the token
    } else {
      rows = slots_of[sl.expert];
    }
    const std::vector<double> wg_i = row_of(*m.gate.t, m.gate.offset + i * H, H);
    const std::vector<double> wu_i = row_of(*m.up.t, m.up.offset + i * H, H);
    std::vector<double> wd_i(H);
    for (std::int64_t c = 0; c < H; ++c) wd_i[c] = m.down.at(c, i);
    for (std::int64_t s : rows) {
      const std::int64_t t = s / k;
      const double w = shared ? 1.0 : d.topk_weights.get(s);
      const auto x = row_of(d.x, t * H, H), dout = row_of(d.d_out, t * H, H);
      double g = 0, u = 0, dh = 0;
      for (std::int64_t c = 0; c < H; ++c) {
        g += wg_i[c] * x[c];
        u += wu_i[c] * x[c];
        dh += wd_i[c] * dout[c];
      }
      dh *= w;
      const double h = activation(d.swiglu_limit, g, u);
      double dg, du;
      activation_backward(d.swiglu_limit, g, u, dh, &dg, &du);
      for (std::int64_t c = 0; c < H; ++c) {
        sl.gate_ref[c] += dg * x[c];
        sl.up_ref[c] += du * x[c];
        sl.down_ref[c] += h * w * dout[c];
      }
    }
    sl.gate_got = row_of(dg_t, base + i * H, H);
    sl.up_got = row_of(du_t, base + i * H, H);
    sl.down_got.resize(H);
    for (std::int64_t c = 0; c < H; ++c) sl.down_got[c] = dd_t.get(base + c * N + i);
  });
  for (bool shared : {false, true}) {
    if (shared && S == 0) continue;
    std::vector<double> g[3], f[3];
    for (const Slice& sl : slices) {
      if ((sl.expert < 0) != shared) continue;
      g[0].insert(g[0].end(), sl.gate_got.begin(), sl.gate_got.end());
      f[0].insert(f[0].end(), sl.gate_ref.begin(), sl.gate_ref.end());
      g[1].insert(g[1].end(), sl.up_got.begin(), sl.up_got.end());
      f[1].insert(f[1].end(), sl.up_ref.begin(), sl.up_ref.end());
      g[2].insert(g[2].end(), sl.down_got.begin(), sl.down_got.end());
      f[2].insert(f[2].end(), sl.down_ref.begin(), sl.down_ref.end());
    }
    const char* names[2][3] = {
        {"d_routed_gate_weights", "d_routed_up_weights", "d_routed_down_weights"},
        {"d_shared_gate_weights", "d_shared_up_weights", "d_shared_down_weights"}};
    for (int n = 0; n < 3; ++n) {
      r.entries.push_back(compared(names[shared][n], g[n], f[n], kGradientTolerance));
    }
  }
  return r;
}

}  // namespace

bool uses_sample(const Problem& p, const CheckOptions& options) {
  const double f64_flops = 3.0 * p.forward_flops(p.num_tokens * p.topk);
  return !(f64_flops <= options.max_full_flops);
}

CheckReport check_against_f64(const LayerData& got, const CheckOptions& options) {
  return uses_sample(got.problem, options) ? check_sampled(got, options) : check_full(got, options);
}

}  // namespace mok
