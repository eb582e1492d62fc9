// Host-owned layer data for tests, the CLI and benchmarks: seeded synthetic inputs, weights,
// routings and output buffers, in bf16 or f64.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mok/api.hpp"

namespace mok {

// A host buffer with its view. Backing store is 8-byte aligned.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<std::int64_t> shape);
  // Copies own their storage: the copy's view points at the copy.
  HostTensor(const HostTensor& other) : storage_(other.storage_), view_(other.view_) { rebind(); }
  HostTensor& operator=(const HostTensor& other) {
    storage_ = other.storage_;
    view_ = other.view_;
    rebind();
    return *this;
  }
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;
  const TensorView& view() const { return view_; }
  TensorView& view() { return view_; }
  std::int64_t numel() const { return view_.numel(); }
  double get(std::int64_t i) const;  // as double, for floating dtypes and integers
  void set(std::int64_t i, double v);
  void fill(double v);
  void fill_bytes(unsigned char byte);  // poisoning
  bool defined() const { return view_.defined(); }

 private:
  void rebind() {
    if (view_.data) view_.data = storage_.data();
  }
  std::vector<std::uint64_t> storage_;
  TensorView view_;
};

enum class Routing : std::uint8_t {
  softmax,     // random logits, softmax, top-k, renormalised: roughly uniform load
  skewed,      // as softmax, but every other row (slot t*k+j even) goes to expert 0: expert 0 takes
               // half of all rows, as the skewed cases of docs/perf/method.md ask; a token may
               // then repeat expert 0
  one_expert,  // every slot of every token goes to expert 0 (repeated ids: allowed by design)
};

const char* routing_name(Routing r);

// Everything one layer call reads and writes, on the host.
struct LayerData {
  Problem problem;
  DType act = DType::bf16;
  HostTensor x, topk_experts, topk_weights;
  HostTensor gate, up, down, shared_gate, shared_up, shared_down;
  HostTensor out, d_out;
  HostTensor d_x, d_topk_weights, d_gate, d_up, d_down, d_shared_gate, d_shared_up, d_shared_down;
  std::optional<float> swiglu_limit;  // Weights::swiglu_limit (absent: plain SwiGLU)

  Inputs inputs() const;
  Weights weights() const;
  Grads grads() const;
  void poison_outputs();  // NaN-fill out and every gradient
};

// Seeded data: x, d_out ~ N(0, 1); weights ~ N(0, 1/fan_in); routing as asked. In bf16 every value
// is rounded to bf16 once, so an f64 copy holds exactly the same numbers.
LayerData make_layer_data(const Problem& p, DType act, std::uint64_t seed,
                          Routing routing = Routing::softmax,
                          DType weight_grad_dtype = DType::bf16);

// The same numbers in another dtype (bf16 -> f64 is exact); outputs are allocated, not copied.
LayerData convert_layer_data(const LayerData& src, DType act);

// A routed weight [E, N, K] quantized into host memory by mok::quantize_weights (mok/fp8.hpp):
// what the CPU FP8 layer reads. Not copyable (its views point into its storage).
class HostQuantizedWeights {
 public:
  explicit HostQuantizedWeights(const TensorView& w);
  HostQuantizedWeights(const HostQuantizedWeights&) = delete;
  HostQuantizedWeights& operator=(const HostQuantizedWeights&) = delete;
  const QuantizedWeights& get() const { return q_; }

 private:
  std::vector<std::uint64_t> storage_;
  QuantizedWeights q_;
};

// A layer's routed gate, up and down quantized on the host (H and I multiples of 128).
struct HostFp8Weights {
  explicit HostFp8Weights(const LayerData& d)
      : gate(d.gate.view()), up(d.up.view()), down(d.down.view()) {}
  Fp8Weights get() const { return {gate.get(), up.get(), down.get()}; }
  HostQuantizedWeights gate, up, down;
};

// A forward context in host memory, laid out as forward_context_layout(ws) says (CPU backend).
class HostContext {
 public:
  explicit HostContext(const Workspace& ws)
      : storage_((forward_context_layout(ws).bytes + 7) / 8 + 2),
        ctx_(forward_context_views(forward_context_layout(ws), aligned())) {}
  ForwardContext& get() { return ctx_; }

 private:
  void* aligned() {
    const auto a = reinterpret_cast<std::uintptr_t>(storage_.data());
    return reinterpret_cast<void*>((a + 15) / 16 * 16);
  }
  std::vector<std::uint64_t> storage_;
  ForwardContext ctx_;
};

}  // namespace mok
