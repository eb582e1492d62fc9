// GPU unit tests of the PTX wrappers (src/cuda/ptx), one wrapper family at a time: each a small
// kernel whose output is compared exactly with what the host expects. Outputs are poisoned first,
// so anything left unwritten fails; inputs are random every run (printed, and replayed with
// MOK_TEST_SEED: test_seed.hpp). Waits are bounded and give up instead of trapping, so a broken
// wrapper fails its own test without poisoning the CUDA context for the others. Skipped (visibly)
// without an sm_90 GPU.
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "cuda/gemm/config.hpp"
#include "cuda/gemm/tensor_map.hpp"
#include "cuda/ptx/fence.cuh"
#include "cuda/ptx/flags.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "gpu_buffer.hpp"
#include "test_seed.hpp"

namespace {

using mok::test::DeviceBuffer;
using mok::test::next_seed;

namespace ptx = mok::ptx;
using mok::gemm::kChunkBytes;

constexpr std::uint16_t kPoison16 = 0xffff;

// Random 16-bit words that are neither 0 (the TMA's out-of-bounds fill) nor the poison.
std::vector<std::uint16_t> random_words(std::size_t n, std::mt19937_64& rng) {
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = static_cast<std::uint16_t>(1 + rng() % 0xfffe);
  return v;
}

// Counts mismatches and keeps a description of the first few for the failure message.
struct Mismatches {
  long long count = 0;
  std::string first;
  void check(std::uint64_t got, std::uint64_t want, const char* what, int i, int j) {
    if (got == want) return;
    if (++count <= 8) {
      char line[160];
      std::snprintf(line, sizeof line, "\n  %s (%d, %d): got 0x%llx, want 0x%llx", what, i, j,
                    static_cast<unsigned long long>(got), static_cast<unsigned long long>(want));
      first += line;
    }
  }
};

// NOTES: long enough for any of these tiny kernels under compute-sanitizer, short enough that a
// broken protocol fails quickly.
constexpr std::uint64_t kWaitTimeoutNs = 1'000'000'000ull;

// A bounded wait on an mbarrier phase that says what timed out: false after kWaitTimeoutNs (said
// once per warp).
__device__ bool wait_phase(std::uint64_t* bar, std::uint32_t parity) {
  const std::uint64_t start = ptx::global_timer_ns();
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
    if (ptx::global_timer_ns() - start > kWaitTimeoutNs) {
      if (threadIdx.x % 32 == 0) {
        printf("block %d thread %d: parity %u of the mbarrier at shared 0x%x timed out\n",
               blockIdx.x, threadIdx.x, parity, ptx::smem_addr(bar));
      }
      return false;
    }
  }
  return true;
}

// The dynamic shared memory, rounded up to the 1024-byte alignment of 128-byte swizzle atoms
// (launch with 1024 bytes more than used).
__device__ std::uint8_t* dynamic_smem_1024() {
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  const std::uint32_t a = ptx::smem_addr(smem_raw);
  return smem_raw + (1024 - a % 1024) % 1024;
}

// Byte offset of element (r, c), c < 64, of a box of 64-column bf16 rows in the 128-byte swizzle:
// the 16-byte piece c / 8 of row r sits at piece (c / 8) ^ (r % 8).
__host__ __device__ constexpr std::uint32_t swizzled_offset(int r, int c) {
  return r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

// A row-major bf16 matrix (raw bits) with ld >= cols; the words in [cols, ld) are padding.
struct Matrix {
  int rows, cols, ld;
  __host__ __device__ bool inside(int r, int c) const {
    return r >= 0 && r < rows && c >= 0 && c < cols;
  }
};

// ---------------------------------------------------------------------------------------------
// mbarrier

// One thread walks a barrier of count 2 through two phases; out[i] records each probe.
__global__ void mbarrier_parity_kernel(int* out) {
  __shared__ std::uint64_t bar;
  ptx::mbarrier_init(&bar, 2);
  int i = 0;
  // fresh: parity 1 counts as complete
  out[i++] = ptx::mbarrier_wait(&bar, 1, kWaitTimeoutNs, nullptr) == ptx::WaitStatus::complete;
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 1);
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 0);
  out[i++] = ptx::mbarrier_test_wait_parity(&bar, 1);
  out[i++] = ptx::mbarrier_test_wait_parity(&bar, 0);
  ptx::mbarrier_arrive(&bar);
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 0);  // one of two arrivals
  ptx::mbarrier_arrive(&bar);
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 0);  // phase 0 complete
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 1);  // phase 1 open
  out[i++] = ptx::mbarrier_test_wait_parity(&bar, 0);
  out[i++] = ptx::mbarrier_wait(&bar, 0, kWaitTimeoutNs, nullptr) == ptx::WaitStatus::complete;
  ptx::mbarrier_arrive(&bar);
  ptx::mbarrier_arrive(&bar);
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 1);  // phase 1 complete
  out[i++] = ptx::mbarrier_try_wait_parity(&bar, 0);  // phase 2 open
}

