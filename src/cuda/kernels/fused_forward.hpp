// The forward megakernel (DESIGN.md section 4): one persistent launch per ring pass that pulls the
// pass's rows, runs gate/up + SwiGLU and the down projection whose epilogue pushes every output row
// into its home slot (the combine), with no launch boundary between the three. The same GEMM
// engine and epilogues as the unfused path's launches (gemm/engine.cuh), so the same bits.
//
//   CTAs [0, C)       pull: each takes an equal share of the rows of every minibatch, minibatch by
//                     minibatch, and adds 1 to ready[m] once its share of minibatch m has landed.
//   CTAs [C, grid)    compute, as engine CTAs (Producer, two cooperative Consumers), tiles in a
//                     static round robin: first the gate/up tiles, the Producer waiting for
//                     ready[m] == C of the tile's minibatch; the Consumers add 1 to done[t] when a
//                     tile of M tile t is stored. Then the down tiles, the Producer waiting for
//                     done[t] == the gate/up tiles of M tile t. One ring, continued from phase to
//                     phase (GemmEngine::continue_from), so a CTA's Producer loads its first down
//                     tiles while its Consumers finish its last gate/up tiles.
//
// No deadlock: pulls wait for nothing, gate/up tiles only for pulls, down tiles only for gate/up
// tiles, and every CTA is resident (a cooperative launch). Every wait is bounded; a wait that gives
// up leaves the rank's error record (FlagId fused_ready or fused_done: counter, index, expected,
// seen) and the launch ends normally, its outputs void. The counters are zero between launches: the
// last CTA to end zeroes them, so graph replays and the next pass start from zero.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/error_record.hpp"
#include "cuda/gemm/descriptor.cuh"
#include "cuda/kernels/transfer.hpp"

namespace mok::cuda {

struct FusedForwardParams {
  gemm::GemmDescriptor gate_up;  // Form<kGateUp, cooperative>, pre-activations stored
  gemm::GemmDescriptor down;     // Form<kRowsWT, cooperative>, rows scattered home
  PullParams pull;               // the pass's rows into gate_up's A (no scale: forward)
  std::int64_t minibatch_rows = 0;  // a multiple of the 128-row tile
  int comm_ctas = 1;                // C, in [1, grid)
  // plan::fused_counters(ring, minibatch_rows, gate_up's groups), one array: `ready` words, then
  // `done` words, then the exit count; zero between launches.
  std::uint32_t* counters = nullptr;
  int ready_words = 0;  // ceil(ring / minibatch_rows): the pass's minibatches
  int done_words = 0;
  std::uint64_t timeout_ns = 0;  // every counter wait gives up after this long
  comm::DeviceErrorRecord* record = nullptr;  // the rank's (local region)
  comm::DeviceErrorRecord* mirror = nullptr;  // its host-mapped mirror, or null
  int rank = 0;
  int withhold_minibatch = -1;  // tests only: ready[m] of this minibatch is never released
};

// NOTES: kernel parameters are limited to 4 KiB (without the large-parameter opt-in).
static_assert(sizeof(FusedForwardParams) <= 4096, "the megakernel's parameters are one parameter");

// The launch: a cooperative grid of one CTA per SM of the current device. `clamped`: the clamped
// SwiGLU epilogue (gate_up.p.swiglu_limit). Throws mok::Error when the launch fails.
void launch_fused_forward(const FusedForwardParams& p, bool clamped, cudaStream_t stream);

}  // namespace mok::cuda
