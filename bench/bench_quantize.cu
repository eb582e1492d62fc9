// The FP8 layer's pass quantizers alone, against the copy they cannot beat (docs/perf/NOTES.md,
// "2026-12-05, 70fd521"): for each of PERF.md's cases, its routed rows (T x k, uniform over the
// experts, each group padded to 128 rows as the layer's segments are) quantized
//   - along the tokens (the weight gradients' operands) at K = H (t(x), t(dy)) and K = I (t(h),
//     t(dg), t(du)), by both kernels of launch_quantize_pass_token_axis (row_loads false, true);
//   - along K (the rows form) at K = H and K = I;
// and a device-to-device copy of the token-axis pass's input bytes: the floor is its rate over
// the bytes a pass reads and writes (bf16 in, e4m3 and scales out).
//
// Before timing, the two token-axis kernels' outputs are compared byte for byte (they must give
// the same bits; the tests check both against the CPU reference); a difference ends the run.
// Each time is the median of 20 launches (CUDA events, after 3 warm-ups, L2 flushed before each
// by a 256 MiB memset), inputs random bf16 from a printed seed.
//
// Usage: mok_quantize_bench OUT.jsonl [COMMIT] [CASE,CASE,...] (default every case). One JSON
// object a case, K and kernel: median_ms, the bytes it reads and writes, GB/s, and that rate over
// the copy's. Under ncu, the first two launches of a case and K are the two token-axis kernels
// (row_loads false, then true) at K = H.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "core/fp8.hpp"
#include "cuda/kernels/quantize_pass_fp8.hpp"

namespace {

struct Case {
  const char* name;
  std::int64_t tokens, hidden, intermediate, experts, topk;
};

// PERF.md's cases (the routed experts; dsv3-ep1 as dsv3-ep8slice at eight times the experts).
constexpr Case kCases[] = {
    {"dsv3-ep8slice", 4096, 7168, 2048, 32, 8},
    {"qwen3-30b-a3b", 16384, 2048, 768, 128, 8},
    {"mixtral-8x7b", 8192, 4096, 14336, 8, 2},
};

template <class F>
double median_ms(const F& launch, void* flush, std::size_t flush_bytes) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
    CHECK_CUDA(cudaEventRecord(start));
    launch();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
}

