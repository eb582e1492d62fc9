// What the CUDA layer tests share (mok_layer_tests only: needs the CUDA build).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "layer_helpers.hpp"
#include "synthetic/device_layer.hpp"

namespace mok::test {

// One training step of `d` on the GPU through the public API (a Workspace of the CUDA backend):
// forward, then backward over the forward's context; every output and gradient back in `d`.
inline void run_gpu(LayerData& d, const Config& config = {}, BackwardOptions options = {}) {
  cuda::DeviceLayer g(d);
  Workspace ws(d.problem, config, {.backend = Backend::cuda});
  cuda::DeviceContext ctx(ws);
  forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
  backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), g.grads(), options);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  g.download(d);
}

}  // namespace mok::test
