// The forward megakernel's kernel template (fused_forward.hpp: the tasks, their ticket order, why
// it cannot deadlock). The library instantiates it without test hooks (fused_forward.cu);
// tests/cpp instantiates the hooked kernel from here.
#pragma once

#include <atomic>
#include <string>

#include "cuda/comm/team.cuh"
#include "cuda/gemm/config.hpp"
#include "cuda/gemm/engine.cuh"
#include "cuda/gemm/launch.hpp"
#include "cuda/kernels/fused_forward.hpp"
#include "cuda/kernels/fused_tasks.hpp"
#include "cuda/kernels/transfer.cuh"
#include "cuda/ptx/fence.cuh"
#include "cuda/ptx/flags.cuh"
#include "mok/error.hpp"

namespace mok::cuda {

// The library's kernel: no trace stamps, no withheld block.
struct FusedNoHooks {
  static constexpr bool kTrace = false;
  static constexpr bool kWithhold = false;
};

namespace {

using fused::decode;
using fused::Task;
using fused::TaskKind;
using fused::TicketPlan;
using gemm::Form;
using gemm::FormKind;
using gemm::GemmEngine;
using gemm::kNoTile;
using gemm::kTileM;
using gemm::Role;
using gemm::SchedulerTables;
using gemm::TileInfo;

using GateUpForm = Form<FormKind::kGateUp>;
using DownForm = Form<FormKind::kRowsWT>;
template <bool kClamped>
using GateUpEngine = GemmEngine<GateUpForm, gemm::epilogue::SwigluForward<true, kClamped>>;
// No row scale; rows scattered into their home slots (the combine).
using DownEngine = GemmEngine<DownForm, gemm::epilogue::RowsBf16<false, true>>;
// The shared expert's down projection: plain rows (its output, which the home reduction adds).
using SharedDownEngine = GemmEngine<DownForm, gemm::epilogue::RowsBf16<false, false>>;

static_assert(GateUpForm::kStages == DownForm::kStages &&
                  GateUpForm::kStageBytes == DownForm::kStageBytes &&
                  GateUpForm::kStagingBytes == DownForm::kStagingBytes,
              "the forms of one launch share the ring's geometry");
// What a CTA's engines carry from task to task: one ring and one tile queue between them.
using SharedState = gemm::EngineState<GateUpForm::kStages>;
static_assert(fused::kPanelBlocks == gemm::kPanelM, "the launches' raster, tile for tile");

// Runs body(engine) on an engine of type Engine over `d` that resumes the CTA's state and leaves
// its own behind. NOTES: one state for every engine (not an engine object per GEMM, each with its
// own copy, all live across the task loop): the Producer runs within 40 registers.
template <class Engine, class Body>
__device__ __forceinline__ auto with_engine(std::uint8_t* smem, const gemm::GemmDescriptor& d,
                                            SharedState& state, Body&& body) {
  Engine e(smem, d);
  e.resume(state);
  auto result = body(e);
  state = e.state();
  return result;
}

constexpr int kPullGroupRows = 8;  // rows a pulling warp takes at a time
// The Producer draws its next ticket this many K blocks before the current tile's last load (a
// counter's round trip is ~1-2 us under load; a K block takes ~0.8 us of MMA).
constexpr int kDrawLead = 6;
// Blocks whose group the launch tables in the ring's spare bytes (BlockGroups::of_block).
constexpr int kTabledBlocks = static_cast<int>(GateUpEngine<false>::kSpareBytes / 2);
static_assert(GateUpEngine<false>::kSpareBytes == DownEngine::kSpareBytes &&
                  GateUpEngine<true>::kSpareBytes == DownEngine::kSpareBytes,
              "one ring geometry: the same spare bytes in every form of the launch");
static_assert(kTabledBlocks >= 1024, "room for a useful table");
static_assert(gemm::kMaxGroups <= 65536, "a group index is a table's u16");
constexpr int kPullBatch = 4;  // loads in flight per lane of a pulling warp
// NOTES: the GEMM's budgets, 40 and 232. At 48 for the Producer (fewer spills in the pull loop)
// the Consumers' setmaxnreg.inc to 232 never succeeded and the launch hung (H200, 4559ca9): the
// registers a warpgroup frees go to the CTA's own pool, which holds what the CTA got at entry,
// 384 x 168 = 128 x 40 + 256 x 232 exactly (gemm::kEntryRegisters).
constexpr int kProducerRegisters = gemm::kProducerRegisters;
constexpr int kConsumerRegisters = gemm::kConsumerRegisters;
static_assert(gemm::kProducerThreads * kProducerRegisters +
                      gemm::kConsumerThreads * kConsumerRegisters <=
                  gemm::kThreads * gemm::kEntryRegisters,
              "register budgets exceed the CTA's registers");
// The named barrier of the two Consumer warpgroups after a task whose stores another CTA's TMA
// reads (engine ids: 1, 2, 3).
constexpr int kStoredBarrierId = 5;
static_assert(kStoredBarrierId > gemm::kWarpgroupBarrierId + 1, "named barrier ids collide");

// The shared expert's tile of block b (rows [128 b, 128 b + 128) of its T), N tile n.
__device__ TileInfo shared_tile(const FusedForwardParams& fp, int b, int n, int k_blocks) {
  TileInfo tile;
  tile.group = 0;
  tile.row_base = 0;
  tile.row_count = fp.gate_up_shared.p.sched.dense_rows;
  tile.m0 = b * kTileM;
  tile.n0 = n;
  tile.k_blocks = k_blocks;
  return tile;
}

// The GEMM tile of block b, N tile n: the group holding ring row 128 b (the last whose start is at
// or before it: BlockGroups). False: no group's rows are there (the tile is empty: nothing to load
// or store).
__device__ bool block_tile(const SchedulerTables& t, const fused::BlockGroups& groups, int b, int n,
                           int k_blocks, TileInfo& tile) {
  const int g = groups.group_of(b);
  tile.group = g;
  tile.row_base = t.start[g];
  tile.row_count = t.count[g];
  tile.m0 = b * kTileM - t.start[g];
  tile.n0 = n;
  tile.k_blocks = k_blocks;
  return tile.m0 >= 0 && tile.m0 < tile.row_count;
}

// Where the counters are (plan::FusedCounterLayout, which also sizes their allocation).
struct Counters {
  std::uint32_t* ready;        // [blocks]
  std::uint32_t* done;         // [blocks]
  std::uint32_t* shared_done;  // [shared_words]
  std::uint32_t* tickets;      // then the pull counter, then the exit count
  std::uint32_t* exit;
  __device__ static plan::FusedCounterLayout layout(const FusedForwardParams& fp) {
    return {fp.blocks, fp.shared_words};
  }
  __device__ static Counters of(const FusedForwardParams& fp) {
    const plan::FusedCounterLayout l = layout(fp);
    std::uint32_t* const c = fp.counters;
    return {c + l.ready(), c + l.done(), c + l.shared_done(), c + l.tickets(), c + l.exit()};
  }
  // The pull counter. NOTES: the pulling warps take only it and `ready`; building every pointer
  // there raised the kernel's spill stores from 48 to 56 bytes (ptxas, 2026-12-03).
  __device__ static std::uint32_t* pulls(const FusedForwardParams& fp) {
    return fp.counters + layout(fp).pulls();
  }
  __device__ static int zeroed_words(const FusedForwardParams& fp) {
    return static_cast<int>(layout(fp).zeroed_words());
  }
};

// The Producer thread: waits until *counter >= target, then orders its async proxy (the TMA
// loads it issues next) after what the counter's releasers wrote. False: the wait gave up (the
// rank's record says which counter, unless the CTA had given up already) and the CTA abandons.
// NOTES: a wait on done or shared_done (downstream: its gate/up tiles wait for pulls) is bounded
// by twice the timeout, so when a pull stalls the report names ready[b], the cause, and not the
// down tile that waited for it too (both waits start within a few tiles of each other).
template <class Engine>
__device__ bool wait_counter(const FusedForwardParams& fp, const Engine& engine,
                             const std::uint32_t* counter, std::uint32_t target, comm::FlagId flag,
                             int index) {
  const std::uint64_t timeout =
      flag == comm::FlagId::fused_ready ? fp.timeout_ns : 2 * fp.timeout_ns;
  std::uint32_t seen = 0;
  std::uint64_t waited = 0;
  if (ptx::wait_at_least<ptx::Scope::gpu>(
          counter, target, timeout, [&] { return engine.aborted(); }, seen, waited)) {
    ptx::fence_proxy_async_global();
    return true;
  }
  if (waited > timeout) {
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
  if (threadIdx.x == gemm::kFirstConsumer) ptx::red_release_add<ptx::Scope::gpu>(counter, 1u);
}

// Warps 1-3 of the Producer warpgroup (idle in a GEMM: one thread of warp 0 issues the loads):
// the pass's rows, kPullGroupRows at a time, groups drawn from a counter in row order, each group
// published with one release increment of its block's ready count. They wait for nothing, so they
// run beside the CTA's GEMM tiles from the start of the launch to the last group. NOTES: it
// derives its counters from the parameters itself, so that less of the task loop's state stays
// live in the Producer warpgroup's registers.
template <class Hooks>
__device__ __forceinline__ void pull_rows(const FusedForwardParams& fp) {
  std::uint32_t* const ready = fp.counters;
  std::uint32_t* const pulls = Counters::pulls(fp);
  const int rows = static_cast<int>(transfer::rows_in_pass(fp.pull.pass));
  const int vectors = static_cast<int>(fp.pull.geo.hidden / transfer::kBf16PerVector);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int groups = (rows + kPullGroupRows - 1) / kPullGroupRows;
  for (;;) {
    unsigned drawn = 0;
    if (lane == 0) drawn = atomicAdd(pulls, 1u);
    const int g = static_cast<int>(__shfl_sync(0xffffffffu, drawn, 0));
    if (g >= groups) break;
    const int block = g * kPullGroupRows / kTileM;
    if (Hooks::kWithhold && block == fp.withhold_block) continue;
    const int end = min((g + 1) * kPullGroupRows, rows);
#pragma unroll 1
    for (int i = g * kPullGroupRows; i < end; ++i) {
      transfer::pull_row<kPullBatch>(fp.pull, i, lane, vectors);
    }
    // NOTES: the rows were generic-proxy stores and the gate/up Producers read them with TMA: each
    // lane fences the proxies, the warp converges, and lane 0's release reduction (cumulative
    // over what the warp's lanes wrote before the __syncwarp) publishes them.
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (lane == 0) ptx::red_release_add<ptx::Scope::gpu>(ready + block, 1u);
  }
  if (Hooks::kTrace && fp.trace != nullptr && lane == 0) {
    atomicMax(reinterpret_cast<unsigned long long*>(fp.trace + 4 + 4 * blockIdx.x + 1),
              static_cast<unsigned long long>(ptx::global_timer_ns()));
  }
}

// The trace's words of `ticket` (fused_forward.hpp), or null: not traced.
template <class Hooks>
__device__ __forceinline__ std::uint64_t* traced(const FusedForwardParams& fp, int ticket) {
  if (!Hooks::kTrace || ticket >= fp.trace_tickets) return nullptr;
  return fp.trace + 4 + 4 * std::int64_t{gridDim.x} + kTraceTicketWords * std::int64_t{ticket};
}

// What the K loop of a traced tile stamps (the first consumer thread's words 4 and 5; mma_tile's
// probe).
struct TraceProbe {
  std::uint64_t* stamps;  // null: not traced, or not thread gemm::kFirstConsumer
  __device__ __forceinline__ void landed() const {
    if (stamps != nullptr) stamps[4] = ptx::global_timer_ns();
  }
  __device__ __forceinline__ void multiplied() const {
    if (stamps != nullptr) stamps[5] = ptx::global_timer_ns();
  }
};

// Row groups of block b: its ready count once every one is pulled.
__device__ std::uint32_t groups_of_block(std::int64_t rows, int b) {
  const std::int64_t in_block = min(std::int64_t{kTileM}, rows - std::int64_t{b} * kTileM);
  return static_cast<std::uint32_t>((in_block + kPullGroupRows - 1) / kPullGroupRows);
}

// What a GEMM task waits for before its loads: counter >= target (null: nothing).
struct Dependency {
  const std::uint32_t* counter;
  std::uint32_t target;
  comm::FlagId flag;
};

// The tiles of a launch's tasks (every role of every CTA resolves a ticket the same way).
struct TaskTiles {
  const FusedForwardParams& fp;
  const SchedulerTables& tables;
  const fused::BlockGroups& groups;

  // The task's tile; false when its block holds no rows (nothing to load or store).
  __device__ bool of(const Task& task, TileInfo& tile) const {
    switch (task.kind) {
      case TaskKind::gate_up:
        return block_tile(tables, groups, task.block, task.n, fp.gate_up.p.sched.k_blocks, tile);
      case TaskKind::down:
        return block_tile(tables, groups, task.block, task.n, fp.down.p.sched.k_blocks, tile);
      case TaskKind::shared_gate_up:
        tile = shared_tile(fp, task.block, task.n, fp.gate_up_shared.p.sched.k_blocks);
        return true;
      case TaskKind::shared_down:
        tile = shared_tile(fp, task.block, task.n, fp.down_shared.p.sched.k_blocks);
        return true;
    }
    return false;
  }

  __device__ Dependency dependency(const Task& task, const Counters& c, std::int64_t rows) const {
    const int b = task.block;
    switch (task.kind) {
      case TaskKind::gate_up:
        return {c.ready + b, groups_of_block(rows, b), comm::FlagId::fused_ready};
      case TaskKind::down:
        return {c.done + b, static_cast<std::uint32_t>(fp.gate_up.p.sched.n_tiles),
                comm::FlagId::fused_done};
      case TaskKind::shared_down:
        return {c.shared_done + b, static_cast<std::uint32_t>(fp.gate_up_shared.p.sched.n_tiles),
                comm::FlagId::fused_shared_done};
      default:
        return {nullptr, 0, comm::FlagId::none};
    }
  }
};

// body(engine) on the engine of `kind` over its descriptor (with_engine).
template <bool kClamped, class Body>
__device__ __forceinline__ auto with_task_engine(std::uint8_t* smem, const FusedForwardParams& fp,
                                                 SharedState& state, TaskKind kind, Body&& body) {
  using Up = GateUpEngine<kClamped>;
  switch (kind) {
    case TaskKind::gate_up:
      return with_engine<Up>(smem, fp.gate_up, state, body);
    case TaskKind::down:
      return with_engine<DownEngine>(smem, fp.down, state, body);
    case TaskKind::shared_gate_up:
      return with_engine<Up>(smem, fp.gate_up_shared, state, body);
    default:
      return with_engine<SharedDownEngine>(smem, fp.down_shared, state, body);
  }
}

// The Producer's reading of a ticket it hands over, for the Consumers: they take it from shared
// memory instead of decoding the ticket again between two tiles, where every nanosecond is one
// the tensor cores wait (docs/perf/NOTES.md, 2026-12-03). kRecords = twice the tile queue's depth:
// the Producer writes the record of its j-th ticket once position j - depth is free, i.e. once
// every Consumer warp has taken ticket j - depth, and so has read the record of ticket j - 2 depth,
// which this one overwrites.
struct TaskRecord {
  Task task;
  TileInfo tile;
  int has_tile;  // tiles.of: a tile with rows (something to load and store)
};
constexpr int kRecords = 2 * gemm::kTileQueueDepth;

// Hooks: FusedNoHooks in the library; tests/cpp's hooked instantiation adds the trace's stamps
// (fused_forward.hpp) and the withheld block, so the library's kernel has none of their code.
template <bool kClamped, class Hooks>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardParams fp) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ SchedulerTables tables;
  __shared__ TaskRecord records[kRecords];
  __shared__ int last;
  const Counters c = Counters::of(fp);
  using Up = GateUpEngine<kClamped>;
  SharedState state;
  Up up(smem_raw, fp.gate_up);  // the tile queue's and the give-up state's engine
  if (threadIdx.x == 0) {
    up.init();
    DownEngine(smem_raw, fp.down).prefetch_maps();
    if (fp.shared_blocks > 0) {
      Up(smem_raw, fp.gate_up_shared).prefetch_maps();
      SharedDownEngine(smem_raw, fp.down_shared).prefetch_maps();
    }
  }
  if (threadIdx.x < 32) {
    // The groups' starts and row counts (n_tiles 1: the prefix counts M tiles, unused here).
    gemm::SchedulerParams rows_only = fp.gate_up.p.sched;
    rows_only.n_tiles = 1;
    gemm::TileScheduler<false>::prepare(rows_only, tables, up.lane());
  }
  __syncthreads();
  // The hooked kernel traces only when given a trace (FusedForwardParams::trace).
  const bool tracing = Hooks::kTrace && fp.trace != nullptr;
  if (tracing && threadIdx.x == 0) fp.trace[4 + 4 * blockIdx.x] = ptx::global_timer_ns();

