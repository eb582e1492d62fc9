// The e4m3 forms of the grouped GEMM engine (gate_up_forward_fp8, rows_times_weight_t_fp8) against
// an exact model of what they compute: each K block's product of FP8 values (exact in f64),
// times the row's and the weight block's scales, summed over K blocks in f64. The GPU sums a K
// block on the tensor cores, which keep fewer bits than fp32 (DeepSeek-V3 reports about 14), then
// adds it into fp32; the bound below models the first (tensor_core_block: 12 fraction bits kept,
// truncated, in steps of 32 products) and the fp32 rounding of the second, and every kept element
// of every row is checked against it (the worst error as a fraction of its bound is printed). What
// the epilogue derives from the accumulators is checked bitwise (hidden = swiglu_fast(g, u) from
// the stored g and u), as are a second run, and that padding rows and rows past the groups are
// never written.
//
// The inputs are FP8 bytes and power-of-two scales drawn directly (the quantizers have their own
// tests): most bytes with exponents near 1, a tenth anything finite (subnormals and +-448
// included), scales 2^-6 .. 2^6 per row block and weight block, padding rows NaN bytes and NaN
// scales.
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
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/fp8.hpp"
#include "core/numerics.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "gemm_layout.hpp"
#include "gemm_test_waits.hpp"
#include "gpu_buffer.hpp"
#include "mok/error.hpp"
#include "test_seed.hpp"

namespace {

using mok::test::DeviceBuffer;
using mok::test::host_pass;
using mok::test::HostPass;
using mok::test::Layout;
using mok::test::next_seed;

// The e4m3 launchers with the binary's wait bound and report (gemm_test_waits.hpp), so that a
// launch that gives up on a wait fails its test instead of leaving void outputs, and waits last
// MOK_TEST_GEMM_TIMEOUT_S under compute-sanitizer. Every launch here goes through them but those
// of the tests of waits that give up (GemmFp8Waits), which bring their own. NOTES (2026-12-06):
// before, these launches kept the default 20 s and no report, and under racecheck a slow launch
// could give up silently: its Consumers then read stages whose loads were still landing.
void launch_gate_up_forward_fp8(mok::gemm::GateUpForwardFp8Args args) {
  args.waits = mok::test::gemm_test_waits();
  mok::gemm::gate_up_forward_fp8(args);
}
void launch_rows_times_weight_t_fp8(mok::gemm::RowsTimesWeightTFp8Args args) {
  args.waits = mok::test::gemm_test_waits();
  mok::gemm::rows_times_weight_t_fp8(args);
}
void launch_rows_times_weight_fp8(mok::gemm::RowsTimesWeightFp8Args args) {
  args.waits = mok::test::gemm_test_waits();
  mok::gemm::rows_times_weight_fp8(args);
}
void launch_weight_grad_fp8(mok::gemm::WeightGradFp8Args args) {
  args.grad.waits = mok::test::gemm_test_waits();
  mok::gemm::weight_grad_fp8(args);
}

// The value of an e4m3 byte (OCP FP8: bias 7, no infinities, S.1111.111 is NaN).
double e4m3_decode(std::uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (b & 0x80) != 0 ? -v : v;
}
double e4m3_value(std::uint8_t b) {
  static const std::vector<double> table = [] {
    std::vector<double> t(256);
    for (int i = 0; i < 256; ++i) t[i] = e4m3_decode(static_cast<std::uint8_t>(i));
    return t;
  }();
  return table[b];
}

// A finite e4m3 byte: nine in ten with exponent field 5..9 (|v| in [0.25, 8)), else any finite.
std::uint8_t random_e4m3(std::mt19937_64& rng) {
  for (;;) {
    const auto r = rng();
    std::uint8_t b = static_cast<std::uint8_t>(r);
    if ((r >> 8) % 10 != 0) b = static_cast<std::uint8_t>((b & 0x87) | ((5 + (r >> 16) % 5) << 3));
    if ((b & 0x7f) != 0x7f) return b;
  }
}

float random_scale(std::mt19937_64& rng) {
  return std::ldexp(1.0f, static_cast<int>(rng() % 13) - 6);
}

// An e4m3 row operand [capacity, k]: bytes, and scales [k / 128, capacity] (scale_ld capacity);
// rows outside the groups NaN in both.
struct HostRows {
  std::vector<std::uint8_t> q;
  std::vector<float> scale;
  HostRows(const Layout& l, int k, std::mt19937_64& rng)
      : q(std::size_t(l.capacity) * k, 0xff), scale(std::size_t(k / 128) * l.capacity, NAN) {
    for (int g = 0; g < l.groups(); ++g) {
      for (int r = l.starts[g]; r < l.starts[g] + l.counts[g]; ++r) {
        for (int c = 0; c < k; ++c) q[std::size_t(r) * k + c] = random_e4m3(rng);
        for (int kb = 0; kb < k / 128; ++kb)
          scale[std::size_t(kb) * l.capacity + r] = random_scale(rng);
      }
    }
  }
};

// An e4m3 weight [G, n, k] and its block scales [G, n / 128, k / 128].
struct HostWeight {
  std::vector<std::uint8_t> q;
  std::vector<float> scale;
  HostWeight(int groups, int n, int k, std::mt19937_64& rng)
      : q(std::size_t(groups) * n * k), scale(std::size_t(groups) * (n / 128) * (k / 128)) {
    for (auto& b : q) b = random_e4m3(rng);
    for (auto& s : scale) s = random_scale(rng);
  }
};

// One K block of the tensor cores' FP8 sum (n <= 128 products, in wgmma steps of 32, into
// accumulators that start at zero): its exact value and the bound on the hardware's error in it.
// NOTES (2026-12-05, ae507f9 and after): the model. The tensor cores align each group of terms
// (products and the incoming accumulator) to the group's largest exponent and keep a fixed number
// of fraction bits, truncating the terms and the group's result (e8m13 accumulators; DeepSeek-V3
// reports about 14 bits of precision). A simulation of such sums over this file's inputs
// (bench/fp8_accumulation_sim.py) reaches the GPU's observed worst against the old 2^-9 allowance
// (1.0 of it, H100, c190c88) with 12 fraction bits, 0.44-0.65 of it with 13: the model takes 12.
// Each truncation then errs by less than 2^-12 of M, the step's largest magnitude: |accumulator
// in|, any |product|, any partial sum at a multiple of 8 products. With groups of 8 or more
// products, a step of 32 truncates 33 terms and at most 4 results; one more for the computed
// partials' own error: 38 * 2^-12 * M per step. The same simulation puts the worst at 0.11-0.17 of
// it (about 0.5 with only 10 bits kept); the bound follows the largest term, not the sum of
// |products|, so an error the size of one block's value (a wrong scale, a lost block) lies beyond a
// four-block element's bound in 96% of elements (median 7.7 times it), and every element is
// checked.
struct BlockSum {
  double value = 0, bound = 0;
};
template <class Product>
BlockSum tensor_core_block(int n, Product&& product) {
  constexpr int kStep = 32, kGroup = 8;
  constexpr double kTruncations = 38;
  BlockSum b;
  for (int s0 = 0; s0 < n; s0 += kStep) {
    double magnitude = std::fabs(b.value);  // the accumulator coming into the step
    for (int c = s0; c < std::min(n, s0 + kStep); ++c) {
      const double p = product(c);
      b.value += p;
      magnitude = std::max(magnitude, std::fabs(p));
      if ((c - s0) % kGroup == kGroup - 1 || c + 1 == n) {
        magnitude = std::max(magnitude, std::fabs(b.value));
      }
    }
    b.bound += kTruncations * std::ldexp(magnitude, -12);
  }
  return b;
}

// The blocks of one output element, each scaled and promoted into fp32 accumulators in K order:
// the exact sum and the bound on the GPU's error in it (before the output's rounding): the blocks'
// tensor-core bounds, scaled, plus 2^-24 of the running sum's magnitude per promotion, twice over
// (the product by the scale and the add), the running sum bounded by every block's magnitude.
struct Promoted {
  double value = 0, tensor_cores = 0, magnitude = 0;
  int blocks = 0;
  void add(const BlockSum& b, double scale) {
    value += scale * b.value;
    tensor_cores += scale * b.bound;
    magnitude += std::fabs(scale * b.value) + scale * b.bound;
    ++blocks;
  }
  // Another product's blocks promoted into the same accumulators after these.
  void add(const Promoted& o) {
    value += o.value;
    tensor_cores += o.tensor_cores;
    magnitude += o.magnitude;
    blocks += o.blocks;
  }
  double bound() const { return tensor_cores + blocks * std::ldexp(magnitude, -23); }
};

struct Exact {
  double value, bound;
};

// Row r of `a` times row n of group g's weight, block by block.
Promoted promoted_product(const HostRows& a, int cap, const HostWeight& w, int g, int n_rows, int k,
                          int r, int n) {
  Promoted out;
  const int kbs = k / 128;
  for (int kb = 0; kb < kbs; ++kb) {
    const BlockSum b = tensor_core_block(128, [&](int i) {
      const int c = kb * 128 + i;
      return e4m3_value(a.q[std::size_t(r) * k + c]) *
             e4m3_value(w.q[(std::size_t(g) * n_rows + n) * k + c]);
    });
    out.add(b, double(a.scale[std::size_t(kb) * cap + r]) *
                   w.scale[(std::size_t(g) * (n_rows / 128) + n / 128) * kbs + kb]);
  }
  return out;
}
Exact exact_product(const HostRows& a, int cap, const HostWeight& w, int g, int n_rows, int k,
                    int r, int n) {
  const Promoted p = promoted_product(a, cap, w, g, n_rows, k, r, n);
  return {p.value, p.bound()};
}

// |bf16 value - exact| within the bound plus the bf16 rounding of a value that close to exact.
bool within(std::uint16_t got_bits, const Exact& e, double* ratio) {
  const double got = mok::bf16_to_float(got_bits);
  const double allowed = e.bound + std::ldexp(std::fabs(e.value) + e.bound, -8) + 1e-30;
  const double err = std::fabs(got - e.value);
  *ratio = std::max(*ratio, err / allowed);
  return err <= allowed;  // NaN fails
}

__global__ void swiglu_kernel(const __nv_bfloat16* g, const __nv_bfloat16* u, std::size_t n,
                              float limit, bool clamped, __nv_bfloat16* h) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const float gv = __bfloat162float(g[i]), uv = __bfloat162float(u[i]);
    h[i] = __float2bfloat16_rn(clamped ? mok::numerics::swiglu_clamped_fast(gv, uv, limit)
                                       : mok::numerics::swiglu_fast(gv, uv));
  }
}

