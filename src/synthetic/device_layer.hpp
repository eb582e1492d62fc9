// A LayerData's tensors on the GPU: the CLI and the tests run the CUDA backend on synthetic data.
#pragma once

#include <optional>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "synthetic/synthetic.hpp"

namespace mok::cuda {

class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h) {
    if (!h.defined()) return;
    view_ = h.view();
    bytes_ = static_cast<std::size_t>(h.numel()) * dtype_size(view_.dtype);
    cudaMalloc(&view_.data, bytes_);
    view_.device = {DeviceKind::cuda, 0};
    upload(h);
  }
  ~DeviceTensor() { cudaFree(view_.data); }
  DeviceTensor(DeviceTensor&& o) noexcept : view_(o.view_), bytes_(o.bytes_) {
    o.view_.data = nullptr;
  }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(view_, o.view_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  const TensorView& view() const { return view_; }
  void upload(const HostTensor& h) {
    if (view_.data) cudaMemcpy(view_.data, h.view().data, bytes_, cudaMemcpyHostToDevice);
  }
  void download(HostTensor& h) const {
    if (view_.data) cudaMemcpy(h.view().data, view_.data, bytes_, cudaMemcpyDeviceToHost);
  }
  void poison() {
    if (view_.data) cudaMemset(view_.data, 0xff, bytes_);
  }

 private:
  TensorView view_;
  std::size_t bytes_ = 0;
};

// A forward context in device memory, laid out as forward_context_layout(ws) says, NaN-poisoned
// (0xff bytes) at allocation.
class DeviceContext {
 public:
  explicit DeviceContext(const Workspace& ws) : DeviceContext(forward_context_layout(ws)) {}
  explicit DeviceContext(const ForwardContextLayout& layout) {
    bytes_ = layout.bytes;
    if (cudaMalloc(&data_, bytes_ > 0 ? bytes_ : 16) != cudaSuccess) {
      throw Error("cudaMalloc of a forward context of " + to_text(bytes_) + " bytes failed");
    }
    cudaMemset(data_, 0xff, bytes_);
    ctx_ = forward_context_views(layout, data_);
  }
  ~DeviceContext() { cudaFree(data_); }
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;
  ForwardContext& get() { return ctx_; }
  std::size_t bytes() const { return bytes_; }
  // The whole context's bytes (every tensor, and what lies between them), copied to the host.
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> h(bytes_);
    if (bytes_ > 0) cudaMemcpy(h.data(), data_, bytes_, cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  ForwardContext ctx_;
};

struct DeviceLayer {
  DeviceTensor x, ids, w, gate, up, down, sg, su, sd, out, d_out;
  DeviceTensor d_x, d_w, d_gate, d_up, d_down, d_sg, d_su, d_sd;
  std::optional<float> swiglu_limit;

  explicit DeviceLayer(const LayerData& d)
      : x(d.x),
        ids(d.topk_experts),
        w(d.topk_weights),
        gate(d.gate),
        up(d.up),
        down(d.down),
        sg(d.shared_gate),
        su(d.shared_up),
        sd(d.shared_down),
        out(d.out),
        d_out(d.d_out),
        d_x(d.d_x),
        d_w(d.d_topk_weights),
        d_gate(d.d_gate),
        d_up(d.d_up),
        d_down(d.d_down),
        d_sg(d.d_shared_gate),
        d_su(d.d_shared_up),
        d_sd(d.d_shared_down),
        swiglu_limit(d.swiglu_limit) {
    poison();
  }
  Inputs inputs() const { return {x.view(), ids.view(), w.view()}; }
  Weights weights() const {
    return {gate.view(), up.view(), down.view(), sg.view(), su.view(), sd.view(), swiglu_limit};
  }
  Grads grads() const {
    return {d_x.view(),    d_w.view(),  d_gate.view(), d_up.view(),
            d_down.view(), d_sg.view(), d_su.view(),   d_sd.view()};
  }
  std::vector<DeviceTensor*> outputs() {
    return {&out, &d_x, &d_w, &d_gate, &d_up, &d_down, &d_sg, &d_su, &d_sd};
  }
  void poison() {
    for (DeviceTensor* t : outputs()) t->poison();
  }
  // New inputs of the same shapes (graph replays read the same device buffers).
  void upload_inputs(const LayerData& d) {
    x.upload(d.x), ids.upload(d.topk_experts), w.upload(d.topk_weights), gate.upload(d.gate);
    up.upload(d.up), down.upload(d.down), sg.upload(d.shared_gate), su.upload(d.shared_up);
    sd.upload(d.shared_down), d_out.upload(d.d_out);
  }
  void download(LayerData& d) const {
    out.download(d.out), d_x.download(d.d_x), d_w.download(d.d_topk_weights);
    d_gate.download(d.d_gate), d_up.download(d.d_up), d_down.download(d.d_down);
    d_sg.download(d.d_shared_gate), d_su.download(d.d_shared_up), d_sd.download(d.d_shared_down);
  }
};

}  // namespace mok::cuda
