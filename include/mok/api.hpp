// mok's torch-free C++ API: one MoE layer (routed SwiGLU experts and an optional shared expert) on
// one rank.
//
//   mok::Problem p{.num_tokens = 4096, .hidden_size = 7168, .intermediate_size = 2048,
//                  .num_experts = 256, .topk = 8, .shared_intermediate_size = 2048};
//   mok::Workspace ws(p, mok::Config{}, {.backend = mok::Backend::cpu});
//   const mok::ForwardContextLayout layout = mok::forward_context_layout(ws);
//   std::vector<std::byte> storage(layout.bytes);        // device memory on the CUDA backend
//   mok::ForwardContext ctx = mok::forward_context_views(layout, storage.data());
//   mok::forward(ws, {x, topk_experts, topk_weights}, weights, out, ctx);
//   mok::backward(ws, {x, topk_experts, topk_weights}, weights, ctx, d_out, grads);
//
// Views are row-major and contiguous:
//   x [T, H], topk_experts int64 [T, k] (ids in [0, E) or -1), topk_weights [T, k],
//   gate, up [E_local, I, H], down [E_local, H, I], shared_gate, shared_up [S, H], shared_down [H,
//   S], out, d_out, d_x [T, H], d_topk_weights [T, k], weight gradients shaped like their weights.
// Activations and weights are bf16 with fp32 router weights; the CPU backend also runs everything
// in f64 (activation_dtype = f64), which the tests use as the exact reference. On the CUDA backend
// every view is 16-byte aligned (the kernels move 16-byte vectors).
//
// Who owns what (docs/architecture.md, "The workspace plan"): the forward context (what backward
// reads of the forward) is tensors the caller owns; the Workspace holds only scratch, so one
// workspace serves any number of layers of its shape. Its calls share that scratch: on the CUDA
// backend a call on a stream other than the previous call's waits on the device for that call's
// work (an event; no host synchronization), so layers sharing a workspace may run on different
// streams. Calls being captured into a CUDA graph are ordered by the graph; a replay on one stream
// beside eager calls on another is the caller's to order. Calls from two host threads at once are
// not allowed.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/fp8.hpp"
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
  // Clamped SwiGLU (MoK's swiglu_limit): absent, the plain silu(g) * u; L, silu(min(g, L)) *
  // clamp(u, -L, L) in every expert, the shared one included (core/numerics.hpp has the
  // gradients). A finite positive float; anything else raises mok::Error naming the value.
  // NOTES: it lives here, beside the weights, because it is part of the expert function F_e the
  // weights define, and MoK passes it on each forward, backward and recompute call. Not in
  // Config (whose knobs never change the result, and which is fixed when the workspace is made)
  // nor in Problem (the shape that sizes the workspace): layers of one shape share a workspace
  // whatever their limits. The forward context records it; backward refuses another limit.
  std::optional<float> swiglu_limit;
};

struct Grads {
  TensorView d_x, d_topk_weights;
  TensorView d_gate, d_up, d_down;
  TensorView d_shared_gate, d_shared_up, d_shared_down;  // absent when S == 0
};

// Which tensors a forward context was computed from: their data pointers, in the order x,
// topk_experts, topk_weights, gate, up, down, shared_gate, shared_up, shared_down (null: absent,
// or not read by the call that recorded the key). Backward refuses a context whose recorded
// tensors are not the ones it is given.
struct ContextKey {
  static constexpr int kTensors = 9;
  std::array<const void*, kTensors> tensors{};
  std::optional<float> swiglu_limit;  // Weights::swiglu_limit of the recording call
  bool fp8 = false;       // recorded by the FP8 layer (then the routed entries are Fp8Weights')
  bool recorded = false;  // false: nothing recorded (the context's pairing is the caller's)
};

// The forward context (MoK's MoKForwardContext): what backward reads of the forward, in views the
// caller owns. Its shapes come from the workspace (forward_context_layout):
//   x_routed       [x_rows, H]        the routed rows of the first ring pass, in schedule order
//   gate_routed    [routed_rows, I]   their g = bf16(x W_gate^T)
//   up_routed      [routed_rows, I]   u = bf16(x W_up^T)
//   hidden_routed  [routed_rows, I]   h = bf16(silu(g) u)
//   gate_shared, up_shared, hidden_shared  [T, S]: the same for the shared expert (absent when
//                                          S == 0)
// The row layout is the backend's: the CUDA backend keeps the first ring pass (its rows in the
// schedule table's order, later passes are recomputed by backward); the CPU backend keeps one
// row per slot t*k + j and no x rows (x_rows = 0). Rows the forward did not fill are never read.
struct ForwardContext {
  TensorView x_routed, gate_routed, up_routed, hidden_routed;
  TensorView gate_shared, up_shared, hidden_shared;
  ContextKey key;  // written by forward / recompute_forward_context, checked by backward
};

