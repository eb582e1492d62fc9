// The CUDA layer (layer.hpp): one forward or backward call, for every rank this process runs, as
// a sequence of launches on the caller's stream (the forward's passes optionally one megakernel
// launch each; backward's weight gradients on side streams it forks and joins). In order:
//   - each rank's layer-region buffers (RankBuffers, Fp8Buffers) and ExpertRows, one family of
//     SwiGLU experts over a row buffer (the routed experts of a pass, or the shared expert);
//   - the bf16 GEMMs of a family: gate/up + SwiGLU, down, the down dgrad with the SwiGLU backward,
//     the gate/up dgrad, the weight gradients (GradTarget: the view, or a carry across passes);
//   - the FP8 forms (the `_fp8` functions): the same GEMMs on e4m3 operands, the quantization of
//     their rows, and why Fp8Kernels' defaults are what they are;
//   - backward through one family (expert_backward, expert_backward_fp8), its weight gradients on
//     side streams (WgradStreams);
//   - Layer::Impl: the team, the buffers and peer tables, and the steps a call is made of
//     (pass segments, staging, schedule, fused_pass, gate_up_pass);
//   - CallOrder: calls on different streams wait for each other on the device;
//   - the Layer's construction (allocations, peer tables) and setters;
//   - Layer::forward and Layer::backward.
#include "cuda/layer/layer.hpp"

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/schedule_check.hpp"
#include "core/schedule_layout.hpp"
#include "cuda/comm/team.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/launch.hpp"
#include "cuda/kernels/fused_forward.hpp"
#include "cuda/kernels/home_reduce.hpp"
#include "cuda/kernels/pass_segments.hpp"
#include "cuda/kernels/quantize_pass_fp8.hpp"
#include "cuda/kernels/router_grad.hpp"
#include "cuda/kernels/transfer.hpp"
#include "mok/schedule.hpp"

namespace mok::cuda {
namespace {

using bf16 = __nv_bfloat16;

void check(cudaError_t e, const char* what) {
  mok::cuda_check(e, what);
}

// One rank's FP8 scratch (plan::Fp8Plan; null without it): the e4m3 operands of a pass.
struct Fp8Buffers {
  std::uint8_t *rows_a = nullptr, *rows_b = nullptr, *rows_c = nullptr;  // 1x128 along K
  float *rows_a_scales = nullptr, *rows_b_scales = nullptr, *rows_c_scales = nullptr;
  std::uint8_t *t_x = nullptr, *t_dy = nullptr, *t_dg = nullptr, *t_du = nullptr, *t_h = nullptr;
  float *t_x_scales = nullptr, *t_dy_scales = nullptr, *t_dg_scales = nullptr,
        *t_du_scales = nullptr, *t_h_scales = nullptr;
};

// One rank's buffers of the plan's layer region (plan::WorkspacePlan): scratch only (the forward
// context is the caller's, RankTensors::ctx).
struct RankBuffers {
  // The rows of a pass: pass 0's are the caller's context; later passes (and backward's replays
  // of them) use this scratch set (only when there can be several passes).
  struct PassSet {
    bf16 *x = nullptr, *gate = nullptr, *up = nullptr, *hidden = nullptr;
  };
  PassSet scratch;
  bf16* y = nullptr;             // [R, H]: backward: d_out rows (bf16 without wh: then dy in place)
  bf16* dg = nullptr;            // [R, I]
  bf16* du = nullptr;            // [R, I]
  bf16* wh = nullptr;            // [R, I]: bf16(w h) (plan::scaled_hidden_in_backward), or null
  float* row_weights = nullptr;  // [R]: the router weight of each row of the pass (backward)
  float* dot = nullptr;          // [R, ceil(I / 128)]: d_w partials of the down dgrad's epilogue
  std::int32_t *pass_starts = nullptr, *pass_rows = nullptr;  // [E_l + 1], [E_l]
  std::int32_t* pass_steps = nullptr;  // [E_l]: the weight gradients' pass plan (passes > 1)
  // shared expert
  bf16* s_out = nullptr;                  // [T, H]: output, then dx
  bf16 *s_dg = nullptr, *s_du = nullptr;  // [T, S]
  // fp32 sums of the experts whose rows span passes (passes > 1): carry_slots [I, H] / [H, I]
  float *carry_gate = nullptr, *carry_up = nullptr, *carry_down = nullptr;
  std::uint32_t* fused_counters = nullptr;  // the forward megakernel's (zero between launches)
  Fp8Buffers fp8;                           // its own allocation (Layer made with `fp8`)
};

// One family of SwiGLU experts over a row buffer: the routed experts over a ring pass (grouped
// by the pass's segments) or the shared expert over the rank's tokens (dense). Both run the same
// GEMM forms in the same order, forward and backward.
struct ExpertRows {
  gemm::RowSegments segments;
  std::int64_t hidden;  // H
  std::int64_t width;   // N: I (routed) or S (shared)
  const bf16* w_gate;   // [G, N, H], gate_up_strides
  const bf16* w_up;     // [G, N, H], gate_up_strides
  const bf16* w_down;   // [G, H, N] contiguous
  cudaStream_t stream;
  std::optional<float> swiglu_limit;  // Weights::swiglu_limit: the clamped epilogues
  gemm::WaitOptions waits;            // the layer's bound and timeout report
  // Routed gate and up may be row-strided views (core/validate.cpp), e.g. of one packed [G, 2N, H]
  // tensor, read in place through the tensor maps; default: contiguous.
  gemm::WeightStrides gate_up_strides = {};
  // The FP8 layer (routed experts only): the quantized weights the GEMMs read instead of w_gate,
  // w_up and w_down, and the scratch their e4m3 row operands are quantized into. Null: bf16.
  const Fp8Weights* q = nullptr;
  const Fp8Buffers* fp8 = nullptr;
  Layer::Fp8Kernels kernels = {};  // the FP8 layer's kernel choices (Layer::set_fp8_kernels)

