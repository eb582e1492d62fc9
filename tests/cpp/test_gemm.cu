// GPU tests of the grouped GEMM engine (src/cuda/gemm/grouped_gemm.hpp): every form against an
// fp32 reference kernel written independently of the engine (plain loads, one fp32 accumulator
// an output, k in increasing order), on random inputs drawn anew each run (printed, and replayed
// with MOK_TEST_SEED: test_seed.hpp). Every output row is checked, at every size, the PERF.md
// ones included; rows that hold no value (padding, past the groups) must stay poison. Skipped
// (visibly) without a Hopper GPU.
//
// Tolerances, per row: a row's error is ||got - want|| / ||want|| over that row alone, so one bad
// row, or one bad tile of a row, fails however many good rows there are. The engine and the
// reference both accumulate in fp32 and differ only in summation order; the outputs then differ
// only where that tiny difference crosses a bf16 rounding boundary, by one bf16 ulp (relative
// u = 2^-8). So a path with r bf16 roundings is bounded by r * u (a bound on every element, so on
// every row: it holds even if every element of the row flipped). fp32 outputs: bounded by the
// worst-case fp32 summation error, K * 2^-24.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/numerics.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "gemm_layout.hpp"
#include "gemm_test_waits.hpp"
#include "gpu_buffer.hpp"
#include "mok/error.hpp"
#include "support/kernel_hooks.hpp"
#include "test_seed.hpp"

namespace {

using mok::test::DeviceBuffer;
using mok::test::next_seed;

using mok::bf16_t;
using mok::gemm::RowSegments;
using mok::test::host_pass;
using mok::test::HostPass;
using mok::test::Layout;
constexpr double kU = 1.0 / 256.0;  // bf16 unit roundoff (2^-8)

// Every launch of these tests (but those of the timeout tests, which bring their own) goes
// through run_form(), which gives it the binary's wait bound and report (gemm_test_waits.hpp); a
// listener names the test during which a wait gave up, and the binary then fails.
template <class Args>
void run_form(void (*form)(const Args&), Args args) {
  args.waits = mok::test::gemm_test_waits();
  form(args);
}

bool g_gave_up = false;  // some test's launch gave up on a wait

// Reads the report after each test (its launches have completed: every test synchronizes before
// it checks its outputs) and names the test whose launch gave up.
class GiveUpListener : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!mok::test::hopper_skip_reason().empty()) return;
    (void)cudaDeviceSynchronize();  // a failed test may have left a launch running
    const std::string text = mok::test::gemm_test_report().take();
    if (text.empty()) return;
    g_gave_up = true;
    std::printf("[ mok ] a GEMM launch of %s.%s gave up (its outputs are void): %s\n",
                info.test_suite_name(), info.name(), text.c_str());
    std::fflush(stdout);
  }
};

class GiveUpCheck : public ::testing::Environment {
  void TearDown() override {
    EXPECT_FALSE(g_gave_up) << "a GEMM launch gave up on a wait (see the '[ mok ]' line above); "
                               "under compute-sanitizer set MOK_TEST_GEMM_TIMEOUT_S";
  }
};

[[maybe_unused]] const bool kWatching = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new GiveUpListener);
  ::testing::AddGlobalTestEnvironment(new GiveUpCheck);
  return true;
}();

__device__ std::uint32_t hash32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

// Uniform values in [-scale, scale), different for every (seed, index).
__global__ void fill_random_kernel(__nv_bfloat16* p, std::size_t n, std::uint64_t seed,
                                   float scale) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const float u = (hash32(seed * 0x9E3779B97F4A7C15ull + i) >> 8) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * scale);
  }
}

void fill_random(DeviceBuffer<__nv_bfloat16>& b, float scale) {
  fill_random_kernel<<<1024, 256>>>(b.get(), b.size(), next_seed(), scale);
}

std::vector<int> random_counts(int groups, int mean, std::mt19937_64& rng) {
  std::vector<int> c(groups);
  for (auto& v : c) v = static_cast<int>(rng() % (2 * mean + 1));
  return c;
}

float bf(bf16_t v) {
  return mok::bf16_to_float(v);
}

// ---------------------------------------------------------------------------------------------
// The fp32 references of every output row, and the check of every row against them.
//
// Each reference output is one fp32 accumulator, k (wgrad: the group's rows) in increasing order
// with fma, from plain loads: written independently of the engine (no tensor cores, no TMA, no
// shared code), and the same sums as a one-thread-per-output loop. A block computes kRefRows
// output rows of kRefCols columns, one column a thread, from operands staged in shared memory
// kRefK at a time, so each weight element is read once per kRefRows rows: the references of the
// PERF.md sizes (about 2e12 FMAs in all) take a fraction of a second where one row a block would
// take tens of seconds.
constexpr int kRefCols = 128;  // threads of a reference block: one output column each
constexpr int kRefRows = 16;   // output rows of a block: the accumulators of a thread
constexpr int kRefK = 32;      // reduction steps staged in shared memory at a time
// A staged step's kRefRows values of A, padded: float4 reads stay 16-byte aligned (80 bytes a
// step) and the stores of consecutive steps spread over more banks.
constexpr int kRefStride = kRefRows + 4;

// acc[i] = fma(a[i], b, acc[i]) for the kRefRows values of one staged step (float4 reads).
__device__ __forceinline__ void fma_step(const float* a_step, float b, float (&acc)[kRefRows]) {
  const float4* a4 = reinterpret_cast<const float4*>(a_step);
#pragma unroll
  for (int q = 0; q < kRefRows / 4; ++q) {
    const float4 v = a4[q];
    acc[4 * q + 0] = __fmaf_rn(v.x, b, acc[4 * q + 0]);
    acc[4 * q + 1] = __fmaf_rn(v.y, b, acc[4 * q + 1]);
    acc[4 * q + 2] = __fmaf_rn(v.z, b, acc[4 * q + 2]);
    acc[4 * q + 3] = __fmaf_rn(v.w, b, acc[4 * q + 3]);
  }
}

// Rows [row0, row0 + rows) of a row buffer, all of group `group`; rows <= kRefRows.
struct RefTile {
  int row0, rows, group;
};

// out[r, n] = sum_k A[r, k] * B_g(k, n) for the rows r of tile blockIdx.y (group g), every other
// row of out untouched. trans_b = 0: B_g = W[g]^T, W [G, N, K]; trans_b = 1: B_g = W[g],
// W [G, K, N]. out has ld n_cols.
__global__ void __launch_bounds__(kRefCols)
    ref_rows_kernel(const __nv_bfloat16* a, long long lda, const __nv_bfloat16* w, int trans_b,
                    const RefTile* tiles, int n_cols, int k_dim, float* out) {
  __shared__ __align__(16) float a_s[kRefK][kRefStride];  // [k][row]
  __shared__ float w_s[kRefK][kRefCols + 1];              // [k][column], padded: no bank conflicts
  const RefTile t = tiles[blockIdx.y];
  const int tid = threadIdx.x, n0 = blockIdx.x * kRefCols;
  const long long g = t.group;
  float acc[kRefRows];
#pragma unroll
  for (int r = 0; r < kRefRows; ++r) acc[r] = 0.0f;
  for (int k0 = 0; k0 < k_dim; k0 += kRefK) {
    const int kc = min(kRefK, k_dim - k0);
    __syncthreads();  // every thread is done with the previous step's values
    for (int i = tid; i < kRefRows * kRefK; i += kRefCols) {  // consecutive threads: along k
      const int r = i / kRefK, kk = i % kRefK;
      a_s[kk][r] = r < t.rows && kk < kc ? __bfloat162float(a[(t.row0 + r) * lda + k0 + kk]) : 0.0f;
    }
    for (int i = tid; i < kRefK * kRefCols; i += kRefCols) {
      // Consecutive threads read consecutive elements of W: along n (trans_b) or along k.
      const int kk = trans_b ? i / kRefCols : i % kRefK;
      const int c = trans_b ? i % kRefCols : i / kRefK;
      const long long n = n0 + c, k = k0 + kk;
      float v = 0.0f;
      if (n < n_cols && kk < kc) {
        v = __bfloat162float(trans_b ? w[(g * k_dim + k) * n_cols + n]
                                     : w[(g * n_cols + n) * k_dim + k]);
      }
      w_s[kk][c] = v;
    }
    __syncthreads();
    for (int kk = 0; kk < kc; ++kk) fma_step(a_s[kk], w_s[kk][tid], acc);
  }
  const int n = n0 + tid;
  if (n >= n_cols) return;
#pragma unroll
  for (int r = 0; r < kRefRows; ++r) {
    if (r < t.rows) out[static_cast<long long>(t.row0 + r) * n_cols + n] = acc[r];
  }
}

// out[g, m, n] = sum over the rows r of group g = blockIdx.z, in increasing order, of
// A[r, m] * B[r, n] (+0 for an empty group), for m in the block's kRefRows rows.
__global__ void __launch_bounds__(kRefCols)
    ref_wgrad_kernel(const __nv_bfloat16* a, int lda, const __nv_bfloat16* b, int ldb,
                     const int* starts, const int* counts, int m_dim, int n_cols, float* out) {
  __shared__ __align__(16) float a_s[kRefK][kRefStride];  // [row of the group][m]
  __shared__ float b_s[kRefK][kRefCols];                  // [row of the group][column]
  const int g = blockIdx.z, m0 = blockIdx.y * kRefRows, tid = threadIdx.x;
  const int n = blockIdx.x * kRefCols + tid;
  const int start = starts[g], count = counts[g];
  float acc[kRefRows];
#pragma unroll
  for (int i = 0; i < kRefRows; ++i) acc[i] = 0.0f;
  for (int r0 = 0; r0 < count; r0 += kRefK) {
    const int rc = min(kRefK, count - r0);
    __syncthreads();  // every thread is done with the previous step's values
    for (int i = tid; i < kRefK * kRefRows; i += kRefCols) {  // consecutive threads: along m
      const int rr = i / kRefRows, mm = i % kRefRows;
      a_s[rr][mm] =
          rr < rc && m0 + mm < m_dim
              ? __bfloat162float(a[static_cast<long long>(start + r0 + rr) * lda + m0 + mm])
              : 0.0f;
    }
    for (int rr = 0; rr < kRefK; ++rr) {
      b_s[rr][tid] = rr < rc && n < n_cols
                         ? __bfloat162float(b[static_cast<long long>(start + r0 + rr) * ldb + n])
                         : 0.0f;
    }
    __syncthreads();
    for (int rr = 0; rr < rc; ++rr) fma_step(a_s[rr], b_s[rr][tid], acc);
  }
  if (n >= n_cols) return;
#pragma unroll
  for (int i = 0; i < kRefRows; ++i) {
    if (m0 + i < m_dim) out[(static_cast<long long>(g) * m_dim + m0 + i) * n_cols + n] = acc[i];
  }
}

// The rows of a row buffer [capacity] that hold a value: rows [starts[g], starts[g] + counts[g])
// of every group g. The dense form's rows [0, counts[0]) are those of its one group.
std::vector<char> kept_rows(const std::vector<int>& starts, const std::vector<int>& counts,
                            int capacity) {
  std::vector<char> kept(capacity, 0);
  for (std::size_t g = 0; g < counts.size(); ++g) {
    for (int r = starts[g]; r < starts[g] + counts[g]; ++r) kept[r] = 1;
  }
  return kept;
}

// The fp32 reference [capacity, n] of every kept row of an M-grouped product of `a` (ld lda) and
// `w` (ref_rows_kernel's trans_b); every other row NaN. Waits for it.
void reference_rows(const std::vector<int>& starts, const std::vector<int>& counts,
                    const DeviceBuffer<__nv_bfloat16>& a, long long lda,
                    const DeviceBuffer<__nv_bfloat16>& w, int trans_b, int n, int k,
                    DeviceBuffer<float>& out) {
  out.poison();  // a kept row the reference missed is NaN: the check fails on it
  std::vector<RefTile> tiles;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    for (int r = 0; r < counts[g]; r += kRefRows) {
      tiles.push_back({starts[g] + r, std::min(kRefRows, counts[g] - r), static_cast<int>(g)});
    }
  }
  if (tiles.empty()) return;
  const DeviceBuffer<RefTile> d_tiles(tiles);
  constexpr std::size_t kMaxGridY = 65535;
  for (std::size_t t0 = 0; t0 < tiles.size(); t0 += kMaxGridY) {
    const auto blocks = static_cast<unsigned>(std::min(kMaxGridY, tiles.size() - t0));
    ref_rows_kernel<<<dim3((n + kRefCols - 1) / kRefCols, blocks), kRefCols>>>(
        a.get(), lda, w.get(), trans_b, d_tiles.get() + t0, n, k, out.get());
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "reference launch";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "reference";
}

// The fp32 reference [G, m, n] of a wgrad of `a` [capacity, m] and `b` [capacity, n] over the
// groups of (d_starts, d_counts). Waits for it.
void reference_wgrad(const int* d_starts, const int* d_counts, int groups,
                     const DeviceBuffer<__nv_bfloat16>& a, int m,
                     const DeviceBuffer<__nv_bfloat16>& b, int n, DeviceBuffer<float>& out) {
  out.poison();
  ref_wgrad_kernel<<<dim3((n + kRefCols - 1) / kRefCols, (m + kRefRows - 1) / kRefRows, groups),
                     kRefCols>>>(a.get(), m, b.get(), n, d_starts, d_counts, m, n, out.get());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "reference launch";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "reference";
}