template <class T>
bool same_bits(const DeviceBuffer<T>& x, const DeviceBuffer<T>& y) {
  const auto a = x.download(), b = y.download();
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

std::vector<char> kept_rows(const Layout& l) {
  std::vector<char> kept(l.capacity, 0);
  for (int g = 0; g < l.groups(); ++g)
    for (int r = l.starts[g]; r < l.starts[g] + l.counts[g]; ++r) kept[r] = 1;
  return kept;
}

int group_of(const Layout& l, int r) {
  int g = 0;
  while (r >= l.starts[g + 1]) ++g;
  return g;
}

// A mainloop variant of the M-grouped e4m3 forms, which must give the plain launch's bits: pairs
// (clusters of two CTAs sharing weight tiles: the launchers' `pairs`), overlap (K block kb + 1's
// wgmma in flight during K block kb's promotion: `overlap`) and wide (128 x 256 tiles: `wide`).
struct Variant {
  bool pairs = false;
  bool overlap = false;
  bool wide = false;
  bool any() const { return pairs || overlap || wide; }
  std::string name() const {
    return wide               ? "wide"
           : pairs && overlap ? "pairs + overlap"
           : pairs            ? "pairs"
           : overlap          ? "overlap"
                              : "plain";
  }
};
constexpr Variant kPairs{true, false}, kOverlap{false, true}, kPairsOverlap{true, true},
    kWide{false, false, true};

// The e4m3 gate/up operands of a layout (random rows and weights) on the device, and launch
// arguments reading them that write hidden only.
struct GateUpFp8Operands {
  HostRows x;
  HostWeight wg, wu;
  DeviceBuffer<std::uint8_t> d_x, d_wg, d_wu;
  DeviceBuffer<float> d_xs, d_wgs, d_wus;
  mok::gemm::GateUpForwardFp8Args args;
  GateUpFp8Operands(const Layout& l, int H, int I, std::mt19937_64& rng)
      : x(l, H, rng), wg(l.groups(), I, H, rng), wu(l.groups(), I, H, rng), d_x(x.q.size()),
        d_wg(wg.q.size()), d_wu(wu.q.size()), d_xs(x.scale.size()), d_wgs(wg.scale.size()),
        d_wus(wu.scale.size()) {
    d_x.upload(x.q), d_wg.upload(wg.q), d_wu.upload(wu.q);
    d_xs.upload(x.scale), d_wgs.upload(wg.scale), d_wus.upload(wu.scale);
    args.segments = l.segments();
    args.x = {d_x.get(), H, d_xs.get(), l.capacity};
    args.w_gate = {d_wg.get(), d_wgs.get()};
    args.w_up = {d_wu.get(), d_wus.get()};
    args.ld_out = I;
    args.hidden_size = H;
    args.intermediate_size = I;
  }
  // The launch for gives_up_then_right.
  auto launch(Variant v) {
    return [this, v](__nv_bfloat16* hidden, mok::gemm::WaitOptions waits) {
      args.pairs = v.pairs, args.overlap = v.overlap, args.wide = v.wide;
      args.hidden = hidden;
      args.waits = waits;
      mok::gemm::gate_up_forward_fp8(args);
    };
  }
};

// `variant`: also that launch (GateUpForwardFp8Args::pairs, ::overlap, ::wide), which must give
// the same bits.
void run_gate_up_fp8(const std::vector<int>& counts, int H, int I,
                     std::optional<float> limit = std::nullopt, Variant variant = {}) {
  Layout l(counts);
  const int G = l.groups();
  std::mt19937_64 rng(next_seed());
  GateUpFp8Operands ops(l, H, I, rng);
  const HostRows& x = ops.x;
  const HostWeight &wg = ops.wg, &wu = ops.wu;
  const std::size_t cells = std::size_t(l.capacity) * I;
  DeviceBuffer<__nv_bfloat16> g(cells), u(cells), h(cells), g2(cells), u2(cells), h2(cells),
      want_h(cells), h_only(cells), g_variant(cells), u_variant(cells), h_variant(cells);
  mok::gemm::GateUpForwardFp8Args& args = ops.args;
  args.swiglu_limit = limit;
  auto run = [&](DeviceBuffer<__nv_bfloat16>& hb, __nv_bfloat16* gb, __nv_bfloat16* ub) {
    hb.poison();
    args.hidden = hb.get();
    args.gate = gb;
    args.up = ub;
    launch_gate_up_forward_fp8(args);
  };
  g.poison(), u.poison(), g2.poison(), u2.poison(), g_variant.poison(), u_variant.poison();
  run(h, g.get(), u.get());
  run(h2, g2.get(), u2.get());
  run(h_only, nullptr, nullptr);
  if (variant.any()) {
    args.pairs = variant.pairs;
    args.overlap = variant.overlap;
    args.wide = variant.wide;
    run(h_variant, g_variant.get(), u_variant.get());
    args.pairs = args.overlap = false;
  }
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  swiglu_kernel<<<1024, 256>>>(g.get(), u.get(), cells, limit.value_or(0.0f), limit.has_value(),
                               want_h.get());
  MOK_CUDA_OK(cudaDeviceSynchronize());

  const auto gh = g.download(), uh = u.download(), hh = h.download(), wh = want_h.download();
  const auto* gb = reinterpret_cast<const std::uint16_t*>(gh.data());
  const auto* ub = reinterpret_cast<const std::uint16_t*>(uh.data());
  const auto* hb = reinterpret_cast<const std::uint16_t*>(hh.data());
  const auto* whb = reinterpret_cast<const std::uint16_t*>(wh.data());
  const std::vector<char> kept = kept_rows(l);
  long long far = 0, stray = 0, hidden_differ = 0, checked = 0;
  double worst = 0;
  for (int r = 0; r < l.capacity; ++r) {
    for (int n = 0; n < I; ++n) {
      const std::size_t i = std::size_t(r) * I + n;
      if (!kept[r]) {
        stray += gb[i] != 0xffff || ub[i] != 0xffff || hb[i] != 0xffff;
        continue;
      }
      const int e = group_of(l, r);
      far += !within(gb[i], exact_product(x, l.capacity, wg, e, I, H, r, n), &worst);
      far += !within(ub[i], exact_product(x, l.capacity, wu, e, I, H, r, n), &worst);
      hidden_differ += hb[i] != whb[i];
      checked += 2;
    }
  }
  std::printf(
      "[ mok ] e4m3 gate/up H=%d I=%d G=%d%s: %lld values, largest error %.3g of its "
      "bound\n",
      H, I, G, limit ? " clamped" : "", checked, worst);
  EXPECT_EQ(far, 0) << "g or u beyond the bound of the exact block-scaled product";
  EXPECT_EQ(hidden_differ, 0) << "hidden differs from swiglu" << (limit ? "_clamped" : "")
                              << "_fast(g, u) of the stored g and u";
  EXPECT_EQ(stray, 0) << "g, u or hidden written in rows past the groups";
  EXPECT_TRUE(same_bits(g, g2) && same_bits(u, u2) && same_bits(h, h2)) << "a second run differs";
  EXPECT_TRUE(same_bits(h, h_only)) << "hidden without pre-activations differs";
  if (variant.any()) {
    EXPECT_TRUE(same_bits(g, g_variant) && same_bits(u, u_variant) && same_bits(h, h_variant))
        << "the " << variant.name() << " launch differs from the plain one";
  }
}

// `variant`: also that launch (RowsTimesWeightTFp8Args::pairs, ::overlap, ::wide), which must
// give the same bits.
void run_rows_fp8(const std::vector<int>& counts, int N, int K, bool scaled, Variant variant = {}) {
  Layout l(counts);
  const int G = l.groups();
  std::mt19937_64 rng(next_seed());
  const HostRows a(l, K, rng);
  const HostWeight w(G, N, K, rng);
  std::vector<float> row_scale(l.capacity);
  for (auto& v : row_scale) v = 0.25f + float(rng() % 1000) / 1000.0f;
  DeviceBuffer<std::uint8_t> d_a(a.q.size()), d_w(w.q.size());
  DeviceBuffer<float> d_as(a.scale.size()), d_ws(w.scale.size()), d_rs(row_scale.size());
  d_a.upload(a.q), d_w.upload(w.q), d_as.upload(a.scale), d_ws.upload(w.scale);
  d_rs.upload(row_scale);
  const std::size_t cells = std::size_t(l.capacity) * N;
  DeviceBuffer<__nv_bfloat16> out(cells), out2(cells), out_variant(cells);
  mok::gemm::RowsTimesWeightTFp8Args args;
  args.segments = l.segments();
  args.a = {d_a.get(), K, d_as.get(), l.capacity};
  args.w = {d_w.get(), d_ws.get()};
  args.ld_out = N;
  args.n = N;
  args.k = K;
  args.row_scale = scaled ? d_rs.get() : nullptr;
  for (auto* o : {&out, &out2, &out_variant}) {
    if (o == &out_variant && !variant.any()) continue;
    o->poison();
    args.out = o->get();
    args.pairs = o == &out_variant && variant.pairs;
    args.overlap = o == &out_variant && variant.overlap;
    args.wide = o == &out_variant && variant.wide;
    launch_rows_times_weight_t_fp8(args);
  }
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const auto oh = out.download();
  const auto* ob = reinterpret_cast<const std::uint16_t*>(oh.data());
  const std::vector<char> kept = kept_rows(l);
  long long far = 0, stray = 0, checked = 0;
  double worst = 0;
  for (int r = 0; r < l.capacity; ++r) {
    for (int n = 0; n < N; ++n) {
      const std::size_t i = std::size_t(r) * N + n;
      if (!kept[r]) {
        stray += ob[i] != 0xffff;
        continue;
      }
      Exact e = exact_product(a, l.capacity, w, group_of(l, r), N, K, r, n);
      if (scaled) {  // bf16(fp32(s * acc)): the product's rounding is one more 2^-24
        const double s = row_scale[r];
        e = {s * e.value, s * e.bound + std::ldexp(std::fabs(s * e.value), -23)};
      }
      far += !within(ob[i], e, &worst);
      ++checked;
    }
  }
  std::printf(
      "[ mok ] e4m3 rows x W^T N=%d K=%d G=%d%s: %lld values, largest error %.3g of its "
      "bound\n",
      N, K, G, scaled ? " row scale" : "", checked, worst);
  EXPECT_EQ(far, 0) << "out beyond the bound of the exact block-scaled product";
  EXPECT_EQ(stray, 0) << "out written in rows past the groups";
  EXPECT_TRUE(same_bits(out, out2)) << "a second run differs";
  if (variant.any()) {
    EXPECT_TRUE(same_bits(out, out_variant))
        << "the " << variant.name() << " launch differs from the plain one";
  }
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, std::size_t n, std::uint64_t seed, float scale) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t x = (seed + i) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    p[i] = __float2bfloat16_rn(((x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale);
  }
}

__global__ void swiglu_backward_kernel(const float* acc, const float* scale, int n_cols,
                                       const __nv_bfloat16* g, const __nv_bfloat16* u,
                                       std::size_t n, __nv_bfloat16* dg, __nv_bfloat16* du) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    // dh = bf16(fp32(scale * acc)), then the backward in fp32, as the epilogue rounds it.
    const float dh = __bfloat162float(__float2bfloat16_rn(__fmul_rn(scale[i / n_cols], acc[i])));
    float a, b;
    mok::numerics::swiglu_backward_fast(__bfloat162float(g[i]), __bfloat162float(u[i]), dh, &a, &b);
    dg[i] = __float2bfloat16_rn(a);
    du[i] = __float2bfloat16_rn(b);
  }
}