  // A GEMM form's arguments with this family's stream and wait bound set: every launch below
  // starts from these, so none runs without the layer's timeout report.
  template <class Args>
  Args launch_args() const {
    Args a;
    a.stream = stream;
    a.waits = waits;
    return a;
  }
};

// The tensor-map strides of a routed gate/up weight view [G, N, H] (validated: unit column stride,
// gate and up alike). One expert: its stride is never used (0: the default).
gemm::WeightStrides weight_strides(const TensorView& v) {
  return {v.strides[1], v.shape[0] > 1 ? v.strides[0] : 0};
}

// g = bf16(x W_gate^T), u = bf16(x W_up^T), h = bf16(silu(g) * u), in one GEMM (with a limit L:
// h = bf16(silu(min(g, L)) * clamp(u, -L, L)), g and u stored unclamped).
gemm::GateUpForwardArgs gate_up_args(const ExpertRows& e, const bf16* x, bf16* g, bf16* u,
                                     bf16* h) {
  gemm::GateUpForwardArgs a = e.launch_args<gemm::GateUpForwardArgs>();
  a.segments = e.segments;
  a.x = x;
  a.ld_x = e.hidden;
  a.w_gate = e.w_gate;
  a.w_up = e.w_up;
  a.w_strides = e.gate_up_strides;
  a.hidden = h;
  a.gate = g;
  a.up = u;
  a.ld_out = e.width;
  a.hidden_size = static_cast<int>(e.hidden);
  a.intermediate_size = static_cast<int>(e.width);
  a.swiglu_limit = e.swiglu_limit;
  return a;
}
void gate_up_forward(const ExpertRows& e, const bf16* x, bf16* g, bf16* u, bf16* h) {
  gemm::gate_up_forward(gate_up_args(e, x, g, u, h));
}

// y = bf16(h W_down^T); with `to` its rows go straight to their home slots (the combine).
gemm::RowsTimesWeightTArgs down_args(const ExpertRows& e, const bf16* h, bf16* y,
                                     const gemm::RowScatter& to) {
  gemm::RowsTimesWeightTArgs a = e.launch_args<gemm::RowsTimesWeightTArgs>();
  a.segments = e.segments;
  a.a = h;
  a.ld_a = e.width;
  a.w = e.w_down;
  a.out = y;
  a.scatter = to;
  a.ld_out = e.hidden;
  a.n = static_cast<int>(e.hidden);
  a.k = static_cast<int>(e.width);
  return a;
}
void down_forward(const ExpertRows& e, const bf16* h, bf16* y, const gemm::RowScatter& to = {}) {
  gemm::rows_times_weight_t(down_args(e, h, y, to));
}

// dh = bf16(row_weights[r] * (d_out W_down)) (or bf16(d_out W_down) without row weights) and,
// in the same GEMM's epilogue, the SwiGLU backward: dg, du = bf16(swiglu_backward(g, u, dh)); dh
// itself is never stored. With `dot`, the epilogue also leaves the router-weight gradient's
// partial sums <d_out W_down, h> per row and 128-column chunk.
void down_dgrad_swiglu(const ExpertRows& e, const bf16* d_out, const bf16* g, const bf16* u,
                       bf16* dg, bf16* du, const float* row_weights, float* dot,
                       bf16* scaled_hidden) {
  gemm::RowsTimesWeightArgs a = e.launch_args<gemm::RowsTimesWeightArgs>();
  a.segments = e.segments;
  a.a = d_out;
  a.ld_a = e.hidden;
  a.w = e.w_down;
  a.swiglu.gate = g;
  a.swiglu.up = u;
  a.swiglu.d_gate = dg;
  a.swiglu.d_up = du;
  a.swiglu.row_scale = row_weights;
  a.swiglu.dot = dot;
  a.swiglu.scaled_hidden = scaled_hidden;
  a.swiglu.limit = e.swiglu_limit;
  a.ld_out = e.width;
  a.n = static_cast<int>(e.width);
  a.k = static_cast<int>(e.hidden);
  gemm::rows_times_weight(a);
}

// dx = bf16(dg W_gate + du W_up), one fp32 accumulator (the reference's order); with `to` its
// rows go straight to their home slots (the backward combine).
void gate_up_dgrad(const ExpertRows& e, const bf16* dg, const bf16* du, bf16* dx,
                   const gemm::RowScatter& to) {
  gemm::RowsTimesWeightArgs a = e.launch_args<gemm::RowsTimesWeightArgs>();
  a.scatter = to;
  a.segments = e.segments;
  a.a = dg;
  a.ld_a = e.width;
  a.w = e.w_gate;
  a.a2 = du;
  a.ld_a2 = e.width;
  a.w2 = e.w_up;
  a.w_strides = e.gate_up_strides;
  a.out = dx;
  a.ld_out = e.hidden;
  a.n = static_cast<int>(e.hidden);
  a.k = static_cast<int>(e.width);
  gemm::rows_times_weight(a);
}

// Where one weight gradient goes: the caller's view (bf16, or fp32 written or added to). When the
// rows come in several ring passes, the pass plan (`steps`, on the device) says per expert
// whether this pass holds all its rows (stored to the view as in one pass), none (untouched), or
// part of them (an fp32 sum carried in its slot of `carry` from pass to pass, stored to the view
// at its last pass).
struct GradTarget {
  const TensorView* view;
  bool add_to_view;       // fp32 main-grad accumulation
  gemm::PassPlan passes;  // steps null: one pass
  bool later_pass;        // a pass after the first: some experts may continue a carried sum
};

// The arguments of a weight gradient [G, m, n] into `t` on e.stream, its operands unset.
// `tickets`: that stream's ticket counter pair (zero between launches; the launches that use a
// pair are ordered on its stream).
gemm::WeightGradArgs weight_grad_args(const ExpertRows& e, std::int64_t m, std::int64_t n,
                                      const GradTarget& t, unsigned* tickets) {
  gemm::WeightGradArgs w = e.launch_args<gemm::WeightGradArgs>();
  w.segments = e.segments;
  w.out = t.view->data;
  w.ld_out = n;
  // Routed gradients may be row-strided views (core/validate.cpp), e.g. the halves of one packed
  // [G, 2m, n] gradient: stored in place through their strides.
  const TensorView& v = *t.view;
  if (v.ndim == 3) {
    w.ld_out = v.strides[1];
    w.out_group_stride = v.shape[0] > 1 ? v.strides[0] : 0;
  }
  w.out_fp32 = t.view->dtype == DType::f32;
  w.accumulate = t.add_to_view;  // out + the fresh sum
  w.m = static_cast<int>(m);
  w.n = static_cast<int>(n);
  w.tickets = tickets;
  w.passes = t.passes;
  return w;
}

// `launch(w)` for one pass: every expert; else the kWhole and kOpen ones, and then the experts
// that continue a carried sum (kCarry, kClose: at most the one expert whose rows cross into this
// pass) in a launch of their own. NOTES: seeding the accumulators makes ptxas serialize the wgmma
// pipeline of the whole kernel (forms.cuh), so only that launch has it.
template <class Launch>
void run_weight_grad(gemm::WeightGradArgs w, const GradTarget& t, Launch&& launch) {
  launch(w);
  if (t.passes.steps != nullptr && t.later_pass) {
    w.continue_reduction = true;
    launch(w);
  }
}

// out[G, m, n] = a[rows]^T b[rows] per group, on e.stream.
void weight_grad(const ExpertRows& e, const bf16* a, std::int64_t m, const bf16* b, std::int64_t n,
                 const GradTarget& t, unsigned* tickets) {
  gemm::WeightGradArgs w = weight_grad_args(e, m, n, t, tickets);
  w.a = a;
  w.ld_a = m;
  w.b = b;
  w.ld_b = n;
  run_weight_grad(w, t, [](const gemm::WeightGradArgs& args) { gemm::weight_grad(args); });
}

// ---- The FP8 forms (docs/architecture.md, "The FP8 layer"): each routed GEMM on e4m3 operands,
// its rows quantized from the bf16 rows just before it, on the stream that then reads them, into
// the rank's FP8 scratch (e.fp8); the weights from e.q. Outputs and epilogues as the bf16 forms'.

gemm::Fp8Weight fp8_weight(const QuantizedWeights& q) {
  return {q.data.ptr<const std::uint8_t>(), q.scales.ptr<const float>()};
}
gemm::Fp8Weight fp8_weight_t(const QuantizedWeights& q) {  // the transposed copy (the dgrads')
  return {q.data_t.ptr<const std::uint8_t>(), q.scales_t.ptr<const float>()};
}

// The pass's rows x [R, K] -> 1x128 blocks along K (the M-grouped forms' A operand), on e.stream,
// for the rows of the pass's segments only (R = the segments' capacity: the ring).
gemm::Fp8Rows quantize_rows(const ExpertRows& e, const bf16* x, std::int64_t K, std::uint8_t* data,
                            float* scales) {
  QuantizePassRowsParams p;
  p.x = reinterpret_cast<const std::uint16_t*>(x);
  p.ld_x = K;
  p.rows = e.segments.capacity_rows;
  p.K = K;
  p.row_end = e.segments.starts + e.segments.num_groups;
  p.data = data;
  p.ld = K;
  p.scales = scales;
  p.scale_ld = e.segments.capacity_rows;
  check(launch_quantize_pass_rows(p, e.stream), "FP8 quantization of a pass's rows");
  return {data, K, scales, e.segments.capacity_rows};
}

// The token-axis copy of the pass's rows x [R, K] (a weight gradient's operand): 128-row blocks
// of each expert's rows from its first, scales from its rows only; on e.stream. With
// `row_weights`, of the rows bf16(w x) (dy from the d_out rows, in the same pass).
gemm::Fp8TokenAxis quantize_token_axis(const ExpertRows& e, const bf16* x, std::int64_t K,
                                       std::uint8_t* data, float* scales,
                                       const float* row_weights = nullptr) {
  QuantizePassTokenAxisParams p;
  p.x = reinterpret_cast<const std::uint16_t*>(x);
  p.ld_x = K;
  p.rows = e.segments.capacity_rows;
  p.K = K;
  p.starts = e.segments.starts;
  p.counts = e.segments.rows;
  p.groups = e.segments.num_groups;
  p.data = data;
  p.ld = e.segments.capacity_rows;
  p.scales = scales;
  p.scale_ld = K;
  p.row_weights = row_weights;
  p.row_loads = e.kernels.token_axis_row_loads;
  check(launch_quantize_pass_token_axis(p, e.stream), "FP8 token-axis quantization of a pass");
  return {data, e.segments.capacity_rows, scales, K};
}

// The rows a pull quantized as they landed (PullParams::fp8_rows into rows_a: forward x, backward
// d_out), as the M-grouped forms' A operand.
gemm::Fp8Rows pulled_rows(const ExpertRows& e) {
  return {e.fp8->rows_a, e.hidden, e.fp8->rows_a_scales, e.segments.capacity_rows};
}

// The pull quantizes its rows as they land (1x128 along H) into rows_a.
void pull_fp8(PullParams& pull, const ExpertRows& e) {
  pull.fp8_rows = e.fp8->rows_a;
  pull.fp8_scales = e.fp8->rows_a_scales;
}

// The kernel choices (Layer::Fp8Kernels; every choice gives the same bits), and why the defaults
// are what they are:
// - overlap (the next K block's wgmma in flight during a block's promotion): NOTES ("642f5ff"),
//   each form alone on an H200: the M-grouped forms 0.88-1.00x with it (their consumers then wait
//   for their stages): off; the weight gradient 1.09-1.15x on dsv3-ep8slice, qwen3-30b-a3b and
//   mixtral-8x7b (0.97-1.04x on dsv3-ep1, whose groups hold one or two token blocks): on.
// - wide (128 x 256 tiles for the M-grouped forms; down and the input gradients where n fills
//   whole wide tiles, a multiple of 256): NOTES ("58329ee"), each form alone on an H100:
//   1.09-1.34x the 128 x 128 tiles on gate/up, down and dgrad, dgrad-swiglu 0.96-1.19x: on.
// - wgrad_tma_store (the weight gradients' bf16 tiles through shared memory and TMA, as the bf16
//   ones store): 1.01-1.03x with the overlap on the same H100: on.
// - quantizing_epilogue (the down dgrad writes dg and du quantized: no bf16 dg and du, no passes
//   over them): the down dgrad alone 0.76-0.91x, the passes it removes not timed beside it: off
//   until the layer benchmark shows it faster.
// - token_axis_row_loads (the token-axis quantizer reading whole rows, fp8_quantize.cuh's
//   quantize_token_tile_rows): alone on an H100, 1.23-1.33x the other kernel on the standard
//   cases (docs/perf/method.md), 0.88-0.94 of a device copy's rate (NOTES, "2026-12-06,
//   48dbb95"): on.
// - hidden_epilogue (the gate/up epilogue writes q(h) beside h: no pass over h): the FP8
//   forwards 0.90-0.93x on qwen3-30b-a3b and 0.95-0.98x on dsv3-ep8slice, the bf16 layer's
//   (untouched) 0.98x in the same runs (NOTES, "2026-12-06, 48e4578", H100): on.
// - dgrad_rows_epilogue (the down dgrad's epilogue writes q(dg) and q(du) beside dg and du: no
//   passes over them): the wide dgrad-swiglu with it against the same GEMM and the two passes,
//   each alone at the power limit, 0.93x on qwen3-30b-a3b, 0.96x on mixtral-8x7b, 0.99x on
//   dsv3-ep8slice (NOTES, "2026-12-06, 7a65b04", H100; in the layer below the A/B's
//   resolution): on.
// - dgrad_rows_wide (that dgrad on 128 x 256 tiles): the rows epilogue costs a wide tile more
//   than two 128 x 128 ones (at the register cap); the 128 x 128 form with it runs 0.87x the
//   wide one's time on qwen3-30b-a3b and 0.98-0.99x on dsv3-ep8slice and mixtral-8x7b, uniform
//   (skewed: 0.88x, 0.98x, 1.00x), on H 1,792 0.86x, H 3,584 0.98x (NOTES, "2026-12-06,
//   329e2bf", H100): off.
bool fp8_wide(const ExpertRows& e, std::int64_t n) { return e.kernels.wide && n % 256 == 0; }

// Whether the gate/up epilogue quantizes h for the down GEMM (Fp8Kernels::hidden_epilogue; its
// tiles must be wide: a tile's 128 columns of h are one 1x128 block). q(h) then goes to rows_b,
// which no forward GEMM reads (rows_a holds q(x) while gate/up runs).
bool gate_up_quantizes_hidden(const ExpertRows& e) {
  return e.kernels.hidden_epilogue && e.kernels.wide;
}
gemm::Fp8Rows quantized_hidden(const ExpertRows& e) {
  return {e.fp8->rows_b, e.width, e.fp8->rows_b_scales, e.segments.capacity_rows};
}

// g, u, h as gate_up_forward, from q(x).W_gate and q(x).W_up (q(x): pulled_rows); with
// `quantize_hidden` (where the down GEMM follows) and gate_up_quantizes_hidden, q(h) as well.
void gate_up_forward_fp8(const ExpertRows& e, bf16* g, bf16* u, bf16* h, bool quantize_hidden) {
  gemm::GateUpForwardFp8Args a = e.launch_args<gemm::GateUpForwardFp8Args>();
  a.segments = e.segments;
  a.x = pulled_rows(e);
  a.w_gate = fp8_weight(e.q->gate);
  a.w_up = fp8_weight(e.q->up);
  a.hidden = h;
  a.gate = g;
  a.up = u;
  a.ld_out = e.width;
  a.hidden_size = static_cast<int>(e.hidden);
  a.intermediate_size = static_cast<int>(e.width);
  a.swiglu_limit = e.swiglu_limit;
  a.overlap = e.kernels.overlap;
  a.wide = e.kernels.wide;
  if (quantize_hidden && gate_up_quantizes_hidden(e)) {
    const gemm::Fp8Rows q = quantized_hidden(e);
    a.hidden_quantized = {e.fp8->rows_b, q.ld, e.fp8->rows_b_scales, q.scale_ld};
  }
  gemm::gate_up_forward_fp8(a);
}

// y = bf16(q(h).W_down), its rows to their home slots (the combine). q(h) from the gate/up
// epilogue (gate_up_quantizes_hidden), else quantized here from h.
void down_forward_fp8(const ExpertRows& e, const bf16* h, const gemm::RowScatter& to) {
  gemm::RowsTimesWeightTFp8Args a = e.launch_args<gemm::RowsTimesWeightTFp8Args>();
  a.segments = e.segments;
  a.a = gate_up_quantizes_hidden(e)
            ? quantized_hidden(e)
            : quantize_rows(e, h, e.width, e.fp8->rows_a, e.fp8->rows_a_scales);
  a.w = fp8_weight(e.q->down);
  a.scatter = to;
  a.ld_out = e.hidden;
  a.n = static_cast<int>(e.hidden);
  a.k = static_cast<int>(e.width);
  a.overlap = e.kernels.overlap;
  a.wide = fp8_wide(e, a.n);
  gemm::rows_times_weight_t_fp8(a);
}

// down_dgrad_swiglu from q(d_out) (pulled_rows) and the transposed W_down copy. With `quantized`,
// dg and du are written quantized as well: in both forms with dg and du null (not in bf16), or in
// the rows forms alone beside the bf16 dg and du. scaled_hidden: as down_dgrad_swiglu's,
// only where dW_down is the bf16 layer's GEMM (BackwardOptions::fp8_weight_grads false); the e4m3
// dW_down takes the reference's operands, t(dy) and t(h).
void down_dgrad_swiglu_fp8(const ExpertRows& e, const bf16* g, const bf16* u, bf16* dg, bf16* du,
                           const float* row_weights, float* dot,
                           const gemm::SwigluBackwardFp8Out& quantized = {},
                           bf16* scaled_hidden = nullptr) {
  gemm::RowsTimesWeightFp8Args a = e.launch_args<gemm::RowsTimesWeightFp8Args>();
  a.segments = e.segments;
  a.a = pulled_rows(e);
  a.w_t = fp8_weight_t(e.q->down);
  a.swiglu.gate = g;
  a.swiglu.up = u;
  a.swiglu.d_gate = dg;
  a.swiglu.d_up = du;
  a.swiglu.row_scale = row_weights;
  a.swiglu.dot = dot;
  a.swiglu.scaled_hidden = scaled_hidden;
  a.swiglu.limit = e.swiglu_limit;
  a.quantized = quantized;
  a.ld_out = e.width;
  a.n = static_cast<int>(e.width);
  a.k = static_cast<int>(e.hidden);
  a.overlap = quantized.any() ? false : e.kernels.overlap;
  a.wide = quantized.tokens() ? false
           : quantized.any()  ? e.kernels.dgrad_rows_wide && fp8_wide(e, a.n)
                              : fp8_wide(e, a.n);
  gemm::rows_times_weight_fp8(a);
}

// dx = bf16(q(dg).W_gate^T + q(du).W_up^T), one accumulator, rows to their home slots; dg and du
// come quantized (expert_backward_fp8 says where).
void gate_up_dgrad_fp8(const ExpertRows& e, const gemm::Fp8Rows& dg, const gemm::Fp8Rows& du,
                       const gemm::RowScatter& to) {
  gemm::RowsTimesWeightFp8Args a = e.launch_args<gemm::RowsTimesWeightFp8Args>();
  a.segments = e.segments;
  a.a = dg;
  a.w_t = fp8_weight_t(e.q->gate);
  a.a2 = du;
  a.w2_t = fp8_weight_t(e.q->up);
  a.scatter = to;
  a.ld_out = e.hidden;
  a.n = static_cast<int>(e.hidden);
  a.k = static_cast<int>(e.width);
  a.overlap = e.kernels.overlap;
  a.wide = fp8_wide(e, a.n);
  gemm::rows_times_weight_fp8(a);
}

// weight_grad from token-axis copies.
void weight_grad_fp8(const ExpertRows& e, const gemm::Fp8TokenAxis& a, std::int64_t m,
                     const gemm::Fp8TokenAxis& b, std::int64_t n, const GradTarget& t,
                     unsigned* tickets) {
  run_weight_grad(weight_grad_args(e, m, n, t, tickets), t, [&](const gemm::WeightGradArgs& args) {
    gemm::weight_grad_fp8({args, a, b, e.kernels.wgrad_overlap, e.kernels.wgrad_tma_store});
  });
}

// Backward through one expert family, given the output gradient rows (and x, g, u, h of the
// forward):
//   dg/du = SwiGLU backward of dh = bf16(w (d_out W_down)) (one GEMM; routed rows: with the d_w
//   partials, and bf16(w h) where scaled_hidden is given), then `between` (routed rows: d_w
//   pushed home; without scaled_hidden, d_out rows scaled to dy = bf16(w d_out) in place),
//   dx = dg W_gate + du W_up, dW_gate = dg^T x, dW_up = du^T x, and dW_down = d_out^T bf16(w h)
//   with scaled_hidden, else dy^T h (the shared expert: w = 1, d_out^T h).
struct ExpertBackward {
  const bf16 *x, *gate, *up, *hidden;
  bf16* d_out;               // rows of d_out; bf16 routed without scaled_hidden: dy after `between`
  const float* row_weights;  // routed: the rows' router weights; shared: null
  float* dot;                // routed: d_w partials; shared: null
  bf16 *dg, *du, *dx;        // scratch rows and the input gradient
  GradTarget d_gate, d_up, d_down;
  gemm::RowScatter dx_to;         // routed: dx rows go to their home slots
  bf16* scaled_hidden = nullptr;  // routed, I <= H, bf16 dW_down: bf16(w h), by the down dgrad
};

// Streams beside the caller's, one per weight gradient (plan::kWgradStreams), and the events that
// fork them from the caller's stream and join them back. `tickets`: one counter pair per stream.
struct WgradStreams {
  cudaStream_t side[plan::kWgradStreams] = {};
  cudaEvent_t forked = nullptr;
  cudaEvent_t done[plan::kWgradStreams] = {};
  cudaEvent_t handed = nullptr;  // hand_over's
  unsigned* tickets = nullptr;  // [kWgradStreams, 2]

