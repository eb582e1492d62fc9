// sm90_bf16_grouped_gemm: the persistent, warp-specialized grouped GEMM kernel and the launchers
// of its four forms (src/cuda/gemm/grouped_gemm.hpp).
//
//   Producer warpgroup : setmaxnreg down; one thread walks the tile sequence and issues TMA
//                        loads into the kStages ring (waits on `empty`, arms `full`).
//   Consumer0/1        : setmaxnreg up. Cooperative: each walks the same tiles, waits on `full`,
//                        issues wgmma on its 64 rows, releases the stage, then runs the epilogue
//                        while the producer already fills the ring for the next tile. Ping-pong:
//                        consumer w runs tiles w, w + 2, ... of the CTA's sequence whole (skipping
//                        the other's stages), the two K loops taking turns (mainloop.cuh), so one
//                        warpgroup's epilogue runs under the other's K loop.
//
// Tile sequences (scheduler.cuh): M-grouped forms walk the static linear order; the K-grouped
// form takes tickets from the caller's counter pair or in the static order, the Producer passing
// each ticket to the Consumers through the tile queue. Every wait is bounded: a CTA that gives up
// ends normally (mainloop.cuh) and leaves a report in mapped host memory (take_wait_timeout).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda/gemm/config.hpp"
#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/mainloop.cuh"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/gemm/tensor_map.hpp"
#include "cuda/ptx/fence.cuh"
#include "mok/error.hpp"

namespace mok::gemm {
namespace {

// Zero unless a CTA is writing this device's timeout report (mainloop.cuh, report_wait_timeout).
// One copy per device, as every __device__ variable.
__device__ unsigned g_wait_report_lock;

template <class F>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_bf16_grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                                  const __grid_constant__ CUtensorMap map_b,
                                  const __grid_constant__ CUtensorMap map_a2,
                                  const __grid_constant__ CUtensorMap map_b2,
                                  const __grid_constant__ CUtensorMap map_out,
                                  const KernelParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ SchedulerTables tables;
  const std::uint32_t raw = ptx::smem_addr(smem_raw);
  const SharedRing<F> ring{smem_raw + ((raw + 1023u) & ~1023u) - raw};

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    ring.init_barriers();
    ptx::fence_barrier_init();
    ptx::tma_prefetch_descriptor(&map_a);
    ptx::tma_prefetch_descriptor(&map_b);
    if constexpr (F::kind == FormKind::kGateUp) ptx::tma_prefetch_descriptor(&map_b2);
    if constexpr (F::kind == FormKind::kRowsW) {
      if (p.k_blocks_first > 0) {
        ptx::tma_prefetch_descriptor(&map_a2);
        ptx::tma_prefetch_descriptor(&map_b2);
      }
    }
  }
  if (threadIdx.x < 32) {
    TileScheduler<F::kKGrouped>::prepare(p.sched, tables, lane);
    if constexpr (F::kKGrouped) {
      auto& scratch = *reinterpret_cast<SchedulerScratch*>(ring.base);
      TileScheduler<F::kKGrouped>::order_heavy_first(p.sched, tables, scratch, lane);
      TileScheduler<F::kKGrouped>::choose_static_order(p.sched, tables, scratch, lane, gridDim.x,
                                                       static_cast<TileOrder>(p.tile_order));
      ptx::fence_proxy_async_shared();  // the ring's TMA loads overwrite the scratch
    }
  }
  __syncthreads();

  TileScheduler<F::kKGrouped> scheduler{p.sched, tables};
  const int num_tiles = scheduler.num_tiles();
  PipelineState<F::kStages> state;
  TileQueueState queue;

