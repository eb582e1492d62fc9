// The steps of build_schedule, one device function each (the kernel in schedule.cu composes them).
//
// The table is a stable counting sort of every source slot by local expert: the canonical order
// (expert-major, then src_rank, t, j) is the slots' natural order inside each expert. The slots of
// all W sources are cut into tiles of kTileSlots consecutive slots (tile = src * tiles_per_rank +
// c, so tiles are in canonical order too), and one warp owns a tile at a time:
//
//   count    per tile and local expert, the number of rows          scratch[e][tile]
//   scan     per expert, an exclusive scan over tiles               scratch[e][tile] -> offset
//   segments per expert, padded counts scanned into segment starts  (every block, in shared memory)
//   place    per tile, in slot order: row = start[e] + offset[e][tile] + rank among the tile's
//            earlier slots of expert e (warp match + prefix popcount, 32 slots at a time); the
//            same step writes the inverse, row_of_slot[src] = row, or -1 for a slot not placed
//            here (every slot belongs to exactly one tile, so each is written once)
//
// NOTES: integer atomics appear only in `count` (shared-memory histogram increments), whose sums do
// not depend on their order; every position comes from scans and ranks in a fixed order, so the
// table is the same bits on every run and for every grid size.
#pragma once

#include <cstdint>

#include "core/schedule_layout.hpp"
#include "cuda/comm/team.cuh"

namespace mok::kernels::schedule_blocks {

using namespace mok::schedule;

inline constexpr int kThreads = 512;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kSlotsPerLane = static_cast<int>(kTileSlots / 32);
static_assert(kTileSlots % 32 == 0);

// Shared memory of one block: a counter array per warp, the segment starts, the counts.
__host__ __device__ constexpr std::int64_t shared_bytes(std::int64_t num_local_experts) {
  return (kWarps * num_local_experts + 2 * (num_local_experts + 1) + 2 * kWarps) * 4;
}

// One rank's view of the problem and of its buffers inside a launch.
struct RankSchedule {
  std::int64_t slots;  // T * k, per source rank
  std::int64_t topk;
  std::int64_t num_experts;  // E
  std::int64_t tiles_per_rank;
  std::int64_t num_tiles;  // W * tiles_per_rank
  std::int64_t max_rows;
  std::int32_t num_local_experts;
  int rank;
  int world_size;
  const std::int64_t* ids;  // this rank's topk_experts [T, k]
  std::int32_t* staged;     // this rank's exchange buffer (symmetric), this launch's parity
  std::int32_t* table;
  std::int32_t* counts;
  std::int32_t* src_counts;
  std::int32_t* segment_starts;
  RingPlan* ring_plan;
  std::int32_t* scratch;  // [E_local][num_tiles]
  std::int32_t* row_of_slot;  // [W * slots]: the table inverted (src -> row, or -1)
};

__device__ __forceinline__ int lane_id() {
  return static_cast<int>(threadIdx.x) & 31;
}
__device__ __forceinline__ int warp_id() {
  return static_cast<int>(threadIdx.x) >> 5;
}

// Step 0: this rank's ids -> int32 in its symmetric exchange buffer; invalid ids become unused
// slots and the smallest bad slot is noted for the error record.
template <ptx::Scope Scope>
__device__ void stage_expert_ids(const RankSchedule& s, comm::RankTeam<Scope>& team) {
  const std::int64_t stride = std::int64_t{gridDim.x} * kThreads;
  for (std::int64_t i = std::int64_t{blockIdx.x} * kThreads + threadIdx.x; i < s.slots;
       i += stride) {
    const std::int64_t id = s.ids[i];
    if (!is_valid_expert_id(id, s.num_experts)) team.note_bad_slot(i);
    s.staged[i] = staged_expert_id(id, s.num_experts);
  }
}

// Loads one tile's staged ids, slot = first + u * 32 + lane (kUnusedSlot past the end).
__device__ __forceinline__ void load_tile(const std::int32_t* src_ids, std::int64_t first,
                                          std::int64_t slots, std::int32_t (&ids)[kSlotsPerLane]) {
#pragma unroll
  for (int u = 0; u < kSlotsPerLane; ++u) {
    const std::int64_t slot = first + u * 32 + lane_id();
    ids[u] = slot < slots ? src_ids[slot] : kUnusedSlot;
  }
}

// Step 1, per warp: histogram of each owned tile over local experts -> scratch[e][tile].
template <typename SourceIds>
__device__ void count_tiles(const RankSchedule& s, SourceIds&& source_ids,
                            std::int32_t* warp_hist) {
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarps;
  for (std::int64_t tile = std::int64_t{blockIdx.x} * kWarps + warp_id(); tile < s.num_tiles;
       tile += warps) {
    const int src = static_cast<int>(tile / s.tiles_per_rank);
    const std::int64_t first = (tile % s.tiles_per_rank) * kTileSlots;
    for (int e = lane_id(); e < s.num_local_experts; e += 32) warp_hist[e] = 0;
    std::int32_t ids[kSlotsPerLane];
    load_tile(source_ids(src), first, s.slots, ids);
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kSlotsPerLane; ++u) {
      const std::int32_t e = local_expert_of(ids[u], s.rank, s.num_local_experts);
      if (e >= 0) atomicAdd(&warp_hist[e], 1);
    }
    __syncwarp();
    for (int e = lane_id(); e < s.num_local_experts; e += 32) {
      s.scratch[e * s.num_tiles + tile] = warp_hist[e];
    }
    __syncwarp();
  }
}