  // The side streams wait for what `s` has queued so far.
  void fork(cudaStream_t s) const {
    check(cudaEventRecord(forked, s), "cudaEventRecord (weight gradients fork)");
    for (cudaStream_t side_stream : side) {
      check(cudaStreamWaitEvent(side_stream, forked, 0), "cudaStreamWaitEvent (fork)");
    }
  }
  // Side stream `to` waits for what side stream `from` has queued so far (one operand two
  // weight gradients read: the FP8 layer's t(x)).
  void hand_over(int from, int to) const {
    check(cudaEventRecord(handed, side[from]), "cudaEventRecord (weight gradients hand-over)");
    check(cudaStreamWaitEvent(side[to], handed, 0), "cudaStreamWaitEvent (hand-over)");
  }
  // `s` waits for what the side streams have queued so far.
  void join(cudaStream_t s) const {
    for (int i = 0; i < plan::kWgradStreams; ++i) {
      check(cudaEventRecord(done[i], side[i]), "cudaEventRecord (weight gradients join)");
      check(cudaStreamWaitEvent(s, done[i], 0), "cudaStreamWaitEvent (join)");
    }
  }
};

// Backward through one expert family. After the down dgrad (on the caller's stream) the work
// forks: `between` and dW_down on side stream 0, dW_gate on 1, dW_up on 2, and dx on the
// caller's stream, all at once. The caller joins (WgradStreams::join) before anything overwrites
// the rows they read (the next pass) and before it reads what `between` pushed.
//
// NOTES: the three weight gradients and dx only read dg, du, x and h, which nothing writes until
// the join; `between` rewrites d_out in place into dy, which only dW_down reads after it (the down
// dgrad read it before the fork); each gradient writes its own view and carry slot. So they run at
// once, and which CTA runs a tile never changes its bits: the results are the serial order's.
// Why at once: under skew (one expert holding half the rows) each weight gradient is bound by
// that expert's long tiles (48 at qwen3-30b-a3b) and, run one after the other, leaves most SMs
// idle; and the memory-bound `between` (a read and a write of every row) hides under the GEMMs.
template <class Between>
void expert_backward(const ExpertRows& e, const ExpertBackward& b, const WgradStreams& w,
                     Between&& between) {
  down_dgrad_swiglu(e, b.d_out, b.gate, b.up, b.dg, b.du, b.row_weights, b.dot, b.scaled_hidden);
  w.fork(e.stream);
  ExpertRows on[plan::kWgradStreams] = {e, e, e};
  for (int i = 0; i < plan::kWgradStreams; ++i) on[i].stream = w.side[i];
  between(w.side[0]);
  const bf16* h = b.scaled_hidden != nullptr ? b.scaled_hidden : b.hidden;
  weight_grad(on[0], b.d_out, e.hidden, h, e.width, b.d_down, w.tickets);
  weight_grad(on[1], b.dg, e.width, b.x, e.hidden, b.d_gate, w.tickets + 2);
  weight_grad(on[2], b.du, e.width, b.x, e.hidden, b.d_up, w.tickets + 4);
  gate_up_dgrad(e, b.dg, b.du, b.dx, b.dx_to);
}

// expert_backward in FP8 (routed experts): the same GEMMs on the same
// streams in the same order. q(d_out) comes from the pull (rows_a); every other e4m3 operand is
// quantized from the bf16 rows on the stream that reads it, after what wrote them: on the
// caller's stream after the down dgrad, q(dg) and q(du) (dx reads them there); after the fork,
// t(h) and t(dy) on side stream 0, t(x) and t(dg) on 1, t(du) on 2, each before its weight
// gradient, so dx starts as soon as its operands are there. t(x), which both side streams 1 and
// 2 read, is the widest pass (H columns): side stream 2 quantizes t(du) first and then waits for
// side stream 1's t(x) (hand_over), so that t(x) is off the caller's stream, where dx waited for
// it.
// t(dy) scales the d_out rows by their router weights as it reads them (dy = bf16(w d_out), the
// reference's, never written in bf16: `between` only pushes d_w here). Scratch: rows_a holds
// q(d_out), then q(dg) (the down dgrad has read it by then: one stream); the join before the next
// pass orders the next pass's writes.
// kernels.quantizing_epilogue: the down dgrad writes q(dg), q(du) and t(dg), t(du) itself, and
// dg and du are not written in bf16. rows_a holds the dgrad's own operand meanwhile, so q(dg)
// goes to rows_b and q(du) into the bf16 du scratch, which this call does not use otherwise:
// [R, I] bf16 holds [R, I] e4m3 and then its [I/128, R] scales (R I / 32 bytes). The FP8 scratch
// does not grow.
// kernels.dgrad_rows_epilogue (and not the quantizing epilogue): the down dgrad writes q(dg), q(du)
// beside the bf16 dg and du (the token-axis copies, or the bf16 weight gradients, read those),
// into rows_b and rows_c: rows_a holds the dgrad's own operand meanwhile.
// fp8_wgrads false (BackwardOptions::fp8_weight_grads): no token-axis copy; the three weight
// gradients are expert_backward's bf16 GEMMs of the bf16 rows, on the same side streams, with the
// router weight where the bf16 layer puts it: in bf16(w h), which the down dgrad's epilogue writes
// (b.scaled_hidden, I <= H), else in dy (`between` scales the d_out rows in place). The dgrads
// stay e4m3. The quantizing epilogue, which writes no bf16 dg and du, is then not used. With
// fp8_wgrads, b.scaled_hidden is null (t(dy) scales d_out as it reads it).
template <class Between>
void expert_backward_fp8(const ExpertRows& e, const ExpertBackward& b, const WgradStreams& w,
                         bool fp8_wgrads, Between&& between) {
  const Fp8Buffers& f = *e.fp8;
  const std::int64_t H = e.hidden, I = e.width, R = e.segments.capacity_rows;
  const bool quantizing_epilogue = e.kernels.quantizing_epilogue && fp8_wgrads;
  gemm::Fp8Rows dg, du;
  gemm::Fp8TokenAxis t_dg, t_du;
  if (!quantizing_epilogue && e.kernels.dgrad_rows_epilogue) {
    gemm::SwigluBackwardFp8Out q;
    q.d_gate_rows = {f.rows_b, I, f.rows_b_scales, R};
    q.d_up_rows = {f.rows_c, I, f.rows_c_scales, R};
    down_dgrad_swiglu_fp8(e, b.gate, b.up, b.dg, b.du, b.row_weights, b.dot, q, b.scaled_hidden);
    dg = {f.rows_b, I, f.rows_b_scales, R};
    du = {f.rows_c, I, f.rows_c_scales, R};
  } else if (quantizing_epilogue) {
    std::uint8_t* const du_q = reinterpret_cast<std::uint8_t*>(b.du);
    float* const du_q_scales = reinterpret_cast<float*>(du_q + R * I);  // 16 KiB-aligned offset
    gemm::SwigluBackwardFp8Out q;
    q.d_gate_rows = {f.rows_b, I, f.rows_b_scales, R};
    q.d_up_rows = {du_q, I, du_q_scales, R};
    q.d_gate_tokens = {f.t_dg, R, f.t_dg_scales, I};
    q.d_up_tokens = {f.t_du, R, f.t_du_scales, I};
    down_dgrad_swiglu_fp8(e, b.gate, b.up, nullptr, nullptr, b.row_weights, b.dot, q);
    dg = {f.rows_b, I, f.rows_b_scales, R};
    du = {du_q, I, du_q_scales, R};
    t_dg = {f.t_dg, R, f.t_dg_scales, I};
    t_du = {f.t_du, R, f.t_du_scales, I};
  } else {
    down_dgrad_swiglu_fp8(e, b.gate, b.up, b.dg, b.du, b.row_weights, b.dot, {},
                          b.scaled_hidden);
    dg = quantize_rows(e, b.dg, I, f.rows_a, f.rows_a_scales);
    du = quantize_rows(e, b.du, I, f.rows_b, f.rows_b_scales);
  }
  w.fork(e.stream);
  ExpertRows on[plan::kWgradStreams] = {e, e, e};
  for (int i = 0; i < plan::kWgradStreams; ++i) on[i].stream = w.side[i];
  if (!fp8_wgrads) {
    between(w.side[0]);  // d_w pushed home; without scaled_hidden, d_out scaled into dy
    const bf16* h = b.scaled_hidden != nullptr ? b.scaled_hidden : b.hidden;
    weight_grad(on[0], b.d_out, H, h, I, b.d_down, w.tickets);
    weight_grad(on[1], b.dg, I, b.x, H, b.d_gate, w.tickets + 2);
    weight_grad(on[2], b.du, I, b.x, H, b.d_up, w.tickets + 4);
    gate_up_dgrad_fp8(e, dg, du, b.dx_to);
    return;
  }
  if (!quantizing_epilogue) {
    t_du = quantize_token_axis(on[2], b.du, I, f.t_du, f.t_du_scales);
  }
  const gemm::Fp8TokenAxis t_x = quantize_token_axis(on[1], b.x, H, f.t_x, f.t_x_scales);
  w.hand_over(1, 2);  // t(x) alone: recorded before side stream 1 queues anything else
  const gemm::Fp8TokenAxis t_h = quantize_token_axis(on[0], b.hidden, I, f.t_h, f.t_h_scales);
  between(w.side[0]);  // d_w pushed home
  const gemm::Fp8TokenAxis t_dy =
      quantize_token_axis(on[0], b.d_out, H, f.t_dy, f.t_dy_scales, b.row_weights);
  weight_grad_fp8(on[0], t_dy, H, t_h, I, b.d_down, w.tickets);
  if (!quantizing_epilogue) {
    t_dg = quantize_token_axis(on[1], b.dg, I, f.t_dg, f.t_dg_scales);
  }
  weight_grad_fp8(on[1], t_dg, I, t_x, H, b.d_gate, w.tickets + 2);
  weight_grad_fp8(on[2], t_du, I, t_x, H, b.d_up, w.tickets + 4);
  gate_up_dgrad_fp8(e, dg, du, b.dx_to);
}

}  // namespace

struct Layer::Impl {
  Problem problem;
  Config config;
  int device = 0;
  Team team;
  // The ranks this process runs: [first, first + count). Virtual team: every rank (0, W); external
  // team: this process's one rank (ep_rank, 1). Ranks are global everywhere below; the per-rank
  // arrays (`ranks`, the call's RankTensors, the team's local regions) are indexed rank - first.
  int first = 0;
  int count = 1;
  std::int64_t ring = 0;  // R: ring rows
  int passes = 1;
  ForwardPath path = config.forward_path;
  Layer::Fp8Kernels fp8_kernels;  // Layer::set_fp8_kernels
  std::int64_t fused_stage_rows = config.resolved_fused_stage_rows();
  ForwardHooks hooks;  // tests and benchmarks only (set_forward_hooks)
  // The order of calls on different streams (CallOrder): the event the last eager call recorded
  // on its stream when its work was enqueued.
  cudaEvent_t call_done = nullptr;
  cudaStream_t last_stream = nullptr;
  bool recorded = false;
  // Where this layer's GEMM launches report a wait that gave up (check_errors takes it): its own,
  // so a stall is reported by the layer that stalled.
  std::unique_ptr<gemm::TimeoutReport> gemm_report;
  std::vector<RankBuffers> ranks;
  void* layer = nullptr;  // every rank's layer region (plan::WorkspacePlan), one allocation
  std::int64_t layer_bytes = 0;
  std::int32_t* dense_rows = nullptr;  // device scalar T: the shared expert's row count
  WgradStreams wgrad;                  // its ticket counter pairs are zeroed once
  // The FP8 layer's scratch (Layer made with `fp8`): every rank's, one allocation.
  void* fp8_region = nullptr;
  std::int64_t fp8_bytes = 0;
  // Peer-address arrays (device), one entry per rank.
  const void** x_peers = nullptr;
  const void** d_out_peers = nullptr;
  const float** w_peers = nullptr;
  void** combine_peers = nullptr;
  void** dx_peers = nullptr;
  float** dw_peers = nullptr;