  if (warpgroup == 0) {
    // Producer.
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (warp == 0 && lane == 0) {
      const TensorMaps maps{&map_a, &map_b, &map_a2, &map_b2};
      ProducerLoads loads;
      loads.stall = static_cast<int>(blockIdx.x) == p.stall_block;
      if constexpr (F::kKGrouped) {
        // Static round robin over the heavy-first order when it balances (choose_static_order) or
        // when the launch has no counter, else the counter. Either way the Consumers get the tiles
        // through the queue.
        const bool fixed = tables.static_order != 0 || p.tickets == nullptr;
        const TicketCounter tickets{p.tickets};
        for (int next = blockIdx.x;; next += gridDim.x) {
          // NOTES: the ticket is drawn once a slot is free and the previous tile's loads are
          // issued, about kStages K blocks before this CTA can start it: late enough that a CTA
          // busy with a long tile leaves the next ones to others.
          if (!wait_barrier(ring, ring.tile_empty(queue.slot()), queue.phase() ^ 1u,
                            kBarrierTileEmpty, p)) {
            break;
          }
          const int drawn = fixed ? next : tickets.take();
          const int ticket = drawn < num_tiles ? drawn : kNoTile;
          if (!publish_ticket(ring.tile_slot(queue.slot()), queue.tag(), ticket)) break;
          ptx::mbarrier_arrive(ring.tile_full(queue.slot()));
          queue.advance();
          if (ticket == kNoTile) break;
          if (!load_tile<F>(maps, ring, state, scheduler.tile_of_ticket(ticket), p, loads)) break;
        }
        if (!fixed) tickets.retire();
      } else {
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
          if (!load_tile<F>(maps, ring, state, scheduler.tile(tile), p, loads)) break;
        }
      }
      drain_loads<F>(ring, state, loads, p);
    }
  } else {
    // Consumer0 / Consumer1.
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int wg = warpgroup - 1;
    const int consumer_thread = threadIdx.x - 128;
    const int reader_thread = F::kPingPong ? consumer_thread % 128 : consumer_thread;
    // Ping-pong: this warpgroup's k-th tile (the CTA's tile 2k + wg) waits for the phase of its
    // turn barrier that the other warpgroup's previous tile completes; warpgroup 0's first tile
    // waits for parity 1 of a fresh barrier, which passes at once.
    unsigned own_tiles = 0;
    auto run_tile = [&](const TileInfo& tile) {
      float acc[F::kAcc];
      init_accumulators<F>(acc, tile, p, wg, warp, lane);
      const std::uint32_t turn_parity = (own_tiles & 1u) ^ (wg == 0 ? 1u : 0u);
      mma_tile<F>(acc, ring, state, tile, p, wg, lane, reader_thread, turn_parity);
      ++own_tiles;
      store_tile<F>(acc, tile, p, wg, warp, lane, ring.staging(), &map_out);
    };
    if constexpr (F::kKGrouped) {
      for (unsigned i = 0;; ++i) {
        const int ticket = take_queued_ticket(
            ring.tile_full(queue.slot()), queue.phase(), ring.tile_slot(queue.slot()),
            ring.tile_empty(queue.slot()), lane, queue.tag(), ring.abort(), p.wait_timeout_ns);
        queue.advance();
        if (ticket == kNoTile) break;
        const TileInfo tile = scheduler.tile_of_ticket(ticket);
        if (F::kPingPong && (i & 1u) != static_cast<unsigned>(wg)) {
          state.advance(tile.k_blocks);  // the other warpgroup's tile
          continue;
        }
        run_tile(tile);
      }
    } else {
      // NOTES: after an abort the remaining tiles still run (their waits give up at once, their
      // outputs are void): the static order is the one thing all consumer warps agree on.
      unsigned i = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++i) {
        if (F::kPingPong && (i & 1u) != static_cast<unsigned>(wg)) {
          state.advance(p.sched.k_blocks);  // the other warpgroup's tile
          continue;
        }
        run_tile(scheduler.tile(tile));
      }
    }
    // TMA-store epilogue: the CTA's shared memory must outlive its last bulk stores.
    if constexpr (F::kTmaStore) {
      if (warp == 0 && lane == 0) ptx::tma_store_wait<0>();
    }
  }
  // Every role has left its loops; a CTA that gave up says which wait first did.
  __syncwarp();
  __syncthreads();
  if (threadIdx.x == 0 && ring.abort()->aborted != 0) {
    report_wait_timeout(*ring.abort(), p.timeout_report, &g_wait_report_lock, p.wait_timeout_ns);
  }
#endif
}

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

void check(bool ok, const std::string& argument, const std::string& expected,
           const std::string& actual) {
  if (!ok) throw Error(argument, expected, actual);
}

void check_aligned(const void* ptr, const char* name) {
  check(reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0, name, "16-byte alignment", to_text(ptr));
}

void check_multiple_of_64(int v, const char* name) {
  check(v > 0 && v % 64 == 0, name, "a positive multiple of 64", to_text(v));
}