// What a kept output row must hold, element by element, from the fp32 references r1 (and r2)
// laid out as the output.
enum class Want : int {
  ref,      // r1
  scaled,   // fp32(r1 * scale[row]): a row-scaled product (the scale applied once, in fp32)
  sum,      // r1 + r2, exact (double): two products in one accumulator
  rounded,  // bf16(r1): a pre-activation, stored rounded
  swiglu,   // bf16(swiglu(bf16(r1), bf16(r2))): the hidden of gate r1 and up r2
};

// One output row's error sums (row_error_kernel).
struct RowError {
  double diff2;  // kept row: sum of (got - want)^2
  double want2;  // kept row: sum of want^2
  int nan;       // kept row: NaN outputs (unwritten, or padding leaked in)
  int want_nan;  // kept row: NaN references (a row the reference missed: a bug of the test)
  int written;   // other rows: outputs no longer poison
};

__device__ __forceinline__ double value_of(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ double value_of(float v) {
  return v;
}
__device__ __forceinline__ bool is_poison(__nv_bfloat16 v) {
  return __bfloat16_as_ushort(v) == 0xffff;
}
__device__ __forceinline__ bool is_poison(float v) {
  return __float_as_uint(v) == 0xffffffffu;
}
__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

constexpr int kErrorThreads = 256;

// errors[row] for row = blockIdx.x of an output [rows, n_cols] (ld n_cols) and its references (the
// same layout); a fixed-order tree sum, so the same data give the same sums.
template <typename Out>
__global__ void __launch_bounds__(kErrorThreads)
    row_error_kernel(const Out* got, const char* kept, Want want, const float* r1, const float* r2,
                     const float* scale, int n_cols, RowError* errors) {
  __shared__ double s_diff[kErrorThreads], s_want[kErrorThreads];
  __shared__ int s_nan[kErrorThreads], s_want_nan[kErrorThreads], s_written[kErrorThreads];
  const long long row = blockIdx.x, base = row * n_cols;
  const int tid = threadIdx.x;
  double diff2 = 0, want2 = 0;
  int nan = 0, want_nan = 0, written = 0;
  for (int c = tid; c < n_cols; c += kErrorThreads) {
    const long long i = base + c;
    if (!kept[row]) {
      written += !is_poison(got[i]);
      continue;
    }
    const double x = value_of(got[i]);
    double w = 0;
    switch (want) {
      case Want::ref:
        w = r1[i];
        break;
      case Want::scaled:
        w = r1[i] * scale[row];  // an fp32 product, rounded once
        break;
      case Want::sum:
        w = double(r1[i]) + double(r2[i]);
        break;
      case Want::rounded:
        w = round_bf16(r1[i]);
        break;
      case Want::swiglu:
        w = round_bf16(mok::numerics::swiglu(round_bf16(r1[i]), round_bf16(r2[i])));
        break;
    }
    nan += isnan(x);
    want_nan += isnan(w);
    diff2 += (x - w) * (x - w);
    want2 += w * w;
  }
  s_diff[tid] = diff2;
  s_want[tid] = want2;
  s_nan[tid] = nan;
  s_want_nan[tid] = want_nan;
  s_written[tid] = written;
  __syncthreads();
  for (int s = kErrorThreads / 2; s > 0; s /= 2) {
    if (tid < s) {
      s_diff[tid] += s_diff[tid + s];
      s_want[tid] += s_want[tid + s];
      s_nan[tid] += s_nan[tid + s];
      s_want_nan[tid] += s_want_nan[tid + s];
      s_written[tid] += s_written[tid + s];
    }
    __syncthreads();
  }
  if (tid == 0) errors[row] = {s_diff[0], s_want[0], s_nan[0], s_want_nan[0], s_written[0]};
}

// Every row of one output against its reference: a kept row's error is ||got - want|| /
// ||want|| over the row (a row whose reference is all zeros must be exactly zero), so one bad row,
// or one bad tile of a row, fails whatever the other rows hold; the other rows must be untouched.
struct RowCheck {
  long long rows = 0;      // kept rows checked
  long long over = 0;      // kept rows over the bound (a NaN error included)
  long long nan = 0;       // NaN outputs in kept rows
  long long want_nan = 0;  // NaN references in kept rows
  long long written = 0;   // outputs written in the other rows
  double worst = 0;        // the largest row error (NaN if any is NaN)
  std::string worst_row;   // where it is
  std::string first_over;  // the first rows over the bound, with their errors
};

// `where(r)` names row r in the messages.
template <typename Out>
RowCheck check_rows(const Out* got, long long rows, int n, const std::vector<char>& kept, Want want,
                    const float* r1, const float* r2, const float* scale, double bound,
                    const std::function<std::string(long long)>& where) {
  RowCheck c;
  if (static_cast<long long>(kept.size()) != rows) {
    ADD_FAILURE() << "a kept-row mask of " << kept.size() << " rows for " << rows << " rows";
    return c;
  }
  if (rows == 0) return c;
  const DeviceBuffer<char> d_kept(kept);
  DeviceBuffer<RowError> errors(rows);
  errors.poison();  // a row the kernel missed: NaN sums and -1 counts, which fail below
  row_error_kernel<Out><<<static_cast<unsigned>(rows), kErrorThreads>>>(got, d_kept.get(), want, r1,
                                                                        r2, scale, n, errors.get());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "row error launch";
  const std::vector<RowError> e = errors.download();
  long long worst = -1;
  for (long long r = 0; r < rows; ++r) {
    if (!kept[r]) {
      c.written += e[r].written;
      continue;
    }
    ++c.rows;
    c.nan += e[r].nan;
    c.want_nan += e[r].want_nan;
    const double rel = e[r].want2 > 0    ? std::sqrt(e[r].diff2 / e[r].want2)
                       : e[r].diff2 == 0 ? 0.0
                                         : INFINITY;
    if (!(rel <= bound) && c.over++ < 3) {
      char text[48];
      std::snprintf(text, sizeof text, ": %.3g; ", rel);
      c.first_over += where(r) + text;
    }
    if (!std::isnan(c.worst) && !(rel <= c.worst)) {
      c.worst = rel;
      worst = r;
    }
  }
  if (worst >= 0) c.worst_row = where(worst);
  return c;
}

// Rows of a row buffer laid out by (starts, counts): "row r (group g, its row i)".
std::function<std::string(long long)> row_names(const std::vector<int>& starts) {
  return [starts](long long r) {
    const auto g =
        std::upper_bound(starts.begin(), starts.end(), static_cast<int>(r)) - starts.begin() - 1;
    return "row " + std::to_string(r) + " (group " + std::to_string(g) + ", its row " +
           std::to_string(r - starts[g]) + ")";
  };
}

// Every row of an M-grouped output [capacity, n] (ld n): the kept rows of (starts, counts)
// against the want expression of the references, every other row still poison.
template <typename Out>
RowCheck check_row_buffer(const Out* got, const std::vector<int>& starts,
                          const std::vector<int>& counts, int capacity, int n, Want want,
                          const float* r1, const float* r2, const float* scale, double bound) {
  return check_rows(got, capacity, n, kept_rows(starts, counts, capacity), want, r1, r2, scale,
                    bound, row_names(starts));
}

// The verdict on one checked output (`what` names it): `rows` kept rows checked, none over the
// bound, nothing NaN, nothing written outside them.
void expect_rows_within(const RowCheck& c, long long rows, double bound, const std::string& what) {
  EXPECT_EQ(c.rows, rows) << what << ": kept rows checked";
  EXPECT_EQ(c.want_nan, 0) << what << ": NaN in the reference of kept rows (a bug of the test)";
  EXPECT_EQ(c.nan, 0) << what << ": NaN outputs in kept rows (unwritten, or padding leaked in)";
  EXPECT_EQ(c.over, 0) << what << ": " << c.over << " of " << c.rows << " rows over the bound "
                       << bound << ", first " << c.first_over;
  EXPECT_EQ(c.written, 0) << what << ": outputs written in padding rows or past the groups";
}

// The sum of the counts: the kept rows of a layout.
long long total_rows(const std::vector<int>& counts) {
  return std::accumulate(counts.begin(), counts.end(), 0ll);
}

bool bitwise_equal(const DeviceBuffer<__nv_bfloat16>& x, const DeviceBuffer<__nv_bfloat16>& y) {
  const auto a = x.download(), b = y.download();
  return std::memcmp(a.data(), b.data(), a.size() * 2) == 0;
}

// ---------------------------------------------------------------------------------------------
// gate/up forward with SwiGLU

struct GateUpCase {
  std::vector<int> counts;
  int h, i;
  bool dense = false;
};

void run_gate_up(const GateUpCase& c, bool with_preact, bool check_bitwise) {
  Layout l(c.counts);
  const int G = l.groups();
  DeviceBuffer<__nv_bfloat16> x(std::size_t(l.capacity) * c.h), wg(std::size_t(G) * c.i * c.h),
      wu(std::size_t(G) * c.i * c.h), hid(std::size_t(l.capacity) * c.i),
      gate(std::size_t(l.capacity) * c.i), up(std::size_t(l.capacity) * c.i),
      hid2(std::size_t(l.capacity) * c.i);
  fill_random(x, 1.0f);
  fill_random(wg, 2.0f / std::sqrt(float(c.h)));
  fill_random(wu, 2.0f / std::sqrt(float(c.h)));
  if (!c.dense) l.poison_padding(x, c.h);
  hid.poison();
  gate.poison();
  up.poison();
  mok::gemm::GateUpForwardArgs args;
  args.segments =
      c.dense ? RowSegments{nullptr, nullptr, 1, l.capacity, c.counts[0]} : l.segments();
  args.x = x.get();
  args.ld_x = c.h;
  args.w_gate = wg.get();
  args.w_up = wu.get();
  args.hidden = hid.get();
  args.gate = with_preact ? gate.get() : nullptr;
  args.up = with_preact ? up.get() : nullptr;
  args.ld_out = c.i;
  args.hidden_size = c.h;
  args.intermediate_size = c.i;
  run_form(mok::gemm::gate_up_forward, args);
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());

  // Every row: hidden = bf16(swiglu(bf16(g), bf16(u))) of the references g and u; with the
  // pre-activations, g = bf16(g) and u = bf16(u) stored too. Padding rows and the rows past the
  // groups stay poison.
  const std::size_t cells = std::size_t(l.capacity) * c.i;
  DeviceBuffer<float> ref_g(cells), ref_u(cells);
  reference_rows(l.starts, l.counts, x, c.h, wg, 0, c.i, c.h, ref_g);
  reference_rows(l.starts, l.counts, x, c.h, wu, 0, c.i, c.h, ref_u);
  auto check = [&](const DeviceBuffer<__nv_bfloat16>& out, Want want, const float* r1,
                   double bound) {
    return check_row_buffer(out.get(), l.starts, l.counts, l.capacity, c.i, want, r1, ref_u.get(),
                            nullptr, bound);
  };
  const RowCheck eh = check(hid, Want::swiglu, ref_g.get(), 2 * kU);
  std::printf("[ mok ] gate/up H=%d I=%d G=%d rows=%lld: worst row error hidden %.3g (bound %.3g)",
              c.h, c.i, G, eh.rows, eh.worst, 2 * kU);
  expect_rows_within(eh, total_rows(c.counts), 2 * kU, "hidden");
  if (with_preact) {
    const RowCheck eg = check(gate, Want::rounded, ref_g.get(), kU);
    const RowCheck eu = check(up, Want::rounded, ref_u.get(), kU);
    std::printf(", g %.3g, u %.3g (bound %.3g)", eg.worst, eu.worst, kU);
    expect_rows_within(eg, total_rows(c.counts), kU, "gate pre-activation");
    expect_rows_within(eu, total_rows(c.counts), kU, "up pre-activation");
  }
  std::printf("\n");
  if (check_bitwise) {
    hid2.poison();
    args.hidden = hid2.get();
    run_form(mok::gemm::gate_up_forward, args);
    MOK_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(bitwise_equal(hid, hid2)) << "two runs differ";
  }
}

TEST(GemmGateUp, SmallOddGroupsWithEmptyOnes) {
  MOK_REQUIRE_HOPPER();
  run_gate_up({{0, 1, 130, 77, 0, 300, 128}, 256, 192}, false, true);
}

TEST(GemmGateUp, PreActivationsVariant) {
  MOK_REQUIRE_HOPPER();
  run_gate_up({{5, 0, 257, 64, 129}, 320, 320}, true, true);
}

TEST(GemmGateUp, RandomGroupSizes) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  for (int trial = 0; trial < 3; ++trial) {
    run_gate_up({random_counts(9, 150, rng), 512, 384}, trial == 0, false);
  }
}

TEST(GemmGateUp, OneGroupHoldsAlmostAllRows) {
  MOK_REQUIRE_HOPPER();
  run_gate_up({{4000, 1, 0, 3, 0}, 384, 256}, false, true);
}

