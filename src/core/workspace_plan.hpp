// The workspace plan: every buffer of one rank's layer state, as byte offsets into three regions
// (symmetric, local, layer; the FP8 layer's scratch, Fp8Plan below, is an allocation of its own),
// defined once for host and device (docs/architecture.md, "The workspace plan"). Sizes follow from
// the shape and the Config only, never from the routing: nothing is sized from data, so no call
// waits for the host.
//
//   symmetric region   same size and layout on every rank; peers read or write it
//     x_staging            bf16 [T, H]       forward dispatch pulls x[src_rank][t] from here
//     combine              bf16 [T*k, H]     expert ranks push output rows into slot t*k+j
//     d_out_staging        bf16 [T, H]       backward dispatch pulls d_out[src_rank][t]
//     dx_routed            bf16 [T*k, H]     expert ranks push d_x rows into slot t*k+j
//     router_weights       f32  [T*k]        backward pulls w[src_rank][t*k+j]
//     router_weight_grads  f32  [T*k]        expert ranks push d_w[t*k+j]
//     expert_ids           i32  [2, T*k]     the id exchange, double-buffered by launch parity
//     team_flags           u32  [kMaxRanks]  team barrier: flags[q] counts arrivals from rank q
//   local region       this rank only
//     schedule_table       i32  [max_schedule_rows]   (src/core/schedule_layout.hpp)
//     expert_counts        i32  [E_local]
//     expert_src_counts    i32  [E_local, W]
//     segment_starts       i32  [E_local + 1]
//     ring_plan            RingPlan
//     schedule_scratch     i32  [E_local, W * tiles_per_rank]   per-tile counts, then offsets
//     row_of_slot          i32  [W*T*k]     the table inverted: the row of each source slot
//                                           (encode_row's index), or -1 when it has none here;
//                                           the dispatches in token order read it
//     sync_state           SyncState (rank-local barrier counters and the bases of every counter)
//     error_record         DeviceErrorRecord
//   layer region       this rank only: the CUDA layer's scratch (the layer allocates it; a team
//                      that only builds schedules does not). R = ring_rows, P = max_passes,
//                      slots = min(P - 1, E_local) (src/cuda/kernels/pass_segments.hpp)
//     pass_x               bf16 [R, H]         rows of passes after the first (P > 1 only; pass
//     pass_gate/up/hidden  bf16 [R, I] each    0's are the caller's forward context)
//     rows_d_out           bf16 [R, H]         backward: the pass's d_out rows, then dy
//     rows_d_gate/d_up     bf16 [R, I] each    backward: dg, du
//     rows_scaled_hidden   bf16 [R, I]         backward: bf16(w h), the down weight gradient's
//                                              operand (I <= H only: scaled_hidden_in_backward)
//     row_weights          f32  [R]            backward: each row's router weight
//     row_dots             f32  [R, ceil(I/128)]  backward: d_w partial sums
//     pass_starts          i32  [E_local + 1]  the pass's segments, ring-relative
//     pass_rows            i32  [E_local]
//     pass_steps           i32  [E_local]      the weight gradients' pass plan (P > 1 only)
//     carry_gate/up        f32  [slots, I, H]  fp32 sums of experts whose rows span passes
//     carry_down           f32  [slots, H, I]
//     shared_out           bf16 [T, H]         shared expert: out, then dx (S > 0 only)
//     shared_d_gate/d_up   bf16 [T, S] each    (S > 0 only)
//     dense_rows           i32  [1]            T, for the shared expert's dense GEMMs
//     wgrad_tickets        u32  [3, 2]         a ticket counter pair per weight-gradient stream
//     wait_report_lock     u32  [1]            the lock of the layer's GEMM timeout report
//     peers                ptr  [6, W]         every rank's staging and slot buffers
//     fused_counters       u32  [2 ceil(R/128) + ceil(T/128) + 3]  the forward megakernel's
//                                              ready, done, shared_done, ticket, pull and exit
//                                              counters
//
// Every buffer starts at a multiple of kBufferAlignment bytes (TMA and 16-byte vector accesses).
#pragma once