void check_segments(const RowSegments& s) {
  check(s.num_groups >= 1 && s.num_groups <= kMaxGroups, "segments.num_groups",
        "in [1, " + to_text(kMaxGroups) + "]", to_text(s.num_groups));
  check(s.capacity_rows >= 0, "segments.capacity_rows", ">= 0", to_text(s.capacity_rows));
  check((s.starts == nullptr) == (s.rows == nullptr), "segments.starts/rows",
        "both device pointers or both null (dense)", "one of them null");
  if (s.starts == nullptr) {
    check(s.num_groups == 1, "segments.num_groups", "1 for the dense form", to_text(s.num_groups));
    check(s.dense_rows >= 0 && s.dense_rows <= s.capacity_rows, "segments.dense_rows",
          "in [0, capacity_rows]", to_text(s.dense_rows));
  }
}

// Output checks of the M-grouped plain forms: `out`, or a row scatter in its place.
void set_output(KernelParams& p, __nv_bfloat16* out, long long ld_out, int n,
                const RowScatter& scatter) {
  check(ld_out % 8 == 0 && ld_out >= n, "ld_out", "a multiple of 8 and >= n", to_text(ld_out));
  if (scatter.rows == nullptr) {
    check(out != nullptr, "out", "a device pointer", "null");
    check_aligned(out, "out");
  } else {
    check(scatter.peers != nullptr, "scatter.peers", "a device array of destinations", "null");
    check(scatter.slots > 0 && scatter.slots <= 0x7fffffff, "scatter.slots", "in [1, 2^31)",
          to_text(scatter.slots));
    check(ld_out % 8 == 0, "ld_out", "a multiple of 8 (16-byte rows at every slot)",
          to_text(ld_out));
  }
  p.out = out;
  p.ld_out = ld_out;
  p.scatter_rows = scatter.rows;
  p.scatter_slots = static_cast<unsigned>(scatter.slots);
  p.scatter_peers = scatter.peers;
}

SchedulerParams scheduler_params(const RowSegments& s, int m_tiles, int n_tiles, int k_blocks) {
  return SchedulerParams{s.starts,     s.rows,  s.num_groups, s.capacity_rows,
                         s.dense_rows, m_tiles, n_tiles,      k_blocks};
}

// Devices whose launcher state is cached (kernel attributes, timeout reports); a device past them
// still runs, setting its kernel attribute at every launch and without a timeout report.
constexpr int kMaxDevices = 64;

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("grouped GEMM: cannot query the current CUDA device");
  }
  return device;
}

// NOTES: the dynamic shared-memory limit is an attribute of the kernel in each device's context,
// so it is set once per device and instantiation (once per process left every device but the
// first with the default 48 KiB limit, and its launches failing).
template <class F>
void configure_kernel(int device) {
  static std::atomic<bool> configured[kMaxDevices] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && configured[device].load(std::memory_order_acquire)) return;
  const cudaError_t e = cudaFuncSetAttribute(sm90_bf16_grouped_gemm_kernel<F>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kSharedBytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("grouped GEMM kernel attribute on device " + to_text(device),
                to_text(kSharedBytes) + " bytes of dynamic shared memory accepted",
                cudaGetErrorString(e));
  }
  if (cached) configured[device].store(true, std::memory_order_release);
}

// One CTA per SM of the current device (a persistent grid).
template <class F>
void launch(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& a2,
            const CUtensorMap& b2, const KernelParams& p, cudaStream_t stream,
            const CUtensorMap* out = nullptr) {
  configure_kernel<F>(current_device());
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSharedBytes;
  config.stream = stream;
  config.gridDim = dim3(persistent_grid_size());
  cudaError_t e = cudaLaunchKernelEx(&config, sm90_bf16_grouped_gemm_kernel<F>, a, b, a2, b2,
                                     out != nullptr ? *out : a, p);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw Error(std::string("grouped GEMM launch failed: ") + cudaGetErrorString(e));
  }
}

// Mapped pinned host memory for one WaitTimeoutReport per device, allocated on first use (retried
// until it succeeds) and never freed: one per process. Portable, so it is mapped in every device's
// context; with unified addressing (every sm_90 system) the host pointer is the device pointer.
std::mutex g_reports_mutex;
std::atomic<WaitTimeoutReport*> g_reports{nullptr};

