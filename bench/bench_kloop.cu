// The ceiling of the GEMM forms' K loops (docs/perf/NOTES.md, "642f5ff"): how fast the consumer
// warpgroups run their wgmma, and the e4m3 promotion, when every stage is always in shared
// memory. The other floor beside mok_supply_bench's delivery rate: a form whose K loop alone runs
// at R TFLOP/s cannot run faster than R, however fast its tiles arrive.
//
// Two consumer warpgroups (and an idle Producer warpgroup, as in the engine) run the mainloop's
// own K-block code (mainloop.cuh: mma_k_block, mma_k_block_fp8, read_block_scales, promote_fp8)
// over the ring's stages in turn, filled once with finite e4m3 or bf16 bytes and scales of 1, with
// no barrier between K blocks (nor the stages' releases, release_stage_fp8's arrivals). One CTA an
// SM, long enough (tens of ms a launch, launches back to back) that the clock settles at the power
// limit, as under a real GEMM. Modes:
//   bf16              the bf16 forms' loop (m64n256k16, one group in flight)
//   e4m3-pipe         e4m3 m64n128k32, one group in flight and no promotion: the tensor pipe's rate
//   e4m3-wait         each K block waited for (wait_group 0), no promotion
//   e4m3-promote      the plain e4m3 loop: the block's scales read, waited for, promoted
//                     (mma_tile_fp8 without its barriers)
//   e4m3-overlap      the overlapped loop (mma_tile_fp8_overlap without its barriers): block
//                     kb + 1's wgmma in flight while block kb is promoted
//   e4m3-wide         the 128 x 256 loop (mma_tile_fp8_wide without its barriers): two halves
//                     a K block, each waited for and promoted
//   e4m3-wide-fill    e4m3-wide while one Producer thread streams bulk copies into the same stages
//                     (their tiles, not their scales) as fast as they complete, from a 4 MiB
//                     buffer the L2 holds, up to kStages copies of a stage's 48 KiB in flight:
//                     the wide loop with the shared-memory writes of its tiles' delivery beside
//                     its wgmma's reads, which neither ceiling alone has (NOTES, "51c7fa2"). The
//                     copies' bytes are finite e4m3 like the fill's, so the products stay finite;
//                     what they are does not matter to the timing. Reported beside the rate: the
//                     bytes a clock and SM the copies moved.
//   e4m3-wide-pipeline  the wide loop fed as the engine feeds it: the Producer thread copies K
//                     block kb's tiles into stage kb % kStages once every consumer thread released
//                     the stage's previous round (an empty barrier of 256 arrivals, as
//                     release_stage_fp8), arming a full barrier the consumers wait on (bounded,
//                     as the engine's waits) before each K block; the same copies as
//                     e4m3-wide-fill. Between e4m3-wide-fill and the form itself: what the
//                     stage protocol costs the loop, without the epilogue, the tile scheduling,
//                     the tensor maps or the scales' copies (NOTES, "51c7fa2": about 280 cycles a
//                     K block separate the form from the loop beside its delivery). Waits that
//                     gave up are counted (`timeouts`); any makes the row void.
//   e4m3-wide-tma     e4m3-wide-pipeline fed by the form's own loads: the Producer thread runs
//                     load_k_block (mainloop.cuh) on the ring's own full and empty barriers (the
//                     engine's arrival counts): each K block's A and B tiles by TMA through tensor
//                     maps over a dense problem of dsv3-ep8slice's gate/up size in HBM (16,128 x
//                     7,168 e4m3 rows against 4,608 weight rows, as mok_supply_bench), tiles in the
//                     M-grouped forms' order (panels of kPanelM M tiles, N tile outer), 56 K blocks
//                     a tile; and the block's scales as the form copies them (its rows' 512 bytes
//                     by a bulk copy, the weight blocks' two floats by cp.async), all 1.0. Against
//                     e4m3-wide-pipeline: what the real operand and scale loads cost the loop a K
//                     block (NOTES, "709b383": l2w-h7168 could not tell); against the form: what is
//                     left is its epilogue and its tile scheduling.
//   e4m3-wide-tma-noscales  the same without the scales' copies (the stages' scales stay 1; the
//                     Producer arrives once more on the full barrier in place of the cp.async's
//                     arrival).
//   e4m3-wide-tma-epilogue  e4m3-wide-tma with the tile turns' work: after a tile's 56th K block
//                     the consumers store it as the down forward's epilogue does (store_plain,
//                     bf16 rows of 256 columns, into a [16,128, 4,608] buffer in HBM) and start the
//                     next tile from zero, while the Producer goes on loading its first stages.
//                     Against e4m3-wide-tma: what the epilogue and the turn cost a tile, the part
//                     of the form's loss that neither the loop nor its loads explain (NOTES,
//                     "2026-12-06, 48e4578 and 0f0bd7b").
//   e4m3-tokens       the weight gradient's loop (mma_tile_fp8_tokens without its barriers):
//                     the 1D1D promotion, a row scale times a column scale for every accumulator
//   e4m3-tokens-overlap  the same overlapped (mma_tile_fp8_tokens_overlap)
// How to read the last two beside e4m3-promote: the weight gradient's loop issues a multiply
// more an accumulator and block (NOTES, "642f5ff": 0.73-0.93x the bf16 wgrad); if e4m3-tokens
// sits at the wgrad forms' rate, the promotion's instructions bind them, not their tiles.
// Reported: TFLOP/s (2 x 128 x 128 x 128 a K block and CTA for e4m3, the same for bf16's 128 x
// 256 x 64) and the mean SM clock over the launch (clock64 over the global timer on one thread).
//
// Usage: mok_kloop_bench OUT.jsonl [COMMIT]: one JSON object a mode; the median of 15 launches
// after 3 warm-ups.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/mainloop.cuh"
#include "cuda/gemm/tensor_map.hpp"