TEST(GemmGateUp, Dsv3Ep8SliceUniform) {
  MOK_REQUIRE_HOPPER();
  run_gate_up({std::vector<int>(32, 1024), 7168, 2048}, true, true);
}

TEST(GemmGateUp, DenseSharedExpert) {
  MOK_REQUIRE_HOPPER();
  run_gate_up({{1000}, 512, 256, true}, false, true);
}

// ---------------------------------------------------------------------------------------------
// rows x W^T (down forward, dense) and rows x W (dgrad)

// The epilogue's row scatter (the layer's combine): every kept row lands, bitwise equal to the
// plain store `out`, in the slot its table entry names on one of two ranks; rows whose entry is
// negative (padding, and a random tenth of the real rows) and every other slot stay poisoned.
template <class Launch>
void check_scatter(const Layout& l, int n, const DeviceBuffer<__nv_bfloat16>& out,
                   Launch&& launch) {
  std::mt19937_64 rng(next_seed());
  const int ranks = 2;
  std::vector<int> real;
  for (int g = 0; g < l.groups(); ++g)
    for (int i = 0; i < l.counts[g]; ++i) real.push_back(l.starts[g] + i);
  const long long slots = std::max<long long>(1, static_cast<long long>(real.size()));
  std::vector<int> places(static_cast<std::size_t>(ranks * slots));
  std::iota(places.begin(), places.end(), 0);
  std::shuffle(places.begin(), places.end(), rng);
  std::vector<int> table(l.capacity, -1);
  for (std::size_t i = 0; i < real.size(); ++i)
    if (rng() % 10 != 0) table[real[i]] = places[i];
  DeviceBuffer<int> d_table(l.capacity);
  d_table.upload(table);
  DeviceBuffer<__nv_bfloat16> dst0(slots * n), dst1(slots * n);
  dst0.poison();
  dst1.poison();
  std::vector<void*> peers = {dst0.get(), dst1.get()};
  DeviceBuffer<void*> d_peers(ranks);
  d_peers.upload(peers);
  launch(mok::gemm::RowScatter{d_table.get(), slots, d_peers.get()});
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto want = out.download();
  const std::vector<std::vector<__nv_bfloat16>> got = {dst0.download(), dst1.download()};
  std::vector<char> landed(static_cast<std::size_t>(ranks * slots), 0);
  long long wrong = 0, stray = 0;
  for (int r = 0; r < l.capacity; ++r) {
    if (table[r] < 0) continue;
    const int rank = table[r] / static_cast<int>(slots), slot = table[r] % static_cast<int>(slots);
    landed[table[r]] = 1;
    wrong += std::memcmp(&got[rank][std::size_t(slot) * n], &want[std::size_t(r) * n], n * 2) != 0;
  }
  for (std::size_t pl = 0; pl < landed.size(); ++pl) {
    if (landed[pl]) continue;
    const auto& g = got[pl / slots];
    for (int j = 0; j < n; ++j) {
      std::uint16_t bits;
      std::memcpy(&bits, &g[(pl % slots) * n + j], 2);
      stray += bits != 0xffff;
    }
  }
  std::printf("[ mok ] row scatter: %lld rows to %d ranks\n", static_cast<long long>(real.size()),
              ranks);
  EXPECT_EQ(wrong, 0) << "scattered rows differ from the plain store";
  EXPECT_EQ(stray, 0) << "slots that no kept row names were written";
}

struct RowsCase {
  std::vector<int> counts;
  int n, k;
  bool trans_b;  // false: rows x W^T (down); true: rows x W (dgrad)
  bool row_scale = false;
  bool dense = false;
};

void run_rows(const RowsCase& c, bool check_bitwise) {
  std::mt19937_64 rng(next_seed());
  Layout l(c.counts);
  const int G = l.groups();
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * c.k), w(std::size_t(G) * c.n * c.k),
      out(std::size_t(l.capacity) * c.n), out2(std::size_t(l.capacity) * c.n);
  DeviceBuffer<float> scale(l.capacity);
  fill_random(a, 1.0f);
  fill_random(w, 2.0f / std::sqrt(float(c.k)));
  if (!c.dense) l.poison_padding(a, c.k);
  std::vector<float> hscale(l.capacity);
  for (auto& v : hscale) v = 0.25f + float(rng() % 1000) / 1000.0f;
  scale.upload(hscale);
  out.poison();
  const RowSegments seg =
      c.dense ? RowSegments{nullptr, nullptr, 1, l.capacity, c.counts[0]} : l.segments();
  auto launch = [&](__nv_bfloat16* dst, const mok::gemm::RowScatter& to = {}) {
    if (c.trans_b) {
      mok::gemm::RowsTimesWeightArgs args;
      args.segments = seg;
      args.a = a.get();
      args.ld_a = c.k;
      args.w = w.get();
      args.out = dst;
      args.scatter = to;
      args.ld_out = c.n;
      args.n = c.n;
      args.k = c.k;
      run_form(mok::gemm::rows_times_weight, args);
    } else {
      mok::gemm::RowsTimesWeightTArgs args;
      args.segments = seg;
      args.a = a.get();
      args.ld_a = c.k;
      args.w = w.get();
      args.out = dst;
      args.scatter = to;
      args.ld_out = c.n;
      args.row_scale = c.row_scale ? scale.get() : nullptr;
      args.n = c.n;
      args.k = c.k;
      run_form(mok::gemm::rows_times_weight_t, args);
    }
  };
  launch(out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  // Every row against the reference (row-scaled: times its scale, in fp32); padding rows and the
  // rows past the groups stay poison.
  DeviceBuffer<float> ref(std::size_t(l.capacity) * c.n);
  reference_rows(l.starts, l.counts, a, c.k, w, c.trans_b ? 1 : 0, c.n, c.k, ref);
  const RowCheck e =
      check_row_buffer(out.get(), l.starts, l.counts, l.capacity, c.n,
                       c.row_scale ? Want::scaled : Want::ref, ref.get(), nullptr, scale.get(), kU);
  std::printf("[ mok ] %s N=%d K=%d G=%d rows=%lld%s: worst row error %.3g at %s (bound %.3g)\n",
              c.trans_b ? "rows x W (dgrad)" : "rows x W^T (down)", c.n, c.k, G, e.rows,
              c.row_scale ? " row-scaled" : "", e.worst, e.worst_row.c_str(), kU);
  expect_rows_within(e, total_rows(c.counts), kU, "out");
  if (check_bitwise) {
    out2.poison();
    launch(out2.get());
    MOK_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(bitwise_equal(out, out2)) << "two runs differ";
  }
  if (check_bitwise && !c.dense && l.capacity * static_cast<long long>(c.n) < (64ll << 20)) {
    check_scatter(l, c.n, out, [&](const mok::gemm::RowScatter& to) { launch(nullptr, to); });
  }
}

TEST(GemmDown, SmallOddGroupsRowScale) {
  MOK_REQUIRE_HOPPER();
  run_rows({{0, 1, 130, 77, 0, 300}, 320, 192, false, true}, true);
}

TEST(GemmDown, RandomGroupSizes) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  for (int trial = 0; trial < 3; ++trial)
    run_rows({random_counts(7, 200, rng), 448, 256, false}, false);
}

TEST(GemmDown, Qwen3SkewedOneGroupHalf) {
  MOK_REQUIRE_HOPPER();
  std::vector<int> counts(128, 16384 * 8 / 2 / 127);
  counts[0] = 16384 * 8 / 2;
  run_rows({counts, 2048, 768, false, true}, true);
}

TEST(GemmDown, DenseSharedExpert) {
  MOK_REQUIRE_HOPPER();
  run_rows({{999}, 512, 256, false, false, true}, true);
}

// An odd number of tiles (5 M tiles x 3 N tiles) in groups of 1, 3 and 1 M tiles: with clusters of
// two CTAs, neighbour tiles fall in different N tiles and groups (no shared weight tile), and the
// last cluster step has a single tile.
TEST(GemmDown, OddTileCountAcrossGroupsAndPanels) {
  MOK_REQUIRE_HOPPER();
  run_rows({{1, 300, 1}, 768, 128, false}, true);
  run_rows({{1, 300, 1}, 768, 128, true}, true);
}

TEST(GemmDgrad, SmallOddGroups) {
  MOK_REQUIRE_HOPPER();
  run_rows({{0, 1, 130, 77, 0, 300}, 320, 192, true}, true);
}

TEST(GemmDgrad, RandomGroupSizesAndAlmostAllInOne) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  run_rows({random_counts(6, 200, rng), 192, 512, true}, false);
  run_rows({{3000, 0, 2, 1}, 256, 384, true}, true);
}

TEST(GemmDgrad, Dsv3Ep8SliceUniform) {
  MOK_REQUIRE_HOPPER();
  run_rows({std::vector<int>(32, 1024), 2048, 7168, true}, true);
}

// The gate/up input gradient: dx = bf16(dg W_gate + du W_up) with one fp32 accumulator.
TEST(GemmDgrad, TwoProductsShareOneAccumulator) {
  MOK_REQUIRE_HOPPER();
  Layout l({0, 1, 130, 77, 0, 300});
  const int G = l.groups(), n = 320, k = 192;
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * k), a2(std::size_t(l.capacity) * k),
      w(std::size_t(G) * k * n), w2(std::size_t(G) * k * n), out(std::size_t(l.capacity) * n),
      out2(std::size_t(l.capacity) * n);
  fill_random(a, 1.0f);
  fill_random(a2, 1.0f);
  fill_random(w, 2.0f / std::sqrt(float(k)));
  fill_random(w2, 2.0f / std::sqrt(float(k)));
  l.poison_padding(a, k);
  l.poison_padding(a2, k);
  auto launch = [&](__nv_bfloat16* dst) {
    mok::gemm::RowsTimesWeightArgs args;
    args.segments = l.segments();
    args.a = a.get();
    args.ld_a = k;
    args.w = w.get();
    args.a2 = a2.get();
    args.ld_a2 = k;
    args.w2 = w2.get();
    args.out = dst;
    args.ld_out = n;
    args.n = n;
    args.k = k;
    run_form(mok::gemm::rows_times_weight, args);
  };
  out.poison();
  launch(out.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  DeviceBuffer<float> ref1(std::size_t(l.capacity) * n), ref2(std::size_t(l.capacity) * n);
  reference_rows(l.starts, l.counts, a, k, w, 1, n, k, ref1);
  reference_rows(l.starts, l.counts, a2, k, w2, 1, n, k, ref2);
  const RowCheck e = check_row_buffer(out.get(), l.starts, l.counts, l.capacity, n, Want::sum,
                                      ref1.get(), ref2.get(), nullptr, kU);
  std::printf("[ mok ] dgrad with two products: worst row error %.3g at %s (bound %.3g)\n", e.worst,
              e.worst_row.c_str(), kU);
  expect_rows_within(e, total_rows(l.counts), kU, "out");
  out2.poison();
  launch(out2.get());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(bitwise_equal(out, out2)) << "two runs differ";
}

// The SwiGLU backward in the down dgrad's epilogue (SwigluBackwardEpilogue). What it must equal,
// element for element: numerics::swiglu_backward_fast applied to the plain dgrad's dh (the same
// accumulation, so the same dh bits) and the same g, u, by this kernel: bitwise. Against the exact
// expression (expf, IEEE division) on the host it may differ by one bf16 ulp where a value sits at
// a rounding boundary (ex2.approx/rcp.approx: ~2^-21 relative in s).
__global__ void swiglu_backward_fast_kernel(const __nv_bfloat16* dh, const __nv_bfloat16* g,
                                            const __nv_bfloat16* u, std::size_t n,
                                            __nv_bfloat16* dg, __nv_bfloat16* du) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    float a, b;
    mok::numerics::swiglu_backward_fast(__bfloat162float(g[i]), __bfloat162float(u[i]),
                                        __bfloat162float(dh[i]), &a, &b);
    dg[i] = __float2bfloat16_rn(a);
    du[i] = __float2bfloat16_rn(b);
  }
}

// The same with the clamped SwiGLU (numerics::swiglu_backward_clamped_fast): what the epilogue
// with SwigluBackwardEpilogue::limit must equal, bitwise.
__global__ void swiglu_backward_clamped_fast_kernel(const __nv_bfloat16* dh, const __nv_bfloat16* g,
                                                    const __nv_bfloat16* u, std::size_t n,
                                                    float limit, __nv_bfloat16* dg,
                                                    __nv_bfloat16* du) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    float a, b;
    mok::numerics::swiglu_backward_clamped_fast(__bfloat162float(g[i]), __bfloat162float(u[i]),
                                                __bfloat162float(dh[i]), limit, &a, &b);
    dg[i] = __float2bfloat16_rn(a);
    du[i] = __float2bfloat16_rn(b);
  }
}

