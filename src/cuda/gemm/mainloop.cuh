// The warp-specialized mainloop: one Producer warpgroup (one elected thread issues TMA into a
// F::kStages-deep shared-memory ring) and two Consumer warpgroups, either cooperative (each issues
// wgmma m64n256k16 on its 64-row half of a 128 x 256 tile) or ping-pong (each owns every other
// tile of the CTA, 128 x 128, and issues two m64n128k16 per k16 step). Full barriers: one arrival
// from the Producer of every CTA of the cluster + the stage's TMA bytes. Empty barriers: one
// arrival per reading consumer warp (F::kReaders) of every CTA of the cluster once its wgmma have
// read the stage.
// Ping-pong turns: consumer warpgroup w waits on turn(w) before its K loop and, once the loop's
// last wgmma is issued, arrives on the other's turn; so the two K loops alternate on the tensor
// cores in the CTA's tile order and each warpgroup's epilogue overlaps the other's K loop.
// NOTES (clusters of two): both CTAs walk the same number of K blocks, so stage s is in the same
// round in both. A Producer may multicast into its peer's stage, so it waits until the consumers
// of both CTAs released the stage (empty). It also arrives on its peer's full barrier once past
// that wait, even when it sends the peer no bytes: so a consumer can reach round r + 1 of a stage
// only after both Producers saw round r released everywhere, which keeps any arrival for round
// r + 1 from landing on a barrier whose round r is not yet complete.
// The tile queue (K-grouped with tickets): the Producer draws a ticket, writes it to a slot and
// arrives on the slot's full barrier; every consumer thread reads it, and each consumer warp then
// arrives on the slot's empty barrier.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/gemm/forms.cuh"
#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace mok::gemm {

// Stage index and phase parity of the ring, advanced identically by producer and consumers.
template <int kStages>
struct PipelineState {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // Past `n` stages at once (a ping-pong consumer skipping the other warpgroup's tile).
  __device__ void advance(int n) {
    const int s = stage + n;
    phase ^= static_cast<std::uint32_t>(s / kStages) & 1u;
    stage = s % kStages;
  }
};

// The tile queue's position as one counter (slot = count mod depth, parity = (count / depth) mod
// 2): the Consumers carry it across a tile's K loop and epilogue, where registers are scarce.
struct TileQueueState {
  static_assert((kTileQueueDepth & (kTileQueueDepth - 1)) == 0, "depth a power of two");
  unsigned count = 0;
  __device__ int slot() const { return static_cast<int>(count % kTileQueueDepth); }
  __device__ std::uint32_t phase() const { return (count / kTileQueueDepth) & 1u; }
  __device__ void advance() { ++count; }
};
inline constexpr int kNoTile = -1;  // the ticket slot's value once the tiles are all taken

// Dynamic shared memory: F::kStages x {A tile, B tile} within kRingBytes, then the barriers and
// ticket slots (config.hpp, kBarrierBytes; the same offsets for every form).
template <class F>
struct SharedRing {
  std::uint8_t* base;  // 1024-byte aligned
  __device__ std::uint8_t* a(int s) const { return base + s * F::kStageBytes; }
  __device__ std::uint8_t* b(int s) const { return base + s * F::kStageBytes + kTileABytes; }
  // The TMA-store epilogue's staging tile (F::kStagingBytes, 1024-byte aligned), after the stages.
  __device__ std::uint8_t* staging() const { return base + F::kStages * F::kStageBytes; }
  __device__ std::uint64_t* barriers() const {
    return reinterpret_cast<std::uint64_t*>(base + kRingBytes);
  }
  __device__ std::uint64_t* full(int s) const { return barriers() + s; }
  __device__ std::uint64_t* empty(int s) const { return barriers() + kMaxStages + s; }
  __device__ std::uint64_t* tile_full(int q) const { return barriers() + 2 * kMaxStages + q; }
  __device__ std::uint64_t* tile_empty(int q) const {
    return barriers() + 2 * kMaxStages + kTileQueueDepth + q;
  }
  __device__ std::uint64_t* turn(int wg) const {
    return barriers() + 2 * kMaxStages + 2 * kTileQueueDepth + wg;
  }
  __device__ volatile int* tile_slot(int q) const {
    return reinterpret_cast<volatile int*>(barriers() + 2 * kMaxStages + 2 * kTileQueueDepth + 2) +
           q;
  }
  __device__ void init_barriers() const {
    for (int s = 0; s < F::kStages; ++s) {
      ptx::mbarrier_init(full(s), F::kCluster);
      ptx::mbarrier_init(empty(s), F::kReaders * F::kCluster);
    }
    for (int q = 0; q < kTileQueueDepth; ++q) {
      ptx::mbarrier_init(tile_full(q), 1);
      ptx::mbarrier_init(tile_empty(q), kConsumerThreads / 32);  // every consumer warp reads it
    }
    for (int w = 0; w < 2; ++w) ptx::mbarrier_init(turn(w), 4);  // the other warpgroup's warps
  }
};

