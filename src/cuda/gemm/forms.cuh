// The GEMM forms the engine runs, as compile-time traits (operand layouts, tile width, ring
// geometry). What a form stores is its epilogue policy (epilogue.cuh); what one GEMM reads and
// writes is its descriptor (descriptor.cuh).
#pragma once

#include "cuda/gemm/scheduler.cuh"

namespace mok::gemm {

enum class FormKind {
  kGateUp,               // M-grouped rows x [W_gate; W_up]^T, SwiGLU epilogue
  kRowsWT,               // M-grouped rows x W^T (down forward, dense), optional row scale
  kRowsW,                // M-grouped rows x W (dgrad): B is N-major in memory
  kWeightGrad,           // K-grouped A^T B over each group's rows (wgrad): A and B M/N-major
  kWeightGradContinued,  // the same, accumulators seeded from the fp32 output
};

// Both consumer warpgroups work on one 128 x 256 tile, 64 rows each (wgmma m64n256k16). NOTES:
// ping-pong consumers (each warpgroup a whole 128 x 128 tile, running its epilogue while the other
// runs its K loop) measured 6-22% slower than this on every form (docs/perf/NOTES.md, v6) and were
// removed.
template <FormKind kKind>
struct Form {
  static constexpr FormKind kind = kKind;
  static constexpr bool kKGrouped =
      kKind == FormKind::kWeightGrad || kKind == FormKind::kWeightGradContinued;
  // NOTES: a separate instantiation, because accumulators defined by ordinary loads before the
  // first wgmma make ptxas serialize the wgmma pipeline (C7515) for the whole kernel.
  static constexpr bool kSeeded = kKind == FormKind::kWeightGradContinued;
  static constexpr int kTransA = kKGrouped ? 1 : 0;  // 1: A is M-major
  static constexpr int kTransB = kKind == FormKind::kRowsW || kKGrouped ? 1 : 0;

  static constexpr int kTileN = 256;
  // NOTES: the bf16 wgrad stores its tiles through shared memory and TMA (epilogue.cuh,
  // store_tile_tma): v4/v5 measured its short-K cells (2-16 K blocks a tile) bound by the
  // epilogue, and a TMA store lets the Consumers start the next tile while the copy engine writes
  // this one. Its 64 KiB staging tile costs the ring one stage.
  static constexpr bool kTmaStore = kKind == FormKind::kWeightGrad;
  static constexpr int kStages = kTmaStore ? 3 : 4;
  // A consumer warpgroup's accumulators: its 64 rows x kTileN columns, kTileN / 2 fp32 a thread.
  static constexpr int kAcc = kTileN / 2;
  static constexpr int kReaders = 8;  // consumer warps that read a stage
  static constexpr std::uint32_t kTileBBytes = kTileN * kTileK * 2;
  static constexpr std::uint32_t kStageBytes = kTileABytes + kTileBBytes;  // TMA bytes a stage
  static constexpr std::uint32_t kStagingBytes = kTmaStore ? kTileM * kTileN * 2 : 0;
  static_assert(kStages * kStageBytes + kStagingBytes <= kRingBytes && kStages <= kMaxStages,
                "ring overflow");
  static_assert(kTileBBytes % 1024 == 0, "swizzle atoms misaligned");

  static constexpr int kOutTileN = kKind == FormKind::kGateUp ? kTileN / 2 : kTileN;
  static constexpr int kBoxRowsA = kTransA ? kTileK : kTileM;
  // M-grouped forms load B in two halves (mainloop.cuh, load_b_half): kTileN / 2 K-major rows a
  // box (gate/up: W_gate's and W_up's rows of the same output columns).
  static constexpr int kBoxRowsB = kTransB ? kTileK : kTileN / 2;
};

}  // namespace mok::gemm
