// bench_dispatch: the layer's dispatch kernels in both orders, on PERF.md's shapes (one rank, the
// default Config, pass 0 of the schedule build_schedule makes for the routing): the row order
// (launch_pull_rows: a warp per ring row, so a token routed to k of the rank's experts is read k
// times) against the token order (launch_pull_tokens: a warp per source token, read once and
// written to each of its rows; the layer's launches). Two forms: the forward's x, and the
// backward's d_out with each row's router weight beside it (row_weights).
//
// Method (PERF.md): both orders' rings and weights compared bitwise first (poisoned before each
// launch); then the two orders interleaved call by call, which goes first alternating, after a
// warm-up; CUDA events around each launch; the median of each order and of the per-pair ratios.
// One input set per routing: the ring a call writes (hundreds of MB) leaves no earlier input in
// the L2. The floor of a form is its bytes at the measured device copy rate (PERF.md: 4.22 TB/s):
// the token order's x read once and every row written once.
//
//   bench_dispatch [--reps 50] [--json FILE] [--commit SHA]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench_routing.hpp"
#include "cuda/comm/team.hpp"
#include "cuda/kernels/transfer.hpp"
#include "mok/schedule.hpp"
#include "support/transfers.hpp"

namespace {

using namespace mok;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_dispatch: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Shape {
  const char* name;
  std::int64_t T, H, E, k;
};
constexpr Shape kShapes[] = {{"dsv3-ep8slice", 4096, 7168, 32, 8},
                             {"dsv3-ep1", 4096, 7168, 256, 8},
                             {"qwen3-30b-a3b", 16384, 2048, 128, 8},
                             {"mixtral-8x7b", 8192, 4096, 8, 2}};

template <class T>
struct Device {
  T* p = nullptr;
  explicit Device(std::int64_t n) {
    check(cudaMalloc(&p, std::max<std::int64_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  ~Device() { cudaFree(p); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
};

template <class T>
std::vector<T> download(const T* p, std::int64_t n) {
  std::vector<T> h(static_cast<std::size_t>(n));
  check(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return h;
}

struct Result {
  std::string name, routing, form;
  double rows_ms, tokens_ms, ratio, floor_ms;
  std::int64_t rows;
  bool bitwise;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_shape(const Shape& s, bool skewed, int reps, std::uint64_t seed,
               std::vector<Result>& out) {
  const Problem p{.num_tokens = s.T,
                  .hidden_size = s.H,
                  .intermediate_size = 64,
                  .num_experts = s.E,
                  .topk = s.k,
                  .shared_intermediate_size = 0,
                  .ep_size = 1};
  const Config config;
  Team team = Team::local_virtual(p, config);
  std::mt19937_64 rng(seed);
  const std::vector<std::int64_t> ids = bench::routing(s.T, s.k, s.E, skewed, rng);
  Device<std::int64_t> d_ids(s.T * s.k);
  check(cudaMemcpy(d_ids.p, ids.data(), ids.size() * 8, cudaMemcpyHostToDevice), "ids");
  std::vector<float> w(ids.size());
  std::uniform_real_distribution<float> u(0.01f, 1.0f);
  for (float& v : w) v = u(rng);
  Device<float> d_w(s.T * s.k);
  check(cudaMemcpy(d_w.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "weights");
  std::vector<std::uint16_t> x(static_cast<std::size_t>(s.T * s.H));
  for (auto& v : x)
    v = static_cast<std::uint16_t>(0x3c00u + (rng() & 0x3ffu));  // bf16 in [0.0078, 0.0156)
  Device<std::uint16_t> d_x(s.T * s.H);
  check(cudaMemcpy(d_x.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "x");

  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const TensorView view =
      TensorView::contiguous(d_ids.p, DType::i64, {s.T, s.k}, {DeviceKind::cuda, 0});
  build_schedule(team, std::span<const TensorView>(&view, 1), {.stream = stream});
  check(cudaStreamSynchronize(stream), "build_schedule");

  const Team::Impl& t = team.impl();
  const plan::WorkspacePlan& pl = t.plan;
  const std::int64_t ring = pl.ring_rows;
  const auto* total = reinterpret_cast<const std::int32_t*>(t.local[0] + pl.ring_plan.offset);
  const auto* row_of_slot =
      reinterpret_cast<const std::int32_t*>(t.local[0] + pl.row_of_slot.offset);
  const std::int64_t rows = std::min<std::int64_t>(download(total, 1)[0], ring);

  Device<std::uint16_t> ring_a(ring * s.H), ring_b(ring * s.H);
  Device<float> weights_a(ring), weights_b(ring);
  cuda::PullParams base;
  base.pass = {static_cast<const std::int32_t*>(team.schedule(0).table.data), total, 0, ring};
  base.geo = {s.T, s.k, s.H, 1};
  base.src_own = d_x.p;

  for (bool backward : {false, true}) {
    cuda::PullParams a = base, b = base;
    a.ring = ring_a.p;
    b.ring = ring_b.p;
    if (backward) {
      a.scale_own = b.scale_own = d_w.p;
      a.row_weights = weights_a.p;
      b.row_weights = weights_b.p;
    }
    // Bitwise first, both outputs poisoned.
    check(cudaMemsetAsync(ring_a.p, 0xff, ring * s.H * 2, stream), "poison");
    check(cudaMemsetAsync(ring_b.p, 0x7f, ring * s.H * 2, stream), "poison");
    check(cudaMemsetAsync(weights_a.p, 0xff, ring * 4, stream), "poison");
    check(cudaMemsetAsync(weights_b.p, 0x7f, ring * 4, stream), "poison");
    check(mok::test::launch_pull_rows(a, stream), "launch_pull_rows");
    check(cuda::launch_pull_tokens(b, row_of_slot, stream), "launch_pull_tokens");
    check(cudaStreamSynchronize(stream), "the first pulls");
    bool bitwise = download(ring_a.p, rows * s.H) == download(ring_b.p, rows * s.H);
    if (backward) {
      const auto wa = download(weights_a.p, rows), wb = download(weights_b.p, rows);
      bitwise = bitwise && std::memcmp(wa.data(), wb.data(), rows * 4) == 0;
    }

    cudaEvent_t ev[4];
    for (auto& e : ev) check(cudaEventCreate(&e), "cudaEventCreate");
    std::vector<double> by_rows, by_tokens, ratios;
    constexpr int kWarmup = 10;
    for (int i = 0; i < kWarmup + reps; ++i) {
      float ms[2];
      for (int j = 0; j < 2; ++j) {
        const bool tokens = (i + j) % 2 == 1;  // which goes first alternates
        check(cudaEventRecord(ev[2 * j], stream), "event");
        check(tokens ? cuda::launch_pull_tokens(b, row_of_slot, stream)
                     : mok::test::launch_pull_rows(a, stream),
              "pull");
        check(cudaEventRecord(ev[2 * j + 1], stream), "event");
        check(cudaEventSynchronize(ev[2 * j + 1]), "sync");
        float e = 0;
        check(cudaEventElapsedTime(&e, ev[2 * j], ev[2 * j + 1]), "elapsed");
        ms[tokens ? 1 : 0] = e;
      }
      if (i < kWarmup) continue;
      by_rows.push_back(ms[0]);
      by_tokens.push_back(ms[1]);
      ratios.push_back(ms[0] / ms[1]);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    const double bytes =
        (s.T * s.H * 2.0 + rows * s.H * 2.0) + (backward ? s.T * s.k * 4.0 + rows * 4.0 : 0.0);
    out.push_back({s.name, skewed ? "skewed" : "uniform", backward ? "d_out+weights" : "x",
                   median(by_rows), median(by_tokens), median(ratios), bytes / 4.22e12 * 1e3, rows,
                   bitwise});
  }
  team.check_errors();
  cudaStreamDestroy(stream);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  std::string json, commit = "unknown";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_dispatch: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--reps") {
      reps = std::max(10, std::atoi(argv[++i]));
    } else if (a == "--json") {
      json = argv[++i];
    } else if (a == "--commit") {
      commit = argv[++i];
    } else {
      std::fprintf(stderr, "bench_dispatch: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "bench_dispatch: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("bench_dispatch on %s, %d pairs per form\n", prop.name, reps);
  std::vector<Result> results;
  std::uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    for (bool skewed : {false, true}) run_shape(s, skewed, reps, seed++, results);
  }
  std::printf("%-15s %-8s %-14s %8s %10s %10s %12s %9s  %s\n", "case", "routing", "form", "rows",
              "rows_us", "tokens_us", "rows/tokens", "floor_us", "check");
  bool ok = true;
  for (const Result& r : results) {
    std::printf("%-15s %-8s %-14s %8lld %10.1f %10.1f %12.3f %9.1f  %s\n", r.name.c_str(),
                r.routing.c_str(), r.form.c_str(), static_cast<long long>(r.rows), r.rows_ms * 1e3,
                r.tokens_ms * 1e3, r.ratio, r.floor_ms * 1e3,
                r.bitwise ? "bitwise equal" : "MISMATCH");
    ok = ok && r.bitwise;
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"gpu\": \"" << prop.name << "\", \"commit\": \"" << commit << "\", \"cases\": [";
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      char line[512];
      std::snprintf(
          line, sizeof line,
          "%s\n  {\"case\": \"%s\", \"routing\": \"%s\", \"form\": \"%s\", \"rows\": %lld, "
          "\"row_order_ms\": %.5f, \"token_order_ms\": %.5f, \"ratio\": %.4f, "
          "\"floor_ms\": %.5f, \"bitwise\": %s}",
          i ? "," : "", r.name.c_str(), r.routing.c_str(), r.form.c_str(),
          static_cast<long long>(r.rows), r.rows_ms, r.tokens_ms, r.ratio, r.floor_ms,
          r.bitwise ? "true" : "false");
      f << line;
    }
    f << "\n]}\n";
  }
  return ok ? 0 : 1;
}