TEST(PtxMbarrier, ParityOfOneThreadsPhases) {
  MOK_REQUIRE_HOPPER();
  const std::vector<int> want = {1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 1, 0};
  DeviceBuffer<int> out(want.size());
  out.poison();
  mbarrier_parity_kernel<<<1, 1>>>(out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(out.download(), want)
      << "probes: wait(1) fresh, try(1) fresh, try(0) fresh, test(1) fresh, test(0) fresh, "
         "try(0) after 1 of 2 arrivals, try(0) after 2, try(1) after 2, test(0) after 2, wait(0), "
         "try(1) after 4, try(0) after 4";
}

// The bounded wait on a phase that never completes (a barrier of count 1, no arrival), by thread
// 0: mode 0 no abort flag (times out), mode 1 the flag already set (gives up at once), mode 2 the
// flag set by warp 1 after kAbortAfterNs (gives up then), mode 3 the flag set but the phase
// complete (completes: the flag is read only when the phase is not), mode 4 no flag, the phase
// owing 16 bytes of transactions, which warp 1 completes after kAbortAfterNs as a copy landing
// late would (a deadline shorter than that times out: the wait must not sleep until the bytes
// land; a longer one completes). out: [status, ns waited].
constexpr std::uint64_t kAbortAfterNs = 50'000;

__device__ void complete_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(
                   ptx::smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__global__ void bounded_wait_kernel(int mode, std::uint64_t timeout_ns, std::uint64_t* out) {
  __shared__ std::uint64_t bar;
  __shared__ int abort_flag;
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&bar, 1);
    abort_flag = mode == 1 || mode == 3 ? 1 : 0;
    if (mode == 3) ptx::mbarrier_arrive(&bar);
    if (mode == 4) ptx::mbarrier_arrive_expect_tx(&bar, 16);
  }
  __syncthreads();
  if (threadIdx.x == 32 && (mode == 2 || mode == 4)) {
    const std::uint64_t start = ptx::global_timer_ns();
    while (ptx::global_timer_ns() - start < kAbortAfterNs) {
    }
    if (mode == 2) atomicExch(&abort_flag, 1);
    if (mode == 4) complete_tx(&bar, 16);
  }
  if (threadIdx.x == 0) {
    const std::uint64_t t0 = ptx::global_timer_ns();
    const ptx::WaitStatus s = ptx::mbarrier_wait(&bar, 0, timeout_ns,
                                                 mode == 0 || mode == 4 ? nullptr : &abort_flag);
    out[1] = ptx::global_timer_ns() - t0;
    out[0] = static_cast<std::uint64_t>(s);
  }
}