#include <cstdint>

#include "core/error_record.hpp"
#include "core/numerics.hpp"  // MOK_HOST_DEVICE
#include "core/schedule_layout.hpp"

namespace mok::plan {

inline constexpr std::int64_t kBufferAlignment = 256;
// The down dgrad epilogue leaves the router-weight gradient's fp32 partial sums per row and chunk
// of this many columns (row_dots; gemm::kDotColumns is this constant).
inline constexpr std::int64_t kDotColumns = 128;

// Counters that let device barriers run without any host reset between launches. Each counter
// only grows; a launch reads the bases at its start, and the block that passes its last barrier
// stores the new bases. Peers' arrivals are counted in team_flags (symmetric region).
struct SyncState {
  std::uint32_t grid_arrive;   // rank-local grid barrier: +1 per block per barrier
  std::uint32_t grid_base;     // grid_arrive when the current launch began
  std::uint32_t team_base;     // every team_flags[q] when the current launch began
  std::uint32_t launch_count;  // launches that used the id exchange (its parity picks the buffer)
  std::uint32_t reserved[12];
};
static_assert(sizeof(SyncState) == 64);

// The three weight gradients of an expert family (down, gate, up) are independent GEMMs and run
// at the same time, each on a stream of its own (src/cuda/layer/layer.cu), so one
// gradient's long tiles (an expert that holds most rows) overlap the others' instead of leaving
// SMs idle. Launches that may run at once need a ticket counter pair each.
inline constexpr int kWgradStreams = 3;

struct PlanShape {
  std::int64_t num_tokens = 0;                // T
  std::int64_t hidden_size = 0;               // H
  std::int64_t topk = 0;                      // k
  std::int64_t num_experts = 0;               // E
  int ep_size = 1;                            // W
  std::int64_t macrobatch_size = 0;           // ring rows: schedule::macrobatch_rows, resolved
  std::int64_t minibatch_size = 0;            // rows per minibatch
  std::int64_t intermediate_size = 0;         // I (the layer region only)
  std::int64_t shared_intermediate_size = 0;  // S (the layer region only)

  constexpr schedule::Shape schedule() const { return {num_tokens, topk, num_experts, ep_size}; }
};

struct Buffer {
  std::int64_t offset = 0;
  std::int64_t bytes = 0;
};

struct WorkspacePlan {
  // symmetric region
  Buffer x_staging, combine, d_out_staging, dx_routed, router_weights, router_weight_grads,
      expert_ids, team_flags;
  std::int64_t symmetric_bytes = 0;
  // local region
  Buffer schedule_table, expert_counts, expert_src_counts, segment_starts, ring_plan,
      schedule_scratch, row_of_slot, sync_state, error_record;
  std::int64_t local_bytes = 0;
  // layer region
  Buffer pass_x, pass_gate, pass_up, pass_hidden, rows_d_out, rows_d_gate, rows_d_up,
      rows_scaled_hidden, row_weights, row_dots, pass_starts, pass_rows, pass_steps, carry_gate,
      carry_up, carry_down, shared_out, shared_d_gate, shared_d_up, dense_rows, wgrad_tickets,
      wait_report_lock, peers, fused_counters;
  std::int64_t layer_bytes = 0;
  std::int64_t ring_rows = 0;    // R: rows of a pass (and of the forward context's routed rows)
  std::int64_t max_passes = 1;   // P
  std::int64_t carry_slots = 0;  // slots

