#include "synthetic/synthetic.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/bf16.hpp"
#include "core/fp8.hpp"
#include "core/thread_pool.hpp"

namespace mok {
namespace {

// splitmix64: a small, fast, platform-independent generator.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {                                                           // Box-Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t state_;
};

// Element i of a tensor is drawn from its own generator, seeded by (the stream's next value, i):
// the values do not depend on how the work is split, so large tensors fill on every core.
void fill_normal(HostTensor& t, Rng& rng, double scale) {
  const std::uint64_t base = rng.next();
  constexpr std::int64_t kChunk = 1 << 16;
  const std::int64_t n = t.numel(), chunks = (n + kChunk - 1) / kChunk;
  ThreadPool pool(chunks > 1 ? 0 : 1);
  pool.run(chunks, [&](std::int64_t c) {
    const std::int64_t end = std::min(n, (c + 1) * kChunk);
    for (std::int64_t i = c * kChunk; i < end; ++i) {
      Rng element(base ^ (static_cast<std::uint64_t>(i) * 0xd1b54a32d192ed03ull));
      t.set(i, element.normal() * scale);
    }
  });
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::initializer_list<std::int64_t> shape) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  storage_.assign((n * dtype_size(dtype) + 7) / 8 + 1, 0);
  view_ = TensorView::contiguous(storage_.data(), dtype, shape);
}

double HostTensor::get(std::int64_t i) const {
  switch (view_.dtype) {
    case DType::bf16:
      return bf16_to_float(view_.ptr<const bf16_t>()[i]);
    case DType::f32:
      return view_.ptr<const float>()[i];
    case DType::f64:
      return view_.ptr<const double>()[i];
    case DType::i32:
      return view_.ptr<const std::int32_t>()[i];
    case DType::i64:
      return static_cast<double>(view_.ptr<const std::int64_t>()[i]);
    case DType::fp8_e4m3:
      return fp8::e4m3_to_float(view_.ptr<const fp8::e4m3_t>()[i]);
    case DType::u8:
      return view_.ptr<const std::uint8_t>()[i];
  }
  return 0;
}

void HostTensor::set(std::int64_t i, double v) {
  switch (view_.dtype) {
    case DType::bf16:
      view_.ptr<bf16_t>()[i] = float_to_bf16(static_cast<float>(v));
      return;
    case DType::f32:
      view_.ptr<float>()[i] = static_cast<float>(v);
      return;
    case DType::f64:
      view_.ptr<double>()[i] = v;
      return;
    case DType::i32:
      view_.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(v);
      return;
    case DType::i64:
      view_.ptr<std::int64_t>()[i] = static_cast<std::int64_t>(v);
      return;
    case DType::fp8_e4m3:
      view_.ptr<fp8::e4m3_t>()[i] = fp8::e4m3_from_float(static_cast<float>(v));
      return;
    case DType::u8:
      view_.ptr<std::uint8_t>()[i] = static_cast<std::uint8_t>(v);
      return;
  }
}

void HostTensor::fill(double v) {
  for (std::int64_t i = 0; i < numel(); ++i) set(i, v);
}

void HostTensor::fill_bytes(unsigned char byte) {
  std::memset(storage_.data(), byte, storage_.size() * sizeof(std::uint64_t));
}

HostQuantizedWeights::HostQuantizedWeights(const TensorView& w) {
  const QuantizedWeightsLayout layout =
      quantized_weights_layout(w.shape[0], w.shape[1], w.shape[2]);
  storage_.assign(layout.bytes / 8 + 1, 0);
  q_ = quantized_weights_views(layout, storage_.data());
  quantize_weights(w, q_);
}

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::softmax:
      return "uniform";
    case Routing::skewed:
      return "skewed";
    case Routing::one_expert:
      return "one-expert";
  }
  return "unknown";
}

Inputs LayerData::inputs() const {
  return {x.view(), topk_experts.view(), topk_weights.view()};
}

Weights LayerData::weights() const {
  return {gate.view(),        up.view(),        down.view(),
          shared_gate.view(), shared_up.view(), shared_down.view(), swiglu_limit};
}

Grads LayerData::grads() const {
  return {d_x.view(),    d_topk_weights.view(), d_gate.view(),      d_up.view(),
          d_down.view(), d_shared_gate.view(),  d_shared_up.view(), d_shared_down.view()};
}

void LayerData::poison_outputs() {
  for (HostTensor* t : {&out, &d_x, &d_topk_weights, &d_gate, &d_up, &d_down, &d_shared_gate,
                        &d_shared_up, &d_shared_down}) {
    if (t->defined()) t->fill_bytes(0xff);  // all-ones bytes: NaN in every float format
  }
}