template <class T>
std::vector<T> download(const T* p, std::size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  std::string commit;
  std::FILE* json = open_results(argc, argv, commit);
  const std::uint64_t seed = std::random_device{}();
  std::printf("mok_quantize_bench: seed %llu\n", static_cast<unsigned long long>(seed));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const std::size_t flush_bytes = std::size_t{256} << 20;
  void* flush = nullptr;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  std::printf("%-14s %-6s %6s %-18s %10s %9s %9s\n", "case", "form", "K", "kernel", "median_ms",
              "GB/s", "of copy");
  const std::string only = argc > 3 ? std::string(",") + argv[3] + "," : std::string();
  for (const Case& c : kCases) {
    if (!only.empty() && only.find(std::string(",") + c.name + ",") == std::string::npos) continue;
    // The routed rows, uniform: each expert's count, its group padded to 128 rows.
    const std::int64_t routed = c.tokens * c.topk;
    std::vector<std::int32_t> counts(c.experts), starts(c.experts + 1, 0);
    for (std::int64_t g = 0; g < c.experts; ++g) {
      counts[g] = static_cast<std::int32_t>(routed / c.experts + (g < routed % c.experts ? 1 : 0));
      starts[g + 1] = starts[g] + (counts[g] + 127) / 128 * 128;
    }
    const std::int64_t rows = starts[c.experts];
    std::int32_t* d_starts = nullptr;
    std::int32_t* d_counts = nullptr;
    CHECK_CUDA(cudaMalloc(&d_starts, starts.size() * sizeof(std::int32_t)));
    CHECK_CUDA(cudaMalloc(&d_counts, counts.size() * sizeof(std::int32_t)));
    CHECK_CUDA(cudaMemcpy(d_starts, starts.data(), starts.size() * sizeof(std::int32_t),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_counts, counts.data(), counts.size() * sizeof(std::int32_t),
                          cudaMemcpyHostToDevice));
    for (const std::int64_t K : {c.hidden, c.intermediate}) {
      const std::size_t in_bytes = static_cast<std::size_t>(rows * K) * 2;
      const std::size_t out_bytes =
          static_cast<std::size_t>(rows * K) + static_cast<std::size_t>(rows / 128 * K) * 4;
      std::vector<std::uint16_t> x(static_cast<std::size_t>(rows * K));
      std::mt19937_64 rng(seed + K);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (std::uint16_t& v : x) {
        float f = normal(rng);
        std::uint32_t bits;
        std::memcpy(&bits, &f, 4);
        v = static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
      }
      std::uint16_t* d_x = nullptr;
      std::uint8_t* d_copy = nullptr;
      std::uint8_t* d_data[2] = {nullptr, nullptr};
      float* d_scales[2] = {nullptr, nullptr};
      CHECK_CUDA(cudaMalloc(&d_x, in_bytes));
      CHECK_CUDA(cudaMalloc(&d_copy, in_bytes));
      CHECK_CUDA(cudaMemcpy(d_x, x.data(), in_bytes, cudaMemcpyHostToDevice));
      for (int v = 0; v < 2; ++v) {
        CHECK_CUDA(cudaMalloc(&d_data[v], static_cast<std::size_t>(rows * K)));
        CHECK_CUDA(cudaMalloc(&d_scales[v], static_cast<std::size_t>(rows / 128 * K) * 4));
        CHECK_CUDA(cudaMemset(d_data[v], 0xff, static_cast<std::size_t>(rows * K)));
        CHECK_CUDA(cudaMemset(d_scales[v], 0xff, static_cast<std::size_t>(rows / 128 * K) * 4));
      }
      mok::cuda::QuantizePassTokenAxisParams p;
      p.x = d_x;
      p.ld_x = K;
      p.rows = rows;
      p.K = K;
      p.starts = d_starts;
      p.counts = d_counts;
      p.groups = static_cast<int>(c.experts);
      p.ld = rows;
      p.scale_ld = K;
      const auto token_axis = [&](bool row_loads) {
        mok::cuda::QuantizePassTokenAxisParams q = p;
        q.row_loads = row_loads;
        q.data = d_data[row_loads];
        q.scales = d_scales[row_loads];
        CHECK_CUDA(mok::cuda::launch_quantize_pass_token_axis(q, nullptr));
      };
      token_axis(false);
      token_axis(true);
      CHECK_CUDA(cudaDeviceSynchronize());
      const std::vector<float> s0 = download(d_scales[0], rows / 128 * K);
      const std::vector<float> s1 = download(d_scales[1], rows / 128 * K);
      if (download(d_data[0], rows * K) != download(d_data[1], rows * K) ||
          std::memcmp(s0.data(), s1.data(), s0.size() * sizeof(float)) != 0) {
        std::fprintf(stderr, "%s K %lld: the two token-axis kernels differ\n", c.name,
                     static_cast<long long>(K));
        return 1;
      }
      mok::cuda::QuantizePassRowsParams r;
      r.x = d_x;
      r.ld_x = K;
      r.rows = rows;
      r.K = K;
      r.data = d_data[0];
      r.ld = K;
      r.scales = d_scales[0];
      r.scale_ld = rows;
      const double copy_ms = median_ms(
          [&] {
            CHECK_CUDA(cudaMemcpyAsync(d_copy, d_x, in_bytes, cudaMemcpyDeviceToDevice));
          },
          flush, flush_bytes);
      const double copy_rate = 2.0 * static_cast<double>(in_bytes) / (copy_ms * 1e-3);
      struct Timed {
        const char* form;
        const char* kernel;
        double ms;
      };
      const Timed timed[] = {
          {"copy", "cudaMemcpyAsync", copy_ms},
          {"tokens", "tile", median_ms([&] { token_axis(false); }, flush, flush_bytes)},
          {"tokens", "tile_rows", median_ms([&] { token_axis(true); }, flush, flush_bytes)},
          {"rows", "rows",
           median_ms([&] { CHECK_CUDA(mok::cuda::launch_quantize_pass_rows(r, nullptr)); },
                     flush, flush_bytes)},
      };
      for (const Timed& t : timed) {
        const double bytes = std::strcmp(t.form, "copy") == 0
                                 ? 2.0 * static_cast<double>(in_bytes)
                                 : static_cast<double>(in_bytes + out_bytes);
        const double rate = bytes / (t.ms * 1e-3);
        std::printf("%-14s %-6s %6lld %-18s %10.4f %9.0f %9.2f\n", c.name, t.form,
                    static_cast<long long>(K), t.kernel, t.ms, rate * 1e-9, rate / copy_rate);
        std::fprintf(json,
                     "{\"suite\": \"quantize\", \"case\": \"%s\", \"form\": \"%s\", \"K\": %lld, "
                     "\"rows\": %lld, \"kernel\": \"%s\", \"median_ms\": %.5f, \"bytes\": %.0f, "
                     "\"gb_s\": %.1f, \"of_copy\": %.3f, \"device\": \"%s\", \"commit\": \"%s\", "
                     "\"seed\": %llu}\n",
                     c.name, t.form, static_cast<long long>(K), static_cast<long long>(rows),
                     t.kernel, t.ms, bytes, rate * 1e-9, rate / copy_rate, prop.name,
                     commit.c_str(), static_cast<unsigned long long>(seed));
      }
      CHECK_CUDA(cudaFree(d_x));
      CHECK_CUDA(cudaFree(d_copy));
      for (int v = 0; v < 2; ++v) {
        CHECK_CUDA(cudaFree(d_data[v]));
        CHECK_CUDA(cudaFree(d_scales[v]));
      }
    }
    CHECK_CUDA(cudaFree(d_starts));
    CHECK_CUDA(cudaFree(d_counts));
  }
  CHECK_CUDA(cudaFree(flush));
  std::fclose(json);
  return 0;
}