  Impl(const Problem& p, const Config& c, int dev, const ExternalRank& external)
      : problem(p),
        config(c),
        device(dev),
        team(external.symmetric_bases.empty()
                 ? Team::local_virtual(p, c, {.device_index = dev})
                 : Team::external(
                       p, c, {p.ep_rank, external.symmetric_bases},
                       {.device_index = dev, .barrier_timeout_ms = external.barrier_timeout_ms})),
        first(team.first_rank()),
        count(team.num_local_ranks()) {}

  bool external() const { return !team.impl().virtual_ranks; }
  RankBuffers& buffers(int r) { return ranks[r - first]; }
  const RankBuffers& buffers(int r) const { return ranks[r - first]; }

  // External team: every rank's launches up to here, on every GPU, have completed before any
  // rank's work after it (a team barrier at system scope). A virtual team's ranks share the
  // stream, whose order is enough.
  void team_barrier(cudaStream_t s) {
    if (external()) check(launch_team_barrier(team.impl(), s), "team barrier");
  }
  ~Impl() {
    for (cudaStream_t s : wgrad.side) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
    for (cudaEvent_t e : wgrad.done) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (wgrad.forked != nullptr) cudaEventDestroy(wgrad.forked);
    if (wgrad.handed != nullptr) cudaEventDestroy(wgrad.handed);
    if (call_done != nullptr) cudaEventDestroy(call_done);
    cudaFree(layer);
    cudaFree(fp8_region);
  }