TEST(PtxMbarrier, BoundedWaitTimesOutOrGivesUpOnAbortWithoutTrapping) {
  MOK_REQUIRE_HOPPER();
  constexpr std::uint64_t kShortNs = 2'000'000, kLongNs = 10'000'000'000ull;
  DeviceBuffer<std::uint64_t> out(2);
  struct Case {
    int mode;
    std::uint64_t timeout_ns;
    ptx::WaitStatus want;
    std::uint64_t min_ns, max_ns;
  };
  const Case cases[] = {
      {0, kShortNs, ptx::WaitStatus::timed_out, kShortNs, kShortNs + 50'000'000},
      {1, kLongNs, ptx::WaitStatus::aborted, 0, 1'000'000},
      {2, kLongNs, ptx::WaitStatus::aborted, kAbortAfterNs - 10'000, 100'000'000},
      {3, kLongNs, ptx::WaitStatus::complete, 0, 1'000'000},
      // NOTES (2026-12-06): before ptx::kShortWaitNs, a 1 ns deadline did not end the pairs
      // GEMM's waits on an H100. Short deadlines (non-blocking probes), then a long one.
      {4, 2'000, ptx::WaitStatus::timed_out, 2'000, kAbortAfterNs - 10'000},
      {4, 500'000, ptx::WaitStatus::complete, kAbortAfterNs - 10'000, 500'000},
      {4, kShortNs, ptx::WaitStatus::complete, kAbortAfterNs - 10'000, kShortNs},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("mode " + std::to_string(c.mode));
    out.poison();
    bounded_wait_kernel<<<1, 64>>>(c.mode, c.timeout_ns, out.get());
    MOK_CUDA_OK(cudaGetLastError());
    MOK_CUDA_OK(cudaDeviceSynchronize());  // no trap: the context survives every case
    const auto r = out.download();
    std::printf("[ mok ] mode %d, deadline %llu ns: status %llu after %llu ns\n", c.mode,
                static_cast<unsigned long long>(c.timeout_ns), static_cast<unsigned long long>(r[0]),
                static_cast<unsigned long long>(r[1]));
    EXPECT_EQ(r[0], static_cast<std::uint64_t>(c.want));
    EXPECT_GE(r[1], c.min_ns);
    EXPECT_LE(r[1], c.max_ns);
  }
}

// A full/empty pair of barriers passing kPhases batches of words from the producer warps (every
// thread arrives on `full` after writing its slot) to one waiter warp (which copies the slots out,
// then arrives once on `empty`). The slots are reused every phase, so a waiter that tracked the
// parity wrong would read a stale or a later batch, and producers that did would overwrite one.
constexpr int kProducerWarps = 4;
constexpr int kProducerThreads = 32 * kProducerWarps;
constexpr int kPhases = 7;

__global__ void mbarrier_pipeline_kernel(const std::uint32_t* values, std::uint32_t* out,
                                         int* timeouts) {
  __shared__ std::uint64_t full, empty;
  __shared__ std::uint32_t slot[kProducerThreads];
  const int t = threadIdx.x;
  if (t == 0) {
    ptx::mbarrier_init(&full, kProducerThreads);
    ptx::mbarrier_init(&empty, 1);
  }
  __syncthreads();
  bool ok = true;
  if (t < kProducerThreads) {
    for (int p = 0; p < kPhases; ++p) {
      ok = ok && wait_phase(&empty, (p & 1) ^ 1u);  // p = 0: a fresh barrier's parity 1
      slot[t] = values[p * kProducerThreads + t];
      ptx::mbarrier_arrive(&full);
    }
  } else {
    const int lane = t - kProducerThreads;
    for (int p = 0; p < kPhases; ++p) {
      ok = ok && wait_phase(&full, p & 1);
      for (int i = lane; i < kProducerThreads; i += 32) out[p * kProducerThreads + i] = slot[i];
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&empty);
    }
  }
  if (!ok) atomicAdd(timeouts, 1);
}

TEST(PtxMbarrier, PhasesAcrossWarps) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  std::vector<std::uint32_t> values(kPhases * kProducerThreads);
  for (auto& v : values) v = static_cast<std::uint32_t>(rng());
  DeviceBuffer<std::uint32_t> d_values(values), out(values.size());
  DeviceBuffer<int> timeouts(1);
  out.poison();
  MOK_CUDA_OK(cudaMemset(timeouts.get(), 0, sizeof(int)));
  mbarrier_pipeline_kernel<<<1, kProducerThreads + 32>>>(d_values.get(), out.get(), timeouts.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(timeouts.download()[0], 0) << "a wait timed out";
  const auto got = out.download();
  Mismatches bad;
  for (int p = 0; p < kPhases; ++p) {
    for (int t = 0; t < kProducerThreads; ++t) {
      bad.check(got[p * kProducerThreads + t], values[p * kProducerThreads + t], "phase, thread", p,
                t);
    }
  }
  EXPECT_EQ(bad.count, 0) << bad.first;
}

// ---------------------------------------------------------------------------------------------
// TMA tiled load (and arrive_expect_tx completed by its bytes)

// Loads the box at (c0, c1) into poisoned shared memory and copies the raw bytes out.
// probes[0]: waits that timed out; probes[1]: whether the phase was already complete after the
// arrival with expect_tx but before the load (it must not be: the bytes are still owed).
__global__ void tma_load_kernel(const __grid_constant__ CUtensorMap map, int c0, int c1,
                                std::uint32_t box_bytes, std::uint8_t* out, int* probes) {
  __shared__ std::uint64_t bar;
  std::uint8_t* box = dynamic_smem_1024();
  for (std::uint32_t i = threadIdx.x * 16; i < box_bytes; i += blockDim.x * 16) {
    *reinterpret_cast<uint4*>(box + i) = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
  ptx::fence_proxy_async_shared();  // the poison before the TMA's writes
  if (threadIdx.x == 0) {
    ptx::tma_prefetch_descriptor(&map);
    ptx::mbarrier_init(&bar, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&bar, box_bytes);
    probes[1] = ptx::mbarrier_try_wait_parity(&bar, 0);
    ptx::tma_load_2d(box, &map, &bar, c0, c1);
  }
  if (!wait_phase(&bar, 0)) atomicAdd(&probes[0], 1);
  for (std::uint32_t i = threadIdx.x * 16; i < box_bytes; i += blockDim.x * 16) {
    *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(box + i);
  }
}

// Element (r, c) of the box is matrix (c1 + r, c0 + c) at swizzled_offset(r, c), or 0 outside.
void check_box(const std::vector<std::uint16_t>& box, const std::vector<std::uint16_t>& matrix,
               const Matrix& m, int box_rows, int c0, int c1, const char* what) {
  Mismatches bad;
  for (int r = 0; r < box_rows; ++r) {
    for (int c = 0; c < 64; ++c) {
      const std::uint16_t want =
          m.inside(c1 + r, c0 + c) ? matrix[static_cast<std::size_t>(c1 + r) * m.ld + c0 + c] : 0;
      bad.check(box[swizzled_offset(r, c) / 2], want, what, r, c);
    }
  }
  EXPECT_EQ(bad.count, 0) << "box at (" << c0 << ", " << c1 << ") of " << box_rows << " rows"
                          << bad.first;
}

void run_tma_load(const Matrix& m, int box_rows, int c0, int c1, std::mt19937_64& rng) {
  SCOPED_TRACE("box at (" + std::to_string(c0) + ", " + std::to_string(c1) + "), " +
               std::to_string(box_rows) + " rows");
  const auto matrix = random_words(static_cast<std::size_t>(m.rows) * m.ld, rng);
  DeviceBuffer<std::uint16_t> d_matrix(matrix);
  const CUtensorMap map = mok::gemm::make_tensor_map_bf16(d_matrix.get(), m.rows, m.cols, m.ld,
                                                          box_rows, "test matrix");
  const std::uint32_t box_bytes = box_rows * 128;
  DeviceBuffer<std::uint16_t> out(box_bytes / 2);
  DeviceBuffer<int> probes(2);
  out.poison();
  probes.poison();
  MOK_CUDA_OK(cudaMemset(probes.get(), 0, sizeof(int)));
  tma_load_kernel<<<1, 128, box_bytes + 1024>>>(
      map, c0, c1, box_bytes, reinterpret_cast<std::uint8_t*>(out.get()), probes.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto p = probes.download();
  EXPECT_EQ(p[0], 0) << "the wait for the TMA's bytes timed out";
  EXPECT_EQ(p[1], 0) << "the phase completed before the expected bytes arrived";
  check_box(out.download(), matrix, m, box_rows, c0, c1, "box element");
}

TEST(PtxTma, LoadBoxesInsideTheMatrix) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const Matrix m{300, 296, 304};
  for (int box_rows : {8, 64, 128, 256}) {
    const int c0 = 8 * static_cast<int>(rng() % ((m.cols - 64) / 8 + 1));
    const int c1 = static_cast<int>(rng() % (m.rows - box_rows + 1));
    run_tma_load(m, box_rows, c0, c1, rng);
  }
}

TEST(PtxTma, LoadBoxesPartlyOutsideTheMatrixGiveZeros) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const Matrix m{77, 200, 208};  // columns [200, 208) are padding, outside the tensor
  run_tma_load(m, 64, m.cols - 24, m.rows - 10, rng);  // past the right and bottom edges
  run_tma_load(m, 64, -16, -3, rng);                   // before the left and top edges
  run_tma_load(m, 64, 0, m.rows, rng);                 // wholly below: all zeros
}

// ---------------------------------------------------------------------------------------------
// TMA store

// Writes `tile` (64 x 64, row-major) swizzled into shared memory with ordinary stores and stores
// it at (c0, c1). Once the store has read shared memory, the tile there is overwritten with zeros
// (a store that had not finished reading would write them); once its writes are done, thread 0
// reads the box back from global memory into `readback` (in-bounds elements only).
__global__ void tma_store_kernel(const __grid_constant__ CUtensorMap map, const std::uint16_t* tile,
                                 int c0, int c1, Matrix m, const std::uint16_t* matrix,
                                 std::uint16_t* readback) {
  std::uint8_t* box = dynamic_smem_1024();
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
    *reinterpret_cast<std::uint16_t*>(box + swizzled_offset(i / 64, i % 64)) = tile[i];
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (threadIdx.x != 0) return;
  ptx::tma_store_2d(&map, box, c0, c1);
  ptx::tma_store_commit();
  ptx::tma_store_wait_read<0>();
  for (int i = 0; i < 64 * 128 / 16; ++i) reinterpret_cast<uint4*>(box)[i] = make_uint4(0, 0, 0, 0);
  ptx::tma_store_wait<0>();
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 64; ++c) {
      if (m.inside(c1 + r, c0 + c)) {
        readback[r * 64 + c] = matrix[static_cast<std::size_t>(c1 + r) * m.ld + c0 + c];
      }
    }
  }
}

void run_tma_store(const Matrix& m, int c0, int c1, std::mt19937_64& rng) {
  SCOPED_TRACE("box at (" + std::to_string(c0) + ", " + std::to_string(c1) + ")");
  const auto tile = random_words(64 * 64, rng);
  DeviceBuffer<std::uint16_t> d_tile(tile), matrix(static_cast<std::size_t>(m.rows) * m.ld),
      readback(64 * 64);
  matrix.poison();
  readback.poison();
  const CUtensorMap map =
      mok::gemm::make_tensor_map_bf16(matrix.get(), m.rows, m.cols, m.ld, 64, "test output");
  tma_store_kernel<<<1, 128, 64 * 128 + 1024>>>(map, d_tile.get(), c0, c1, m, matrix.get(),
                                                readback.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  auto in_box = [&](int r, int c) { return r >= c1 && r < c1 + 64 && c >= c0 && c < c0 + 64; };
  const auto got = matrix.download();
  Mismatches bad;
  for (int r = 0; r < m.rows; ++r) {
    for (int c = 0; c < m.ld; ++c) {
      const std::uint16_t want =
          in_box(r, c) && m.inside(r, c) ? tile[(r - c1) * 64 + c - c0] : kPoison16;
      bad.check(got[static_cast<std::size_t>(r) * m.ld + c], want, "matrix element", r, c);
    }
  }
  EXPECT_EQ(bad.count, 0) << "the store wrote the wrong elements" << bad.first;
  const auto back = readback.download();
  Mismatches bad_back;
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 64; ++c) {
      const std::uint16_t want = m.inside(c1 + r, c0 + c) ? tile[r * 64 + c] : kPoison16;
      bad_back.check(back[r * 64 + c], want, "read back after tma_store_wait, box element", r, c);
    }
  }
  EXPECT_EQ(bad_back.count, 0) << bad_back.first;
}

