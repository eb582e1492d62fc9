// Expert parallelism across processes on the CPU backend ("host EP"): mok computes, the caller
// moves the rows between ranks (mok.functional does it with torch.distributed collectives over a
// gloo group). The same semantics as one process holding every expert: every output and gradient
// is bitwise that of a W = 1 workspace over the concatenated tokens of all ranks (the shared
// expert's weight gradients: those of this rank's tokens, as a data-parallel replica's).
//
// Rank r of W holds a CPU Workspace of a Problem with ep_size = W, ep_rank = r, its own
// num_tokens = T (the same T on every rank) and its E/W local experts [r*E/W, (r+1)*E/W)
// (weights [E/W, ...]). "Gathered" views are every rank's tensor concatenated in rank order
// (x_all [W*T, H], topk_experts_all [W*T, k], ...): gathered slot (q*T + t)*k + j is rank q's
// token t, slot j. Rows move in the layout of src/core/host_ep_layout.hpp: this rank's send
// buffer holds the rows its experts computed, in gathered slot order (so home rank by home
// rank); its receive buffer holds its own slots grouped by the expert rank that computed them.
// An all-to-all with the send and receive splits of exchange_counts moves one into the other.
//
//   forward:    all-gather x, topk_experts      -> expert_forward (combine rows [send, H])
//               all-to-all the combine rows      -> home_forward (out: shared expert + the
//                                                   fixed-j reduction)
//   recompute:  all-gather x, topk_experts      -> expert_forward and home_forward with absent
//                                                   combine and out views (the context only)
//   backward:   all-gather x, topk_experts, topk_weights, d_out
//                                                -> expert_backward (dx rows [send, H], d_w
//                                                   entries [send], local weight gradients)
//               all-to-all both                  -> home_backward (d_x, d_topk_weights, the
//                                                   shared expert's gradients)
//
// The forward context: routed rows one per gathered slot ([W*T*k, I]; the rows of this rank's
// experts are written), shared rows [T, S] of this rank's tokens; x_routed has no rows
// (forward_context_layout gives the shapes). No ContextKey is recorded. Every call validates its
// views and every id of the gathered topk_experts (the error names the rank, token and slot), so
// every rank of a group rejects a bad id on any rank.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/api.hpp"

namespace mok::host_ep {

struct ExchangeCounts {
  std::vector<std::int64_t> send;     // [W]: rows this rank's experts computed for each home rank
  std::vector<std::int64_t> receive;  // [W]: rows of this rank's slots each expert rank computed
};

// The all-to-all splits of this rank, from the gathered ids (validated here).
ExchangeCounts exchange_counts(const Workspace& ws, const TensorView& topk_experts_all);

// The local experts over their rows of the gathered inputs (x_all, topk_experts_all; topk_weights
// not read): their context rows, and the combine rows y [sum send, H] (activation dtype) into
// `combine_send` (absent: the context only, for recompute).
void expert_forward(Workspace& ws, const Inputs& gathered, const Weights& w,
                    const TensorView& combine_send, ForwardContext& ctx);

// This rank's own inputs: the shared expert (its context rows) and, with `out` present,
// out = S(x) + sum_j w[t,j] y[t,j] from `combine_received` [sum receive, H]. Counts as a forward
// (a recompute_forward_context when `out` is absent).
void home_forward(Workspace& ws, const Inputs& in, const Weights& w,
                  const TensorView& combine_received, const TensorView& out, ForwardContext& ctx);

// The local experts' backward over their rows of the gathered inputs (x_all, topk_experts_all,
// topk_weights_all) and `d_out_all` [W*T, H]: dx rows [sum send, H] (activation dtype) into
// `dx_send`, d_w entries [sum send] (router dtype) into `dw_send`, and the local experts' weight
// gradients grads.d_gate, d_up, d_down (the other fields are home_backward's).
void expert_backward(Workspace& ws, const Inputs& gathered, const Weights& w,
                     const ForwardContext& ctx, const TensorView& d_out_all,
                     const TensorView& dx_send, const TensorView& dw_send, const Grads& grads,
                     const BackwardOptions& options = {});

// This rank's own inputs: the shared expert's backward (grads.d_shared_*), and d_x, d_topk_weights
// from the received dx rows and d_w entries, reduced in fixed j order. Counts as a backward.
void home_backward(Workspace& ws, const Inputs& in, const Weights& w, const ForwardContext& ctx,
                   const TensorView& d_out, const TensorView& dx_received,
                   const TensorView& dw_received, const Grads& grads,
                   const BackwardOptions& options = {});

// The FP8 layer's expert halves (api.hpp, Fp8Weights): the same, with the routed GEMMs on `q`
// (w's routed views not read: absent, or the master weights). The home halves above serve both
// layers (they read no routed weight).
void expert_forward(Workspace& ws, const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                    const TensorView& combine_send, ForwardContext& ctx);
void expert_backward(Workspace& ws, const Inputs& gathered, const Weights& w, const Fp8Weights& q,
                     const ForwardContext& ctx, const TensorView& d_out_all,
                     const TensorView& dx_send, const TensorView& dw_send, const Grads& grads,
                     const BackwardOptions& options = {});

}  // namespace mok::host_ep
