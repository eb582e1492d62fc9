// The delivery ceiling of the GEMM forms' operand loads (docs/perf/NOTES.md, "642f5ff"): how many
// bytes a second the tensor copy engine brings from L2/HBM into the SMs' shared-memory rings when
// nothing else limits it. A floor for the grouped GEMM forms: a form whose tiles need B bytes a
// FLOP cannot run faster than (this rate) / B, however its K loop is written.
//
// The kernel is the warp-specialized mainloop without the math: one Producer thread issues each
// K block's TMA boxes (A: a_rows x 128 bytes, B: b_rows x 128 bytes in one box, 128-byte swizzle;
// the forms load B as two boxes of half the rows, and the e4m3 forms also 1 KiB of scales a stage,
// which this bench leaves out: its e4m3 bytes a FLOP are 1.6% under theirs) into a ring of
// `stages` stages (the tile bytes only, so 7 stages of 32 KB fit where the e4m3 forms hold 6 of
// 33); eight consumer warps wait for each stage and
// release it at once, one arrival a warp, as the forms' consumers do after their wgmma. Persistent
// CTAs, one per SM, over a dense problem in the M-grouped forms' tile order (panels of kPanelM M
// tiles; within a panel N tile outer, M tile inner; CTA c runs tiles c, c + grid, ...). Every wait
// is bounded; a wait that gives up fails the run.
//
// Configurations: the bf16 forms' K block (128 x 256 tile, K 64: 48 KB), the e4m3 forms' (128 x
// 128, K 128: 32 KB) and the larger e4m3 tiles that would need fewer bytes a FLOP (128 x 192,
// 192 x 128, 128 x 256), each at every stage count that fits in shared memory. With no math the
// SM clock is not held down by the power limit as in a GEMM, so the rate is an upper bound.
//
// Usage: mok_supply_bench OUT.jsonl [COMMIT]. One JSON object a configuration and stage count:
// the median over 20 timed launches (CUDA events, L2 flushed before each, after 3 warm-ups), the
// TFLOP/s that rate allows at the configuration's bytes a FLOP, the mean SM clock over block 0's
// loads (clock64 over the global timer) and the rate in bytes a clock and SM, which carries over
// to the lower clocks a GEMM runs at under the power limit.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "cuda/gemm/config.hpp"
#include "cuda/gemm/tensor_map.hpp"
#include "cuda/ptx/fence.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"