TEST(PtxTma, StoreBoxInsideTheMatrix) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const Matrix m{150, 200, 208};
  const int c0 = 8 * static_cast<int>(rng() % ((m.cols - 64) / 8 + 1));
  const int c1 = static_cast<int>(rng() % (m.rows - 64 + 1));
  run_tma_store(m, c0, c1, rng);
}

TEST(PtxTma, StoreBoxesPartlyOutsideTheMatrixWriteOnlyInside) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const Matrix m{150, 200, 208};  // columns [200, 208) are padding: must stay poisoned
  run_tma_store(m, m.cols - 24, m.rows - 10, rng);
  run_tma_store(m, 0, m.rows - 1, rng);  // one row inside
  // NOTES: no negative coordinates here, unlike the loads: a store box starting at (-16, -3)
  // raised "illegal instruction" on the H200 (2026-12-02), so tma.cuh requires c0, c1 >= 0.
}

// ---------------------------------------------------------------------------------------------
// stmatrix

// Where row r of matrix i goes: 16-byte row slots interleaved and reversed, so that rows and
// matrices swapped by mistake land visibly elsewhere.
__host__ __device__ constexpr int stmatrix_slot(int matrix, int row) {
  return row * 4 + (3 - matrix);
}

// One warp; values[64 i + 8 r + c] is element (r, c) of matrix i. Shared memory holds 32 row slots
// of 8 b16, poisoned first, copied out raw afterwards.
__global__ void stmatrix_kernel(const std::uint16_t* values, std::uint16_t* out) {
  __shared__ __align__(16) std::uint16_t rows[32 * 8];
  const int lane = threadIdx.x;
  for (int i = lane; i < 32 * 8; i += 32) rows[i] = 0xffff;
  __syncwarp();
  auto pair = [&](int matrix) {  // row lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1
    const int e = 64 * matrix + 8 * (lane / 4) + 2 * (lane % 4);
    return std::uint32_t{values[e]} | (std::uint32_t{values[e + 1]} << 16);
  };
  const std::uint32_t address = ptx::smem_addr(rows) + stmatrix_slot(lane / 8, lane % 8) * 16;
  ptx::stmatrix_x4(address, pair(0), pair(1), pair(2), pair(3));
  __syncwarp();
  for (int i = lane; i < 32 * 8; i += 32) out[i] = rows[i];
}