  const std::int64_t rows = transfer::rows_in_pass(fp.pull.pass);
  TicketPlan plan;
  plan.blocks = static_cast<int>((rows + kTileM - 1) / kTileM);
  // Every block's group, once, in the ring's spare bytes (the Producer's decode reads it instead
  // of searching the groups' starts twice a ticket: docs/perf/NOTES.md, 2026-12-04); blocks past
  // its room are searched.
  std::uint16_t* const group_table = reinterpret_cast<std::uint16_t*>(up.spare());
  const int num_groups = fp.gate_up.p.sched.num_groups;
  const int tabled = min(plan.blocks, kTabledBlocks);
  const fused::BlockGroups searched{tables.start, num_groups};
  for (int q = static_cast<int>(threadIdx.x); q < tabled; q += static_cast<int>(blockDim.x)) {
    group_table[q] = static_cast<std::uint16_t>(searched.search(q));
  }
  __syncthreads();
  const fused::BlockGroups groups{tables.start, num_groups, group_table, tabled};
  plan.per_minibatch = static_cast<int>(fp.minibatch_rows / kTileM);
  plan.minibatches = (plan.blocks + plan.per_minibatch - 1) / plan.per_minibatch;
  plan.n_up = fp.gate_up.p.sched.n_tiles;
  plan.n_down = fp.down.p.sched.n_tiles;
  plan.shared_up = fp.shared_blocks * fp.gate_up_shared.p.sched.n_tiles;
  plan.shared_down = fp.shared_blocks * fp.down_shared.p.sched.n_tiles;
  const int tickets = plan.tickets();
  const TaskTiles tiles{fp, tables, groups};
  if (tracing && blockIdx.x == 0 && threadIdx.x == 0) {
    fp.trace[0] = static_cast<std::uint64_t>(tickets);
    fp.trace[1] = gridDim.x;
    fp.trace[2] = static_cast<std::uint64_t>(plan.blocks);
  }

