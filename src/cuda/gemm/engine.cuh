// The GEMM engine: one CTA's machinery for running tile tasks of one form F with epilogue policy E
// (epilogue.cuh), whichever loop picks the tiles. It owns the shared-memory ring, its mbarriers,
// the tile queue between the roles, the pipeline state and the CTA's give-up state; the caller
// owns the order of the tiles (a persistent tile loop, kernels/sm90_grouped_gemm.cuh, or the
// forward megakernel's task loop, kernels/fused_forward.cuh) and gives every role the same
// sequence of tiles.
//
//   Producer  (warpgroup 0, one elected thread): produce(tile) issues the TMA loads of every K
//             block of the tile into the next stages of the ring; finish_producing() before
//             leaving.
//   Consumer0/1 (warpgroups 1, 2, all their threads): consume(tile) runs the tile's K loop with
//             wgmma and then the epilogue E; both consume every tile (64 rows each).
//             finish_consuming() before leaving.
//   Tile queue: when only the Producer knows the next tile (tickets drawn from a counter), it
//             hands the tile's ticket to the Consumers: reserve_ticket_slot() then
//             publish_ticket(t) on the Producer, take_ticket() on every consumer thread.
//
// Every wait is bounded (descriptor's wait_timeout_ns); a CTA that gives up ends normally and
// report_timeout() (one thread, after a CTA barrier that follows every role's loop) leaves the
// report in mapped host memory (mainloop.cuh's header says how each role gives up).
//
// The engine is a value each thread holds; the members a role does not use cost it nothing (every
// method is inlined). The descriptor must live in parameter space (__grid_constant__): the TMA
// instructions take its maps' addresses.
#pragma once

#include <cstdint>

#include "cuda/gemm/config.hpp"
#include "cuda/gemm/descriptor.cuh"
#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/forms.cuh"
#include "cuda/gemm/mainloop.cuh"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/ptx/fence.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace mok::gemm {

// What an engine carries from tile to tile (GemmEngine::state / resume).
template <int kStages>
struct EngineState {
  PipelineState<kStages> pipeline;
  TileQueueState queue;
  ProducerLoads loads;
};

// The warp roles of an engine CTA (kThreads threads: three warpgroups).
enum class Role { kProducer, kConsumer0, kConsumer1 };

// kStallHook: the test hook of become_producer (tests/cpp's stall kernels; the library's kernels
// are built without it, so their code has none of it).
template <class F, class E, bool kStallHook = false>
class GemmEngine {
 public:
  using Form = F;
  using Epilogue = E;

  // Every thread: the engine over `smem` (the dynamic shared memory, kSharedBytes) and `d` (in
  // parameter space); e4m3 forms: and their scales `fp8` (in parameter space too).
  __device__ __forceinline__ GemmEngine(std::uint8_t* smem, const GemmDescriptor& d,
                                        const Fp8Params* fp8 = nullptr)
      : ring_{aligned(smem)},
        d_(d),
        fp8_(fp8),
        warpgroup_(static_cast<int>(threadIdx.x) / kWarpgroupThreads),
        warp_((static_cast<int>(threadIdx.x) / 32) % 4),
        lane_(static_cast<int>(threadIdx.x) % 32) {}

  __device__ __forceinline__ Role role() const {
    return warpgroup_ == 0   ? Role::kProducer
           : warpgroup_ == 1 ? Role::kConsumer0
                             : Role::kConsumer1;
  }
  __device__ __forceinline__ bool is_producer_thread() const {
    return warpgroup_ == 0 && warp_ == 0 && lane_ == 0;
  }
  __device__ __forceinline__ int lane() const { return lane_; }

  // One thread, before the CTA barrier that precedes every other use: the barriers, the tile
  // queue, the give-up state; prefetches the descriptor's tensor maps.
  __device__ __forceinline__ void init() const {
    ring_.init_barriers();
    ptx::fence_barrier_init();
    prefetch_maps();
  }

