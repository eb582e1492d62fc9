// The forward megakernel (fused_forward.hpp: the tasks, their ticket order, why it cannot
// deadlock).
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
using gemm::kNoTile;
using gemm::kTileM;
using gemm::Role;
using gemm::SchedulerTables;
using gemm::TileInfo;

using GateUpForm = Form<FormKind::kGateUp, false>;
using DownForm = Form<FormKind::kRowsWT, false>;
template <bool kClamped>
using GateUpEngine = GemmEngine<GateUpForm, gemm::epilogue::SwigluForward<true, kClamped>>;
// No row scale; rows scattered into their home slots (the combine).
using DownEngine = GemmEngine<DownForm, gemm::epilogue::RowsBf16<false, true>>;

constexpr int kConsumerWarps = gemm::kConsumerThreads / 32;
constexpr int kPullBatch = 8;  // loads in flight per lane of a pulling warp
// The named barrier of the two Consumer warpgroups after a task whose stores another CTA's TMA
// reads (engine ids: 1, 2, 3).
constexpr int kStoredBarrierId = 5;
static_assert(kStoredBarrierId > gemm::kWarpgroupBarrierId + 1, "named barrier ids collide");

// Zero unless a CTA is writing this device's GEMM wait report (GemmEngine::report_timeout).
__device__ unsigned g_fused_report_lock;

// The launch's tickets: its blocks and minibatches (every thread computes the same from the
// pass's row count, which the schedule left in device memory).
struct TicketPlan {
  int blocks;          // B: 128-row blocks holding the pass's rows
  int per_minibatch;   // blocks per minibatch
  int minibatches;
  int n_up, n_down;    // tiles per block of the two GEMMs
  // Blocks of the first x minibatches.
  __device__ int first_blocks(int x) const {
    return x <= 0 ? 0 : min(x * per_minibatch, blocks);
  }
  __device__ int blocks_of(int minibatch) const {
    return first_blocks(minibatch + 1) - first_blocks(minibatch);
  }
  // Tickets before stage s: the pulls of minibatches < s, the gate/up tiles of those < s - 1,
  // the down tiles of those < s - 2.
  __device__ int before_stage(int s) const {
    return first_blocks(s) + n_up * first_blocks(s - 1) + n_down * first_blocks(s - 2);
  }
  __device__ int tickets() const { return before_stage(minibatches + 2); }
};

enum class TaskKind { pull, gate_up, down };
struct Task {
  TaskKind kind;
  int block;
  int n;  // N tile (GEMM tasks)
};

__device__ Task decode(const TicketPlan& p, int ticket) {
  // The stage: the last s with before_stage(s) <= ticket (no stage of a non-empty pass is empty).
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
  const int pulls = p.blocks_of(lo);
  if (o < pulls) return {TaskKind::pull, p.first_blocks(lo) + o, 0};
  o -= pulls;
  const int up_blocks = p.blocks_of(lo - 1);
  if (o < up_blocks * p.n_up) {
    return {TaskKind::gate_up, p.first_blocks(lo - 1) + o % up_blocks, o / up_blocks};
  }
  o -= up_blocks * p.n_up;
  const int down_blocks = p.blocks_of(lo - 2);
  return {TaskKind::down, p.first_blocks(lo - 2) + o % down_blocks, o / down_blocks};
}