// Ids of the barriers in timeout reports.
enum : int {
  kBarrierFull = 0,
  kBarrierEmpty = 1,
  kBarrierTileFull = 2,
  kBarrierTileEmpty = 3,
  kBarrierTurn = 4
};

struct TensorMaps {
  const CUtensorMap* a;
  const CUtensorMap* b;
  const CUtensorMap* a2;  // RowsW with a second product: its A
  const CUtensorMap* b2;  // gate/up: W_up; RowsW with a second product: its W
};

// A TMA load into this CTA's stage, or multicast into the same offsets of both CTAs of the
// cluster.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, std::uint64_t* bar,
                                         int c0, int c1, bool multicast) {
  if (multicast) {
    ptx::tma_load_2d_multicast(dst, map, bar, c0, c1, 0x3);
  } else {
    ptx::tma_load_2d(dst, map, bar, c0, c1);
  }
}

// Producer, M-grouped forms: half `h` of the kTileN x 64 B tile of K block `kb` (B rows or N
// chunks [h kTileN / 2, (h + 1) kTileN / 2)); the halves together give the same bytes as one box.
template <class F>
__device__ __forceinline__ void load_b_half(const TensorMaps& maps, const SharedRing<F>& ring,
                                            int s, const TileInfo& tile, int kb,
                                            const KernelParams& p, int h, bool multicast) {
  constexpr int kHalfChunks = F::kTileN / 2 / kSwizzleChunk;
  std::uint64_t* bar = ring.full(s);
  std::uint8_t* dst = ring.b(s) + h * (F::kTileBBytes / 2);
  const int k0 = kb * kTileK;
  const int n0 = tile.n0 * F::kOutTileN;
  const int w_row = tile.group * p.b_rows_per_group;
  if constexpr (F::kind == FormKind::kGateUp) {
    // Half 0: W_gate's kTileN / 2 rows, half 1: W_up's, for the same output columns.
    tma_load(dst, h == 0 ? maps.b : maps.b2, bar, k0, w_row + n0, multicast);
  } else if constexpr (F::kTransB) {
    // Two products share the accumulators: K blocks [0, k_blocks_first) of (a, W), then those of
    // (a2, W2).
    const bool second = p.k_blocks_first > 0 && kb >= p.k_blocks_first;
    const int kk0 = second ? k0 - p.k_blocks_first * kTileK : k0;
    const CUtensorMap* map_b = second ? maps.b2 : maps.b;
#pragma unroll
    for (int c = 0; c < kHalfChunks; ++c) {
      tma_load(dst + c * kChunkBytes, map_b, bar, n0 + (kHalfChunks * h + c) * kSwizzleChunk,
               w_row + kk0, multicast);
    }
  } else {
    tma_load(dst, maps.b, bar, k0, w_row + n0 + h * (F::kTileN / 2), multicast);
  }
}

// Consumer, tile queue: waits for the slot's ticket (kNoTile at the end), reads it and frees the
// slot (one arrival per warp, once all its lanes have read it). NOTES: not inlined: inlined, its
// bounded wait loop made ptxas spill registers in the Consumers' epilogue (the consumer code is
// allocated within the 168-register entry cap). Called between tiles, with no wgmma in flight; the
// HGMMA pipelining (DEPBAR.LE gsb0, 0x1) is unchanged.
__device__ __noinline__ inline int take_queued_ticket(std::uint64_t* full, std::uint32_t parity,
                                                      const volatile int* slot,
                                                      std::uint64_t* empty, int lane,
                                                      ptx::WaitTimeoutReport* report) {
  ptx::mbarrier_wait(full, parity, kBarrierTileFull, report);
  const int ticket = *slot;
  __syncwarp();
  if (lane == 0) ptx::mbarrier_arrive(empty);
  return ticket;
}

