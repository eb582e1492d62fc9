// bench_schedule: times build_schedule on the GPU (PERF.md's method): CUDA events, warm-up, median
// of many runs, routings rotated among fresh random sets, every set checked against the host twin
// first. W ranks are virtual ranks on one GPU, all built by one launch.
//
//   bench_schedule [--json PATH] [--commit SHA] [--date YYYY-MM-DD] [--runs N] [--seed N]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/schedule_host.hpp"
#include "cuda/comm/team.hpp"
#include "mok/schedule.hpp"

namespace {

using namespace mok;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_schedule: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Keeps the GPU busy while the host enqueues the timed region, so that launch latency on the host
// is not counted as GPU time between the events.
__global__ void hold_gpu(std::uint64_t ns) {
  std::uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

struct Case {
  std::int64_t T, k, E;
  int W;
  const char* routing;  // uniform | skewed
};

// k distinct experts per token, uniformly; "skewed": expert 0 takes every even slot (half the rows,
// as PERF.md's skewed cases), the rest distinct and uniform.
std::vector<std::int64_t> make_routing(const Case& c, std::mt19937_64& rng) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(c.T * c.k));
  std::uniform_int_distribution<std::int64_t> pick(0, c.E - 1);
  const bool skewed = std::strcmp(c.routing, "skewed") == 0;
  for (std::int64_t t = 0; t < c.T; ++t) {
    for (std::int64_t j = 0; j < c.k; ++j) {
      std::int64_t e;
      bool again;
      do {
        e = skewed && ((t * c.k + j) % 2 == 0) ? 0 : pick(rng);
        again = false;
        for (std::int64_t i = 0; i < j && !(skewed && e == 0); ++i) again |= ids[t * c.k + i] == e;
      } while (again);
      ids[t * c.k + j] = e;
    }
  }
  return ids;
}

struct Result {
  std::string name, routing;
  double median_ms, min_ms, p90_ms, floor_ms;
  int runs;
  bool correct;
};

