// Small helpers shared by the C++ tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mok/api.hpp"
#include "synthetic/check.hpp"
#include "synthetic/synthetic.hpp"
#include "test_seed.hpp"

namespace mok::test {

inline void run_layer(LayerData& d, int threads = 0, bool backward_too = true) {
  Workspace ws(d.problem, Config{},
               {.backend = Backend::cpu, .activation_dtype = d.act, .num_threads = threads});
  HostContext ctx(ws);
  forward(ws, d.inputs(), d.weights(), d.out.view(), ctx.get());
  if (backward_too) backward(ws, d.inputs(), d.weights(), ctx.get(), d.d_out.view(), d.grads());
}

// Inputs on a grid whose products and sums are exact in bf16 and fp32: the gate and up weights in
// {-1, -1/2, 0, 1/2, 1}, x the same at H = 64 and in {-1/2, 0, 1/2} at H = 128 (where I < H can
// be tested), so every g and u is a multiple of 1/4 of magnitude at most 64, exactly
// representable in bf16. The bf16 layer's g and u are then the exact ones: the clamp decides
// every element as the f64 layer does (random data would put a few elements within a bf16
// rounding of the limit, on different sides in the two layers), and many land exactly on +-L (the
// boundary, where the gradient flows). Down weights, router weights and d_out stay random. The
// clamped-SwiGLU tests' inputs (test_swiglu_limit.cpp and its GPU twin).
inline LayerData grid_layer(const Problem& p, std::uint64_t seed, Routing r) {
  EXPECT_TRUE(p.hidden_size == 64 || p.hidden_size == 128) << "H " << p.hidden_size;
  LayerData d = make_layer_data(p, DType::bf16, seed, r);
  std::mt19937_64 rng(seed ^ 0x5eed);
  const int x_steps = p.hidden_size == 64 ? 2 : 1;  // |x| <= 64 / H: |g|, |u| <= 64
  std::uniform_int_distribution<int> pick(-2, 2), pick_x(-x_steps, x_steps);
  for (HostTensor* t : {&d.x, &d.gate, &d.up, &d.shared_gate, &d.shared_up}) {
    if (!t->defined()) continue;  // no shared expert (S = 0)
    auto& draw = t == &d.x ? pick_x : pick;
    for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 0.5 * draw(rng));
  }
  return d;
}

// Byte equality of two host tensors (bitwise determinism checks).
inline bool same_bits(const HostTensor& a, const HostTensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  const std::size_t n = a.numel() * dtype_size(a.view().dtype);
  return a.numel() == b.numel() && std::memcmp(a.view().data, b.view().data, n) == 0;
}

inline bool all_outputs_same(const LayerData& a, const LayerData& b) {
  return same_bits(a.out, b.out) && same_bits(a.d_x, b.d_x) &&
         same_bits(a.d_topk_weights, b.d_topk_weights) && same_bits(a.d_gate, b.d_gate) &&
         same_bits(a.d_up, b.d_up) && same_bits(a.d_down, b.d_down) &&
         same_bits(a.d_shared_gate, b.d_shared_gate) && same_bits(a.d_shared_up, b.d_shared_up) &&
         same_bits(a.d_shared_down, b.d_shared_down);
}

inline Problem layer_shape(std::int64_t T, std::int64_t H, std::int64_t I, std::int64_t E,
                           std::int64_t k, std::int64_t S) {
  return {.num_tokens = T,
          .hidden_size = H,
          .intermediate_size = I,
          .num_experts = E,
          .topk = k,
          .shared_intermediate_size = S};
}

// ---- row-strided routed weights and gradients (core/validate.cpp)

// gate and up packed in one [E, 2I, H] tensor, concatenated (rows [0, I) gate, [I, 2I) up) or
// interleaved (even rows gate, odd rows up): the two row-strided views of it.
struct Packed {
  HostTensor storage;
  TensorView gate, up;
};

inline Packed pack(const HostTensor& gate, const HostTensor& up, bool interleaved) {
  const TensorView& g = gate.view();
  const std::int64_t E = g.shape[0], I = g.shape[1], H = g.shape[2];
  Packed p{HostTensor(g.dtype, {E, 2 * I, H}), g, g};
  p.gate.strides = {2 * I * H, interleaved ? 2 * H : H, 1, 0};
  p.up.strides = p.gate.strides;
  const std::int64_t up_offset = interleaved ? H : I * H;
  p.gate.data = p.storage.view().data;
  p.up.data = static_cast<char*>(p.storage.view().data) + up_offset * dtype_size(g.dtype);
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t i = 0; i < I * H; ++i) {
      const std::int64_t row = interleaved ? 2 * (i / H) : i / H;
      const std::int64_t at = e * 2 * I * H + row * H + i % H;
      p.storage.set(at, gate.get(e * I * H + i));
      p.storage.set(at + up_offset, up.get(e * I * H + i));
    }
  }
  return p;
}

// `dense` [E, R, C] in rows padded to C + pad columns: the padded storage (the padding `fill`)
// and the [E, R, C] row-strided view of it.
struct Padded {
  HostTensor storage;
  TensorView view;
};

inline Padded pad_rows(const HostTensor& dense, std::int64_t pad, double fill) {
  const TensorView& d = dense.view();
  const std::int64_t E = d.shape[0], R = d.shape[1], C = d.shape[2], ld = C + pad;
  Padded p{HostTensor(d.dtype, {E, R, ld}), d};
  p.storage.fill(fill);
  p.view.data = p.storage.view().data;
  p.view.strides = {R * ld, ld, 1, 0};
  for (std::int64_t row = 0; row < E * R; ++row) {
    for (std::int64_t c = 0; c < C; ++c) p.storage.set(row * ld + c, dense.get(row * C + c));
  }
  return p;
}

inline bool all_finite(const HostTensor& t) {
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.get(i))) return false;
  }
  return true;
}

// Every entry of `param`'s gradient `grad` against a central difference of `loss()` (f64, eps
// 1e-6), within `tolerance` relative (check.hpp's relative_error); the callers say why theirs.
template <typename Loss>
void check_gradient_by_differences(HostTensor& param, const HostTensor& grad, const char* name,
                                   Loss&& loss, double tolerance) {
  constexpr double eps = 1e-6;
  std::vector<double> fd(param.numel()), an(param.numel());
  for (std::int64_t i = 0; i < param.numel(); ++i) {
    const double v = param.get(i);
    param.set(i, v + eps);
    const double up = loss();
    param.set(i, v - eps);
    const double down = loss();
    param.set(i, v);
    fd[i] = (up - down) / (2 * eps);
    an[i] = grad.get(i);
  }
  EXPECT_LT(relative_error(an, fd), tolerance) << name;
}

// Runs `f`, expects a mok::Error whose message contains every string in `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected mok::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

}  // namespace mok::test
