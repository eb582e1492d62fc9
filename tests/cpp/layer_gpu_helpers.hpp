// What the CUDA layer tests share (mok_layer_tests only: needs the CUDA build).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "cuda/layer/layer.hpp"
#include "layer_helpers.hpp"
#include "synthetic/device_layer.hpp"

namespace mok::test {

// Runs of the repeated-bitwise checks: 10, or MOK_TEST_RUNS (the sanitizers' runs use 2: each run
// under racecheck costs tens of seconds).
inline int test_runs() {
  const char* v = std::getenv("MOK_TEST_RUNS");
  return v != nullptr && std::atoi(v) >= 2 ? std::atoi(v) : 10;
}

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

// A layer of W ranks of T tokens (every `unused_every`-th slot unused): `one` run whole on one
// GPU, `many` the same inputs for the ranks, `rank` the problem of one rank (ep_rank 0).
struct EpCase {
  LayerData one, many;
  Problem rank;
};
inline EpCase ep_case(int W, std::int64_t T, const Problem& shape, std::uint64_t seed,
                      Routing routing, std::int64_t unused_every) {
  const Problem global = layer_shape(W * T, shape.hidden_size, shape.intermediate_size,
                                     shape.num_experts, shape.topk, shape.shared_intermediate_size);
  EpCase c{make_layer_data(global, DType::bf16, seed, routing), {}, global};
  for (std::int64_t s = 3; s < W * T * shape.topk; s += unused_every) {
    c.one.topk_experts.set(s, -1);
  }
  c.many = c.one;
  run_gpu(c.one);
  c.rank.num_tokens = T;
  c.rank.ep_size = W;
  return c;
}

// Rank r of W over one global layer: tokens [r T, (r + 1) T), experts [r E_l, (r + 1) E_l), the
// shared expert's weights whole. Shared-expert gradients are per rank (a data-parallel sum, not
// the layer's): rank 0's land in the global buffers, the others' in `scratch`; each rank gets a
// forward context in `contexts`.
inline std::vector<cuda::RankTensors> split_into_ranks(
    cuda::DeviceLayer& g, const Problem& p,
    std::vector<std::unique_ptr<cuda::DeviceTensor>>& scratch,
    std::vector<std::unique_ptr<cuda::DeviceContext>>& contexts) {
  const int W = p.ep_size;
  const std::int64_t T = p.num_tokens, E_l = p.num_local_experts();
  auto rows = [](const TensorView& v, std::int64_t first, std::int64_t count) {
    TensorView r = v;
    r.data = static_cast<char*>(v.data) + first * v.strides[0] * dtype_size(v.dtype);
    r.shape[0] = count;
    return r;
  };
  std::vector<cuda::RankTensors> ranks(W);
  for (int r = 0; r < W; ++r) {
    cuda::RankTensors& t = ranks[r];
    t.in = {rows(g.x.view(), r * T, T), rows(g.ids.view(), r * T, T), rows(g.w.view(), r * T, T)};
    t.w = {rows(g.gate.view(), r * E_l, E_l),
           rows(g.up.view(), r * E_l, E_l),
           rows(g.down.view(), r * E_l, E_l),
           g.sg.view(),
           g.su.view(),
           g.sd.view()};
    t.out = rows(g.out.view(), r * T, T);
    t.d_out = rows(g.d_out.view(), r * T, T);
    t.grads = {rows(g.d_x.view(), r * T, T),
               rows(g.d_w.view(), r * T, T),
               rows(g.d_gate.view(), r * E_l, E_l),
               rows(g.d_up.view(), r * E_l, E_l),
               rows(g.d_down.view(), r * E_l, E_l),
               g.d_sg.view(),
               g.d_su.view(),
               g.d_sd.view()};
    contexts.push_back(std::make_unique<cuda::DeviceContext>(
        forward_context_layout(p, Config{}, Backend::cuda, DType::bf16)));
    t.ctx = contexts.back()->get();
    if (r == 0) continue;
    for (TensorView* v : {&t.grads.d_shared_gate, &t.grads.d_shared_up, &t.grads.d_shared_down}) {
      HostTensor h(DType::bf16, {v->shape[0], v->shape[1]});
      scratch.push_back(std::make_unique<cuda::DeviceTensor>(h));
      *v = scratch.back()->view();
    }
  }
  return ranks;
}

}  // namespace mok::test
