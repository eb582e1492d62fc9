// The forward megakernel's ticket order (kernels/fused_forward.hpp): which GEMM tile each ticket
// of a launch is. Plain C++ for host and device, so the order is tested on the CPU
// (tests/cpp/test_fused_tasks.cpp): every tile has exactly one ticket, and every dependency between
// tiles is on a smaller ticket, which is what the kernel's freedom from deadlock rests on (the
// pulls, the other dependency of a gate/up tile, are not tickets: they wait for nothing).
#pragma once

#include <algorithm>

#include "core/numerics.hpp"  // MOK_HOST_DEVICE

namespace mok::fused {

// A launch's GEMM tickets: its blocks and minibatches (every thread computes the same from the
// pass's row count, which the schedule left in device memory) and the shared expert's tiles.
struct TicketPlan {
  int blocks;                  // B: 128-row blocks holding the pass's rows
  int per_minibatch;           // blocks per minibatch
  int minibatches;
  int n_up, n_down;            // tiles per block of the two GEMMs
  int shared_up, shared_down;  // the shared expert's tiles (stage 0 and stage 1), or 0
  // Blocks of the first x minibatches.
  MOK_HOST_DEVICE int first_blocks(int x) const {
#if defined(__CUDA_ARCH__)
    return x <= 0 ? 0 : min(x * per_minibatch, blocks);
#else
    return x <= 0 ? 0 : std::min(x * per_minibatch, blocks);
#endif
  }
  MOK_HOST_DEVICE int blocks_of(int minibatch) const {
    return first_blocks(minibatch + 1) - first_blocks(minibatch);
  }
  // Tickets before stage s: the gate/up tiles of minibatches < s - 1, the down tiles of those
  // < s - 2, the shared tiles of the stages before.
  MOK_HOST_DEVICE int before_stage(int s) const {
    return n_up * first_blocks(s - 1) + n_down * first_blocks(s - 2) + (s >= 1 ? shared_up : 0) +
           (s >= 2 ? shared_down : 0);
  }
  MOK_HOST_DEVICE int tickets() const { return before_stage(minibatches + 2); }
};

enum class TaskKind { gate_up, down, shared_gate_up, shared_down };
struct Task {
  TaskKind kind;
  int block;
  int n;  // N tile
};

// Blocks per raster panel: the unfused GEMM scheduler's kPanelM (gemm/scheduler.cuh).
inline constexpr int kPanelBlocks = 16;

// The o-th of the `n_tiles`-tile rows of `blocks` blocks from `first`, in panels of kPanelBlocks
// blocks, panel by panel, and within a panel N outer, block inner: the raster of the unfused
// scheduler, so that the tiles running at one time share a panel's A rows and a few N columns of
// weights in L2. NOTES: N outer over a whole 32-block minibatch kept 58 MB of A rows live on
// dsv3 shapes (more than the 50 MB L2) and made dsv3-ep1 (one block per expert) 20% slower than
// the launches (session 11).
MOK_HOST_DEVICE inline Task tile_task(TaskKind kind, int first, int blocks, int n_tiles, int o) {
  const int panel = o / (kPanelBlocks * n_tiles);
  const int rem = o - panel * kPanelBlocks * n_tiles;
  const int rest = blocks - panel * kPanelBlocks;
  const int size = rest < kPanelBlocks ? rest : kPanelBlocks;
  return {kind, first + panel * kPanelBlocks + rem % size, rem / size};
}

// The task of `ticket` (in [0, p.tickets())); `shared_blocks`: the shared expert's blocks.
MOK_HOST_DEVICE inline Task decode(const TicketPlan& p, int shared_blocks, int ticket) {
  // The stage: the last s with before_stage(s) <= ticket (an empty stage shares its start with
  // the next one, which the search prefers).
  int lo = 0, hi = p.minibatches + 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.before_stage(mid) <= ticket) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  int o = ticket - p.before_stage(lo);
  // (A shared stage holds tiles only when shared_blocks > 0.)
  if (lo == 0) {
    return tile_task(TaskKind::shared_gate_up, 0, shared_blocks, p.shared_up / shared_blocks, o);
  }
  if (lo == 1) {
    if (o < p.shared_down) {
      return tile_task(TaskKind::shared_down, 0, shared_blocks, p.shared_down / shared_blocks, o);
    }
    o -= p.shared_down;
  }
  const int up_blocks = p.blocks_of(lo - 1);
  if (o < up_blocks * p.n_up) {
    return tile_task(TaskKind::gate_up, p.first_blocks(lo - 1), up_blocks, p.n_up, o);
  }
  o -= up_blocks * p.n_up;
  return tile_task(TaskKind::down, p.first_blocks(lo - 2), p.blocks_of(lo - 2), p.n_down, o);
}

}  // namespace mok::fused
