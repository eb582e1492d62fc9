// bench_virtual_ranks: the forward of one layer split over W virtual ranks on one GPU
// (cuda::Layer of a local virtual team), the unfused launches against the forward
// megakernel, in the same run. Each rank holds T / W of the tokens and E / W of the experts, the
// shared expert whole; routing uniform (every slot an expert drawn uniformly) or skewed (half the
// slots to expert 0). Before timing, the two paths' outputs are compared bitwise (every rank's
// whole `out`); timing: CUDA events around each call, warm-up first, three input sets rotated,
// the two paths interleaved call by call (which goes first alternates), so that both see the same
// clocks: the median of each path's --reps calls and the median of the per-pair ratios, which is
// what a drifting power-capped clock disturbs least. The stream drains after each pair, so a
// call's time also holds the host's work before its first kernel (what a call after an idle GPU
// costs); --queued queues every pair before one wait instead (GPU time with the host ahead, as in
// training; on the H200 it gives the same ratios as drained, docs/perf/runs/2026-12-03-fa0a730).
// --ranks 1: one GPU.
//
// --trace: afterwards one fused call records the megakernel's trace of rank 0's pass 0
// (kernels/fused_forward.hpp), summarised per task kind: tiles, Consumer time per tile, the
// Producer's dependency waits, the CTAs' idle time (before the first tile, between tiles, after
// the last), when the last pull landed.
//
//   bench_virtual_ranks [--case dsv3-ep8slice] [--ranks 8] [--reps 30] [--json FILE] [--trace]
//                       [--queued] [--trace-out PREFIX] [--minibatch ROWS] [--stage-rows ROWS]
//                       [--dense] [--solo SECONDS]
//
// --minibatch ROWS: Config::minibatch_size for both paths (default: Config's).
// --stage-rows ROWS: Config::fused_stage_rows, the megakernel's stage (default 0: the larger of
// the minibatch and 16384 rows).
//
// --dense: at the end of the run, the rate a dense bf16 GEMM sustains on this GPU (cuBLAS, 8192^3,
// back to back for kDenseSettleS + kDenseMeasureS seconds, the median call after the first
// kDenseSettleS, as bench/ceilings.py measures bf16_tflops_sustained), and each path's median over
// the time that rate takes for the layer's own FLOPs (Problem::forward_flops over all T): the
// issue-16 bar "forward time over the same-run sustained dense-GEMM time of the same FLOPs". So
// that both sides are timed in the same state, --dense also implies --queued and warms each
// routing up with kDenseSettleS seconds of calls back to back (bench_layer's sustained state).
// Then mok's own GEMM engine on the same product for as long (its dense form; its product checked
// at sampled elements first), printed as a rate and a ratio to cuBLAS's: the two engines' energy
// per FLOP at the same power limit.
//
// --solo SECONDS: after the pairs of each routing, each path alone (unfused first for uniform
// routing, fused first for skewed), calls queued back to back for SECONDS: the median call of the
// second half, and that half's wall-clock interval (Unix
// seconds), to read beside clocks and power sampled meanwhile (nvidia-smi --query-gpu=timestamp,
// clocks.sm,power.draw -lms 20): whether a path's time follows its cycles or its energy.
//
// --trace-out PREFIX (with --trace): also the raw trace of each routing, to
// PREFIX-<case>-<routing>.u64, for bench/trace_summary.py.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_routing.hpp"
#include "core/bf16.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/kernels/fused_trace.hpp"
#include "cuda/layer/layer.hpp"
#include "mok/api.hpp"
#include "support/kernel_hooks.hpp"