// The e4m3 input gradients (rows x the weights' W^T copies): the fp32 output against the exact
// model (one product, or two into the same accumulators), the bf16 output the rounding of the
// fp32 one, and the SwiGLU-backward epilogue (row scale, dot partials, bf16(w h)) bitwise what
// swiglu_backward_fast gives on bf16(scale * the fp32 output); a second run bitwise.
// `variant`: also every output of that launch (RowsTimesWeightFp8Args::pairs, ::overlap), which
// must give the same bits.
void run_input_grad_fp8(const std::vector<int>& counts, int N, int K, bool dual,
                        Variant variant = {}) {
  Layout l(counts);
  const int G = l.groups();
  std::mt19937_64 rng(next_seed());
  const HostRows a(l, K, rng), a2(l, K, rng);
  const HostWeight w(G, N, K, rng), w2(G, N, K, rng);
  DeviceBuffer<std::uint8_t> d_a(a.q.size()), d_a2(a2.q.size()), d_w(w.q.size()), d_w2(w2.q.size());
  DeviceBuffer<float> d_as(a.scale.size()), d_a2s(a2.scale.size()), d_ws(w.scale.size()),
      d_w2s(w2.scale.size());
  d_a.upload(a.q), d_a2.upload(a2.q), d_w.upload(w.q), d_w2.upload(w2.q);
  d_as.upload(a.scale), d_a2s.upload(a2.scale), d_ws.upload(w.scale), d_w2s.upload(w2.scale);
  const std::size_t cells = std::size_t(l.capacity) * N;
  const int chunks = (N + mok::gemm::kDotColumns - 1) / mok::gemm::kDotColumns;
  DeviceBuffer<float> acc(cells), acc2(cells), row_scale(l.capacity),
      dot(std::size_t(l.capacity) * chunks);
  DeviceBuffer<__nv_bfloat16> out(cells), g(cells), u(cells), dg(cells), du(cells), wh(cells),
      want_dg(cells), want_du(cells);
  std::vector<float> hscale(l.capacity);
  for (auto& v : hscale) v = 0.25f + float(rng() % 1000) / 1000.0f;
  row_scale.upload(hscale);
  fill_bf16_kernel<<<256, 256>>>(g.get(), cells, next_seed(), 3.0f);
  fill_bf16_kernel<<<256, 256>>>(u.get(), cells, next_seed(), 2.0f);

  mok::gemm::RowsTimesWeightFp8Args args;
  args.segments = l.segments();
  args.a = {d_a.get(), K, d_as.get(), l.capacity};
  args.w_t = {d_w.get(), d_ws.get()};
  if (dual) {
    args.a2 = {d_a2.get(), K, d_a2s.get(), l.capacity};
    args.w2_t = {d_w2.get(), d_w2s.get()};
  }
  args.ld_out = N;
  args.n = N;
  args.k = K;
  auto fp32_run = [&](DeviceBuffer<float>& o) {
    o.poison();
    mok::gemm::RowsTimesWeightFp8Args f = args;
    f.out = o.get();
    f.out_fp32 = true;
    launch_rows_times_weight_fp8(f);
  };
  fp32_run(acc);
  fp32_run(acc2);
  out.poison();
  {
    mok::gemm::RowsTimesWeightFp8Args f = args;
    f.out = out.get();
    launch_rows_times_weight_fp8(f);
  }
  for (auto* b : {&dg, &du, &wh}) b->poison();
  dot.poison();
  {
    mok::gemm::RowsTimesWeightFp8Args f = args;
    f.swiglu = {g.get(),         u.get(),   dg.get(), du.get(),
                row_scale.get(), dot.get(), wh.get(), std::nullopt};
    launch_rows_times_weight_fp8(f);
  }
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  swiglu_backward_kernel<<<1024, 256>>>(acc.get(), row_scale.get(), N, g.get(), u.get(), cells,
                                        want_dg.get(), want_du.get());
  MOK_CUDA_OK(cudaDeviceSynchronize());

  const std::vector<float> acc_h = acc.download(), dot_h = dot.download();
  const auto out_h = out.download(), dg_h = dg.download(), du_h = du.download(),
             wdg_h = want_dg.download(), wdu_h = want_du.download(), g_h = g.download(),
             u_h = u.download();
  auto bits = [](const std::vector<__nv_bfloat16>& v) {
    return reinterpret_cast<const std::uint16_t*>(v.data());
  };
  const std::vector<char> kept = kept_rows(l);
  long long far = 0, rounding = 0, swiglu_differ = 0, stray = 0, dot_far = 0, checked = 0;
  double worst = 0;
  for (int r = 0; r < l.capacity; ++r) {
    for (int n = 0; n < N; ++n) {
      const std::size_t i = std::size_t(r) * N + n;
      if (!kept[r]) {
        stray += bits(out_h)[i] != 0xffff || bits(dg_h)[i] != 0xffff || !std::isnan(acc_h[i]);
        continue;
      }
      const int e = group_of(l, r);
      Promoted p = promoted_product(a, l.capacity, w, e, N, K, r, n);
      if (dual) p.add(promoted_product(a2, l.capacity, w2, e, N, K, r, n));
      const Exact x{p.value, p.bound()};
      const double err = std::fabs(double(acc_h[i]) - x.value);
      worst = std::max(worst, err / (x.bound + 1e-30));
      far += !(err <= x.bound);
      rounding += bits(out_h)[i] != mok::float_to_bf16(acc_h[i]);
      swiglu_differ += bits(dg_h)[i] != bits(wdg_h)[i] || bits(du_h)[i] != bits(wdu_h)[i];
      ++checked;
    }
    // dot[r][c] = sum over the chunk's columns of acc * h (h = bf16(swiglu_fast(g, u)), which the
    // test does not recompute bit for bit on the host): within fp32 summation of 128 terms of
    // |acc| * |h| <= |acc| * |g u|-ish; checked loosely here, tightly by the bf16 form's test.
    if (kept[r]) {
      for (int c = 0; c < chunks; ++c) dot_far += std::isnan(dot_h[std::size_t(r) * chunks + c]);
    }
  }
  std::printf(
      "[ mok ] e4m3 input gradient N=%d K=%d G=%d%s: %lld values, largest error %.3g of "
      "its bound\n",
      N, K, G, dual ? " two products" : "", checked, worst);
  EXPECT_EQ(far, 0) << "the fp32 output beyond the bound of the exact block-scaled product";
  EXPECT_EQ(rounding, 0) << "the bf16 output is not the rounding of the fp32 output";
  EXPECT_EQ(swiglu_differ, 0) << "dg, du differ from swiglu_backward_fast(g, u, bf16(s acc))";
  EXPECT_EQ(dot_far, 0) << "a kept row's dot partial not written";
  EXPECT_EQ(stray, 0) << "outputs written in rows past the groups";
  EXPECT_TRUE(same_bits(acc, acc2)) << "a second run differs";
  (void)g_h, (void)u_h;
  if (!variant.any()) return;
  // The variant's launch, every output poisoned first.
  DeviceBuffer<float> acc_p(cells), dot_p(std::size_t(l.capacity) * chunks);
  DeviceBuffer<__nv_bfloat16> out_p(cells), dg_p(cells), du_p(cells), wh_p(cells);
  for (auto* b : {&out_p, &dg_p, &du_p, &wh_p}) b->poison();
  acc_p.poison(), dot_p.poison();
  mok::gemm::RowsTimesWeightFp8Args f = args;
  f.pairs = variant.pairs;
  f.overlap = variant.overlap;
  f.wide = variant.wide;
  f.out = acc_p.get();
  f.out_fp32 = true;
  launch_rows_times_weight_fp8(f);
  f.out = out_p.get();
  f.out_fp32 = false;
  launch_rows_times_weight_fp8(f);
  f.out = nullptr;
  f.swiglu = {g.get(),         u.get(),     dg_p.get(), du_p.get(),
              row_scale.get(), dot_p.get(), wh_p.get(), std::nullopt};
  launch_rows_times_weight_fp8(f);
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(acc, acc_p) && same_bits(out, out_p))
      << "the " << variant.name() << " launch's fp32 or bf16 rows differ from the plain ones";
  EXPECT_TRUE(same_bits(dg, dg_p) && same_bits(du, du_p) && same_bits(wh, wh_p) &&
              same_bits(dot, dot_p))
      << "the " << variant.name()
      << " launch's SwiGLU backward (dg, du, w h, dot) differs from "
         "the plain one";
}

TEST(GemmFp8InputGrad, OneProductSmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_input_grad_fp8({0, 1, 130, 77, 0, 300}, 384, 256, false);
}

TEST(GemmFp8InputGrad, TwoProductsAndOneHeavyGroup) {
  MOK_REQUIRE_HOPPER();
  run_input_grad_fp8({0, 1, 130, 77, 0, 300}, 256, 384, true);
  run_input_grad_fp8({1000, 0, 2, 1}, 256, 512, true);
}

// Where the quantizing SwiGLU backward writes in run_quantized_swiglu_fp8: every leading dimension
// different from the others and from n, so that a kernel using the wrong one writes the wrong
// place (and the stray checks see it). rows form: data [capacity, rows_ld], scales [n / 128,
// rows_scale_ld]; token-axis form: data [n, tokens_ld], scales [blocks, tokens_scale_ld].
struct QuantizedLayout {
  int n, rows_ld, rows_scale_ld, tokens_ld, tokens_scale_ld, blocks;
  QuantizedLayout(const Layout& l, int N)
      : n(N),
        rows_ld(N + 24),
        rows_scale_ld(l.capacity + 4),
        tokens_ld((l.capacity + 127) / 128 * 128 + 16),
        tokens_scale_ld(N + 2),
        blocks((l.capacity + 127) / 128) {}
};

// The rows form of bf16 rows x [capacity, ld_x] on the host (quantize_pass_fp8.cu's rows kernel:
// 1x128 blocks along the columns), for the kept rows; the token-axis form (its token-axis kernel:
// 128-row blocks from each group's first row, a column's scale from the group's rows, rows past
// the count stored as 0); both in q's layout.
struct HostQuantized {
  std::vector<std::uint8_t> rows, tokens;
  std::vector<float> row_scales, token_scales;
};
HostQuantized host_quantized(const Layout& l, const std::vector<__nv_bfloat16>& x, int ld_x,
                             const QuantizedLayout& q) {
  namespace fp8 = mok::fp8;
  const std::uint16_t* bits = reinterpret_cast<const std::uint16_t*>(x.data());
  const auto value = [&](int r, int n) {
    return mok::bf16_to_float(bits[std::size_t(r) * ld_x + n]);
  };
  HostQuantized h{std::vector<std::uint8_t>(std::size_t(l.capacity) * q.rows_ld),
                  std::vector<std::uint8_t>(std::size_t(q.n) * q.tokens_ld),
                  std::vector<float>(std::size_t(q.n / 128) * q.rows_scale_ld),
                  std::vector<float>(std::size_t(q.blocks) * q.tokens_scale_ld)};
  const auto quantize = [&](const auto& at, std::uint8_t* out, float* scale) {
    std::uint32_t amax = 0;
    for (int i = 0; i < 128; ++i) amax = fp8::amax_update(amax, at(i));
    const int e = fp8::scale_exponent(amax);
    *scale = fp8::scale_of(e);
    for (int i = 0; i < 128; ++i) out[i] = fp8::quantize_value(at(i), fp8::inverse_scale_of(e));
  };
  for (int g = 0; g < l.groups(); ++g) {
    for (int r = l.starts[g]; r < l.starts[g] + l.counts[g]; ++r) {
      for (int b = 0; b < q.n / 128; ++b) {
        quantize([&](int i) { return value(r, 128 * b + i); },
                 h.rows.data() + std::size_t(r) * q.rows_ld + 128 * b,
                 h.row_scales.data() + std::size_t(b) * q.rows_scale_ld + r);
      }
    }
    for (int r0 = l.starts[g]; r0 < l.starts[g] + l.counts[g]; r0 += 128) {
      const int valid = std::min(128, l.starts[g] + l.counts[g] - r0);
      for (int n = 0; n < q.n; ++n) {
        quantize([&](int i) { return i < valid ? value(r0 + i, n) : 0.0f; },
                 h.tokens.data() + std::size_t(n) * q.tokens_ld + r0,
                 h.token_scales.data() + std::size_t(r0 / 128) * q.tokens_scale_ld + n);
      }
    }
  }
  return h;
}