__device__ __forceinline__ std::int32_t warp_exclusive_scan(std::int32_t v, std::int32_t* total) {
  std::int32_t incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const std::int32_t n = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane_id() >= d) incl += n;
  }
  *total = __shfl_sync(0xffffffffu, incl, 31);
  return incl - v;
}

// Step 2, per warp: for each owned expert, the exclusive scan of its tile counts (in place), its
// unpadded count and its per-source counts. Each lane scans a contiguous run of tiles.
__device__ void scan_experts(const RankSchedule& s) {
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarps;
  const std::int64_t per_lane = (s.num_tiles + 31) / 32;
  for (std::int64_t e = std::int64_t{blockIdx.x} * kWarps + warp_id(); e < s.num_local_experts;
       e += warps) {
    std::int32_t* row = s.scratch + e * s.num_tiles;
    const std::int64_t begin = lane_id() * per_lane;
    const std::int64_t end = begin + per_lane < s.num_tiles ? begin + per_lane : s.num_tiles;
    std::int32_t sum = 0;
    for (std::int64_t i = begin; i < end; ++i) sum += row[i];
    std::int32_t total = 0;
    std::int32_t run = warp_exclusive_scan(sum, &total);
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int32_t c = row[i];
      row[i] = run;
      run += c;
    }
    __syncwarp();  // NOTES: orders the row's new values for the other lanes' reads below
    if (lane_id() == 0) s.counts[e] = total;
    for (int src = lane_id(); src < s.world_size; src += 32) {
      const std::int32_t a = row[src * s.tiles_per_rank];
      const std::int32_t b = src + 1 < s.world_size ? row[(src + 1) * s.tiles_per_rank] : total;
      s.src_counts[e * s.world_size + src] = b - a;
    }
  }
}

// Step 3, every block: segment starts of all local experts into shared memory `starts`
// (E_local + 1 entries) and the counts into `counts`; block 0 also writes them out with the
// ring plan. `warp_sums` holds kWarps entries.
__device__ void compute_segments(const RankSchedule& s, std::int64_t macrobatch_size,
                                 std::int64_t minibatch_size, std::int32_t* starts,
                                 std::int32_t* counts, std::int32_t* warp_sums) {
  const int E = s.num_local_experts;
  const int per_thread = (E + kThreads - 1) / kThreads;
  const int begin = static_cast<int>(threadIdx.x) * per_thread;
  const int end = begin + per_thread < E ? begin + per_thread : E;
  std::int32_t sum = 0;
  for (int e = begin; e < end; ++e) {
    const std::int32_t c = s.counts[e];
    counts[e] = c;
    sum += static_cast<std::int32_t>(padded_rows(c));
  }
  std::int32_t warp_total = 0;
  const std::int32_t in_warp = warp_exclusive_scan(sum, &warp_total);
  if (lane_id() == 0) warp_sums[warp_id()] = warp_total;
  __syncthreads();
  std::int32_t before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp_id() ? warp_sums[w] : 0;
    all += warp_sums[w];
  }
  std::int32_t run = before + in_warp;
  for (int e = begin; e < end; ++e) {
    starts[e] = run;
    run += static_cast<std::int32_t>(padded_rows(counts[e]));
  }
  if (threadIdx.x == 0) starts[E] = all;
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= E; e += kThreads) s.segment_starts[e] = starts[e];
    if (threadIdx.x == 0) *s.ring_plan = make_ring_plan(all, macrobatch_size, minibatch_size);
  }
}