TEST(PtxStmatrix, X4PutsEveryElementAtItsRowAndColumn) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  // 256 distinct values in random order: any misplaced element shows.
  std::vector<std::uint16_t> values(256);
  std::iota(values.begin(), values.end(), static_cast<std::uint16_t>(1 + rng() % 60000));
  std::shuffle(values.begin(), values.end(), rng);
  DeviceBuffer<std::uint16_t> d_values(values), out(256);
  out.poison();
  stmatrix_kernel<<<1, 32>>>(d_values.get(), out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto got = out.download();
  Mismatches bad;
  for (int i = 0; i < 4; ++i) {
    for (int r = 0; r < 8; ++r) {
      for (int c = 0; c < 8; ++c) {
        bad.check(got[stmatrix_slot(i, r) * 8 + c], values[64 * i + 8 * r + c],
                  "element (8 x matrix + row, column)", 8 * i + r, c);
      }
    }
  }
  EXPECT_EQ(bad.count, 0) << bad.first;
}

// ---------------------------------------------------------------------------------------------
// wgmma

// One K block (64) of D[64 x kN] (+)= A[64 x 64] B[64 x kN] by one warpgroup: 4 k16 steps with the
// descriptors built as mainloop.cuh's mma_k_block builds them. The operands arrive as ready-made
// shared-memory images (operand_image below); `seeded`: the accumulators start from `c`,
// otherwise from NaN with scale-d 0 on the first step.
// kARegs: A from registers instead (the _rs forms), each thread's fragment read from `a_rows`
// (row-major bf16 [64][64]) in the layout wgmma.cuh documents; kTransA is then unused.
template <int kN, int kTransA, int kTransB, bool kARegs = false>
__global__ void __launch_bounds__(128, 1)
    wgmma_kernel(const uint4* image_a, const uint4* image_b, const std::uint16_t* a_rows,
                 const float* c, int seeded, float* out) {
  constexpr std::uint32_t kABytes = 64 * 128, kBBytes = kN * 128;
  std::uint8_t* a = dynamic_smem_1024();
  std::uint8_t* b = a + kABytes;
  for (std::uint32_t i = threadIdx.x; i < kABytes / 16; i += 128) {
    reinterpret_cast<uint4*>(a)[i] = image_a[i];
  }
  for (std::uint32_t i = threadIdx.x; i < kBBytes / 16; i += 128) {
    reinterpret_cast<uint4*>(b)[i] = image_b[i];
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();

  // d[4j + r] holds D[16 w + l / 4 + 8 (r / 2)][8 j + 2 (l % 4) + r % 2] (wgmma.cuh).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto row = [&](int i) { return 16 * warp + lane / 4 + 8 * ((i % 4) / 2); };
  auto col = [&](int i) { return 8 * (i / 4) + 2 * (lane % 4) + i % 2; };
  float acc[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = seeded ? c[row(i) * kN + col(i)] : NAN;

  // As in mma_k_block: K-major operands step 32 bytes along a swizzled row per k16, M/N-major ones
  // 16 rows of 128 bytes; LBO 16 (unused) for K-major, the 64-wide chunk stride for M/N-major.
  constexpr std::uint32_t kStepA = kTransA ? 16 * 128 : 32;
  constexpr std::uint32_t kStepB = kTransB ? 16 * 128 : 32;
  constexpr std::uint32_t kLboA = kTransA ? kChunkBytes : 16;
  constexpr std::uint32_t kLboB = kTransB ? kChunkBytes : 16;
  const std::uint32_t a_base = ptx::smem_addr(a), b_base = ptx::smem_addr(b);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const std::uint64_t da = ptx::make_smem_desc_sw128(a_base + kk * kStepA, kLboA, 1024);
    const std::uint64_t db = ptx::make_smem_desc_sw128(b_base + kk * kStepB, kLboB, 1024);
    const int scale_d = kk > 0 || seeded ? 1 : 0;
    if constexpr (kARegs) {
      // a[i]: A[r][c], A[r][c + 1] with r = 16 w + l / 4 + 8 (i % 2), c = 16 kk + 2 (l % 4) + 8 (i
      // / 2).
      std::uint32_t frag[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 16 * warp + lane / 4 + 8 * (i % 2),
                  k = 16 * kk + 2 * (lane % 4) + 8 * (i / 2);
        frag[i] = std::uint32_t{a_rows[r * 64 + k]} | (std::uint32_t{a_rows[r * 64 + k + 1]} << 16);
      }
      if constexpr (kN == 256) {
        ptx::wgmma_m64n256k16_bf16_rs<kTransB>(acc, frag, db, scale_d);
      } else {
        ptx::wgmma_m64n128k16_bf16_rs<kTransB>(acc, frag, db, scale_d);
      }
    } else if constexpr (kN == 256) {
      ptx::wgmma_m64n256k16_bf16<kTransA, kTransB>(acc, da, db, scale_d);
    } else {
      ptx::wgmma_m64n128k16_bf16<kTransA, kTransB>(acc, da, db, scale_d);
    }
  }
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  ptx::fence_registers(acc);
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) out[row(i) * kN + col(i)] = acc[i];
}

