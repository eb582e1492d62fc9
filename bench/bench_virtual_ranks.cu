// bench_virtual_ranks: the forward of one layer split over W virtual ranks on one GPU
// (cuda::UnfusedLayer of a local virtual team), the unfused launches against the forward
// megakernel, in the same run. Each rank holds T / W of the tokens and E / W of the experts, the
// shared expert whole; routing uniform (every slot an expert drawn uniformly) or skewed (half the
// slots to expert 0). Before timing, the two paths' outputs are compared bitwise (every rank's
// whole `out`); timing: CUDA events around each call, warm-up first, the median of --reps calls,
// three input sets rotated.
//
//   bench_virtual_ranks [--case dsv3-ep8slice] [--ranks 8] [--reps 30] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/layer/unfused_layer.hpp"
#include "mok/api.hpp"

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
    {"qwen3-30b-a3b", 16384, 2048, 768, 128, 8, 0},
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
  std::vector<std::int64_t> ids(static_cast<std::size_t>(s.T * s.k));
  std::vector<float> w(ids.size(), 1.0f / static_cast<float>(s.k));
  for (std::int64_t t = 0; t < s.T; ++t) {
    std::vector<std::int64_t> pick;
    while (static_cast<std::int64_t>(pick.size()) < s.k) {
      const std::int64_t e =
          skewed && pick.empty() && rng() % 2 == 0 ? 0 : static_cast<std::int64_t>(rng() % s.E);
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    std::copy(pick.begin(), pick.end(), ids.begin() + t * s.k);
  }
  in.ids = std::make_unique<DeviceBuffer>(ids.size() * 8);
  in.w = std::make_unique<DeviceBuffer>(w.size() * 4);
  check(cudaMemcpy(in.ids->p, ids.data(), ids.size() * 8, cudaMemcpyHostToDevice), "ids");
  check(cudaMemcpy(in.w->p, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "w");
  return in;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name = "dsv3-ep8slice", json;
  int W = 8, reps = 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--case")
      name = argv[i + 1];
    else if (a == "--ranks")
      W = std::atoi(argv[i + 1]);
    else if (a == "--reps")
      reps = std::atoi(argv[i + 1]);
    else if (a == "--json")
      json = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
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
  const mok::Config config{};
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

  std::printf("%s over %d virtual ranks (T %lld, E_l %lld per rank), reps %d\n", s.name, W,
              static_cast<long long>(T), static_cast<long long>(E_l), reps);
  std::string records;
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
    double medians[2];
    for (int fused = 0; fused < 2; ++fused) {
      mok::cuda::UnfusedLayer layer(p, config, 0);
      layer.set_forward_path(fused ? mok::cuda::ForwardPath::fused
                                   : mok::cuda::ForwardPath::unfused);
      std::vector<mok::cuda::RankTensors> rank_sets[3] = {ranks_of(sets[0]), ranks_of(sets[1]),
                                                          ranks_of(sets[2])};
      check(cudaMemset(out.p, 0xff, out.bytes), "poison");
      layer.forward(rank_sets[0], true, stream);
      check(cudaStreamSynchronize(stream), "forward");
      layer.check_errors(stream);
      outs[fused].resize(static_cast<std::size_t>(s.T * s.H));
      check(cudaMemcpy(outs[fused].data(), out.p, out.bytes, cudaMemcpyDeviceToHost), "out");
      for (int i = 0; i < 20; ++i) layer.forward(rank_sets[i % 3], true, stream);
      std::vector<float> ms;
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      for (int i = 0; i < reps; ++i) {
        cudaEventRecord(a, stream);
        layer.forward(rank_sets[i % 3], true, stream);
        cudaEventRecord(b, stream);
        check(cudaEventSynchronize(b), "timing");
        float t = 0;
        cudaEventElapsedTime(&t, a, b);
        ms.push_back(t);
      }
      layer.check_errors(stream);
      std::sort(ms.begin(), ms.end());
      medians[fused] = ms[ms.size() / 2];
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    const bool same = outs[0] == outs[1];
    const char* routing = skewed ? "skewed" : "uniform";
    std::printf("%-14s %-7s W %d  unfused %8.3f ms  fused %8.3f ms  unfused/fused %.3f  %s\n",
                s.name, routing, W, medians[0], medians[1], medians[0] / medians[1],
                same ? "bitwise equal" : "OUTPUTS DIFFER");
    if (!same) return 1;
    char rec[512];
    std::snprintf(rec, sizeof rec,
                  "%s{\"suite\": \"layer-virtual-ranks\", \"case\": \"%s\", \"routing\": \"%s\", "
                  "\"ranks\": %d, \"pass\": \"fwd\", \"unfused_ms\": %.4f, \"fused_ms\": %.4f}",
                  records.empty() ? "" : ",\n  ", s.name, routing, W, medians[0], medians[1]);
    records += rec;
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) return 2;
    std::fprintf(f, "{\"records\": [\n  %s\n]}\n", records.c_str());
    std::fclose(f);
  }
  cudaStreamDestroy(stream);
  return 0;
}
