// The forward megakernel (fused_forward.hpp says what each CTA does and why it cannot deadlock).
#include "cuda/kernels/fused_forward.hpp"

#include <atomic>
#include <string>

#include "cuda/comm/team.cuh"
#include "cuda/gemm/config.hpp"
#include "cuda/gemm/engine.cuh"
#include "cuda/gemm/launch.hpp"
#include "cuda/kernels/transfer.cuh"
#include "cuda/ptx/fence.cuh"
#include "cuda/ptx/flags.cuh"
#include "mok/error.hpp"

namespace mok::cuda {
namespace {

using gemm::Form;
using gemm::FormKind;
using gemm::GemmEngine;
using gemm::Role;
using gemm::SchedulerTables;
using gemm::TileInfo;

using GateUpForm = Form<FormKind::kGateUp, false>;
using DownForm = Form<FormKind::kRowsWT, false>;
template <bool kClamped>
using GateUpEpilogue = gemm::epilogue::SwigluForward<true, kClamped>;
using DownEpilogue = gemm::epilogue::RowsBf16<false, true>;  // no scale, rows scattered home

constexpr int kWarps = gemm::kThreads / 32;
constexpr int kPullBatch = 8;  // loads in flight per lane of a pulling warp
// The named barrier of the two consumer warpgroups after a gate/up tile (engine ids: 1, 2, 3).
constexpr int kTileStoredBarrierId = 5;
static_assert(kTileStoredBarrierId > gemm::kWarpgroupBarrierId + 1, "named barrier ids collide");

// Zero unless a CTA is writing this device's GEMM wait report (GemmEngine::report_timeout).
__device__ unsigned g_fused_report_lock;

// The counters of one launch (plan::fused_counters).
struct Counters {
  std::uint32_t* ready;
  std::uint32_t* done;
  std::uint32_t* exit;
  int words_before_exit;
};

__device__ Counters counters_of(const FusedForwardParams& fp) {
  std::uint32_t* done = fp.counters + fp.ready_words;
  return {fp.counters, done, done + fp.done_words, fp.ready_words + fp.done_words};
}

// A tile of the pass and its M tile. NOTES: the tables hold M tiles (prepared with n_tiles 1), so
// both GEMMs, whose N tiles differ, walk them: tile j of a GEMM with n_tiles N is, in panels of
// kPanelM M tiles across the whole pass (N outer, M inner), M tile `mtile` and N tile `n`. Which
// CTA runs a tile, and when, never changes its bits.
struct PassTile {
  TileInfo tile;
  int mtile;
};

__device__ PassTile pass_tile(const SchedulerTables& t, int num_groups, int m_tiles, int n_tiles,
                              int k_blocks, int j) {
  const int panel = j / (gemm::kPanelM * n_tiles);
  const int rem = j - panel * gemm::kPanelM * n_tiles;
  const int panel_m = min(gemm::kPanelM, m_tiles - panel * gemm::kPanelM);
  const int mtile = panel * gemm::kPanelM + rem % panel_m;
  // The last group whose first M tile is at or before mtile (groups without rows share their
  // successor's prefix and come before it).
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.prefix[mid] <= mtile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  TileInfo info;
  info.group = lo;
  info.row_base = t.start[lo];
  info.row_count = t.count[lo];
  info.m0 = (mtile - t.prefix[lo]) * gemm::kTileM;
  info.n0 = rem / panel_m;
  info.k_blocks = k_blocks;
  return {info, mtile};
}

// The Producer thread: waits until *counter >= target, then orders the async proxy (its TMA
// loads) after what the counter's releasers wrote. False: the wait gave up (the rank's record says
// which counter, unless the CTA had already given up for another reason) and the CTA abandons.
template <class Engine>
__device__ bool wait_counter(const FusedForwardParams& fp, const Engine& engine,
                             const std::uint32_t* counter, std::uint32_t target,
                             comm::FlagId flag, int index) {
  std::uint32_t seen = 0;
  std::uint64_t waited = 0;
  if (ptx::wait_at_least<ptx::Scope::gpu>(
          counter, target, fp.timeout_ns, [&] { return engine.aborted(); }, seen, waited)) {
    ptx::fence_proxy_async_global();
    return true;
  }
  if (waited > fp.timeout_ns) {
    comm::report_flag_timeout(fp.record, fp.mirror, fp.rank, flag, index, target, seen, waited);
  }
  engine.abandon();
  return false;
}

// CTAs [0, C): the pass's rows, minibatch by minibatch; warp w of CTA c takes rows
// lo + c * kWarps + w, lo + C * kWarps + ..., of each minibatch [lo, hi).
__device__ void pull_rows(const FusedForwardParams& fp, const Counters& c) {
  const std::int64_t rows = transfer::rows_in_pass(fp.pull.pass);
  const std::int64_t vectors = fp.pull.geo.hidden / transfer::kBf16PerVector;
  const std::int64_t warps = std::int64_t{fp.comm_ctas} * kWarps;
  const std::int64_t me = std::int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int minibatches = static_cast<int>(c.done - c.ready);
  for (int m = 0; m < minibatches; ++m) {
    const std::int64_t lo = m * fp.minibatch_rows;
    const std::int64_t hi = min(lo + fp.minibatch_rows, rows);
    for (std::int64_t i = lo + me; i < hi; i += warps) {
      transfer::pull_row<kPullBatch>(fp.pull, i, lane, vectors);
    }
    // NOTES: the rows were generic-proxy stores and the gate/up Producers read them with TMA (the
    // async proxy): each writer fences the proxies, the CTA barrier gathers the writes at thread
    // 0, whose release reduction (cumulative) publishes them with the count.
    ptx::fence_proxy_async_global();
    __syncthreads();
    if (threadIdx.x == 0 && m != fp.withhold_minibatch) {
      ptx::red_release_add<ptx::Scope::gpu>(c.ready + m, 1u);
    }
  }
}

// CTAs [C, grid): the gate/up tiles, then the down tiles, in a static round robin over these CTAs.
template <bool kClamped>
__device__ void compute(const FusedForwardParams& fp, std::uint8_t* smem, SchedulerTables& tables,
                        const Counters& c) {
  GemmEngine<GateUpForm, GateUpEpilogue<kClamped>> up(smem, fp.gate_up);
  GemmEngine<DownForm, DownEpilogue> down(smem, fp.down);
  const int lane = up.lane();
  if (threadIdx.x == 0) {
    up.init();
    down.prefetch_maps();
  }
  if (threadIdx.x < 32) {
    gemm::SchedulerParams m_tiles_only = fp.gate_up.p.sched;
    m_tiles_only.n_tiles = 1;
    gemm::TileScheduler<false>::prepare(m_tiles_only, tables, lane);
  }
  __syncthreads();

  const int groups = fp.gate_up.p.sched.num_groups;
  const int m_tiles = tables.prefix[groups];
  const int n_up = fp.gate_up.p.sched.n_tiles, n_down = fp.down.p.sched.n_tiles;
  const int k_up = fp.gate_up.p.sched.k_blocks, k_down = fp.down.p.sched.k_blocks;
  const int tiles_up = m_tiles * n_up, tiles_down = m_tiles * n_down;
  const int first = static_cast<int>(blockIdx.x) - fp.comm_ctas;
  const int stride = static_cast<int>(gridDim.x) - fp.comm_ctas;
  const auto minibatch = [&](const TileInfo& t, int row) {
    return static_cast<int>((t.row_base + t.m0 + row) / fp.minibatch_rows);
  };

  if (up.role() == Role::kProducer) {
    up.become_producer();
    if (up.is_producer_thread()) {
      bool ok = true;
      for (int j = first; ok && j < tiles_up; j += stride) {
        const PassTile p = pass_tile(tables, groups, m_tiles, n_up, k_up, j);
        const int rows = min(gemm::kTileM, p.tile.row_count - p.tile.m0);
        // NOTES: a tile lies in one minibatch (both are whole 128-row tiles from 128-aligned
        // segments); the loop says what it needs without assuming so.
        for (int m = minibatch(p.tile, 0); ok && m <= minibatch(p.tile, rows - 1); ++m) {
          ok = wait_counter(fp, up, c.ready + m, static_cast<std::uint32_t>(fp.comm_ctas),
                            comm::FlagId::fused_ready, m);
        }
        ok = ok && up.produce(p.tile);
      }
      down.continue_from(up);
      for (int j = first; ok && j < tiles_down; j += stride) {
        const PassTile p = pass_tile(tables, groups, m_tiles, n_down, k_down, j);
        ok = wait_counter(fp, down, c.done + p.mtile, static_cast<std::uint32_t>(n_up),
                          comm::FlagId::fused_done, p.mtile) &&
             down.produce(p.tile);
      }
      down.finish_producing();
    }
  } else {
    up.become_consumer();
    for (int j = first; j < tiles_up; j += stride) {
      const PassTile p = pass_tile(tables, groups, m_tiles, n_up, k_up, j);
      up.consume(p.tile);
      // NOTES: the epilogue stored hidden with generic-proxy stores and the down Producers read
      // it with TMA: every consumer thread fences the proxies, the named barrier gathers the
      // stores at one thread, whose release reduction publishes them with the count.
      ptx::fence_proxy_async_global();
      ptx::named_barrier_sync(kTileStoredBarrierId, gemm::kConsumerThreads);
      if (threadIdx.x == 128) ptx::red_release_add<ptx::Scope::gpu>(c.done + p.mtile, 1u);
    }
    up.finish_consuming();
    down.continue_from(up);
    for (int j = first; j < tiles_down; j += stride) {
      down.consume(pass_tile(tables, groups, m_tiles, n_down, k_down, j).tile);
    }
    down.finish_consuming();
  }
  // Every role has left its loops; a CTA whose engine wait gave up says which one did.
  __syncwarp();
  __syncthreads();
  if (threadIdx.x == 0) down.report_timeout(&g_fused_report_lock);
}

template <bool kClamped>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardParams fp) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ SchedulerTables tables;
  __shared__ int last;
  const Counters c = counters_of(fp);
  if (static_cast<int>(blockIdx.x) < fp.comm_ctas) {
    pull_rows(fp, c);
  } else {
    compute<kClamped>(fp, smem_raw, tables, c);
  }
  // The last CTA to end zeroes the counters for the next launch (every wait of this one is over:
  // each CTA counts itself out only after its own).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(c.exit, 1u) == gridDim.x - 1 ? 1 : 0;
  }
  __syncthreads();
  if (last != 0) {
    for (int i = static_cast<int>(threadIdx.x); i < c.words_before_exit;
         i += static_cast<int>(blockDim.x)) {
      fp.counters[i] = 0u;
    }
    if (threadIdx.x == 0) *c.exit = 0u;
  }