struct ForwardContextLayout {
  DType dtype = DType::bf16;  // the activation dtype
  Device device{};
  std::int64_t x_rows = 0;       // rows of x_routed
  std::int64_t routed_rows = 0;  // rows of gate/up/hidden_routed
  std::int64_t hidden_size = 0, intermediate_size = 0;
  std::int64_t num_tokens = 0, shared_intermediate_size = 0;
  // forward_context_views: each field at a multiple of 256 bytes from the start, in the order
  // of ForwardContext's fields; `bytes` in all.
  std::size_t bytes = 0;
};

struct WorkspaceOptions {
  Backend backend = Backend::automatic;
  DType activation_dtype = DType::bf16;  // bf16; f64 only on the CPU backend (exact reference)
  int num_threads = 0;                   // CPU backend: 0 = all hardware threads
  int device_index = 0;                  // CUDA backend
  // CUDA backend: also reserve the FP8 layer's scratch (the e4m3 operands of a ring pass; H and I
  // multiples of 128), so that the Fp8Weights calls below can run on it; without it they raise
  // mok::Error naming this option. The CPU backend needs no scratch for them and ignores it.
  bool fp8 = false;
  // With fp8: also reserve the token-axis copies that the e4m3 weight gradients read
  // (BackwardOptions::fp8_weight_grads true, MoK's recipe: five e4m3 copies of a pass's rows,
  // (2 H + 3 I) bytes a ring row and their scales). false: a workspace for the bf16 weight
  // gradients alone, smaller by that much; a backward asking for e4m3 weight gradients on it
  // raises mok::Error naming this option.
  bool fp8_token_axis = true;
  // CUDA backend, expert parallelism across processes (problem.ep_size > 1): this process runs
  // rank problem.ep_rank, and these are every rank's symmetric regions, ep_size entries of
  // symmetric_workspace_bytes() each, in rank order (e.g. from PyTorch symmetric memory). Every
  // rank must construct its Workspace before any rank calls it (a host barrier in between).
  std::vector<void*> symmetric_bases;
  // Every device-side wait for a peer gives up after this long and the next call raises
  // mok::Error naming the rank, the flag, the expected and the seen value.
  std::uint64_t barrier_timeout_ms = 10000;
};

struct BackwardOptions {
  // With f32 weight-gradient views: add into them (fp32 main-grad accumulation) instead of
  // overwriting. bf16 gradient views are always overwritten.
  bool accumulate_weight_grads = false;
  // The FP8 layer's backward (the calls given Fp8Weights): the three routed weight gradients as
  // e4m3 products of token-axis copies (true, MoK's recipe), or as the bf16 layer computes them,
  // bf16 products of the bf16 rows the layer holds anyway (dW_down = dy^T h, dW_gate = dg^T x,
  // dW_up = du^T x: torchao's "gradient of the weight in high precision"). false skips the five
  // token-axis quantizations and is the closer of the two to the f64 layer; the forward and the
  // input gradients are FP8 either way. Calls without Fp8Weights compute bf16 weight gradients
  // whatever it says.
  bool fp8_weight_grads = true;
};

// The scratch of a layer's calls: the schedule table, ring buffers, symmetric buffers. Sized from
// Problem and Config only, never from the routing, so no call after construction allocates. It
// keeps nothing between calls that a later call needs: any number of layers of one shape can
// share it.
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
  // stream). Calls return once the work is enqueued; they never wait for the device. A call on
  // another stream than the previous call's first waits (on the device) for that call's work.
  void set_stream(void* stream);

  // How many forward, recompute_forward_context and backward calls this workspace has run (for
  // tests and diagnostics: a backward never recomputes a forward behind the caller's back).
  struct CallCounts {
    std::int64_t forward = 0, recompute = 0, backward = 0;
  };
  CallCounts call_counts() const;

  struct Impl;
  Impl& impl();

 private:
  std::unique_ptr<Impl> impl_;
};

