// The grouped GEMM forms of the MoE layer: torch-free launchers over one Hopper engine (TMA +
// wgmma, warp-specialized, persistent: src/cuda/gemm/engine.cuh, its kernel
// src/cuda/kernels/sm90_bf16_grouped_gemm.cu, these launchers src/cuda/gemm/launch.cu).
//
// Row layout contract (built by the schedule): routed rows are contiguous in segment order in
// every row buffer. `starts` holds G+1 int32 entries (multiples of kExpertSegmentAlignment),
// `rows` G unpadded counts, both in device memory and never read by the host. Rows in
// [starts[g] + rows[g], starts[g+1]) are padding: they are read but never change a kept value,
// and outputs in padding rows are not written.
//
// Every matrix is row-major bf16 (PyTorch's convention); leading dimensions are in elements and
// must be multiples of 8 (16-byte TMA strides); pointers 16-byte aligned. Launchers only enqueue
// work on `stream` (no synchronization, no device reads), so they can be captured in CUDA graphs.
// They throw mok::Error for invalid arguments and launch failures.
//
// Every wait inside a launch is bounded (WaitOptions): a launch that waits too long gives up
// cleanly, its outputs void, and the caller's TimeoutReport says which wait gave up; it never
// traps, so the CUDA context (and the next launch) survives.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "core/schedule_layout.hpp"
#include "core/workspace_plan.hpp"

namespace mok::gemm {

// The schedule pads every expert segment to this (one definition: core/schedule_layout.hpp); the
// engine's tile height equals it (config.hpp asserts so).
inline constexpr int kExpertSegmentAlignment = schedule::kExpertSegmentAlignment;
inline constexpr int kMaxGroups = 1024;

struct WaitTimeoutReport;  // descriptor.cuh

// Where launches that gave up on a wait say which one: a WaitTimeoutReport in mapped pinned host
// memory and a lock word in device memory, both on the device current at construction. One per
// owner of launches (the CUDA layer keeps one per workspace, so a stall is reported by the layer
// whose launch stalled, never by another's), never shared by callers who read it apart.
class TimeoutReport {
 public:
  // `lock`: a zeroed word of device memory the report uses (e.g. a buffer of the caller's own
  // allocation); null: the report allocates one. Throws mok::Error when memory cannot be had.
  explicit TimeoutReport(unsigned* lock = nullptr);
  ~TimeoutReport();
  TimeoutReport(const TimeoutReport&) = delete;
  TimeoutReport& operator=(const TimeoutReport&) = delete;

  // The first wait that gave up since the report was last cleared, as text ("" if none did: its
  // barrier, parity, block and thread), then clears it. Read once the launches in question have
  // completed (e.g. after a stream synchronization, or the next call's check on its stream).
  std::string take();
  // The same text without clearing the report.
  std::string peek() const;

  WaitTimeoutReport* report() const { return report_; }
  unsigned* lock() const { return lock_; }

