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

// The operands' element type. e4m3 (docs/architecture.md, "The FP8 layer"): FP8 bytes with fp32
// power-of-two scales, rows per 1x128 along K and weights per 128x128 block (GemmParams::fp8),
// K-major only.
enum class Operand { bf16, e4m3 };

// Both consumer warpgroups work on one 128 x kTileN tile, 64 rows each. bf16: kTileN 256 (wgmma
// m64n256k16). NOTES: ping-pong consumers (each warpgroup a whole 128 x 128 tile, running its
// epilogue while the other runs its K loop) measured 6-22% slower than this on every form
// (docs/perf/NOTES.md, v6) and were removed.
// e4m3: kTileN 128 (wgmma m64n128k32) and K blocks of 128 elements, one scale block each: a K
// block's product (4 k32 steps) goes to a second set of accumulators, which is then added into
// the first times the row's and the weight block's scales (mainloop.cuh, mma_tile_fp8). Two sets
// of 64 fp32 a thread: 256 wide would need 256 registers. A stage is 33 KiB (32 of tiles, then the
// K block's scales), so 6 stages.
//
// kPair (e4m3 M-grouped forms, the launchers' `pairs`): CTAs run in clusters of two over
// consecutive tiles of the linear order; when the two tiles use the same weight tile (same group
// and N tile), each CTA loads half of it and multicasts it to both, so the L2 serves a quarter
// fewer bytes a K block. Same tiles, same arithmetic: bitwise the unpaired launch. NOTES
// (2026-12-05, 479191c): 4-14% faster on the down and dgrad forms of the large cases, not on
// gate/up.
//
// kOverlap (e4m3 forms, the launchers' `overlap`): each consumer warpgroup issues K block kb + 1's
// wgmma before it promotes K block kb, into a second partial set (mainloop.cuh,
// mma_tile_fp8_overlap, mma_tile_fp8_tokens_overlap), so that it leaves the tensor pipe work while
// it promotes. Same products, same promotion order: bitwise the plain launch.
//
// kStagedStore: the ring keeps a staging tile of kTileM x kTileN bf16 after its stages, which costs
// it a stage. The plain weight gradient (the e4m3 launcher's `tma_store`): the output tiles go
// through it and a TMA store (epilogue.cuh, store_tile_tma), so that the Consumers start the next
// tile while the copy engine writes this one; on by default for the bf16 form, an option of the
// e4m3 one; the same bits as the Consumers' own stores. The e4m3 input gradients (RowsWT, 128-wide
// tiles): the SwiGLU backward that quantizes dg and du (epilogue.cuh, store_token_block) stages
// each as bf16 there to write its token-axis copy, whose blocks run down the tile's columns.
//
// kWide (the M-grouped e4m3 forms; the launchers' `wide`): 128 x 256 tiles, as the bf16 forms',
// in fewer bytes a FLOP than 128 x 128 (a K block's 48 KiB of tiles for twice the products of 32
// KiB: 0.75 of the bytes; NOTES, "642f5ff": the forms may be bound by how fast their tiles
// arrive). Each consumer warpgroup runs a K block as two m64n128k32 halves into one partial set,
// each waited for and promoted into its half of the accumulators (128 + 64 fp32 a thread), so the
// products and the promotion order of every output element are those of 128 x 128 tiles: bitwise
// the plain launch. 4 stages of 49 KiB.
template <FormKind kKind, Operand kOperand = Operand::bf16, bool kPair = false,
          bool kOverlap = false,
          bool kStagedStore = kKind == FormKind::kWeightGrad && kOperand == Operand::bf16,
          bool kWide = false>
struct Form {
  static constexpr FormKind kind = kKind;
  static constexpr Operand operand = kOperand;
  static constexpr bool kFp8 = kOperand == Operand::e4m3;
  static constexpr bool kKGrouped =
      kKind == FormKind::kWeightGrad || kKind == FormKind::kWeightGradContinued;
  static constexpr int kCluster = kPair ? 2 : 1;  // CTAs of a cluster
  static constexpr bool kOverlapPromotion = kOverlap;
  static_assert(!kPair || (kFp8 && !kKGrouped), "pairs: the M-grouped e4m3 forms");
  static_assert(!kOverlap || kFp8, "overlap: the e4m3 forms");
  static constexpr bool kWideTile = kWide;
  static_assert(!kWide || (kFp8 && !kKGrouped && !kPair && !kOverlap),
                "wide tiles: the M-grouped e4m3 forms, without pairs or the overlap");
  // NOTES: a separate instantiation, because accumulators defined by ordinary loads before the
  // first wgmma make ptxas serialize the wgmma pipeline (C7515) for the whole kernel.
  static constexpr bool kSeeded = kKind == FormKind::kWeightGradContinued;
  // 1: A is M-major, B N-major. e4m3 operands are K-major only: the K-grouped e4m3 form reads
  // the token-axis copies (the rows' transposes: K along the tokens), the input gradients the
  // weights' W^T copies.
  static constexpr int kTransA = kKGrouped && !kFp8 ? 1 : 0;
  static constexpr int kTransB = (kKind == FormKind::kRowsW || kKGrouped) && !kFp8 ? 1 : 0;