Result run_case(const Case& c, int runs, std::uint64_t seed) {
  constexpr int kSets = 8;
  Problem p{.num_tokens = c.T,
            .hidden_size = 64,
            .intermediate_size = 64,
            .num_experts = c.E,
            .topk = c.k,
            .shared_intermediate_size = 0,
            .ep_size = c.W};
  Config config;
  Team team = Team::local_virtual(p, config);
  std::mt19937_64 rng(seed);
  const std::int64_t n = c.T * c.k;

  std::vector<std::vector<std::vector<std::int64_t>>> host(kSets);  // [set][rank]
  std::vector<std::int64_t*> dev(kSets * c.W);
  for (int s = 0; s < kSets; ++s) {
    for (int r = 0; r < c.W; ++r) {
      host[s].push_back(make_routing(c, rng));
      check(cudaMalloc(&dev[s * c.W + r], n * sizeof(std::int64_t)), "cudaMalloc");
      check(cudaMemcpy(dev[s * c.W + r], host[s][r].data(), n * sizeof(std::int64_t),
                       cudaMemcpyHostToDevice),
            "cudaMemcpy");
    }
  }
  auto views = [&](int s) {
    std::vector<TensorView> v;
    for (int r = 0; r < c.W; ++r) {
      v.push_back(
          TensorView::contiguous(dev[s * c.W + r], DType::i64, {c.T, c.k}, {DeviceKind::cuda, 0}));
    }
    return v;
  };
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  // Correctness first: every set, every rank, bitwise against the host twin.
  bool correct = true;
  const schedule::Shape shape{c.T, c.k, c.E, c.W};
  for (int s = 0; s < kSets && correct; ++s) {
    const auto v = views(s);
    build_schedule(team, v, {.stream = stream});
    check(cudaStreamSynchronize(stream), "build_schedule");
    std::vector<const std::int64_t*> ptrs;
    for (int r = 0; r < c.W; ++r) ptrs.push_back(host[s][r].data());
    for (int r = 0; r < c.W && correct; ++r) {
      const schedule::HostSchedule want = schedule::build_schedule_host(
          shape, config.macrobatch_size, config.minibatch_size, r, ptrs);
      const ScheduleViews got = team.schedule(r);
      std::vector<std::int32_t> table(want.table.size()), seg(want.segment_starts.size());
      check(cudaMemcpy(table.data(), got.table.data, table.size() * 4, cudaMemcpyDeviceToHost),
            "copy");
      check(cudaMemcpy(seg.data(), got.segment_starts.data, seg.size() * 4, cudaMemcpyDeviceToHost),
            "copy");
      correct = table == want.table && seg == want.segment_starts;
    }
  }

  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < runs + 5; ++i) {
    const auto v = views(i % kSets);
    hold_gpu<<<1, 1, 0, stream>>>(200000);  // 200 us
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    build_schedule(team, v, {.stream = stream});
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    if (i >= 5) ms.push_back(t);  // the first 5 are warm-up
  }
  team.check_errors();
  std::sort(ms.begin(), ms.end());
  // Floor: each rank reads every rank's ids once (8 B) and writes its staged ids (4 B) and its
  // whole table (4 B a row), at the measured device copy rate (PERF.md: 4.22 TB/s).
  const double bytes =
      c.W * (n * 8.0 + n * 4.0 + c.W * n * 4.0 + schedule::max_schedule_rows(shape) * 4.0);
  Result r;
  r.name = "T" + std::to_string(c.T) + "-k" + std::to_string(c.k) + "-E" + std::to_string(c.E) +
           "-W" + std::to_string(c.W);
  r.routing = c.routing;
  r.median_ms = ms[ms.size() / 2];
  r.min_ms = ms.front();
  r.p90_ms = ms[ms.size() * 9 / 10];
  r.floor_ms = bytes / 4.22e12 * 1e3;
  r.runs = runs;
  r.correct = correct;
  for (auto* d : dev) cudaFree(d);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, commit = "unknown", date = "unknown";
  int runs = 50;
  std::uint64_t seed =
      static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--json")
      json_path = v;
    else if (a == "--commit")
      commit = v;
    else if (a == "--date")
      date = v;
    else if (a == "--runs")
      runs = std::max(20, std::atoi(v.c_str()));
    else if (a == "--seed")
      seed = std::strtoull(v.c_str(), nullptr, 10);
    else {
      std::fprintf(stderr, "bench_schedule: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "bench_schedule: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("bench_schedule on %s (%d SMs), seed %llu, %d timed runs per case\n", prop.name,
              prop.multiProcessorCount, static_cast<unsigned long long>(seed), runs);

  const Case cases[] = {{4096, 8, 256, 1, "uniform"},
                        {4096, 8, 256, 8, "uniform"},
                        {4096, 8, 256, 1, "skewed"},
                        {4096, 8, 256, 8, "skewed"}};
  std::vector<Result> results;
  bool all_correct = true;
  for (const Case& c : cases) {
    results.push_back(run_case(c, runs, seed++));
    all_correct = all_correct && results.back().correct;
  }
  std::printf("%-20s %-8s %10s %10s %10s %10s  %s\n", "case", "routing", "median_us", "min_us",
              "p90_us", "floor_us", "check");
  for (const Result& r : results) {
    std::printf("%-20s %-8s %10.2f %10.2f %10.2f %10.2f  %s\n", r.name.c_str(), r.routing.c_str(),
                r.median_ms * 1e3, r.min_ms * 1e3, r.p90_ms * 1e3, r.floor_ms * 1e3,
                r.correct ? "bitwise == host twin" : "MISMATCH");
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << "{\"gpu\": \"" << prop.name << "\", \"commit\": \"" << commit << "\", \"date\": \"" << date
      << "\", \"ceilings\": {\"hbm_tbps\": 4.22}, \"cases\": [";
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      char line[512];
      std::snprintf(line, sizeof(line),
                    "%s\n  {\"suite\": \"schedule\", \"case\": \"%s\", \"routing\": \"%s\", "
                    "\"pass\": \"fwd\", \"impl\": \"mok\", \"median_ms\": %.5f, \"min_ms\": %.5f, "
                    "\"p90_ms\": %.5f, \"tflops\": null, \"floor_ms\": %.5f, \"runs\": %d, "
                    "\"checked\": %s}",
                    i ? "," : "", r.name.c_str(), r.routing.c_str(), r.median_ms, r.min_ms,
                    r.p90_ms, r.floor_ms, r.runs, r.correct ? "true" : "false");
      f << line;
    }
    f << "\n]}\n";
  }
  return all_correct ? 0 : 1;
}