// Producer: the TMA loads of one K block of one tile into stage `s`. With `shared_b` (the
// cluster's two tiles use the same B tile) this CTA loads only half `rank` of B and multicasts it;
// its peer sends the other half. Either way the stage receives kStageBytes.
template <class F>
__device__ __forceinline__ void load_k_block(const TensorMaps& maps, const SharedRing<F>& ring,
                                             int s, const TileInfo& tile, int kb,
                                             const KernelParams& p, bool shared_b, int rank) {
  std::uint64_t* bar = ring.full(s);
  ptx::mbarrier_arrive_expect_tx(bar, F::kStageBytes);
  const int k0 = kb * kTileK;
  if constexpr (F::kKGrouped) {
    const int row = tile.row_base + k0;
    const int n0 = tile.n0 * F::kOutTileN;
#pragma unroll
    for (int c = 0; c < kTileM / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.a(s) + c * kChunkBytes, maps.a, bar, tile.m0 + c * kSwizzleChunk, row);
    }
#pragma unroll
    for (int c = 0; c < F::kTileN / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.b(s) + c * kChunkBytes, maps.b, bar, n0 + c * kSwizzleChunk, row);
    }
  } else {
    const bool second =
        F::kind == FormKind::kRowsW && p.k_blocks_first > 0 && kb >= p.k_blocks_first;
    const int kk0 = second ? k0 - p.k_blocks_first * kTileK : k0;
    ptx::tma_load_2d(ring.a(s), second ? maps.a2 : maps.a, bar, kk0, tile.row_base + tile.m0);
    if (shared_b) {
      load_b_half<F>(maps, ring, s, tile, kb, p, rank, true);
    } else {
      load_b_half<F>(maps, ring, s, tile, kb, p, 0, false);
      load_b_half<F>(maps, ring, s, tile, kb, p, 1, false);
    }
  }
}

// Producer: every K block of one tile, each into the next free stage of the ring.
template <class F>
__device__ __forceinline__ void load_tile(const TensorMaps& maps, const SharedRing<F>& ring,
                                          PipelineState<F::kStages>& state, const TileInfo& tile,
                                          const KernelParams& p, bool shared_b, int rank) {
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    ptx::mbarrier_wait(ring.empty(state.stage), state.phase ^ 1u, kBarrierEmpty, p.timeout_report);
    if constexpr (F::kCluster > 1) ptx::mbarrier_arrive_cluster(ring.full(state.stage), rank ^ 1);
    load_k_block<F>(maps, ring, state.stage, tile, kb, p, shared_b, rank);
    state.advance();
  }
}

// Producer, clusters: before the CTA exits, every stage it filled has been released by the
// consumers of both CTAs, so no arrival from the peer is still on its way to this CTA's barriers.
template <class F>
__device__ __forceinline__ void drain_ring(const SharedRing<F>& ring,
                                           PipelineState<F::kStages>& state,
                                           const KernelParams& p) {
  for (int i = 0; i < F::kStages; ++i) {
    ptx::mbarrier_wait(ring.empty(state.stage), state.phase ^ 1u, kBarrierEmpty, p.timeout_report);
    state.advance();
  }
}

// Consumer, lane 0 of each warp: stage `s` has been read; with clusters, tell both CTAs' Producers.
template <class F>
__device__ __forceinline__ void release_stage(const SharedRing<F>& ring, int s) {
  if constexpr (F::kCluster == 1) {
    ptx::mbarrier_arrive(ring.empty(s));
  } else {
#pragma unroll
    for (int r = 0; r < F::kCluster; ++r) ptx::mbarrier_arrive_cluster(ring.empty(s), r);
  }
}

