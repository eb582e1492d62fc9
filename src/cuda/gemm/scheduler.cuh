// Persistent tile scheduler over groups whose sizes live in device memory.
//
// The linear tile order: group-major; within a group, panels of kPanelM M tiles; within a panel,
// N tile outer and M tile inner. So the CTAs running at one time cover about kPanelM x
// (grid / kPanelM) tiles of one group and share both their A rows and their weight columns in L2
// (with N fastest, a wide N, e.g. mixtral's I = 14336, re-streamed the whole weight from HBM once
// per M tile).
// M-grouped forms: group g has ceil(rows_g / kTileM) x n_tiles tiles, each with a fixed K loop;
// CTA c runs tiles c, c + grid, ... (pairs: cluster c runs steps c, c + clusters, ..., step s
// tiles 2s and 2s + 1, pair_tile).
// K-grouped form (wgrad): every group has m_tiles x n_tiles tiles; the K loop covers rows_g. Tile
// t (a ticket) is the (t mod tiles-per-group)-th tile of the (t / tiles-per-group)-th group in
// heavy-first order (most K blocks first, ties by group index); CTAs draw t from a counter, or
// CTA c takes tickets c, c + grid, ... (the static order).
#pragma once

#include <climits>

#include "cuda/gemm/config.hpp"

namespace mok::gemm {

struct SchedulerParams {
  const int* starts;  // null: dense (one group of dense_rows rows at row 0)
  const int* rows;
  int num_groups;
  int capacity_rows;
  int dense_rows;
  int m_tiles;  // K-grouped only
  int n_tiles;
  int k_blocks;  // M-grouped only: K / kTileK
  // K-grouped with a pass plan (PassPlan): steps[g] = step | slot << kPassSlotShift; the launch
  // runs the groups whose step is first_step or first_step + 1 and whose slot is below `slots`
  // (kWhole groups need none). Null: every group.
  const int* steps;
  int first_step;
  int slots;
};

// Whether a K-grouped launch runs group g (its pass step, PassPlan).
__device__ __forceinline__ bool runs_group(const SchedulerParams& p, int g) {
  if (p.steps == nullptr) return true;
  const int code = __ldg(p.steps + g);
  const int step = code & ((1 << kPassSlotShift) - 1);
  const int slot = code >> kPassSlotShift;
  if (step != p.first_step && step != p.first_step + 1) return false;
  return step == kWhole || (slot >= 0 && slot < p.slots);
}

struct TileInfo {
  int group;
  int row_base;   // first row of the group in the row buffers
  int row_count;  // rows of the group (clamped to its segment and the buffer)
  int m0;         // M-grouped: first row within the group; K-grouped: first output row
  int n0;         // N tile index (times the form's output tile width: first output column)
  int k_blocks;
};

// One CTA's share of a pair's step (TileScheduler::pair_tile): its tile, whether it stores it, and
// whether the pair's two tiles use the same weight tile (then each CTA loads half of it and
// multicasts it).
struct PairTile {
  TileInfo tile;
  bool store;
  bool shared_b;
};

// Shared-memory tables, filled once per CTA by one warp.
struct SchedulerTables {
  int start[kMaxGroups];
  int count[kMaxGroups];       // K-grouped: -1 for a group the launch does not run (pass plan)
  int prefix[kMaxGroups + 1];  // exclusive prefix of tiles per group
  int order[kMaxGroups];       // K-grouped: groups, heaviest first
  int static_order;            // K-grouped: 1 = CTA c takes tickets c, c + grid, ... (no counter)
};
// Scratch of the set-up only (heavy-first sort, static-order choice). NOTES: it lives at the start
// of the dynamic shared memory, which the ring reuses once set-up is over (the writers fence the
// async proxy before the CTA barrier that precedes the first TMA load), so it costs no shared
// memory: the TMA-store epilogue's staging tile needs every byte (config.hpp).
struct SchedulerScratch {
  int bucket[kOrderBuckets];           // heavy-first sort
  long long load[kMaxStaticCtas + 1];  // choose_static_order: per-CTA cost
};
static_assert(kSharedBytes + sizeof(SchedulerTables) <= 227 * 1024, "shared memory overflow");
static_assert(sizeof(SchedulerScratch) <= kRingBytes, "scratch larger than the ring");

// Sort key of a group's K length: non-decreasing in k_blocks, exact up to 15 blocks, then the
// leading bit and 3 more (groups in one bucket differ by less than 1/8), so a counting sort over
// kOrderBuckets buckets orders groups heavy first up to ties that cost within 12.5%.
__device__ __forceinline__ int order_key(int k_blocks) {
  if (k_blocks <= 0) return 0;
  const int e = 31 - __clz(k_blocks);
  const int m = e >= 3 ? (k_blocks >> (e - 3)) & 7 : (k_blocks << (3 - e)) & 7;
  return 1 + e * 8 + m;  // <= 1 + 30 * 8 + 7 < kOrderBuckets
}

// kBlockK: the K-grouped form's K block in rows (64 bf16, 128 e4m3), which sizes its tiles' K
// loops.
template <bool kKGrouped, int kBlockK = kTileK>
struct TileScheduler {
  const SchedulerParams& p;
  const SchedulerTables& t;
  int cursor = 0;