  // One thread: prefetches the descriptor's tensor maps (init does it; an engine that shares
  // another's ring, resume, has its own maps to prefetch).
  __device__ __forceinline__ void prefetch_maps() const {
    ptx::tma_prefetch_descriptor(&d_.a);
    ptx::tma_prefetch_descriptor(&d_.b);
    if constexpr (F::kind == FormKind::kGateUp) ptx::tma_prefetch_descriptor(&d_.b2);
    if constexpr (F::kInputGradient) {
      if (d_.p.k_blocks_first > 0) {
        ptx::tma_prefetch_descriptor(&d_.a2);
        ptx::tma_prefetch_descriptor(&d_.b2);
      }
    }
  }

  // The engine's state across tiles (stage, phase, tile queue position, the Producer's loads),
  // for a loop that runs several engines over one ring and one tile queue (a megakernel's tasks,
  // kernels/fused_forward.cuh): each task's engine resumes where the previous task's left off, with
  // no barrier re-initialised. Forms that share a ring must share its geometry (the caller
  // asserts it).
  __device__ __forceinline__ EngineState<F::kStages> state() const {
    return {state_, queue_, loads_};
  }
  __device__ __forceinline__ void resume(const EngineState<F::kStages>& s) {
    state_ = s.pipeline;
    queue_ = s.queue;
    loads_ = s.loads;
  }

  // Whether the CTA has given up (any role's wait, or abandon()).
  __device__ __forceinline__ bool aborted() const {
    return *static_cast<volatile int*>(&ring_.abort()->aborted) != 0;
  }
  // The CTA gives up for a reason outside the engine (a megakernel's flag wait that the kernel
  // reports itself): every engine wait from now on gives up at once, and report_timeout says
  // nothing of it.
  __device__ __forceinline__ void abandon() const {
    atomicCAS(&ring_.abort()->aborted, 0, kAbandoned);
  }

  // Set-up scratch (scheduler.cuh, SchedulerScratch): the ring's memory, free until the first
  // load. NOTES: its writers fence the async proxy before the CTA barrier that precedes the first
  // TMA load, which overwrites it.
  __device__ __forceinline__ void* setup_scratch() const { return ring_.base; }

  // Warpgroup 0, all its threads: the Producer's register budget (a kernel whose Producer
  // warpgroup does more than issue loads may ask for more, within the register file).
  // `stall_block` (kStallHook only): the CTA with this index never loads its first K block.
  template <int kRegisters = kProducerRegisters>
  __device__ __forceinline__ void become_producer(int stall_block = -1) {
    ptx::setmaxnreg_dec<kRegisters>();
    if constexpr (kStallHook) loads_.stall = static_cast<int>(blockIdx.x) == stall_block;
  }

  // Producer: the loads of every K block of `tile`, hook(kb) before each (NoLoadHook: nothing).
  // False when the CTA gives up (then it issues no more loads and goes to finish_producing).
  // Pairs (F::kCluster 2): `pair` says whether the cluster's two tiles share their weight tile.
  template <class Hook = NoLoadHook>
  __device__ __forceinline__ bool produce(const TileInfo& tile, Hook&& hook = Hook{},
                                          const PairLoad& pair = PairLoad{}) {
    const TensorMaps maps{&d_.a, &d_.b, &d_.a2, &d_.b2};
    return load_tile<F, kStallHook>(maps, ring_, state_, tile, d_.p, fp8_, loads_, hook, pair);
  }

  // The ring's bytes that no stage and no staging tile of this form uses (kSpareBytes from
  // spare()): a kernel's own shared scratch, free from the start.
  static constexpr std::uint32_t kSpareBytes =
      kRingBytes - F::kStages * F::kStageBytes - F::kStagingBytes;
  __device__ __forceinline__ std::uint8_t* spare() const {
    return ring_.base + F::kStages * F::kStageBytes + F::kStagingBytes;
  }