// Where a quantizing launch writes one tensor (dg or du): both forms, poisoned (NaN bytes and
// scales).
struct QuantizedOut {
  DeviceBuffer<std::uint8_t> rows, tokens;
  DeviceBuffer<float> row_scales, token_scales;
  QuantizedOut(const Layout& l, const QuantizedLayout& q)
      : rows(std::size_t(l.capacity) * q.rows_ld),
        tokens(std::size_t(q.n) * q.tokens_ld),
        row_scales(std::size_t(q.n / 128) * q.rows_scale_ld),
        token_scales(std::size_t(q.blocks) * q.tokens_scale_ld) {
    rows.poison(), tokens.poison(), row_scales.poison(), token_scales.poison();
  }
  mok::gemm::Fp8Out rows_out(const QuantizedLayout& q) {
    return {rows.get(), q.rows_ld, row_scales.get(), q.rows_scale_ld};
  }
  mok::gemm::Fp8Out tokens_out(const QuantizedLayout& q) {
    return {tokens.get(), q.tokens_ld, token_scales.get(), q.tokens_scale_ld};
  }
};

// The FP8 layer's down dgrad with its SwiGLU backward, as the quantizing tests launch it: random
// e4m3 rows and weight (N x K) of `l`, router weights as the row scale (0.25-1.25), the forward's
// g and u (bf16 [capacity, ld_out], ld_out = N + 8: every leading dimension its own); `args` reads
// them with no epilogue set (each test sets its swiglu and quantized outputs).
struct SwigluBackwardFp8Operands {
  HostRows a;
  HostWeight w;
  int ld_out;
  std::size_t cells;
  int chunks;  // dot columns
  DeviceBuffer<std::uint8_t> d_a, d_w;
  DeviceBuffer<float> d_as, d_ws, row_scale;
  DeviceBuffer<__nv_bfloat16> g, u;
  mok::gemm::RowsTimesWeightFp8Args args;
  SwigluBackwardFp8Operands(const Layout& l, int N, int K, std::mt19937_64& rng)
      : a(l, K, rng), w(l.groups(), N, K, rng), ld_out(N + 8),
        cells(std::size_t(l.capacity) * ld_out),
        chunks((N + mok::gemm::kDotColumns - 1) / mok::gemm::kDotColumns), d_a(a.q.size()),
        d_w(w.q.size()), d_as(a.scale.size()), d_ws(w.scale.size()), row_scale(l.capacity),
        g(cells), u(cells) {
    d_a.upload(a.q), d_w.upload(w.q), d_as.upload(a.scale), d_ws.upload(w.scale);
    std::vector<float> hscale(l.capacity);
    for (auto& v : hscale) v = 0.25f + float(rng() % 1000) / 1000.0f;
    row_scale.upload(hscale);
    fill_bf16_kernel<<<256, 256>>>(g.get(), cells, next_seed(), 3.0f);
    fill_bf16_kernel<<<256, 256>>>(u.get(), cells, next_seed(), 2.0f);
    args.segments = l.segments();
    args.a = {d_a.get(), K, d_as.get(), l.capacity};
    args.w_t = {d_w.get(), d_ws.get()};
    args.ld_out = ld_out;
    args.n = N;
    args.k = K;
  }
  std::size_t dots() const { return std::size_t(args.segments.capacity_rows) * chunks; }
};

// The SwiGLU backward that also quantizes dg and du (RowsTimesWeightFp8Args::quantized, the FP8
// layer's down dgrad: row scale and dot): its bf16 outputs, dot and bits the launch without it
// gives; its rows and token-axis forms of dg and du the bits of the standalone quantizers' maths
// (host_quantized over that launch's bf16 dg and du) on every kept row and every token block of
// every group, nothing written elsewhere (the outputs are poisoned first; every leading dimension
// its own); and the same quantized outputs with dg and du not written in bf16 (the layer's call).
void run_quantized_swiglu_fp8(const std::vector<int>& counts, int N, int K,
                              std::optional<float> limit) {
  Layout l(counts);
  const int G = l.groups();
  const QuantizedLayout ql(l, N);
  std::mt19937_64 rng(next_seed());
  SwigluBackwardFp8Operands ops(l, N, K, rng);
  const int ld_out = ops.ld_out;
  const std::size_t cells = ops.cells;
  const auto &g = ops.g, &u = ops.u;
  const auto &row_scale = ops.row_scale;
  const mok::gemm::RowsTimesWeightFp8Args& args = ops.args;
  DeviceBuffer<float> dot(ops.dots()), dot_q(ops.dots());
  DeviceBuffer<__nv_bfloat16> dg(cells), du(cells), dg_q(cells), du_q(cells);
  // out[run][t]: t 0 dg, 1 du; run 0 with dg and du in bf16 too, run 1 quantized only.
  QuantizedOut out[2][2] = {{{l, ql}, {l, ql}}, {{l, ql}, {l, ql}}};
  for (auto* b : {&dg, &du, &dg_q, &du_q}) b->poison();
  dot.poison(), dot_q.poison();
  {
    mok::gemm::RowsTimesWeightFp8Args f = args;
    f.swiglu = {g.get(), u.get(), dg.get(), du.get(), row_scale.get(), dot.get(), nullptr, limit};
    launch_rows_times_weight_fp8(f);
  }
  for (int run = 0; run < 2; ++run) {
    mok::gemm::RowsTimesWeightFp8Args f = args;
    f.swiglu = {g.get(),
                u.get(),
                run == 0 ? dg_q.get() : nullptr,
                run == 0 ? du_q.get() : nullptr,
                row_scale.get(),
                dot_q.get(),
                nullptr,
                limit};
    f.quantized.d_gate_rows = out[run][0].rows_out(ql);
    f.quantized.d_up_rows = out[run][1].rows_out(ql);
    f.quantized.d_gate_tokens = out[run][0].tokens_out(ql);
    f.quantized.d_up_tokens = out[run][1].tokens_out(ql);
    launch_rows_times_weight_fp8(f);
  }
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(dg, dg_q) && same_bits(du, du_q) && same_bits(dot, dot_q))
      << "the quantizing launch's bf16 dg, du or dot differ from the plain epilogue's";
  const HostQuantized want[2] = {host_quantized(l, dg.download(), ld_out, ql),
                                 host_quantized(l, du.download(), ld_out, ql)};
  const std::vector<char> kept = kept_rows(l);
  // Token blocks a group's tiles cover (row r0 a block's first row): the others are never written.
  std::vector<char> covered(ql.blocks, 0);
  for (int g_ = 0; g_ < G; ++g_) {
    for (int r0 = l.starts[g_]; r0 < l.starts[g_] + l.counts[g_]; r0 += 128) covered[r0 / 128] = 1;
  }
  const auto is_covered = [&](int r) { return r / 128 < ql.blocks && covered[r / 128]; };
  const char* names[2] = {"dg", "du"};
  for (int run = 0; run < 2; ++run) {
    for (int t = 0; t < 2; ++t) {
      const auto r_h = out[run][t].rows.download(), k_h = out[run][t].tokens.download();
      const auto rs_h = out[run][t].row_scales.download();
      const auto ks_h = out[run][t].token_scales.download();
      long long rows_differ = 0, tokens_differ = 0, stray = 0;
      for (int r = 0; r < l.capacity; ++r) {
        for (int c = 0; c < ql.rows_ld; ++c) {
          const std::size_t i = std::size_t(r) * ql.rows_ld + c;
          if (kept[r] && c < N) {
            rows_differ += r_h[i] != want[t].rows[i];
          } else {
            stray += r_h[i] != 0xff;
          }
        }
      }
      for (int b = 0; b < N / 128; ++b) {
        for (int r = 0; r < ql.rows_scale_ld; ++r) {
          const std::size_t i = std::size_t(b) * ql.rows_scale_ld + r;
          if (r < l.capacity && kept[r]) {
            rows_differ += std::memcmp(&rs_h[i], &want[t].row_scales[i], 4) != 0;
          } else {
            stray += !std::isnan(rs_h[i]);
          }
        }
      }
      for (int n = 0; n < N; ++n) {
        for (int r = 0; r < ql.tokens_ld; ++r) {
          const std::size_t i = std::size_t(n) * ql.tokens_ld + r;
          if (is_covered(r)) {
            tokens_differ += k_h[i] != want[t].tokens[i];
          } else {
            stray += k_h[i] != 0xff;
          }
        }
      }
      for (int b = 0; b < ql.blocks; ++b) {
        for (int n = 0; n < ql.tokens_scale_ld; ++n) {
          const std::size_t i = std::size_t(b) * ql.tokens_scale_ld + n;
          if (covered[b] && n < N) {
            tokens_differ += std::memcmp(&ks_h[i], &want[t].token_scales[i], 4) != 0;
          } else {
            stray += !std::isnan(ks_h[i]);
          }
        }
      }
      EXPECT_EQ(rows_differ, 0) << names[t] << "'s rows form (bytes or scales) differs from the "
                                << "rows quantizer's" << (run ? " (dg, du not in bf16)" : "");
      EXPECT_EQ(tokens_differ, 0) << names[t] << "'s token-axis form differs from the token-axis "
                                  << "quantizer's" << (run ? " (dg, du not in bf16)" : "");
      EXPECT_EQ(stray, 0) << names[t] << "'s quantized forms written outside the groups' rows";
    }
  }
  std::printf("[ mok ] quantized dg, du N=%d K=%d G=%d%s: %d rows\n", N, K, G,
              limit ? " clamped" : "", l.capacity);
}

// Three tiles of N, odd counts and empty groups, and 300 tiles (300 one-row groups: CTAs that
// quantize a second tile through their staging tile); short enough for the sanitizers' steps ...
TEST(GemmFp8InputGrad, QuantizedDgAndDuSmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_quantized_swiglu_fp8({0, 1, 130, 77, 0, 300}, 384, 256, std::nullopt);
  run_quantized_swiglu_fp8(std::vector<int>(300, 1), 128, 128, std::nullopt);
}

// ... a group of eight token blocks, the clamped SwiGLU backward, 1 and 3 K blocks, 1 and 2 tiles
// of N, and 900 tiles (300 one-row groups): every CTA quantizes several tiles through its staging
// tile, each after the last one's columns are read out.
TEST(GemmFp8InputGrad, QuantizedDgAndDuHeavyGroupAndClamped) {
  MOK_REQUIRE_HOPPER();
  run_quantized_swiglu_fp8({1000, 0, 2, 1}, 128, 128, 0.5f);
  run_quantized_swiglu_fp8({129, 256, 3}, 256, 384, std::nullopt);
  run_quantized_swiglu_fp8(std::vector<int>(300, 1), 384, 128, std::nullopt);
}

