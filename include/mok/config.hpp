// MoK's tuning knobs, with MoK's names and defaults. None of them changes the result: the goal is
// the same bits whatever their values (DESIGN.md rule 2).
#pragma once

#include <cstdint>
#include <string>

namespace mok {

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

  // NOTES: MoK sizes its schedule from schedule_capacity_multiplier and can overflow when the
  // routing is skewed past it. mok's schedule table is always sized for the worst case
  // (Problem::max_routed_rows), so this knob never limits anything; it is validated and kept only
  // so that MoK configurations carry over unchanged.

  // Throws mok::Error naming the first knob that is out of range.
  void validate() const;
  std::string to_string() const;
};

}  // namespace mok
