// Persistent tile scheduler over groups whose sizes live in device memory.
//
// Every CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ... of one linear order: group-major;
// within a group, panels of kPanelM M tiles; within a panel, N tile outer and M tile inner. So the
// CTAs running at one time cover about kPanelM x (grid / kPanelM) tiles of one group and share
// both their A rows and their weight columns in L2 (with N fastest, a wide N, e.g. mixtral's
// I = 14336, re-streamed the whole weight from HBM once per M tile).
// M-grouped forms: group g has ceil(rows_g / kTileM) x n_tiles tiles, each with a fixed K loop.
// K-grouped form (wgrad): every group has m_tiles x n_tiles tiles; the K loop covers rows_g.
#pragma once

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
};

struct TileInfo {
  int group;
  int row_base;   // first row of the group in the row buffers
  int row_count;  // rows of the group (clamped to its segment and the buffer)
  int m0;         // M-grouped: first row within the group; K-grouped: first output row
  int n0;         // N tile index (times the form's output tile width: first output column)
  int k_blocks;
};

// Shared-memory tables, filled once per CTA by one warp.
struct SchedulerTables {
  int start[kMaxGroups];
  int count[kMaxGroups];
  int prefix[kMaxGroups + 1];  // exclusive prefix of tiles per group
};

template <bool kKGrouped>
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
        t.start[g] = start;
        t.count[g] = count;
        tiles = kKGrouped ? p.m_tiles * p.n_tiles : (count + kTileM - 1) / kTileM * p.n_tiles;
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

  __device__ int num_tiles() const {
    return t.prefix[p.num_groups];
  }

  // Tiles must be asked for in increasing order (the cursor only moves forward).
  __device__ TileInfo tile(int index) {
    while (t.prefix[cursor + 1] <= index) ++cursor;
    const int local = index - t.prefix[cursor];
    TileInfo info;
    info.group = cursor;
    info.row_base = t.start[cursor];
    info.row_count = t.count[cursor];
    const int m_tiles = kKGrouped ? p.m_tiles : (info.row_count + kTileM - 1) / kTileM;
    const int panel = local / (kPanelM * p.n_tiles);
    const int rem = local - panel * kPanelM * p.n_tiles;
    const int panel_m = min(kPanelM, m_tiles - panel * kPanelM);
    info.m0 = (panel * kPanelM + rem % panel_m) * kTileM;
    info.n0 = rem / panel_m;
    info.k_blocks = kKGrouped ? (info.row_count + kTileK - 1) / kTileK : p.k_blocks;
    return info;
  }
};

}  // namespace mok::gemm
