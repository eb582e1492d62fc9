#include "core/validate.hpp"

#include <cmath>
#include <cstdint>
#include <string>

namespace mok {

static std::string shape_list_text(std::initializer_list<std::int64_t> shape) {
  std::string s = "[";
  bool first = true;
  for (std::int64_t d : shape) {
    s += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return s + "]";
}

static void check_layout(const char* name, const TensorView& v,
                         std::initializer_list<std::int64_t> shape, Device device) {
  const std::string n = name;
  if (!v.defined() || (v.data == nullptr && v.numel() != 0)) {  // an empty view may be null
    throw Error(n, "a tensor of shape " + shape_list_text(shape), "none");
  }
  if (v.device != device) throw Error(n + ".device", device_name(device), device_name(v.device));
  bool same = v.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (std::int64_t s : shape) same = same && v.shape[d++] == s;
  if (!same) throw Error(n + ".shape", shape_list_text(shape), v.shape_text());
  if (!v.is_contiguous()) {
    throw Error(n + ".strides", "row-major contiguous strides", v.strides_text());
  }
}

// Routed weights (and, on the CPU backend, their gradients) may be row-strided: [E, R, C] views
// with unit column stride whose rows do not overlap (row stride >= C, expert stride >= R * row
// stride), e.g. the gate and up halves of one [E, 2I, H] tensor (row stride H, expert stride
// 2IH) or its interleaved rows (row stride 2H). NOTES: used in place, so a framework's packed
// weights need no copy per call (Hugging Face's gate_up_proj). The CUDA backend reads them
// through tensor maps whose row coordinate is expert * (expert stride / row stride) + row: there
// the row stride must be a multiple of 8 elements (TMA: 16-byte strides) and divide the expert
// stride.
static void check_row_strided_layout(const std::string& n, const TensorView& v, Device device) {
  const std::int64_t R = v.shape[1], C = v.shape[2];
  const std::int64_t expert = v.strides[0], row = v.strides[1];
  const std::string expected =
      "row-major contiguous strides, or row-strided ones: [expert, row, 1] with row >= " +
      to_text(C) + " and expert >= " + to_text(R) + " * row" +
      (device.kind == DeviceKind::cuda ? ", row a multiple of 8 that divides expert (CUDA)" : "");
  bool ok = (v.strides[2] == 1 || C == 1) && (row >= C || R == 1) &&
            (expert >= R * row || v.shape[0] == 1);
  if (device.kind == DeviceKind::cuda) {
    ok = ok && row % 8 == 0 && row > 0 && (v.shape[0] == 1 || expert % row == 0);
  }
  if (!ok) throw Error(n + ".strides", expected, v.strides_text());
}

// A routed weight or weight gradient ([E, R, C]) in dtype `a` or `b`: contiguous, or with
// `strided` row-strided as above.
static void check_weight_view(const char* name, const TensorView& v, DType a, DType b,
                              std::initializer_list<std::int64_t> shape, Device device,
                              bool strided) {
  if (!strided || !v.defined() || v.is_contiguous()) {
    check_view_either(name, v, a, b, shape, device);
    return;
  }
  const std::string n = name;
  if (v.dtype != a && v.dtype != b) {
    throw Error(
        n + ".dtype",
        a == b ? std::string(dtype_name(a)) : std::string(dtype_name(a)) + " or " + dtype_name(b),
        dtype_name(v.dtype));
  }
  if (v.data == nullptr && v.numel() != 0) {
    throw Error(n, "a tensor of shape " + shape_list_text(shape), "none");
  }
  if (v.device != device) throw Error(n + ".device", device_name(device), device_name(v.device));
  bool same = v.ndim == static_cast<int>(shape.size()) && v.ndim == 3;
  int d = 0;
  for (std::int64_t s : shape) same = same && v.shape[d++] == s;
  if (!same) throw Error(n + ".shape", shape_list_text(shape), v.shape_text());
  check_row_strided_layout(n, v, device);
}

void check_view(const char* name, const TensorView& v, DType dtype,
                std::initializer_list<std::int64_t> shape, Device device) {
  if (v.defined() && v.dtype != dtype) {
    throw Error(std::string(name) + ".dtype", dtype_name(dtype), dtype_name(v.dtype));
  }
  check_layout(name, v, shape, device);
}

void check_view_either(const char* name, const TensorView& v, DType a, DType b,
                       std::initializer_list<std::int64_t> shape, Device device) {
  if (v.defined() && v.dtype != a && v.dtype != b) {
    throw Error(std::string(name) + ".dtype", std::string(dtype_name(a)) + " or " + dtype_name(b),
                dtype_name(v.dtype));
  }
  check_layout(name, v, shape, device);
}

void check_absent(const char* name, const TensorView& v, const char* why) {
  if (v.defined())
    throw Error(name, std::string("none (") + why + ")", "a tensor " + v.shape_text());
}

static DType router_dtype(DType act) {
  return act == DType::f64 ? DType::f64 : DType::f32;
}

void check_aligned_16(const char* name, const TensorView& v) {
  if (v.data == nullptr) return;
  const auto address = reinterpret_cast<std::uintptr_t>(v.data);
  if (address % 16 != 0) {
    throw Error(name, "a view whose data starts at a multiple of 16 bytes",
                "address " + to_text(v.data) + " (" + to_text(address % 16) +
                    " bytes past a 16-byte boundary)");
  }
}

void check_inputs(const Problem& p, DType act, Device device, const Inputs& in, const Weights& w,
                  InputUse use, RoutedWeights routed) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk;
  // recompute_forward_context does not read these: absent is fine, present must be right.
  const bool optional = use == InputUse::context_only;
  auto unless_absent = [&](const TensorView& v) { return !(optional && !v.defined()); };
  check_view("x", in.x, act, {T, H}, device);
  check_view("topk_experts", in.topk_experts, DType::i64, {T, k}, device);
  if (unless_absent(in.topk_weights)) {
    check_view("topk_weights", in.topk_weights, router_dtype(act), {T, k}, device);
  }
  if (device.kind == DeviceKind::cuda) check_aligned_16("x", in.x);
  check_weights(p, act, device, w, use, routed);
}

void check_swiglu_limit(const std::optional<float>& limit) {
  if (!limit) return;
  if (!(std::isfinite(*limit) && *limit > 0.0f)) {
    throw Error("swiglu_limit", "None or a finite positive number", to_text(*limit));
  }
}

void check_weights(const Problem& p, DType act, Device device, const Weights& w, InputUse use,
                   RoutedWeights routed) {
  check_swiglu_limit(w.swiglu_limit);
  const std::int64_t H = p.hidden_size, I = p.intermediate_size, E = p.num_local_experts(),
                     S = p.shared_intermediate_size;
  const bool optional = use == InputUse::context_only;
  auto unless_absent = [&](const TensorView& v) { return !(optional && !v.defined()); };
  // Row-strided routed weights: every backend reads gate and up in place; the CUDA backend's down
  // projection reads W_down densely.
  const bool cpu = device.kind == DeviceKind::cpu;
  const bool read = routed == RoutedWeights::read;
  if (read || w.gate.defined()) {
    check_weight_view("routed_gate_weights", w.gate, act, act, {E, I, H}, device, true);
  }
  if (read || w.up.defined()) {
    check_weight_view("routed_up_weights", w.up, act, act, {E, I, H}, device, true);
  }
  if (read ? unless_absent(w.down) : w.down.defined()) {
    check_weight_view("routed_down_weights", w.down, act, act, {E, H, I}, device, cpu);
  }
  if (S > 0) {
    check_view("shared_gate_weights", w.shared_gate, act, {S, H}, device);
    check_view("shared_up_weights", w.shared_up, act, {S, H}, device);
    if (unless_absent(w.shared_down)) {
      check_view("shared_down_weights", w.shared_down, act, {H, S}, device);
    }
  } else {
    const char* why = "the problem has no shared expert (shared_intermediate_size = 0)";
    check_absent("shared_gate_weights", w.shared_gate, why);
    check_absent("shared_up_weights", w.shared_up, why);
    check_absent("shared_down_weights", w.shared_down, why);
  }
  if (device.kind == DeviceKind::cuda) {
    // One set of tensor-map strides serves gate and up (cuda/layer/layer.cu, ExpertRows).
    if (w.gate.defined() && w.up.defined() &&
        (w.gate.strides[1] != w.up.strides[1] || (E > 1 && w.gate.strides[0] != w.up.strides[0]))) {
      throw Error("routed_up_weights.strides",
                  "the strides of routed_gate_weights, " + w.gate.strides_text() +
                      " (the CUDA backend reads both through one geometry)",
                  w.up.strides_text());
    }
    check_aligned_16("routed_gate_weights", w.gate);
    check_aligned_16("routed_up_weights", w.up);
    check_aligned_16("routed_down_weights", w.down);
    check_aligned_16("shared_gate_weights", w.shared_gate);
    check_aligned_16("shared_up_weights", w.shared_up);
    check_aligned_16("shared_down_weights", w.shared_down);
  }
}

// One quantized routed weight of shape [E, N, K] (its four views named `name`.data, ...).
static void check_quantized(const std::string& name, const QuantizedWeights& q, std::int64_t E,
                            std::int64_t N, std::int64_t K, Device device) {
  constexpr std::int64_t B = 128;
  check_view((name + ".data").c_str(), q.data, DType::fp8_e4m3, {E, N, K}, device);
  check_view((name + ".scales").c_str(), q.scales, DType::f32, {E, N / B, K / B}, device);
  check_view((name + ".data_t").c_str(), q.data_t, DType::fp8_e4m3, {E, K, N}, device);
  check_view((name + ".scales_t").c_str(), q.scales_t, DType::f32, {E, K / B, N / B}, device);
  if (device.kind == DeviceKind::cuda) {  // the GEMMs read the bytes through tensor maps (TMA)
    check_aligned_16((name + ".data").c_str(), q.data);
    check_aligned_16((name + ".data_t").c_str(), q.data_t);
  }
}

void check_fp8_layer(const Problem& p, DType act, Device device, const Fp8Weights& q,
                     InputUse use) {
  const std::int64_t H = p.hidden_size, I = p.intermediate_size, E = p.num_local_experts();
  if (act != DType::bf16) {
    throw Error("WorkspaceOptions.activation_dtype", "bfloat16 for the FP8 layer", dtype_name(act));
  }
  // The 1x128 and 128x128 blocks tile both of every routed GEMM's dimensions.
  if (H % 128 != 0) {
    throw Error("hidden_size", "a multiple of 128 for the FP8 layer", to_text(H));
  }
  if (I % 128 != 0) {
    throw Error("intermediate_size", "a multiple of 128 for the FP8 layer", to_text(I));
  }
  check_quantized("fp8_weights.gate", q.gate, E, I, H, device);
  check_quantized("fp8_weights.up", q.up, E, I, H, device);
  const bool down_absent = !q.down.data.defined() && !q.down.scales.defined() &&
                           !q.down.data_t.defined() && !q.down.scales_t.defined();
  if (!(use == InputUse::context_only && down_absent)) {
    check_quantized("fp8_weights.down", q.down, E, H, I, device);
  }
}

void check_expert_ids_host(const Problem& p, const TensorView& topk_experts) {
  const auto* ids = topk_experts.ptr<const std::int64_t>();
  const std::int64_t n = p.num_tokens * p.topk;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t e = ids[i];
    if (e < -1 || e >= p.num_experts) {
      throw Error(
          "topk_experts[" + std::to_string(i / p.topk) + ", " + std::to_string(i % p.topk) + "]",
          "an expert id in [-1, " + std::to_string(p.num_experts) + ")", to_text(e));
    }
  }
}

