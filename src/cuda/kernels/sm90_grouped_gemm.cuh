// sm90_grouped_gemm: the standalone persistent grouped GEMM, a tile loop around the engine
// (src/cuda/gemm/engine.cuh): the kernel template and its launch, for bf16 and e4m3 forms alike
// (the form's operand type is a template parameter). The library's instantiations are in
// sm90_bf16_grouped_gemm.cu and the three sm90_fp8_*.cu files (their launchers in
// src/cuda/gemm/launch.cu); tests/cpp instantiates the stall-hooked kernels it needs from here.
//
//   Producer  : walks the CTA's tile sequence and, for each tile, engine.produce(tile) (the TMA
//               loads of its K blocks into the ring).
//   Consumer0/1 : walk the same sequence and engine.consume(tile) (K loop and epilogue), 64 rows
//               of each tile each.
//
// Tile sequences (scheduler.cuh): M-grouped forms walk the static linear order (CTA c: tiles c,
// c + grid, ...; pairs, F::kCluster 2: cluster c steps c, c + clusters, ..., each step two
// consecutive tiles, one a CTA); the K-grouped form takes tickets from the caller's counter pair or
// in the static heavy-first order, the Producer handing each ticket to the Consumers through the
// engine's tile queue. Every wait is bounded: a CTA that gives up ends normally and leaves a report
// in the launch's mapped host memory (TimeoutReport).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/gemm/config.hpp"
#include "cuda/gemm/engine.cuh"
#include "cuda/gemm/launch.hpp"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/fence.cuh"
#include "mok/error.hpp"

namespace mok::gemm {

// The kernel of form F with epilogue E; `fp8`: the e4m3 forms' scales (unused by bf16 forms).
// kStallHook (tests only, tests/cpp's stall kernels): the CTA with index `stall_block` never loads
// its first K block (GemmEngine::become_producer); the library instantiates only kStallHook =
// false, whose code has none of the hook.
template <class F, class E, bool kStallHook>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ GemmDescriptor d, int stall_block,
                                  const __grid_constant__ Fp8Params fp8) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Scheduler = TileScheduler<F::kKGrouped, F::kBlockK>;
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ SchedulerTables tables;
  GemmEngine<F, E, kStallHook> engine(smem_raw, d, F::kFp8 ? &fp8 : nullptr);
  const int lane = engine.lane();
  if (threadIdx.x == 0) engine.init();
  if (threadIdx.x < 32) {
    Scheduler::prepare(d.p.sched, tables, lane);
    if constexpr (F::kKGrouped) {
      auto& scratch = *static_cast<SchedulerScratch*>(engine.setup_scratch());
      Scheduler::order_heavy_first(d.p.sched, tables, scratch, lane);
      Scheduler::choose_static_order(d.p.sched, tables, scratch, lane, gridDim.x,
                                     static_cast<TileOrder>(d.p.tile_order));
      ptx::fence_proxy_async_shared();  // the ring's TMA loads overwrite the scratch
    }
  }
  __syncthreads();
  // Pairs: the peer's multicast loads and arrivals target this CTA's barriers, so both CTAs'
  // barriers are initialised before either issues any.
  if constexpr (F::kCluster > 1) ptx::cluster_sync();

  Scheduler scheduler{d.p.sched, tables};
  const int num_tiles = scheduler.num_tiles();
  // Pairs: this CTA's rank, its cluster and the number of clusters (consecutive blocks along x).
  const int rank = F::kCluster > 1 ? static_cast<int>(ptx::cluster_ctarank()) : 0;
  const int cluster = static_cast<int>(blockIdx.x) / F::kCluster;
  const int clusters = static_cast<int>(gridDim.x) / F::kCluster;

  if (engine.role() == Role::kProducer) {
    engine.become_producer(stall_block);
    if (engine.is_producer_thread()) {
      if constexpr (F::kKGrouped) {
        // Static round robin over the heavy-first order when it balances (choose_static_order) or
        // when the launch has no counter, else the counter. Either way the Consumers get the tiles
        // through the queue.
        const bool fixed = tables.static_order != 0 || d.p.tickets == nullptr;
        const TicketCounter tickets{d.p.tickets};
        for (int next = blockIdx.x;; next += gridDim.x) {
          // NOTES: the ticket is drawn once a slot is free and the previous tile's loads are
          // issued, about kStages K blocks before this CTA can start it: late enough that a CTA
          // busy with a long tile leaves the next ones to others.
          if (!engine.reserve_ticket_slot()) break;
          const int drawn = fixed ? next : tickets.take();
          const int ticket = drawn < num_tiles ? drawn : kNoTile;
          if (!engine.publish_ticket(ticket)) break;
          if (ticket == kNoTile) break;
          if (!engine.produce(scheduler.tile_of_ticket(ticket))) break;
        }
        if (!fixed) tickets.retire();
      } else if constexpr (F::kCluster > 1) {
        for (int step = cluster; 2 * step < num_tiles; step += clusters) {
          const PairTile pt = scheduler.pair_tile(step, rank);
          if (!engine.produce(pt.tile, NoLoadHook{}, PairLoad{pt.shared_b, rank})) break;
        }
      } else {
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
          if (!engine.produce(scheduler.tile(tile))) break;
        }
      }
      engine.finish_producing();
    }
  } else {
    engine.become_consumer();
    if constexpr (F::kKGrouped) {
      for (;;) {
        const int ticket = engine.take_ticket();
        if (ticket == kNoTile) break;
        engine.consume(scheduler.tile_of_ticket(ticket));
      }
    } else if constexpr (F::kCluster > 1) {
      static_assert(!epilogue::HoldsRows<E, F>, "pairs: no held rows");
      for (int step = cluster; 2 * step < num_tiles; step += clusters) {
        const PairTile pt = scheduler.pair_tile(step, rank);
        TileInfo tile = pt.tile;
        if (!pt.store) tile.row_count = tile.m0;  // every row past the count: nothing stored
        engine.consume(tile);
      }
    } else {
      // NOTES: after an abort the remaining tiles still run (their waits give up at once, their
      // outputs are void): the static order is the one thing all consumer warps agree on.
      // An epilogue that holds rows: each tile's, until the next tile's first K block.
      std::conditional_t<epilogue::HoldsRows<E, F>, HeldRows, NoHeldRows> held;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        if constexpr (epilogue::HoldsRows<E, F>) {
          engine.consume(scheduler.tile(tile), held);
        } else {
          engine.consume(scheduler.tile(tile));
        }
      }
      store_held(held, lane);  // the last tile's
    }
    engine.finish_consuming();
  }
  // Every role has left its loops; a CTA that gave up says which wait first did. Pairs: neither
  // CTA exits while its peer may still arrive on its barriers or write its shared memory.
  __syncwarp();
  __syncthreads();
  if constexpr (F::kCluster > 1) ptx::cluster_sync();
  if (threadIdx.x == 0) engine.report_timeout();