 private:
  WaitTimeoutReport* report_ = nullptr;  // mapped pinned host memory (host and device pointer)
  unsigned* lock_ = nullptr;             // device memory, zero
  bool own_lock_ = false;
  int device_ = 0;
};

// How long any wait inside a launch may take before the launch gives up (default 20 s: no
// legitimate wait comes near it), and where it says so. A launch that gives up ends normally with
// its outputs void and, with a `report`, leaves its report there. A timeout under 1 ms (a test of
// the give-up path) is kept by polling, to within a tick of the global timer; the Producer's last
// wait, for its copies in flight, still takes up to 1 ms (ptx::kShortWaitNs).
struct WaitOptions {
  std::uint64_t timeout_ns = 20ull * 1000 * 1000 * 1000;
  TimeoutReport* report = nullptr;  // null: no report (the outputs are void all the same)
};

// Which rows belong to which group. Dense form: starts == rows == nullptr, num_groups == 1,
// and `dense_rows` rows from row 0 (any count, not padded).
struct RowSegments {
  const int* starts = nullptr;  // [num_groups + 1], device
  const int* rows = nullptr;    // [num_groups], device
  int num_groups = 0;
  int capacity_rows = 0;  // rows allocated in each row buffer: no row at or past it is touched
  int dense_rows = 0;     // dense form only
};

// Optional destination of the output rows of an M-grouped plain form: the combine of the layer
// fused into the epilogue. Row i of the row buffer goes to row `slot` of peers[rank], where
// rows[i] = rank * slots + slot (the schedule table's source encoding); rows whose entry is
// negative are not stored. bf16 output only; `out` is then not written (may be null).
struct RowScatter {
  const std::int32_t* rows = nullptr;  // [capacity_rows], device; null: store to `out`
  std::int64_t slots = 0;              // rows of each peer's [slots, ld_out] destination
  void* const* peers = nullptr;        // device array of destination pointers, one per rank
};

// hidden = bf16(silu(g) * u), g = bf16(x W_gate[e]^T), u = bf16(x W_up[e]^T) for the rows of e.
// Where a weight operand's rows lie: `ld` elements between rows, `group_stride` between groups
// (experts); 0 means contiguous (ld = the row length, group_stride = rows per group * ld). The
// tensor map covers rows [0, (G - 1) * group_stride / ld + rows per group) with leading dimension
// ld, and a group's first row is group * (group_stride / ld): ld a multiple of 8 elements that
// divides group_stride. E.g. the gate half of a packed [G, 2I, H] gate/up tensor: ld H,
// group_stride 2IH; its interleaved rows: ld 2H, group_stride 2IH.
struct WeightStrides {
  std::int64_t ld = 0;
  std::int64_t group_stride = 0;
};

struct GateUpForwardArgs {
  RowSegments segments;
  const __nv_bfloat16* x = nullptr;  // [capacity_rows, hidden_size], ld_x
  std::int64_t ld_x = 0;
  const __nv_bfloat16* w_gate = nullptr;  // [G, intermediate_size, hidden_size], WeightStrides
  const __nv_bfloat16* w_up = nullptr;    // [G, intermediate_size, hidden_size], WeightStrides
  WeightStrides w_strides;                // of w_gate and w_up (default: contiguous)
  __nv_bfloat16* hidden = nullptr;        // [capacity_rows, intermediate_size], ld_out
  __nv_bfloat16* gate = nullptr;          // optional pre-activations g (same shape and ld)
  __nv_bfloat16* up = nullptr;            // optional pre-activations u (both or neither)
  std::int64_t ld_out = 0;
  int hidden_size = 0;        // K, multiple of 64
  int intermediate_size = 0;  // N, multiple of 64
  // Clamped SwiGLU (core/numerics.hpp): hidden = bf16(silu(min(g, L)) * clamp(u, -L, L)); g and u
  // are stored unclamped. A finite positive float; absent: the plain epilogue, whose code is
  // unchanged (a separate instantiation, epilogue::SwigluForward's kClamped).
  std::optional<float> swiglu_limit;
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// out = bf16(row_scale[r] * (a[r] W[e]^T)): the down projection (a = hidden, W = W_down) with an
// optional fp32 per-row factor (the router weight); row_scale indexes rows of the buffer.
struct RowsTimesWeightTArgs {
  RowSegments segments;
  const __nv_bfloat16* a = nullptr;  // [capacity_rows, k], ld_a
  std::int64_t ld_a = 0;
  const __nv_bfloat16* w = nullptr;  // [G, n, k] contiguous
  __nv_bfloat16* out = nullptr;      // [capacity_rows, n], ld_out
  std::int64_t ld_out = 0;
  const float* row_scale = nullptr;  // optional, [capacity_rows]
  RowScatter scatter;                // optional: out's rows scattered to peers instead
  int n = 0;                         // multiple of 64
  int k = 0;                         // multiple of 64
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// e4m3 operands (docs/architecture.md, "The FP8 layer"): FP8 bytes and fp32 power-of-two scales.
// wgmma reads them K-major only, so both operands of an e4m3 form have K contiguous; H and I
// multiples of 128.
//   rows:    [capacity_rows, k] with ld; scale[kb * scale_ld + row] per 1 x 128 along k (k-block-
//            major, so a tile's rows of one K block are contiguous), scale_ld >= capacity_rows.
//   weights: [G, n, k] contiguous; scale [G, n / 128, k / 128], one per 128 x 128 block.
struct Fp8Rows {
  const std::uint8_t* data = nullptr;
  std::int64_t ld = 0;
  const float* scale = nullptr;
  std::int64_t scale_ld = 0;
};
struct Fp8Weight {
  const std::uint8_t* data = nullptr;
  const float* scale = nullptr;
};

// Where an e4m3 GEMM writes an output quantized (layouts as Fp8Rows and Fp8TokenAxis say,
// Fp8TokenAxis's below).
struct Fp8Out {
  std::uint8_t* data = nullptr;
  std::int64_t ld = 0;
  float* scale = nullptr;
  std::int64_t scale_ld = 0;
};

// GateUpForwardArgs over e4m3 operands: g and u are the promoted fp32 sums (each K block's
// product times its row's and weight block's scales, added in K order), then the same epilogue.
struct GateUpForwardFp8Args {
  RowSegments segments;
  Fp8Rows x;               // [capacity_rows, hidden_size]
  Fp8Weight w_gate, w_up;  // [G, intermediate_size, hidden_size]
  __nv_bfloat16* hidden = nullptr;
  __nv_bfloat16* gate = nullptr;
  __nv_bfloat16* up = nullptr;
  std::int64_t ld_out = 0;
  int hidden_size = 0;        // K, multiple of 128
  int intermediate_size = 0;  // N, multiple of 128
  std::optional<float> swiglu_limit;
  // Clusters of two CTAs on consecutive tiles that load a shared weight tile once between them
  // (TMA multicast): the same results, bit for bit, with a quarter fewer L2 reads where the
  // weight tile is shared. Off by default: faster only on the down and dgrad forms of large
  // weights (docs/perf/NOTES.md, 479191c).
  bool pairs = false;
  // Each consumer warpgroup issues the next K block's wgmma before it promotes this one's (a
  // second set of partial accumulators): the same results, bit for bit. Off by default: 0.88-1.00x
  // on the M-grouped forms, whose consumers then wait for their stages; 1.09-1.15x on the weight
  // gradient's large cases, where the layer uses it (docs/perf/NOTES.md, 642f5ff).
  bool overlap = false;
  // 128 x 256 tiles instead of 128 x 128 (each K block as two 128-column halves, one partial set):
  // the same results, bit for bit, with a quarter fewer tile bytes a FLOP. Not with pairs or
  // overlap (mok's error names `wide`). Off by default here; the FP8 layer turns it on where n
  // fills whole wide tiles (docs/perf/NOTES.md, 58329ee).
  bool wide = false;
  // Optional: hidden quantized as well, in the rows form the down GEMM reads (Fp8Out below:
  // 1x128 along intermediate_size, data [capacity_rows, ld], scale [intermediate_size / 128,
  // scale_ld], ld >= intermediate_size a multiple of 8, scale_ld >= capacity_rows), with the
  // rows quantizer's bits over the bf16 hidden (src/cuda/kernels/quantize_pass_fp8.hpp), which is
  // written too. Needs `wide` (a tile's 128 output columns are one block of each row).
  Fp8Out hidden_quantized;
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// RowsTimesWeightTArgs over e4m3 operands (the down forward; with a weight's transposed copy, the
// input gradients).
struct RowsTimesWeightTFp8Args {
  RowSegments segments;
  Fp8Rows a;    // [capacity_rows, k]
  Fp8Weight w;  // [G, n, k]
  __nv_bfloat16* out = nullptr;
  std::int64_t ld_out = 0;
  const float* row_scale = nullptr;
  RowScatter scatter;
  int n = 0;             // multiple of 128
  int k = 0;             // multiple of 128
  bool pairs = false;    // as GateUpForwardFp8Args::pairs
  bool overlap = false;  // as GateUpForwardFp8Args::overlap
  bool wide = false;     // as GateUpForwardFp8Args::wide (n a multiple of 256)
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// The SwiGLU backward as the epilogue of the down projection's input gradient: instead of storing
// dh = bf16(a W) the epilogue reads the forward's g and u at the same rows and columns and stores
//   dg, du = bf16(swiglu_backward(g, u, dh))   (numerics::swiglu_backward_fast)
// so dh never reaches memory. All four [capacity_rows, n] bf16 with the output's ld_out.
// Two optional outputs for the router weight's gradient at the expert side (each independent):
//   row_scale [capacity_rows] fp32: dh = bf16(row_scale[r] * acc) instead of bf16(acc) (then `a`
//     holds the unscaled d_out rows and row_scale each row's router weight);
//   dot [capacity_rows, ceil(n / kDotColumns)] fp32, row-major: dot[r][c] = the sum over the
//     columns j of chunk c (kDotColumns wide) of acc[r][j] * h[r][j], with acc the unscaled fp32
//     accumulator and h = bf16(silu(g) * u) (numerics::swiglu_fast; bitwise the forward's hidden),
//     in a fixed order (epilogue.cuh): the same bits whichever CTA runs the tile, every run.
// And, with both of those, one more (optional):
//   scaled_hidden [capacity_rows, n] bf16, ld_out: bf16(row_scale[r] * h[r][j]) (the fp32
//     product of the weight and that same h, rounded once): the down weight gradient's operand
//     when it scales h instead of d_out (dW_down = d_out^T bf16(w h)).
// Rows past a group's rows (padding) are written in none of the outputs.
inline constexpr int kDotColumns = static_cast<int>(plan::kDotColumns);

struct SwigluBackwardEpilogue {
  const __nv_bfloat16* gate = nullptr;  // g of the forward
  const __nv_bfloat16* up = nullptr;    // u of the forward
  __nv_bfloat16* d_gate = nullptr;
  __nv_bfloat16* d_up = nullptr;
  const float* row_scale = nullptr;        // optional, [capacity_rows]
  float* dot = nullptr;                    // optional, [capacity_rows, ceil(n / kDotColumns)]
  __nv_bfloat16* scaled_hidden = nullptr;  // optional, with row_scale and dot: [capacity_rows, n]
  // Clamped SwiGLU: dg, du = bf16(swiglu_backward_clamped(g, u, dh, L)) and h (for `dot`) clamped
  // as the forward's; absent: the plain epilogue (a separate instantiation).
  std::optional<float> limit;
};

// out = bf16(a[r] W[e]): the input gradient of a projection (B not transposed), e.g.
// dh = dy W_down[e] with a = dy [rows, H], W = W_down [G, H, I], n = I, k = H.
// With a2 and w2: out = bf16(a[r] W[e] + a2[r] W2[e]) in one fp32 accumulator (the K blocks of
// the first product, then those of the second), e.g. the gate/up input gradient
// dx = dg W_gate[e] + du W_up[e] with one rounding, as the reference computes it.
struct RowsTimesWeightArgs {
  RowSegments segments;
  const __nv_bfloat16* a = nullptr;  // [capacity_rows, k], ld_a
  std::int64_t ld_a = 0;
  const __nv_bfloat16* w = nullptr;   // [G, k, n], w_strides
  const __nv_bfloat16* a2 = nullptr;  // optional second product: [capacity_rows, k], ld_a2
  std::int64_t ld_a2 = 0;
  const __nv_bfloat16* w2 = nullptr;  // [G, k, n], w_strides (with a2)
  WeightStrides w_strides;            // of w and w2 (default: contiguous)
  void* out = nullptr;                // [capacity_rows, n], ld_out: bf16, or fp32 with out_fp32
  std::int64_t ld_out = 0;
  bool out_fp32 = false;  // fp32 output: the accumulators as they are (no scatter, no swiglu)
  RowScatter scatter;     // optional: out's rows scattered to peers instead
  // optional (gate, up, d_gate, d_up all or none; not with a scatter): out is not written (may
  // be null)
  SwigluBackwardEpilogue swiglu;
  int n = 0;
  int k = 0;
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// The SwiGLU backward of an e4m3 input gradient can write dg and du already quantized for the
// GEMMs that read them (the FP8 layer's down dgrad; docs/architecture.md, "The FP8 layer"): in the
// rows form the gate/up input gradient reads (Fp8Rows: 1x128 along n, data [capacity_rows, ld],
// scale [n / 128, scale_ld]) and in the token-axis form the weight gradients read (Fp8TokenAxis:
// data [n, ld] with ld >= capacity_rows rounded up to 128, the transpose, scale
// [ceil(capacity_rows / 128), scale_ld]; 128-row blocks from each group's first row, scales from
// the group's rows, rows past its count stored as 0), each from
// the bf16 values the epilogue rounds, with the bits of the standalone quantizers
// (src/cuda/kernels/quantize_pass_fp8.hpp) over the bf16 dg and du. Needs swiglu with row_scale
// and dot, the combination the layer runs, the only one compiled. Either
//   - all four: dg and du in bf16 are then optional (swiglu.d_gate and d_up both null: not
//     written); no scaled_hidden; the plain mainloop (no pairs, overlap or wide). NOTES: each
//     token-axis block is the tile's 128 rows down one column, so the epilogue stages dg, then
//     du, as bf16 in a staging tile, which costs the ring one of its six stages; or
//   - the rows forms alone (the FP8 layer's dgrads read them; its weight gradients then read the
//     bf16 dg and du, or token-axis copies of them): dg and du in bf16 written too; scaled_hidden
//     allowed; the plain or the wide mainloop (no pairs or overlap).
// The rows forms share ld and scale_ld, and so do the token-axis forms.
struct SwigluBackwardFp8Out {
  Fp8Out d_gate_rows, d_up_rows;
  Fp8Out d_gate_tokens, d_up_tokens;
  bool any() const { return d_gate_rows.data != nullptr || d_up_rows.data != nullptr || tokens(); }
  bool tokens() const { return d_gate_tokens.data != nullptr || d_up_tokens.data != nullptr; }
};

// RowsTimesWeightArgs (the input gradients) over e4m3 operands. wgmma reads e4m3 K-major only, so
// the weight comes as its transposed copy (the second orientation of the quantized weight):
// w_t [G, n, k] with n the output columns and k the contraction, e.g. dh = dy W_down[e] with
// a = dy [rows, H], w_t = W_down^T [G, I, H], n = I, k = H; dx = dg W_gate + du W_up with a = dg,
// w_t = W_gate^T [G, H, I], a2 = du, w2_t = W_up^T. Outputs and epilogues as RowsTimesWeightArgs.
struct RowsTimesWeightFp8Args {
  RowSegments segments;
  Fp8Rows a;       // [capacity_rows, k]
  Fp8Weight w_t;   // [G, n, k]
  Fp8Rows a2;      // optional second product (a2.data and w2_t.data both or neither); a2's
  Fp8Weight w2_t;  // scales share a's scale_ld
  void* out = nullptr;
  std::int64_t ld_out = 0;
  bool out_fp32 = false;
  RowScatter scatter;
  SwigluBackwardEpilogue swiglu;
  SwigluBackwardFp8Out quantized;  // optional, with swiglu: dg and du quantized as well
  int n = 0;                       // multiple of 128
  int k = 0;                       // multiple of 128
  bool pairs = false;              // as GateUpForwardFp8Args::pairs
  bool overlap = false;            // as GateUpForwardFp8Args::overlap
  bool wide = false;               // as GateUpForwardFp8Args::wide (n a multiple of 256)
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// dw[e] = a[rows of e]^T b[rows of e]  ([m, n] per group), reduced over the group's rows in
// increasing order by one CTA per output tile: deterministic; an empty group gives exact zeros;
// padding rows contribute nothing whatever they hold. E.g. dW_down[e] = dy^T h (a = dy, m = H,
// b = h, n = I). Output bf16 or fp32 (`out_fp32`), [G, m, n] with ld_out and group stride m*ld_out.
//
// How the CTAs share the tiles (`order`; which CTA runs a tile never changes its bits):
//   fixed: a static round robin over the tiles in heavy-groups-first order;
//   tickets: CTAs draw tiles from an integer counter pair the caller provides (`tickets`);
//   automatic: with `tickets`, the static round robin when it balances the CTAs' K blocks within a
//     few percent of what the counter would (decided on the device from the group sizes), else
//     the counter; without `tickets`, fixed.
// `tickets`: 2 unsigned words of device memory, zero before the launch; the launch's last CTA puts
// them back to zero, so launches ordered on one stream (or one graph branch) can reuse a pair,
// while launches that may run at the same time (two streams, parallel graph branches) need a pair
// each. Null: no counter (the static order); TileOrder::tickets then is an error.
enum class TileOrder { automatic, fixed, tickets };

// A reduction whose rows come in several launches (the layer's ring passes), planned per group on
// the device (src/cuda/kernels/pass_segments.cu writes the plan). steps[g] = step | slot << 8:
//   kSkip  the group has no rows in this launch: no tile of it is loaded, computed or stored;
//   kWhole all its rows are in this launch: its sum goes to `out` as without a plan (bf16, fp32,
//          or fp32 added to `out`);
//   kOpen  its first rows: the fp32 sum goes to carry slot `slot` ([m, n], ld n);
//   kCarry middle rows: the sum continues from the slot and goes back to it;
//   kClose its last rows: the sum continues from the slot and goes to `out` as kWhole's would.
// A plain launch (continue_reduction false) runs the kWhole and kOpen groups, a continued launch
// the kCarry and kClose ones; the others have no tiles. So a reduction split over launches is
// bitwise the unsplit one (splits on multiples of kTileK rows of each group), and only groups
// whose rows span launches touch fp32 carries. Groups with an out-of-range step or slot have no
// tiles.
enum PassStep : int { kSkip = 0, kWhole = 1, kOpen = 2, kCarry = 3, kClose = 4 };
inline constexpr int kPassSlotShift = 8;

struct PassPlan {
  const int* steps = nullptr;  // [num_groups], device; null: every group kWhole (no plan)
  float* carry = nullptr;      // [slots, m, n] fp32 partial sums, device
  int slots = 0;
};

struct WeightGradArgs {
  RowSegments segments;
  TileOrder order = TileOrder::automatic;
  const __nv_bfloat16* a = nullptr;  // [capacity_rows, m], ld_a
  std::int64_t ld_a = 0;
  const __nv_bfloat16* b = nullptr;  // [capacity_rows, n], ld_b
  std::int64_t ld_b = 0;
  void* out = nullptr;  // [G, m, n]: group g's row r at out + g * out_group_stride + r * ld_out
  std::int64_t ld_out = 0;
  // Elements between groups' outputs: 0 for m * ld_out (dense); else a multiple of ld_out, at
  // least m * ld_out (e.g. the gate or up half of one packed [G, 2m, n] gradient).
  std::int64_t out_group_stride = 0;
  bool out_fp32 = false;
  // fp32 output only. accumulate: out = out + (a^T b), the sum formed first, then one fp32 add
  // (fp32 main-grad accumulation). continue_reduction: the values in `out` seed the accumulators,
  // so a reduction split over row ranges (ring passes) gives the bits of the unsplit one when
  // every split falls on a multiple of kTileK rows of each group. Empty groups keep `out` in both.
  // With a `passes` plan the seeds are the carry slots instead, and `out` may be bf16 (and
  // accumulate may go with continue_reduction: it applies to the kClose groups' stores).
  bool accumulate = false;
  bool continue_reduction = false;
  PassPlan passes;
  int m = 0;                    // multiple of 64
  int n = 0;                    // multiple of 64
  unsigned* tickets = nullptr;  // optional: [2] zeroed device words (see above)
  cudaStream_t stream = nullptr;
  WaitOptions waits;
};

// The token-axis copy of a row buffer [capacity_rows, cols] in e4m3 (what the K-grouped forms
// read: K runs along the tokens, and wgmma reads e4m3 K-major only): data [cols, ld] (the
// transpose; ld >= capacity_rows, a multiple of 16), scales fp32 [ceil(capacity_rows / 128),
// scale_ld] per 128 rows (1 x 128 along the tokens; scale_ld >= cols, a multiple of 4, 16-byte
// aligned): the scales are read by bulk copies, which have no bounds, so a last partial block
// needs its row. Rows of a 128-row block past its group's end may hold anything: the GEMM zeroes
// them.
struct Fp8TokenAxis {
  const std::uint8_t* data = nullptr;
  std::int64_t ld = 0;
  const float* scale = nullptr;
  std::int64_t scale_ld = 0;
};

// WeightGradArgs over e4m3 operands: dw[e] = a[rows of e]^T b[rows of e] from the token-axis
// copies of a [rows, m] and b [rows, n]; m and n multiples of 128. Every group starts on a
// multiple of 128 rows (kExpertSegmentAlignment; the schedule's segments and the ring's passes
// do): a token block's scales belong to one group. The starts live on the device, so this is the
// caller's guarantee, not checked. Each 128-row token block's
// product is promoted into fp32 times its row's and column's scales, in row order; outputs,
// passes and tile order as `grad` says (grad.a and grad.b null).
struct WeightGradFp8Args {
  WeightGradArgs grad;
  Fp8TokenAxis a;        // [m, capacity_rows]
  Fp8TokenAxis b;        // [n, capacity_rows]
  bool overlap = false;  // as GateUpForwardFp8Args::overlap
  // bf16 output tiles through a staging tile in shared memory and a TMA store, as the bf16 weight
  // gradient stores (the Consumers go on with the next tile while the copy engine writes): the
  // same bits, one stage fewer in the ring. fp32 outputs and carries are stored as without it.
  // Off by default here; the FP8 layer turns it on (cuda::Layer::Fp8Kernels::wgrad_tma_store:
  // 1.01-1.03x with the overlap on an H100, layer.cu).
  bool tma_store = false;
};

void gate_up_forward(const GateUpForwardArgs& args);
void rows_times_weight_t(const RowsTimesWeightTArgs& args);  // down forward (and dense)
void rows_times_weight(const RowsTimesWeightArgs& args);     // dgrad
void weight_grad(const WeightGradArgs& args);                // wgrad
void weight_grad_fp8(const WeightGradFp8Args& args);
void gate_up_forward_fp8(const GateUpForwardFp8Args& args);
void rows_times_weight_t_fp8(const RowsTimesWeightTFp8Args& args);
void rows_times_weight_fp8(const RowsTimesWeightFp8Args& args);

// The persistent grid size the launchers use (one CTA per SM of the current device).
int persistent_grid_size();

}  // namespace mok::gemm