void check_expert_ids_all_ranks(const Problem& p, const TensorView& topk_experts_all) {
  const auto* ids = topk_experts_all.ptr<const std::int64_t>();
  const std::int64_t per_rank = p.num_tokens * p.topk;
  for (std::int64_t i = 0; i < std::int64_t{p.ep_size} * per_rank; ++i) {
    if (ids[i] >= -1 && ids[i] < p.num_experts) continue;
    const std::int64_t q = i / per_rank, s = i % per_rank;
    throw Error("topk_experts[" + std::to_string(s / p.topk) + ", " + std::to_string(s % p.topk) +
                    "] of rank " + std::to_string(q),
                "an expert id in [-1, " + std::to_string(p.num_experts) + ")", to_text(ids[i]));
  }
}

void check_grads(const Problem& p, DType act, Device device, const Grads& g,
                 const BackwardOptions& options) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size,
                     E = p.num_local_experts(), k = p.topk, S = p.shared_intermediate_size;
  check_view("d_x", g.d_x, act, {T, H}, device);
  check_view("d_topk_weights", g.d_topk_weights, router_dtype(act), {T, k}, device);
  // Weight gradients: the activation dtype, or f32 for fp32 main-grad accumulation.
  const DType wide = act == DType::f64 ? DType::f64 : DType::f32;
  // Routed gradients may be row-strided (e.g. the halves of one [E, 2I, H] gradient): every
  // backend stores them in place (the CUDA weight-gradient epilogues through the row and expert
  // strides, its TMA store through a map of expert stride / row stride rows per expert).
  check_weight_view("d_routed_gate_weights", g.d_gate, act, wide, {E, I, H}, device, true);
  check_weight_view("d_routed_up_weights", g.d_up, act, wide, {E, I, H}, device, true);
  check_weight_view("d_routed_down_weights", g.d_down, act, wide, {E, H, I}, device, true);
  if (S > 0) {
    check_view_either("d_shared_gate_weights", g.d_shared_gate, act, wide, {S, H}, device);
    check_view_either("d_shared_up_weights", g.d_shared_up, act, wide, {S, H}, device);
    check_view_either("d_shared_down_weights", g.d_shared_down, act, wide, {H, S}, device);
  } else {
    const char* why = "the problem has no shared expert (shared_intermediate_size = 0)";
    check_absent("d_shared_gate_weights", g.d_shared_gate, why);
    check_absent("d_shared_up_weights", g.d_shared_up, why);
    check_absent("d_shared_down_weights", g.d_shared_down, why);
  }
  if (device.kind == DeviceKind::cuda) {
    check_aligned_16("d_x", g.d_x);
    check_aligned_16("d_routed_gate_weights", g.d_gate);
    check_aligned_16("d_routed_up_weights", g.d_up);
    check_aligned_16("d_routed_down_weights", g.d_down);
    check_aligned_16("d_shared_gate_weights", g.d_shared_gate);
    check_aligned_16("d_shared_up_weights", g.d_shared_up);
    check_aligned_16("d_shared_down_weights", g.d_shared_down);
  }
  if (options.accumulate_weight_grads) {
    for (const auto* v : {&g.d_gate, &g.d_up, &g.d_down}) {
      if (v->dtype != wide) {
        throw Error("BackwardOptions.accumulate_weight_grads",
                    std::string("weight gradients in ") + dtype_name(wide),
                    std::string("a gradient in ") + dtype_name(v->dtype));
      }
    }
  }
}

}  // namespace mok