  const plan::WorkspacePlan& plan() const { return team.impl().plan; }
  gemm::WaitOptions waits() const { return {.report = gemm_report.get()}; }
  std::uint8_t* symmetric(int r) const { return team.impl().symmetric[r]; }
  std::uint8_t* local(int r) const { return team.impl().local[r - first]; }
  template <typename T>
  T* sym(int r, const plan::Buffer& b) const {
    return reinterpret_cast<T*>(symmetric(r) + b.offset);
  }
  template <typename T>
  T* loc(int r, const plan::Buffer& b) const {
    return reinterpret_cast<T*>(local(r) + b.offset);
  }

  const std::int32_t* table(int r) const { return loc<std::int32_t>(r, plan().schedule_table); }
  // The table inverted (slot -> row or -1), written by the schedule beside it: the dispatches in
  // token order read it.
  const std::int32_t* row_of_slot(int r) const { return loc<std::int32_t>(r, plan().row_of_slot); }
  const std::int32_t* total_rows(int r) const {
    // RingPlan's first field is total_rows (schedule_layout.hpp).
    return loc<std::int32_t>(r, plan().ring_plan);
  }
  RowGeometry geometry() const {
    return {problem.num_tokens, problem.topk, problem.hidden_size, problem.ep_size};
  }
  PassRows pass_rows(int r, int pass) const {
    return {table(r), total_rows(r), std::int64_t{pass} * ring, ring};
  }
  // The combine fused into a GEMM's epilogue: ring row i of the pass goes to the slot that table
  // row (pass offset + i) names, in `peers` (each rank's [T*k, H] slot buffer).
  gemm::RowScatter to_home_slots(int r, int pass, void* const* peers) const {
    const PassRows rows = pass_rows(r, pass);
    return {rows.table + rows.row_offset, problem.num_tokens * problem.topk, peers};
  }
  gemm::RowSegments pass_segments(int r) const {
    return {buffers(r).pass_starts, buffers(r).pass_rows,
            static_cast<int>(problem.num_local_experts()), static_cast<int>(ring), 0};
  }
  gemm::RowSegments dense_segments() const {
    const int T = static_cast<int>(problem.num_tokens);
    return {nullptr, nullptr, 1, T, T};
  }

  // The pass's segments and, with several passes, the weight gradients' pass plan.
  void compute_pass_segments(int r, int pass, cudaStream_t s) {
    PassSegmentsParams p;
    p.segment_starts = loc<std::int32_t>(r, plan().segment_starts);
    p.expert_counts = loc<std::int32_t>(r, plan().expert_counts);
    p.num_experts = static_cast<std::int32_t>(problem.num_local_experts());
    p.row_offset = std::int64_t{pass} * ring;
    p.ring_rows = ring;
    p.pass_starts = buffers(r).pass_starts;
    p.pass_rows = buffers(r).pass_rows;
    p.steps = buffers(r).pass_steps;  // null with one pass
    p.pass = pass;
    p.passes = passes;
    check(launch_pass_segments(p, s), "pass segments");
  }
  // The pass plan of rank r's weight gradients into `carry` (none with one pass).
  gemm::PassPlan pass_plan(int r, float* carry) const {
    if (passes == 1) return {};
    return {buffers(r).pass_steps, carry, static_cast<int>(plan().carry_slots)};
  }

  // The routed experts of rank r over the current pass (its segments), and its shared expert.
  ExpertRows routed(int r, const RankTensors& t, cudaStream_t s) const {
    return {pass_segments(r),
            problem.hidden_size,
            problem.intermediate_size,
            t.w.gate.ptr<const bf16>(),
            t.w.up.ptr<const bf16>(),
            t.w.down.ptr<const bf16>(),
            s,
            t.w.swiglu_limit,
            waits(),
            weight_strides(t.w.gate),
            t.q,
            t.q != nullptr ? &buffers(r).fp8 : nullptr,
            fp8_kernels};
  }

  // Whether a call runs the FP8 layer: every rank's tensors with quantized weights, or none. The
  // FP8 scratch must be there, and the forward megakernel runs bf16 GEMMs only.
  bool fp8_call(std::span<const RankTensors> ranks_in, bool fused_forward) const {
    const bool fp8 = ranks_in[0].q != nullptr;
    for (const RankTensors& t : ranks_in) {
      if ((t.q != nullptr) != fp8) {
        throw Error("RankTensors.q", "quantized weights for every rank of the call, or for none",
                    "some ranks with, some without");
      }
    }
    if (fp8 && fp8_region == nullptr) {
      throw Error("WorkspaceOptions.fp8",
                  "true for the FP8 layer on the CUDA backend (it reserves the FP8 scratch)",
                  "false");
    }
    // NOTES: the megakernel gains about 1% over the launches on one GPU; its FP8 form (e4m3
    // descriptors, the row quantization in its pulls and epilogues) waits until the FP8 launches
    // have been measured, and until then it refuses FP8 instead of running the launches unasked.
    if (fp8 && fused_forward) {
      throw Error("config.forward_path",
                  "launches for the FP8 layer (the forward megakernel has bf16 GEMMs only)",
                  "fused");
    }
    return fp8;
  }
  ExpertRows shared(const RankTensors& t, cudaStream_t s) const {
    return {dense_segments(),
            problem.hidden_size,
            problem.shared_intermediate_size,
            t.w.shared_gate.ptr<const bf16>(),
            t.w.shared_up.ptr<const bf16>(),
            t.w.shared_down.ptr<const bf16>(),
            s,
            t.w.swiglu_limit,
            waits()};
  }

  // Pass 0's rows live in the caller's forward context, later passes' in the scratch set.
  RankBuffers::PassSet pass_set(int r, int pass, const RankTensors& t) const {
    if (pass > 0) return buffers(r).scratch;
    return {t.ctx.x_routed.ptr<bf16>(), t.ctx.gate_routed.ptr<bf16>(), t.ctx.up_routed.ptr<bf16>(),
            t.ctx.hidden_routed.ptr<bf16>()};
  }

