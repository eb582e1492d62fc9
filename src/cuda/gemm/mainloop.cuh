// The warp-specialized mainloop: one Producer warpgroup (one elected thread issues TMA into a
// kStages-deep shared-memory ring) and two Consumer warpgroups (each issues wgmma m64n256k16 on its
// 64-row half of the tile). Full barriers: one arrival + the stage's TMA bytes. Empty barriers: one
// arrival per consumer warp once its wgmma have read the stage.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/gemm/forms.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace mok::gemm {

inline constexpr int kConsumerWarps = kConsumerThreads / 32;
inline constexpr int kConsumerBarrierId = 1;  // named barrier among the two consumer warpgroups

// Stage index and phase parity of the ring, advanced identically by producer and consumers.
struct PipelineState {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

struct SharedRing {
  std::uint8_t* base;  // 1024-byte aligned
  __device__ std::uint8_t* a(int s) const { return base + s * kStageBytes; }
  __device__ std::uint8_t* b(int s) const { return base + s * kStageBytes + kTileABytes; }
  __device__ std::uint64_t* full(int s) const {
    return reinterpret_cast<std::uint64_t*>(base + kStages * kStageBytes) + s;
  }
  __device__ std::uint64_t* empty(int s) const {
    return reinterpret_cast<std::uint64_t*>(base + kStages * kStageBytes) + kStages + s;
  }
  __device__ void init_barriers() const {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(full(s), 1);
      ptx::mbarrier_init(empty(s), kConsumerWarps);
    }
  }
};

struct TensorMaps {
  const CUtensorMap* a;
  const CUtensorMap* b;
  const CUtensorMap* a2;  // RowsW with a second product: its A
  const CUtensorMap* b2;  // gate/up: W_up; RowsW with a second product: its W
};

// Producer: the TMA loads of one K block of one tile into stage `s`.
template <class F>
__device__ __forceinline__ void load_k_block(const TensorMaps& maps, const SharedRing& ring, int s,
                                             const TileInfo& tile, int kb, const KernelParams& p) {
  std::uint64_t* bar = ring.full(s);
  ptx::mbarrier_arrive_expect_tx(bar, kStageBytes);
  const int k0 = kb * kTileK;
  const int n0 = tile.n0 * F::kOutTileN;
  if constexpr (F::kKGrouped) {
    const int row = tile.row_base + k0;
#pragma unroll
    for (int c = 0; c < kTileM / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.a(s) + c * kChunkBytes, maps.a, bar, tile.m0 + c * kSwizzleChunk, row);
    }
#pragma unroll
    for (int c = 0; c < kTileN / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.b(s) + c * kChunkBytes, maps.b, bar, n0 + c * kSwizzleChunk, row);
    }
  } else if constexpr (F::kind == FormKind::kRowsW) {
    // Two products share the accumulators: K blocks [0, k_blocks_first) of (a, W), then those of
    // (a2, W2).
    const bool second = p.k_blocks_first > 0 && kb >= p.k_blocks_first;
    const int kk0 = second ? k0 - p.k_blocks_first * kTileK : k0;
    const CUtensorMap* map_a = second ? maps.a2 : maps.a;
    const CUtensorMap* map_b = second ? maps.b2 : maps.b;
    ptx::tma_load_2d(ring.a(s), map_a, bar, kk0, tile.row_base + tile.m0);
    const int w_row = tile.group * p.b_rows_per_group;
#pragma unroll
    for (int c = 0; c < kTileN / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.b(s) + c * kChunkBytes, map_b, bar, n0 + c * kSwizzleChunk,
                       w_row + kk0);
    }
  } else {
    ptx::tma_load_2d(ring.a(s), maps.a, bar, k0, tile.row_base + tile.m0);
    const int w_row = tile.group * p.b_rows_per_group;
    if constexpr (F::kind == FormKind::kGateUp) {
      ptx::tma_load_2d(ring.b(s), maps.b, bar, k0, w_row + n0);
      ptx::tma_load_2d(ring.b(s) + kTileBBytes / 2, maps.b2, bar, k0, w_row + n0);
    } else if constexpr (F::kTransB) {
#pragma unroll
      for (int c = 0; c < kTileN / kSwizzleChunk; ++c) {
        ptx::tma_load_2d(ring.b(s) + c * kChunkBytes, maps.b, bar, n0 + c * kSwizzleChunk,
                         w_row + k0);
      }
    } else {
      ptx::tma_load_2d(ring.b(s), maps.b, bar, k0, w_row + n0);
    }
  }
}

// K-grouped forms: rows of the last K block past the group's end may hold anything (padding,
// the next group); zero them in both operands so they contribute exactly nothing. Both consumer
// warpgroups take part; ends with the consumer named barrier.
__device__ __forceinline__ void zero_tail_rows(const SharedRing& ring, int s, int valid_rows,
                                               int consumer_thread) {
  const int rows = kTileK - valid_rows;
  const int per_chunk = rows * 8;  // 16-byte pieces
  constexpr int kChunks = (kTileM + kTileN) / kSwizzleChunk;
  for (int i = consumer_thread; i < kChunks * per_chunk; i += kConsumerThreads) {
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
  ptx::named_barrier_sync(kConsumerBarrierId, kConsumerThreads);
}

// Consumer: the 4 wgmma k16 steps of one K block for this warpgroup's 64 rows.
template <class F>
__device__ __forceinline__ void mma_k_block(float (&acc)[kTileN / 2], const SharedRing& ring, int s,
                                            int consumer_wg) {
  const std::uint32_t a_base = ptx::smem_addr(ring.a(s)) + consumer_wg * (kTileABytes / 2);
  const std::uint32_t b_base = ptx::smem_addr(ring.b(s));
  // K-major operands step 16 elements (32 bytes) along a swizzled row; M/N-major operands step 16
  // rows of 128 bytes.
  constexpr std::uint32_t kStepA = F::kTransA ? 16 * 128 : 32;
  constexpr std::uint32_t kStepB = F::kTransB ? 16 * 128 : 32;
  constexpr std::uint32_t kLboA = F::kTransA ? kChunkBytes : 16;
  constexpr std::uint32_t kLboB = F::kTransB ? kChunkBytes : 16;
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileK / 16; ++kk) {
    const std::uint64_t da = ptx::make_smem_desc_sw128(a_base + kk * kStepA, kLboA, 1024);
    const std::uint64_t db = ptx::make_smem_desc_sw128(b_base + kk * kStepB, kLboB, 1024);
    ptx::wgmma_m64n256k16_bf16<F::kTransA, F::kTransB>(acc, da, db, 1);
  }
  ptx::wgmma_commit_group();
}

}  // namespace mok::gemm