  if (up.role() == Role::kProducer) {
    up.template become_producer<kProducerRegisters>();
    state = up.state();
    if (threadIdx.x >= 32) {
      pull_rows<Hooks>(fp);
    } else if (up.is_producer_thread()) {
      bool ok = true;
      unsigned handed = 0;  // tickets handed over (records written)
      int ahead = -1;       // a ticket drawn during the previous tile's loads, or -1
      while (ok) {
        const std::uint64_t free_at = tracing ? ptx::global_timer_ns() : 0;
        up.resume(state);
        if (!up.reserve_ticket_slot()) break;
        const int drawn =
            ahead >= 0 ? ahead : static_cast<int>(ptx::atom_inc_relaxed_gpu(c.tickets));
        ahead = -1;
        const int ticket = drawn < tickets ? drawn : kNoTile;
        Task task{};
        TileInfo tile{};
        bool has_tile = false;
        if (ticket != kNoTile) {
          task = decode(plan, fp.shared_blocks, ticket, groups);
          has_tile = tiles.of(task, tile);
          TaskRecord& r = records[handed++ % kRecords];
          r.task = task;
          r.tile = tile;
          r.has_tile = has_tile ? 1 : 0;
        }
        // (publish_ticket's mbarrier arrival releases the record to the Consumers' wait.)
        if (!up.publish_ticket(ticket)) break;
        state = up.state();
        if (ticket == kNoTile) break;
        std::uint64_t* const stamps = traced<Hooks>(fp, ticket);
        if (stamps != nullptr) {
          stamps[0] = free_at;
          stamps[1] = ptx::global_timer_ns();
        }
        if (!has_tile) continue;  // no rows there: nothing to load
        const Dependency dep = tiles.dependency(task, c, rows);
        ok = with_task_engine<kClamped>(smem_raw, fp, state, task.kind, [&](auto& e) {
          const bool met = dep.counter == nullptr ||
                           wait_counter(fp, e, dep.counter, dep.target, dep.flag, task.block);
          if (stamps != nullptr) stamps[2] = ptx::global_timer_ns();
          // The next ticket is drawn kDrawLead K blocks before this tile's last load, so that its
          // round trip is over when the Producer turns to it (docs/perf/NOTES.md, 2026-12-04).
          const int draw_at = max(0, tile.k_blocks - kDrawLead);
          return met && e.produce(tile, [&](int kb) {
            if (kb == draw_at) ahead = static_cast<int>(ptx::atom_inc_relaxed_gpu(c.tickets));
          });
        });
      }
      up.resume(state);
      up.finish_producing();  // the ring's loads, whichever engine issued them
    }
  } else {
    up.template become_consumer<kConsumerRegisters>();
    state = up.state();
    unsigned taken = 0;  // tickets taken (records read)
    for (;;) {
      up.resume(state);
      const int ticket = up.take_ticket();
      state = up.state();
      if (ticket == kNoTile) break;
      const TaskRecord& record = records[taken++ % kRecords];
      const Task task = record.task;
      std::uint64_t* const stamps =
          threadIdx.x == gemm::kFirstConsumer ? traced<Hooks>(fp, ticket) : nullptr;
      if (stamps != nullptr) stamps[3] = ptx::global_timer_ns();
      if (record.has_tile != 0) {
        const TileInfo tile = record.tile;
        with_task_engine<kClamped>(smem_raw, fp, state, task.kind, [&](auto& e) {
          if constexpr (Hooks::kTrace) {
            e.consume(tile, TraceProbe{stamps});
          } else {
            e.consume(tile);
          }
          return 0;
        });
      }
      // A gate/up tile (even an empty one) counts towards its down tiles' dependency.
      if (task.kind == TaskKind::gate_up) publish_stored(c.done + task.block);
      if (task.kind == TaskKind::shared_gate_up) publish_stored(c.shared_done + task.block);
      if (stamps != nullptr) {
        stamps[6] = ptx::global_timer_ns();
        stamps[7] = blockIdx.x | static_cast<std::uint64_t>(task.kind) << 16 |
                    static_cast<std::uint64_t>(task.block) << 32;
      }
    }
    // No form here stores through TMA: nothing in flight to wait for (finish_consuming).
  }
  // Every role has left its loops; a CTA whose engine wait gave up says which one did (the give-up
  // state is the ring's, which every engine shares).
  __syncwarp();
  __syncthreads();
  if (threadIdx.x == 0) up.report_timeout();
  if (tracing && threadIdx.x == 0) {
    fp.trace[4 + 4 * blockIdx.x + 2] = ptx::global_timer_ns();
  }