  // This process's ranks' x (and, backward, router weights and d_out) into their symmetric
  // regions, where peers pull from. One rank reads its own tensors where they are
  // (PullParams::src_own): nothing to stage.
  //
  // NOTES: an external team stages after the schedule's team barrier, which every peer reaches
  // only once its stream has finished the previous call (pulls of these buffers included: the
  // write-after-read across calls), and then barriers again so that no peer pulls before the
  // rows are here.
  void stage(std::span<const RankTensors> ranks_in, bool x, bool weights, bool d_out,
             cudaStream_t s) {
    const std::int64_t T = problem.num_tokens, H = problem.hidden_size, k = problem.topk;
    const plan::WorkspacePlan& pl = plan();
    if (problem.ep_size == 1) return;
    for (int r = first; r < first + count; ++r) {
      const RankTensors& t = ranks_in[r - first];
      if (x) {
        check(cudaMemcpyAsync(sym<void>(r, pl.x_staging), t.in.x.data, T * H * 2,
                              cudaMemcpyDeviceToDevice, s),
              "staging x");
      }
      if (weights) {
        check(cudaMemcpyAsync(sym<void>(r, pl.router_weights), t.in.topk_weights.data, T * k * 4,
                              cudaMemcpyDeviceToDevice, s),
              "staging router weights");
      }
      if (d_out) {
        check(cudaMemcpyAsync(sym<void>(r, pl.d_out_staging), t.d_out.data, T * H * 2,
                              cudaMemcpyDeviceToDevice, s),
              "staging d_out");
      }
    }
    team_barrier(s);
  }

  // The schedule table of this call's routing (forward and backward each build it: the
  // workspace keeps nothing between calls).
  void schedule(std::span<const RankTensors> ranks_in, cudaStream_t s) {
    std::vector<TensorView> ids;
    for (int i = 0; i < count; ++i) ids.push_back(ranks_in[i].in.topk_experts);
    build_schedule(team, ids, {.stream = s});
  }

  // The forward megakernel over pass `pass` of rank r: the pass's rows into `set` (its x, gate, up
  // and hidden, as gate_up_pass writes them) and its output rows into their home slots, as
  // gate_up_pass and the down GEMM with the combine do, in one launch; with `shared`, the shared
  // expert's forward too (its context and s_out, as the dense launches write them).
  void fused_pass(int r, int pass, const RankTensors& t, const RankBuffers::PassSet& set,
                  bool shared, cudaStream_t s) {
    const ExpertRows e = routed(r, t, s);
    using gemm::Form;
    using gemm::FormKind;
    const std::optional<gemm::GemmDescriptor> up =
        gemm::describe_gate_up_forward<Form<FormKind::kGateUp>>(
            gate_up_args(e, set.x, set.gate, set.up, set.hidden));
    const std::optional<gemm::GemmDescriptor> down =
        gemm::describe_rows_times_weight_t<Form<FormKind::kRowsWT>>(
            down_args(e, set.hidden, nullptr, to_home_slots(r, pass, combine_peers)));
    if (!up || !down) throw Error("internal: a forward megakernel over a ring of no rows");
    FusedForwardParams f;
    f.gate_up = *up;
    f.down = *down;
    f.shared_words = static_cast<int>(plan::fused_blocks(problem.num_tokens));
    if (shared) {
      const ExpertRows se = this->shared(t, s);
      const std::optional<gemm::GemmDescriptor> shared_up =
          gemm::describe_gate_up_forward<Form<FormKind::kGateUp>>(
              gate_up_args(se, t.in.x.ptr<const bf16>(), t.ctx.gate_shared.ptr<bf16>(),
                           t.ctx.up_shared.ptr<bf16>(), t.ctx.hidden_shared.ptr<bf16>()));
      const std::optional<gemm::GemmDescriptor> shared_down =
          gemm::describe_rows_times_weight_t<Form<FormKind::kRowsWT>>(
              down_args(se, t.ctx.hidden_shared.ptr<const bf16>(), buffers(r).s_out, {}));
      if (!shared_up || !shared_down) throw Error("internal: a shared expert of no tokens");
      f.gate_up_shared = *shared_up;
      f.down_shared = *shared_down;
      f.shared_blocks = f.shared_words;
    }
    f.pull = {pass_rows(r, pass), geometry(), x_peers, nullptr, set.x};
    if (problem.ep_size == 1) f.pull.src_own = t.in.x.data;
    f.minibatch_rows = fused_stage_rows;
    f.counters = buffers(r).fused_counters;
    f.blocks = static_cast<int>(plan::fused_blocks(ring));
    const Team::Impl& ti = team.impl();
    f.timeout_ns =
        (hooks.timeout_ms > 0 ? hooks.timeout_ms : ti.options.barrier_timeout_ms) * 1000000ull;
    f.record = loc<comm::DeviceErrorRecord>(r, plan().error_record);
    f.mirror = ti.mirrors + (r - first);
    f.rank = r;
    f.withhold_block = hooks.withheld_block;
    if (r == first && pass == 0 && hooks.trace != nullptr) {
      f.trace = hooks.trace;
      f.trace_tickets = static_cast<int>(std::min<std::int64_t>(
          (hooks.trace_words - fused_trace_words(gemm::persistent_grid_size(), 0)) /
              kTraceTicketWords,
          INT_MAX));
    }
    (hooks.launcher != nullptr ? hooks.launcher : launch_fused_forward)(
        f, t.w.swiglu_limit.has_value(), s);
  }

  // Dispatch of x and gate/up + SwiGLU for pass `pass` of rank r into `set`. NOTES (cec3016):
  // the dispatch in token order reads each source token once (the row order read it once per
  // row: 8 times on qwen3-30b-a3b, mostly from DRAM).
  void gate_up_pass(int r, int pass, const RankTensors& t, const RankBuffers::PassSet& set,
                    bool down_follows, cudaStream_t s) {
    const ExpertRows e = routed(r, t, s);
    PullParams pull{pass_rows(r, pass), geometry(), x_peers, nullptr, set.x};
    if (problem.ep_size == 1) pull.src_own = t.in.x.data;
    if (e.q != nullptr) pull_fp8(pull, e);
    check(launch_pull_tokens(pull, row_of_slot(r), s), "dispatch of x");
    if (e.q != nullptr) {
      gate_up_forward_fp8(e, set.gate, set.up, set.hidden, down_follows);
    } else {
      gate_up_forward(e, set.x, set.gate, set.up, set.hidden);
    }
  }
};

namespace {

// Calls on one layer share its scratch, so a call on a stream other than the previous call's
// waits on the device for that call's work (an event it recorded), and records its own when its
// work is enqueued (also when it throws part-way). No host synchronization. Inside a stream
// capture the graph orders its own calls; a call being captured neither waits nor records (an
// event recorded outside a capture cannot be waited on inside one), so a graph replayed on one
// stream beside eager calls on another is the caller's to order.
class CallOrder {
 public:
  CallOrder(Layer::Impl& m, cudaStream_t s) : m_(m), s_(s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(s, &status), "cudaStreamIsCapturing");
    captured_ = status != cudaStreamCaptureStatusNone;
    if (!captured_ && m.recorded && s != m.last_stream) {
      check(cudaStreamWaitEvent(s, m.call_done, 0), "cudaStreamWaitEvent (the previous call)");
    }
  }
  ~CallOrder() {
    if (captured_) return;
    if (cudaEventRecord(m_.call_done, s_) == cudaSuccess) {
      m_.last_stream = s_;
      m_.recorded = true;
    } else {
      (void)cudaGetLastError();  // the call's own error is the one to report
      m_.recorded = false;
    }
  }
  CallOrder(const CallOrder&) = delete;
  CallOrder& operator=(const CallOrder&) = delete;

 private:
  Layer::Impl& m_;
  cudaStream_t s_;
  bool captured_ = false;
};

}  // namespace