namespace {

namespace ptx = mok::ptx;
namespace gemm = mok::gemm;

constexpr int kThreads = 384;  // one Producer warpgroup, two consumer warpgroups (the engine's)
constexpr int kConsumerWarps = 8;
constexpr int kBoxBytes = 128;  // one 128-byte swizzle row of K a box row
constexpr std::uint64_t kTimeoutNs = 2ull * 1000 * 1000 * 1000;

struct Problem {
  int m_tiles, n_tiles, k_blocks;
  int a_rows, b_rows;  // box rows of A and of B
  int stages;
  std::uint32_t stage_bytes;
};

struct Result {
  unsigned long long consumed;  // K blocks the consumers saw land, all CTAs
  int gave_up;                  // a wait passed its deadline
  long long cycles;             // block 0's Producer thread: SM clocks over its loop
  unsigned long long ns;        // and global-timer nanoseconds (its mean SM clock)
};

__device__ __forceinline__ bool wait_phase(std::uint64_t* bar, std::uint32_t parity,
                                           Result* result) {
  if (ptx::mbarrier_wait(bar, parity, kTimeoutNs, nullptr) == ptx::WaitStatus::complete) {
    return true;
  }
  atomicExch(&result->gave_up, 1);
  return false;
}

// Tile t of the M-grouped forms' order: (m tile, n tile).
__device__ __forceinline__ void tile_coords(const Problem& p, int t, int& m, int& n) {
  const int panel_tiles = gemm::kPanelM * p.n_tiles;
  const int panel = t / panel_tiles;
  const int i = t - panel * panel_tiles;
  const int m0 = panel * gemm::kPanelM;
  const int pm = min(gemm::kPanelM, p.m_tiles - m0);
  n = i / pm;
  m = m0 + i % pm;
}

__global__ void __launch_bounds__(kThreads, 1)
    supply_kernel(const __grid_constant__ CUtensorMap map_a,
                  const __grid_constant__ CUtensorMap map_b, Problem p, Result* result) {
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  std::uint8_t* ring = reinterpret_cast<std::uint8_t*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(ring + p.stages * p.stage_bytes);
  std::uint64_t* empty = full + p.stages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      ptx::mbarrier_init(full + s, 1);
      ptx::mbarrier_init(empty + s, kConsumerWarps);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const int tiles = p.m_tiles * p.n_tiles;
  const std::uint32_t a_bytes = static_cast<std::uint32_t>(p.a_rows) * kBoxBytes;
  int stage = 0;
  std::uint32_t phase = 0;
  if (warp == 0 && lane == 0) {  // the Producer
    const long long c0 = clock64();
    const unsigned long long t0 = ptx::global_timer_ns();
    bool ok = true;
    for (int t = blockIdx.x; ok && t < tiles; t += gridDim.x) {
      int m, n;
      tile_coords(p, t, m, n);
      for (int kb = 0; ok && kb < p.k_blocks; ++kb) {
        ok = wait_phase(empty + stage, phase ^ 1u, result);
        if (!ok) break;
        ptx::mbarrier_arrive_expect_tx(full + stage, p.stage_bytes);
        std::uint8_t* a = ring + stage * p.stage_bytes;
        ptx::tma_load_2d(a, &map_a, full + stage, kb * kBoxBytes, m * p.a_rows);
        ptx::tma_load_2d(a + a_bytes, &map_b, full + stage, kb * kBoxBytes, n * p.b_rows);
        if (++stage == p.stages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    // The loads in flight land before the CTA exits (a fresh barrier passes its wait).
    for (int s = 0; s < p.stages; ++s) {
      (void)wait_phase(full + s, s < stage ? phase : phase ^ 1u, result);
    }
    if (blockIdx.x == 0) {
      result->cycles = clock64() - c0;
      result->ns = ptx::global_timer_ns() - t0;
    }
  } else if (warp >= 4) {  // the consumer warps
    unsigned long long seen = 0;
    bool ok = true;
    for (int t = blockIdx.x; ok && t < tiles; t += gridDim.x) {
      for (int kb = 0; ok && kb < p.k_blocks; ++kb) {
        ok = wait_phase(full + stage, phase, result);
        if (!ok) break;
        ++seen;
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive(empty + stage);
        if (++stage == p.stages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    if (lane == 0) atomicAdd(&result->consumed, seen);
  }
}

struct Config {
  const char* name;
  int tile_m, tile_n, k_per_block;  // the GEMM tile a K block feeds, K elements a block
  int a_rows, b_rows;
  int k_bytes_per_element;
};

constexpr Config kConfigs[] = {
    {"bf16-128x256", 128, 256, 64, 128, 256, 2},  {"e4m3-128x128", 128, 128, 128, 128, 128, 1},
    {"e4m3-128x192", 128, 192, 128, 128, 192, 1}, {"e4m3-192x128", 192, 128, 128, 192, 128, 1},
    {"e4m3-128x256", 128, 256, 128, 128, 256, 1},
};

}  // namespace

int main(int argc, char** argv) {
  std::string commit;
  std::FILE* json = open_results(argc, argv, commit);
  int device = 0, sms = 0, max_smem = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  CHECK_CUDA(
      cudaFuncSetAttribute(supply_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));

  // A dense problem about the size of dsv3-ep8slice's gate/up (16 K rows of H = 7168 against the
  // 4096 rows of W_gate and W_up); K in bytes of the configuration's element type. Both row counts
  // are multiples of every box's rows (128, 192, 256).
  constexpr int kRows = 16128, kWeightRows = 4608, kK = 7168;
  const size_t max_k_bytes = size_t(kK) * 2;
  void *a = nullptr, *b = nullptr, *flush = nullptr;
  const size_t flush_bytes = 256u << 20;
  CHECK_CUDA(cudaMalloc(&a, size_t(kRows) * max_k_bytes));
  CHECK_CUDA(cudaMalloc(&b, size_t(kWeightRows) * max_k_bytes));
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  CHECK_CUDA(cudaMemset(a, 0x11, size_t(kRows) * max_k_bytes));
  CHECK_CUDA(cudaMemset(b, 0x22, size_t(kWeightRows) * max_k_bytes));
  Result* result = nullptr;
  CHECK_CUDA(cudaMalloc(&result, sizeof(Result)));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  std::printf("%s, %d SMs; %d x %d rows of K %d against %d weight rows\n", prop.name, sms, kRows,
              kK, kK, kWeightRows);
  std::printf("%-14s %6s %9s %9s %8s %14s %8s %11s\n", "config", "stages", "stage KB", "ms", "TB/s",
              "TFLOP/s bound", "SM MHz", "B/clk/SM");
  int failures = 0;
  for (const Config& c : kConfigs) {
    const std::int64_t k_bytes = std::int64_t(kK) * c.k_bytes_per_element;
    const CUtensorMap map_a = gemm::make_tensor_map_e4m3(a, kRows, k_bytes, k_bytes, c.a_rows, "a");
    const CUtensorMap map_b =
        gemm::make_tensor_map_e4m3(b, kWeightRows, k_bytes, k_bytes, c.b_rows, "b");
    Problem p{};
    p.m_tiles = kRows / c.a_rows;
    p.n_tiles = kWeightRows / c.b_rows;
    p.k_blocks = static_cast<int>(k_bytes / kBoxBytes);
    p.a_rows = c.a_rows;
    p.b_rows = c.b_rows;
    p.stage_bytes = static_cast<std::uint32_t>((c.a_rows + c.b_rows) * kBoxBytes);
    const double flop_per_block = 2.0 * c.tile_m * c.tile_n * c.k_per_block;
    const double bytes_per_flop = p.stage_bytes / flop_per_block;
    const unsigned long long expected =
        static_cast<unsigned long long>(p.m_tiles) * p.n_tiles * p.k_blocks * kConsumerWarps;
    for (int stages = 2;; ++stages) {
      const size_t smem = 1024 + size_t(stages) * p.stage_bytes + 2 * stages * 8;
      if (smem > static_cast<size_t>(max_smem) || stages > 8) break;
      p.stages = stages;
      std::vector<float> ms;
      std::vector<double> mhz;
      for (int r = 0; r < 23; ++r) {
        CHECK_CUDA(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
        CHECK_CUDA(cudaMemsetAsync(result, 0, sizeof(Result)));
        CHECK_CUDA(cudaEventRecord(start));
        supply_kernel<<<sms, kThreads, smem>>>(map_a, map_b, p, result);
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        Result host{};
        CHECK_CUDA(cudaMemcpy(&host, result, sizeof(Result), cudaMemcpyDeviceToHost));
        if (host.gave_up != 0 || host.consumed != expected) {
          std::fprintf(stderr,
                       "%s, %d stages: a wait gave up (%d) or K blocks lost (%llu of %llu)\n",
                       c.name, stages, host.gave_up, host.consumed, expected);
          ++failures;
          break;
        }
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
        if (r >= 3) {
          ms.push_back(t);
          mhz.push_back(host.ns > 0 ? 1e3 * double(host.cycles) / double(host.ns) : 0.0);
        }
      }
      if (ms.size() != 20) continue;
      std::sort(ms.begin(), ms.end());
      const double median = 0.5 * (ms[9] + ms[10]);
      const double bytes = double(p.stage_bytes) * p.m_tiles * p.n_tiles * p.k_blocks;
      const double tbs = bytes / (median * 1e-3) / 1e12;
      const double tflops = tbs / bytes_per_flop;
      std::sort(mhz.begin(), mhz.end());
      const double clock = mhz[mhz.size() / 2];
      // Bytes a clock and SM: the rate in a form that carries over to the power limit's clocks.
      const double per_clock = clock > 0 ? tbs * 1e12 / (clock * 1e6) / sms : 0.0;
      std::printf("%-14s %6d %9.1f %9.4f %8.2f %14.0f %8.0f %11.1f\n", c.name, stages,
                  p.stage_bytes / 1024.0, median, tbs, tflops, clock, per_clock);
      std::fprintf(
          json,
          "{\"suite\": \"supply\", \"gpu\": \"%s\", \"commit\": \"%s\", \"config\": \"%s\", "
          "\"stages\": %d, \"stage_bytes\": %u, \"median_ms\": %.5f, \"min_ms\": %.5f, "
          "\"max_ms\": %.5f, \"tb_per_s\": %.4f, \"bytes_per_flop\": %.6g, "
          "\"tflops_bound\": %.1f, \"sm_mhz\": %.0f, \"bytes_per_clock_per_sm\": %.2f}\n",
          prop.name, commit.c_str(), c.name, stages, p.stage_bytes, median, ms.front(), ms.back(),
          tbs, bytes_per_flop, tflops, clock, per_clock);
    }
  }
  std::fclose(json);
  return failures == 0 ? 0 : 1;
}