namespace {

namespace gemm = mok::gemm;
namespace ptx = mok::ptx;

using Bf16Form = gemm::Form<gemm::FormKind::kRowsWT>;
using E4m3Form = gemm::Form<gemm::FormKind::kRowsWT, gemm::Operand::e4m3>;
using E4m3WideForm =
    gemm::Form<gemm::FormKind::kRowsWT, gemm::Operand::e4m3, false, false, false, true>;
using E4m3TokensForm = gemm::Form<gemm::FormKind::kWeightGrad, gemm::Operand::e4m3>;

enum class Mode {
  bf16,
  e4m3_pipe,
  e4m3_wait,
  e4m3_promote,
  e4m3_overlap,
  e4m3_wide,
  e4m3_wide_fill,
  e4m3_wide_pipeline,
  e4m3_wide_tma,
  e4m3_wide_tma_noscales,
  e4m3_wide_tma_epilogue,
  e4m3_tokens,
  e4m3_tokens_overlap
};

constexpr int kThreads = 384;
// K blocks a CTA and launch, passed as the kernel's argument: with the count a constant, ptxas
// serialized the overlapped loops' wgmma (C7514), which the engine's loops, counting blocks at
// run time, are not.
constexpr int kBlocks = 40000;

struct Clocks {
  long long cycles;
  unsigned long long ns;
  unsigned long long fill_bytes;  // e4m3-wide-fill and -pipeline: bytes CTA 0's copies delivered
  unsigned int timeouts;          // e4m3-wide-pipeline: waits that gave up, all CTAs
};

constexpr std::size_t kFillSourceBytes = 4u << 20;

// e4m3-wide-tma's operands: the dense problem (mok_supply_bench's) and the scales' arrays.
constexpr int kTmaRows = 16128, kTmaWeightRows = 4608, kTmaK = 7168;
constexpr int kTmaKBlocks = kTmaK / 128;
struct TmaOperands {
  CUtensorMap a, b;       // [kTmaRows, kTmaK] and [kTmaWeightRows, kTmaK] e4m3, K-major
  const float* a_scales;  // [kTmaKBlocks, kTmaRows]: each row's scale of each K block
  const float* b_scales;  // [kTmaWeightRows / 128, kTmaKBlocks]: the weight blocks'
  __nv_bfloat16* out;     // [kTmaRows, kTmaWeightRows]: e4m3-wide-tma-epilogue's tiles
};

template <Mode kMode>
constexpr bool kTmaMode = kMode == Mode::e4m3_wide_tma || kMode == Mode::e4m3_wide_tma_noscales ||
                          kMode == Mode::e4m3_wide_tma_epilogue;

// K block kb of a CTA's walk in e4m3-wide-tma: its tile (CTA c takes tiles c, c + grid, ... of the
// M-grouped order, wrapping around the problem) and the block within it.
__device__ __forceinline__ gemm::TileInfo tma_tile(int kb, int& k_block) {
  constexpr int kMTiles = kTmaRows / gemm::kTileM, kNTiles = kTmaWeightRows / 256;
  const int t = (blockIdx.x + (kb / kTmaKBlocks) * gridDim.x) % (kMTiles * kNTiles);
  const int panel_tiles = gemm::kPanelM * kNTiles;
  const int panel = t / panel_tiles, i = t - panel * panel_tiles;
  const int m_first = panel * gemm::kPanelM;
  const int pm = min(gemm::kPanelM, kMTiles - m_first);
  k_block = kb % kTmaKBlocks;
  return {0, 0, kTmaRows, (m_first + i % pm) * gemm::kTileM, i / pm, kTmaKBlocks};
}

template <class F, Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    kloop_kernel(float* sink, Clocks* clocks, int blocks, const std::uint8_t* fill_source,
                 const __grid_constant__ TmaOperands ops) {
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  std::uint8_t* base = reinterpret_cast<std::uint8_t*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  const gemm::SharedRing<F> ring{base};
  // Finite operands: e4m3 bytes with the exponent never all ones (no NaN), bf16 halves of
  // moderate magnitude; scales 1.
  for (std::uint32_t i = threadIdx.x; i < F::kStages * F::kStageBytes / 4; i += blockDim.x) {
    std::uint32_t h = (i + 1) * 2654435761u;
    h ^= h >> 15;
    reinterpret_cast<std::uint32_t*>(base)[i] = F::kFp8 ? (h & 0xb7b7b7b7u) : (h & 0x3f7f3f7fu);
  }
  __syncthreads();
  if constexpr (F::kFp8) {
    for (int s = 0; s < F::kStages; ++s) {
      float* scales = reinterpret_cast<float*>(ring.scales(s));
      for (int i = threadIdx.x; i < int(F::kScaleBytes / 4); i += blockDim.x) scales[i] = 1.0f;
    }
  }
  // e4m3-wide-fill: one barrier a stage for its copies, and the consumers' end flag, after the
  // stages; e4m3-wide-pipeline: those barriers as the stages' full barriers, then their empty
  // barriers (make_run allots the 128 bytes).
  std::uint64_t* fill_bars = reinterpret_cast<std::uint64_t*>(base + F::kStages * F::kStageBytes);
  std::uint64_t* empty_bars = fill_bars + F::kStages;
  volatile int* consumers_done = reinterpret_cast<volatile int*>(empty_bars + F::kStages);
  constexpr int kReleases = 256;  // every consumer thread releases a stage (release_stage_fp8)
  if constexpr (kMode == Mode::e4m3_wide_fill || kMode == Mode::e4m3_wide_pipeline) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < F::kStages; ++s) {
        ptx::mbarrier_init(&fill_bars[s], 1);
        ptx::mbarrier_init(&empty_bars[s], kReleases);
      }
      *consumers_done = 0;
    }
  }
  if constexpr (kTmaMode<kMode>) {
    if (threadIdx.x == 0) {
      ring.init_barriers();  // the engine's arrival counts: the Producer and the cp.async, 256
      ptx::fence_barrier_init();
    }
  }
  ptx::fence_proxy_async_shared();  // the generic writes above, before wgmma reads them
  __syncthreads();
  // The engine's register budgets (config.hpp): the overlapped and wide loops hold 192
  // accumulators a thread, more than the 168 a thread has at entry.
  if (threadIdx.x < 128) {  // the idle Producer warpgroup (e4m3-wide-fill: its first thread copies)
    ptx::setmaxnreg_dec<gemm::kProducerRegisters>();
    if constexpr (kMode == Mode::e4m3_wide_fill) {
      if (threadIdx.x != 0) return;
      constexpr std::uint32_t kTileBytes = gemm::kTileABytes + F::kTileBBytes;  // 48 KiB
      constexpr std::uint32_t kCopy = 16384;
      static_assert(kTileBytes % kCopy == 0, "whole copies a stage");
      constexpr std::uint64_t kWaitNs = 1'000'000'000;  // a bench's bound: a copy that never lands
      std::uint32_t phase = 0;  // of stage s's barrier, for its next wait (bit s)
      std::size_t offset = blockIdx.x * std::size_t{kCopy} % kFillSourceBytes;
      unsigned long long copies = 0;
      for (int s = 0; *consumers_done == 0; s = (s + 1) % F::kStages) {
        if (copies >= F::kStages) {  // the stage's previous copies landed
          if (ptx::mbarrier_wait(&fill_bars[s], (phase >> s) & 1u, kWaitNs, nullptr) !=
              ptx::WaitStatus::complete) {
            break;
          }
          phase ^= 1u << s;
        }
        ptx::mbarrier_arrive_expect_tx(&fill_bars[s], kTileBytes);
        for (std::uint32_t c = 0; c < kTileBytes; c += kCopy) {
          ptx::bulk_load(ring.a(s) + c, fill_source + offset, kCopy, &fill_bars[s]);
          offset = (offset + kCopy) % kFillSourceBytes;
        }
        ++copies;
      }
      // The copies in flight land before the CTA may exit.
      for (unsigned long long i = copies > F::kStages ? copies - F::kStages : 0; i < copies; ++i) {
        const int s = static_cast<int>(i % F::kStages);
        (void)ptx::mbarrier_wait(&fill_bars[s], (phase >> s) & 1u, kWaitNs, nullptr);
        phase ^= 1u << s;
      }
      if (blockIdx.x == 0) clocks->fill_bytes = copies * kTileBytes;
    }
    if constexpr (kMode == Mode::e4m3_wide_pipeline) {
      if (threadIdx.x != 0) return;
      constexpr std::uint32_t kTileBytes = gemm::kTileABytes + F::kTileBBytes;  // 48 KiB
      constexpr std::uint32_t kCopy = 16384;
      constexpr std::uint64_t kWaitNs = 1'000'000'000;
      std::size_t offset = blockIdx.x * std::size_t{kCopy} % kFillSourceBytes;
      for (int kb = 0; kb < blocks; ++kb) {
        const int s = kb % F::kStages;
        const int round = kb / F::kStages;
        // The stage's previous round released by every consumer thread (round r's releases
        // complete the empty barrier's phase r - 1).
        if (round > 0 && ptx::mbarrier_wait(&empty_bars[s], (round - 1) & 1, kWaitNs, nullptr) !=
                             ptx::WaitStatus::complete) {
          atomicAdd(&clocks->timeouts, 1u);
        }
        ptx::mbarrier_arrive_expect_tx(&fill_bars[s], kTileBytes);
        for (std::uint32_t c = 0; c < kTileBytes; c += kCopy) {
          ptx::bulk_load(ring.a(s) + c, fill_source + offset, kCopy, &fill_bars[s]);
          offset = (offset + kCopy) % kFillSourceBytes;
        }
      }
      // Every copy is waited for by the consumers before they finish, so none is in flight
      // when the CTA exits.
      if (blockIdx.x == 0) clocks->fill_bytes = std::uint64_t(blocks) * kTileBytes;
    }
    if constexpr (kTmaMode<kMode>) {
      if (threadIdx.x != 0) return;
      constexpr std::uint64_t kWaitNs = 1'000'000'000;
      const gemm::TensorMaps maps{&ops.a, &ops.b, nullptr, nullptr};
      gemm::GemmParams p{};
      p.b_rows_per_group = kTmaWeightRows;
      gemm::Fp8Params fp8{};
      fp8.a = ops.a_scales;
      fp8.a_ld = kTmaRows;
      fp8.b = ops.b_scales;
      fp8.b_n_blocks = kTmaWeightRows / 128;
      fp8.b_k_blocks = kTmaKBlocks;
      for (int kb = 0; kb < blocks; ++kb) {
        const int s = kb % F::kStages;
        const int round = kb / F::kStages;
        if (round > 0 && ptx::mbarrier_wait(ring.empty(s), (round - 1) & 1, kWaitNs, nullptr) !=
                             ptx::WaitStatus::complete) {
          atomicAdd(&clocks->timeouts, 1u);
        }
        int k_block = 0;
        const gemm::TileInfo tile = tma_tile(kb, k_block);
        if constexpr (kMode != Mode::e4m3_wide_tma_noscales) {
          gemm::load_k_block<F>(maps, ring, s, tile, k_block, p, &fp8);
        } else {
          ptx::mbarrier_arrive_expect_tx(ring.full(s), gemm::kTileABytes + F::kTileBBytes);
          ptx::tma_load_2d(ring.a(s), maps.a, ring.full(s), k_block * F::kBlockK, tile.m0);
          gemm::load_b_half<F>(maps, ring, s, tile, k_block, p, 0);
          gemm::load_b_half<F>(maps, ring, s, tile, k_block, p, 1);
          ptx::mbarrier_arrive(ring.full(s));  // the cp.async's arrival, which this mode has not
        }
      }
      if (blockIdx.x == 0) {
        clocks->fill_bytes = std::uint64_t(blocks) * (gemm::kTileABytes + F::kTileBBytes);
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<gemm::kConsumerRegisters>();
  const int consumer_wg = threadIdx.x / 128 - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const bool timer = threadIdx.x == 128 && blockIdx.x == 0;
  long long c0 = 0;
  unsigned long long t0 = 0;
  if (timer) c0 = clock64(), t0 = ptx::global_timer_ns();
  float acc[F::kAcc];
  // Not in the pipe and wait modes, whose first wgmma step starts acc (scale-d 0): accumulators
  // that ordinary writes define before a wgmma would serialize its pipeline (C7515).
  if constexpr (kMode != Mode::e4m3_pipe && kMode != Mode::e4m3_wait) {
#pragma unroll
    for (int i = 0; i < F::kAcc; ++i) acc[i] = 0.0f;
  }
  if constexpr (kMode == Mode::bf16) {
    for (int kb = 0; kb < blocks; ++kb) {
      gemm::mma_k_block<F>(acc, ring, kb % F::kStages, consumer_wg);
      ptx::wgmma_wait_group<1>();
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(acc);
  } else if constexpr (kMode == Mode::e4m3_promote) {
    const int row = consumer_wg * 64 + warp * 16 + lane / 4;
    float partial[F::kAcc];
    for (int kb = 0; kb < blocks; ++kb) {
      const int s = kb % F::kStages;
      gemm::mma_k_block_fp8<F>(partial, ring, s, consumer_wg);
      const gemm::Fp8BlockScales scales = gemm::read_block_scales<F>(ring, s, row);
      ptx::wgmma_wait_group<0>();
      ptx::fence_registers(partial);
      gemm::promote_fp8<F>(acc, partial, scales);
    }
    ptx::fence_registers(acc);
  } else if constexpr (kMode == Mode::e4m3_overlap) {
    const int row = consumer_wg * 64 + warp * 16 + lane / 4;
    float partial[2][F::kAcc];
    gemm::Fp8BlockScales scales[2];
    const auto issue = [&](auto j, int kb) {
      constexpr int J = decltype(j)::value;
      gemm::mma_k_block_fp8<F>(partial[J], ring, kb % F::kStages, consumer_wg);
      scales[J] = gemm::read_block_scales<F>(ring, kb % F::kStages, row);
    };
    const auto finish = [&](auto j) {
      constexpr int J = decltype(j)::value;
      ptx::fence_registers(partial[J]);
      gemm::promote_fp8<F>(acc, partial[J], scales[J]);
    };
    gemm::overlapped_k_loop(blocks, issue, finish);
    ptx::fence_registers(acc);
  } else if constexpr (kMode == Mode::e4m3_wide || kMode == Mode::e4m3_wide_fill ||
                       kMode == Mode::e4m3_wide_pipeline || kTmaMode<kMode>) {
    // mma_tile_fp8_wide's loop; e4m3-wide-pipeline and -tma: with its waits and releases, on the
    // bench's barriers or the ring's own.
    constexpr bool kPipeline = kMode == Mode::e4m3_wide_pipeline || kTmaMode<kMode>;
    std::uint64_t* const full_bars = kTmaMode<kMode> ? ring.full(0) : fill_bars;
    std::uint64_t* const release_bars = kTmaMode<kMode> ? ring.empty(0) : empty_bars;
    const int row = consumer_wg * 64 + warp * 16 + lane / 4;
    float partial[64];
    unsigned int gave_up = 0;
    for (int kb = 0; kb < blocks; ++kb) {
      const int s = kb % F::kStages;
      if constexpr (kPipeline) {
        gave_up += ptx::mbarrier_wait(&full_bars[s], (kb / F::kStages) & 1, 1'000'000'000,
                                      nullptr) != ptx::WaitStatus::complete;
      }
      gemm::mma_k_block_fp8<F>(partial, ring, s, consumer_wg, 0);
      const gemm::Fp8BlockScales scales = gemm::read_block_scales<F>(ring, s, row);
      ptx::wgmma_wait_group<0>();
      ptx::fence_registers(partial);
      gemm::promote_fp8_half<F, 0>(acc, partial, scales);
      gemm::mma_k_block_fp8<F>(partial, ring, s, consumer_wg, 1);
      ptx::wgmma_wait_group<0>();
      ptx::fence_registers(partial);
      if constexpr (kPipeline) ptx::mbarrier_arrive(&release_bars[s]);
      gemm::promote_fp8_half<F, 1>(acc, partial, scales);
      if constexpr (kMode == Mode::e4m3_wide_tma_epilogue) {
        if ((kb + 1) % kTmaKBlocks == 0) {  // the tile's last K block: its epilogue, the turn
          int k_block = 0;
          const gemm::TileInfo tile = tma_tile(kb, k_block);
          gemm::GemmParams p{};
          p.out = ops.out;
          p.ld_out = kTmaWeightRows;
          p.n = kTmaWeightRows;
          gemm::store_plain<F, gemm::epilogue::RowsBf16<false, false>>(
              acc, tile, p, consumer_wg, warp, lane);
#pragma unroll
          for (int i = 0; i < F::kAcc; ++i) acc[i] = 0.0f;
        }
      }
    }
    ptx::fence_registers(acc);
    if (gave_up != 0) atomicAdd(&clocks->timeouts, gave_up);
  } else if constexpr (kMode == Mode::e4m3_tokens) {
    float partial[F::kAcc];
    for (int kb = 0; kb < blocks; ++kb) {
      const int s = kb % F::kStages;
      gemm::mma_k_block_fp8<F>(partial, ring, s, consumer_wg);
      const gemm::TokenBlockScales<F> scales =
          gemm::read_token_block_scales<F>(ring, s, consumer_wg, warp, lane);
      ptx::wgmma_wait_group<0>();
      ptx::fence_registers(partial);
      gemm::promote_tokens<F>(acc, partial, scales);
    }
    ptx::fence_registers(acc);
  } else if constexpr (kMode == Mode::e4m3_tokens_overlap) {
    float partial[2][F::kAcc];
    int stage[2];
    const auto issue = [&](auto j, int kb) {
      constexpr int J = decltype(j)::value;
      gemm::mma_k_block_fp8<F>(partial[J], ring, kb % F::kStages, consumer_wg);
      stage[J] = kb % F::kStages;
    };
    const auto finish = [&](auto j) {
      constexpr int J = decltype(j)::value;
      ptx::fence_registers(partial[J]);
      const gemm::TokenBlockScales<F> scales =
          gemm::read_token_block_scales<F>(ring, stage[J], consumer_wg, warp, lane);
      gemm::promote_tokens<F>(acc, partial[J], scales);
    };
    gemm::overlapped_k_loop(blocks, issue, finish);
    ptx::fence_registers(acc);
  } else {
    // Every K block's 4 k32 steps accumulate into acc (mma_k_block_fp8's steps with scale-d 1
    // after the very first). NOTES ("58329ee"): with each block overwriting acc, as
    // mma_k_block_fp8 does, ptxas dropped every block's wgmma but the last (dead results) and the
    // modes timed 3x the tensor cores' peak.
    const std::uint32_t a0 = ptx::smem_addr(ring.a(0)) + consumer_wg * (gemm::kTileABytes / 2);
    const std::uint32_t b0 = ptx::smem_addr(ring.b(0));
    for (int kb = 0; kb < blocks; ++kb) {
      const std::uint32_t stage = (kb % F::kStages) * F::kStageBytes;
      const std::uint64_t da = ptx::make_smem_desc_sw128(a0 + stage, 16, 1024);
      const std::uint64_t db = ptx::make_smem_desc_sw128(b0 + stage, 16, 1024);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < F::kBlockK / 32; ++kk) {
        ptx::wgmma_m64n128k32_e4m3(acc, ptx::smem_desc_advance(da, kk * 32),
                                   ptx::smem_desc_advance(db, kk * 32), (kb | kk) != 0);
      }
      ptx::wgmma_commit_group();
      if constexpr (kMode == Mode::e4m3_pipe) {
        ptx::wgmma_wait_group<1>();
      } else {
        ptx::wgmma_wait_group<0>();
        ptx::fence_registers(acc);
      }
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(acc);
  }
  if constexpr (kMode == Mode::e4m3_wide_fill) {
    if (threadIdx.x == 128) *consumers_done = 1;  // the Producer's copies stop
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < F::kAcc; ++i) sum += acc[i];
  sink[blockIdx.x * kThreads + threadIdx.x] = sum;  // keeps the loop's results live
  if (timer) {
    clocks->cycles = clock64() - c0;
    clocks->ns = ptx::global_timer_ns() - t0;
  }
}

struct Run {
  const char* name;
  void (*kernel)(float*, Clocks*, int, const std::uint8_t*, TmaOperands);
  std::uint32_t smem;
  double flop_per_block;  // a CTA's
};

template <class F, Mode kMode>
Run make_run(const char* name) {
  // e4m3-wide-fill's barriers and flag after the stages: 128 bytes; e4m3-wide-tma: the engine's
  // layout (the ring's barriers after kRingBytes).
  const std::uint32_t smem =
      kTmaMode<kMode> ? gemm::kSharedBytes : F::kStages * F::kStageBytes + 1024 + 128;
  CHECK_CUDA(cudaFuncSetAttribute(kloop_kernel<F, kMode>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return {name, kloop_kernel<F, kMode>, smem, 2.0 * gemm::kTileM * F::kTileN * F::kBlockK};
}

}  // namespace

int main(int argc, char** argv) {
  std::string commit;
  std::FILE* json = open_results(argc, argv, commit);
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  float* sink = nullptr;
  Clocks* clocks = nullptr;
  CHECK_CUDA(cudaMalloc(&sink, size_t(sms) * kThreads * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&clocks, sizeof(Clocks)));
  // e4m3-wide-fill's source: finite e4m3 bytes (exponent never all ones), as the stages' fill.
  std::uint8_t* fill_source = nullptr;
  CHECK_CUDA(cudaMalloc(&fill_source, kFillSourceBytes));
  CHECK_CUDA(cudaMemset(fill_source, 0x35, kFillSourceBytes));
  // e4m3-wide-tma's operands: finite e4m3 bytes, every scale 1.0.
  void *tma_a = nullptr, *tma_b = nullptr;
  float *a_scales = nullptr, *b_scales = nullptr;
  const std::size_t a_scale_count = std::size_t(kTmaKBlocks) * kTmaRows;
  const std::size_t b_scale_count = std::size_t(kTmaWeightRows / 128) * kTmaKBlocks;
  CHECK_CUDA(cudaMalloc(&tma_a, std::size_t(kTmaRows) * kTmaK));
  CHECK_CUDA(cudaMalloc(&tma_b, std::size_t(kTmaWeightRows) * kTmaK));
  __nv_bfloat16* tma_out = nullptr;  // e4m3-wide-tma-epilogue's output tiles
  CHECK_CUDA(cudaMalloc(&tma_out, std::size_t(kTmaRows) * kTmaWeightRows * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&a_scales, a_scale_count * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&b_scales, b_scale_count * sizeof(float)));
  CHECK_CUDA(cudaMemset(tma_a, 0x35, std::size_t(kTmaRows) * kTmaK));
  CHECK_CUDA(cudaMemset(tma_b, 0x35, std::size_t(kTmaWeightRows) * kTmaK));
  const std::vector<float> ones(a_scale_count, 1.0f);
  CHECK_CUDA(cudaMemcpy(a_scales, ones.data(), a_scale_count * sizeof(float),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b_scales, ones.data(), b_scale_count * sizeof(float),
                        cudaMemcpyHostToDevice));
  const TmaOperands ops{
      gemm::make_tensor_map_e4m3(tma_a, kTmaRows, kTmaK, kTmaK, E4m3WideForm::kBoxRowsA, "a"),
      gemm::make_tensor_map_e4m3(tma_b, kTmaWeightRows, kTmaK, kTmaK, E4m3WideForm::kBoxRowsB,
                                 "b"),
      a_scales, b_scales, tma_out};
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const Run runs[] = {
      make_run<Bf16Form, Mode::bf16>("bf16"),
      make_run<E4m3Form, Mode::e4m3_pipe>("e4m3-pipe"),
      make_run<E4m3Form, Mode::e4m3_wait>("e4m3-wait"),
      make_run<E4m3Form, Mode::e4m3_promote>("e4m3-promote"),
      make_run<E4m3Form, Mode::e4m3_overlap>("e4m3-overlap"),
      make_run<E4m3WideForm, Mode::e4m3_wide>("e4m3-wide"),
      make_run<E4m3WideForm, Mode::e4m3_wide_fill>("e4m3-wide-fill"),
      make_run<E4m3WideForm, Mode::e4m3_wide_pipeline>("e4m3-wide-pipeline"),
      make_run<E4m3WideForm, Mode::e4m3_wide_tma_noscales>("e4m3-wide-tma-noscales"),
      make_run<E4m3WideForm, Mode::e4m3_wide_tma>("e4m3-wide-tma"),
      make_run<E4m3WideForm, Mode::e4m3_wide_tma_epilogue>("e4m3-wide-tma-epilogue"),
      make_run<E4m3TokensForm, Mode::e4m3_tokens>("e4m3-tokens"),
      make_run<E4m3TokensForm, Mode::e4m3_tokens_overlap>("e4m3-tokens-overlap"),
  };
  std::printf("%s, %d SMs, %d K blocks a CTA and launch\n", prop.name, sms, kBlocks);
  std::printf("%-20s %9s %9s %9s %10s\n", "mode", "ms", "TFLOP/s", "SM MHz", "fill B/clk");
  for (const Run& r : runs) {
    std::vector<float> ms;
    std::vector<double> mhz, fill;  // fill: CTA 0's copied bytes over its consumer's cycles
    unsigned int timeouts = 0;      // waits that gave up, over the repetitions
    for (int rep = 0; rep < 18; ++rep) {
      CHECK_CUDA(cudaMemset(clocks, 0, sizeof(Clocks)));
      CHECK_CUDA(cudaEventRecord(start));
      r.kernel<<<sms, kThreads, r.smem>>>(sink, clocks, kBlocks, fill_source, ops);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      if (rep < 3) continue;
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      Clocks c{};
      CHECK_CUDA(cudaMemcpy(&c, clocks, sizeof(Clocks), cudaMemcpyDeviceToHost));
      ms.push_back(t);
      mhz.push_back(c.ns > 0 ? 1e3 * double(c.cycles) / double(c.ns) : 0.0);
      fill.push_back(c.cycles > 0 ? double(c.fill_bytes) / double(c.cycles) : 0.0);
      timeouts += c.timeouts;
    }
    std::vector<float> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    std::sort(mhz.begin(), mhz.end());
    const double clock = mhz[mhz.size() / 2];
    std::sort(fill.begin(), fill.end());
    const double fill_rate = fill[fill.size() / 2];
    const double tflops = r.flop_per_block * kBlocks * sms / (median * 1e-3) / 1e12;
    std::printf("%-20s %9.3f %9.0f %9.0f %10.1f%s\n", r.name, median, tflops, clock, fill_rate,
                timeouts != 0 ? "  VOID: waits gave up" : "");
    std::fprintf(json,
                 "{\"suite\": \"kloop\", \"gpu\": \"%s\", \"commit\": \"%s\", \"mode\": \"%s\", "
                 "\"median_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, \"tflops\": %.1f, "
                 "\"sm_mhz\": %.0f, \"fill_bytes_per_clock_sm\": %.2f, \"timeouts\": %u}\n",
                 prop.name, commit.c_str(), r.name, median, sorted.front(), sorted.back(), tflops,
                 clock, fill_rate, timeouts);
  }
  std::fclose(json);
  return 0;
}
