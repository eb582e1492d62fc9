// The forward megakernel (docs/architecture.md, "The forward megakernel"): one persistent launch
// per ring pass that pulls the pass's rows, runs gate/up + SwiGLU, and runs the down projection
// whose epilogue pushes every output row into its home slot (the combine), with no launch boundary
// between them. The same GEMM engine and epilogues as the unfused path's launches
// (gemm/engine.cuh), so the same bits.
//
// Every CTA is an engine CTA (Producer warpgroup, two cooperative Consumer warpgroups). The
// Producer warpgroup's warps 1-3, idle in a GEMM, pull: they copy the pass's rows into the ring 8
// rows at a time, groups drawn in row order from a counter, from the start of the launch, beside
// the CTA's GEMM tiles. The GEMM tiles are tickets of a second counter: the pass's rows are cut
// into 128-row blocks (the M tiles) and the blocks into minibatches of minibatch_rows rows (the
// stage: Config::resolved_fused_stage_rows(), by default the larger of minibatch_size and 16,384);
// a block has gate/up tiles (one per 128 columns of I) and down tiles (one per 256 columns of H);
// the shared expert (pass 0's launch, S > 0) has both over the rank's T tokens. Ticket order,
// stage by stage (s = 0 .. minibatches + 1; within a stage the unfused scheduler's raster: panels
// of 16 blocks, in each N outer, block inner):
//
//   stage 0:  the shared expert's gate/up tiles
//   stage 1:  the gate/up tiles of minibatch 0
//   stage s:  the gate/up tiles of minibatch s - 1, the down tiles of minibatch s - 2
//   last:     the shared expert's down tiles, block by block
//
// so the shared expert's gate/up runs while the first rows are pulled, each minibatch's down tiles
// run beside the next one's gate/up tiles, and the shared expert's down tiles (which wait for no
// routed tile) fill the routed down tiles' tail. Dependencies, counted per block: a gate/up tile's
// Producer waits for ready[b] == the row groups of its block, a down tile's for done[b] == the
// gate/up tiles of its block, a shared down tile's for shared_done[b] likewise. Pulls wait for
// nothing; every GEMM dependency is on a pull or a smaller ticket; each CTA runs its tickets in
// order and every CTA is resident (cooperative launch): the smallest unfinished ticket can always
// run, so there is no deadlock, whatever the routing.
// (A CTA's Producer draws its next ticket a few K blocks before the current tile's last load, so
// the counter's round trip is not between two tiles: a CTA then holds one drawn ticket beyond the
// one it loads, which is larger, so the argument stands.)
// Which CTA runs a task never changes its bits. The Producer thread decodes each ticket (its task
// and tile; every block's expert group is tabled once a launch, in shared memory the ring leaves
// free) and leaves the result in shared memory beside the ticket it hands the Consumers, so
// nothing but the hand-over stands between two of their tiles.
//
// Every wait is bounded; a counter wait that gives up leaves the rank's error record (FlagId
// fused_ready, fused_done or fused_shared_done, the block, expected and seen), the CTA gives up
// its remaining tasks, and the launch ends normally with its outputs void. The counters are zero
// between launches: the last CTA to end zeroes them, so graph replays and the next pass start from
// zero.
//
// The trace (tests and benchmarks only: the hooked kernel of tests/cpp, Layer::set_forward_hooks;
// off when FusedForwardParams::trace is null): globaltimer stamps (ns) of one launch, in u64
// words:
//   [0] the launch's tickets, [1] its grid, [2] its blocks, [3] unused;
//   CTA c, words 4 + 4 c: [0] its start, [1] its last pulling warp done, [2] its end, [3] unused;
//   ticket t, words 4 + 4 grid + 8 t (kTraceTicketWords): [0] the Producer was free for it
//   (the loads of its CTA's previous ticket all issued; the loop's top), [1] it handed the ticket
//   over (drawn, decoded, its record written, published), [2] its dependency was met (0: an empty
//   tile, nothing loaded), [3] the Consumers began it, [4] its first K block had landed and [5]
//   its last wgmma was done (thread 128; 0: an empty tile), [6] they ended it (stores
//   published), [7] the CTA | TaskKind << 16 | block << 32.
// Tickets past trace_tickets are not traced. What the stamps themselves cost (each reads
// %globaltimer) is not measured yet.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/error_record.hpp"
#include "cuda/gemm/descriptor.cuh"
#include "cuda/kernels/fused_trace.hpp"  // kTraceTicketWords, fused_trace_words
#include "cuda/kernels/transfer.hpp"

namespace mok::cuda {

struct FusedForwardParams {
  gemm::GemmDescriptor gate_up;  // Form<kGateUp>, pre-activations stored
  gemm::GemmDescriptor down;     // Form<kRowsWT>, rows scattered home
  // The shared expert (shared_blocks > 0): dense gate/up (pre-activations stored) over the rank's
  // tokens, and dense down into its output rows.
  gemm::GemmDescriptor gate_up_shared;
  gemm::GemmDescriptor down_shared;
  PullParams pull;                  // the pass's rows into gate_up's A (no scale: forward)
  std::int64_t minibatch_rows = 0;  // a positive multiple of 128
  // plan::fused_counter_words(ring rows, T): ready [blocks], done [blocks], shared_done
  // [shared_words], the ticket counter, the pull counter, the exit count, in that order; zero
  // between launches.
  std::uint32_t* counters = nullptr;
  int blocks = 0;         // ceil(ring rows / 128)
  int shared_words = 0;   // ceil(T / 128)
  int shared_blocks = 0;  // shared_words with the shared expert in this launch, else 0
  // A wait on ready gives up after this long, on done and shared_done after twice this long.
  std::uint64_t timeout_ns = 0;
  comm::DeviceErrorRecord* record = nullptr;  // the rank's (local region)
  comm::DeviceErrorRecord* mirror = nullptr;  // its host-mapped mirror, or null
  int rank = 0;
  // Test hooks, read only by the hooked kernel (tests/cpp; the library's launcher refuses them).
  int withhold_block = -1;         // the rows of this block are never pulled (-1: off)
  std::uint64_t* trace = nullptr;  // fused_trace_words(grid, trace_tickets) words, or null
  int trace_tickets = 0;
};
// NOTES: kernel parameters are limited to 4 KiB (without the large-parameter opt-in).
static_assert(sizeof(FusedForwardParams) <= 4096, "the megakernel's parameters are one parameter");

// The launch: a cooperative grid of one CTA per SM of the current device. `clamped`: the clamped
// SwiGLU epilogue (gate_up.p.swiglu_limit). Throws mok::Error when the launch fails, and when the
// parameters ask for a test hook (withhold_block, trace): the library's kernel has none.
void launch_fused_forward(const FusedForwardParams& p, bool clamped, cudaStream_t stream);

}  // namespace mok::cuda