WaitTimeoutReport* timeout_reports() {
  if (WaitTimeoutReport* r = g_reports.load(std::memory_order_acquire)) return r;
  const std::lock_guard<std::mutex> lock(g_reports_mutex);
  if (WaitTimeoutReport* r = g_reports.load(std::memory_order_acquire)) return r;
  void* h = nullptr;
  if (cudaHostAlloc(&h, kMaxDevices * sizeof(WaitTimeoutReport),
                    cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  std::memset(h, 0, kMaxDevices * sizeof(WaitTimeoutReport));
  auto* r = static_cast<WaitTimeoutReport*>(h);
  g_reports.store(r, std::memory_order_release);
  return r;
}

KernelParams base_params(const RowSegments& s, const WaitOptions& waits) {
  check(waits.timeout_ns > 0, "waits.timeout_ns", "> 0 nanoseconds", to_text(waits.timeout_ns));
  check(waits.stall_block >= -1, "waits.stall_block", "-1 (off) or a block index",
        to_text(waits.stall_block));
  KernelParams p{};
  p.sched = scheduler_params(s, 0, 0, 0);
  p.wait_timeout_ns = waits.timeout_ns;
  p.stall_block = waits.stall_block;
  const int device = current_device();
  WaitTimeoutReport* reports = device < kMaxDevices ? timeout_reports() : nullptr;
  p.timeout_report = reports != nullptr ? reports + device : nullptr;
  return p;
}

// The reports of every device that has one, as text; `take` clears them.
std::string wait_timeouts(bool take) {
  const char* const names[] = {"full", "empty", "tile queue full", "tile queue empty",
                               "ping-pong turn"};
  WaitTimeoutReport* reports = g_reports.load(std::memory_order_acquire);
  if (reports == nullptr) return {};
  const std::lock_guard<std::mutex> lock(g_reports_mutex);
  std::string text;
  for (int d = 0; d < kMaxDevices; ++d) {
    volatile WaitTimeoutReport* r = reports + d;
    if (r->timed_out == 0) continue;
    const int id = r->barrier_id;
    if (!text.empty()) text += "; ";
    text += "grouped GEMM gave up on device " + to_text(d) + ": barrier " +
            (id >= 0 && id < 5 ? names[id] : "?") + " (shared offset " + to_text(r->smem_address) +
            ", parity " + to_text(r->parity) + ") waited past " +
            to_text(r->timeout_ns / 1000000ull) + " ms in block " + to_text(r->block) +
            ", thread " + to_text(r->thread);
    if (take) r->timed_out = 0;
  }
  return text;
}

}  // namespace

std::string take_wait_timeout() {
  return wait_timeouts(true);
}

std::string last_wait_timeout() {
  return wait_timeouts(false);
}

int persistent_grid_size() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    throw Error("cannot query the multiprocessor count of the current device");
  }
  return sms;
}

