// What the FP8 layer's tests share (CPU: test_fp8_layer.cpp; GPU: test_fp8_layer_gpu.cpp):
// quantized weights in host memory, one step of the CPU FP8 layer, and the error measures the
// tests print beside MoK's MXFP8 bounds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "layer_helpers.hpp"
#include "mok/fp8.hpp"

namespace mok::test {

// A routed weight [E, N, K] quantized into host memory (mok::quantize_weights).
class HostQuantized {
 public:
  explicit HostQuantized(const TensorView& w)
      : layout_(quantized_weights_layout(w.shape[0], w.shape[1], w.shape[2])),
        storage_(layout_.bytes / 8 + 1),
        q_(quantized_weights_views(layout_, storage_.data())) {
    quantize_weights(w, q_);
  }
  const QuantizedWeights& get() const { return q_; }
  QuantizedWeights& get() { return q_; }

 private:
  QuantizedWeightsLayout layout_;
  std::vector<std::uint64_t> storage_;
  QuantizedWeights q_;
};

struct HostFp8Weights {
  explicit HostFp8Weights(const LayerData& d)
      : gate(d.gate.view()), up(d.up.view()), down(d.down.view()) {}
  Fp8Weights get() const { return {gate.get(), up.get(), down.get()}; }
  HostQuantized gate, up, down;
};

// One step (forward, backward) of the CPU FP8 layer over `d` with quantized weights `q`; without
// `routed_masters` the routed bf16 weights are not passed at all.
inline void run_fp8(LayerData& d, const Fp8Weights& q, int threads = 0, const Config& config = {},
                    bool routed_masters = true, const BackwardOptions& options = {}) {
  Workspace ws(d.problem, config,
               {.backend = Backend::cpu, .activation_dtype = DType::bf16, .num_threads = threads});
  HostContext ctx(ws);
  Weights w = d.weights();
  if (!routed_masters) w.gate = w.up = w.down = TensorView{};  // not read by the FP8 layer
  forward(ws, d.inputs(), w, q, d.out.view(), ctx.get());
  backward(ws, d.inputs(), w, q, ctx.get(), d.d_out.view(), d.grads(), options);
}

// `got` against `ref`: the largest |difference|, sum |difference| / sum |ref|, and the cosine.
struct Errors {
  double abs_max = 0, rel_sum = 0, cosine = 1;
};

inline Errors errors_of(const HostTensor& got, const HostTensor& ref) {
  double diff = 0, sum_ref = 0, dot = 0, n_got = 0, n_ref = 0;
  Errors e;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.get(i), b = ref.get(i);
    e.abs_max = std::max(e.abs_max, std::fabs(a - b));
    diff += std::fabs(a - b);
    sum_ref += std::fabs(b);
    dot += a * b;
    n_got += a * a;
    n_ref += b * b;
  }
  e.rel_sum = diff / sum_ref;
  e.cosine = dot / std::sqrt(n_got * n_ref);
  return e;
}

}  // namespace mok::test