  // Producer, tile queue: waits for the next queue position to be free. False when the CTA gives
  // up. NOTES: a caller drawing tickets from a counter draws after this wait, so a CTA takes its
  // next tile only once the Consumers are within the queue's depth of it.
  __device__ __forceinline__ bool reserve_ticket_slot() {
    return wait_barrier(ring_, ring_.tile_empty(queue_.slot()), queue_.phase() ^ 1u,
                        kBarrierTileEmpty, d_.p);
  }
  // Producer, tile queue, after reserve_ticket_slot: hands `ticket` (kNoTile: the end) to the
  // Consumers. False when the Consumers closed the position (the CTA is aborting).
  __device__ __forceinline__ bool publish_ticket(int ticket) {
    if (!gemm::publish_ticket(ring_.tile_slot(queue_.slot()), queue_.tag(), ticket)) return false;
    ptx::mbarrier_arrive(ring_.tile_full(queue_.slot()));
    queue_.advance();
    return true;
  }

  // Producer, last: waits for the loads it issued to land.
  __device__ __forceinline__ void finish_producing() const {
    drain_loads<F, kStallHook>(ring_, state_, loads_, d_.p);
  }

  // Warpgroups 1 and 2, all their threads: the Consumers' register budget.
  template <int kRegisters = kConsumerRegisters>
  __device__ __forceinline__ void become_consumer() {
    ptx::setmaxnreg_inc<kRegisters>();
  }

  // Consumer: this warpgroup's index among the Consumers (0 or 1).
  __device__ __forceinline__ int consumer() const { return warpgroup_ - 1; }

  // Consumer, tile queue: the next ticket the Producer handed over (kNoTile: the end, or the CTA
  // gave up). Every consumer thread calls it and gets the same value.
  __device__ __forceinline__ int take_ticket() {
    const int ticket = take_queued_ticket(
        ring_.tile_full(queue_.slot()), queue_.phase(), ring_.tile_slot(queue_.slot()),
        ring_.tile_empty(queue_.slot()), lane_, queue_.tag(), ring_.abort(), d_.p.wait_timeout_ns);
    queue_.advance();
    return ticket;
  }

