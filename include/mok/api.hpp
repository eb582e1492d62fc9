// mok's torch-free C++ API: one MoE layer (DESIGN.md section 1) on one rank.
//
//   mok::Problem p{.num_tokens = 4096, .hidden_size = 7168, .intermediate_size = 2048,
//                  .num_experts = 256, .topk = 8, .shared_intermediate_size = 2048};
//   mok::Workspace ws(p, mok::Config{}, {.backend = mok::Backend::cpu});
//   mok::forward(ws, {x, topk_experts, topk_weights}, weights, out);
//   mok::backward(ws, {x, topk_experts, topk_weights}, weights, d_out, grads);
//
// Views are row-major and contiguous:
//   x [T, H], topk_experts int64 [T, k] (ids in [0, E) or -1), topk_weights [T, k],
//   gate, up [E_local, I, H], down [E_local, H, I], shared_gate, shared_up [S, H], shared_down [H,
//   S], out, d_out, d_x [T, H], d_topk_weights [T, k], weight gradients shaped like their weights.
// Activations and weights are bf16 with fp32 router weights; the CPU backend also runs everything
// in f64 (activation_dtype = f64), which the tests use as the exact reference.
#pragma once

#include <memory>
#include <string>

#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/problem.hpp"
#include "mok/tensor.hpp"

namespace mok {

enum class Backend : std::uint8_t { automatic, cpu, cuda };

const char* backend_name(Backend b);
// Whether this build and machine can run `b` (cuda: compiled in and a device present).
bool backend_available(Backend b);
// `automatic` resolved: cuda where available, else cpu.
Backend resolve_backend(Backend b);
// Throws mok::Error saying why `b` cannot run here; returns when it can.
void require_backend(Backend b);

struct Inputs {
  TensorView x;
  TensorView topk_experts;
  TensorView topk_weights;
};

struct Weights {
  TensorView gate, up, down;                       // routed experts held by this rank
  TensorView shared_gate, shared_up, shared_down;  // absent (default) when S == 0
};

struct Grads {
  TensorView d_x, d_topk_weights;
  TensorView d_gate, d_up, d_down;
  TensorView d_shared_gate, d_shared_up, d_shared_down;  // absent when S == 0
};

struct WorkspaceOptions {
  Backend backend = Backend::automatic;
  DType activation_dtype = DType::bf16;  // bf16; f64 only on the CPU backend (exact reference)
  int num_threads = 0;                   // CPU backend: 0 = all hardware threads
  int device_index = 0;                  // CUDA backend
};

struct BackwardOptions {
  // With f32 weight-gradient views: add into them (fp32 main-grad accumulation) instead of
  // overwriting. bf16 gradient views are always overwritten.
  bool accumulate_weight_grads = false;
};

// Everything a layer needs between calls: the forward context (pass 0's intermediates), scratch
// and, later, the schedule table and symmetric buffers. Sized from Problem and Config only, never
// from the routing, so no call after construction allocates.
class Workspace {
 public:
  Workspace(const Problem& problem, const Config& config, const WorkspaceOptions& options = {});
  ~Workspace();
  Workspace(Workspace&&) noexcept;
  Workspace& operator=(Workspace&&) noexcept;

  const Problem& problem() const;
  const Config& config() const;
  Backend backend() const;  // resolved, never `automatic`
  DType activation_dtype() const;
  int num_threads() const;
  std::size_t bytes() const;  // memory this workspace holds

  // CUDA backend: the cudaStream_t later calls enqueue their work on (null: the legacy default
  // stream). Calls return once the work is enqueued; they never wait for the device.
  void set_stream(void* stream);

  struct Impl;
  Impl& impl();

 private:
  std::unique_ptr<Impl> impl_;
};

// out = S(x) + sum_j w[t,j] * F_{e[t,j]}(x[t]); keeps the forward context in `ws`.
void forward(Workspace& ws, const Inputs& in, const Weights& w, const TensorView& out);

// All gradients of <out, d_out>. Needs the context of a forward (or recompute_forward_context)
// over the same inputs and weights.
void backward(Workspace& ws, const Inputs& in, const Weights& w, const TensorView& d_out,
              const Grads& grads, const BackwardOptions& options = {});

// Rebuilds the forward context without computing `out` (activation checkpointing).
void recompute_forward_context(Workspace& ws, const Inputs& in, const Weights& w);

}  // namespace mok
