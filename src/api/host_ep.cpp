// Host expert parallelism's entry points (include/mok/host_ep.hpp): validate, then hand over to
// the workspace's backend (the CPU reference; src/reference/reference.cpp).
#include "mok/host_ep.hpp"

#include <numeric>
#include <string>

#include "core/host_ep_layout.hpp"
#include "core/validate.hpp"
#include "core/workspace.hpp"

namespace mok {

// LayerBackend's defaults: only the CPU reference runs host expert parallelism.
namespace host_ep {
namespace {

Workspace::Impl& cpu_impl(Workspace& ws) {
  Workspace::Impl& impl = ws.impl();
  if (impl.backend != Backend::cpu) {
    throw Error("workspace backend", "cpu (host expert parallelism runs on the CPU reference)",
                backend_name(impl.backend));
  }
  return impl;
}

DType router_dtype(DType act) {
  return act == DType::f64 ? DType::f64 : DType::f32;
}

std::int64_t total(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

// Every rank's inputs, concatenated in rank order; their ids validated.
void check_gathered(const Problem& p, DType act, Device dev, const Inputs& g,
                    bool with_topk_weights) {
  const std::int64_t rows = std::int64_t{p.ep_size} * p.num_tokens;
  check_view("x_all", g.x, act, {rows, p.hidden_size}, dev);
  check_view("topk_experts_all", g.topk_experts, DType::i64, {rows, p.topk}, dev);
  if (with_topk_weights) {
    check_view("topk_weights_all", g.topk_weights, router_dtype(act), {rows, p.topk}, dev);
  }
  check_expert_ids_all_ranks(p, g.topk_experts);
}

}  // namespace

ExchangeCounts exchange_counts(const Workspace& ws_, const TensorView& topk_experts_all) {
  Workspace::Impl& ws = cpu_impl(const_cast<Workspace&>(ws_));
  const Problem& p = ws.problem;
  check_view("topk_experts_all", topk_experts_all, DType::i64,
             {std::int64_t{p.ep_size} * p.num_tokens, p.topk}, device_of(ws));
  check_expert_ids_all_ranks(p, topk_experts_all);
  return exchange_counts(p, topk_experts_all.ptr<const std::int64_t>());
}

namespace {

// `q` null: the bf16 layer.
void run_expert_forward(Workspace& ws_, const Inputs& gathered, const Weights& w,
                        const Fp8Weights* q, const TensorView& combine_send, ForwardContext& ctx) {
  Workspace::Impl& ws = cpu_impl(ws_);
  const Problem& p = ws.problem;
  const DType act = ws.options.activation_dtype;
  const Device dev = device_of(ws);
  const bool recompute = !combine_send.defined();
  const InputUse use = recompute ? InputUse::context_only : InputUse::forward;
  if (q != nullptr) check_fp8_call(ws, *q, use);
  check_gathered(p, act, dev, gathered, /*with_topk_weights=*/false);
  check_weights(p, act, dev, w, use, q != nullptr ? RoutedWeights::not_read : RoutedWeights::read);
  if (!recompute) {
    const ExchangeCounts c = exchange_counts(p, gathered.topk_experts.ptr<const std::int64_t>());
    check_view("combine_send", combine_send, act, {total(c.send), p.hidden_size}, dev);
  }
  check_context(ws_, ctx);
  ctx.key = ContextKey{};
  if (q != nullptr) {
    ws.layer->ep_expert_forward_fp8(gathered, w, *q, recompute ? nullptr : &combine_send, ctx);
  } else {
    ws.layer->ep_expert_forward(gathered, w, recompute ? nullptr : &combine_send, ctx);
  }
}

void run_expert_backward(Workspace& ws_, const Inputs& gathered, const Weights& w,
                         const Fp8Weights* q, const ForwardContext& ctx,
                         const TensorView& d_out_all, const TensorView& dx_send,
                         const TensorView& dw_send, const Grads& grads,
                         const BackwardOptions& options) {
  Workspace::Impl& ws = cpu_impl(ws_);
  const Problem& p = ws.problem;
  const DType act = ws.options.activation_dtype;
  const Device dev = device_of(ws);
  if (q != nullptr) check_fp8_call(ws, *q, InputUse::forward);
  check_gathered(p, act, dev, gathered, /*with_topk_weights=*/true);
  check_weights(p, act, dev, w, InputUse::forward,
                q != nullptr ? RoutedWeights::not_read : RoutedWeights::read);
  check_view("d_out_all", d_out_all, act, {std::int64_t{p.ep_size} * p.num_tokens, p.hidden_size},
             dev);
  const ExchangeCounts c = exchange_counts(p, gathered.topk_experts.ptr<const std::int64_t>());
  check_view("dx_send", dx_send, act, {total(c.send), p.hidden_size}, dev);
  check_view("dw_send", dw_send, router_dtype(act), {total(c.send)}, dev);
  check_grads(p, act, dev, grads, options);
  check_context(ws_, ctx);
  if (q != nullptr) {
    ws.layer->ep_expert_backward_fp8(gathered, w, *q, ctx, d_out_all, dx_send, dw_send, grads,
                                     options);
  } else {
    ws.layer->ep_expert_backward(gathered, w, ctx, d_out_all, dx_send, dw_send, grads, options);
  }
}

}  // namespace

void expert_forward(Workspace& ws, const Inputs& gathered, const Weights& w,
                    const TensorView& combine_send, ForwardContext& ctx) {
  run_expert_forward(ws, gathered, w, nullptr, combine_send, ctx);
}

void expert_forward(Workspace& ws, const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                    const TensorView& combine_send, ForwardContext& ctx) {
  run_expert_forward(ws, gathered, w, &q, combine_send, ctx);
}

void home_forward(Workspace& ws_, const Inputs& in, const Weights& w,
                  const TensorView& combine_received, const TensorView& out, ForwardContext& ctx) {
  Workspace::Impl& ws = cpu_impl(ws_);
  const Problem& p = ws.problem;
  const DType act = ws.options.activation_dtype;
  const Device dev = device_of(ws);
  const bool recompute = !out.defined();
  check_inputs(p, act, dev, in, w, recompute ? InputUse::context_only : InputUse::forward);
  check_expert_ids_host(p, in.topk_experts);
  if (!recompute) {
    check_view("out", out, act, {p.num_tokens, p.hidden_size}, dev);
    const std::int64_t rows = received_rows(p, in.topk_experts.ptr<const std::int64_t>());
    check_view("combine_received", combine_received, act, {rows, p.hidden_size}, dev);
  }
  check_context(ws_, ctx);
  ctx.key = ContextKey{};
  ws.layer->ep_home_forward(in, w, recompute ? nullptr : &combine_received,
                            recompute ? nullptr : &out, ctx);
  if (recompute) {
    ++ws.calls.recompute;
  } else {
    ++ws.calls.forward;
  }
}

void expert_backward(Workspace& ws, const Inputs& gathered, const Weights& w,
                     const ForwardContext& ctx, const TensorView& d_out_all,
                     const TensorView& dx_send, const TensorView& dw_send, const Grads& grads,
                     const BackwardOptions& options) {
  run_expert_backward(ws, gathered, w, nullptr, ctx, d_out_all, dx_send, dw_send, grads, options);
}

void expert_backward(Workspace& ws, const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                     const ForwardContext& ctx, const TensorView& d_out_all,
                     const TensorView& dx_send, const TensorView& dw_send, const Grads& grads,
                     const BackwardOptions& options) {
  run_expert_backward(ws, gathered, w, &q, ctx, d_out_all, dx_send, dw_send, grads, options);
}

void home_backward(Workspace& ws_, const Inputs& in, const Weights& w, const ForwardContext& ctx,
                   const TensorView& d_out, const TensorView& dx_received,
                   const TensorView& dw_received, const Grads& grads,
                   const BackwardOptions& options) {
  Workspace::Impl& ws = cpu_impl(ws_);
  const Problem& p = ws.problem;
  const DType act = ws.options.activation_dtype;
  const Device dev = device_of(ws);
  check_inputs(p, act, dev, in, w);
  check_expert_ids_host(p, in.topk_experts);
  check_view("d_out", d_out, act, {p.num_tokens, p.hidden_size}, dev);
  const std::int64_t rows = received_rows(p, in.topk_experts.ptr<const std::int64_t>());
  check_view("dx_received", dx_received, act, {rows, p.hidden_size}, dev);
  check_view("dw_received", dw_received, router_dtype(act), {rows}, dev);
  check_grads(p, act, dev, grads, options);
  check_context(ws_, ctx);
  ws.layer->ep_home_backward(in, w, ctx, d_out, dx_received, dw_received, grads, options);
  ++ws.calls.backward;
}

}  // namespace host_ep
}  // namespace mok