#endif
}

// NOTES: the dynamic shared-memory limit is an attribute of the kernel in each device's context,
// so it is set once per device and instantiation (once per process left every device but the
// first with the default 48 KiB limit, and its launches failing).
template <class F, class E, bool kStallHook>
void configure_grouped_gemm_kernel(int device) {
  static std::atomic<bool> configured[kMaxDevices] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && configured[device].load(std::memory_order_acquire)) return;
  const cudaError_t e = cudaFuncSetAttribute(sm90_grouped_gemm_kernel<F, E, kStallHook>,
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

// Pairs: the CTAs of a persistent launch in clusters of two, no more clusters than can be
// resident at once (asked of the driver once per device and instantiation).
template <class F, class E, bool kStallHook>
int pair_grid_size(int device, cudaLaunchConfig_t config) {
  static std::atomic<int> resident[kMaxDevices] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  int clusters = cached ? resident[device].load(std::memory_order_acquire) : 0;
  const int sms = persistent_grid_size();
  if (clusters == 0) {
    config.gridDim = dim3(sms / 2 * 2);
    const cudaError_t e = cudaOccupancyMaxActiveClusters(
        &clusters, sm90_grouped_gemm_kernel<F, E, kStallHook>, &config);
    if (e != cudaSuccess || clusters <= 0) {
      (void)cudaGetLastError();
      throw Error("grouped GEMM pairs on device " + to_text(device),
                  "a cluster of 2 CTAs resident (cudaOccupancyMaxActiveClusters)",
                  e != cudaSuccess ? cudaGetErrorString(e) : "0 clusters");
    }
    if (cached) resident[device].store(clusters, std::memory_order_release);
  }
  return std::min(clusters, sms / 2) * 2;
}

// One CTA per SM of the current device (a persistent grid); pairs (F::kCluster 2) in clusters of
// two CTAs.
template <class F, class E, bool kStallHook = false>
void launch_grouped_gemm_kernel(const GemmDescriptor& d, cudaStream_t stream, int stall_block = -1,
                                const Fp8Params& fp8 = {}) {
  const int device = current_device();
  configure_grouped_gemm_kernel<F, E, kStallHook>(device);
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSharedBytes;
  config.stream = stream;
  config.gridDim = dim3(persistent_grid_size());
  cudaLaunchAttribute cluster[1] = {};
  if constexpr (F::kCluster > 1) {
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = F::kCluster;
    cluster[0].val.clusterDim.y = 1;
    cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = 1;
    config.gridDim = dim3(pair_grid_size<F, E, kStallHook>(device, config));
  }
  cudaError_t e = cudaLaunchKernelEx(&config, sm90_grouped_gemm_kernel<F, E, kStallHook>, d,
                                     stall_block, fp8);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw Error(std::string("grouped GEMM launch failed: ") + cudaGetErrorString(e));
  }
}

// launch.hpp's entry point, instantiated by the kernel files for their (form, epilogue) pairs.
template <class F, class E>
void launch_grouped_gemm(const GemmDescriptor& d, cudaStream_t stream, const Fp8Params& fp8) {
  launch_grouped_gemm_kernel<F, E>(d, stream, -1, fp8);
}

}  // namespace mok::gemm