// K-grouped forms: rows of the last K block past the group's end may hold anything (padding,
// the next group); zero them in both operands so they contribute exactly nothing. Every consumer
// thread that reads the stage takes part (both warpgroups when cooperative, the owner when
// ping-pong); ends with their named barrier.
template <class F>
__device__ __forceinline__ void zero_tail_rows(const SharedRing<F>& ring, int s, int valid_rows,
                                               int reader_thread, int barrier_id) {
  constexpr int kThreadsReading = F::kReaders * 32;
  const int rows = kTileK - valid_rows;
  const int per_chunk = rows * 8;  // 16-byte pieces
  constexpr int kChunks = (kTileM + F::kTileN) / kSwizzleChunk;
  for (int i = reader_thread; i < kChunks * per_chunk; i += kThreadsReading) {
    const int chunk = i / per_chunk;
    const int rem = i - chunk * per_chunk;
    std::uint8_t* base = chunk < kTileM / kSwizzleChunk
                             ? ring.a(s) + chunk * kChunkBytes
                             : ring.b(s) + (chunk - kTileM / kSwizzleChunk) * kChunkBytes;
    // NOTES: the 128-byte swizzle permutes 16-byte pieces within a 128-byte row, so clearing
    // whole rows clears exactly the logical rows k >= valid_rows.
    *reinterpret_cast<uint4*>(base + (valid_rows + rem / 8) * 128 + (rem % 8) * 16) =
        make_uint4(0, 0, 0, 0);
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(barrier_id, kThreadsReading);
}

// Accumulator block `b` (64 rows) of a consumer warpgroup's accumulators.
template <class F>
__device__ __forceinline__ float (&acc_block(float (&acc)[F::kAcc], int b))[F::kBlockAcc] {
  return *reinterpret_cast<float(*)[F::kBlockAcc]>(acc + b * F::kBlockAcc);
}

// Consumer: the 4 wgmma k16 steps of one K block: cooperative, this warpgroup's 64 rows x 256;
// ping-pong, both 64-row blocks x 128 (the B descriptor shared by the two).
template <class F>
__device__ __forceinline__ void mma_k_block(float (&acc)[F::kAcc], const SharedRing<F>& ring, int s,
                                            int consumer_wg) {
  const std::uint32_t a_base =
      ptx::smem_addr(ring.a(s)) + (F::kPingPong ? 0 : consumer_wg * (kTileABytes / 2));
  const std::uint32_t b_base = ptx::smem_addr(ring.b(s));
  // K-major operands step 16 elements (32 bytes) along a swizzled row; M/N-major operands step 16
  // rows of 128 bytes. A's 64-row blocks are 8 KiB apart either way (64 rows of 128 bytes, or one
  // 64-wide M chunk).
  constexpr std::uint32_t kStepA = F::kTransA ? 16 * 128 : 32;
  constexpr std::uint32_t kStepB = F::kTransB ? 16 * 128 : 32;
  constexpr std::uint32_t kLboA = F::kTransA ? kChunkBytes : 16;
  constexpr std::uint32_t kLboB = F::kTransB ? kChunkBytes : 16;
  constexpr std::uint32_t kBlockA = kTileABytes / 2;
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileK / 16; ++kk) {
    const std::uint64_t db = ptx::make_smem_desc_sw128(b_base + kk * kStepB, kLboB, 1024);
    if constexpr (F::kPingPong) {
#pragma unroll
      for (int b = 0; b < F::kBlocks; ++b) {
        const std::uint64_t da =
            ptx::make_smem_desc_sw128(a_base + b * kBlockA + kk * kStepA, kLboA, 1024);
        ptx::wgmma_m64n128k16_bf16<F::kTransA, F::kTransB>(acc_block<F>(acc, b), da, db, 1);
      }
    } else {
      const std::uint64_t da = ptx::make_smem_desc_sw128(a_base + kk * kStepA, kLboA, 1024);
      ptx::wgmma_m64n256k16_bf16<F::kTransA, F::kTransB>(acc, da, db, 1);
    }
  }
  ptx::wgmma_commit_group();
}

// Consumer: the whole K loop of one tile into `acc` (already zeroed or seeded). NOTES: one wgmma
// group stays in flight: block kb is issued before block kb-1 is waited for, and stage kb-1 is
// released only then, so the tensor cores never wait for the issue. Ping-pong: the loop starts
// once it is this warpgroup's turn (`turn_parity` on turn(wg)) and passes the turn on once its
// last wgmma is issued. NOTES: the pass is unconditional: turns strictly alternate along the
// CTA's tiles, so the other warpgroup waits for it exactly when it has a next tile, and a turn
// barrier is never a whole phase ahead of its waiter (the waiter's previous tile gates it).
template <class F>
__device__ __forceinline__ void mma_tile(float (&acc)[F::kAcc], const SharedRing<F>& ring,
                                         PipelineState<F::kStages>& state, const TileInfo& tile,
                                         const KernelParams& p, int consumer_wg, int lane,
                                         int reader_thread, std::uint32_t turn_parity) {
  if constexpr (F::kPingPong) {
    ptx::mbarrier_wait(ring.turn(consumer_wg), turn_parity, kBarrierTurn, p.timeout_report);
  }
  int previous_stage = -1;
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    ptx::mbarrier_wait(ring.full(state.stage), state.phase, kBarrierFull, p.timeout_report);
    if constexpr (F::kKGrouped) {
      const int valid = tile.row_count - kb * kTileK;
      if (valid < kTileK) {
        zero_tail_rows(ring, state.stage, valid, reader_thread,
                       F::kPingPong ? kWarpgroupBarrierId + consumer_wg : kConsumerBarrierId);
      }
    }
    mma_k_block<F>(acc, ring, state.stage, consumer_wg);
    ptx::wgmma_wait_group<1>();
    if (previous_stage >= 0 && lane == 0) release_stage<F>(ring, previous_stage);
    previous_stage = state.stage;
    state.advance();
  }
  if constexpr (F::kPingPong) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(ring.turn(consumer_wg ^ 1));
  }
  ptx::wgmma_wait_group<0>();
  ptx::fence_registers(acc);
  if (previous_stage >= 0 && lane == 0) release_stage<F>(ring, previous_stage);
}

}  // namespace mok::gemm
