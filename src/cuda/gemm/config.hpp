// The engine's tile geometry and shared-memory layout: one definition for host and device.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm.hpp"

namespace mok::gemm {

inline constexpr int kTileM = 128;        // rows of a tile (the schedule's segment alignment)
inline constexpr int kTileK = 64;         // 64 bf16 = one 128-byte swizzle row
inline constexpr int kSwizzleChunk = 64;  // elements per 128-byte swizzle row
inline constexpr int kPanelM = 16;        // M tiles per raster panel (scheduler.cuh)

// NOTES: with kClusterM = 2 the M-grouped forms run as clusters of two CTAs on consecutive tiles of
// the linear order; two neighbours that share their weight tile (same group and N tile:
// consecutive M tiles of a panel) each load half of it and multicast it to both, so the L2 serves
// 32 KiB instead of 48 KiB per CTA and K block. Correct (the tests pass with it), but measured
// neutral on the H200 (geometric mean 0.998x over the 24 M-grouped cells, -6%..+5% per cell,
// docs/perf/NOTES.md v3b; again 0.997x with v7's epilogues, v7b), so off by default; build with
// -DMOK_GEMM_CLUSTER_M=2 to measure it.
#ifndef MOK_GEMM_CLUSTER_M
#define MOK_GEMM_CLUSTER_M 1
#endif
inline constexpr int kClusterM = MOK_GEMM_CLUSTER_M;
static_assert(kClusterM == 1 || kClusterM == 2, "clusters of one or two CTAs");

// NOTES: the K-grouped form (wgrad), whose tiles cost their group's row count, takes tiles from an
// integer ticket counter in heavy-groups-first order instead of a static round robin, so CTAs that
// drew long tiles take fewer short ones (v3b: qwen3 skewed wgrad 1.6-1.8x faster; uniform rows
// 3-12% slower on dsv3-ep1 and mixtral). 0 keeps the static order.
#ifndef MOK_GEMM_WGRAD_TICKETS
#define MOK_GEMM_WGRAD_TICKETS 1
#endif
inline constexpr bool kWgradTickets = MOK_GEMM_WGRAD_TICKETS != 0;
inline constexpr int kTileQueueDepth = 4;  // tickets in flight from the Producer to the Consumers
inline constexpr int kTicketSlots = 64;    // ticket counters, taken round robin by launches
inline constexpr int kOrderBuckets = 256;  // heavy-first order: buckets of similar K length
// NOTES: a launch whose tiles the static round robin balances within kStaticSlackPercent of the
// ticket estimate takes them statically (no counter): v3b measured tickets 3-6% slower than the
// static order on equal tiles (dsv3-ep8slice, mixtral uniform), and 1.4-1.8x faster on skewed
// rows (qwen3). kTileFixedCost is a tile's epilogue and pipeline fill in K blocks.
inline constexpr int kMaxStaticCtas = 256;
inline constexpr int kStaticSlackPercent = 3;
inline constexpr int kTileFixedCost = 2;

inline constexpr int kThreads = 384;           // Producer, Consumer0, Consumer1 warpgroups
inline constexpr int kConsumerBarrierId = 1;   // named barrier among the two consumer warpgroups
inline constexpr int kWarpgroupBarrierId = 2;  // + w: named barrier of consumer warpgroup w
inline constexpr int kConsumerThreads = 256;
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536,
              "register budgets exceed the register file");

// Two consumer schedules (forms.cuh): cooperative (both consumer warpgroups on one 128 x 256 tile,
// 64 rows each: 4 stages of 48 KiB, or 3 and a 64 KiB staging tile for the TMA-store epilogue) and
// ping-pong (each consumer warpgroup owns a whole 128 x 128 tile, the two alternate: 6 stages of
// 32 KiB). All fit in kRingBytes.
inline constexpr std::uint32_t kTileABytes = kTileM * kTileK * 2;         // 16 KiB
inline constexpr std::uint32_t kChunkBytes = kSwizzleChunk * kTileK * 2;  // 64 x 64 MN-major box
inline constexpr std::uint32_t kRingBytes = 208 * 1024;
inline constexpr int kMaxStages = 6;
// Ring barriers (full, empty per stage), then the tile queue's barriers (full, empty per slot),
// the ping-pong turn barriers (one per consumer warpgroup) and the queue's ticket slots.
inline constexpr std::uint32_t kBarrierBytes =
    (2 * kMaxStages + 2 * kTileQueueDepth + 2) * 8 + kTileQueueDepth * 4;
// NOTES: +1024 so the kernel can round the dynamic shared-memory base up to the 1024-byte
// alignment that 128-byte-swizzled wgmma operands need.
inline constexpr std::uint32_t kSharedBytes = kRingBytes + kBarrierBytes + 1024;
static_assert(kExpertSegmentAlignment == kTileM, "segments are padded to the tile height");
static_assert(kTileABytes % 1024 == 0, "swizzle atoms misaligned");

}  // namespace mok::gemm