void run_dgrad_swiglu(const std::vector<int>& counts, int n, int k, bool dense) {
  Layout l(counts);
  const int G = l.groups();
  const std::size_t cells = std::size_t(l.capacity) * n;
  DeviceBuffer<__nv_bfloat16> dy(std::size_t(l.capacity) * k), w(std::size_t(G) * k * n), g(cells),
      u(cells), dh(cells), dg(cells), du(cells), dg2(cells), du2(cells), want_g(cells),
      want_u(cells);
  fill_random(dy, 1.0f);
  fill_random(w, 2.0f / std::sqrt(float(k)));
  fill_random(g, 6.0f);  // sigmoid's whole range: s from 0.0025 to 0.9975
  fill_random(u, 2.0f);
  if (!dense) {
    l.poison_padding(dy, k);
    l.poison_padding(g, n);
    l.poison_padding(u, n);
  }
  const RowSegments seg =
      dense ? RowSegments{nullptr, nullptr, 1, l.capacity, counts[0]} : l.segments();
  auto launch = [&](__nv_bfloat16* out, __nv_bfloat16* d_gate, __nv_bfloat16* d_up) {
    mok::gemm::RowsTimesWeightArgs args;
    args.segments = seg;
    args.a = dy.get();
    args.ld_a = k;
    args.w = w.get();
    args.out = out;
    if (d_gate != nullptr) args.swiglu = {g.get(), u.get(), d_gate, d_up};
    args.ld_out = n;
    args.n = n;
    args.k = k;
    run_form(mok::gemm::rows_times_weight, args);
  };
  for (auto* b : {&dh, &dg, &du, &want_g, &want_u}) b->poison();
  launch(dh.get(), nullptr, nullptr);
  launch(nullptr, dg.get(), du.get());
  swiglu_backward_fast_kernel<<<1024, 256>>>(dh.get(), g.get(), u.get(), cells, want_g.get(),
                                             want_u.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());

  // Rows that hold a value: the groups' rows (dense: the first counts[0]); everything else must
  // still be poison in dg and du.
  std::vector<char> kept(l.capacity, 0);
  if (dense) {
    for (int r = 0; r < counts[0]; ++r) kept[r] = 1;
  } else {
    for (int e = 0; e < G; ++e)
      for (int r = l.starts[e]; r < l.starts[e] + l.counts[e]; ++r) kept[r] = 1;
  }
  const auto hg = g.download(), hu = u.download(), hdh = dh.download(), gg = dg.download(),
             gu = du.download(), wg = want_g.download(), wu = want_u.download();
  auto bits = [](const auto& v) {  // host() gives __nv_bfloat16: compare and convert raw bits
    return reinterpret_cast<const std::uint16_t*>(v.data());
  };
  const std::uint16_t *bg = bits(gg), *bu = bits(gu), *bwg = bits(wg), *bwu = bits(wu),
                      *b_g = bits(hg), *b_u = bits(hu), *b_dh = bits(hdh);
  long long differ = 0, stray = 0, off_by_one_ulp = 0, far = 0, checked = 0;
  auto close = [&](bf16_t got, float want) {
    const float w = mok::round_to_bf16(want), x = bf(got);
    if (x == w) return true;
    ++off_by_one_ulp;
    return std::fabs(x - w) <= std::fabs(w) * 0x1.0p-7f;
  };
  for (int r = 0; r < l.capacity; ++r) {
    for (int c = 0; c < n; ++c) {
      const std::size_t i = std::size_t(r) * n + c;
      if (!kept[r]) {
        stray += bg[i] != 0xffff || bu[i] != 0xffff;
        continue;
      }
      differ += bg[i] != bwg[i] || bu[i] != bwu[i];
      float eg, eu;
      mok::numerics::swiglu_backward(bf(b_g[i]), bf(b_u[i]), bf(b_dh[i]), &eg, &eu);
      far += !close(bg[i], eg) || !close(bu[i], eu);
      checked += 2;
    }
  }
  std::printf(
      "[ mok ] dgrad + SwiGLU backward N=%d K=%d G=%d%s: %lld values, %lld one bf16 ulp "
      "from the exact expression\n",
      n, k, G, dense ? " dense" : "", checked, off_by_one_ulp);
  EXPECT_EQ(differ, 0) << "epilogue differs from swiglu_backward_fast of the plain dgrad's dh";
  EXPECT_EQ(stray, 0) << "padding rows or rows past the groups were written";
  EXPECT_EQ(far, 0) << "more than one bf16 ulp from the exact SwiGLU backward";
  EXPECT_LT(off_by_one_ulp, checked / 100 + 1)
      << "more boundary cases than the approximation explains";

  // Run to run: the same bits.
  dg2.poison();
  du2.poison();
  launch(nullptr, dg2.get(), du2.get());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(bitwise_equal(dg, dg2) && bitwise_equal(du, du2)) << "two runs differ";
}

TEST(GemmDgrad, SwigluBackwardEpilogueSmallOddGroups) {
  MOK_REQUIRE_HOPPER();
  run_dgrad_swiglu({0, 1, 130, 77, 0, 300}, 320, 192, false);
}

TEST(GemmDgrad, SwigluBackwardEpilogueDenseAndOneHeavyGroup) {
  MOK_REQUIRE_HOPPER();
  run_dgrad_swiglu({999}, 512, 256, true);
  run_dgrad_swiglu({3000, 0, 2, 1}, 768, 448, false);
}

// The SwiGLU-backward epilogue's optional outputs (SwigluBackwardEpilogue::row_scale, dot, and
// with both scaled_hidden).
// g, u and h come from the gate/up forward itself; the dgrad's own fp32 accumulators from the
// same dgrad with an fp32 output (the same kernel and K loop, so the same bits: checked against
// its bf16 output). Then:
//   dg, du with row_scale: bitwise swiglu_backward_fast(g, u, bf16(scale * acc)) (fp32 product,
//     rounded once to bf16: exactly what the host computes);
//   dot: against the fp64 sum over each 128-column chunk of acc * h, h the forward's hidden. The
//     epilogue adds 32 products a lane with fma, then 2 quad additions, all rounded to nearest in
//     fp32: a product passes through at most 34 roundings, so |dot - exact| <= gamma_34 * sum |acc
//     h| with gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, 3.1); the fp64
//     sum adds at most 127 * 2^-53 of the same, and underflow 34 * 2^-149 absolute. That bound
//     only holds if the epilogue's h is bitwise the forward's hidden: one bf16 ulp off in one h
//     moves its product by 2^-8 to 2^-7 of itself, thousands of times the bound's share of it;
//   scaled_hidden: bitwise bf16(scale * h) (fp32 product, rounded once), h the forward's hidden;
//   rows past each group's rows: dg, du, dot and scaled_hidden untouched (poisoned before);
//   both consumer schedules and a second run: the same bits; each option alone: the same bits as
//     with all three (dot never depends on the scale; dg, du never on dot or scaled_hidden).
// With a limit (clamped SwiGLU) the forward and every dgrad take it: g, u stay unclamped, h is
// the clamped hidden, dg, du bitwise swiglu_backward_clamped_fast; and the clamp must act (some
// kept g > L or |u| > L, and the unclamped dg, du differ somewhere), or ignoring it would pass.
void run_dgrad_dot(const std::vector<int>& counts, int n, int k, bool dense,
                   std::optional<float> limit = std::nullopt) {
  Layout l(counts);
  const int G = l.groups();
  const std::size_t cells = std::size_t(l.capacity) * n;
  const int chunks = (n + mok::gemm::kDotColumns - 1) / mok::gemm::kDotColumns;
  const std::size_t dot_cells = std::size_t(l.capacity) * chunks;
  DeviceBuffer<__nv_bfloat16> x(std::size_t(l.capacity) * k), w_gate(std::size_t(G) * n * k),
      w_up(std::size_t(G) * n * k), dy(std::size_t(l.capacity) * k), w_down(std::size_t(G) * k * n),
      g(cells), u(cells), hid(cells), dh16(cells), dh_scaled(cells), dg(cells), du(cells),
      want_g(cells), want_u(cells), dg2(cells), du2(cells), wh(cells), wh2(cells);
  DeviceBuffer<float> acc32(cells), scale(l.capacity), dot(dot_cells), dot2(dot_cells);
  fill_random(x, 1.0f);
  fill_random(w_gate, 4.0f / std::sqrt(float(k)));
  fill_random(w_up, 2.0f / std::sqrt(float(k)));
  fill_random(dy, 1.0f);
  fill_random(w_down, 2.0f / std::sqrt(float(k)));
  std::mt19937_64 rng(next_seed());
  std::vector<float> hscale(l.capacity);
  for (auto& v : hscale) v = 0.25f + float(rng() % 1000) / 1000.0f;
  scale.upload(hscale);
  if (!dense) {
    l.poison_padding(x, k);
    l.poison_padding(dy, k);
  }
  const RowSegments seg =
      dense ? RowSegments{nullptr, nullptr, 1, l.capacity, counts[0]} : l.segments();
  for (auto* b : {&g, &u, &hid}) b->poison();
  mok::gemm::GateUpForwardArgs fwd;
  fwd.segments = seg;
  fwd.x = x.get();
  fwd.ld_x = k;
  fwd.w_gate = w_gate.get();
  fwd.w_up = w_up.get();
  fwd.hidden = hid.get();
  fwd.gate = g.get();
  fwd.up = u.get();
  fwd.ld_out = n;
  fwd.hidden_size = k;
  fwd.intermediate_size = n;
  fwd.swiglu_limit = limit;
  run_form(mok::gemm::gate_up_forward, fwd);
  MOK_CUDA_OK(cudaGetLastError());

  // The dgrad: plain (bf16 and fp32 outputs), or with the SwiGLU epilogue and the options given.
  auto dgrad = [&](void* out, bool fp32, __nv_bfloat16* d_gate, __nv_bfloat16* d_up,
                   const float* row_scale, float* d, __nv_bfloat16* scaled_hidden = nullptr) {
    mok::gemm::RowsTimesWeightArgs args;
    args.segments = seg;
    args.a = dy.get();
    args.ld_a = k;
    args.w = w_down.get();
    args.out = out;
    args.out_fp32 = fp32;
    if (d_gate != nullptr)
      args.swiglu = {g.get(), u.get(), d_gate, d_up, row_scale, d, scaled_hidden, limit};
    args.ld_out = n;
    args.n = n;
    args.k = k;
    run_form(mok::gemm::rows_times_weight, args);
  };
  for (auto* b : {&dh16, &dg, &du, &want_g, &want_u}) b->poison();
  acc32.poison();
  dot.poison();
  wh.poison();
  dgrad(dh16.get(), false, nullptr, nullptr, nullptr, nullptr);
  dgrad(acc32.get(), true, nullptr, nullptr, nullptr, nullptr);
  dgrad(nullptr, false, dg.get(), du.get(), scale.get(), dot.get(), wh.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());

  std::vector<char> kept(l.capacity, 0);
  if (dense) {
    for (int r = 0; r < counts[0]; ++r) kept[r] = 1;
  } else {
    for (int e = 0; e < G; ++e)
      for (int r = l.starts[e]; r < l.starts[e] + l.counts[e]; ++r) kept[r] = 1;
  }
  const std::vector<float> acc = acc32.download();
  const auto h16 = dh16.download(), hh = hid.download();
  const auto* dh_bits = reinterpret_cast<const std::uint16_t*>(h16.data());
  const auto* h_bits = reinterpret_cast<const std::uint16_t*>(hh.data());
  // The fp32 output is the accumulator the bf16 output rounds; dh scaled as the epilogue must.
  std::vector<bf16_t> scaled(cells, 0);
  long long fp32_vs_bf16 = 0;
  for (int r = 0; r < l.capacity; ++r) {
    if (!kept[r]) continue;
    for (int c = 0; c < n; ++c) {
      const std::size_t i = std::size_t(r) * n + c;
      fp32_vs_bf16 += mok::float_to_bf16(acc[i]) != dh_bits[i];
      scaled[i] = mok::float_to_bf16(hscale[r] * acc[i]);  // IEEE fp32 product, then bf16
    }
  }
  EXPECT_EQ(fp32_vs_bf16, 0) << "the fp32 output is not the accumulator of the bf16 output";
  MOK_CUDA_OK(cudaMemcpy(dh_scaled.get(), scaled.data(), cells * 2, cudaMemcpyHostToDevice));
  if (limit) {
    swiglu_backward_clamped_fast_kernel<<<1024, 256>>>(dh_scaled.get(), g.get(), u.get(), cells,
                                                       *limit, want_g.get(), want_u.get());
    // The unclamped expectation, into dg2, du2 (poisoned again before their own use below).
    swiglu_backward_fast_kernel<<<1024, 256>>>(dh_scaled.get(), g.get(), u.get(), cells, dg2.get(),
                                               du2.get());
  } else {
    swiglu_backward_fast_kernel<<<1024, 256>>>(dh_scaled.get(), g.get(), u.get(), cells,
                                               want_g.get(), want_u.get());
  }
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto got_g = dg.download(), got_u = du.download(), wg = want_g.download(),
             wu = want_u.download();
  const auto* bg = reinterpret_cast<const std::uint16_t*>(got_g.data());
  const auto* bu = reinterpret_cast<const std::uint16_t*>(got_u.data());
  const auto* bwg = reinterpret_cast<const std::uint16_t*>(wg.data());
  const auto* bwu = reinterpret_cast<const std::uint16_t*>(wu.data());
  long long differ = 0, stray = 0;
  for (int r = 0; r < l.capacity; ++r) {
    for (int c = 0; c < n; ++c) {
      const std::size_t i = std::size_t(r) * n + c;
      if (kept[r]) {
        differ += bg[i] != bwg[i] || bu[i] != bwu[i];
      } else {
        stray += bg[i] != 0xffff || bu[i] != 0xffff;
      }
    }
  }
  EXPECT_EQ(differ, 0) << "dg, du differ from swiglu_backward" << (limit ? "_clamped" : "")
                       << "_fast(g, u, bf16(scale * acc))";
  EXPECT_EQ(stray, 0) << "dg or du written in rows past the groups";

  // With a limit: kept elements the clamp acts on (g > L or |u| > L), and kept elements whose
  // dg or du the unclamped backward gives differently (so ignoring the limit fails above).
  long long clamped = 0, unclamped_differ = 0, kept_values = 0;
  if (limit) {
    const float L = *limit;
    const auto hg = g.download(), hu = u.download(), pg = dg2.download(), pu = du2.download();
    const auto* b_g = reinterpret_cast<const std::uint16_t*>(hg.data());
    const auto* b_u = reinterpret_cast<const std::uint16_t*>(hu.data());
    const auto* bpg = reinterpret_cast<const std::uint16_t*>(pg.data());
    const auto* bpu = reinterpret_cast<const std::uint16_t*>(pu.data());
    for (int r = 0; r < l.capacity; ++r) {
      if (!kept[r]) continue;
      for (int c = 0; c < n; ++c) {
        const std::size_t i = std::size_t(r) * n + c;
        const float gv = mok::bf16_to_float(b_g[i]), uv = mok::bf16_to_float(b_u[i]);
        clamped += gv > L || std::fabs(uv) > L;
        unclamped_differ += bpg[i] != bg[i] || bpu[i] != bu[i];
        ++kept_values;
      }
    }
    EXPECT_GT(clamped, 0) << "no kept g above the limit nor u outside it";
    EXPECT_GT(unclamped_differ, 0) << "the unclamped dg, du are the clamped ones";
  }

  const auto got_wh = wh.download();
  const auto* bwh = reinterpret_cast<const std::uint16_t*>(got_wh.data());
  long long wh_differ = 0, wh_stray = 0;
  for (int r = 0; r < l.capacity; ++r) {
    for (int c = 0; c < n; ++c) {
      const std::size_t i = std::size_t(r) * n + c;
      if (kept[r]) {
        wh_differ += bwh[i] != mok::float_to_bf16(hscale[r] * mok::bf16_to_float(h_bits[i]));
      } else {
        wh_stray += bwh[i] != 0xffff;
      }
    }
  }
  EXPECT_EQ(wh_differ, 0) << "scaled_hidden differs from bf16(scale * h), h the forward's hidden";
  EXPECT_EQ(wh_stray, 0) << "scaled_hidden written in rows past the groups";

  const double u32 = std::ldexp(1.0, -24);
  const double gamma34 = 34 * u32 / (1 - 34 * u32);
  const std::vector<float> got_dot = dot.download();
  long long far = 0, dot_stray = 0, checked = 0;
  double worst = 0;  // the largest error as a fraction of its bound
  for (int r = 0; r < l.capacity; ++r) {
    for (int ch = 0; ch < chunks; ++ch) {
      const float v = got_dot[std::size_t(r) * chunks + ch];
      if (!kept[r]) {
        std::uint32_t bits;
        std::memcpy(&bits, &v, 4);
        dot_stray += bits != 0xffffffffu;
        continue;
      }
      double sum = 0, sum_abs = 0;
      for (int c = ch * mok::gemm::kDotColumns; c < std::min(n, (ch + 1) * mok::gemm::kDotColumns);
           ++c) {
        const std::size_t i = std::size_t(r) * n + c;
        const double t = double(acc[i]) * mok::bf16_to_float(h_bits[i]);
        sum += t;
        sum_abs += std::fabs(t);
      }
      const double bound =
          (gamma34 + 127 * std::ldexp(1.0, -53)) * sum_abs + 34 * std::ldexp(1.0, -149);
      const double err = std::fabs(double(v) - sum);
      far += !(err <= bound);  // NaN counts as far
      worst = std::max(worst, err / bound);
      ++checked;
    }
  }
  char clamp_note[96] = "";
  if (limit) {
    std::snprintf(clamp_note, sizeof clamp_note, " limit %g (%lld of %lld values clamped)",
                  double(*limit), clamped, kept_values);
  }
  std::printf(
      "[ mok ] dgrad + SwiGLU backward, row scale and dot N=%d K=%d G=%d%s%s: %lld dot "
      "values, largest error %.3g of its bound\n",
      n, k, G, dense ? " dense" : "", clamp_note, checked, worst);
  EXPECT_GT(checked, 0);
  EXPECT_EQ(far, 0) << "dot beyond the fp32 summation bound (h not the forward's hidden?)";
  EXPECT_EQ(dot_stray, 0) << "dot written in rows past the groups";

  // A second run, and each option alone: the same bits.
  auto same = [](const auto& x, const auto& y) {
    const auto a = x.download(), b = y.download();
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  {
    dg2.poison();
    du2.poison();
    dot2.poison();
    wh2.poison();
    dgrad(nullptr, false, dg2.get(), du2.get(), scale.get(), dot2.get(), wh2.get());
    MOK_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(same(dot, dot2)) << "a second run: dot differs";
    EXPECT_TRUE(same(wh, wh2)) << "a second run: scaled_hidden differs";
    EXPECT_TRUE(same(dg, dg2) && same(du, du2)) << "a second run: dg or du differs";
  }
  dg2.poison();
  du2.poison();
  dgrad(nullptr, false, dg2.get(), du2.get(), scale.get(), nullptr);  // scale only
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same(dg, dg2) && same(du, du2)) << "row scale without dot: dg or du differs";
  dot2.poison();
  dg2.poison();
  du2.poison();
  dgrad(nullptr, false, dg2.get(), du2.get(), scale.get(),
        dot2.get());  // scale and dot, no scaled_hidden
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same(dot, dot2)) << "dot without scaled_hidden differs";
  EXPECT_TRUE(same(dg, dg2) && same(du, du2)) << "scaled_hidden changed dg or du";
  dot2.poison();
  dg2.poison();
  du2.poison();
  dgrad(nullptr, false, dg2.get(), du2.get(), nullptr, dot2.get());  // dot only
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same(dot, dot2)) << "dot without row scale differs";
  want_g.poison();
  want_u.poison();
  dgrad(nullptr, false, want_g.get(), want_u.get(), nullptr, nullptr);  // neither: dg, du alone
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same(dg2, want_g) && same(du2, want_u)) << "dot changed dg or du";
}