#endif
}

// NOTES: the dynamic shared-memory limit is a per-device attribute of each instantiation.
template <bool kClamped>
void configure(int device) {
  static std::atomic<bool> configured[gemm::kMaxDevices] = {};
  const bool cached = device >= 0 && device < gemm::kMaxDevices;
  if (cached && configured[device].load(std::memory_order_acquire)) return;
  const cudaError_t e =
      cudaFuncSetAttribute(fused_forward_kernel<kClamped>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(gemm::kSharedBytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("forward megakernel attribute on device " + to_text(device),
                to_text(gemm::kSharedBytes) + " bytes of dynamic shared memory accepted",
                cudaGetErrorString(e));
  }
  if (cached) configured[device].store(true, std::memory_order_release);
}

template <bool kClamped>
void launch(const FusedForwardParams& p, cudaStream_t stream) {
  configure<kClamped>(gemm::current_device());
  const int grid = gemm::persistent_grid_size();
  if (p.comm_ctas < 1 || p.comm_ctas >= grid) {
    throw Error("forward megakernel: pulling CTAs", "in [1, " + to_text(grid - 1) + "]",
                to_text(p.comm_ctas));
  }
  if (p.minibatch_rows <= 0 || p.minibatch_rows % gemm::kTileM != 0) {
    throw Error("forward megakernel: minibatch rows", "a positive multiple of 128",
                to_text(p.minibatch_rows));
  }
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;  // every CTA resident: the waits between CTAs need it
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(gemm::kThreads);
  config.dynamicSmemBytes = gemm::kSharedBytes;
  config.stream = stream;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&config, fused_forward_kernel<kClamped>, p);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw Error(std::string("forward megakernel launch failed: ") + cudaGetErrorString(e));
  }
}

}  // namespace

void launch_fused_forward(const FusedForwardParams& p, bool clamped, cudaStream_t stream) {
  if (clamped) {
    launch<true>(p, stream);
  } else {
    launch<false>(p, stream);
  }
}

}  // namespace mok::cuda