  // Warp-cooperative: reads the group table from device memory, clamps every count to its
  // segment and to the buffer (bad tables never touch memory outside the buffers), and scans.
  __device__ static void prepare(const SchedulerParams& p, SchedulerTables& t, int lane) {
    int carry = 0;
    for (int base = 0; base < p.num_groups; base += 32) {
      const int g = base + lane;
      int tiles = 0;
      if (g < p.num_groups) {
        int start = 0, count = p.dense_rows;
        if (p.starts != nullptr) {
          start = __ldg(p.starts + g);
          const int next = __ldg(p.starts + g + 1);
          count = min(__ldg(p.rows + g), next - start);
        }
        start = max(start, 0);
        count = max(0, min(count, p.capacity_rows - start));
        if constexpr (kKGrouped) {
          const bool runs = runs_group(p, g);
          tiles = runs ? p.m_tiles * p.n_tiles : 0;
          count = runs ? count : -1;
        } else {
          tiles = (count + kTileM - 1) / kTileM * p.n_tiles;
        }
        t.start[g] = start;
        t.count[g] = count;
      }
      int inclusive = tiles;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      if (g < p.num_groups) t.prefix[g + 1] = carry + inclusive;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) t.prefix[0] = 0;
  }

  // Warp-cooperative, after prepare (same warp): t.order = the groups by decreasing order_key of
  // their K blocks, ties in increasing group index (a stable counting sort; integer atomics only
  // count, the placement is fixed by group index). Groups the launch does not run come last, so
  // the first num_tiles / (m_tiles n_tiles) entries are the ones it runs.
  __device__ static void order_heavy_first(const SchedulerParams& p, SchedulerTables& t,
                                           SchedulerScratch& scratch, int lane) {
    static_assert(kKGrouped, "only K-grouped tiles differ in cost");
    __syncwarp();
    for (int b = lane; b < kOrderBuckets; b += 32) scratch.bucket[b] = 0;
    __syncwarp();
    static_assert(1 + 30 * 8 + 7 + 1 < kOrderBuckets, "order_key and the skipped bucket fit");
    auto bucket_of = [&](int g) {
      const int count = t.count[g];
      return count < 0 ? kOrderBuckets - 1
                       : kOrderBuckets - 2 - order_key((count + kBlockK - 1) / kBlockK);
    };
    for (int g = lane; g < p.num_groups; g += 32) atomicAdd(&scratch.bucket[bucket_of(g)], 1);
    __syncwarp();
    // Exclusive scan of the histogram: lane l owns buckets [8l, 8l + 8).
    constexpr int kPerLane = kOrderBuckets / 32;
    int local[kPerLane], sum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      local[i] = sum;
      sum += scratch.bucket[lane * kPerLane + i];
    }
    int inclusive = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      scratch.bucket[lane * kPerLane + i] = inclusive - sum + local[i];
    __syncwarp();
    // Placement, 32 groups at a time in increasing index: a group's position is its bucket's
    // running base plus the lanes below it with the same bucket.
    for (int base = 0; base < p.num_groups; base += 32) {
      const int g = base + lane;
      const unsigned active = __ballot_sync(0xffffffffu, g < p.num_groups);
      if (g < p.num_groups) {
        const int b = bucket_of(g);
        const unsigned peers = __match_any_sync(active, b);
        const unsigned below = peers & ((1u << lane) - 1u);
        t.order[scratch.bucket[b] + __popc(below)] = g;
        __syncwarp(active);
        if (below == 0) scratch.bucket[b] += __popc(peers);
      }
      __syncwarp();
    }
  }