TEST(GemmDgrad, SwigluBackwardRowScaleAndDotSmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_dgrad_dot({0, 1, 130, 77, 0, 300}, 320, 192, false);  // a last chunk of 64 columns
}

TEST(GemmDgrad, SwigluBackwardRowScaleAndDotDenseAndOneHeavyGroup) {
  MOK_REQUIRE_HOPPER();
  run_dgrad_dot({999}, 512, 256, true);
  run_dgrad_dot({3000, 0, 2, 1}, 768, 448, false);
}

// The same with the clamped SwiGLU. The data: x uniform in [-1, 1), w_gate in [-4, 4)/sqrt(K),
// w_up in [-2, 2)/sqrt(K), so g and u are near normal with standard deviations 4/3 and 2/3 (K
// sums of variance 1/3 * 16/(3K) and 1/3 * 4/(3K)), whatever K. L = 0.5 clamps g above 0.375 sd
// (~35% of g) and u beyond 0.75 sd (~45%): about 65% of the elements one way or both, the clamp
// on nearly every row. L = 3 clamps g above 2.25 sd (~1.2%, some 28000 of the 3000-row group's
// 2.3M) and u almost never (4.5 sd): a sparse clamp, mostly of the gate alone.
TEST(GemmDgrad, SwigluBackwardRowScaleAndDotClamped) {
  MOK_REQUIRE_HOPPER();
  run_dgrad_dot({0, 1, 130, 77, 0, 300}, 320, 192, false, 0.5f);
  run_dgrad_dot({3000, 0, 2, 1}, 768, 448, false, 3.0f);
}

TEST(GemmArguments, SwigluOptionsNeedTheSwigluEpilogue) {
  MOK_REQUIRE_HOPPER();
  Layout l({100});
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * 64), w(64 * 64),
      x(std::size_t(l.capacity) * 64);
  DeviceBuffer<float> f(l.capacity);
  mok::gemm::RowsTimesWeightArgs args;
  args.segments = l.segments();
  args.a = a.get();
  args.ld_a = 64;
  args.w = w.get();
  args.out = x.get();
  args.ld_out = 64;
  args.n = 64;
  args.k = 64;
  args.swiglu.row_scale = f.get();
  try {
    run_form(mok::gemm::rows_times_weight, args);
    ADD_FAILURE() << "a row scale without the SwiGLU epilogue was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "swiglu.row_scale") << e.what();
  }
  args.swiglu.row_scale = nullptr;
  args.swiglu.dot = f.get();
  try {
    run_form(mok::gemm::rows_times_weight, args);
    ADD_FAILURE() << "a dot output without the SwiGLU epilogue was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "swiglu.dot") << e.what();
  }
  args.swiglu = {x.get(), x.get(), x.get(), x.get(), nullptr, nullptr};
  args.out_fp32 = true;
  try {
    run_form(mok::gemm::rows_times_weight, args);
    ADD_FAILURE() << "an fp32 output with the SwiGLU epilogue was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "out_fp32") << e.what();
  }
  args.out_fp32 = false;
  for (float* dot : {static_cast<float*>(nullptr), f.get()}) {  // scaled_hidden needs both options
    args.swiglu = {x.get(), x.get(), x.get(), x.get(), dot == nullptr ? f.get() : nullptr,
                   dot,     x.get()};
    try {
      run_form(mok::gemm::rows_times_weight, args);
      ADD_FAILURE() << "scaled_hidden without " << (dot == nullptr ? "dot" : "row_scale")
                    << " was accepted";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), "swiglu.scaled_hidden") << e.what();
    }
  }
}