  std::int64_t total_bytes() const { return symmetric_bytes + local_bytes + layer_bytes; }
};

// The peer-address arrays of the layer region's `peers` buffer, in this order, W pointers each.
enum class Peers : int { x, d_out, router_weights, combine, dx, router_weight_grads, count };

constexpr std::int64_t align_up(std::int64_t v) {
  return (v + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
}

// Appends a buffer of `bytes` to a region whose current end is `end`.
constexpr Buffer carve(std::int64_t& end, std::int64_t bytes) {
  const Buffer b{end, bytes};
  end = align_up(end + bytes);
  return b;
}

// Rows of a ring pass: macrobatch_size, but never more than the worst-case schedule table rounded
// up to whole minibatches (so a one-pass layer holds only what it can receive).
constexpr std::int64_t ring_rows(const PlanShape& s) {
  const std::int64_t table =
      schedule::round_up(schedule::max_schedule_rows(s.schedule()), s.minibatch_size);
  return table < s.macrobatch_size ? table : s.macrobatch_size;
}

// fp32 carry slots of the weight gradients' pass plan: the expert segments are in order, so at
// most one expert crosses each of the passes - 1 boundaries, and there are no more carried experts
// than experts (src/cuda/kernels/pass_segments.cu gives each its slot).
constexpr std::int64_t carry_slots(std::int64_t passes, std::int64_t experts) {
  const std::int64_t boundaries = passes > 1 ? passes - 1 : 0;
  return boundaries < experts ? boundaries : experts;
}

// The forward megakernel's counters (src/cuda/kernels/fused_forward.hpp), zero between launches,
// one layout for the allocation here and the kernel's pointers: ready [blocks], done [blocks]
// (blocks = ceil(R / 128), the pass's M tiles), shared_done [shared_words = ceil(T / 128)], the
// ticket counter, the pull counter and the exit count. Word offsets.
struct FusedCounterLayout {
  int blocks;
  int shared_words;
  MOK_HOST_DEVICE constexpr std::int64_t ready() const { return 0; }
  MOK_HOST_DEVICE constexpr std::int64_t done() const { return blocks; }
  MOK_HOST_DEVICE constexpr std::int64_t shared_done() const { return done() + blocks; }
  MOK_HOST_DEVICE constexpr std::int64_t tickets() const { return shared_done() + shared_words; }
  MOK_HOST_DEVICE constexpr std::int64_t pulls() const { return tickets() + 1; }
  MOK_HOST_DEVICE constexpr std::int64_t exit() const { return tickets() + 2; }
  // Every word but the exit count (the last CTA of a launch zeroes them for the next).
  MOK_HOST_DEVICE constexpr std::int64_t zeroed_words() const { return exit(); }
  MOK_HOST_DEVICE constexpr std::int64_t words() const { return exit() + 1; }
};
constexpr std::int64_t fused_blocks(std::int64_t rows) {
  return (rows + 127) / 128;
}
// Rows and tokens are below 2^31 (validated), so both block counts fit an int.
constexpr std::int64_t fused_counter_words(std::int64_t ring_rows, std::int64_t tokens) {
  return FusedCounterLayout{static_cast<int>(fused_blocks(ring_rows)),
                            static_cast<int>(fused_blocks(tokens))}
      .words();
}

// Which operand of the down weight gradient carries the router weight, dW_down = sum over rows
// of dy^T h with one factor bf16(w x): h (the down dgrad's epilogue writes bf16(w h) as it
// computes h anyway, R*I more bytes written) when I <= H, else d_out (its rows scaled in place
// after that epilogue, R*H read and written again). docs/perf/NOTES.md, b1528ab.
constexpr bool scaled_hidden_in_backward(const PlanShape& s) {
  return s.intermediate_size <= s.hidden_size;
}

// Ring passes the worst-case table needs (at least 1).
constexpr std::int64_t max_passes(const PlanShape& s) {
  const std::int64_t rows = schedule::max_schedule_rows(s.schedule());
  const std::int64_t p = (rows + s.macrobatch_size - 1) / s.macrobatch_size;
  return p > 1 ? p : 1;
}

constexpr WorkspacePlan make_workspace_plan(const PlanShape& s) {
  const schedule::Shape sched = s.schedule();
  const std::int64_t T = s.num_tokens, H = s.hidden_size, k = s.topk, W = s.ep_size;
  const std::int64_t E_local = sched.num_local_experts();
  const std::int64_t bf16 = 2, f32 = 4, i32 = 4, u32 = 4;
  WorkspacePlan p;
  std::int64_t end = 0;
  p.x_staging = carve(end, T * H * bf16);
  p.combine = carve(end, T * k * H * bf16);
  p.d_out_staging = carve(end, T * H * bf16);
  p.dx_routed = carve(end, T * k * H * bf16);
  p.router_weights = carve(end, T * k * f32);
  p.router_weight_grads = carve(end, T * k * f32);
  p.expert_ids = carve(end, 2 * T * k * i32);
  p.team_flags = carve(end, schedule::kMaxRanks * u32);
  p.symmetric_bytes = end;

  end = 0;
  p.schedule_table = carve(end, schedule::max_schedule_rows(sched) * i32);
  p.expert_counts = carve(end, E_local * i32);
  p.expert_src_counts = carve(end, E_local * W * i32);
  p.segment_starts = carve(end, (E_local + 1) * i32);
  p.ring_plan = carve(end, sizeof(schedule::RingPlan));
  p.schedule_scratch = carve(end, E_local * W * sched.tiles_per_rank() * i32);
  p.row_of_slot = carve(end, W * T * k * i32);
  p.sync_state = carve(end, sizeof(SyncState));
  p.error_record = carve(end, sizeof(comm::DeviceErrorRecord));
  p.local_bytes = end;

  const std::int64_t R = ring_rows(s), I = s.intermediate_size, S = s.shared_intermediate_size;
  const std::int64_t P = max_passes(s), dot_chunks = (I + kDotColumns - 1) / kDotColumns;
  p.ring_rows = R;
  p.max_passes = P;
  p.carry_slots = carry_slots(P, E_local);
  const std::int64_t later = P > 1 ? 1 : 0, shared = S > 0 ? 1 : 0;
  end = 0;
  p.pass_x = carve(end, later * R * H * bf16);
  p.pass_gate = carve(end, later * R * I * bf16);
  p.pass_up = carve(end, later * R * I * bf16);
  p.pass_hidden = carve(end, later * R * I * bf16);
  p.rows_d_out = carve(end, R * H * bf16);
  p.rows_d_gate = carve(end, R * I * bf16);
  p.rows_d_up = carve(end, R * I * bf16);
  p.rows_scaled_hidden = carve(end, scaled_hidden_in_backward(s) ? R * I * bf16 : 0);
  p.row_weights = carve(end, R * f32);
  p.row_dots = carve(end, R * dot_chunks * f32);
  p.pass_starts = carve(end, (E_local + 1) * i32);
  p.pass_rows = carve(end, E_local * i32);
  p.pass_steps = carve(end, later * E_local * i32);
  p.carry_gate = carve(end, p.carry_slots * I * H * f32);
  p.carry_up = carve(end, p.carry_slots * I * H * f32);
  p.carry_down = carve(end, p.carry_slots * H * I * f32);
  p.shared_out = carve(end, shared * T * H * bf16);
  p.shared_d_gate = carve(end, T * S * bf16);
  p.shared_d_up = carve(end, T * S * bf16);
  p.dense_rows = carve(end, i32);
  p.wgrad_tickets = carve(end, kWgradStreams * 2 * u32);
  p.wait_report_lock = carve(end, u32);
  p.peers = carve(end, static_cast<std::int64_t>(Peers::count) * W * 8);
  p.fused_counters = carve(end, fused_counter_words(R, T) * u32);
  p.layer_bytes = end;
  return p;
}

// The FP8 layer's scratch (docs/architecture.md, "The FP8 layer"), per rank, in an allocation of
// its own that only a workspace made for the FP8 layer has (WorkspaceOptions::fp8): the e4m3
// operands of a pass, quantized from the bf16 rows the layer keeps anyway. R = ring_rows, a
// multiple of 128; M = max(H, I).
//   rows_a, rows_a_scales   e4m3 [R, M], f32 [M/128, R]  1x128 along K: forward x, then h;
//                                                        backward d_out, then dg
//   rows_b, rows_b_scales   e4m3 [R, I], f32 [I/128, R]  backward du (dx reads dg and du at once);
//                                                        with the rows epilogues (Layer::
//                                                        Fp8Kernels), forward h, backward dg
//   rows_c, rows_c_scales   e4m3 [R, I], f32 [I/128, R]  the rows epilogues' backward du
//   t_x, t_dy               e4m3 [H, R], scales f32 [R/128, H]  token-axis copies (the pass's rows
//   t_dg, t_du, t_h         e4m3 [I, R], scales f32 [R/128, I]  as columns), the weight gradients'
// The five token-axis copies exist at once: the three weight gradients run at the same time.
// Without `token_axis` (WorkspaceOptions::fp8_token_axis false: bf16 weight gradients only) they
// are not carved: the t_* buffers are empty (offset 0, 0 bytes).
struct Fp8Plan {
  Buffer rows_a, rows_a_scales, rows_b, rows_b_scales, rows_c, rows_c_scales;
  Buffer t_x, t_x_scales, t_dy, t_dy_scales, t_dg, t_dg_scales, t_du, t_du_scales, t_h, t_h_scales;
  std::int64_t bytes = 0;
};

constexpr Fp8Plan make_fp8_plan(const PlanShape& s, bool token_axis = true) {
  const std::int64_t R = ring_rows(s), H = s.hidden_size, I = s.intermediate_size;
  const std::int64_t M = H > I ? H : I, blocks = R / 128, f32 = 4;
  Fp8Plan p;
  std::int64_t end = 0;
  p.rows_a = carve(end, R * M);
  p.rows_a_scales = carve(end, M / 128 * R * f32);
  p.rows_b = carve(end, R * I);
  p.rows_b_scales = carve(end, I / 128 * R * f32);
  p.rows_c = carve(end, R * I);
  p.rows_c_scales = carve(end, I / 128 * R * f32);
  if (!token_axis) {
    p.bytes = end;
    return p;
  }
  p.t_x = carve(end, H * R);
  p.t_x_scales = carve(end, blocks * H * f32);
  p.t_dy = carve(end, H * R);
  p.t_dy_scales = carve(end, blocks * H * f32);
  p.t_dg = carve(end, I * R);
  p.t_dg_scales = carve(end, blocks * I * f32);
  p.t_du = carve(end, I * R);
  p.t_du_scales = carve(end, blocks * I * f32);
  p.t_h = carve(end, I * R);
  p.t_h_scales = carve(end, blocks * I * f32);
  p.bytes = end;
  return p;
}

enum class Region : std::uint8_t { symmetric, local, layer };

constexpr const char* region_name(Region r) {
  return r == Region::symmetric ? "symmetric" : r == Region::local ? "local" : "layer";
}

// For printing (`mok run --plan`) and for tests that walk every buffer.
struct BufferInfo {
  const char* name;
  Region region;
  Buffer WorkspacePlan::*member;
  const char* what;
};

inline constexpr BufferInfo kBuffers[] = {
    {"x_staging", Region::symmetric, &WorkspacePlan::x_staging, "bf16 [T, H]"},
    {"combine", Region::symmetric, &WorkspacePlan::combine, "bf16 [T*k, H]"},
    {"d_out_staging", Region::symmetric, &WorkspacePlan::d_out_staging, "bf16 [T, H]"},
    {"dx_routed", Region::symmetric, &WorkspacePlan::dx_routed, "bf16 [T*k, H]"},
    {"router_weights", Region::symmetric, &WorkspacePlan::router_weights, "f32 [T*k]"},
    {"router_weight_grads", Region::symmetric, &WorkspacePlan::router_weight_grads, "f32 [T*k]"},
    {"expert_ids", Region::symmetric, &WorkspacePlan::expert_ids, "i32 [2, T*k]"},
    {"team_flags", Region::symmetric, &WorkspacePlan::team_flags, "u32 [64]"},
    {"schedule_table", Region::local, &WorkspacePlan::schedule_table, "i32 [W*T*k + E_local*127]"},
    {"expert_counts", Region::local, &WorkspacePlan::expert_counts, "i32 [E_local]"},
    {"expert_src_counts", Region::local, &WorkspacePlan::expert_src_counts, "i32 [E_local, W]"},
    {"segment_starts", Region::local, &WorkspacePlan::segment_starts, "i32 [E_local + 1]"},
    {"ring_plan", Region::local, &WorkspacePlan::ring_plan, "RingPlan (8 x i32)"},
    {"schedule_scratch", Region::local, &WorkspacePlan::schedule_scratch,
     "i32 [E_local, W * ceil(T*k/512)]"},
    {"row_of_slot", Region::local, &WorkspacePlan::row_of_slot, "i32 [W*T*k]"},
    {"sync_state", Region::local, &WorkspacePlan::sync_state, "SyncState (64 B)"},
    {"error_record", Region::local, &WorkspacePlan::error_record, "DeviceErrorRecord (128 B)"},
    {"pass_x", Region::layer, &WorkspacePlan::pass_x, "bf16 [R, H] (P > 1)"},
    {"pass_gate", Region::layer, &WorkspacePlan::pass_gate, "bf16 [R, I] (P > 1)"},
    {"pass_up", Region::layer, &WorkspacePlan::pass_up, "bf16 [R, I] (P > 1)"},
    {"pass_hidden", Region::layer, &WorkspacePlan::pass_hidden, "bf16 [R, I] (P > 1)"},
    {"rows_d_out", Region::layer, &WorkspacePlan::rows_d_out, "bf16 [R, H]"},
    {"rows_d_gate", Region::layer, &WorkspacePlan::rows_d_gate, "bf16 [R, I]"},
    {"rows_d_up", Region::layer, &WorkspacePlan::rows_d_up, "bf16 [R, I]"},
    {"rows_scaled_hidden", Region::layer, &WorkspacePlan::rows_scaled_hidden,
     "bf16 [R, I] (I <= H)"},
    {"row_weights", Region::layer, &WorkspacePlan::row_weights, "f32 [R]"},
    {"row_dots", Region::layer, &WorkspacePlan::row_dots, "f32 [R, ceil(I/128)]"},
    {"pass_starts", Region::layer, &WorkspacePlan::pass_starts, "i32 [E_local + 1]"},
    {"pass_rows", Region::layer, &WorkspacePlan::pass_rows, "i32 [E_local]"},
    {"pass_steps", Region::layer, &WorkspacePlan::pass_steps, "i32 [E_local] (P > 1)"},
    {"carry_gate", Region::layer, &WorkspacePlan::carry_gate, "f32 [slots, I, H]"},
    {"carry_up", Region::layer, &WorkspacePlan::carry_up, "f32 [slots, I, H]"},
    {"carry_down", Region::layer, &WorkspacePlan::carry_down, "f32 [slots, H, I]"},
    {"shared_out", Region::layer, &WorkspacePlan::shared_out, "bf16 [T, H] (S > 0)"},
    {"shared_d_gate", Region::layer, &WorkspacePlan::shared_d_gate, "bf16 [T, S]"},
    {"shared_d_up", Region::layer, &WorkspacePlan::shared_d_up, "bf16 [T, S]"},
    {"dense_rows", Region::layer, &WorkspacePlan::dense_rows, "i32 [1]"},
    {"wgrad_tickets", Region::layer, &WorkspacePlan::wgrad_tickets, "u32 [3, 2]"},
    {"wait_report_lock", Region::layer, &WorkspacePlan::wait_report_lock, "u32 [1]"},
    {"peers", Region::layer, &WorkspacePlan::peers, "ptr [6, W]"},
    {"fused_counters", Region::layer, &WorkspacePlan::fused_counters,
     "u32 [2 * ceil(R/128) + ceil(T/128) + 3]"},
};

}  // namespace mok::plan