namespace {

using mok::DType;
using mok::TensorView;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

struct Shape {
  const char* name;
  std::int64_t T, H, I, E, k, S;
};
constexpr Shape kShapes[] = {
    {"dsv3-ep8slice", 4096, 7168, 2048, 32, 8, 2048},
    {"dsv3-ep1", 4096, 7168, 2048, 256, 8, 2048},
    {"qwen3-30b-a3b", 16384, 2048, 768, 128, 8, 0},
    {"mixtral-8x7b", 8192, 4096, 14336, 8, 2, 0},
};

// Deterministic pseudo-random bf16 in about [-scale, scale].
__global__ void fill_bf16(std::uint16_t* p, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint64_t z = (static_cast<std::uint64_t>(i) + seed) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    z ^= z >> 29;
    const float u = static_cast<float>(z >> 40) / 16777216.0f * 2.0f - 1.0f;
    const float v = u * scale;
    std::uint32_t bits;
    std::memcpy(&bits, &v, 4);
    p[i] = static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

struct DeviceBuffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n) : bytes(n) {
    check(cudaMalloc(&p, n ? n : 16), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

std::unique_ptr<DeviceBuffer> random_bf16(std::int64_t n, std::uint64_t seed, float scale) {
  auto b = std::make_unique<DeviceBuffer>(static_cast<std::size_t>(n) * 2);
  fill_bf16<<<1024, 256>>>(static_cast<std::uint16_t*>(b->p), n, seed, scale);
  check(cudaGetLastError(), "fill");
  // On the legacy stream, which the benchmark's non-blocking stream does not wait for: done here.
  check(cudaDeviceSynchronize(), "fill");
  return b;
}

TensorView view(const DeviceBuffer& b, std::size_t offset_bytes, DType t,
                std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(static_cast<char*>(b.p) + offset_bytes, t, shape,
                                {mok::DeviceKind::cuda, 0});
}

// One input set: every rank's x, ids and weights (global token order: rank r holds tokens
// [r T/W, (r + 1) T/W)).
struct Inputs {
  std::unique_ptr<DeviceBuffer> x, ids, w;
};
Inputs make_inputs(const Shape& s, bool skewed, std::uint64_t seed) {
  Inputs in;
  in.x = random_bf16(s.T * s.H, seed, 1.0f);
  std::mt19937_64 rng(seed);
  const std::vector<std::int64_t> ids = mok::bench::routing(s.T, s.k, s.E, skewed, rng);
  std::vector<float> w(ids.size(), 1.0f / static_cast<float>(s.k));
  in.ids = std::make_unique<DeviceBuffer>(ids.size() * 8);
  in.w = std::make_unique<DeviceBuffer>(w.size() * 4);
  check(cudaMemcpy(in.ids->p, ids.data(), ids.size() * 8, cudaMemcpyHostToDevice), "ids");
  check(cudaMemcpy(in.w->p, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "w");
  return in;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The trace of one launch (kernels/fused_forward.hpp), summarised on stdout and as a JSON object.
std::string summarise_trace(const std::vector<std::uint64_t>& w, const char* label) {
  static const char* const kKinds[] = {"gate_up", "down", "shared_gate_up", "shared_down"};
  const std::int64_t tickets = static_cast<std::int64_t>(w[0]),
                     grid = static_cast<std::int64_t>(w[1]);
  constexpr int kWords = mok::cuda::kTraceTicketWords;
  const std::int64_t room = (static_cast<std::int64_t>(w.size()) - 4 - 4 * grid) / kWords;
  const std::int64_t traced = std::min(tickets, room);
  std::uint64_t t0 = UINT64_MAX, t1 = 0, pulled = 0;
  for (std::int64_t c = 0; c < grid; ++c) {
    t0 = std::min(t0, w[4 + 4 * c]);
    t1 = std::max(t1, w[4 + 4 * c + 2]);
    pulled = std::max(pulled, w[4 + 4 * c + 1]);
  }
  const double span = static_cast<double>(t1 - t0);
  struct Kind {
    long long tiles = 0, waited_tiles = 0;
    double busy = 0, wait = 0, draw = 0, landing = 0, loop = 0, epilogue = 0;
  } kinds[4];
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> per_cta(grid);
  for (std::int64_t t = 0; t < traced; ++t) {
    const std::uint64_t* x = &w[4 + 4 * grid + kWords * t];
    const int cta = static_cast<int>(x[7] & 0xffff), kind = static_cast<int>((x[7] >> 16) & 0xffff);
    if (x[6] == 0 || cta >= grid || kind > 3) continue;  // not run (a give-up) or not traced
    Kind& k = kinds[kind];
    ++k.tiles;
    k.busy += static_cast<double>(x[6] - x[3]);
    k.draw += static_cast<double>(x[1] - x[0]);
    if (x[2] != 0 && x[4] != 0) {  // a tile with rows
      ++k.waited_tiles;
      k.wait += static_cast<double>(x[2] - x[1]);
      k.landing += static_cast<double>(x[4] - x[3]);
      k.loop += static_cast<double>(x[5] - x[4]);
      k.epilogue += static_cast<double>(x[6] - x[5]);
    }
    per_cta[cta].push_back({x[3], x[6]});
  }
  double head = 0, between = 0, tail = 0, busy = 0;
  for (std::int64_t c = 0; c < grid; ++c) {
    auto& v = per_cta[c];
    std::sort(v.begin(), v.end());
    if (v.empty()) {
      tail += span;
      continue;
    }
    head += static_cast<double>(v.front().first - t0);
    tail += static_cast<double>(t1 - v.back().second);
    for (std::size_t i = 0; i < v.size(); ++i) {
      busy += static_cast<double>(v[i].second - v[i].first);
      if (i > 0 && v[i].first > v[i - 1].second) {
        between += static_cast<double>(v[i].first - v[i - 1].second);
      }
    }
  }
  const double cta_time = span * static_cast<double>(grid);
  std::printf(
      "  trace %s: span %.3f ms over %lld CTAs, %lld tickets (%lld traced), last pull "
      "landed at %.3f ms\n",
      label, span / 1e6, static_cast<long long>(grid), static_cast<long long>(tickets),
      static_cast<long long>(traced), static_cast<double>(pulled - t0) / 1e6);
  std::string json =
      std::string("{\"label\": \"") + label + "\", \"span_ms\": " + std::to_string(span / 1e6) +
      ", \"last_pull_ms\": " + std::to_string(static_cast<double>(pulled - t0) / 1e6) +
      ", \"kinds\": {";
  for (int k = 0; k < 4; ++k) {
    const Kind& x = kinds[k];
    if (x.tiles == 0) continue;
    const double n = x.waited_tiles ? 1e3 * static_cast<double>(x.waited_tiles) : 1e300;
    std::printf(
        "    %-15s %6lld tiles  %7.1f us per tile (Consumers: first K block %.2f, K loop %.1f, "
        "epilogue %.2f)  Producer: draw %.2f, wait %.2f us  %.3f ms of the grid\n",
        kKinds[k], x.tiles, x.busy / x.tiles / 1e3, x.landing / n, x.loop / n, x.epilogue / n,
        x.draw / x.tiles / 1e3, x.wait / n, x.busy / static_cast<double>(grid) / 1e6);
    json += std::string(json.back() == '{' ? "" : ", ") + "\"" + kKinds[k] +
            "\": {\"tiles\": " + std::to_string(x.tiles) +
            ", \"us_per_tile\": " + std::to_string(x.busy / x.tiles / 1e3) +
            ", \"wait_us_per_tile\": " +
            std::to_string(x.waited_tiles ? x.wait / x.waited_tiles / 1e3 : 0.0) +
            ", \"first_k_block_us\": " + std::to_string(x.waited_tiles ? x.landing / n : 0.0) +
            ", \"k_loop_us\": " + std::to_string(x.waited_tiles ? x.loop / n : 0.0) +
            ", \"epilogue_us\": " + std::to_string(x.waited_tiles ? x.epilogue / n : 0.0) +
            ", \"draw_us\": " + std::to_string(x.draw / x.tiles / 1e3) + "}";
  }
  std::printf(
      "    CTA time: tiles %.1f%%, before the first %.1f%%, between tiles %.1f%%, after "
      "the last %.1f%%\n",
      100 * busy / cta_time, 100 * head / cta_time, 100 * between / cta_time,
      100 * tail / cta_time);
  json += "}, \"busy_pct\": " + std::to_string(100 * busy / cta_time) +
          ", \"head_pct\": " + std::to_string(100 * head / cta_time) +
          ", \"between_pct\": " + std::to_string(100 * between / cta_time) +
          ", \"tail_pct\": " + std::to_string(100 * tail / cta_time) + "}";
  return json;
}

constexpr double kDenseSettleS = 2.0, kDenseMeasureS = 4.0;

// Wall-clock time (Unix seconds), to line a phase up with clocks and power sampled beside it.
double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Calls timed back to back: call(i) issued on `stream` for `seconds`, each between its own pair
// of events, the host waiting every `batch` calls (so it stays a few calls ahead); `ms` holds the
// times of the calls issued from `measured_from` seconds on, [from, to] the wall-clock interval
// from the first of them to the end.
struct BackToBack {
  std::vector<double> ms;
  double from = 0, to = 0;
};
template <class Call>
BackToBack back_to_back(cudaStream_t stream, double seconds, double measured_from, int batch,
                        const char* what, Call&& call) {
  struct Timed {
    double at;
    cudaEvent_t begin, end;
  };
  std::vector<Timed> calls;
  BackToBack run;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (int i = 0; elapsed() < seconds; ++i) {
    Timed t{elapsed(), nullptr, nullptr};
    if (run.from == 0 && t.at >= measured_from) run.from = unix_seconds();
    check(cudaEventCreate(&t.begin), "event");
    check(cudaEventCreate(&t.end), "event");
    cudaEventRecord(t.begin, stream);
    call(i);
    cudaEventRecord(t.end, stream);
    calls.push_back(t);
    if (calls.size() % batch == 0) check(cudaEventSynchronize(t.end), what);
  }
  check(cudaStreamSynchronize(stream), what);
  run.to = unix_seconds();
  for (const Timed& t : calls) {
    float ms = 0;
    cudaEventElapsedTime(&ms, t.begin, t.end);
    if (t.at >= measured_from) run.ms.push_back(ms);
    cudaEventDestroy(t.begin);
    cudaEventDestroy(t.end);
  }
  return run;
}

// The dense engine's product out = a w^T ([n, n] bf16 each, row-major) against a double-precision
// reference at 1,024 sampled elements (the four corners among them): within bf16's rounding of
// the result (2^-8 of it) plus 2^-14 of the sum of the products' magnitudes for the fp32
// accumulation. A transposed or garbage product misses by tens. Exits on a miss: no rate is
// printed for a product that is wrong.
void check_dense_product(const void* a_dev, const void* w_dev, const void* out_dev, int n) {
  const std::size_t count = static_cast<std::size_t>(n) * n;
  std::vector<mok::bf16_t> a(count), w(count), out(count);
  check(cudaMemcpy(a.data(), a_dev, count * 2, cudaMemcpyDeviceToHost), "dense check: a");
  check(cudaMemcpy(w.data(), w_dev, count * 2, cudaMemcpyDeviceToHost), "dense check: w");
  check(cudaMemcpy(out.data(), out_dev, count * 2, cudaMemcpyDeviceToHost), "dense check: out");
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> pick(0, n - 1);
  int misses = 0;
  for (int s = 0; s < 1024; ++s) {
    const int i = s < 4 ? (s & 1) * (n - 1) : pick(rng);
    const int j = s < 4 ? (s >> 1) * (n - 1) : pick(rng);
    double ref = 0, magnitude = 0;
    for (int k = 0; k < n; ++k) {
      const double p = double{mok::bf16_to_float(a[static_cast<std::size_t>(i) * n + k])} *
                       double{mok::bf16_to_float(w[static_cast<std::size_t>(j) * n + k])};
      ref += p;
      magnitude += std::fabs(p);
    }
    const double got = mok::bf16_to_float(out[static_cast<std::size_t>(i) * n + j]);
    const double tolerance = std::ldexp(std::fabs(ref), -8) + std::ldexp(magnitude, -14);
    if (!(std::fabs(got - ref) <= tolerance) && misses++ < 4) {
      std::fprintf(stderr,
                   "mok dense GEMM wrong at [%d, %d]: %.6g, reference %.6g (tolerance %.3g)\n", i,
                   j, got, ref, tolerance);
    }
  }
  if (misses > 0) {
    std::fprintf(stderr, "mok dense GEMM: %d of 1024 sampled elements outside tolerance\n", misses);
    std::exit(2);
  }
}

// The dense bf16 GEMM rate (TFLOP/s) this GPU sustains: --dense above.
double sustained_dense_tflops(cudaStream_t stream) {
  constexpr int n = 8192;
  auto a = random_bf16(std::int64_t{n} * n, 101, 1.0f),
       b = random_bf16(std::int64_t{n} * n, 102, 1.0f);
  DeviceBuffer c(static_cast<std::size_t>(n) * n * 2);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS ||
      cublasSetStream(handle, stream) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS handle\n");
    std::exit(2);
  }
  const float alpha = 1.0f, beta = 0.0f;
  const BackToBack run =
      back_to_back(stream, kDenseSettleS + kDenseMeasureS, kDenseSettleS, 16, "dense", [&](int) {
        if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a->p, CUDA_R_16BF, n,
                         b->p, CUDA_R_16BF, n, &beta, c.p, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
          std::fprintf(stderr, "cublasGemmEx failed\n");
          std::exit(2);
        }
      });
  std::printf("dense bf16 GEMM timed over wall clock %.3f to %.3f\n", run.from, run.to);
  cublasDestroy(handle);
  if (run.ms.empty()) {
    std::fprintf(stderr, "no dense GEMM timed\n");
    std::exit(2);
  }
  const double tflops = 2.0 * n * n * double{n} / (median(run.ms) * 1e9);
  // mok's own engine on the same product, back to back for as long (its dense form: one group of
  // n rows, out = a w^T, plain bf16 rows, the automatic consumer schedule), so that its energy
  // per FLOP can be read beside cuBLAS's at the same power limit.
  mok::gemm::RowsTimesWeightTArgs g;
  g.segments.num_groups = 1;
  g.segments.capacity_rows = n;
  g.segments.dense_rows = n;
  g.a = static_cast<const __nv_bfloat16*>(a->p);
  g.ld_a = n;
  g.w = static_cast<const __nv_bfloat16*>(b->p);
  g.out = static_cast<__nv_bfloat16*>(c.p);
  g.ld_out = n;
  g.n = n;
  g.k = n;
  g.stream = stream;
  // Checked before it is timed: the output poisoned (bf16 NaN), one call, the sampled elements.
  check(cudaStreamSynchronize(stream), "dense GEMM");
  check(cudaMemsetAsync(c.p, 0xff, c.bytes, stream), "poison");
  mok::gemm::rows_times_weight_t(g);
  check(cudaStreamSynchronize(stream), "mok dense GEMM");
  check_dense_product(a->p, b->p, c.p, n);
  const BackToBack own = back_to_back(stream, kDenseSettleS + kDenseMeasureS, kDenseSettleS, 16,
                                      "mok dense", [&](int) { mok::gemm::rows_times_weight_t(g); });
  if (own.ms.empty()) {
    std::fprintf(stderr, "no mok dense GEMM timed\n");
    std::exit(2);
  }
  const double own_tflops = 2.0 * n * n * double{n} / (median(own.ms) * 1e9);
  std::printf("mok dense bf16 GEMM timed over wall clock %.3f to %.3f\n", own.from, own.to);
  std::printf("mok dense bf16 GEMM sustained %.1f TFLOP/s, %.3f x cuBLAS's %.1f\n", own_tflops,
              own_tflops / tflops, tflops);
  return tflops;
}

// --solo: `layer` alone, calls queued back to back for `seconds` over the three input sets; the
// median call of the second half, printed with that half's wall-clock interval.
double solo_ms(mok::cuda::Layer& layer, const std::vector<mok::cuda::RankTensors> (&sets)[3],
               double seconds, cudaStream_t stream, const char* path) {
  const BackToBack run = back_to_back(stream, seconds, seconds / 2, 8, "solo",
                                      [&](int i) { layer.forward(sets[i % 3], true, stream); });
  layer.check_errors(stream);
  const double m = run.ms.empty() ? 0.0 : median(run.ms);
  std::printf("  solo %-7s %8.3f ms (median of %zu calls, wall clock %.3f to %.3f)\n", path, m,
              run.ms.size(), run.from, run.to);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name = "dsv3-ep8slice", json, trace_out;
  int W = 8, reps = 30;
  std::int64_t minibatch = 0, stage_rows = 0;
  double solo = 0;
  bool trace = false, queued = false, dense = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--trace" || a == "--queued" || a == "--dense") {
      (a == "--trace" ? trace : a == "--queued" ? queued : dense) = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--case")
      name = argv[i + 1];
    else if (a == "--ranks")
      W = std::atoi(argv[i + 1]);
    else if (a == "--reps")
      reps = std::atoi(argv[i + 1]);
    else if (a == "--json")
      json = argv[i + 1];
    else if (a == "--trace-out")
      trace_out = argv[i + 1];
    else if (a == "--minibatch" || a == "--stage-rows" || a == "--solo") {
      char* end = nullptr;
      const double v = std::strtod(argv[i + 1], &end);
      const bool rows = a != "--solo";
      if (*end != '\0' || !(v > 0) || (rows && v != static_cast<double>(std::int64_t(v)))) {
        std::fprintf(stderr, "%s needs a positive %s, not %s\n", a.c_str(),
                     rows ? "integer" : "number", argv[i + 1]);
        return 2;
      }
      if (rows) {
        (a == "--minibatch" ? minibatch : stage_rows) = static_cast<std::int64_t>(v);
      } else {
        solo = v;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (dense) queued = true;
  const Shape* found = nullptr;
  for (const Shape& s : kShapes) {
    if (name == s.name) found = &s;
  }
  if (found == nullptr || W < 1 || found->T % W != 0 || found->E % W != 0 || reps < 1) {
    std::fprintf(stderr, "bad --case %s / --ranks %d / --reps %d\n", name.c_str(), W, reps);
    return 2;
  }
  const Shape s = *found;
  const std::int64_t T = s.T / W, E_l = s.E / W;
  mok::Problem p{T, s.H, s.I, s.E, s.k, s.S, W, 0};
  mok::Config config{};
  if (minibatch > 0) config.minibatch_size = minibatch;
  config.fused_stage_rows = stage_rows;
  config.validate();
  // Weights: every rank's experts in one [E, ...] tensor (rank r's are experts [r E_l, ...)).
  auto gate = random_bf16(s.E * s.I * s.H, 11, 0.02f), up = random_bf16(s.E * s.I * s.H, 12, 0.02f);
  auto down = random_bf16(s.E * s.H * s.I, 13, 0.02f);
  auto sg = random_bf16(s.S * s.H, 14, 0.02f), su = random_bf16(s.S * s.H, 15, 0.02f);
  auto sd = random_bf16(s.H * s.S, 16, 0.02f);
  DeviceBuffer out(static_cast<std::size_t>(s.T * s.H) * 2);
  const mok::ForwardContextLayout layout =
      mok::forward_context_layout(p, config, mok::Backend::cuda, DType::bf16);
  std::vector<std::unique_ptr<DeviceBuffer>> contexts;
  for (int r = 0; r < W; ++r) contexts.push_back(std::make_unique<DeviceBuffer>(layout.bytes));

  std::printf("%s over %d virtual ranks (T %lld, E_l %lld per rank), reps %d, minibatch %lld\n",
              s.name, W, static_cast<long long>(T), static_cast<long long>(E_l), reps,
              static_cast<long long>(config.minibatch_size));
  std::vector<std::string> records;                // each without its closing brace
  std::vector<std::pair<double, double>> path_ms;  // each record's unfused and fused medians
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (bool skewed : {false, true}) {
    Inputs sets[3] = {make_inputs(s, skewed, 1), make_inputs(s, skewed, 2),
                      make_inputs(s, skewed, 3)};
    auto ranks_of = [&](const Inputs& in) {
      std::vector<mok::cuda::RankTensors> ranks(W);
      for (int r = 0; r < W; ++r) {
        mok::cuda::RankTensors& t = ranks[r];
        const std::size_t tok = static_cast<std::size_t>(r * T);
        t.in = {view(*in.x, tok * s.H * 2, DType::bf16, {T, s.H}),
                view(*in.ids, tok * s.k * 8, DType::i64, {T, s.k}),
                view(*in.w, tok * s.k * 4, DType::f32, {T, s.k})};
        const std::size_t ex = static_cast<std::size_t>(r * E_l);
        t.w.gate = view(*gate, ex * s.I * s.H * 2, DType::bf16, {E_l, s.I, s.H});
        t.w.up = view(*up, ex * s.I * s.H * 2, DType::bf16, {E_l, s.I, s.H});
        t.w.down = view(*down, ex * s.H * s.I * 2, DType::bf16, {E_l, s.H, s.I});
        if (s.S > 0) {
          t.w.shared_gate = view(*sg, 0, DType::bf16, {s.S, s.H});
          t.w.shared_up = view(*su, 0, DType::bf16, {s.S, s.H});
          t.w.shared_down = view(*sd, 0, DType::bf16, {s.H, s.S});
        }
        t.out = view(out, tok * s.H * 2, DType::bf16, {T, s.H});
        t.ctx = mok::forward_context_views(layout, contexts[r]->p);
      }
      return ranks;
    };
    std::vector<std::uint16_t> outs[2];
    std::unique_ptr<mok::cuda::Layer> layers[2];
    std::vector<mok::cuda::RankTensors> rank_sets[3] = {ranks_of(sets[0]), ranks_of(sets[1]),
                                                        ranks_of(sets[2])};
    for (int fused = 0; fused < 2; ++fused) {
      layers[fused] = std::make_unique<mok::cuda::Layer>(p, config, 0);
      layers[fused]->set_forward_path(fused ? mok::ForwardPath::fused : mok::ForwardPath::launches);
      check(cudaMemset(out.p, 0xff, out.bytes), "poison");
      layers[fused]->forward(rank_sets[0], true, stream);
      check(cudaStreamSynchronize(stream), "forward");
      layers[fused]->check_errors(stream);
      outs[fused].resize(static_cast<std::size_t>(s.T * s.H));
      check(cudaMemcpy(outs[fused].data(), out.p, out.bytes, cudaMemcpyDeviceToHost), "out");
    }
    // Warm-up: 20 calls; with --dense, calls back to back for kDenseSettleS seconds (the clock
    // then sits where the power limit holds it, as in the dense GEMM's timing and in training).
    const auto warm_start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      const double warm =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - warm_start).count();
      if (dense ? warm >= kDenseSettleS : i >= 20) break;
      layers[i % 2]->forward(rank_sets[i % 3], true, stream);
      if (i % 16 == 15) check(cudaStreamSynchronize(stream), "warm-up");
    }
    // Every call between its own pair of events; the stream drains after each pair, or with
    // --queued only after the last one (the host then stays ahead of the GPU, as in training).
    std::vector<double> ms[2], ratios;
    std::vector<cudaEvent_t> ev(static_cast<std::size_t>(4 * reps));
    for (cudaEvent_t& e : ev) check(cudaEventCreate(&e), "event");
    for (int i = 0; i < reps; ++i) {
      // Both paths on the same input set, in alternating order.
      for (int j = 0; j < 2; ++j) {
        const int fused = (i + j) % 2;
        cudaEventRecord(ev[4 * i + 2 * fused], stream);
        layers[fused]->forward(rank_sets[i % 3], true, stream);
        cudaEventRecord(ev[4 * i + 2 * fused + 1], stream);
      }
      if (!queued) check(cudaStreamSynchronize(stream), "timing");
    }
    check(cudaStreamSynchronize(stream), "timing");
    for (int i = 0; i < reps; ++i) {
      float t[2] = {0, 0};
      for (int fused = 0; fused < 2; ++fused) {
        cudaEventElapsedTime(&t[fused], ev[4 * i + 2 * fused], ev[4 * i + 2 * fused + 1]);
        ms[fused].push_back(t[fused]);
      }
      ratios.push_back(static_cast<double>(t[0]) / t[1]);
    }
    for (cudaEvent_t& e : ev) cudaEventDestroy(e);
    for (auto& l : layers) l->check_errors(stream);
    const double medians[2] = {median(ms[0]), median(ms[1])};
    const double ratio = median(ratios);
    std::sort(ratios.begin(), ratios.end());
    const double q1 = ratios[ratios.size() / 4], q3 = ratios[ratios.size() * 3 / 4];
    const bool same = outs[0] == outs[1];
    const char* routing = skewed ? "skewed" : "uniform";
    std::printf(
        "%-14s %-7s W %d %s unfused %8.3f ms  fused %8.3f ms  unfused/fused per pair: "
        "median %.3f (quartiles %.3f, %.3f)  %s\n",
        s.name, routing, W, queued ? "queued" : "synced", medians[0], medians[1], ratio, q1, q3,
        same ? "bitwise equal" : "OUTPUTS DIFFER");
    if (!same) return 1;
    std::string solo_json;
    if (solo > 0) {
      char rec[256];
      double medians_alone[2] = {0, 0};
      for (int j = 0; j < 2; ++j) {  // unfused first for uniform routing, fused for skewed
        const int fused = skewed ? 1 - j : j;
        medians_alone[fused] =
            solo_ms(*layers[fused], rank_sets, solo, stream, fused ? "fused" : "unfused");
      }
      std::snprintf(rec, sizeof rec,
                    "\"solo_s\": %.1f, \"solo_unfused_ms\": %.4f, "
                    "\"solo_fused_ms\": %.4f, ",
                    solo, medians_alone[0], medians_alone[1]);
      solo_json = rec;
    }
    std::string traced = "null";
    if (trace) {
      const std::int64_t words = mok::cuda::Layer::forward_trace_words(1 << 20);
      DeviceBuffer buffer(static_cast<std::size_t>(words) * 8);
      check(cudaMemset(buffer.p, 0, buffer.bytes), "trace");
      layers[1]->set_forward_hooks({.trace = static_cast<std::uint64_t*>(buffer.p),
                                    .trace_words = words,
                                    .launcher = &mok::test::launch_fused_forward_with_hooks});
      layers[1]->forward(rank_sets[0], true, stream);
      check(cudaStreamSynchronize(stream), "traced forward");
      layers[1]->check_errors(stream);
      layers[1]->set_forward_hooks({});
      std::vector<std::uint64_t> host(static_cast<std::size_t>(words));
      check(cudaMemcpy(host.data(), buffer.p, buffer.bytes, cudaMemcpyDeviceToHost), "trace");
      traced = summarise_trace(host, (std::string(s.name) + " " + routing).c_str());
      if (!trace_out.empty()) {
        // The launch's words as they are (little-endian u64; bench/trace_summary.py reads them),
        // cut after its last ticket.
        const std::string file = trace_out + "-" + s.name + "-" + routing + ".u64";
        const std::size_t used = std::min(
            host.size(),
            static_cast<std::size_t>(4 + 4 * host[1] + mok::cuda::kTraceTicketWords * host[0]));
        FILE* f = std::fopen(file.c_str(), "wb");
        const bool written = f != nullptr && std::fwrite(host.data(), 8, used, f) == used;
        if (f != nullptr && std::fclose(f) != 0) return 2;
        if (!written) {
          std::fprintf(stderr, "cannot write %s\n", file.c_str());
          return 2;
        }
      }
    }
    char rec[768];
    std::snprintf(
        rec, sizeof rec,
        "{\"suite\": \"layer-virtual-ranks\", \"case\": \"%s\", \"routing\": \"%s\", "
        "\"ranks\": %d, \"pass\": \"fwd\", \"sync\": %s, \"reps\": %d, \"unfused_ms\": %.4f, "
        "\"fused_ms\": %.4f, \"pair_ratio_median\": %.4f, \"pair_ratio_q1\": %.4f, "
        "\"pair_ratio_q3\": %.4f, %s\"trace\": ",
        s.name, routing, W, queued ? "false" : "true", reps, medians[0], medians[1], ratio, q1, q3,
        solo_json.c_str());
    records.push_back(rec + traced);
    path_ms.push_back({medians[0], medians[1]});
  }
  if (dense) {
    const double tflops = sustained_dense_tflops(stream);
    // Every rank's tokens: the layer of all T, as one GPU computes it.
    const mok::Problem whole{s.T, s.H, s.I, s.E, s.k, s.S, 1, 0};
    const double flops = whole.forward_flops(s.T * s.k);
    const double dense_ms = flops / (tflops * 1e9);
    std::printf("dense bf16 GEMM sustained %.1f TFLOP/s: the layer's %.3f TFLOP in %.3f ms\n",
                tflops, flops / 1e12, dense_ms);
    for (std::size_t i = 0; i < records.size(); ++i) {
      char rec[256];
      std::snprintf(rec, sizeof rec,
                    ", \"dense_tflops_sustained\": %.2f, \"dense_ms\": %.4f, "
                    "\"unfused_over_dense\": %.4f, \"fused_over_dense\": %.4f",
                    tflops, dense_ms, path_ms[i].first / dense_ms, path_ms[i].second / dense_ms);
      records[i] += rec;
      std::printf("  %s: unfused %.3f, fused %.3f x the dense time\n",
                  i % 2 == 0 ? "uniform" : "skewed", path_ms[i].first / dense_ms,
                  path_ms[i].second / dense_ms);
    }
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) return 2;
    std::string all;
    for (const std::string& r : records) all += (all.empty() ? "" : ",\n  ") + r + "}";
    std::fprintf(f, "{\"records\": [\n  %s\n]}\n", all.c_str());
    std::fclose(f);
  }
  cudaStreamDestroy(stream);
  return 0;
}