  static_assert(!kFp8 || kKind != FormKind::kRowsW, "e4m3 input gradients: kRowsWT over W^T");
  static constexpr int kTileN = kFp8 && !kWide ? 128 : 256;
  // The forms that compute input gradients (dh = dy W_down, dx = dg W_gate + du W_up): bf16 reads
  // W N-major (kRowsW); e4m3 reads the weight's transposed copy K-major, as rows x W^T. Both take
  // a second product into the same accumulators (GemmParams::k_blocks_first) and the input-gradient
  // epilogues (fp32 rows, the SwiGLU backward).
  static constexpr bool kInputGradient =
      kKind == FormKind::kRowsW || (kFp8 && kKind == FormKind::kRowsWT);
  // Elements of one K block: one 128-byte swizzled row of each operand (64 bf16, 128 e4m3).
  static constexpr int kBlockK = kFp8 ? 2 * kTileK : kTileK;
  // NOTES: the bf16 wgrad stores its tiles through shared memory and TMA (epilogue.cuh,
  // store_tile_tma): v4/v5 measured its short-K cells (2-16 K blocks a tile) bound by the
  // epilogue, and a TMA store lets the Consumers start the next tile while the copy engine writes
  // this one. Its 64 KiB staging tile costs the ring one stage; the e4m3 form's 32 KiB, one too.
  static constexpr bool kTmaStore = kStagedStore && kKind == FormKind::kWeightGrad;
  static_assert(!kStagedStore || kKind == FormKind::kWeightGrad ||
                    (kFp8 && kKind == FormKind::kRowsWT && !kWide && !kPair),
                "a staging tile: the plain wgrad, or the 128-wide e4m3 input gradients");
  static constexpr int kStages = kStagedStore ? (kFp8 ? 5 : 3) : kFp8 && !kWide ? 6 : 4;
  // A consumer warpgroup's accumulators: its 64 rows x kTileN columns, kTileN / 2 fp32 a thread.
  static constexpr int kAcc = kTileN / 2;
  static constexpr int kReaders = 8;  // consumer warps that read a stage
  static constexpr std::uint32_t kTileBBytes = kTileN * kTileK * 2;
  // An e4m3 K block's scales travel with it in its stage, after the tiles (1 KiB): the K-grouped
  // form's A's 128 rows' and B's 128 columns' (fp32, 1 x 128 along the tokens); the M-grouped
  // forms' A's 128 rows' and then the weight block's (gate/up: W_gate's, W_up's; wide tiles of
  // the other forms: the two 128-column blocks').
  static constexpr std::uint32_t kScaleBytes = kFp8 ? 1024 : 0;
  static_assert(!kFp8 || (kTileM + (kKGrouped ? kTileN : 2)) * 4 <= kScaleBytes,
                "scales overflow their stage");
  static constexpr std::uint32_t kStageBytes = kTileABytes + kTileBBytes + kScaleBytes;
  // Arrivals that complete a stage's full phase: the Producer's (with the stage's bulk bytes);
  // the M-grouped e4m3 forms add the one of the weight scales' copy (mainloop.cuh,
  // load_k_block), pairs the peer Producer's. Its empty phase: every consumer warp's of every CTA
  // of the cluster (a Producer may write its peer's stage); the e4m3 forms', whose consumer
  // threads also read the stage's scales, every consumer thread's (mainloop.cuh,
  // release_stage_fp8).
  static constexpr int kFullArrivals = (kFp8 && !kKGrouped ? 2 : 1) + (kCluster - 1);
  static constexpr int kEmptyArrivals = kReaders * (kFp8 ? 32 : 1) * kCluster;
  static constexpr std::uint32_t kStagingBytes = kStagedStore ? kTileM * kTileN * 2 : 0;
  static_assert(kStages * kStageBytes + kStagingBytes <= kRingBytes && kStages <= kMaxStages,
                "ring overflow");
  static_assert(kTileBBytes % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms misaligned");

  static constexpr int kOutTileN = kKind == FormKind::kGateUp ? kTileN / 2 : kTileN;
  static constexpr int kBoxRowsA = kTransA ? kTileK : kTileM;
  // M-grouped forms load B in two halves (mainloop.cuh, load_b_half): kTileN / 2 K-major rows a
  // box (gate/up: W_gate's and W_up's rows of the same output columns).
  static constexpr int kBoxRowsB = kTransB ? kTileK : kTileN / 2;
};

}  // namespace mok::gemm