// The shared-memory image of an operand x[mn][k] (64 k, 128-byte swizzle), laid out as the
// engine's TMA loads lay it: K-major, one 128-byte row of k per m (or n); M/N-major, 64-wide
// chunks of m (or n) kChunkBytes apart, each one 128-byte row of 64 m (or n) per k.
std::vector<std::uint16_t> operand_image(const std::vector<float>& x, int mn, bool mn_major) {
  std::vector<std::uint16_t> image(static_cast<std::size_t>(mn) * 64);
  for (int i = 0; i < mn; ++i) {
    for (int k = 0; k < 64; ++k) {
      const std::uint32_t byte =
          mn_major ? (i / 64) * kChunkBytes + swizzled_offset(k, i % 64) : swizzled_offset(i, k);
      image[byte / 2] = mok::float_to_bf16(x[i * 64 + k]);
    }
  }
  return image;
}

// Small non-zero integers: every product and sum below is exact in fp32, so the comparison is
// bitwise (and with no zero product, no result is -0).
std::vector<float> small_integers(std::size_t n, int max, std::mt19937_64& rng) {
  std::vector<float> v(n);
  for (auto& x : v) {
    const int k = 1 + static_cast<int>(rng() % max);
    x = static_cast<float>(rng() % 2 ? k : -k);
  }
  return v;
}

template <int kN, int kTransA, int kTransB, bool kARegs = false>
void run_wgmma(bool seeded) {
  SCOPED_TRACE(seeded ? "seeded" : "scale-d 0 first");
  std::mt19937_64 rng(next_seed());
  const auto a = small_integers(64 * 64, 4, rng);   // a[m * 64 + k]
  const auto bt = small_integers(kN * 64, 4, rng);  // bt[n * 64 + k] = B[k][n]
  const auto c = small_integers(64 * kN, 1000, rng);
  std::vector<float> want(64 * kN);
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < kN; ++n) {
      double d = seeded ? c[m * kN + n] : 0.0;
      for (int k = 0; k < 64; ++k) d += double{a[m * 64 + k]} * bt[n * 64 + k];
      want[m * kN + n] = static_cast<float>(d);
    }
  }
  DeviceBuffer<std::uint16_t> image_a(operand_image(a, 64, kTransA != 0));
  DeviceBuffer<std::uint16_t> image_b(operand_image(bt, kN, kTransB != 0));
  std::vector<std::uint16_t> rows(64 * 64);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = mok::float_to_bf16(a[i]);
  DeviceBuffer<std::uint16_t> a_rows(rows);
  DeviceBuffer<float> d_c(c), out(64 * kN);
  out.poison();
  constexpr int kSmem = (64 + kN) * 128 + 1024;
  wgmma_kernel<kN, kTransA, kTransB, kARegs><<<1, 128, kSmem>>>(
      reinterpret_cast<const uint4*>(image_a.get()), reinterpret_cast<const uint4*>(image_b.get()),
      a_rows.get(), d_c.get(), seeded ? 1 : 0, out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto got = out.download();
  Mismatches bad;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < kN; ++n) {
      std::uint32_t g, w;
      std::memcpy(&g, &got[m * kN + n], 4);
      std::memcpy(&w, &want[m * kN + n], 4);
      bad.check(g, w, "D bits", m, n);
    }
  }
  EXPECT_EQ(bad.count, 0) << bad.first;
}

TEST(PtxWgmma, M64N256K16AKMajorBKMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<256, 0, 0>(true);
  run_wgmma<256, 0, 0>(false);
}

TEST(PtxWgmma, M64N256K16AKMajorBNMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<256, 0, 1>(true);
  run_wgmma<256, 0, 1>(false);
}

TEST(PtxWgmma, M64N256K16AMMajorBNMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<256, 1, 1>(true);
  run_wgmma<256, 1, 1>(false);
}

TEST(PtxWgmma, M64N128K16AKMajorBKMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<128, 0, 0>(true);
  run_wgmma<128, 0, 0>(false);
}

TEST(PtxWgmma, M64N128K16AKMajorBNMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<128, 0, 1>(true);
  run_wgmma<128, 0, 1>(false);
}

TEST(PtxWgmma, M64N128K16AMMajorBNMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<128, 1, 1>(true);
  run_wgmma<128, 1, 1>(false);
}

TEST(PtxWgmma, M64N256K16ARegistersBKMajorAndNMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<256, 0, 0, true>(true);
  run_wgmma<256, 0, 0, true>(false);
  run_wgmma<256, 0, 1, true>(true);
  run_wgmma<256, 0, 1, true>(false);
}

TEST(PtxWgmma, M64N128K16ARegistersBKMajorAndNMajor) {
  MOK_REQUIRE_HOPPER();
  run_wgmma<128, 0, 0, true>(true);
  run_wgmma<128, 0, 0, true>(false);
  run_wgmma<128, 0, 1, true>(true);
  run_wgmma<128, 0, 1, true>(false);
}

// ---------------------------------------------------------------------------------------------
// setmaxnreg: the engine's budgets (config.hpp) in a kernel of its shape

