// The forward megakernel's ticket order (kernels/fused_forward.hpp): which GEMM tile each ticket
// of a launch is. Plain C++ for host and device, so the order is tested on the CPU
// (tests/cpp/test_fused_tasks.cpp): every tile has exactly one ticket, and every dependency between
// tiles is on a smaller ticket, which is what the kernel's freedom from deadlock rests on (the
// pulls, the other dependency of a gate/up tile, are not tickets: they wait for nothing).
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/numerics.hpp"  // MOK_HOST_DEVICE

namespace mok::fused {

// A launch's GEMM tickets: its blocks and minibatches (every thread computes the same from the
// pass's row count, which the schedule left in device memory) and the shared expert's tiles.
struct TicketPlan {
  int blocks;                  // B: 128-row blocks holding the pass's rows
  int per_minibatch;           // blocks per minibatch
  int minibatches;
  int n_up, n_down;            // tiles per block of the two GEMMs
  int shared_up, shared_down;  // the shared expert's tiles (stage 0 and the last stage), or 0
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
  // The last stage: the shared expert's down tiles.
  MOK_HOST_DEVICE int last_stage() const { return minibatches + 2; }
  // Tickets before stage s: the gate/up tiles of minibatches < s - 1, the down tiles of those
  // < s - 2, the shared gate/up tiles (stage 0), and past the last stage its tiles.
  MOK_HOST_DEVICE int before_stage(int s) const {
    return n_up * first_blocks(s - 1) + n_down * first_blocks(s - 2) + (s >= 1 ? shared_up : 0) +
           (s > last_stage() ? shared_down : 0);
  }
  MOK_HOST_DEVICE int tickets() const { return before_stage(last_stage() + 1); }
};

enum class TaskKind { gate_up, down, shared_gate_up, shared_down };
struct Task {
  TaskKind kind;
  int block;
  int n;  // N tile
};

// Blocks per raster panel: the unfused GEMM scheduler's kPanelM (gemm/scheduler.cuh).
inline constexpr int kPanelBlocks = 16;

// Which blocks share an expert group: `clip(q, lo, hi)` narrows [lo, hi) to the blocks of block
// q's group (it must be a partition: every block of the narrowed range narrows it the same way).
// NoGroups: one group (the shared expert's dense rows).
struct NoGroups {
  MOK_HOST_DEVICE void clip(int, int&, int&) const {}
};

// The routed blocks' groups from the groups' first rows (ascending, as the schedule lays them
// out): block q is in the last group whose first row is at or before row 128 q (group 0 when
// none is), as its GEMM tile is (fused_forward.cuh, block_tile). `of_block`, when given, holds
// search(q) for the blocks q < tabled (the megakernel fills it once per launch: NOTES,
// f09c8ab), so that decoding a ticket needs no search.
struct BlockGroups {
  const int* start;  // [groups] first rows
  int groups;
  const std::uint16_t* of_block = nullptr;
  int tabled = 0;
  MOK_HOST_DEVICE int search(int q) const {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= 128 * q) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
  MOK_HOST_DEVICE int group_of(int q) const {
    return q >= 0 && q < tabled ? static_cast<int>(of_block[q]) : search(q);
  }
  // The blocks of group g are [ceil(start[g] / 128), ceil(start[g + 1] / 128)) (from 0 for g = 0,
  // to the end for the last). NOTES: the final clamp keeps q in its range whatever the table holds
  // (a table that is not ascending would give overlapping panels, whose tiles' dependency counts
  // then time out with a report; ascending tables give a partition).
  MOK_HOST_DEVICE void clip(int q, int& lo, int& hi) const {
    const int g = group_of(q);
    if (g > 0 && (start[g] + 127) / 128 > lo) lo = (start[g] + 127) / 128;
    if (g + 1 < groups && (start[g + 1] + 127) / 128 < hi) hi = (start[g + 1] + 127) / 128;
    if (lo > q) lo = q;
    if (hi <= q) hi = q + 1;
  }
};

// The o-th of the `n_tiles`-tile rows of `blocks` blocks from `first`, in panels: runs of at most
// kPanelBlocks blocks of one group, panel by panel, and within a panel N outer, block inner: the
// raster of the unfused scheduler, so that the tiles running at one time share a panel's A rows
// and a few N columns of one expert's weights in L2. NOTES: N outer over a whole 32-block
// minibatch kept 58 MB of A rows live on dsv3 shapes (more than the 50 MB L2) and made dsv3-ep1
// (one block per expert) 20% slower than the launches; panels of 16 blocks across experts left it
// 14% slower (bf77fd1). A panel's tiles are a contiguous range of o (every block has n_tiles),
// so the panel of o is the panel of block first + o / n_tiles.
template <class Groups>
MOK_HOST_DEVICE Task tile_task(TaskKind kind, int first, int blocks, int n_tiles, int o,
                               const Groups& groups) {
  const int q = first + o / n_tiles;
  int lo = first, hi = first + blocks;
  groups.clip(q, lo, hi);
  const int start = lo + (q - lo) / kPanelBlocks * kPanelBlocks;
  const int size = hi - start < kPanelBlocks ? hi - start : kPanelBlocks;
  const int local = o - n_tiles * (start - first);
  return {kind, start + local % size, local / size};
}

// The task of `ticket` (in [0, p.tickets())); `shared_blocks`: the shared expert's blocks;
// `groups`: the routed blocks' expert groups (tile_task).
template <class Groups>
MOK_HOST_DEVICE Task decode(const TicketPlan& p, int shared_blocks, int ticket,
                            const Groups& groups) {
  // The stage: the last s with before_stage(s) <= ticket (an empty stage shares its start with
  // the next one, which the search prefers).
  int lo = 0, hi = p.last_stage();
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
    return tile_task(TaskKind::shared_gate_up, 0, shared_blocks, p.shared_up / shared_blocks, o,
                     NoGroups{});
  }
  // The shared expert's down tiles block by block (N inner): they wait for no routed tile, so
  // they fill the routed down tiles' tail (docs/perf/NOTES.md, fa0a730).
  if (lo == p.last_stage()) {
    const int n_tiles = p.shared_down / shared_blocks;
    return {TaskKind::shared_down, o / n_tiles, o % n_tiles};
  }
  const int up_blocks = p.blocks_of(lo - 1);
  if (o < up_blocks * p.n_up) {
    return tile_task(TaskKind::gate_up, p.first_blocks(lo - 1), up_blocks, p.n_up, o, groups);
  }
  o -= up_blocks * p.n_up;
  return tile_task(TaskKind::down, p.first_blocks(lo - 2), p.blocks_of(lo - 2), p.n_down, o,
                   groups);
}

}  // namespace mok::fused