// Step 4, per warp: the rows of each owned tile, in slot order, and each slot's row (or -1).
template <typename SourceIds>
__device__ void place_tiles(const RankSchedule& s, SourceIds&& source_ids,
                            const std::int32_t* starts, std::int32_t* warp_next) {
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarps;
  const unsigned lanes_below = (1u << lane_id()) - 1u;
  for (std::int64_t tile = std::int64_t{blockIdx.x} * kWarps + warp_id(); tile < s.num_tiles;
       tile += warps) {
    const int src = static_cast<int>(tile / s.tiles_per_rank);
    const std::int64_t first = (tile % s.tiles_per_rank) * kTileSlots;
    std::int32_t ids[kSlotsPerLane];
    load_tile(source_ids(src), first, s.slots, ids);
    for (int e = lane_id(); e < s.num_local_experts; e += 32) {
      warp_next[e] = starts[e] + s.scratch[e * s.num_tiles + tile];
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kSlotsPerLane; ++u) {
      const std::int32_t e = local_expert_of(ids[u], s.rank, s.num_local_experts);
      const std::int64_t slot = first + u * 32 + lane_id();
      std::int32_t* const inverse = slot < s.slots ? s.row_of_slot + src * s.slots + slot : nullptr;
      if (__ballot_sync(0xffffffffu, e >= 0) == 0u) {  // no local row in these 32 slots
        if (inverse != nullptr) *inverse = kPaddingRow;
        continue;
      }
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int leader = __ffs(peers) - 1;
      const bool lead = lane_id() == leader;
      std::int32_t base = e >= 0 && lead ? warp_next[e] : 0;
      base = __shfl_sync(0xffffffffu, base, leader);
      const std::int32_t row = base + __popc(peers & lanes_below);
      if (e >= 0) s.table[row] = encode_row(src, slot, s.slots);
      if (inverse != nullptr) *inverse = e >= 0 ? row : kPaddingRow;
      __syncwarp();
      if (e >= 0 && lead) warp_next[e] = base + __popc(peers);
      __syncwarp();
    }
  }
}

// Step 5: kPaddingRow in every row that holds no routed row (segment ends, and the rows from
// total_rows to the table's capacity).
__device__ void fill_padding(const RankSchedule& s, const std::int32_t* starts,
                             const std::int32_t* counts) {
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarps;
  for (std::int64_t e = std::int64_t{blockIdx.x} * kWarps + warp_id(); e < s.num_local_experts;
       e += warps) {
    for (std::int64_t r = starts[e] + counts[e] + lane_id(); r < starts[e + 1]; r += 32) {
      s.table[r] = kPaddingRow;
    }
  }
  // The tail, 16 bytes at a time (total_rows is a multiple of 128 rows, so 16-byte aligned).
  const std::int64_t total = starts[s.num_local_experts];
  const std::int64_t vec_end = total + (s.max_rows - total) / 4 * 4;
  int4* v = reinterpret_cast<int4*>(s.table + total);
  const std::int64_t stride = std::int64_t{gridDim.x} * kThreads;
  const std::int64_t first = std::int64_t{blockIdx.x} * kThreads + threadIdx.x;
  for (std::int64_t i = first; i < (vec_end - total) / 4; i += stride) {
    v[i] = make_int4(kPaddingRow, kPaddingRow, kPaddingRow, kPaddingRow);
  }
  for (std::int64_t r = vec_end + first; r < s.max_rows; r += stride) s.table[r] = kPaddingRow;
}

}  // namespace mok::kernels::schedule_blocks
