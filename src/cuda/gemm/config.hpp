// The engine's tile geometry and shared-memory layout: one definition for host and device.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm.hpp"

namespace mok::gemm {

inline constexpr int kTileM = 128;  // two consumer warpgroups x wgmma m64
inline constexpr int kTileN = 256;  // one wgmma n256 per k16 step (gate/up: 128 gate + 128 up)
inline constexpr int kTileK = 64;   // 64 bf16 = one 128-byte swizzle row
inline constexpr int kStages = 4;
inline constexpr int kSwizzleChunk = 64;  // elements per 128-byte swizzle row
inline constexpr int kPanelM = 16;        // M tiles per raster panel (scheduler.cuh)

inline constexpr int kThreads = 384;  // Producer, Consumer0, Consumer1 warpgroups
inline constexpr int kConsumerThreads = 256;
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536,
              "register budgets exceed the register file");

inline constexpr std::uint32_t kTileABytes = kTileM * kTileK * 2;         // 16 KiB
inline constexpr std::uint32_t kTileBBytes = kTileN * kTileK * 2;         // 32 KiB
inline constexpr std::uint32_t kStageBytes = kTileABytes + kTileBBytes;   // TMA bytes per stage
inline constexpr std::uint32_t kChunkBytes = kSwizzleChunk * kTileK * 2;  // 64 x 64 MN-major box
inline constexpr std::uint32_t kBarrierBytes = 2 * kStages * 8;
// NOTES: +1024 so the kernel can round the dynamic shared-memory base up to the 1024-byte
// alignment that 128-byte-swizzled wgmma operands need.
inline constexpr std::uint32_t kSharedBytes = kStages * kStageBytes + kBarrierBytes + 1024;
static_assert(kSharedBytes + 3 * (kMaxGroups + 1) * 4 <= 227 * 1024, "shared memory overflow");
static_assert(kExpertSegmentAlignment == kTileM, "segments are padded to the tile height");
static_assert(kTileABytes % 1024 == 0 && kTileBBytes % 1024 == 0, "swizzle atoms misaligned");

}  // namespace mok::gemm
