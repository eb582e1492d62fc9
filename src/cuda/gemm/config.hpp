// The engine's tile geometry and shared-memory layout: one definition for host and device.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm.hpp"

namespace mok::gemm {

inline constexpr int kTileM = 128;        // rows of a tile (the schedule's segment alignment)
inline constexpr int kTileK = 64;         // 64 bf16 = one 128-byte swizzle row
inline constexpr int kSwizzleChunk = 64;  // elements per 128-byte swizzle row
inline constexpr int kPanelM = 16;        // M tiles per raster panel (scheduler.cuh)

// NOTES: the K-grouped form (wgrad), whose tiles cost their group's row count, can take tiles from
// an integer ticket counter in heavy-groups-first order instead of a static round robin, so CTAs
// that drew long tiles take fewer short ones (v3b: qwen3 skewed wgrad 1.6-1.8x faster; uniform
// rows 3-12% slower on dsv3-ep1 and mixtral). The counter pair is the caller's
// (WeightGradArgs::tickets): without one the launch takes the static order. Either way the
// Producer hands the Consumers their tiles through a queue in shared memory.
inline constexpr int kTileQueueDepth = 4;  // tickets in flight from the Producer to the Consumers
inline constexpr int kOrderBuckets = 256;  // heavy-first order: buckets of similar K length
// NOTES: a launch whose tiles the static round robin balances within kStaticSlackPercent of the
// ticket estimate takes them statically (no counter): v3b measured tickets 3-6% slower than the
// static order on equal tiles (dsv3-ep8slice, mixtral uniform), and 1.4-1.8x faster on skewed
// rows (qwen3). kTileFixedCost is a tile's epilogue and pipeline fill in K blocks.
inline constexpr int kMaxStaticCtas = 256;
inline constexpr int kStaticSlackPercent = 3;
inline constexpr int kTileFixedCost = 2;
// An epilogue that reads row buffers (the SwiGLU backward's g and u) has them fetched into L2 this
// many K blocks before the end of the tile's K loop (at its first K block if it has fewer), so
// that more of its loads wait for L2 rather than HBM. NOTES (H200, 1a1eca3): leads of 1 to 4
// took about 2.5% off qwen3-30b-a3b's down dgrad (1-5% by cell), 6 about 1.6%, 12 nothing;
// dsv3-ep8slice within the spread either way.
// Built with -DMOK_EPILOGUE_LEAD_BLOCKS=n to measure another lead.
#ifndef MOK_EPILOGUE_LEAD_BLOCKS
#define MOK_EPILOGUE_LEAD_BLOCKS 3
#endif
inline constexpr int kEpilogueLeadBlocks = MOK_EPILOGUE_LEAD_BLOCKS;

inline constexpr int kThreads = 384;           // Producer, Consumer0, Consumer1 warpgroups
inline constexpr int kConsumerBarrierId = 1;   // named barrier among the two consumer warpgroups
inline constexpr int kWarpgroupBarrierId = 2;  // + w: named barrier of consumer warpgroup w
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kProducerThreads = kWarpgroupThreads;      // warpgroup 0
inline constexpr int kConsumerThreads = 2 * kWarpgroupThreads;  // warpgroups 1 and 2
// The first consumer thread (Consumer0's thread 0): the one that speaks for both consumer
// warpgroups after they gather at a named barrier; consumer thread i is thread kFirstConsumer + i.
inline constexpr int kFirstConsumer = kProducerThreads;
static_assert(kProducerThreads + kConsumerThreads == kThreads);
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;
// NOTES: the registers each thread has at entry (__launch_bounds__(kThreads, 1): 65536 / 384,
// rounded down to a multiple of 8). setmaxnreg moves registers within the CTA's own pool of
// kThreads x kEntryRegisters: a Consumer increase beyond what the Producer's decrease freed
// never succeeds, and the launch hangs (H200, 31273c4).
inline constexpr int kEntryRegisters = 168;
static_assert(kProducerThreads * kProducerRegisters + kConsumerThreads * kConsumerRegisters <=
                  kThreads * kEntryRegisters,
              "register budgets exceed the CTA's registers");

// The ring (forms.cuh, kStages): both consumer warpgroups on one tile, 64 rows each. bf16 (128 x
// 256 tiles): 4 stages of 48 KiB, or 3 and a 64 KiB staging tile for the TMA-store epilogue;
// e4m3: 6 stages of 33 KiB on 128 x 128 tiles (5 and a 32 KiB staging tile where the epilogue
// stages), 4 of 49 KiB on wide ones. kMaxStages is the 128-wide e4m3 forms' 6 stages, kRingBytes
// the bf16 TMA-store form's 3 x 48 + 64 KiB; a form that uses less leaves the rest to its kernel
// as scratch (Engine::spare).
inline constexpr std::uint32_t kTileABytes = kTileM * kTileK * 2;         // 16 KiB
inline constexpr std::uint32_t kChunkBytes = kSwizzleChunk * kTileK * 2;  // 64 x 64 MN-major box
inline constexpr std::uint32_t kRingBytes = 208 * 1024;
inline constexpr int kMaxStages = 6;
// Ring barriers (full, empty per stage), then the tile queue's barriers (full, empty per slot),
// two unused barrier slots (the removed ping-pong schedule's turns, kept so that the layout, and
// so the SASS, stays as tested on the H200), the queue's ticket slots (8 bytes each) and the CTA's
// give-up state (mainloop.cuh, CtaAbort: 32 bytes).
inline constexpr std::uint32_t kBarrierBytes =
    (2 * kMaxStages + 2 * kTileQueueDepth + 2) * 8 + kTileQueueDepth * 8 + 32;
// NOTES: +1024 so the kernel can round the dynamic shared-memory base up to the 1024-byte
// alignment that 128-byte-swizzled wgmma operands need.
inline constexpr std::uint32_t kSharedBytes = kRingBytes + kBarrierBytes + 1024;
static_assert(kExpertSegmentAlignment == kTileM, "segments are padded to the tile height");
static_assert(kTileABytes % 1024 == 0, "swizzle atoms misaligned");

}  // namespace mok::gemm