namespace {

// A diagnostic override from the environment: `variable` unset, empty or "automatic" gives
// Enum::automatic, else the choice named (`names[i]` for Enum value i + 1); anything else throws.
template <class Enum, std::size_t kChoices>
Enum choice_from_environment(const char* variable, const char* const (&names)[kChoices]) {
  const char* v = std::getenv(variable);
  if (v == nullptr || *v == '\0' || std::string(v) == "automatic") return Enum::automatic;
  std::string expected = "automatic";
  for (std::size_t i = 0; i < kChoices; ++i) {
    if (std::string(v) == names[i]) return static_cast<Enum>(i + 1);
    expected += std::string(i + 1 < kChoices ? ", " : " or ") + names[i];
  }
  throw Error(variable, expected, v);
}

// NOTES: MOK_GEMM_CONSUMERS=cooperative|ping_pong replaces the automatic choice in every launch
// that leaves `consumers` automatic (a diagnostic for layer-level A/B runs). Read once.
Consumers default_consumers() {
  static_assert(static_cast<int>(Consumers::ping_pong) == 2, "names in enum order");
  static const Consumers consumers =
      choice_from_environment<Consumers>("MOK_GEMM_CONSUMERS", {"cooperative", "ping_pong"});
  return consumers;
}

// Runs body(Form<kKind, ping-pong?>{}) for the schedule `requested` resolves to.
template <FormKind kKind, class Body>
void with_form(Consumers requested, Body&& body) {
  Consumers c = requested == Consumers::automatic ? default_consumers() : requested;
  if (c == Consumers::automatic) {
    c = kPingPongByDefault[static_cast<int>(kKind)] ? Consumers::ping_pong : Consumers::cooperative;
  }
  if (c == Consumers::ping_pong) {
    body(Form<kKind, true>{});
  } else {
    body(Form<kKind, false>{});
  }
}

template <class F>
void gate_up_forward_form(const GateUpForwardArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.hidden_size, "hidden_size");
  check_multiple_of_64(args.intermediate_size, "intermediate_size");
  check((args.gate == nullptr) == (args.up == nullptr), "gate/up outputs", "both or neither",
        "one of them null");
  check(args.hidden != nullptr, "hidden", "a device pointer", "null");
  check_aligned(args.hidden, "hidden");
  check_aligned(args.gate, "gate");
  check_aligned(args.up, "up");
  check(args.ld_out % 8 == 0 && args.ld_out >= args.intermediate_size, "ld_out",
        "a multiple of 8 and >= intermediate_size", to_text(args.ld_out));
  const RowSegments& s = args.segments;
  if (s.capacity_rows == 0) return;
  const long long w_rows = static_cast<long long>(s.num_groups) * args.intermediate_size;
  const CUtensorMap a =
      make_tensor_map_bf16(args.x, s.capacity_rows, args.hidden_size, args.ld_x, F::kBoxRowsA, "x");
  const CUtensorMap bg = make_tensor_map_bf16(args.w_gate, w_rows, args.hidden_size,
                                              args.hidden_size, F::kBoxRowsB, "w_gate");
  const CUtensorMap bu = make_tensor_map_bf16(args.w_up, w_rows, args.hidden_size, args.hidden_size,
                                              F::kBoxRowsB, "w_up");
  KernelParams p = base_params(s, args.waits);
  p.sched.n_tiles = ceil_div(args.intermediate_size, F::kOutTileN);
  p.sched.k_blocks = args.hidden_size / kTileK;
  p.n = args.intermediate_size;
  p.b_rows_per_group = args.intermediate_size;
  p.out = args.hidden;
  p.ld_out = args.ld_out;
  p.gate_out = args.gate;
  p.up_out = args.up;
  launch<F>(a, bg, a, bu, p, args.stream);
}

template <class F>
void rows_times_weight_t_form(const RowsTimesWeightTArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.n, "n");
  check_multiple_of_64(args.k, "k");
  const RowSegments& s = args.segments;
  if (s.capacity_rows == 0) return;
  const CUtensorMap a =
      make_tensor_map_bf16(args.a, s.capacity_rows, args.k, args.ld_a, F::kBoxRowsA, "a");
  const CUtensorMap b = make_tensor_map_bf16(args.w, static_cast<long long>(s.num_groups) * args.n,
                                             args.k, args.k, F::kBoxRowsB, "w");
  KernelParams p = base_params(s, args.waits);
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.sched.k_blocks = args.k / kTileK;
  p.n = args.n;
  p.b_rows_per_group = args.n;
  set_output(p, args.out, args.ld_out, args.n, args.scatter);
  p.row_scale = args.row_scale;
  launch<F>(a, b, a, b, p, args.stream);
}