  // Warp-cooperative, after order_heavy_first (same warp): whether the static round robin over
  // the heavy-first order (CTA c takes tickets c, c + P, ...) finishes within kStaticSlackPercent
  // of what the ticket counter would reach; then every CTA takes its tickets without the counter.
  // Every CTA computes the same answer from the same tables. A tile costs its K blocks plus
  // kTileFixedCost (its epilogue and pipeline fill, in K blocks). Static makespan: max over CTAs
  // of the sum of their tiles' costs (a difference array over CTAs: group i's tickets
  // [i pg, (i + 1) pg) give each CTA pg / P tiles and a cyclic run of pg % P CTAs one more).
  // Ticket makespan, estimated: max(longest tile, total / P).
  __device__ static void choose_static_order(const SchedulerParams& p, SchedulerTables& t,
                                             SchedulerScratch& scratch, int lane, int ctas,
                                             TileOrder order) {
    static_assert(kKGrouped, "only K-grouped tiles differ in cost");
    if (order != TileOrder::automatic || ctas > kMaxStaticCtas) {
      if (lane == 0) t.static_order = order == TileOrder::fixed ? 1 : 0;
      return;
    }
    const long long pg = static_cast<long long>(p.m_tiles) * p.n_tiles;
    for (int c = lane; c <= ctas; c += 32) scratch.load[c] = 0;
    __syncwarp();
    long long base = 0, total = 0, longest = 0;
    for (int i = lane; i < p.num_groups; i += 32) {
      if (t.count[t.order[i]] < 0) continue;  // not run (pass plan): after every group that is
      const long long cost = (t.count[t.order[i]] + kBlockK - 1) / kBlockK + kTileFixedCost;
      const long long q = pg / ctas;
      const int r = static_cast<int>(pg - q * ctas);
      const int s = static_cast<int>((i * pg) % ctas);
      base += cost * q;
      total += cost * pg;
      longest = max(longest, pg > 0 ? cost : 0LL);
      if (r > 0) {  // CTAs s .. s + r - 1 (mod P) take one more tile of this group
        atomicAdd(reinterpret_cast<unsigned long long*>(&scratch.load[s]), cost);
        if (s + r <= ctas) {
          atomicAdd(reinterpret_cast<unsigned long long*>(&scratch.load[s + r]), -cost);
        } else {
          atomicAdd(reinterpret_cast<unsigned long long*>(&scratch.load[ctas]), -cost);
          atomicAdd(reinterpret_cast<unsigned long long*>(&scratch.load[0]), cost);
          atomicAdd(reinterpret_cast<unsigned long long*>(&scratch.load[s + r - ctas]), -cost);
        }
      }
    }
    __syncwarp();
    // Inclusive scan of the differences over CTAs 0..P-1, lane l owning a run of them; the max.
    const int per_lane = (ctas + 31) / 32;
    const int c0 = min(lane * per_lane, ctas), c1 = min(c0 + per_lane, ctas);
    long long sum = 0, best = LLONG_MIN;
    for (int c = c0; c < c1; ++c) {
      sum += scratch.load[c];
      best = max(best, sum);  // the run's best prefix from its own start
    }
    long long before = sum;  // exclusive prefix of the runs below this lane
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long v = __shfl_up_sync(0xffffffffu, before, d);
      if (lane >= d) before += v;
    }
    before -= sum;
    long long worst = c1 > c0 ? before + best : LLONG_MIN;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      worst = max(worst, __shfl_xor_sync(0xffffffffu, worst, d));
      base += __shfl_xor_sync(0xffffffffu, base, d);
      total += __shfl_xor_sync(0xffffffffu, total, d);
      longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
    }
    const long long fixed = base + worst;
    const long long dynamic = max(longest, (total + ctas - 1) / ctas);
    if (lane == 0) t.static_order = fixed * 100 <= dynamic * (100 + kStaticSlackPercent) ? 1 : 0;
  }

  __device__ int num_tiles() const {
    return t.prefix[p.num_groups];
  }

  // Tile `local` of group `g` in the group's panel order.
  __device__ TileInfo tile_in_group(int g, int local) const {
    TileInfo info;
    info.group = g;
    info.row_base = t.start[g];
    info.row_count = t.count[g];
    const int m_tiles = kKGrouped ? p.m_tiles : (info.row_count + kTileM - 1) / kTileM;
    const int panel = local / (kPanelM * p.n_tiles);
    const int rem = local - panel * kPanelM * p.n_tiles;
    const int panel_m = min(kPanelM, m_tiles - panel * kPanelM);
    info.m0 = (panel * kPanelM + rem % panel_m) * kTileM;
    info.n0 = rem / panel_m;
    info.k_blocks = kKGrouped ? (info.row_count + kBlockK - 1) / kBlockK : p.k_blocks;
    return info;
  }

  // Tile `index` of the linear order. Tiles must be asked for in increasing order (the cursor only
  // moves forward).
  __device__ TileInfo tile(int index) {
    while (t.prefix[cursor + 1] <= index) ++cursor;
    return tile_in_group(cursor, index - t.prefix[cursor]);
  }

  // Pairs (M-grouped, clusters of two CTAs): rank `rank`'s share of cluster step `step`, tiles
  // 2 step and 2 step + 1 of the linear order (asked for in increasing steps). With an odd tile
  // count the last step gives rank 1 a copy of rank 0's tile, which it computes (its peer needs its
  // half of the weight tile) but does not store.
  __device__ PairTile pair_tile(int step, int rank) {
    static_assert(!kKGrouped, "pairs: M-grouped tiles");
    const int first = 2 * step;
    const bool second = first + 1 < num_tiles();
    const TileInfo a = tile(first);
    const TileInfo b = second ? tile(first + 1) : a;
    return {rank == 0 ? a : b, rank == 0 || second, a.group == b.group && a.n0 == b.n0};
  }

  // Tile `ticket` of the heavy-first order (K-grouped).
  __device__ TileInfo tile_of_ticket(int ticket) const {
    const int per_group = p.m_tiles * p.n_tiles;
    const int j = ticket / per_group;
    return tile_in_group(t.order[j], ticket - j * per_group);
  }
};

// A launch's ticket counter pair {next ticket, CTAs done} (WeightGradArgs::tickets: the caller's
// device memory), zero between launches: the last CTA to finish puts both back to zero, so the
// launches ordered after it may use the pair again.
struct TicketCounter {
  unsigned* counters;

  __device__ int take() const { return static_cast<int>(atomicAdd(counters, 1u)); }

  // Once per CTA, after its last take() (also when the CTA gave up early): the last CTA of the
  // grid resets the pair for the next launch that uses it. NOTES: the fence orders this CTA's
  // last take before its done count, so when the count reaches gridDim.x no take of this launch
  // is still to come.
  __device__ void retire() const {
    __threadfence();
    if (atomicAdd(counters + 1, 1u) == gridDim.x - 1) {
      atomicExch(counters, 0u);
      atomicExch(counters + 1, 0u);
    }
  }
};

}  // namespace mok::gemm