// The rows form of `got` (data [capacity, rows_ld], scales [n / 128, rows_scale_ld]) against
// `want`'s on every kept row; *stray counts bytes and scales written elsewhere (poisoned: 0xff
// bytes, NaN scales). Returns the differing bytes and scales.
long long rows_form_differs(const Layout& l, const QuantizedLayout& ql, QuantizedOut& got,
                            const HostQuantized& want, long long* stray) {
  const std::vector<char> kept = kept_rows(l);
  const auto r_h = got.rows.download();
  const auto rs_h = got.row_scales.download();
  long long differ = 0;
  for (int r = 0; r < l.capacity; ++r) {
    for (int c = 0; c < ql.rows_ld; ++c) {
      const std::size_t i = std::size_t(r) * ql.rows_ld + c;
      if (kept[r] && c < ql.n) {
        differ += r_h[i] != want.rows[i];
      } else {
        *stray += r_h[i] != 0xff;
      }
    }
  }
  for (int b = 0; b < ql.n / 128; ++b) {
    for (int r = 0; r < ql.rows_scale_ld; ++r) {
      const std::size_t i = std::size_t(b) * ql.rows_scale_ld + r;
      if (r < l.capacity && kept[r]) {
        differ += std::memcmp(&rs_h[i], &want.row_scales[i], 4) != 0;
      } else {
        *stray += !std::isnan(rs_h[i]);
      }
    }
  }
  return differ;
}

// The rows forms alone (RowsTimesWeightFp8Args::quantized without the token-axis outputs: the FP8
// layer's down dgrad with Fp8Kernels::dgrad_rows_epilogue), beside dg and du in bf16, on the plain or
// the wide tiles, with or without bf16(w h): the bf16 dg, du, dot and bf16(w h) the bits of the
// launch without quantized outputs; the rows forms of dg and du the rows quantizer's maths over
// those bf16 dg and du (host_quantized) on every kept row, nothing written past the groups.
void run_quantized_rows_swiglu_fp8(const std::vector<int>& counts, int N, int K,
                                   std::optional<float> limit, bool wide, bool scaled_hidden) {
  Layout l(counts);
  const QuantizedLayout ql(l, N);
  std::mt19937_64 rng(next_seed());
  SwigluBackwardFp8Operands ops(l, N, K, rng);
  const int ld_out = ops.ld_out;
  const std::size_t cells = ops.cells;
  const auto &g = ops.g, &u = ops.u;
  const auto &row_scale = ops.row_scale;
  DeviceBuffer<float> dot(ops.dots()), dot_q(ops.dots());
  DeviceBuffer<__nv_bfloat16> dg(cells), du(cells), wh(cells), dg_q(cells), du_q(cells),
      wh_q(cells);
  QuantizedOut out[2] = {{l, ql}, {l, ql}};  // dg, du
  for (auto* b : {&dg, &du, &wh, &dg_q, &du_q, &wh_q}) b->poison();
  dot.poison(), dot_q.poison();
  mok::gemm::RowsTimesWeightFp8Args args = ops.args;
  args.wide = wide;
  mok::gemm::RowsTimesWeightFp8Args f = args;
  f.swiglu = {g.get(),
              u.get(),
              dg.get(),
              du.get(),
              row_scale.get(),
              dot.get(),
              scaled_hidden ? wh.get() : nullptr,
              limit};
  launch_rows_times_weight_fp8(f);
  f = args;
  f.swiglu = {g.get(),
              u.get(),
              dg_q.get(),
              du_q.get(),
              row_scale.get(),
              dot_q.get(),
              scaled_hidden ? wh_q.get() : nullptr,
              limit};
  f.quantized.d_gate_rows = out[0].rows_out(ql);
  f.quantized.d_up_rows = out[1].rows_out(ql);
  launch_rows_times_weight_fp8(f);
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const std::string what = std::string(wide ? "wide" : "plain") + (limit ? ", clamped" : "") +
                           (scaled_hidden ? ", bf16(w h)" : "");
  EXPECT_TRUE(same_bits(dg, dg_q) && same_bits(du, du_q) && same_bits(dot, dot_q))
      << what << ": the bf16 dg, du or dot differ from the launch without quantized outputs";
  EXPECT_TRUE(same_bits(wh, wh_q)) << what << ": bf16(w h) differs";
  const HostQuantized want[2] = {host_quantized(l, dg.download(), ld_out, ql),
                                 host_quantized(l, du.download(), ld_out, ql)};
  const char* names[2] = {"dg", "du"};
  for (int t = 0; t < 2; ++t) {
    long long stray = 0;
    EXPECT_EQ(rows_form_differs(l, ql, out[t], want[t], &stray), 0)
        << what << ": " << names[t] << "'s rows form differs from the rows quantizer's";
    EXPECT_EQ(stray, 0) << what << ": " << names[t] << "'s rows form written past the groups";
  }
  std::printf("[ mok ] quantized rows of dg, du N=%d K=%d G=%d, %s: %d rows\n", N, K, l.groups(),
              what.c_str(), l.capacity);
}

// The rows forms alone: plain and wide tiles, plain and clamped, with and without bf16(w h); odd
// counts and empty groups, one and several tiles of N, short enough for the sanitizers' steps
// (*SmallOdd*) ...
TEST(GemmFp8InputGrad, QuantizedRowsSmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  for (const bool wide : {false, true}) {
    run_quantized_rows_swiglu_fp8({0, 1, 130, 77, 0, 300}, 512, 256, std::nullopt, wide, false);
    run_quantized_rows_swiglu_fp8({0, 1, 130, 77}, 256, 128, 0.5f, wide, true);
  }
}

// ... a heavy group, 1 to 3 K blocks, and more tiles than SMs (300 one-row groups).
TEST(GemmFp8InputGrad, QuantizedRowsHeavyGroupAndManyTiles) {
  MOK_REQUIRE_HOPPER();
  for (const bool wide : {false, true}) {
    run_quantized_rows_swiglu_fp8({1000, 0, 2, 1}, 256, 384, std::nullopt, wide, true);
    run_quantized_rows_swiglu_fp8(std::vector<int>(300, 1), 768, 128, 0.5f, wide, false);
  }
  run_quantized_rows_swiglu_fp8({129, 256, 3}, 384, 256, std::nullopt, false, true);
}

// The gate/up epilogue that quantizes hidden (GateUpForwardFp8Args::hidden_quantized, wide tiles):
// g, u and hidden the bits of the launch without it; the rows form of hidden the rows
// quantizer's maths over that hidden on every kept row, nothing written past the groups.
void run_gate_up_quantized_hidden_fp8(const std::vector<int>& counts, int H, int I,
                                      std::optional<float> limit, bool pre_activations) {
  Layout l(counts);
  std::mt19937_64 rng(next_seed());
  GateUpFp8Operands ops(l, H, I, rng);
  const QuantizedLayout ql(l, I);
  const std::size_t cells = std::size_t(l.capacity) * I;
  DeviceBuffer<__nv_bfloat16> g(cells), u(cells), h(cells), g_q(cells), u_q(cells), h_q(cells);
  for (auto* b : {&g, &u, &h, &g_q, &u_q, &h_q}) b->poison();
  QuantizedOut out(l, ql);
  mok::gemm::GateUpForwardFp8Args& args = ops.args;
  args.swiglu_limit = limit;
  args.wide = true;
  args.hidden = h.get();
  args.gate = pre_activations ? g.get() : nullptr;
  args.up = pre_activations ? u.get() : nullptr;
  launch_gate_up_forward_fp8(args);
  args.hidden = h_q.get();
  args.gate = pre_activations ? g_q.get() : nullptr;
  args.up = pre_activations ? u_q.get() : nullptr;
  args.hidden_quantized = out.rows_out(ql);
  launch_gate_up_forward_fp8(args);
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const std::string what = std::string(limit ? "clamped" : "plain") +
                           (pre_activations ? ", with g and u" : ", hidden alone");
  EXPECT_TRUE(same_bits(h, h_q) && same_bits(g, g_q) && same_bits(u, u_q))
      << what << ": g, u or hidden differ from the launch without the quantized hidden";
  const HostQuantized want = host_quantized(l, h.download(), I, ql);
  long long stray = 0;
  EXPECT_EQ(rows_form_differs(l, ql, out, want, &stray), 0)
      << what << ": the quantized hidden differs from the rows quantizer's";
  EXPECT_EQ(stray, 0) << what << ": the quantized hidden written past the groups";
  std::printf("[ mok ] quantized hidden H=%d I=%d G=%d, %s: %d rows\n", H, I, l.groups(),
              what.c_str(), l.capacity);
}

// Odd counts and empty groups, 1 to 3 K blocks, one and several wide tiles, both SwiGLUs, with
// and without g and u; short enough for the sanitizers' steps (*SmallOdd*) ...
TEST(GemmFp8GateUp, QuantizedHiddenSmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_gate_up_quantized_hidden_fp8({0, 1, 130, 77}, 256, 384, std::nullopt, true);
  run_gate_up_quantized_hidden_fp8({0, 1, 130, 77}, 128, 128, 0.5f, false);
}

// ... a heavy group and more tiles than SMs (300 one-row groups, 5 K blocks).
TEST(GemmFp8GateUp, QuantizedHiddenHeavyGroupAndManyTiles) {
  MOK_REQUIRE_HOPPER();
  run_gate_up_quantized_hidden_fp8({1000, 0, 2, 1}, 384, 256, 0.5f, true);
  run_gate_up_quantized_hidden_fp8(std::vector<int>(300, 1), 640, 768, std::nullopt, true);
}

// A token-axis operand [cols, capacity] of `l`'s rows: random finite bytes on each group's rows,
// NaN bytes past a group's end; random power-of-two scales [blocks, cols].
void token_axis_operand(const Layout& l, int cols, std::mt19937_64& rng,
                        std::vector<std::uint8_t>& q, std::vector<float>& sc) {
  q.assign(std::size_t(cols) * l.capacity, 0xff);
  sc.resize(std::size_t((l.capacity + 127) / 128) * cols);
  for (auto& v : sc) v = random_scale(rng);
  for (int g = 0; g < l.groups(); ++g)
    for (int t = l.starts[g]; t < l.starts[g] + l.counts[g]; ++t)
      for (int c = 0; c < cols; ++c) q[std::size_t(c) * l.capacity + t] = random_e4m3(rng);
}

// The K-grouped e4m3 operands of a layout (token_axis_operand: A m columns, B n) on the device,
// and launch arguments reading them (the output left to the caller).
struct WeightGradFp8Operands {
  std::vector<std::uint8_t> qa, qb;
  std::vector<float> sa, sb;
  DeviceBuffer<std::uint8_t> d_qa, d_qb;
  DeviceBuffer<float> d_sa, d_sb;
  mok::gemm::WeightGradFp8Args args;
  WeightGradFp8Operands(const Layout& l, int m, int n, std::mt19937_64& rng)
      : d_qa(std::size_t(m) * l.capacity), d_qb(std::size_t(n) * l.capacity),
        d_sa(std::size_t((l.capacity + 127) / 128) * m),
        d_sb(std::size_t((l.capacity + 127) / 128) * n) {
    token_axis_operand(l, m, rng, qa, sa);
    token_axis_operand(l, n, rng, qb, sb);
    d_qa.upload(qa), d_qb.upload(qb), d_sa.upload(sa), d_sb.upload(sb);
    args.grad.segments = l.segments();
    args.grad.m = m;
    args.grad.n = n;
    args.grad.ld_out = n;
    args.a = {d_qa.get(), l.capacity, d_sa.get(), m};
    args.b = {d_qb.get(), l.capacity, d_sb.get(), n};
  }
};