TEST(GemmArguments, SwigluBackwardEpilogueNeedsAllFourPointersAndNoScatter) {
  MOK_REQUIRE_HOPPER();
  Layout l({100});
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * 64), w(64 * 64),
      x(std::size_t(l.capacity) * 64);
  DeviceBuffer<int> slots(l.capacity);
  DeviceBuffer<void*> peers(1);
  mok::gemm::RowsTimesWeightArgs args;
  args.segments = l.segments();
  args.a = a.get();
  args.ld_a = 64;
  args.w = w.get();
  args.ld_out = 64;
  args.n = 64;
  args.k = 64;
  args.swiglu = {x.get(), x.get(), x.get(), nullptr};
  EXPECT_THROW(run_form(mok::gemm::rows_times_weight, args), mok::Error);
  args.swiglu.d_up = x.get();
  args.scatter = {slots.get(), 1, peers.get()};
  try {
    run_form(mok::gemm::rows_times_weight, args);
    ADD_FAILURE() << "a row scatter with the SwiGLU epilogue was accepted";
  } catch (const mok::Error& e) {
    EXPECT_NE(std::string(e.what()).find("swiglu"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// wgrad (K-grouped)

// Every output row (group g, row i of its [m, n]) of a wgrad over `l` of `a` [capacity, m] and
// `b` [capacity, n] into `out` [G, m, n] (ld n), against the fp32 reference; an empty group's
// rows exactly +0 (zero bytes, in bf16 and fp32). With `start` ([G, m, n] fp32: the output's
// values before a continued or accumulating launch) the rows hold start + the reference instead.
// `what` names it in the messages.
template <typename Out>
void expect_wgrad_rows(const Out* out, const Layout& l, const DeviceBuffer<__nv_bfloat16>& a, int m,
                       const DeviceBuffer<__nv_bfloat16>& b, int n, double bound,
                       const std::string& what, const float* start = nullptr) {
  const int G = l.groups();
  const long long rows = static_cast<long long>(G) * m;
  DeviceBuffer<float> ref(static_cast<std::size_t>(rows) * n);
  reference_wgrad(l.d_starts.get(), l.d_counts.get(), G, a, m, b, n, ref);
  const RowCheck e = check_rows(
      out, rows, n, std::vector<char>(rows, 1), start ? Want::sum : Want::ref, ref.get(), start,
      nullptr, bound, [m](long long r) {
        return "group " + std::to_string(r / m) + ", output row " + std::to_string(r % m);
      });
  long long nonzero_empty = 0;
  for (int g = 0; g < G && start == nullptr; ++g) {
    if (l.counts[g] != 0) continue;
    std::vector<unsigned char> bytes(std::size_t(m) * n * sizeof(Out));
    EXPECT_EQ(cudaMemcpy(bytes.data(), out + std::size_t(g) * m * n, bytes.size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (const unsigned char v : bytes) nonzero_empty += v != 0;
  }
  std::printf("[ mok ] %s: worst row error %.3g at %s (bound %.3g)\n", what.c_str(), e.worst,
              e.worst_row.c_str(), bound);
  expect_rows_within(e, rows, bound, what);
  EXPECT_EQ(nonzero_empty, 0) << what << ": empty groups must give exact (+0) zeros";
}

struct WgradCase {
  std::vector<int> counts;
  int m, n;
  bool fp32;
};

void run_wgrad(const WgradCase& c, bool check_bitwise) {
  Layout l(c.counts);
  const int G = l.groups();
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * c.m), b(std::size_t(l.capacity) * c.n);
  const std::size_t out_elems = std::size_t(G) * c.m * c.n;
  DeviceBuffer<float> out32(c.fp32 ? out_elems : 0), out32b(c.fp32 ? out_elems : 0);
  DeviceBuffer<__nv_bfloat16> out16(c.fp32 ? 0 : out_elems), out16b(c.fp32 ? 0 : out_elems);
  fill_random(a, 1.0f);
  fill_random(b, 1.0f);
  l.poison_padding(a, c.m);  // NaN in padding: must contribute exactly nothing
  l.poison_padding(b, c.n);
  DeviceBuffer<unsigned> tickets(2);  // one counter pair, reused by the launches (one stream)
  MOK_CUDA_OK(cudaMemset(tickets.get(), 0, 2 * sizeof(unsigned)));
  auto launch = [&](void* dst, mok::gemm::TileOrder order = mok::gemm::TileOrder::automatic) {
    mok::gemm::WeightGradArgs args;
    args.segments = l.segments();
    args.order = order;
    args.tickets = tickets.get();
    args.a = a.get();
    args.ld_a = c.m;
    args.b = b.get();
    args.ld_b = c.n;
    args.out = dst;
    args.ld_out = c.n;
    args.out_fp32 = c.fp32;
    args.m = c.m;
    args.n = c.n;
    run_form(mok::gemm::weight_grad, args);
  };
  c.fp32 ? out32.poison() : out16.poison();
  launch(c.fp32 ? static_cast<void*>(out32.get()) : out16.get());
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());

  int max_rows = 1;
  for (int v : c.counts) max_rows = std::max(max_rows, v);
  const double bound = c.fp32 ? max_rows * std::ldexp(1.0, -24) : kU;
  const std::string what = "wgrad M=" + std::to_string(c.m) + " N=" + std::to_string(c.n) +
                           " G=" + std::to_string(G) + " rows=" + std::to_string(l.starts.back()) +
                           (c.fp32 ? " fp32" : " bf16");
  if (c.fp32) {
    expect_wgrad_rows(out32.get(), l, a, c.m, b, c.n, bound, what);
  } else {
    expect_wgrad_rows(out16.get(), l, a, c.m, b, c.n, bound, what);
  }
  if (check_bitwise) {
    // A second run, then each tile order forced: the same bits whoever runs which tile.
    using mok::gemm::TileOrder;
    for (int v = 0; v < 3; ++v) {
      const TileOrder order = v == 1   ? TileOrder::fixed
                              : v == 2 ? TileOrder::tickets
                                       : TileOrder::automatic;
      const char* name = v == 0 ? "automatic order" : v == 1 ? "fixed order" : "tickets order";
      if (c.fp32) {
        out32b.poison();
        launch(out32b.get(), order);
        MOK_CUDA_OK(cudaDeviceSynchronize());
        const auto x = out32.download(), y = out32b.download();
        EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << name << " differs";
      } else {
        out16b.poison();
        launch(out16b.get(), order);
        MOK_CUDA_OK(cudaDeviceSynchronize());
        EXPECT_TRUE(bitwise_equal(out16, out16b)) << name << " differs";
      }
    }
  }
  EXPECT_EQ(tickets.download(), (std::vector<unsigned>{0, 0})) << "the counter pair was not reset";
}

TEST(GemmWgrad, SmallOddGroupsFp32AndBf16) {
  MOK_REQUIRE_HOPPER();
  run_wgrad({{0, 1, 130, 77, 0, 300, 64}, 192, 320, true}, true);
  run_wgrad({{0, 1, 130, 77, 0, 300, 64}, 192, 320, false}, true);
}

TEST(GemmWgrad, RandomGroupSizesAndAlmostAllInOne) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  run_wgrad({random_counts(5, 300, rng), 256, 384, true}, false);
  run_wgrad({{5000, 0, 3, 1}, 320, 256, false}, true);
}

// Heavy-first tile order: the heaviest group is the last one, short and empty groups before it,
// and more tiles than CTAs.
TEST(GemmWgrad, HeavyGroupLastManyGroups) {
  MOK_REQUIRE_HOPPER();
  std::vector<int> counts(40, 70);
  counts[3] = 0;
  counts[17] = 1;
  counts[39] = 6000;
  run_wgrad({counts, 256, 512, false}, true);
  run_wgrad({counts, 256, 512, true}, true);
}

TEST(GemmWgrad, Dsv3Ep8SliceDown) {
  MOK_REQUIRE_HOPPER();
  run_wgrad({std::vector<int>(32, 1024), 7168, 2048, false}, true);
}

// Random A [capacity, m] and B [capacity, n] row buffers of a wgrad over `l`, every padding row
// poisoned (it must contribute nothing).
struct WgradOperands {
  int m, n;
  DeviceBuffer<__nv_bfloat16> a, b;
  WgradOperands(const Layout& l, int m_, int n_)
      : m(m_), n(n_), a(std::size_t(l.capacity) * m_), b(std::size_t(l.capacity) * n_) {
    fill_random(a, 1.0f);
    fill_random(b, 1.0f);
    l.poison_padding(a, m);
    l.poison_padding(b, n);
  }
  // A launch over these operands into `out` ([groups, m, n], ld n); segments, tickets and the
  // rest are the caller's.
  mok::gemm::WeightGradArgs args(void* out, bool out_fp32) const {
    mok::gemm::WeightGradArgs w;
    w.a = a.get();
    w.ld_a = m;
    w.b = b.get();
    w.ld_b = n;
    w.out = out;
    w.ld_out = n;
    w.out_fp32 = out_fp32;
    w.m = m;
    w.n = n;
    return w;
  }
};

// A strided output (WeightGradArgs::out_group_stride): each group's [m, n] in the second half of
// a [G, 2m, n + 64] buffer (the up half of a packed gradient, rows padded), through the TMA store
// (bf16) and the plain one (fp32), is bitwise the dense output, and no other byte of the buffer
// changes. A group stride that is not a multiple of ld_out, or below m * ld_out, is refused by
// name.
TEST(GemmWgrad, StridedOutputIsBitwiseTheDenseAndLeavesTheRestAlone) {
  MOK_REQUIRE_HOPPER();
  Layout l({0, 1, 130, 77, 0, 300, 64});
  const int G = l.groups(), m = 192, n = 320, ld = n + 64;
  const long long stride = 2LL * m * ld;  // a group's 2m rows of ld
  WgradOperands ops(l, m, n);
  for (const bool fp32 : {false, true}) {
    SCOPED_TRACE(fp32 ? "fp32" : "bf16");
    const std::size_t bytes = fp32 ? 4 : 2;
    DeviceBuffer<std::uint8_t> dense(std::size_t(G) * m * n * bytes);
    DeviceBuffer<std::uint8_t> strided(std::size_t(G) * stride * bytes);
    auto launch = [&](void* out, long long ld_out, long long group_stride) {
      mok::gemm::WeightGradArgs args = ops.args(out, fp32);
      args.segments = l.segments();
      args.order = mok::gemm::TileOrder::fixed;
      args.ld_out = ld_out;
      args.out_group_stride = group_stride;
      run_form(mok::gemm::weight_grad, args);
    };
    dense.poison();
    strided.poison();
    launch(dense.get(), n, 0);
    launch(strided.get() + std::size_t(m) * ld * bytes, ld, stride);
    MOK_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<std::uint8_t> want = dense.download(), got = strided.download();
    std::vector<std::uint8_t> expected(got.size(), 0xff);
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < m; ++r) {
        const std::size_t to = std::size_t(g) * stride + std::size_t(m + r) * ld;
        const std::size_t from = (std::size_t(g) * m + r) * n;
        std::memcpy(&expected[to * bytes], &want[from * bytes], n * bytes);
      }
    }
    long long wrong = 0, first = -1;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i] != expected[i] && wrong++ == 0) first = static_cast<long long>(i);
    }
    EXPECT_EQ(wrong, 0) << "bytes differ from the dense output (or the untouched rest), the first "
                        << "at byte " << first;
  }
  for (const long long bad : {2LL * m * ld + 8, (m - 1LL) * ld}) {
    try {
      mok::gemm::WeightGradArgs args = ops.args(nullptr, false);
      DeviceBuffer<__nv_bfloat16> out(std::size_t(G) * 2 * m * ld);
      args.out = out.get();
      args.segments = l.segments();
      args.order = mok::gemm::TileOrder::fixed;
      args.ld_out = ld;
      args.out_group_stride = bad;
      run_form(mok::gemm::weight_grad, args);
      ADD_FAILURE() << "out_group_stride " << bad << " was accepted";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), "out_group_stride") << e.what();
    }
  }
}

// A wgrad split over two row ranges (two ring passes), the second continuing the first's fp32
// sums, gives the bits of the unsplit reduction; `accumulate` adds the fresh sum to the output.
TEST(GemmWgrad, ContinuedReductionIsBitwiseTheUnsplitOneAndAccumulateAdds) {
  MOK_REQUIRE_HOPPER();
  Layout l({300, 0, 700, 129, 64});
  const int G = l.groups(), m = 192, n = 320;
  const int split = 640;  // a multiple of 128: inside group 2's segment [384, 1152)
  const WgradOperands ops(l, m, n);
  const std::size_t elems = std::size_t(G) * m * n;
  DeviceBuffer<float> whole(elems), parts(elems), added(elems);
  std::vector<int> s1(G + 1), r1(G), s2(G + 1), r2(G);
  for (int g = 0; g <= G; ++g) {
    s1[g] = std::min(l.starts[g], split);
    s2[g] = std::max(l.starts[g], split);
    if (g == G) break;
    r1[g] = std::max(0, std::min(l.starts[g] + l.counts[g], split) - l.starts[g]);
    r2[g] = std::max(0, l.starts[g] + l.counts[g] - s2[g]);
  }
  DeviceBuffer<int> d_s1(G + 1), d_r1(G), d_s2(G + 1), d_r2(G);
  d_s1.upload(s1);
  d_r1.upload(r1);
  d_s2.upload(s2);
  d_r2.upload(r2);
  auto launch = [&](RowSegments seg, float* out, bool cont, bool acc) {
    mok::gemm::WeightGradArgs args = ops.args(out, true);
    args.segments = seg;
    args.continue_reduction = cont;
    args.accumulate = acc;
    run_form(mok::gemm::weight_grad, args);
  };
  whole.poison();
  parts.poison();
  launch(l.segments(), whole.get(), false, false);
  launch(RowSegments{d_s1.get(), d_r1.get(), G, l.capacity, 0}, parts.get(), false, false);
  launch(RowSegments{d_s2.get(), d_r2.get(), G, l.capacity, 0}, parts.get(), true, false);
  std::vector<float> base(elems);
  for (std::size_t i = 0; i < elems; ++i) base[i] = 0.25f * float(i % 13) - 1.0f;
  added.upload(base);
  launch(l.segments(), added.get(), false, true);
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  // The unsplit launch itself: every row against the reference (the largest group: 700 rows).
  expect_wgrad_rows(whole.get(), l, ops.a, m, ops.b, n, 700 * std::ldexp(1.0, -24),
                    "unsplit fp32 wgrad");
  const auto w = whole.download(), p = parts.download(), ad = added.download();
  EXPECT_EQ(std::memcmp(w.data(), p.data(), elems * 4), 0) << "split reduction differs";
  long long wrong = 0;
  for (std::size_t i = 0; i < elems; ++i) wrong += ad[i] != base[i] + w[i];
  EXPECT_EQ(wrong, 0) << "accumulate is not out + fresh sum";
  for (std::size_t i = std::size_t(1) * m * n; i < std::size_t(2) * m * n; ++i) {
    ASSERT_EQ(w[i], 0.0f) << "empty group";
  }
}