  // The last CTA to end zeroes the counters for the next launch (every wait of this one is over:
  // each CTA counts itself out only after its own).
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(c.exit, 1u) == gridDim.x - 1 ? 1 : 0;
  }
  __syncthreads();
  if (last != 0) {
    const int words = Counters::zeroed_words(fp);
    for (int i = static_cast<int>(threadIdx.x); i < words; i += static_cast<int>(blockDim.x)) {
      fp.counters[i] = 0u;
    }
    if (threadIdx.x == 0) *c.exit = 0u;
  }
#endif
}

// NOTES: the dynamic shared-memory limit is a per-device attribute of each instantiation.
template <bool kClamped, class Hooks>
void configure_fused_forward(int device) {
  static std::atomic<bool> configured[gemm::kMaxDevices] = {};
  const bool cached = device >= 0 && device < gemm::kMaxDevices;
  if (cached && configured[device].load(std::memory_order_acquire)) return;
  const cudaError_t e = cudaFuncSetAttribute(fused_forward_kernel<kClamped, Hooks>,
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

template <bool kClamped, class Hooks>
void launch_fused_forward_kernel(const FusedForwardParams& p, cudaStream_t stream) {
  configure_fused_forward<kClamped, Hooks>(gemm::current_device());
  if (p.minibatch_rows <= 0 || p.minibatch_rows % kTileM != 0) {
    throw Error("forward megakernel: minibatch rows", "a positive multiple of 128",
                to_text(p.minibatch_rows));
  }
  if (p.blocks < 1 || p.counters == nullptr) {
    throw Error("forward megakernel: counters",
                "at least one block's (plan::FusedCounterLayout's words)",
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
  cudaError_t e = cudaLaunchKernelEx(&config, fused_forward_kernel<kClamped, Hooks>, p);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw Error(std::string("forward megakernel launch failed: ") + cudaGetErrorString(e));
  }
}

}  // namespace

}  // namespace mok::cuda