// The K-grouped e4m3 form (weight gradients) over token-axis copies: dw[g] = a^T b over group g's
// rows, each 128-row token block's product times its row's and column's scales. Tokens past a
// group's end inside its last block hold NaN bytes (the GEMM must zero them); every token block's
// scales are finite. fp32 output against the exact model, bf16 output its rounding, empty groups
// exact zeros, a second run bitwise. `overlap`, `tma_store`: also both outputs of the launch with
// those options (WeightGradFp8Args::overlap, ::tma_store), which must give the same bits.
void run_weight_grad_fp8(const std::vector<int>& counts, int M, int N, bool overlap = false,
                         bool tma_store = false) {
  Layout l(counts);
  const int G = l.groups();
  std::mt19937_64 rng(next_seed());
  WeightGradFp8Operands ops(l, M, N, rng);
  const std::vector<std::uint8_t>&qa = ops.qa, &qb = ops.qb;
  const std::vector<float>&sa = ops.sa, &sb = ops.sb;
  const std::size_t cells = std::size_t(G) * M * N;
  DeviceBuffer<float> out32(cells), out32b(cells);
  DeviceBuffer<__nv_bfloat16> out16(cells);
  mok::gemm::WeightGradFp8Args& args = ops.args;
  for (auto* o : {&out32, &out32b}) {
    o->poison();
    args.grad.out = o->get();
    args.grad.out_fp32 = true;
    launch_weight_grad_fp8(args);
  }
  out16.poison();
  args.grad.out = out16.get();
  args.grad.out_fp32 = false;
  launch_weight_grad_fp8(args);
  const bool variant = overlap || tma_store;
  DeviceBuffer<float> out32_overlap(variant ? cells : 1);
  DeviceBuffer<__nv_bfloat16> out16_overlap(variant ? cells : 1);
  if (variant) {
    args.overlap = overlap;
    args.tma_store = tma_store;
    out32_overlap.poison(), out16_overlap.poison();
    args.grad.out = out32_overlap.get();
    args.grad.out_fp32 = true;
    launch_weight_grad_fp8(args);
    args.grad.out = out16_overlap.get();
    args.grad.out_fp32 = false;
    launch_weight_grad_fp8(args);
  }
  MOK_CUDA_OK(cudaGetLastError());
  MOK_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = out32.download();
  const auto got16 = out16.download();
  const auto* b16 = reinterpret_cast<const std::uint16_t*>(got16.data());
  long long far = 0, rounding = 0, checked = 0;
  double worst = 0;
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < N; ++j) {
        Promoted p;
        for (int t0 = l.starts[g]; t0 < l.starts[g] + l.counts[g]; t0 += 128) {
          const int t1 = std::min(t0 + 128, l.starts[g] + l.counts[g]);
          const BlockSum b = tensor_core_block(t1 - t0, [&](int i_t) {
            const int t = t0 + i_t;
            return e4m3_value(qa[std::size_t(i) * l.capacity + t]) *
                   e4m3_value(qb[std::size_t(j) * l.capacity + t]);
          });
          p.add(b, double(sa[std::size_t(t0 / 128) * M + i]) * sb[std::size_t(t0 / 128) * N + j]);
        }
        const double sum = p.value, bound = p.bound();
        const std::size_t at = (std::size_t(g) * M + i) * N + j;
        const double err = std::fabs(double(got[at]) - sum);
        worst = std::max(worst, err / (bound + 1e-30));
        far += !(err <= bound);  // exact zeros for empty groups: bound 0, err 0
        rounding += b16[at] != mok::float_to_bf16(got[at]);
        ++checked;
      }
    }
  }
  std::printf(
      "[ mok ] e4m3 weight gradient m=%d n=%d G=%d: %lld values, largest error %.3g of its "
      "bound\n",
      M, N, G, checked, worst);
  EXPECT_EQ(far, 0) << "dw beyond the bound of the exact block-scaled product";
  EXPECT_EQ(rounding, 0) << "the bf16 output is not the rounding of the fp32 output";
  EXPECT_TRUE(same_bits(out32, out32b)) << "a second run differs";
  if (variant) {
    EXPECT_TRUE(same_bits(out32, out32_overlap) && same_bits(out16, out16_overlap))
        << "the launch with overlap " << overlap << ", tma_store " << tma_store
        << " differs from the plain one";
  }
}

TEST(GemmFp8WeightGrad, SmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_weight_grad_fp8({0, 1, 130, 77, 0, 300}, 256, 384);
}

TEST(GemmFp8WeightGrad, OneHeavyGroup) {
  MOK_REQUIRE_HOPPER();
  run_weight_grad_fp8({1000, 0, 2, 1}, 128, 256);
}