// The shapes of the forward context this workspace's calls read and write.
ForwardContextLayout forward_context_layout(const Workspace& ws);
// The same, without a workspace (`backend` cpu or cuda; nothing is allocated or launched).
ForwardContextLayout forward_context_layout(const Problem& p, const Config& c, Backend backend,
                                            DType activation_dtype, int device_index = 0);

// Views of a context laid out in one caller buffer of layout.bytes bytes on layout.device
// (16-byte aligned; device allocations are).
ForwardContext forward_context_views(const ForwardContextLayout& layout, void* buffer);

// out = S(x) + sum_j w[t,j] * F_{e[t,j]}(x[t]); writes the forward context into `ctx`.
void forward(Workspace& ws, const Inputs& in, const Weights& w, const TensorView& out,
             ForwardContext& ctx);

// All gradients of <out, d_out>, from the context a forward (or recompute_forward_context) over
// the same inputs and weights wrote. Never recomputes the context itself.
void backward(Workspace& ws, const Inputs& in, const Weights& w, const ForwardContext& ctx,
              const TensorView& d_out, const Grads& grads, const BackwardOptions& options = {});

// Writes the forward context again without computing `out` (activation checkpointing): the same
// bits as the forward's. Reads x, topk_experts, gate, up and the shared gate and up only
// (topk_weights, down and shared_down may be absent views).
void recompute_forward_context(Workspace& ws, const Inputs& in, const Weights& w,
                               ForwardContext& ctx);

// ---- The FP8 layer (docs/architecture.md, "The FP8 layer") ----
//
// The same layer with every routed-expert GEMM on e4m3 operands with power-of-two block scales
// (activations 1x128 along each GEMM's K, weights 128x128 blocks, token-axis copies for the
// weight gradients); the shared expert, the router weights, the combine and the reductions as in
// the bf16 layer, and the same outputs: bf16 activations, bf16 or fp32 weight gradients.
//
//   mok::QuantizedWeights gate_q = ..., up_q = ..., down_q = ...;  // mok/fp8.hpp's layout
//   mok::quantize_weights(gate, gate_q);  // once per weight version (per optimizer step), and
//   mok::quantize_weights(up, up_q);      // likewise up and down: both orientations each
//   mok::quantize_weights(down, down_q);
//   const mok::Fp8Weights q{gate_q, up_q, down_q};
//   mok::forward(ws, in, w, q, out, ctx);             // w: the shared expert, swiglu_limit
//   mok::backward(ws, in, w, q, ctx, d_out, grads);   // grads: of the bf16 master weights
//
// The weights are quantized by the caller, not per call: a training step changes them once. The
// bf16 master weights stay the caller's; the weight gradients are theirs (shaped like them).
// `w`'s routed gate, up and down are not read: absent, or the master weights (checked for shape
// like the bf16 layer's). Requires H and I multiples of 128 and a bf16 workspace; on the CUDA
// backend a workspace made with WorkspaceOptions::fp8 and the launches' forward path (the
// megakernel has no FP8 form yet: Config::forward_path fused raises mok::Error). The forward
// context has the bf16 layer's layout and contents (g, u, h in bf16; the FP8 copies of x and h
// are quantized again from them, the same bits). A context recorded by one layer is refused by
// the other's backward (ContextKey::fp8), and by an FP8 backward given other quantized weights.
struct Fp8Weights {
  QuantizedWeights gate, up;  // of [E_local, I, H]: data [E, I, H] (forward), data_t [E, H, I]
  QuantizedWeights down;      // of [E_local, H, I]: data [E, H, I] (forward), data_t [E, I, H]
};

void forward(Workspace& ws, const Inputs& in, const Weights& w, const Fp8Weights& q,
             const TensorView& out, ForwardContext& ctx);
void backward(Workspace& ws, const Inputs& in, const Weights& w, const Fp8Weights& q,
              const ForwardContext& ctx, const TensorView& d_out, const Grads& grads,
              const BackwardOptions& options = {});
// Reads x, topk_experts, q.gate, q.up and the shared gate and up (q.down may be absent: all four
// of its views).
void recompute_forward_context(Workspace& ws, const Inputs& in, const Weights& w,
                               const Fp8Weights& q, ForwardContext& ctx);

}  // namespace mok