// The GEMM tile of block b, N tile n: the group holding ring row 128 b (the last whose start is at
// or before it). False: no group's rows are there (the tile is empty: nothing to load or store).
__device__ bool block_tile(const SchedulerTables& t, int groups, int b, int n, int k_blocks,
                           TileInfo& tile) {
  const int row = b * kTileM;
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.start[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  tile.group = lo;
  tile.row_base = t.start[lo];
  tile.row_count = t.count[lo];
  tile.m0 = row - t.start[lo];
  tile.n0 = n;
  tile.k_blocks = k_blocks;
  return tile.m0 >= 0 && tile.m0 < tile.row_count;
}

// Where the counters are (plan::fused_counter_words).
struct Counters {
  std::uint32_t* ready;
  std::uint32_t* done;
  std::uint32_t* tickets;
  std::uint32_t* exit;
};

// The Producer thread: waits until *counter >= target, then orders its async proxy (the TMA
// loads it issues next) after what the counter's releasers wrote. False: the wait gave up (the
// rank's record says which counter, unless the CTA had given up already) and the CTA abandons.
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

// Every Consumer thread, after a task whose global stores another CTA's TMA reads: the stores
// are published with one release increment of `counter`. NOTES: each thread fences its own
// generic-proxy stores against the async proxy, the named barrier gathers them at one thread,
// whose release reduction (cumulative) publishes them.
__device__ void publish_stored(std::uint32_t* counter) {
  ptx::fence_proxy_async_global();
  ptx::named_barrier_sync(kStoredBarrierId, gemm::kConsumerThreads);
  if (threadIdx.x == 128) ptx::red_release_add<ptx::Scope::gpu>(counter, 1u);
}

// Consumer warps: the rows of block b (ring rows [128 b, 128 b + 128) within the pass's rows),
// warp w taking rows 128 b + w, 128 b + w + 8, ...
__device__ void pull_block(const FusedForwardParams& fp, std::int64_t rows, int b) {
  const std::int64_t vectors = fp.pull.geo.hidden / transfer::kBf16PerVector;
  const int warp = static_cast<int>(threadIdx.x - 128) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t end = min(std::int64_t{b + 1} * kTileM, rows);
  for (std::int64_t i = std::int64_t{b} * kTileM + warp; i < end; i += kConsumerWarps) {
    transfer::pull_row<kPullBatch>(fp.pull, i, lane, vectors);
  }
}

template <bool kClamped>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardParams fp) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ SchedulerTables tables;
  __shared__ int last;
  const Counters c{fp.counters, fp.counters + fp.blocks, fp.counters + 2 * fp.blocks,
                   fp.counters + 2 * fp.blocks + 1};
  GateUpEngine<kClamped> up(smem_raw, fp.gate_up);
  DownEngine down(smem_raw, fp.down);
  if (threadIdx.x == 0) {
    up.init();
    down.prefetch_maps();
  }
  if (threadIdx.x < 32) {
    // The groups' starts and row counts (n_tiles 1: the prefix counts M tiles, unused here).
    gemm::SchedulerParams rows_only = fp.gate_up.p.sched;
    rows_only.n_tiles = 1;
    gemm::TileScheduler<false>::prepare(rows_only, tables, up.lane());
  }
  __syncthreads();

  const std::int64_t rows = transfer::rows_in_pass(fp.pull.pass);
  TicketPlan plan;
  plan.blocks = static_cast<int>((rows + kTileM - 1) / kTileM);
  plan.per_minibatch = static_cast<int>(fp.minibatch_rows / kTileM);
  plan.minibatches = (plan.blocks + plan.per_minibatch - 1) / plan.per_minibatch;
  plan.n_up = fp.gate_up.p.sched.n_tiles;
  plan.n_down = fp.down.p.sched.n_tiles;
  const int tickets = plan.tickets();
  const int groups = fp.gate_up.p.sched.num_groups;
  const int k_up = fp.gate_up.p.sched.k_blocks, k_down = fp.down.p.sched.k_blocks;

  if (up.role() == Role::kProducer) {
    up.become_producer();
    if (up.is_producer_thread()) {
      // NOTES: the two engines share one ring and one tile queue; the one that ran the last
      // task holds their state, and the other continues from it when the task kind changes.
      bool on_down = false, ok = true;
      while (ok) {
        ok = on_down ? down.reserve_ticket_slot() : up.reserve_ticket_slot();
        if (!ok) break;
        const int drawn = static_cast<int>(atomicAdd(c.tickets, 1u));
        const int ticket = drawn < tickets ? drawn : kNoTile;
        ok = on_down ? down.publish_ticket(ticket) : up.publish_ticket(ticket);
        if (!ok || ticket == kNoTile) break;
        const Task task = decode(plan, ticket);
        if (task.kind == TaskKind::pull) continue;  // the Consumers' warps copy the rows
        TileInfo tile;
        if (task.kind == TaskKind::gate_up) {
          if (on_down) up.continue_from(down), on_down = false;
          if (!block_tile(tables, groups, task.block, task.n, k_up, tile)) continue;
          ok = wait_counter(fp, up, c.ready + task.block, 1u, comm::FlagId::fused_ready,
                            task.block) &&
               up.produce(tile);
        } else {
          if (!on_down) down.continue_from(up), on_down = true;
          if (!block_tile(tables, groups, task.block, task.n, k_down, tile)) continue;
          ok = wait_counter(fp, down, c.done + task.block, static_cast<std::uint32_t>(plan.n_up),
                            comm::FlagId::fused_done, task.block) &&
               down.produce(tile);
        }
      }
      if (on_down) {
        down.finish_producing();
      } else {
        up.finish_producing();
      }
    }
  } else {
    up.become_consumer();
    bool on_down = false;
    for (;;) {
      const int ticket = on_down ? down.take_ticket() : up.take_ticket();
      if (ticket == kNoTile) break;
      const Task task = decode(plan, ticket);
      TileInfo tile;
      if (task.kind == TaskKind::pull) {
        if (task.block != fp.withhold_block) {
          pull_block(fp, rows, task.block);
          publish_stored(c.ready + task.block);
        }
      } else if (task.kind == TaskKind::gate_up) {
        if (on_down) up.continue_from(down), on_down = false;
        if (block_tile(tables, groups, task.block, task.n, k_up, tile)) up.consume(tile);
        publish_stored(c.done + task.block);
      } else {
        if (!on_down) down.continue_from(up), on_down = true;
        if (block_tile(tables, groups, task.block, task.n, k_down, tile)) down.consume(tile);
      }
    }
    // Neither form stores through TMA: nothing in flight to wait for (finish_consuming).
  }
  // Every role has left its loops; a CTA whose engine wait gave up says which one did.
  __syncwarp();
  __syncthreads();
  if (threadIdx.x == 0) up.report_timeout(&g_fused_report_lock);

  // The last CTA to end zeroes the counters for the next launch (every wait of this one is over:
  // each CTA counts itself out only after its own).
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(c.exit, 1u) == gridDim.x - 1 ? 1 : 0;
  }
  __syncthreads();
  if (last != 0) {
    for (int i = static_cast<int>(threadIdx.x); i < 2 * fp.blocks + 1;
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
  if (p.minibatch_rows <= 0 || p.minibatch_rows % kTileM != 0) {
    throw Error("forward megakernel: minibatch rows", "a positive multiple of 128",
                to_text(p.minibatch_rows));
  }
  if (p.blocks < 1 || p.counters == nullptr) {
    throw Error("forward megakernel: counters", "at least one block's (2 * blocks + 2 words)",
                to_text(p.blocks) + " blocks at " + to_text(p.counters));
  }
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;  // every CTA resident: the waits between CTAs need it
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(gemm::persistent_grid_size()));
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