// The e4m3 weight gradient split over ring passes with a pass plan (each group skipped, whole, or
// opened, carried and closed through an fp32 slot; a pass's operands are the token-axis copies
// from its first row on, their scales from its first block) gives the bits of the unsplit launch,
// for bf16, fp32 and accumulated fp32 outputs, as the bf16 form's PassPlan test checks.
// `overlap`: the passes (plain and continued forms) overlapped, against the plain unsplit launch;
// `tma_store`: the plain passes' bf16 outputs staged and stored by TMA (the carries stay fp32).
void run_weight_grad_pass_plan_fp8(bool overlap, bool tma_store = false) {
  Layout l({300, 0, 700, 129, 64, 1000, 5, 0});
  const int G = l.groups(), M = 128, N = 256;
  std::mt19937_64 rng(next_seed());
  std::vector<std::uint8_t> qa, qb;
  std::vector<float> sa, sb;
  token_axis_operand(l, M, rng, qa, sa);
  token_axis_operand(l, N, rng, qb, sb);
  const DeviceBuffer<std::uint8_t> d_qa(qa), d_qb(qb);
  const DeviceBuffer<float> d_sa(sa), d_sb(sb);
  const std::size_t elems = std::size_t(G) * M * N;
  std::vector<float> base(elems);
  for (std::size_t i = 0; i < elems; ++i) base[i] = 0.25f * float(i % 13) - 1.0f;
  DeviceBuffer<unsigned> tickets(2);
  MOK_CUDA_OK(cudaMemset(tickets.get(), 0, 2 * sizeof(unsigned)));
  enum class Out { bf16, fp32, fp32_accumulate };
  // The operands of the rows from r0 on.
  auto args_at = [&](Out o, void* out, int r0) {
    mok::gemm::WeightGradFp8Args args;
    args.grad.m = M;
    args.grad.n = N;
    args.grad.ld_out = N;
    args.grad.out = out;
    args.grad.out_fp32 = o != Out::bf16;
    args.grad.accumulate = o == Out::fp32_accumulate;
    args.grad.tickets = tickets.get();
    args.a = {d_qa.get() + r0, l.capacity, d_sa.get() + std::size_t(r0 / 128) * M, M};
    args.b = {d_qb.get() + r0, l.capacity, d_sb.get() + std::size_t(r0 / 128) * N, N};
    return args;
  };
  for (Out o : {Out::bf16, Out::fp32, Out::fp32_accumulate}) {
    const std::size_t bytes = elems * (o == Out::bf16 ? 2 : 4);
    DeviceBuffer<unsigned char> whole(bytes), parts(bytes);
    auto reset = [&](DeviceBuffer<unsigned char>& out) {
      if (o == Out::fp32_accumulate) {
        MOK_CUDA_OK(cudaMemcpy(out.get(), base.data(), bytes, cudaMemcpyHostToDevice));
      } else {
        MOK_CUDA_OK(cudaMemset(out.get(), 0xff, bytes));
      }
    };
    reset(whole);
    mok::gemm::WeightGradFp8Args one = args_at(o, whole.get(), 0);
    one.grad.segments = l.segments();
    launch_weight_grad_fp8(one);
    for (int pass_rows : {640, 256, 128}) {
      const int passes = (l.starts.back() + pass_rows - 1) / pass_rows;
      const int slots = std::min(passes - 1, G);
      DeviceBuffer<float> carry(std::size_t(std::max(slots, 1)) * M * N);
      MOK_CUDA_OK(cudaMemset(carry.get(), 0xff, carry.size() * 4));
      reset(parts);
      for (int pass = 0; pass < passes; ++pass) {
        const int r0 = pass * pass_rows;
        const HostPass h = host_pass(l, pass, passes, pass_rows);
        const DeviceBuffer<int> d_starts(h.starts), d_rows(h.rows), d_steps(h.steps);
        mok::gemm::WeightGradFp8Args args = args_at(o, parts.get(), r0);
        args.overlap = overlap;
        args.tma_store = tma_store;
        args.grad.segments = {d_starts.get(), d_rows.get(), G, l.capacity - r0, 0};
        args.grad.passes = {d_steps.get(), carry.get(), slots};
        launch_weight_grad_fp8(args);
        if (pass > 0) {
          args.grad.continue_reduction = true;
          launch_weight_grad_fp8(args);
        }
        MOK_CUDA_OK(cudaDeviceSynchronize());  // d_starts and friends die with this iteration
      }
      MOK_CUDA_OK(cudaGetLastError());
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

TEST(GemmFp8WeightGrad, PassPlanIsBitwiseTheUnsplitReduction) {
  MOK_REQUIRE_HOPPER();
  run_weight_grad_pass_plan_fp8(false);
}

// The staged store (WeightGradFp8Args::tma_store: bf16 tiles through shared memory and TMA): the
// plain launch's bits, alone and with the overlapped loop, on groups of 0 to 8 token blocks (a test
// of its own, short enough for the sanitizers' steps: *SmallOdd*) ...
TEST(GemmFp8WeightGrad, TmaStoreSmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_weight_grad_fp8({0, 1, 130, 77, 0, 300, 513, 1000}, 256, 384, false, true);
  run_weight_grad_fp8({0, 1, 130, 77, 0, 300, 513, 1000}, 256, 384, true, true);
}

// ... on 40 groups (240 tiles: most CTAs store two, the second after the first's store has read
// the staging tile); and over ring passes (the passes' bf16 outputs staged, their fp32 carries
// not).
TEST(GemmFp8WeightGrad, TmaStoreSameBitsAsPlain) {
  MOK_REQUIRE_HOPPER();
  constexpr int kCounts[] = {0, 1, 77, 128, 130, 255, 300, 513};
  std::vector<int> many;
  for (int g = 0; g < 40; ++g) many.push_back(kCounts[g % 8]);
  run_weight_grad_fp8(many, 256, 384, true, true);
  run_weight_grad_pass_plan_fp8(true, true);
}

TEST(GemmFp8GateUp, SmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_gate_up_fp8({0, 1, 130, 77, 0, 300}, 256, 384);
}

TEST(GemmFp8GateUp, OneHeavyGroupAndClamped) {
  MOK_REQUIRE_HOPPER();
  run_gate_up_fp8({1000, 0, 2, 1}, 512, 256);
  run_gate_up_fp8({0, 1, 130, 77, 0, 300}, 256, 384, 0.5f);
}

TEST(GemmFp8RowsWT, SmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_rows_fp8({0, 1, 130, 77, 0, 300}, 384, 256, false);
  run_rows_fp8({0, 1, 130, 77, 0, 300}, 384, 256, true);
}

TEST(GemmFp8RowsWT, OneHeavyGroup) {
  MOK_REQUIRE_HOPPER();
  run_rows_fp8({1000, 0, 2, 1}, 256, 768, true);
}

// The shortest M-grouped e4m3 K loops: one and three K blocks of every form, and the input
// gradient's second product starting at the second block (1 + 1 blocks).
TEST(GemmFp8Forms, OneAndThreeKBlocks) {
  MOK_REQUIRE_HOPPER();
  for (int k : {128, 384}) {
    run_gate_up_fp8({0, 1, 130, 77}, k, 256);
    run_rows_fp8({0, 1, 130, 77}, 256, k, true);
    run_input_grad_fp8({0, 1, 130, 77}, 256, k, false);
  }
  run_input_grad_fp8({130, 0, 77}, 256, 128, true);
}

// The e4m3 forms in pairs (clusters of two CTAs sharing weight tiles): the same bits as the
// unpaired launch, on odd tile counts (an odd last step: rank 1 computes rank 0's tile and does
// not store it), steps across groups and N tiles (no shared weight tile), the clamped SwiGLU, the
// row scale, and the input gradients' epilogues and second product.
TEST(GemmFp8Pairs, SameBitsAsUnpaired) {
  MOK_REQUIRE_HOPPER();
  run_gate_up_fp8({0, 1, 130, 77, 0, 300}, 256, 384, std::nullopt, kPairs);
  run_gate_up_fp8({1000, 0, 2, 1}, 128, 256, 0.5f, kPairs);
  run_rows_fp8({0, 1, 130, 77, 0, 300}, 384, 256, false, kPairs);  // 21 tiles
  run_rows_fp8({1000, 0, 2, 1}, 256, 384, true, kPairs);
  run_rows_fp8({5}, 128, 128, false, kPairs);  // one tile: rank 1 only mirrors it
  run_input_grad_fp8({0, 1, 130, 77, 0, 300}, 384, 256, false, kPairs);
  run_input_grad_fp8({130, 0, 77}, 256, 128, true, kPairs);  // two products
}

// The overlapped promotion (K block kb + 1's wgmma issued before K block kb is promoted): the same
// bits as the plain launch for every count of K blocks its loop treats apart (1; 2 and 3, the
// tails; 4 and 5, through the two-block steady state), the epilogues' early loads (lead) at each
// of those counts, the input gradients' second product, and with pairs.
TEST(GemmFp8Overlap, SameBitsAsPlain) {
  MOK_REQUIRE_HOPPER();
  for (const int k : {128, 256, 384, 512, 640}) {
    run_gate_up_fp8({0, 1, 130, 77}, k, 256, std::nullopt, kOverlap);
    run_rows_fp8({0, 1, 130, 77}, 256, k, true, kOverlap);
    run_input_grad_fp8({0, 1, 130, 77}, 256, k, false, kOverlap);
  }
  run_gate_up_fp8({1000, 0, 2, 1}, 128, 256, 0.5f, kOverlap);
  run_rows_fp8({0, 1, 130, 77, 0, 300}, 384, 256, false, kOverlap);
  run_input_grad_fp8({130, 0, 77}, 256, 128, true, kOverlap);  // two products: 2 K blocks
  run_input_grad_fp8({130, 0, 77}, 256, 384, true, kOverlap);  // 6 K blocks over two products
  run_gate_up_fp8({0, 1, 130, 77, 0, 300}, 384, 384, std::nullopt, kPairsOverlap);
  run_rows_fp8({0, 1, 130, 77, 0, 300}, 384, 640, true, kPairsOverlap);
  run_input_grad_fp8({0, 1, 130, 77, 0, 300}, 384, 256, true, kPairsOverlap);
}

// The weight gradient's (K-grouped) overlapped loop, which the layer runs: the same bits as the
// plain loop over groups of 1 to 8 token blocks (K blocks of 128 tokens), tails included. Short
// enough for the sanitizers' steps.
TEST(GemmFp8Overlap, WeightGradSameBitsAsPlain) {
  MOK_REQUIRE_HOPPER();
  run_weight_grad_fp8({0, 1, 130, 77, 0, 300, 513, 1000}, 256, 384, true);
  run_weight_grad_fp8({128, 256, 384}, 128, 256, true);
}

// Wide tiles (128 x 256, each K block as two 128-column halves into one partial set): the plain
// launch's bits, short enough for the sanitizers' steps (*SmallOdd*) ...
TEST(GemmFp8Wide, SmallOddAndEmptyGroups) {
  MOK_REQUIRE_HOPPER();
  run_gate_up_fp8({0, 1, 130, 77}, 256, 384, std::nullopt, kWide);
  run_input_grad_fp8({0, 1, 130, 77}, 256, 256, true, kWide);
}

// ... and for 1 to 3 K blocks, both SwiGLU epilogues (clamped too), the row scale, the input
// gradients' epilogues and second product, N of one and of several wide tiles; past the ring's 4
// stages (5 to 10 K blocks: the stages' second and third rounds) and with more tiles than SMs
// (300 one-row groups: a CTA's second and third tiles after its first's epilogue).
TEST(GemmFp8Wide, SameBitsAsPlain) {
  MOK_REQUIRE_HOPPER();
  for (const int k : {128, 256, 384}) {
    run_gate_up_fp8({0, 1, 130, 77}, k, 384, std::nullopt, kWide);
    run_rows_fp8({0, 1, 130, 77}, 512, k, true, kWide);
    run_input_grad_fp8({0, 1, 130, 77}, 256, k, false, kWide);
  }
  run_gate_up_fp8({1000, 0, 2, 1}, 128, 256, 0.5f, kWide);
  run_rows_fp8({0, 1, 130, 77, 0, 300}, 256, 256, false, kWide);
  run_input_grad_fp8({130, 0, 77}, 512, 128, true, kWide);  // two products
  run_input_grad_fp8({0, 1, 130, 77, 0, 300}, 256, 256, true, kWide);
  run_gate_up_fp8({0, 1, 130, 77}, 640, 384, std::nullopt, kWide);
  run_rows_fp8(std::vector<int>(300, 1), 256, 1280, true, kWide);
  run_input_grad_fp8(std::vector<int>(300, 1), 256, 640, true, kWide);  // 10 K blocks, 2 products
}

// The overlapped weight gradient over ring passes (its plain and continued forms) against the plain
// unsplit launch. A test of its own: about a hundred launches, too many for the sanitizers' steps.
TEST(GemmFp8Overlap, WeightGradPassPlanIsBitwiseThePlainUnsplitReduction) {
  MOK_REQUIRE_HOPPER();
  run_weight_grad_pass_plan_fp8(true);
}

// Shapes the 128 x 128 blocks cannot cover, missing scales, and what a wide launch cannot do
// (pairs or the overlap with it; an n that leaves a half tile, each half reading its own weight
// block), on each M-grouped launcher: mok::Error naming the argument.
TEST(GemmFp8Arguments, SizesAndScalesAreChecked) {
  MOK_REQUIRE_HOPPER();
  Layout l({100});
  DeviceBuffer<std::uint8_t> a(std::size_t(l.capacity) * 256), w(256 * 256);
  DeviceBuffer<float> s(std::size_t(l.capacity) * 2), ws(4);
  DeviceBuffer<__nv_bfloat16> out(std::size_t(l.capacity) * 256);
  mok::gemm::RowsTimesWeightTFp8Args args;
  args.segments = l.segments();
  args.a = {a.get(), 256, s.get(), l.capacity};
  args.w = {w.get(), ws.get()};
  args.out = out.get();
  args.ld_out = 256;
  args.n = 256;
  args.k = 256;
  auto expect_error = [&](const char* argument) {
    try {
      launch_rows_times_weight_t_fp8(args);
      ADD_FAILURE() << "accepted without the error naming " << argument;
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  args.k = 192;
  expect_error("k");
  args.k = 256;
  args.n = 64;
  expect_error("n");
  args.n = 256;
  args.a.scale = nullptr;
  expect_error("a.scale");
  args.a.scale = s.get() + 1;  // 4 bytes past 16-byte alignment: a tile's scales are one bulk copy
  expect_error("a.scale");
  args.a.scale = s.get();
  args.a.scale_ld = l.capacity - 1;
  expect_error("a.scale_ld");
  args.a.scale_ld = l.capacity + 2;  // >= capacity, not a multiple of 4
  expect_error("a.scale_ld");
  args.a.scale_ld = l.capacity;
  args.w.scale = nullptr;
  expect_error("w.scale");
  args.w.scale = ws.get();
  args.wide = true;
  args.pairs = true;
  expect_error("wide");
  args.pairs = false;
  args.overlap = true;
  expect_error("wide");
  args.overlap = false;
  args.n = 128;  // one 128-column block: half a wide tile
  expect_error("n");
  args.n = 256;
  args.wide = false;
  launch_rows_times_weight_t_fp8(args);  // and the good call still runs
  MOK_CUDA_OK(cudaDeviceSynchronize());
  // The other two M-grouped launchers refuse the same (with_mainloop, check_wide_n).
  mok::gemm::GateUpForwardFp8Args up;
  up.segments = l.segments();
  up.x = {a.get(), 256, s.get(), l.capacity};
  up.w_gate = up.w_up = {w.get(), ws.get()};
  up.hidden = out.get();
  up.ld_out = 256;
  up.hidden_size = 256;
  up.intermediate_size = 256;
  up.wide = up.overlap = true;
  try {
    launch_gate_up_forward_fp8(up);
    ADD_FAILURE() << "gate/up: wide with overlap accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "wide") << e.what();
  }
  mok::gemm::RowsTimesWeightFp8Args dgrad;
  dgrad.segments = l.segments();
  dgrad.a = {a.get(), 256, s.get(), l.capacity};
  dgrad.w_t = {w.get(), ws.get()};
  dgrad.out = out.get();
  dgrad.ld_out = 256;
  dgrad.n = 128;  // half a wide tile
  dgrad.k = 256;
  dgrad.wide = true;
  try {
    launch_rows_times_weight_fp8(dgrad);
    ADD_FAILURE() << "input gradient: wide with n 128 accepted";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.argument(), "n") << e.what();
  }
}

// RowsTimesWeightFp8Args::quantized: what it needs (the SwiGLU backward with the row scale and dot,
// the plain mainloop, all four outputs) and its outputs' layout, mok::Error naming the argument;
// then the good call runs.
TEST(GemmFp8Arguments, QuantizedOutputsAreChecked) {
  MOK_REQUIRE_HOPPER();
  Layout l({100, 30});
  const int N = 128, K = 128, ld = 384;  // capacity 320: 256 rows of groups and 64 past them
  DeviceBuffer<std::uint8_t> a(std::size_t(l.capacity) * K), w(2 * N * K),
      rows(2 * std::size_t(l.capacity) * N), tokens(2 * std::size_t(N) * ld);
  DeviceBuffer<float> s(std::size_t(l.capacity)), ws(2), rs(2 * std::size_t(l.capacity)),
      ts(2 * std::size_t(ld / 128) * N), row_scale(l.capacity), dot(l.capacity);
  DeviceBuffer<__nv_bfloat16> g(std::size_t(l.capacity) * N), u(std::size_t(l.capacity) * N);
  mok::gemm::RowsTimesWeightFp8Args args;
  args.segments = l.segments();
  args.a = {a.get(), K, s.get(), l.capacity};
  args.w_t = {w.get(), ws.get()};
  args.ld_out = N;
  args.n = N;
  args.k = K;
  args.swiglu = {g.get(), u.get(), nullptr, nullptr, row_scale.get(), dot.get(), nullptr, {}};
  mok::gemm::SwigluBackwardFp8Out& q = args.quantized;
  q.d_gate_rows = {rows.get(), N, rs.get(), l.capacity};
  q.d_up_rows = {rows.get() + std::size_t(l.capacity) * N, N, rs.get() + l.capacity, l.capacity};
  q.d_gate_tokens = {tokens.get(), ld, ts.get(), N};
  q.d_up_tokens = {tokens.get() + std::size_t(N) * ld, ld, ts.get() + (ld / 128) * N, N};
  auto expect_error = [&](const char* argument) {
    try {
      launch_rows_times_weight_fp8(args);
      ADD_FAILURE() << "accepted without the error naming " << argument;
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  q.d_up_tokens.data = nullptr;
  expect_error("quantized");
  q.d_up_tokens.data = tokens.get() + std::size_t(N) * ld;
  args.swiglu.dot = nullptr;
  expect_error("swiglu.row_scale/dot");
  args.swiglu.dot = dot.get();
  args.swiglu.d_gate = g.get();  // d_up null
  expect_error("swiglu.d_gate/d_up");
  args.swiglu.d_gate = nullptr;
  args.overlap = true;
  expect_error("quantized");
  args.overlap = false;
  q.d_up_rows.ld = N + 8;
  expect_error("quantized.d_up_rows");
  q.d_up_rows.ld = N;
  q.d_gate_tokens.ld = q.d_up_tokens.ld = l.capacity + 8;  // not a multiple of 16
  expect_error("quantized.d_gate_tokens.ld");
  q.d_gate_tokens.ld = q.d_up_tokens.ld = l.capacity;  // a tile stores 128 rows: 384 needed
  expect_error("quantized.d_gate_tokens.ld");
  q.d_gate_tokens.ld = q.d_up_tokens.ld = ld;
  q.d_gate_tokens.data = tokens.get() + 8;
  expect_error("quantized.d_gate_tokens.data");
  q.d_gate_tokens.data = tokens.get();
  launch_rows_times_weight_fp8(args);  // and the good call still runs
  MOK_CUDA_OK(cudaDeviceSynchronize());

  // The rows forms alone: dg and du in bf16 too, no pairs or overlap; wide tiles and bf16(w h)
  // allowed.
  q.d_gate_tokens = q.d_up_tokens = {};
  expect_error("swiglu.d_gate/d_up");  // dg and du not in bf16
  DeviceBuffer<__nv_bfloat16> dg(std::size_t(l.capacity) * N), du(std::size_t(l.capacity) * N);
  args.swiglu.d_gate = dg.get();
  args.swiglu.d_up = du.get();
  args.pairs = true;
  expect_error("quantized");
  args.pairs = false;
  q.d_gate_rows.scale_ld = q.d_up_rows.scale_ld = l.capacity - 1;
  expect_error("quantized.d_gate_rows.scale_ld");
  q.d_gate_rows.scale_ld = q.d_up_rows.scale_ld = l.capacity;
  q.d_up_rows.data = nullptr;
  expect_error("quantized");
  q.d_up_rows.data = rows.get() + std::size_t(l.capacity) * N;
  args.swiglu.scaled_hidden = g.get() + 1;  // not 16-byte aligned
  expect_error("swiglu.scaled_hidden");
  args.swiglu.scaled_hidden = nullptr;
  launch_rows_times_weight_fp8(args);
  MOK_CUDA_OK(cudaDeviceSynchronize());
}

// GateUpForwardFp8Args::hidden_quantized: wide tiles alone, its layout and alignment; mok::Error
// names the argument, and the good call still runs.
TEST(GemmFp8Arguments, QuantizedHiddenIsChecked) {
  MOK_REQUIRE_HOPPER();
  Layout l({100, 30});
  std::mt19937_64 rng(next_seed());
  const int H = 128, I = 256;
  GateUpFp8Operands ops(l, H, I, rng);
  DeviceBuffer<__nv_bfloat16> h(std::size_t(l.capacity) * I);
  DeviceBuffer<std::uint8_t> q(std::size_t(l.capacity) * I + 8);
  DeviceBuffer<float> qs(std::size_t(I / 128) * l.capacity);
  mok::gemm::GateUpForwardFp8Args& args = ops.args;
  args.hidden = h.get();
  args.hidden_quantized = {q.get(), I, qs.get(), l.capacity};
  auto expect_error = [&](const char* argument) {
    try {
      launch_gate_up_forward_fp8(args);
      ADD_FAILURE() << "accepted without the error naming " << argument;
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  expect_error("hidden_quantized");  // without wide
  args.wide = true;
  args.hidden_quantized.ld = I - 8;
  expect_error("hidden_quantized.ld");
  args.hidden_quantized.ld = I;
  args.hidden_quantized.scale_ld = l.capacity - 1;
  expect_error("hidden_quantized.scale_ld");
  args.hidden_quantized.scale_ld = l.capacity;
  args.hidden_quantized.data = q.get() + 4;
  expect_error("hidden_quantized.data");
  args.hidden_quantized.data = q.get();
  args.hidden_quantized.scale = nullptr;
  expect_error("hidden_quantized.scale");
  args.hidden_quantized.scale = qs.get();
  launch_gate_up_forward_fp8(args);
  MOK_CUDA_OK(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------------------------
// Waits that give up in the e4m3 forms. With a 1 ns timeout a wait gives up at its first poll
// that finds its barrier incomplete, so CTAs end through the abort paths: the Producer stops and
// drains, the Consumers run their remaining K blocks without waiting, still releasing each stage
// (release_stage_fp8), and every barrier among consumer threads (the epilogues' named barriers)
// must still see all of them. Each launch must end (no hang, no trap), its report name a barrier
// when a wait gave up, and the next launch with the default timeout must give the bits of a
// launch made before it.

// Runs `launch(waits)` with a 1 ns timeout to its end; returns whether a wait gave up (a failed
// CUDA call fails the test and counts as none).
template <class Launch>
bool impatient_launch_ends(const std::string& what, Launch&& launch) {
  mok::gemm::TimeoutReport report;
  if (cudaDeviceSynchronize() != cudaSuccess) {
    ADD_FAILURE() << what << ": the device failed before the launch";
    return false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  launch(mok::gemm::WaitOptions{1, &report});
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t ended = cudaDeviceSynchronize();  // returns (no hang) and succeeds (no trap)
  EXPECT_EQ(launched, cudaSuccess) << what << ": " << cudaGetErrorString(launched);
  EXPECT_EQ(ended, cudaSuccess) << what << ": " << cudaGetErrorString(ended);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string r = report.take();
  std::printf("[ mok ] %s with a 1 ns timeout ended after %.3f s: %s\n", what.c_str(), seconds,
              r.empty() ? "no wait gave up" : r.c_str());
  EXPECT_LT(seconds, 10.0) << what << ": took far longer than its timeout";
  if (!r.empty()) {
    EXPECT_NE(r.find("barrier "), std::string::npos) << what << ": " << r;
    // The barrier's offset in its CTA's shared memory (within an SM's 228 KiB on Hopper),
    // whatever the CTA's rank in a cluster.
    const std::size_t at = r.find("shared offset ");
    EXPECT_NE(at, std::string::npos) << what << ": " << r;
    if (at != std::string::npos) {
      const unsigned long offset = std::strtoul(r.c_str() + at + 14, nullptr, 10);
      EXPECT_LT(offset, 228ul * 1024) << what << ": not an offset in the CTA's shared memory: " << r;
    }
  }
  return !r.empty();
}

// `launch(out, waits)` first with the default timeout into `want`, then with 1 ns a wait
// (impatient_launch_ends), then again with the default timeout into `got`, which must hold
// `want`'s bits, with no report. Returns whether the impatient launch gave up.
template <class T, class Launch>
bool gives_up_then_right(const std::string& what, DeviceBuffer<T>& want, DeviceBuffer<T>& got,
                         Launch&& launch) {
  want.poison();
  launch(want.get(), mok::gemm::WaitOptions{});
  const bool gave_up =
      impatient_launch_ends(what, [&](mok::gemm::WaitOptions w) { launch(got.get(), w); });
  mok::gemm::TimeoutReport report;
  got.poison();
  launch(got.get(), mok::gemm::WaitOptions{.report = &report});
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  EXPECT_TRUE(same_bits(want, got)) << what << ": the launch after one that gave up differs";
  EXPECT_EQ(report.take(), "") << what << ": a launch that did not give up left a report";
  return gave_up;
}

// The gate/up form (plain, overlapped, wide; pairs below) and the weight gradient (plain,
// overlapped, overlapped with the staged store): 3 K blocks a tile, more than one tile a CTA for
// none of them.
TEST(GemmFp8Waits, GivingUpEndsAndTheNextLaunchIsRight) {
  MOK_REQUIRE_HOPPER();
  Layout l({0, 1, 130, 77, 0, 300});
  const int G = l.groups(), H = 384, I = 256;
  std::mt19937_64 rng(next_seed());
  GateUpFp8Operands gate_up(l, H, I, rng);
  DeviceBuffer<__nv_bfloat16> want(std::size_t(l.capacity) * I), got(std::size_t(l.capacity) * I);
  int gave_up = 0;
  for (const Variant v : {Variant{}, kOverlap, kWide}) {
    gave_up += gives_up_then_right("e4m3 gate/up " + v.name(), want, got, gate_up.launch(v));
  }

  const int M = 256, N = 384;
  WeightGradFp8Operands dw(l, M, N, rng);
  mok::gemm::WeightGradFp8Args& w = dw.args;
  DeviceBuffer<__nv_bfloat16> want_dw(std::size_t(G) * M * N), got_dw(std::size_t(G) * M * N);
  for (const auto [overlap, tma_store] : {std::pair{false, false}, {true, false}, {true, true}}) {
    w.overlap = overlap, w.tma_store = tma_store;
    gave_up += gives_up_then_right(
        std::string("e4m3 weight gradient") + (overlap ? ", overlap" : "") +
            (tma_store ? ", staged store" : ""),
        want_dw, got_dw, [&](__nv_bfloat16* out, mok::gemm::WaitOptions waits) {
          w.grad.out = out;
          w.grad.waits = waits;
          mok::gemm::weight_grad_fp8(w);
        });
  }
  EXPECT_GT(gave_up, 0) << "no launch gave up: no abort path was run";
}

// The same for pairs (clusters of two CTAs, each Producer writing both CTAs' stages, each stage
// released in both), three times: a test of its own, so that a hang there is named apart. NOTES
// (2026-12-06, H100): with 3 K blocks a tile (H 384, at most one tile a CTA) and blocking probes,
// no 1 ns wait of a pairs launch gave up. Short waits now poll (ptx::kShortWaitNs), and 24 K
// blocks a tile (H 3072, four times the ring's 6 stages) make the Producers wait for released
// stages too.
TEST(GemmFp8Waits, PairsGivingUpEndsAndTheNextLaunchIsRight) {
  MOK_REQUIRE_HOPPER();
  Layout l({0, 1, 130, 77, 0, 300});
  const int H = 3072, I = 256;
  std::mt19937_64 rng(next_seed());
  GateUpFp8Operands gate_up(l, H, I, rng);
  DeviceBuffer<__nv_bfloat16> want(std::size_t(l.capacity) * I), got(std::size_t(l.capacity) * I);
  int gave_up = 0;
  for (const int repeat : {1, 2, 3}) {
    gave_up += gives_up_then_right("e4m3 gate/up pairs, launch " + std::to_string(repeat), want,
                                   got, gate_up.launch(kPairs));
  }
  EXPECT_GT(gave_up, 0) << "no launch gave up: no abort path was run";
}

}  // namespace