static void allocate_outputs(LayerData& d, DType weight_grad_dtype) {
  const Problem& p = d.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size,
                     E = p.num_local_experts(), k = p.topk, S = p.shared_intermediate_size;
  const DType act = d.act, router = act == DType::f64 ? DType::f64 : DType::f32;
  const DType wg = act == DType::f64 ? DType::f64 : weight_grad_dtype;
  d.out = HostTensor(act, {T, H});
  d.d_x = HostTensor(act, {T, H});
  d.d_topk_weights = HostTensor(router, {T, k});
  d.d_gate = HostTensor(wg, {E, I, H});
  d.d_up = HostTensor(wg, {E, I, H});
  d.d_down = HostTensor(wg, {E, H, I});
  if (S > 0) {
    d.d_shared_gate = HostTensor(wg, {S, H});
    d.d_shared_up = HostTensor(wg, {S, H});
    d.d_shared_down = HostTensor(wg, {H, S});
  }
  d.poison_outputs();
}

LayerData make_layer_data(const Problem& p, DType act, std::uint64_t seed, Routing routing,
                          DType weight_grad_dtype) {
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size,
                     E = p.num_local_experts(), k = p.topk, S = p.shared_intermediate_size;
  const DType router = act == DType::f64 ? DType::f64 : DType::f32;
  LayerData d;
  d.problem = p;
  d.act = act;
  Rng rng(seed);
  d.x = HostTensor(act, {T, H});
  fill_normal(d.x, rng, 1.0);
  d.gate = HostTensor(act, {E, I, H});
  d.up = HostTensor(act, {E, I, H});
  d.down = HostTensor(act, {E, H, I});
  fill_normal(d.gate, rng, 1.0 / std::sqrt(double(H)));
  fill_normal(d.up, rng, 1.0 / std::sqrt(double(H)));
  fill_normal(d.down, rng, 1.0 / std::sqrt(double(I)));
  if (S > 0) {
    d.shared_gate = HostTensor(act, {S, H});
    d.shared_up = HostTensor(act, {S, H});
    d.shared_down = HostTensor(act, {H, S});
    fill_normal(d.shared_gate, rng, 1.0 / std::sqrt(double(H)));
    fill_normal(d.shared_up, rng, 1.0 / std::sqrt(double(H)));
    fill_normal(d.shared_down, rng, 1.0 / std::sqrt(double(S)));
  }
  d.d_out = HostTensor(act, {T, H});
  fill_normal(d.d_out, rng, 1.0);

  // Router: softmax over random logits, top-k distinct experts, renormalised weights.
  const std::int64_t E_global = p.num_experts;
  d.topk_experts = HostTensor(DType::i64, {T, k});
  d.topk_weights = HostTensor(router, {T, k});
  std::vector<double> logits(E_global);
  std::vector<std::int64_t> order(E_global);
  for (std::int64_t t = 0; t < T; ++t) {
    for (auto& l : logits) l = rng.normal();
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](std::int64_t a, std::int64_t b) { return logits[a] > logits[b]; });
    double sum = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += std::exp(logits[order[j]]);
    for (std::int64_t j = 0; j < k; ++j) {
      const bool to_zero =
          routing == Routing::one_expert || (routing == Routing::skewed && (t * k + j) % 2 == 0);
      const std::int64_t e = to_zero ? 0 : order[j];
      d.topk_experts.set(t * k + j, static_cast<double>(e));
      d.topk_weights.set(t * k + j, std::exp(logits[order[j]]) / sum);
    }
  }
  allocate_outputs(d, weight_grad_dtype);
  return d;
}

LayerData convert_layer_data(const LayerData& src, DType act) {
  LayerData d;
  d.problem = src.problem;
  d.act = act;
  d.swiglu_limit = src.swiglu_limit;
  const DType router = act == DType::f64 ? DType::f64 : DType::f32;
  auto copy = [&](const HostTensor& from, DType dtype) {
    if (!from.defined()) return HostTensor();
    const TensorView& v = from.view();
    HostTensor to;
    switch (v.ndim) {
      case 1:
        to = HostTensor(dtype, {v.shape[0]});
        break;
      case 2:
        to = HostTensor(dtype, {v.shape[0], v.shape[1]});
        break;
      case 3:
        to = HostTensor(dtype, {v.shape[0], v.shape[1], v.shape[2]});
        break;
      default:
        throw Error("internal: convert_layer_data rank " + std::to_string(v.ndim));
    }
    for (std::int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
    return to;
  };
  d.x = copy(src.x, act);
  d.topk_experts = copy(src.topk_experts, DType::i64);
  d.topk_weights = copy(src.topk_weights, router);
  d.gate = copy(src.gate, act);
  d.up = copy(src.up, act);
  d.down = copy(src.down, act);
  d.shared_gate = copy(src.shared_gate, act);
  d.shared_up = copy(src.shared_up, act);
  d.shared_down = copy(src.shared_down, act);
  d.d_out = copy(src.d_out, act);
  allocate_outputs(d, act == DType::f64 ? DType::f64 : DType::bf16);
  return d;
}

}  // namespace mok