  // Consumer: the whole tile: accumulators zeroed (or seeded, F::kSeeded), the K loop, the
  // epilogue E. `probe`: what the K loop tells a trace (mma_tile); NoProbe, nothing.
  template <class Probe = NoProbe>
  __device__ __forceinline__ void consume(const TileInfo& tile, const Probe& probe = Probe{}) {
    const int wg = consumer();
    const int reader_thread = static_cast<int>(threadIdx.x) - kFirstConsumer;
    float acc[F::kAcc];
    init_accumulators<F>(acc, tile, d_.p, wg, warp_, lane_);
    if constexpr (F::kFp8 && F::kKGrouped && F::kOverlapPromotion) {
      mma_tile_fp8_tokens_overlap<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_,
                                     reader_thread, probe);
    } else if constexpr (F::kFp8 && F::kKGrouped) {
      mma_tile_fp8_tokens<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, reader_thread,
                             probe);
    } else if constexpr (F::kFp8 && F::kOverlapPromotion && epilogue::ReadsRows<E, F>) {
      const auto lead = [&] { E::template lead<F>(tile, d_.p, wg, warp_, lane_); };
      mma_tile_fp8_overlap<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, probe, lead);
    } else if constexpr (F::kFp8 && F::kOverlapPromotion) {
      mma_tile_fp8_overlap<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, probe);
    } else if constexpr (F::kWideTile && epilogue::ReadsRows<E, F>) {
      const auto lead = [&] { E::template lead<F>(tile, d_.p, wg, warp_, lane_); };
      mma_tile_fp8_wide<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, probe, lead);
    } else if constexpr (F::kWideTile) {
      mma_tile_fp8_wide<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, probe);
    } else if constexpr (F::kFp8 && epilogue::ReadsRows<E, F>) {
      const auto lead = [&] { E::template lead<F>(tile, d_.p, wg, warp_, lane_); };
      mma_tile_fp8<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, probe, lead);
    } else if constexpr (F::kFp8) {
      mma_tile_fp8<F>(acc, ring_, state_, tile, d_.p, wg, warp_, lane_, probe);
    } else if constexpr (epilogue::ReadsRows<E, F>) {
      const auto lead = [&] { E::template lead<F>(tile, d_.p, wg, warp_, lane_); };
      mma_tile<F>(acc, ring_, state_, tile, d_.p, wg, lane_, reader_thread, probe, lead);
    } else {
      mma_tile<F>(acc, ring_, state_, tile, d_.p, wg, lane_, reader_thread, probe);
    }
    if constexpr (epilogue::WritesFp8<E>) {
      E::template store<F>(acc, tile, d_, wg, warp_, lane_, ring_.staging(), *fp8_);
    } else {
      E::template store<F>(acc, tile, d_, wg, warp_, lane_, ring_.staging());
    }
  }

  // Consumer, with rows held across tiles (HeldRows, epilogue.cuh, which the caller keeps from
  // tile to tile and stores with store_held after its last): consume, but the rows `held` holds
  // are stored once this tile's first K block is issued, and this tile's rows are held in turn
  // (E holds them in form F: epilogue::HoldsRows).
  template <class Probe = NoProbe>
  __device__ __forceinline__ void consume(const TileInfo& tile, HeldRows& held,
                                          const Probe& probe = Probe{}) {
    static_assert(epilogue::HoldsRows<E, F>, "an epilogue that holds rows");
    const int wg = consumer();
    const int reader_thread = static_cast<int>(threadIdx.x) - kFirstConsumer;
    float acc[F::kAcc];
    init_accumulators<F>(acc, tile, d_.p, wg, warp_, lane_);
    const int lane = lane_;
    const auto store_held_rows = [&held, lane] { store_held(held, lane); };
    mma_tile<F>(acc, ring_, state_, tile, d_.p, wg, lane_, reader_thread, probe, NoLead{},
                store_held_rows);
    E::template hold<F>(acc, tile, d_, wg, warp_, lane_, held);
  }

  // Consumer, last: the TMA-store epilogue's bulk stores have read the CTA's shared memory.
  __device__ __forceinline__ void finish_consuming() const {
    if constexpr (F::kTmaStore) {
      if (warp_ == 0 && lane_ == 0) ptx::tma_store_wait<0>();
    }
  }

  // One thread, after a CTA barrier that every role reaches once out of its loops: a CTA that gave
  // up says which wait first did, in the launch's report (GemmParams::timeout_report).
  __device__ __forceinline__ void report_timeout() const {
    if (ring_.abort()->aborted == 1) {  // a wait of the engine's (CtaAbort::give_up)
      report_wait_timeout(*ring_.abort(), d_.p.timeout_report, d_.p.timeout_lock,
                          d_.p.wait_timeout_ns);
    }
  }

 private:
  static constexpr int kAbandoned = 2;  // CtaAbort::aborted set by abandon (give_up sets 1)

  // NOTES: the dynamic shared-memory base rounded up to the 1024-byte alignment that
  // 128-byte-swizzled wgmma operands need (kSharedBytes has the 1024 bytes for it).
  __device__ __forceinline__ static std::uint8_t* aligned(std::uint8_t* smem) {
    const std::uint32_t raw = ptx::smem_addr(smem);
    return smem + ((raw + 1023u) & ~1023u) - raw;
  }

  const SharedRing<F> ring_;
  const GemmDescriptor& d_;
  const Fp8Params* const fp8_;
  const int warpgroup_, warp_, lane_;
  PipelineState<F::kStages> state_;
  TileQueueState queue_;
  ProducerLoads loads_;
};

}  // namespace mok::gemm