Layer::Layer(const Problem& p, const Config& config, int device, const ExternalRank& external,
             bool fp8, bool fp8_token_axis)
    : impl_(std::make_unique<Impl>(p, config, device, external)) {
  Impl& m = *impl_;
  if (fp8) {  // before the layer buffers are allocated
    for (const auto& [name, size] :
         {std::pair{"hidden_size", p.hidden_size}, {"intermediate_size", p.intermediate_size}}) {
      if (size % 128 != 0) {
        throw Error(name, "a multiple of 128 for the FP8 layer (128 x 128 weight blocks)",
                    to_text(size));
      }
    }
  }
  set_forward_path(config.forward_path);
  check(cudaSetDevice(device), "cudaSetDevice");
  const plan::WorkspacePlan& pl = m.plan();
  const int W = p.ep_size;
  const std::int64_t T = p.num_tokens;
  // NOTES: the ring never needs more rows than the worst-case table, rounded to whole minibatches
  // (so passes keep their alignment); the Config's macrobatch (schedule::macrobatch_rows) only
  // caps it (plan::ring_rows).
  // With several passes the ring is the macrobatch, so pass p holds table rows [p R, (p + 1) R).
  m.ring = pl.ring_rows;
  m.passes = static_cast<int>(pl.max_passes);
  const std::int64_t macrobatch =
      schedule::macrobatch_rows({p.num_tokens, p.topk, p.num_experts, p.ep_size},
                                config.macrobatch_size, config.minibatch_size);
  if (m.passes > 1 && m.ring != macrobatch) {
    throw Error("internal: a ring of several passes is not one macrobatch");
  }

  // The layer region of every rank this process runs, one after the other (each starts aligned:
  // layer_bytes is a multiple of the plan's alignment).
  m.layer_bytes = pl.layer_bytes;
  check(cudaMalloc(&m.layer, static_cast<std::size_t>(m.count * m.layer_bytes)),
        "cudaMalloc of the layer buffers");
  m.ranks.resize(m.count);
  for (int i = 0; i < m.count; ++i) {
    std::uint8_t* base = static_cast<std::uint8_t*>(m.layer) + i * m.layer_bytes;
    auto at = [&](auto*& ptr, const plan::Buffer& b) {
      using V = std::remove_reference_t<decltype(*ptr)>;
      ptr = b.bytes > 0 ? reinterpret_cast<V*>(base + b.offset) : nullptr;
    };
    RankBuffers& b = m.ranks[i];
    at(b.scratch.gate, pl.pass_gate), at(b.scratch.up, pl.pass_up);
    at(b.scratch.hidden, pl.pass_hidden);
    at(b.scratch.x, pl.pass_x);
    at(b.y, pl.rows_d_out), at(b.dg, pl.rows_d_gate), at(b.du, pl.rows_d_up);
    at(b.wh, pl.rows_scaled_hidden);
    at(b.row_weights, pl.row_weights), at(b.dot, pl.row_dots);
    at(b.pass_starts, pl.pass_starts), at(b.pass_rows, pl.pass_rows);
    at(b.pass_steps, pl.pass_steps);
    at(b.carry_gate, pl.carry_gate), at(b.carry_up, pl.carry_up), at(b.carry_down, pl.carry_down);
    at(b.s_out, pl.shared_out), at(b.s_dg, pl.shared_d_gate), at(b.s_du, pl.shared_d_up);
    at(b.fused_counters, pl.fused_counters);
    check(cudaMemset(b.fused_counters, 0, static_cast<std::size_t>(pl.fused_counters.bytes)),
          "cudaMemset of the megakernel counters");
  }
  if (fp8) {
    const plan::Fp8Plan fp = plan::make_fp8_plan(plan_shape_of(p, config), fp8_token_axis);
    m.fp8_bytes = fp.bytes;
    check(cudaMalloc(&m.fp8_region, static_cast<std::size_t>(m.count * m.fp8_bytes)),
          "cudaMalloc of the FP8 scratch");
    for (int i = 0; i < m.count; ++i) {
      std::uint8_t* base = static_cast<std::uint8_t*>(m.fp8_region) + i * m.fp8_bytes;
      auto at = [&](auto*& ptr, const plan::Buffer& b) {
        using V = std::remove_reference_t<decltype(*ptr)>;
        ptr = reinterpret_cast<V*>(base + b.offset);
      };
      Fp8Buffers& f = m.ranks[i].fp8;
      at(f.rows_a, fp.rows_a), at(f.rows_a_scales, fp.rows_a_scales);
      at(f.rows_b, fp.rows_b), at(f.rows_b_scales, fp.rows_b_scales);
      at(f.rows_c, fp.rows_c), at(f.rows_c_scales, fp.rows_c_scales);
      if (!fp8_token_axis) continue;  // the token-axis pointers stay null
      at(f.t_x, fp.t_x), at(f.t_x_scales, fp.t_x_scales);
      at(f.t_dy, fp.t_dy), at(f.t_dy_scales, fp.t_dy_scales);
      at(f.t_dg, fp.t_dg), at(f.t_dg_scales, fp.t_dg_scales);
      at(f.t_du, fp.t_du), at(f.t_du_scales, fp.t_du_scales);
      at(f.t_h, fp.t_h), at(f.t_h_scales, fp.t_h_scales);
    }
  }

  // Team-wide scalars and peer arrays: the first local rank's copies.
  auto* base0 = static_cast<std::uint8_t*>(m.layer);
  m.dense_rows = reinterpret_cast<std::int32_t*>(base0 + pl.dense_rows.offset);
  m.wgrad.tickets = reinterpret_cast<unsigned*>(base0 + pl.wgrad_tickets.offset);
  for (int i = 0; i < plan::kWgradStreams; ++i) {
    check(cudaStreamCreateWithFlags(&m.wgrad.side[i], cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags (weight gradients)");
    check(cudaEventCreateWithFlags(&m.wgrad.done[i], cudaEventDisableTiming), "cudaEventCreate");
  }
  check(cudaEventCreateWithFlags(&m.wgrad.forked, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventCreateWithFlags(&m.wgrad.handed, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventCreateWithFlags(&m.call_done, cudaEventDisableTiming), "cudaEventCreate");
  // Each array: W pointers at its place in the peers buffer.
  auto peers = [&](plan::Peers which) {
    return base0 + pl.peers.offset + static_cast<int>(which) * W * sizeof(void*);
  };
  m.x_peers = reinterpret_cast<const void**>(peers(plan::Peers::x));
  m.d_out_peers = reinterpret_cast<const void**>(peers(plan::Peers::d_out));
  m.w_peers = reinterpret_cast<const float**>(peers(plan::Peers::router_weights));
  m.combine_peers = reinterpret_cast<void**>(peers(plan::Peers::combine));
  m.dx_peers = reinterpret_cast<void**>(peers(plan::Peers::dx));
  m.dw_peers = reinterpret_cast<float**>(peers(plan::Peers::router_weight_grads));

  std::vector<void*> table(static_cast<std::size_t>(plan::Peers::count) * W);
  auto fill = [&](plan::Peers which, const plan::Buffer& b) {
    for (int r = 0; r < W; ++r) table[static_cast<int>(which) * W + r] = m.symmetric(r) + b.offset;
  };
  fill(plan::Peers::x, pl.x_staging);
  fill(plan::Peers::d_out, pl.d_out_staging);
  fill(plan::Peers::router_weights, pl.router_weights);
  fill(plan::Peers::combine, pl.combine);
  fill(plan::Peers::dx, pl.dx_routed);
  fill(plan::Peers::router_weight_grads, pl.router_weight_grads);
  const std::int32_t rows = static_cast<std::int32_t>(T);
  check(cudaMemcpy(m.dense_rows, &rows, sizeof rows, cudaMemcpyHostToDevice), "upload");
  check(cudaMemset(m.wgrad.tickets, 0, pl.wgrad_tickets.bytes),
        "cudaMemset of the ticket counters");
  auto* report_lock = reinterpret_cast<unsigned*>(base0 + pl.wait_report_lock.offset);
  check(cudaMemset(report_lock, 0, pl.wait_report_lock.bytes), "cudaMemset of the report's lock");
  m.gemm_report = std::make_unique<gemm::TimeoutReport>(report_lock);
  check(cudaMemcpy(peers(plan::Peers::x), table.data(), table.size() * sizeof(void*),
                   cudaMemcpyHostToDevice),
        "upload of the peer addresses");
}

Layer::~Layer() = default;

ForwardPath Layer::forward_path() const {
  return impl_->path;
}
void Layer::set_forward_path(ForwardPath path) {
  // NOTES: the megakernel's cross-process waits (peers' staged rows at system scope) have never
  // run on several GPUs; until a multi-GPU run tests them, a team across processes runs the
  // launches, whose barriers have.
  if (path == ForwardPath::fused && impl_->external() && !impl_->hooks.untested_team) {
    throw Error("config.forward_path",
                "launches on a team across processes (the fused forward has not been tested "
                "across GPUs yet)",
                "fused");
  }
  impl_->path = path;
}

Layer::Fp8Kernels Layer::fp8_kernels() const {
  return impl_->fp8_kernels;
}
void Layer::set_fp8_kernels(const Fp8Kernels& kernels) {
  if (kernels.wide && kernels.overlap) {
    throw Error("fp8_kernels.wide", "false with fp8_kernels.overlap (wide tiles run without it)",
                "true");
  }
  impl_->fp8_kernels = kernels;
}

std::int64_t Layer::forward_trace_words(std::int64_t tickets) {
  return fused_trace_words(gemm::persistent_grid_size(), tickets);
}

void Layer::set_forward_hooks(const ForwardHooks& hooks) {
  const std::int64_t header = forward_trace_words(0);
  if (hooks.trace != nullptr && hooks.trace_words < header) {
    throw Error("ForwardHooks.trace_words", "at least " + to_text(header) + " (header and CTAs)",
                to_text(hooks.trace_words));
  }
  if (hooks.withheld_block < -1) {
    throw Error("ForwardHooks.withheld_block", "-1 (off) or a block index",
                to_text(hooks.withheld_block));
  }
  if ((hooks.trace != nullptr || hooks.withheld_block >= 0) && hooks.launcher == nullptr) {
    throw Error("ForwardHooks.launcher", "a launcher built with the test hooks (tests/cpp)",
                "null (the library's launcher has none)");
  }
  impl_->hooks = hooks;
}

std::int64_t Layer::ring_rows() const {
  return impl_->ring;
}
int Layer::max_passes() const {
  return impl_->passes;
}
bool Layer::has_fp8() const {
  return impl_->fp8_region != nullptr;
}
std::size_t Layer::bytes() const {
  const auto& t = impl_->team.impl();
  return static_cast<std::size_t>(impl_->count * (impl_->layer_bytes + impl_->fp8_bytes) +
                                  t.allocation_bytes);
}
void Layer::check_errors(cudaStream_t stream) {
  const CallOrder order(*impl_, stream);
  impl_->team.check_errors(stream);
  const std::string stalled = impl_->gemm_report->take();
  if (!stalled.empty()) throw Error(stalled + " (the launch gave up; its outputs are void)");
}

void Layer::forward(std::span<const RankTensors> ranks, bool write_output, cudaStream_t s) {
  Impl& m = *impl_;
  const CallOrder order(m, s);
  const Problem& p = m.problem;
  const std::int64_t T = p.num_tokens, k = p.topk, H = p.hidden_size,
                     S = p.shared_intermediate_size;
  const plan::WorkspacePlan& pl = m.plan();

  const bool fused = write_output && m.path == ForwardPath::fused;
  m.fp8_call(ranks, fused);  // refuses what it cannot run before any work is queued

  // The schedule first: its team barrier is where every peer has finished its previous call.
  m.schedule(ranks, s);
  m.stage(ranks, /*x=*/true, /*weights=*/false, /*d_out=*/false, s);

  // Shared expert first (it hides the first dispatch; docs/architecture.md, "One forward call"):
  // in pass 0's megakernel launch, or as two dense launches before the passes.
  for (int r = m.first; r < m.first + m.count && S > 0 && !fused; ++r) {
    const RankTensors& t = ranks[r - m.first];
    const ExpertRows e = m.shared(t, s);
    gate_up_forward(e, t.in.x.ptr<const bf16>(), t.ctx.gate_shared.ptr<bf16>(),
                    t.ctx.up_shared.ptr<bf16>(), t.ctx.hidden_shared.ptr<bf16>());
    if (write_output) down_forward(e, t.ctx.hidden_shared.ptr<const bf16>(), m.buffers(r).s_out);
  }

  // recompute_forward_context: pass 0 (the context) only, and no down projection.
  const int passes = write_output ? m.passes : 1;
  for (int pass = 0; pass < passes; ++pass) {
    for (int r = m.first; r < m.first + m.count; ++r) {
      const RankBuffers::PassSet set = m.pass_set(r, pass, ranks[r - m.first]);
      m.compute_pass_segments(r, pass, s);
      if (fused) {
        m.fused_pass(r, pass, ranks[r - m.first], set, pass == 0 && S > 0, s);
        continue;
      }
      m.gate_up_pass(r, pass, ranks[r - m.first], set, write_output, s);
      // The combine: the down GEMM stores each row in its slot of the home rank's `combine`.
      if (write_output) {
        const ExpertRows e = m.routed(r, ranks[r - m.first], s);
        const gemm::RowScatter to = m.to_home_slots(r, pass, m.combine_peers);
        if (e.q != nullptr) {
          down_forward_fp8(e, set.hidden, to);
        } else {
          down_forward(e, set.hidden, nullptr, to);
        }
      }
    }
  }
  if (!write_output) return;
  m.team_barrier(s);  // every peer's combine rows have landed in this rank's slots
  for (int r = m.first; r < m.first + m.count; ++r) {
    HomeReduceParams h{T,
                       k,
                       H,
                       p.num_experts,
                       ranks[r - m.first].in.topk_experts.ptr<const std::int64_t>(),
                       ranks[r - m.first].in.topk_weights.ptr<const float>(),
                       m.sym<const void>(r, pl.combine),
                       S > 0 ? m.buffers(r).s_out : nullptr,
                       ranks[r - m.first].out.data};
    check(launch_combine_reduce(h, s), "home reduction of out");
  }
}

void Layer::backward(std::span<const RankTensors> ranks, const BackwardOptions& options,
                     cudaStream_t s) {
  Impl& m = *impl_;
  const CallOrder order(m, s);
  const Problem& p = m.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk,
                     S = p.shared_intermediate_size;
  const plan::WorkspacePlan& pl = m.plan();
  const std::int64_t dot_chunks = (p.intermediate_size + gemm::kDotColumns - 1) / gemm::kDotColumns;
  const bool fp8 = m.fp8_call(ranks, false);
  if (fp8 && options.fp8_weight_grads && m.ranks[0].fp8.t_x == nullptr) {  // before any work
    throw Error("BackwardOptions.fp8_weight_grads",
                "false on a layer made without the FP8 token-axis copies (fp8_token_axis false: "
                "bf16 weight gradients only)",
                "true");
  }

  // x only for the replays of later passes; the router weights scale the pulled rows. The
  // schedule first, as in forward.
  m.schedule(ranks, s);
  m.stage(ranks, /*x=*/m.passes > 1, /*weights=*/true, /*d_out=*/true, s);

  const bool add = options.accumulate_weight_grads;
  // The FP8 layer's routed weight gradients in e4m3 (else bf16 products of the bf16 rows, as the
  // bf16 layer's: BackwardOptions::fp8_weight_grads).
  const bool fp8_wgrads = fp8 && options.fp8_weight_grads;
  // Shared expert (dense, every token): one pass.
  for (int r = m.first; r < m.first + m.count && S > 0; ++r) {
    RankBuffers& b = m.buffers(r);
    const RankTensors& t = ranks[r - m.first];
    ExpertBackward eb{t.in.x.ptr<const bf16>(),
                      t.ctx.gate_shared.ptr<const bf16>(),
                      t.ctx.up_shared.ptr<const bf16>(),
                      t.ctx.hidden_shared.ptr<const bf16>(),
                      t.d_out.ptr<bf16>(),  // read only: no row weights, nothing between
                      nullptr,
                      nullptr,
                      b.s_dg,
                      b.s_du,
                      b.s_out /* its d_x */,
                      {&t.grads.d_shared_gate, add, {}, false},
                      {&t.grads.d_shared_up, add, {}, false},
                      {&t.grads.d_shared_down, add, {}, false},
                      {}};
    expert_backward(m.shared(t, s), eb, m.wgrad, [](cudaStream_t) {});
  }

  // Routed experts, pass by pass. Weight gradients reduce straight into the caller's views when
  // one pass holds every row of an expert; else its sum is carried in fp32 across the passes
  // (the pass plan, computed on the device with the pass's segments).
  for (int pass = 0; pass < m.passes; ++pass) {
    const bool first = pass == 0;
    // The previous pass's weight gradients read its rows, segments and pass plan: all rewritten
    // below. (The shared expert's need no join here: nothing below writes what they read.)
    if (!first) m.wgrad.join(s);
    for (int r = m.first; r < m.first + m.count; ++r) {
      RankBuffers& b = m.buffers(r);
      const RankTensors& t = ranks[r - m.first];
      const RankBuffers::PassSet set = m.pass_set(r, pass, t);
      m.compute_pass_segments(r, pass, s);
      if (!first) m.gate_up_pass(r, pass, t, set, false, s);  // replay: only pass 0 was kept
      // The rows' d_out, unscaled, and their router weights, pulled from the home ranks.
      PullParams pull{m.pass_rows(r, pass), m.geometry(), m.d_out_peers, m.w_peers, b.y,
                      b.row_weights};
      if (p.ep_size == 1) {
        pull.src_own = t.d_out.data;
        pull.scale_own = t.in.topk_weights.ptr<const float>();
      }
      const ExpertRows e = m.routed(r, t, s);
      if (fp8) pull_fp8(pull, e);  // q(d_out), the down dgrad's operand
      check(launch_pull_tokens(pull, m.row_of_slot(r), s), "dispatch of d_out");
      const PassRows rows = m.pass_rows(r, pass);
      // bf16(w h) from the down dgrad's epilogue (I <= H; b.wh null otherwise) where dW_down is a
      // bf16 GEMM; the e4m3 dW_down takes dy and h (the reference's operands): the token-axis
      // quantizer scales the d_out rows into dy as it reads them.
      bf16* const wh = fp8_wgrads ? nullptr : b.wh;
      auto between = [&](cudaStream_t on) {
        // d_w = the sum of the dgrad epilogue's partials, pushed into its home slot; then, where
        // the dgrad did not write bf16(w h) and the down weight gradient is a bf16 GEMM (I > H, in
        // the bf16 layer and in the FP8 layer with bf16 weight gradients), dy = bf16(w d_out) in
        // place for it.
        RouterGradPushParams push{rows, m.geometry(), b.dot, static_cast<int>(dot_chunks),
                                  m.dw_peers};
        check(launch_router_grad_push(push, on), "router weight gradient");
        if (wh == nullptr && !fp8_wgrads) {
          ScaleRowsParams scale{rows, m.geometry(), b.row_weights, b.y};
          check(launch_scale_rows(scale, on), "scaling of d_out rows");
        }
      };
      ExpertBackward eb{set.x,
                        set.gate,
                        set.up,
                        set.hidden,
                        b.y,
                        b.row_weights,
                        b.dot,
                        b.dg,
                        b.du,
                        nullptr /* dx: scattered home (dx_to) */,
                        {&t.grads.d_gate, add, m.pass_plan(r, b.carry_gate), !first},
                        {&t.grads.d_up, add, m.pass_plan(r, b.carry_up), !first},
                        {&t.grads.d_down, add, m.pass_plan(r, b.carry_down), !first},
                        m.to_home_slots(r, pass, m.dx_peers),  // the backward combine
                        wh};
      if (fp8) {
        expert_backward_fp8(e, eb, m.wgrad, fp8_wgrads, between);
      } else {
        expert_backward(e, eb, m.wgrad, between);
      }
    }
  }

  if (m.external()) {
    // Every peer's dx rows and d_w entries (pushed by dx and by `between` on side stream 0) have
    // landed in this rank's slots before its home reductions read them.
    m.wgrad.join(s);
    m.team_barrier(s);
  }
  for (int r = m.first; r < m.first + m.count; ++r) {
    HomeReduceParams h{T,
                       k,
                       H,
                       p.num_experts,
                       ranks[r - m.first].in.topk_experts.ptr<const std::int64_t>(),
                       nullptr,
                       m.sym<const void>(r, pl.dx_routed),
                       S > 0 ? m.buffers(r).s_out : nullptr,
                       ranks[r - m.first].grads.d_x.data};
    check(launch_dx_reduce(h, s), "home reduction of d_x");
  }
  // The pushed d_w (side stream 0) and every weight gradient have landed past this point: the
  // next call may overwrite any row.
  m.wgrad.join(s);
  for (int r = m.first; r < m.first + m.count; ++r) {
    RouterGradGatherParams g{T,
                             k,
                             p.num_experts,
                             ranks[r - m.first].in.topk_experts.ptr<const std::int64_t>(),
                             m.sym<const float>(r, pl.router_weight_grads),
                             ranks[r - m.first].grads.d_topk_weights.ptr<float>()};
    check(launch_router_grad_gather(g, s), "home copy of d_topk_weights");
  }
}

}  // namespace mok::cuda