// A wgrad split over ring passes with a pass plan (every group: skipped, whole, or opened,
// carried and closed through an fp32 slot) gives the bits of the unsplit launch, for bf16, fp32
// and accumulated fp32 outputs; with more pass boundaries than groups the slots are per group.
// Groups the plan skips are never written (poisoned outputs stay poisoned until their step).
TEST(GemmWgrad, PassPlanIsBitwiseTheUnsplitReduction) {
  MOK_REQUIRE_HOPPER();
  // Rows per group: a group spanning many passes, empty groups, one in a single pass, odd counts.
  Layout l({300, 0, 700, 129, 64, 1000, 5, 0});
  const int G = l.groups(), m = 192, n = 320;
  const WgradOperands ops(l, m, n);
  const auto& a = ops.a;
  const auto& b = ops.b;
  const std::size_t elems = std::size_t(G) * m * n;
  std::vector<float> base(elems);
  for (std::size_t i = 0; i < elems; ++i) base[i] = 0.25f * float(i % 13) - 1.0f;
  const DeviceBuffer<float> d_base(base);
  enum class Out { bf16, fp32, fp32_accumulate };
  DeviceBuffer<unsigned> tickets(2);
  MOK_CUDA_OK(cudaMemset(tickets.get(), 0, 2 * sizeof(unsigned)));
  auto args_for = [&](Out o, void* out) {
    mok::gemm::WeightGradArgs args = ops.args(out, o != Out::bf16);
    args.accumulate = o == Out::fp32_accumulate;
    args.tickets = tickets.get();
    return args;
  };
  for (Out o : {Out::bf16, Out::fp32, Out::fp32_accumulate}) {
    const std::size_t bytes = elems * (o == Out::bf16 ? 2 : 4);
    DeviceBuffer<unsigned char> whole(bytes), parts(bytes);
    auto reset = [&](DeviceBuffer<unsigned char>& out) {
      if (o == Out::fp32_accumulate) {
        MOK_CUDA_OK(cudaMemcpy(out.get(), base.data(), bytes, cudaMemcpyHostToDevice));
      } else {
        MOK_CUDA_OK(cudaMemset(out.get(), 0xff, bytes));  // NaN in bf16 and fp32
      }
    };
    reset(whole);
    mok::gemm::WeightGradArgs one = args_for(o, whole.get());
    one.segments = l.segments();
    run_form(mok::gemm::weight_grad, one);
    // The unsplit launch itself: every row against the reference (the largest group: 1000 rows).
    if (o == Out::bf16) {
      expect_wgrad_rows(reinterpret_cast<const __nv_bfloat16*>(whole.get()), l, a, m, b, n, kU,
                        "unsplit bf16 wgrad");
    } else {
      expect_wgrad_rows(reinterpret_cast<const float*>(whole.get()), l, a, m, b, n,
                        1000 * std::ldexp(1.0, -24), "unsplit fp32 wgrad",
                        o == Out::fp32_accumulate ? d_base.get() : nullptr);
    }
    for (int pass_rows : {640, 256, 128}) {
      const int passes = (l.starts.back() + pass_rows - 1) / pass_rows;
      const int slots = std::min(passes - 1, G);
      DeviceBuffer<float> carry(std::size_t(std::max(slots, 1)) * m * n);
      MOK_CUDA_OK(cudaMemset(carry.get(), 0xff, carry.size() * 4));
      reset(parts);
      std::vector<int> steps_seen;
      for (int pass = 0; pass < passes; ++pass) {
        const int r0 = pass * pass_rows;
        const HostPass h = host_pass(l, pass, passes, pass_rows);
        for (int step : h.steps) steps_seen.push_back(step & 0xff);
        const DeviceBuffer<int> d_starts(h.starts), d_rows(h.rows), d_steps(h.steps);
        // The pass's rows: the row buffers from row r0 on (as the ring holds them).
        mok::gemm::WeightGradArgs args = args_for(o, parts.get());
        args.a = a.get() + std::size_t(r0) * m;
        args.b = b.get() + std::size_t(r0) * n;
        args.segments = RowSegments{d_starts.get(), d_rows.get(), G, l.capacity - r0, 0};
        args.passes = {d_steps.get(), carry.get(), slots};
        run_form(mok::gemm::weight_grad, args);
        if (pass > 0) {
          args.continue_reduction = true;
          run_form(mok::gemm::weight_grad, args);
        }
        MOK_CUDA_OK(cudaDeviceSynchronize());  // d_starts and friends die with this iteration
      }
      MOK_CUDA_OK(cudaGetLastError());
      for (int step : {mok::gemm::kSkip, mok::gemm::kWhole, mok::gemm::kOpen, mok::gemm::kClose}) {
        EXPECT_NE(std::count(steps_seen.begin(), steps_seen.end(), step), 0)
            << "pass rows " << pass_rows << " never has step " << step;
      }
      if (pass_rows == 128) {
        EXPECT_GT(passes - 1, G) << "slots per group not exercised";
        EXPECT_NE(std::count(steps_seen.begin(), steps_seen.end(), mok::gemm::kCarry), 0);
      }
      std::vector<unsigned char> w(bytes), p(bytes);
      MOK_CUDA_OK(cudaMemcpy(w.data(), whole.get(), bytes, cudaMemcpyDeviceToHost));
      MOK_CUDA_OK(cudaMemcpy(p.data(), parts.get(), bytes, cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::memcmp(w.data(), p.data(), bytes), 0)
          << "output " << static_cast<int>(o) << ", pass rows " << pass_rows
          << ": the split reduction differs from the unsplit one";
    }
  }
  EXPECT_EQ(tickets.download(), std::vector<unsigned>(2, 0u)) << "the counter pair was not reset";
}

// wgrad launches in flight at once on two streams, and replays of a captured one, give the bits of
// a single launch (each launch has its own ticket counter pair, which its last CTA resets; the
// automatic order may or may not use it).
TEST(GemmWgrad, ConcurrentStreamsAndGraphReplaysAreBitwiseOneLaunch) {
  MOK_REQUIRE_HOPPER();
  Layout l({900, 0, 77, 2000, 128, 1, 640});
  const int G = l.groups(), m = 192, n = 320;
  const WgradOperands ops(l, m, n);
  const std::size_t elems = std::size_t(G) * m * n;
  constexpr int kCopies = 6;
  std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> outs;
  for (int i = 0; i <= kCopies; ++i)
    outs.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(elems));
  cudaStream_t streams[2];
  for (auto& st : streams) MOK_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  // The counter pair of outs[i]: pairs[2i, 2i + 2).
  DeviceBuffer<unsigned> pairs(2 * (kCopies + 1));
  MOK_CUDA_OK(cudaMemset(pairs.get(), 0, pairs.size() * sizeof(unsigned)));
  auto launch = [&](int i, cudaStream_t stream) {
    mok::gemm::WeightGradArgs args = ops.args(outs[i]->get(), false);
    args.segments = l.segments();
    args.tickets = pairs.get() + 2 * i;
    args.stream = stream;
    run_form(mok::gemm::weight_grad, args);
  };
  for (auto& o : outs) o->poison();
  MOK_CUDA_OK(cudaDeviceSynchronize());
  launch(0, nullptr);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  expect_wgrad_rows(outs[0]->get(), l, ops.a, m, ops.b, n, kU, "the single launch");
  for (int i = 1; i <= 4; ++i) launch(i, streams[i % 2]);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_OK(cudaStreamBeginCapture(streams[0], cudaStreamCaptureModeGlobal));
  launch(5, streams[0]);
  launch(6, streams[0]);
  MOK_CUDA_OK(cudaStreamEndCapture(streams[0], &graph));
  MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    outs[5]->poison();
    outs[6]->poison();
    MOK_CUDA_OK(cudaDeviceSynchronize());
    MOK_CUDA_OK(cudaGraphLaunch(exec, streams[0]));
    MOK_CUDA_OK(cudaStreamSynchronize(streams[0]));
    for (int i = 1; i <= kCopies; ++i) {
      EXPECT_TRUE(bitwise_equal(*outs[0], *outs[i])) << "copy " << i << ", replay " << replay;
    }
  }
  const auto h = outs[0]->download();
  long long nan = 0;
  for (const auto v : h) nan += std::isnan(__bfloat162float(v));
  EXPECT_EQ(nan, 0) << "unwritten output elements";
  EXPECT_EQ(pairs.download(), std::vector<unsigned>(pairs.size(), 0u))
      << "a counter pair was not reset";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (auto& st : streams) cudaStreamDestroy(st);
}

// ---------------------------------------------------------------------------------------------
// Ticket counters: every launch draws its tiles from the pair its caller gives it

// One wgrad problem of the GemmTickets test, always with TileOrder::tickets: `continued` launches
// continue an fp32 reduction from `seed` (the output is reset to it before every launch), the
// others store bf16.
struct TicketProblem {
  Layout layout;
  int m, n;
  bool continued;
  DeviceBuffer<__nv_bfloat16> a, b;
  DeviceBuffer<float> seed;
  std::size_t out_elems;
  TicketProblem(const std::vector<int>& counts, int m_, int n_, bool continued_)
      : layout(counts),
        m(m_),
        n(n_),
        continued(continued_),
        a(std::size_t(layout.capacity) * m_),
        b(std::size_t(layout.capacity) * n_),
        seed(continued_ ? std::size_t(layout.groups()) * m_ * n_ : 0),
        out_elems(std::size_t(layout.groups()) * m_ * n_) {
    fill_random(a, 1.0f);
    fill_random(b, 1.0f);
    layout.poison_padding(a, m);
    layout.poison_padding(b, n);
    if (continued) {
      std::vector<float> h(out_elems);
      std::mt19937_64 rng(next_seed());
      for (auto& v : h) v = float(int(rng() % 2001) - 1000) / 256.0f;
      seed.upload(h);
    }
  }
  // The output before a launch: the seed (continued) or poison.
  void reset(void* out, cudaStream_t stream) const {
    if (continued) {
      cudaMemcpyAsync(out, seed.get(), out_elems * 4, cudaMemcpyDeviceToDevice, stream);
    } else {
      cudaMemsetAsync(out, 0xff, out_elems * 2, stream);
    }
  }
  void launch(void* out, unsigned* tickets, cudaStream_t stream) const {
    mok::gemm::WeightGradArgs args;
    args.order = mok::gemm::TileOrder::tickets;
    args.segments = layout.segments();
    args.a = a.get();
    args.ld_a = m;
    args.b = b.get();
    args.ld_b = n;
    args.out = out;
    args.ld_out = n;
    args.out_fp32 = continued;
    args.continue_reduction = continued;
    args.m = m;
    args.n = n;
    args.tickets = tickets;
    args.stream = stream;
    run_form(mok::gemm::weight_grad, args);
  }
  std::size_t out_bytes() const { return out_elems * (continued ? 4 : 2); }
};

bool same_bytes(const void* x, const void* y, std::size_t bytes) {
  std::vector<unsigned char> a(bytes), b(bytes);
  cudaMemcpy(a.data(), x, bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), y, bytes, cudaMemcpyDeviceToHost);
  return std::memcmp(a.data(), b.data(), bytes) == 0;
}

// A plain and a continued wgrad in flight at once, on two streams and as parallel branches of a
// replayed CUDA graph, each with its own counter pair: every result is bitwise its single launch.
// The plain one (P) has a few long tiles (one group of 16384 rows: 256 K blocks a tile); the
// continued one (C) thousands of short ones. Launched P first: P's CTAs without a tile leave at
// once and C's CTAs draw tiles on their SMs while P's long tiles run. Had the two one pair
// (9a62ee7: the plain and the continued instantiation take pairs round robin, each from slot
// 0, so the i-th plain and the i-th continued launch of a process share one), C's CTAs would take
// tickets past P's, and P's last CTA would reset the pair under C, whose CTAs then take its tiles
// from 0 again: tiles computed twice, each time from the output, which a continued reduction
// reads (so C's bits change). Run alone with --gtest_filter='*GemmTickets*' for that.
TEST(GemmTickets, PlainAndContinuedInFlightTogetherAreBitwiseTheirSingleLaunches) {
  MOK_REQUIRE_HOPPER();
  const TicketProblem p(std::vector<int>{16384}, 256, 256, false);
  const TicketProblem c(std::vector<int>(64, 1024), 1024, 1024, true);
  // Pairs: 0, 1 the single launches; 2, 3 the streams; 4, 5 the graph.
  DeviceBuffer<unsigned> pairs(12);
  MOK_CUDA_OK(cudaMemset(pairs.get(), 0, pairs.size() * sizeof(unsigned)));
  DeviceBuffer<unsigned char> want_p(p.out_bytes()), want_c(c.out_bytes()), got_p(p.out_bytes()),
      got_c(c.out_bytes()), graph_p(p.out_bytes()), graph_c(c.out_bytes());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  // The single launches (also the first launch of each instantiation: attributes set before any
  // capture). As many plain as continued launches before every pair below.
  p.reset(want_p.get(), nullptr);
  p.launch(want_p.get(), pairs.get() + 0, nullptr);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  c.reset(want_c.get(), nullptr);
  c.launch(want_c.get(), pairs.get() + 2, nullptr);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  {
    const auto h = want_p.download();
    long long unwritten = 0;
    for (std::size_t i = 0; i + 1 < h.size(); i += 2) unwritten += h[i] == 0xff && h[i + 1] == 0xff;
    ASSERT_EQ(unwritten, 0) << "the single plain launch left output elements unwritten";
    ASSERT_FALSE(same_bytes(want_c.get(), c.seed.get(), c.out_bytes()))
        << "the continued launch wrote nothing";
    // The single launches themselves, every row against the reference (the continued one: its
    // seed plus the reference; 1024 rows a group).
    expect_wgrad_rows(reinterpret_cast<const __nv_bfloat16*>(want_p.get()), p.layout, p.a, p.m, p.b,
                      p.n, kU, "the single plain launch");
    expect_wgrad_rows(reinterpret_cast<const float*>(want_c.get()), c.layout, c.a, c.m, c.b, c.n,
                      1024 * std::ldexp(1.0, -24), "the single continued launch", c.seed.get());
  }

  cudaStream_t s0, s1;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  for (int round = 0; round < 3; ++round) {
    p.reset(got_p.get(), s0);
    c.reset(got_c.get(), s1);
    MOK_CUDA_OK(cudaDeviceSynchronize());
    p.launch(got_p.get(), pairs.get() + 4, s0);
    c.launch(got_c.get(), pairs.get() + 6, s1);
    MOK_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(same_bytes(got_p.get(), want_p.get(), p.out_bytes()))
        << "streams, round " << round << ": the plain wgrad differs from its single launch";
    EXPECT_TRUE(same_bytes(got_c.get(), want_c.get(), c.out_bytes()))
        << "streams, round " << round << ": the continued wgrad differs from its single launch";
  }

  cudaEvent_t fork, join;
  MOK_CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  MOK_CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  MOK_CUDA_OK(cudaEventRecord(fork, s0));
  MOK_CUDA_OK(cudaStreamWaitEvent(s1, fork, 0));
  p.reset(graph_p.get(), s0);
  p.launch(graph_p.get(), pairs.get() + 8, s0);
  c.reset(graph_c.get(), s1);
  c.launch(graph_c.get(), pairs.get() + 10, s1);
  MOK_CUDA_OK(cudaEventRecord(join, s1));
  MOK_CUDA_OK(cudaStreamWaitEvent(s0, join, 0));
  MOK_CUDA_OK(cudaStreamEndCapture(s0, &graph));
  MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    MOK_CUDA_OK(cudaGraphLaunch(exec, s0));
    MOK_CUDA_OK(cudaStreamSynchronize(s0));
    EXPECT_TRUE(same_bytes(graph_p.get(), want_p.get(), p.out_bytes()))
        << "graph replay " << replay << ": the plain wgrad differs from its single launch";
    EXPECT_TRUE(same_bytes(graph_c.get(), want_c.get(), c.out_bytes()))
        << "graph replay " << replay << ": the continued wgrad differs from its single launch";
  }
  EXPECT_EQ(pairs.download(), std::vector<unsigned>(pairs.size(), 0u))
      << "a launch's last CTA did not reset its counter pair";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
}