// 384 threads at the 168-register entry cap; warpgroup 0 gives registers back, warpgroups 1 and 2
// take the Consumers' budget, then every thread writes its index (a budget the register file cannot
// grant would hang the increase, so completing is the check, together with every thread's word).
__global__ void __launch_bounds__(384, 1) setmaxnreg_kernel(std::uint32_t* out) {
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<mok::gemm::kProducerRegisters>();
  } else {
    ptx::setmaxnreg_inc<mok::gemm::kConsumerRegisters>();
  }
  out[threadIdx.x] = threadIdx.x + 1;
}

TEST(PtxSetmaxnreg, ProducerAndConsumerBudgets) {
  MOK_REQUIRE_HOPPER();
  DeviceBuffer<std::uint32_t> out(384);
  out.poison();
  setmaxnreg_kernel<<<1, 384>>>(out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto got = out.download();
  for (std::uint32_t t = 0; t < 384; ++t) ASSERT_EQ(got[t], t + 1) << "thread " << t;
}

// ---------------------------------------------------------------------------------------------
// Flags: release/acquire between blocks

// The consumer's waits: ptx::wait_at_least (acquire loads), or for the relaxed + fence pattern a
// bounded spin of relaxed loads, which the caller follows with fence_acq_rel.
template <ptx::Scope S>
__device__ bool wait_acquire(const std::uint32_t* flag, std::uint32_t target,
                             std::uint64_t timeout_ns, std::uint32_t* seen) {
  std::uint64_t waited = 0;
  return ptx::wait_at_least<S>(
      flag, target, timeout_ns, [] { return false; }, *seen, waited);
}

template <ptx::Scope S>
__device__ bool wait_relaxed(const std::uint32_t* flag, std::uint32_t target,
                             std::uint64_t timeout_ns, std::uint32_t* seen) {
  const std::uint64_t start = ptx::global_timer_ns();
  for (std::uint32_t spin = 0;; ++spin) {
    *seen = ptx::ld_relaxed<S>(flag);
    if (*seen >= target) return true;
    if ((spin & 31u) == 31u && ptx::global_timer_ns() - start > timeout_ns) return false;
  }
}

// Block 0 consumes, blocks 1-4 produce: producer p copies its kWords words of `src` into `data`,
// then signals. Producer 0: st_release on flags[0]; producer 1: fence_acq_rel + st_relaxed on
// flags[1]; producers 2 and 3: red_release_add on the counter flags[2]. The consumer waits for
// each signal in turn (acquire; for flags[1] relaxed loads + fence_acq_rel), then copies the data
// it covers to `seen`. Producers start late (p + 1) x 20 us so the consumer is already spinning.
constexpr int kFlagProducers = 4;
constexpr int kWords = 2048;
constexpr std::uint32_t kReady = 0x600du;

template <ptx::Scope S>
__global__ void flags_kernel(const std::uint32_t* src, std::uint32_t* data, std::uint32_t* flags,
                             std::uint32_t* seen, int* timeouts) {
  if (blockIdx.x > 0) {
    const int p = blockIdx.x - 1;
    if (threadIdx.x == 0) {
      const std::uint64_t start = ptx::global_timer_ns();
      while (ptx::global_timer_ns() - start < (p + 1) * 20'000ull) ptx::sleep_ns(1000);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kWords; i += blockDim.x) {
      data[p * kWords + i] = src[p * kWords + i];
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (p == 0) {
      ptx::st_release<S>(&flags[0], kReady);
    } else if (p == 1) {
      ptx::fence_acq_rel<S>();
      ptx::st_relaxed<S>(&flags[1], kReady);
    } else {
      ptx::red_release_add<S>(&flags[2], 1);
    }
    return;
  }
  for (int stage = 0; stage < 3; ++stage) {
    if (threadIdx.x == 0) {
      std::uint32_t last = 0;
      bool ok;
      if (stage == 0) {
        ok = wait_acquire<S>(&flags[0], kReady, kWaitTimeoutNs, &last);
      } else if (stage == 1) {
        ok = wait_relaxed<S>(&flags[1], kReady, kWaitTimeoutNs, &last);
        ptx::fence_acq_rel<S>();
      } else {
        ok = wait_acquire<S>(&flags[2], kFlagProducers - 2, kWaitTimeoutNs, &last);
      }
      if (!ok) {
        printf("consumer, stage %d: timed out, flag last seen %u\n", stage, last);
        atomicAdd(timeouts, 1);
      }
    }
    __syncthreads();
    const int first = stage * kWords, words = (stage < 2 ? 1 : 2) * kWords;
    for (int i = threadIdx.x; i < words; i += blockDim.x) seen[first + i] = data[first + i];
  }
}

template <ptx::Scope S>
void run_flags() {
  std::mt19937_64 rng(next_seed());
  std::vector<std::uint32_t> src(kFlagProducers * kWords);
  for (auto& v : src) v = static_cast<std::uint32_t>(rng());
  DeviceBuffer<std::uint32_t> d_src(src), data(src.size()), seen(src.size()), flags(3);
  DeviceBuffer<int> timeouts(1);
  data.poison();
  seen.poison();
  MOK_CUDA_OK(cudaMemset(flags.get(), 0, 3 * sizeof(std::uint32_t)));
  MOK_CUDA_OK(cudaMemset(timeouts.get(), 0, sizeof(int)));
  flags_kernel<S><<<1 + kFlagProducers, 256>>>(d_src.get(), data.get(), flags.get(), seen.get(),
                                               timeouts.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(timeouts.download()[0], 0) << "the consumer's wait timed out";
  const auto got = seen.download();
  Mismatches bad;
  for (int p = 0; p < kFlagProducers; ++p) {
    for (int i = 0; i < kWords; ++i) {
      bad.check(got[p * kWords + i], src[p * kWords + i], "producer, word", p, i);
    }
  }
  EXPECT_EQ(bad.count, 0) << "the consumer read data the signal did not cover" << bad.first;
  EXPECT_EQ(flags.download(), (std::vector<std::uint32_t>{kReady, kReady, kFlagProducers - 2}));
}

TEST(PtxFlags, ReleaseAcquireBetweenBlocksGpuScope) {
  MOK_REQUIRE_HOPPER();
  run_flags<ptx::Scope::gpu>();
}

TEST(PtxFlags, ReleaseAcquireBetweenBlocksSysScope) {
  MOK_REQUIRE_HOPPER();
  run_flags<ptx::Scope::sys>();
}

// Nobody signals: the bounded wait gives up, at the timeout or when give_up() says so at once.
// out: [returned, seen, ns elapsed, ns the wait reports].
__global__ void unsignalled_wait_kernel(const std::uint32_t* flag, std::uint64_t timeout_ns,
                                        int give_up, std::uint64_t* out) {
  const std::uint64_t t0 = ptx::global_timer_ns();
  std::uint32_t seen = ~0u;
  std::uint64_t waited = ~0ull;
  const bool ok = ptx::wait_at_least<ptx::Scope::gpu>(
      flag, 1, timeout_ns, [&] { return give_up != 0; }, seen, waited);
  out[2] = ptx::global_timer_ns() - t0;
  out[0] = ok;
  out[1] = seen;
  out[3] = waited;
}

TEST(PtxFlags, WaitWithoutSignalTimesOutOrGivesUp) {
  MOK_REQUIRE_HOPPER();
  constexpr std::uint64_t kTimeoutNs = 200'000;
  DeviceBuffer<std::uint32_t> flag(1);
  DeviceBuffer<std::uint64_t> out(4);
  MOK_CUDA_OK(cudaMemset(flag.get(), 0, sizeof(std::uint32_t)));
  for (int give_up = 0; give_up < 2; ++give_up) {
    SCOPED_TRACE(give_up ? "give_up() true" : "timeout");
    out.poison();
    unsignalled_wait_kernel<<<1, 1>>>(flag.get(), kTimeoutNs, give_up, out.get());
    MOK_CUDA_OK(cudaGetLastError());
    MOK_CUDA_OK(cudaDeviceSynchronize());
    const auto r = out.download();
    EXPECT_EQ(r[0], 0u) << "the wait reported a signal nobody sent";
    EXPECT_EQ(r[1], 0u) << "the flag's value as last seen";
    EXPECT_LE(r[3], r[2]) << "the wait reports more time than passed";
    if (give_up) {
      EXPECT_LT(r[3], kTimeoutNs) << "give_up() was not heeded before the timeout";
    } else {
      EXPECT_GT(r[3], kTimeoutNs) << "gave up before the timeout";
      EXPECT_LT(r[2], kTimeoutNs + 100'000'000) << "gave up long after the timeout";
    }
  }
}

// Every thread of the grid takes one value of a counter: the values taken are 0 .. n - 1, each
// once, and the counter ends at n.
__global__ void atom_inc_kernel(std::uint32_t* counter, std::uint32_t* taken) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  taken[i] = ptx::atom_inc_relaxed_gpu(counter);
}

TEST(PtxFlags, AtomIncHandsOutEveryValueOnce) {
  MOK_REQUIRE_HOPPER();
  constexpr int kBlocks = 132, kThreads = 96;
  constexpr std::uint32_t kStart = 7;
  DeviceBuffer<std::uint32_t> counter(1);
  DeviceBuffer<std::uint32_t> taken(kBlocks * kThreads);
  MOK_CUDA_OK(cudaMemcpy(counter.get(), &kStart, sizeof(kStart), cudaMemcpyHostToDevice));
  taken.poison();
  atom_inc_kernel<<<kBlocks, kThreads>>>(counter.get(), taken.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint32_t> values = taken.download();
  std::sort(values.begin(), values.end());
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(values[i], kStart + i) << "value " << i << " of those taken";
  }
  EXPECT_EQ(counter.download()[0], kStart + kBlocks * kThreads) << "the counter's final value";
}

// ---------------------------------------------------------------------------------------------
// Named barriers

// Two pairs of warps, each on its own named barrier (ids 1 and 2, 64 threads): warps 0 and 1 write
// shared memory, warps 2 and 3 read it after their pair's barrier. Warp 0 starts 20 us late, so
// warp 2 waits at barrier 1 while pair 1 goes through barrier 2.
__global__ void named_barrier_kernel(const std::uint32_t* in, std::uint32_t* out) {
  __shared__ std::uint32_t words[2][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pair = warp % 2, id = 1 + pair;
  if (warp < 2) {
    if (pair == 0) {
      const std::uint64_t start = ptx::global_timer_ns();
      while (ptx::global_timer_ns() - start < 20'000) {
      }
    }
    words[pair][lane] = in[pair * 32 + lane];
    ptx::named_barrier_sync(id, 64);
  } else {
    ptx::named_barrier_sync(id, 64);
    out[pair * 32 + lane] = words[pair][lane];
  }
}

TEST(PtxFence, NamedBarriersOrderTheirOwnWarps) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  std::vector<std::uint32_t> in(64);
  for (auto& v : in) v = static_cast<std::uint32_t>(rng());
  DeviceBuffer<std::uint32_t> d_in(in), out(64);
  out.poison();
  named_barrier_kernel<<<1, 128>>>(d_in.get(), out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(out.download(), in);
}

}  // namespace
