// MoK's tuning knobs, with MoK's names and defaults, and mok's own (below them). None of them
// changes the result: every output is the same bits whatever their values; they choose how the
// work runs, and so its speed.
#pragma once

#include <cstdint>
#include <string>

namespace mok {

// How the CUDA backend runs a forward ring pass (recompute_forward_context always runs the
// launches' gate/up). Both give the same bits.
//   launches  a sequence of launches: pull, gate/up + SwiGLU, down with the combine in its epilogue
//   fused     one forward megakernel launch per pass (cuda/kernels/fused_forward.hpp); on one GPU
//             at the power limit within about 1% of the launches; refused on a team across
//             processes until a multi-GPU run has tested it
// The CPU backend computes the same function either way.
enum class ForwardPath : std::uint8_t { launches, fused };
const char* forward_path_name(ForwardPath p);

// The forward megakernel's default stage (Config::fused_stage_rows 0): the larger of this and
// minibatch_size. NOTES: 16384-row stages saved 0.5% of the megakernel's time alone on average
// over the four standard cases of docs/perf/method.md against 4096-row ones (2026-12-04,
// fba1f6c).
inline constexpr std::int64_t kFusedStageRows = 16384;

struct Config {
  int fwd_num_comm_sms = 40;                  // MoK: CTAs of its forward kernel that move tokens;
                                              // accepted, unused: in mok's megakernel every CTA
                                              // pulls with the idle warps of its GEMM Producer
                                              // warpgroup (fused_forward.hpp)
  int bwd_num_comm_sms = 28;                  // same, backward
  std::int64_t minibatch_size = 4096;         // rows pulled per dispatch step inside a pass
  std::int64_t macrobatch_size = 0;           // rows of the ring buffer (one pass); 0: automatic,
                                              // 131072 routed rows plus each local expert's
                                              // padding to the 128-row tile
  double schedule_capacity_multiplier = 0.5;  // accepted for MoK compatibility; see below

  // mok's own knobs.
  ForwardPath forward_path = ForwardPath::launches;
  // Rows of one stage of the forward megakernel (its tickets run a pass's blocks stage by stage,
  // each stage's gate/up tiles beside the previous stage's down tiles; the order never changes the
  // bits): 0, automatic (the larger of minibatch_size and kFusedStageRows), else a positive
  // multiple of 128. Only the fused forward path reads it.
  std::int64_t fused_stage_rows = 0;

  // NOTES: MoK sizes its schedule from schedule_capacity_multiplier and can overflow when the
  // routing is skewed past it. mok's schedule table is always sized for the worst case
  // (Problem::max_routed_rows), so this knob never limits anything; it is validated and kept only
  // so that MoK configurations carry over unchanged.

  // Throws mok::Error naming the first knob that is out of range.
  void validate() const;
  std::string to_string() const;
  // fused_stage_rows resolved (never 0).
  std::int64_t resolved_fused_stage_rows() const;
};

}  // namespace mok