template <class F>
void rows_times_weight_form(const RowsTimesWeightArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.n, "n");
  check_multiple_of_64(args.k, "k");
  const RowSegments& s = args.segments;
  const SwigluBackwardEpilogue& sw = args.swiglu;
  const bool swiglu = sw.d_gate != nullptr;
  check(swiglu == (sw.gate != nullptr) && swiglu == (sw.up != nullptr) &&
            swiglu == (sw.d_up != nullptr),
        "swiglu", "all four of gate, up, d_gate, d_up device pointers, or all null",
        "some of them null");
  const bool dual = args.a2 != nullptr;
  check(dual == (args.w2 != nullptr), "a2/w2", "both device pointers or both null",
        "one of them null");
  if (!swiglu) {
    check(sw.row_scale == nullptr, "swiglu.row_scale",
          "null without the SwiGLU epilogue (gate, up, d_gate, d_up)", to_text(sw.row_scale));
    check(sw.dot == nullptr, "swiglu.dot",
          "null without the SwiGLU epilogue (gate, up, d_gate, d_up)", to_text(sw.dot));
  }
  if (s.capacity_rows == 0) return;
  const CUtensorMap a =
      make_tensor_map_bf16(args.a, s.capacity_rows, args.k, args.ld_a, F::kBoxRowsA, "a");
  const CUtensorMap b = make_tensor_map_bf16(args.w, static_cast<long long>(s.num_groups) * args.k,
                                             args.n, args.n, F::kBoxRowsB, "w");
  KernelParams p = base_params(s, args.waits);
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.sched.k_blocks = (dual ? 2 : 1) * (args.k / kTileK);
  p.k_blocks_first = dual ? args.k / kTileK : 0;
  p.n = args.n;
  p.b_rows_per_group = args.k;
  if (swiglu) {
    check(args.scatter.rows == nullptr, "swiglu", "no row scatter with it", "scatter.rows set");
    check(!args.out_fp32, "out_fp32", "false with the SwiGLU epilogue (dg and du are bf16)",
          "true");
    check(args.ld_out % 8 == 0 && args.ld_out >= args.n, "ld_out", "a multiple of 8 and >= n",
          to_text(args.ld_out));
    check_aligned(sw.gate, "swiglu.gate");
    check_aligned(sw.up, "swiglu.up");
    check_aligned(sw.d_gate, "swiglu.d_gate");
    check_aligned(sw.d_up, "swiglu.d_up");
    check(reinterpret_cast<std::uintptr_t>(sw.row_scale) % 4 == 0, "swiglu.row_scale",
          "4-byte alignment", to_text(sw.row_scale));
    check(reinterpret_cast<std::uintptr_t>(sw.dot) % 4 == 0, "swiglu.dot", "4-byte alignment",
          to_text(sw.dot));
    p.ld_out = args.ld_out;
    p.swiglu_gate = sw.gate;
    p.swiglu_up = sw.up;
    p.d_gate = sw.d_gate;
    p.d_up = sw.d_up;
    p.row_scale = sw.row_scale;
    p.swiglu_dot = sw.dot;
  } else if (args.out_fp32) {
    check(args.scatter.rows == nullptr, "scatter.rows",
          "null with out_fp32 (a scatter stores bf16)", "set");
    check(args.out != nullptr, "out", "a device pointer", "null");
    check_aligned(args.out, "out");
    check(args.ld_out % 8 == 0 && args.ld_out >= args.n, "ld_out", "a multiple of 8 and >= n",
          to_text(args.ld_out));
    p.out = args.out;
    p.ld_out = args.ld_out;
    p.out_fp32 = 1;
  } else {
    set_output(p, static_cast<__nv_bfloat16*>(args.out), args.ld_out, args.n, args.scatter);
  }
  if (!dual) {
    launch<F>(a, b, a, b, p, args.stream);
    return;
  }
  const CUtensorMap a2 =
      make_tensor_map_bf16(args.a2, s.capacity_rows, args.k, args.ld_a2, F::kBoxRowsA, "a2");
  const CUtensorMap b2 = make_tensor_map_bf16(
      args.w2, static_cast<long long>(s.num_groups) * args.k, args.n, args.n, F::kBoxRowsB, "w2");
  launch<F>(a, b, a2, b2, p, args.stream);
}

// NOTES: MOK_GEMM_WGRAD_ORDER=fixed|tickets replaces the automatic choice in every launch that
// leaves `order` automatic (a diagnostic: the layer's A/B of docs/perf/NOTES.md v4). Read once.
TileOrder default_wgrad_order() {
  static_assert(static_cast<int>(TileOrder::tickets) == 2, "names in enum order");
  static const TileOrder order =
      choice_from_environment<TileOrder>("MOK_GEMM_WGRAD_ORDER", {"fixed", "tickets"});
  return order;
}