// The tiles really come from the caller's pair: with its ticket counter set past the last tile, a
// TileOrder::tickets launch computes nothing (the output stays poisoned), and its last CTA still
// puts the pair back to zero.
TEST(GemmTickets, TilesComeFromTheCallersPair) {
  MOK_REQUIRE_HOPPER();
  const TicketProblem p(std::vector<int>{300, 0, 77}, 192, 320, false);
  DeviceBuffer<unsigned> pair(2);
  pair.upload({1u << 30, 0u});
  DeviceBuffer<unsigned char> out(p.out_bytes());
  p.reset(out.get(), nullptr);
  p.launch(out.get(), pair.get(), nullptr);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto h = out.download();
  long long written = 0;
  for (const auto v : h) written += v != 0xff;
  EXPECT_EQ(written, 0) << "tiles were computed though the counter was past the last one";
  EXPECT_EQ(pair.download(), (std::vector<unsigned>{0, 0})) << "the pair was not reset";
  // And from zero, the same pair gives the whole result.
  p.reset(out.get(), nullptr);
  p.launch(out.get(), pair.get(), nullptr);
  MOK_CUDA_OK(cudaDeviceSynchronize());
  long long unwritten = 0;
  const auto g = out.download();
  for (std::size_t i = 0; i + 1 < g.size(); i += 2) unwritten += g[i] == 0xff && g[i + 1] == 0xff;
  EXPECT_EQ(unwritten, 0);
  expect_wgrad_rows(reinterpret_cast<const __nv_bfloat16*>(out.get()), p.layout, p.a, p.m, p.b, p.n,
                    kU, "the launch from zero");
}

TEST(GemmArguments, TicketOrderWithoutCountersNamesTheField) {
  MOK_REQUIRE_HOPPER();
  Layout l({100});
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * 64), out(64 * 64);
  mok::gemm::WeightGradArgs args;
  args.segments = l.segments();
  args.order = mok::gemm::TileOrder::tickets;
  args.a = a.get();
  args.ld_a = 64;
  args.b = a.get();
  args.ld_b = 64;
  args.out = out.get();
  args.ld_out = 64;
  args.m = 64;
  args.n = 64;
  try {
    run_form(mok::gemm::weight_grad, args);
    ADD_FAILURE() << "TileOrder::tickets without a counter pair was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "WeightGradArgs.tickets") << e.what();
  }
  args.order = mok::gemm::TileOrder::fixed;  // fine without counters
  EXPECT_NO_THROW(run_form(mok::gemm::weight_grad, args));
  MOK_CUDA_OK(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------------------------
// Group sizes changed on the device, between launches and under CUDA graph replay.

__global__ void set_counts_kernel(int* counts, const int* values, int n) {
  if (threadIdx.x < n) counts[threadIdx.x] = values[threadIdx.x];
}

TEST(GemmDeviceGroups, SizesChangedOnDeviceBetweenGraphReplays) {
  MOK_REQUIRE_HOPPER();
  const int n = 256, k = 320;
  // Segments sized for 384 rows each; the counts live on the device and change between replays.
  Layout l(std::vector<int>{384, 384, 384, 384});
  const int G = l.groups();
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * k), w(std::size_t(G) * n * k),
      out(std::size_t(l.capacity) * n);
  fill_random(a, 1.0f);
  fill_random(w, 0.1f);
  const std::vector<std::vector<int>> count_sets = {
      {384, 0, 17, 200}, {1, 383, 0, 129}, {0, 0, 0, 0}};
  DeviceBuffer<int> values(G);
  cudaStream_t stream;
  MOK_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  mok::gemm::RowsTimesWeightTArgs args;
  args.segments = l.segments();
  args.a = a.get();
  args.ld_a = k;
  args.w = w.get();
  args.out = out.get();
  args.ld_out = n;
  args.n = n;
  args.k = k;
  args.stream = stream;
  // One launch before capture, so first-use set-up (kernel attributes, the timeout report's
  // pinned memory) stays out of the captured region.
  values.upload(count_sets[0]);
  set_counts_kernel<<<1, 32, 0, stream>>>(l.d_counts.get(), values.get(), G);
  run_form(mok::gemm::rows_times_weight_t, args);
  MOK_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  set_counts_kernel<<<1, 32, 0, stream>>>(l.d_counts.get(), values.get(),
                                          G);  // sizes set on the device
  run_form(mok::gemm::rows_times_weight_t, args);
  MOK_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  MOK_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  DeviceBuffer<float> ref(std::size_t(l.capacity) * n);
  for (const auto& counts : count_sets) {
    values.upload(counts);
    out.poison();
    MOK_CUDA_OK(cudaDeviceSynchronize());  // both done before the replay on the other stream
    MOK_CUDA_OK(cudaGraphLaunch(exec, stream));
    MOK_CUDA_OK(cudaStreamSynchronize(stream));
    // Every row of the current counts against the reference; the rows past each group's current
    // count (and past the segments) stay poisoned.
    reference_rows(l.starts, counts, a, k, w, 0, n, k, ref);
    const RowCheck e = check_row_buffer(out.get(), l.starts, counts, l.capacity, n, Want::ref,
                                        ref.get(), nullptr, nullptr, kU);
    std::printf("[ mok ] graph replay counts {%d,%d,%d,%d}: worst row error %.3g (bound %.3g)\n",
                counts[0], counts[1], counts[2], counts[3], e.worst, kU);
    expect_rows_within(e, total_rows(counts), kU, "out");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---------------------------------------------------------------------------------------------
// Waits that give up: no hang, no trap, a report, and a context that still works afterwards

constexpr std::uint64_t kShortTimeoutNs = 200'000'000;  // 0.2 s

// Runs a launch whose CTA 0 never gets the data of its first stage (the stall-hooked kernel of
// tests/cpp/support, timeout kShortTimeoutNs, its report in `report`) to its end. The shapes keep
// every CTA at one tile of at most 3 K blocks (no more than any form's stages), so the stalled
// CTA's Producer never waits and the one wait that times out is its Consumers' on the full
// barrier. `other`: a report no launch here writes to, which must stay empty.
template <class Launch>
void expect_stalled_launch_gives_up(mok::gemm::TimeoutReport& report_to,
                                    mok::gemm::TimeoutReport& other, Launch&& launch_stalled) {
  ASSERT_EQ(report_to.take(), "") << "a fresh report is empty";
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  launch_stalled();
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());  // returns (no hang) and succeeds (no trap)
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(report_to.peek(), report_to.peek()) << "peek() changed the report";
  const std::string report = report_to.take();
  std::printf("[ mok ] stalled launch ended after %.3f s: %s\n", seconds, report.c_str());
  EXPECT_GE(seconds, 0.9e-9 * kShortTimeoutNs) << "ended before a wait could time out";
  EXPECT_LT(seconds, 10.0) << "took far longer than its timeout";
  EXPECT_NE(report.find("barrier full ("), std::string::npos) << report;
  EXPECT_NE(report.find("in block 0,"), std::string::npos) << report;
  EXPECT_EQ(report_to.take(), "") << "take() did not clear the report";
  EXPECT_EQ(other.take(), "") << "another caller's report saw the stall";
}

TEST(GemmWaits, StalledDgradEndsWithAReportAndTheNextLaunchIsRight) {
  MOK_REQUIRE_HOPPER();
  Layout l({200, 77, 300});  // 6 M tiles: 6 or 12 tiles, fewer than the CTAs
  const int G = l.groups(), n = 256, k = 192;
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * k), w(std::size_t(G) * k * n),
      out(std::size_t(l.capacity) * n), out2(std::size_t(l.capacity) * n);
  fill_random(a, 1.0f);
  fill_random(w, 2.0f / std::sqrt(float(k)));
  l.poison_padding(a, k);
  mok::gemm::TimeoutReport report, other;
  auto launch = [&](__nv_bfloat16* dst, mok::gemm::WaitOptions waits, int stall_block = -1) {
    mok::gemm::RowsTimesWeightArgs args;
    args.segments = l.segments();
    args.a = a.get();
    args.ld_a = k;
    args.w = w.get();
    args.out = dst;
    args.ld_out = n;
    args.n = n;
    args.k = k;
    args.waits = waits;
    if (stall_block >= 0) {
      mok::test::launch_rows_times_weight_stalled(args, stall_block);
    } else {
      mok::gemm::rows_times_weight(args);
    }
  };
  expect_stalled_launch_gives_up(report, other, [&] {
    launch(out.get(), {kShortTimeoutNs, &report}, 0);
  });
  // The next launch in this process, on the same context: right, and leaves no report.
  out.poison();
  launch(out.get(), {.report = &report});
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  DeviceBuffer<float> ref(std::size_t(l.capacity) * n);
  reference_rows(l.starts, l.counts, a, k, w, 1, n, k, ref);
  const RowCheck e = check_row_buffer(out.get(), l.starts, l.counts, l.capacity, n, Want::ref,
                                      ref.get(), nullptr, nullptr, kU);
  expect_rows_within(e, total_rows(l.counts), kU, "dgrad after a stalled one");
  out2.poison();
  launch(out2.get(), {.report = &report});
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(bitwise_equal(out, out2)) << "two runs after the stalled one differ";
  EXPECT_EQ(report.take(), "") << "a launch that did not stall left a report";
}

// The K-grouped form: its Consumers take tiles from the queue, so they must all see its end.
TEST(GemmWaits, StalledWgradEndsWithAReportAndTheNextLaunchIsRight) {
  MOK_REQUIRE_HOPPER();
  Layout l({150, 0, 64});  // 3, 0 and 1 K blocks; 6 or 12 tiles
  const int G = l.groups(), m = 256, n = 256;
  const WgradOperands ops(l, m, n);
  const auto& a = ops.a;
  const auto& b = ops.b;
  const std::size_t elems = std::size_t(G) * m * n;
  DeviceBuffer<__nv_bfloat16> out(elems), out2(elems);
  mok::gemm::TimeoutReport report, other;
  auto launch = [&](__nv_bfloat16* dst, mok::gemm::WaitOptions waits, int stall_block = -1) {
    mok::gemm::WeightGradArgs args = ops.args(dst, false);
    args.segments = l.segments();
    args.waits = waits;
    if (stall_block >= 0) {
      mok::test::launch_weight_grad_stalled(args, stall_block);
    } else {
      mok::gemm::weight_grad(args);
    }
  };
  expect_stalled_launch_gives_up(report, other, [&] {
    launch(out.get(), {kShortTimeoutNs, &report}, 0);
  });
  out.poison();
  launch(out.get(), {.report = &report});
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  expect_wgrad_rows(out.get(), l, a, m, b, n, kU, "wgrad after a stalled one");
  out2.poison();
  launch(out2.get(), {.report = &report});
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(bitwise_equal(out, out2)) << "two runs after the stalled one differ";
  EXPECT_EQ(report.take(), "") << "a launch that did not stall left a report";
}

TEST(GemmArguments, WaitTimeoutMustBePositive) {
  MOK_REQUIRE_HOPPER();
  Layout l({100});
  DeviceBuffer<__nv_bfloat16> a(std::size_t(l.capacity) * 64), w(64 * 64),
      x(std::size_t(l.capacity) * 64);
  mok::gemm::RowsTimesWeightTArgs args;
  args.segments = l.segments();
  args.a = a.get();
  args.ld_a = 64;
  args.w = w.get();
  args.out = x.get();
  args.ld_out = 64;
  args.n = 64;
  args.k = 64;
  args.waits.timeout_ns = 0;
  try {
    mok::gemm::rows_times_weight_t(args);
    ADD_FAILURE() << "a zero wait timeout was accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "waits.timeout_ns") << e.what();
  }
}

}  // namespace