template <class F>
void weight_grad_form(const WeightGradArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.m, "m");
  check_multiple_of_64(args.n, "n");
  check(args.out != nullptr, "out", "a device pointer", "null");
  check_aligned(args.out, "out");
  check(args.ld_out % 8 == 0 && args.ld_out >= args.n, "ld_out", "a multiple of 8 and >= n",
        to_text(args.ld_out));
  const RowSegments& s = args.segments;
  // NOTES: with no rows the outputs are still written (zeros); the maps then cover one row that
  // is never read.
  const int rows = s.capacity_rows > 0 ? s.capacity_rows : 1;
  const CUtensorMap a = make_tensor_map_bf16(args.a, rows, args.m, args.ld_a, F::kBoxRowsA, "a");
  const CUtensorMap b = make_tensor_map_bf16(args.b, rows, args.n, args.ld_b, F::kBoxRowsB, "b");
  KernelParams p = base_params(s, args.waits);
  p.sched.m_tiles = ceil_div(args.m, kTileM);
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.m = args.m;
  p.n = args.n;
  p.out = args.out;
  p.ld_out = args.ld_out;
  p.out_group_stride = static_cast<long long>(args.m) * args.ld_out;
  p.out_fp32 = args.out_fp32 ? 1 : 0;
  check(!args.accumulate || args.out_fp32, "accumulate", "an fp32 output (out_fp32)",
        "a bf16 output");
  const PassPlan& plan = args.passes;
  if (plan.steps == nullptr) {
    check(!args.continue_reduction || args.out_fp32, "continue_reduction",
          "an fp32 output (out_fp32), or a pass plan (passes.steps)", "a bf16 output");
    check(!(args.accumulate && args.continue_reduction), "accumulate/continue_reduction",
          "at most one of them without a pass plan", "both");
  } else {
    // NOTES: the plan's slots are [m, n] fp32 matrices with ld n; plain launches write them
    // (kOpen), continued ones read and write them.
    check(plan.slots >= 0, "passes.slots", ">= 0", to_text(plan.slots));
    check(plan.slots == 0 || plan.carry != nullptr, "passes.carry",
          "a device pointer to passes.slots fp32 [m, n] matrices", "null");
    check_aligned(plan.carry, "passes.carry");
    p.sched.steps = plan.steps;
    p.sched.first_step = args.continue_reduction ? kCarry : kWhole;
    p.sched.slots = plan.slots;
    p.carry = plan.carry;
  }
  p.accumulate = args.accumulate ? 1 : 0;
  // NOTES: the counter pair is the caller's (WeightGradArgs::tickets), so no two launches share
  // one unless the caller says so: launches in flight at once each have their own.
  const TileOrder order = args.order == TileOrder::automatic ? default_wgrad_order() : args.order;
  if (args.tickets == nullptr) {
    check(args.order != TileOrder::tickets, "WeightGradArgs.tickets",
          "2 zeroed words of device memory (order = TileOrder::tickets draws tiles from them)",
          "null");
    check(order != TileOrder::tickets, "MOK_GEMM_WGRAD_ORDER",
          "fixed or automatic for a launch without WeightGradArgs.tickets", "tickets");
  }
  check(reinterpret_cast<std::uintptr_t>(args.tickets) % 4 == 0, "WeightGradArgs.tickets",
        "4-byte alignment", to_text(args.tickets));
  p.tickets = args.tickets;
  p.tile_order = static_cast<int>(args.tickets == nullptr ? TileOrder::fixed : order);
  if constexpr (F::kTmaStore) {
    if (!args.out_fp32) {
      // NOTES: 64 x 64 boxes (epilogue.cuh, store_tile_tma); groups are m rows apart.
      const CUtensorMap out = make_tensor_map_bf16(
          args.out, static_cast<long long>(s.num_groups) * args.m, args.n, args.ld_out, 64, "out");
      launch<F>(a, b, a, b, p, args.stream, &out);
      return;
    }
  }
  launch<F>(a, b, a, b, p, args.stream);
}

}  // namespace

void gate_up_forward(const GateUpForwardArgs& args) {
  with_form<FormKind::kGateUp>(args.consumers,
                               [&](auto f) { gate_up_forward_form<decltype(f)>(args); });
}

void rows_times_weight_t(const RowsTimesWeightTArgs& args) {
  with_form<FormKind::kRowsWT>(args.consumers,
                               [&](auto f) { rows_times_weight_t_form<decltype(f)>(args); });
}

void rows_times_weight(const RowsTimesWeightArgs& args) {
  with_form<FormKind::kRowsW>(args.consumers,
                              [&](auto f) { rows_times_weight_form<decltype(f)>(args); });
}

void weight_grad(const WeightGradArgs& args) {
  if (args.continue_reduction) {
    with_form<FormKind::kWeightGradContinued>(args.consumers,
                                              [&](auto f) { weight_grad_form<decltype(f)>(args); });
  } else {
    with_form<FormKind::kWeightGrad>(args.consumers,
                                     [&](auto f) { weight_grad_form<decltype(f)>(args); });
  }
}

}  // namespace mok::gemm
