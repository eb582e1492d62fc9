// mok's grouped GEMM forms timed on every PERF.md case, uniform and skewed routing.
// Writes one JSON object per measurement (one per line) to the file named by argv[1]; the torch
// baselines and the merge into docs/perf/gemm.json are in bench/bench_gemm.py (same row counts).
//
// Method (PERF.md): correctness checked on sampled rows before timing (fp32 reference kernel);
// a warm-up round over all items of a case, then `rounds` measured rounds over all items (the
// items interleaved), each item's round = 5 warm-up runs and `reps` timed runs with CUDA events
// around each launch, L2 flushed (256 MB memset) before each. Reported: the median over rounds of
// the rounds' medians, the smallest and largest round median (the spread), and the median SM clock
// over the item's rounds (NVML: nvml_clocks.hpp; absent where NVML is not).
// Every form is timed as "mok"; the plain gate/up GEMM (no SwiGLU epilogue) as "mok-unfused".
// "dgrad-swiglu" is the layer's routed down dgrad: dh = dy W_down with the SwiGLU-backward
// epilogue, the row scale (router weight) and the router-gradient dot partials; "dgrad-swiglu-wh"
// the same with bf16(w h) stored too (the backward's form where I <= H). Before timing, both
// forms must write every kept row of dg, du and dot with the same bits.
// "mok-fp8": the e4m3 forms of gemm1 (gate/up with SwiGLU), gemm2 (down), dgrad (dy W_down from the
// weight's transposed copy), dgrad-swiglu (the same with the SwiGLU-backward epilogue, as the
// layer runs it) and wgrad (the k-grouped dW_down = dy^T h from token-axis copies, 1 x 128 along
// the tokens), on FP8 operands with 1 x 128 scales and 128 x 128 weight-block scales; gemm1,
// gemm2, dgrad and wgrad checked before timing on a sampled row of the first and last expert
// against an fp32 model of the block-scaled product (dgrad-swiglu's epilogue values are
// test_gemm_fp8.cu's).
// "mok-fp8-pairs": gemm1, gemm2, dgrad and dgrad-swiglu of mok-fp8 in clusters of two CTAs that
// share weight tiles (the launchers' `pairs`); "mok-fp8-overlap": the same with each K block's
// wgmma in flight during the previous block's promotion (`overlap`; wgrad too); "mok-fp8-pairs-
// overlap": both (its wgrad the overlap's); "mok-fp8-staged" and "mok-fp8-overlap-staged": the
// weight gradient with its bf16 tiles stored through shared memory and TMA (`tma_store`), without
// and with the overlap; "mok-fp8-wide": gemm1, gemm2, dgrad and dgrad-swiglu on 128 x 256 tiles
// (`wide`); "mok-fp8-quantized": dgrad-swiglu writing dg and du quantized only, in the rows and
// token-axis forms the next GEMMs read (`quantized`, what the layer's
// Fp8Kernels::quantizing_epilogue runs; the passes it replaces are not timed here);
// "mok-fp8-wide-rows": dgrad-swiglu on wide tiles writing the rows forms of dg and du beside the
// bf16 ones (Fp8Kernels::dgrad_rows_epilogue), "mok-fp8-rows" the same on 128 x 128 tiles (the
// layer's: Fp8Kernels::dgrad_rows_wide off), and "mok-fp8-wide-passes": the wide dgrad-swiglu
// followed by the two rows passes that give the same bytes (the layer without it). Each checked
// bitwise against mok-fp8 first (the quantized one: its bf16 dg, du and dot, and the rows form of
// two rows against the host's quantization of mok-fp8's bf16 rows), and timed only when argv[6]
// names it.
// argv[5], optional: the passes to time (comma-separated), e.g. dgrad,dgrad-swiglu; argv[6],
// optional: the impls (e.g. mok-fp8), so that one form runs alone at the power limit (its solo
// time).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bench_check.hpp"
#include "nvml_clocks.hpp"
#include "core/fp8.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/kernels/quantize_pass_fp8.hpp"

namespace {

struct Case {
  const char* name;
  int t, h, i, e, k;
};
const Case kCases[] = {{"dsv3-ep8slice", 4096, 7168, 2048, 32, 8},
                       {"dsv3-ep1", 4096, 7168, 2048, 256, 8},
                       {"qwen3-30b-a3b", 16384, 2048, 768, 128, 8},
                       {"mixtral-8x7b", 8192, 4096, 14336, 8, 2}};
// dsv3-ep8slice with H (the gate/up GEMM's K) from 1,792 to 14,336: the same 4,096 tiles of
// gate/up with 14 to 112 K blocks each. Timed only when named, uniform routing only. Their
// gate/up cycles against K blocks a tile split a form's time into a cost a K block (the slope)
// and a cost a tile (the intercept: epilogue, tile switch, the last wave), NOTES "2026-12-06,
// c3cc991 to a7fd29e" (where the short items' NVML clock, 1,980 MHz, is in doubt).
// "l2w-h7168": dsv3-ep8slice's K (7,168) on one expert of 196,608 rows with I = 256, whose gate/up
// weights (3.7 MB in e4m3) stay in the L2: 3,072 tiles of 128 x 256, each weight tile read by
// every row tile, a call about as long as dsv3-ep8slice's (whose NVML clock reads as the power
// limit's, 1,470 MHz on an H100).
// Against dsv3-ep8slice (0.9 GB of weights) at the same K: how much of the wide forms' loss a K
// block is their weights' traffic (NOTES, "2026-12-06, c3cc991 to a7fd29e").
// "wgk-t8192", "wgk-t16384": dsv3-ep1 with 2x and 4x the tokens, so the K-grouped weight gradient's
// tiles have 256 and 512 rows of K instead of 128 (the same tiles, the same 7.5 GB of output): its
// time against K splits into the output's cost and the K loop's. 8,192 tokens is what Transformers'
// DeepSeek-V3 block runs in bench_hf.py (NOTES, "2026-12-07, 0bb13df").
const Case kSweepCases[] = {{"ksweep-h1792", 4096, 1792, 2048, 32, 8},
                            {"ksweep-h3584", 4096, 3584, 2048, 32, 8},
                            {"ksweep-h14336", 4096, 14336, 2048, 32, 8},
                            {"l2w-h7168", 196608, 7168, 256, 1, 1},
                            {"wgk-t8192", 8192, 7168, 2048, 256, 8},
                            {"wgk-t16384", 16384, 7168, 2048, 256, 8}};

// Rows per expert: uniform splits T*k evenly; skewed gives expert 0 half of them and splits the
// rest evenly (remainders to the lowest experts). bench_gemm.py uses the same function.
std::vector<int> routing_counts(const Case& c, bool skewed) {
  const int total = c.t * c.k;
  std::vector<int> counts(c.e);
  if (!skewed) {
    for (int g = 0; g < c.e; ++g) counts[g] = total / c.e + (g < total % c.e ? 1 : 0);
  } else {
    counts[0] = total / 2;
    const int rest = total - counts[0], others = c.e - 1;
    for (int g = 1; g < c.e; ++g) counts[g] = rest / others + (g - 1 < rest % others ? 1 : 0);
  }
  return counts;
}

__global__ void fill_kernel(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    unsigned x =
        static_cast<unsigned>(i) * 2654435761u ^ seed ^ static_cast<unsigned>(i >> 32) * 40503u;
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    x *= 0x297a2d39u;
    x ^= x >> 15;
    p[i] = __float2bfloat16_rn(((x >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale);
  }
}

__nv_bfloat16* alloc_random(size_t n, unsigned seed, float scale) {
  __nv_bfloat16* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * 2));
  fill_kernel<<<2048, 256>>>(p, n, seed, scale);
  return p;
}

// The relative L2 error of n bf16 outputs against the fp32 reference `ref` (device memory the
// call frees).
double rel_err_against(float* ref, int n, const __nv_bfloat16* out) {
  std::vector<float> r(n);
  std::vector<__nv_bfloat16> o(n);
  CHECK_CUDA(cudaMemcpy(r.data(), ref, n * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o.data(), out, n * 2, cudaMemcpyDeviceToHost));
  cudaFree(ref);
  double d = 0, s = 0;
  for (int j = 0; j < n; ++j) {
    const double v = __bfloat162float(o[j]);
    d += (v - r[j]) * (v - r[j]);
    s += double(r[j]) * r[j];
  }
  return std::sqrt(d / std::max(s, 1e-30));
}

// Finite e4m3 bytes with exponent fields 5..9 (|v| in [0.25, 8)), and power-of-two scales
// 2^-8 .. 2^-4, both from a hash of (index, seed).
__device__ unsigned hash_index(size_t i, unsigned seed) {
  unsigned x =
      static_cast<unsigned>(i) * 2654435761u ^ seed ^ static_cast<unsigned>(i >> 32) * 40503u;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return x;
}
__global__ void fill_e4m3_kernel(std::uint8_t* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const unsigned x = hash_index(i, seed);
    p[i] = static_cast<std::uint8_t>((x & 0x87u) | ((5u + (x >> 8) % 5u) << 3));
  }
}
__global__ void fill_scale_kernel(float* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    p[i] = ldexpf(1.0f, -4 - static_cast<int>(hash_index(i, seed) % 5u));
  }
}
// A bf16 value from its bits (exact).
float bf16f(std::uint16_t bits) {
  std::uint32_t w = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

std::uint8_t* alloc_e4m3(size_t n, unsigned seed) {
  std::uint8_t* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1)));
  fill_e4m3_kernel<<<2048, 256>>>(p, n, seed);
  return p;
}
float* alloc_scales(size_t n, unsigned seed) {
  float* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * 4));
  fill_scale_kernel<<<256, 256>>>(p, n, seed);
  return p;
}

// The e4m3 row `row` of group g times its weight [G, n, k]: per K block the product of the
// decoded values in fp32, times the row's and the block's scales, summed in K order.
__global__ void ref_fp8_kernel(const std::uint8_t* a, int lda, const float* a_scale, long long a_ld,
                               const std::uint8_t* w, const float* w_scale, int row, int g,
                               int n_cols, int k_dim, float* out) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= n_cols) return;
  const int kbs = k_dim / 128;
  float acc = 0.0f;
  for (int kb = 0; kb < kbs; ++kb) {
    float block = 0.0f;
    for (int k = kb * 128; k < kb * 128 + 128; ++k) {
      __nv_fp8_e4m3 x, y;
      x.__x = a[size_t(row) * lda + k];
      y.__x = w[(size_t(g) * n_cols + n) * k_dim + k];
      block = fmaf(float(x), float(y), block);
    }
    const float s = a_scale[size_t(kb) * a_ld + row] *
                    w_scale[(size_t(g) * (n_cols / 128) + n / 128) * kbs + kb];
    acc = fmaf(block, s, acc);
  }
  out[n] = acc;
}

// Row m_row of the k-grouped e4m3 product dw[g] = a^T b over the group's rows [start, start +
// count), from token-axis copies a [m_dim, ld], b [n_cols, ld] with scales per 128 tokens
// ([capacity / 128, m_dim], [capacity / 128, n_cols]): per 128-token block the decoded products
// summed in fp32, times both scales, blocks in token order.
__global__ void ref_wgrad_fp8_kernel(const std::uint8_t* a, const float* a_scale, int m_dim,
                                     const std::uint8_t* b, const float* b_scale, int n_cols,
                                     long long ld, int start, int count, int m_row, float* out) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= n_cols) return;
  float acc = 0.0f;
  for (int t0 = start; t0 < start + count; t0 += 128) {
    const int t1 = min(t0 + 128, start + count);
    float block = 0.0f;
    for (int t = t0; t < t1; ++t) {
      __nv_fp8_e4m3 x, y;
      x.__x = a[size_t(m_row) * ld + t];
      y.__x = b[size_t(n) * ld + t];
      block = fmaf(float(x), float(y), block);
    }
    const float s =
        a_scale[size_t(t0 / 128) * m_dim + m_row] * b_scale[size_t(t0 / 128) * n_cols + n];
    acc = fmaf(block, s, acc);
  }
  out[n] = acc;
}

double rel_err_row_fp8(const std::uint8_t* a, int lda, const float* a_scale, long long a_ld,
                       const std::uint8_t* w, const float* w_scale, int row, int g, int n, int k,
                       const __nv_bfloat16* out, long long ld_out) {
  float* ref = nullptr;
  CHECK_CUDA(cudaMalloc(&ref, n * 4));
  ref_fp8_kernel<<<(n + 127) / 128, 128>>>(a, lda, a_scale, a_ld, w, w_scale, row, g, n, k, ref);
  return rel_err_against(ref, n, out + size_t(row) * ld_out);
}

// out[s, n] = sum_k a[row_s, k] * b(n, k) for a sampled row (fp32), for the correctness check.
__global__ void ref_kernel(const __nv_bfloat16* a, int lda, const __nv_bfloat16* w, int trans_b,
                           int row, int g, int n_cols, int k_dim, float* out) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= n_cols) return;
  float acc = 0.0f;
  for (int k = 0; k < k_dim; ++k) {
    const float b = trans_b ? __bfloat162float(w[(size_t(g) * k_dim + k) * n_cols + n])
                            : __bfloat162float(w[(size_t(g) * n_cols + n) * k_dim + k]);
    acc = fmaf(__bfloat162float(a[size_t(row) * lda + k]), b, acc);
  }
  out[n] = acc;
}

double rel_err_row(const __nv_bfloat16* a, int lda, const __nv_bfloat16* w, int trans_b, int row,
                   int g, int n, int k, const __nv_bfloat16* out, long long ld_out) {
  float* ref = nullptr;
  CHECK_CUDA(cudaMalloc(&ref, n * 4));
  ref_kernel<<<(n + 127) / 128, 128>>>(a, lda, w, trans_b, row, g, n, k, ref);
  return rel_err_against(ref, n, out + size_t(row) * ld_out);
}

double time_median_ms(const std::function<void()>& fn, void* flush, size_t flush_bytes, int reps) {
  for (int i = 0; i < 5; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
    cudaEventRecord(e0);
    fn();
    cudaEventRecord(e1);
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s out.jsonl [reps] [rounds] [case,case,...] [pass,pass,...] [impl,...]\n",
                 argv[0]);
    return 2;
  }
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const std::string only = argc > 4 ? std::string(",") + argv[4] + "," : std::string();
  // Passes to time (gemm1, gemm2, dgrad, dgrad-swiglu, dgrad-swiglu-wh, wgrad); default all.
  const std::string passes = argc > 5 ? std::string(",") + argv[5] + "," : std::string();
  const std::string impls = argc > 6 ? std::string(",") + argv[6] + "," : std::string();
  FILE* json = std::fopen(argv[1], "w");
  const size_t flush_bytes = 256u << 20;
  void* flush = nullptr;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  ClockSampler clocks(device);
  std::printf("%-14s %-8s %-15s %-24s %10s %9s %9s  %s\n", "case", "routing", "pass", "impl",
              "median_ms", "tflops", "rel_err", "[round min, max]");
  std::vector<Case> cases(std::begin(kCases), std::end(kCases));
  cases.insert(cases.end(), std::begin(kSweepCases), std::end(kSweepCases));
  for (const Case& c : cases) {
    const bool named = only.find(std::string(",") + c.name + ",") != std::string::npos;
    const bool sweep = std::string(c.name).rfind("ksweep-", 0) == 0 ||
                       std::string(c.name).rfind("l2w-", 0) == 0 ||
                       std::string(c.name).rfind("wgk-", 0) == 0;
    if ((!only.empty() || sweep) && !named) continue;
    for (int skew = 0; skew < (sweep ? 1 : 2); ++skew) {
      const std::vector<int> counts = routing_counts(c, skew != 0);
      const int G = c.e;
      std::vector<int> starts(G + 1, 0);
      long long rows = 0;
      for (int g = 0; g < G; ++g) {
        starts[g + 1] = starts[g] + (counts[g] + 127) / 128 * 128;
        rows += counts[g];
      }
      const int capacity = starts[G];
      int *d_starts, *d_counts;
      CHECK_CUDA(cudaMalloc(&d_starts, (G + 1) * 4));
      CHECK_CUDA(cudaMalloc(&d_counts, G * 4));
      CHECK_CUDA(cudaMemcpy(d_starts, starts.data(), (G + 1) * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_counts, counts.data(), G * 4, cudaMemcpyHostToDevice));
      const mok::gemm::RowSegments seg{d_starts, d_counts, G, capacity, 0};
      const float ws = 2.0f / std::sqrt(float(c.h));
      __nv_bfloat16* x = alloc_random(size_t(capacity) * c.h, 1, 1.0f);
      // mok's SwiGLU form reads separate W_gate, W_up [G, I, H]; the plain (unfused) gate/up GEMM
      // reads them stacked as w13 [G, 2I, H], as torch's baseline does.
      __nv_bfloat16* w13 = alloc_random(size_t(G) * 2 * c.i * c.h, 2, ws);
      __nv_bfloat16* wg = alloc_random(size_t(G) * c.i * c.h, 3, ws);
      __nv_bfloat16* wu = alloc_random(size_t(G) * c.i * c.h, 4, ws);
      __nv_bfloat16* wd = alloc_random(size_t(G) * c.h * c.i, 5, 2.0f / std::sqrt(float(c.i)));
      __nv_bfloat16* hid = alloc_random(size_t(capacity) * c.i, 6, 1.0f);
      __nv_bfloat16* dy = alloc_random(size_t(capacity) * c.h, 7, 1.0f);
      __nv_bfloat16 *out_h, *out_gu, *out_y, *out_dh, *out_dw;
      unsigned* tickets;  // the wgrad's counter pair (its launches are ordered on one stream)
      CHECK_CUDA(cudaMalloc(&tickets, 2 * sizeof(unsigned)));
      CHECK_CUDA(cudaMemset(tickets, 0, 2 * sizeof(unsigned)));
      CHECK_CUDA(cudaMalloc(&out_h, size_t(capacity) * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_gu, size_t(capacity) * 2 * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_y, size_t(capacity) * c.h * 2));
      CHECK_CUDA(cudaMalloc(&out_dh, size_t(capacity) * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_dw, size_t(G) * c.h * c.i * 2));
      // The SwiGLU-backward dgrad: g, u as the forward stored them, dg, du, bf16(w h) and the dot
      // partials out, the router weight of each row in.
      const int dot_chunks = (c.i + mok::gemm::kDotColumns - 1) / mok::gemm::kDotColumns;
      __nv_bfloat16* sg = alloc_random(size_t(capacity) * c.i, 8, 2.0f);
      __nv_bfloat16* su = alloc_random(size_t(capacity) * c.i, 9, 2.0f);
      __nv_bfloat16 *out_dg, *out_du, *out_wh;
      float *row_w, *out_dot;
      CHECK_CUDA(cudaMalloc(&out_dg, size_t(capacity) * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_du, size_t(capacity) * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_wh, size_t(capacity) * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_dot, size_t(capacity) * dot_chunks * 4));
      CHECK_CUDA(cudaMalloc(&row_w, size_t(capacity) * 4));
      {
        std::vector<float> w(capacity);
        for (int r = 0; r < capacity; ++r) w[r] = 0.05f + 0.9f * float((r * 7919) % 1000) / 1000;
        CHECK_CUDA(cudaMemcpy(row_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
      }
      CHECK_CUDA(cudaDeviceSynchronize());

      mok::gemm::GateUpForwardArgs gu;
      gu.segments = seg;
      gu.x = x;
      gu.ld_x = c.h;
      gu.w_gate = wg;
      gu.w_up = wu;
      gu.hidden = out_h;
      gu.ld_out = c.i;
      gu.hidden_size = c.h;
      gu.intermediate_size = c.i;
      mok::gemm::RowsTimesWeightTArgs plain;  // gate/up without SwiGLU: x [G, 2I, H]^T
      plain.segments = seg;
      plain.a = x;
      plain.ld_a = c.h;
      plain.w = w13;
      plain.out = out_gu;
      plain.ld_out = 2 * c.i;
      plain.n = 2 * c.i;
      plain.k = c.h;
      mok::gemm::RowsTimesWeightTArgs down;
      down.segments = seg;
      down.a = hid;
      down.ld_a = c.i;
      down.w = wd;
      down.out = out_y;
      down.ld_out = c.h;
      down.n = c.h;
      down.k = c.i;
      mok::gemm::RowsTimesWeightArgs dgrad;
      dgrad.segments = seg;
      dgrad.a = dy;
      dgrad.ld_a = c.h;
      dgrad.w = wd;
      dgrad.out = out_dh;
      dgrad.ld_out = c.i;
      dgrad.n = c.i;
      dgrad.k = c.h;
      mok::gemm::WeightGradArgs wgrad;
      wgrad.segments = seg;
      wgrad.a = dy;
      wgrad.ld_a = c.h;
      wgrad.b = hid;
      wgrad.ld_b = c.i;
      wgrad.out = out_dw;
      wgrad.ld_out = c.i;
      wgrad.m = c.h;
      wgrad.n = c.i;
      wgrad.tickets = tickets;
      mok::gemm::RowsTimesWeightArgs dgrad_swiglu = dgrad;
      dgrad_swiglu.out = nullptr;
      dgrad_swiglu.swiglu = {sg, su, out_dg, out_du, row_w, out_dot, nullptr, std::nullopt};
      mok::gemm::RowsTimesWeightArgs dgrad_swiglu_wh = dgrad_swiglu;
      dgrad_swiglu_wh.swiglu.scaled_hidden = out_wh;

      // Correctness before timing: a sampled row of expert 0 and of the last expert (the GEMM
      // tests check every form fully, tests/cpp/test_gemm.cu).
      double err = 0;
      {
        const mok::gemm::RowsTimesWeightTArgs plain_s = plain, down_s = down;
        const mok::gemm::RowsTimesWeightArgs dgrad_s = dgrad;
        CHECK_CUDA(cudaMemset(out_gu, 0xff, size_t(capacity) * 2 * c.i * 2));
        CHECK_CUDA(cudaMemset(out_y, 0xff, size_t(capacity) * c.h * 2));
        CHECK_CUDA(cudaMemset(out_dh, 0xff, size_t(capacity) * c.i * 2));
        mok::gemm::rows_times_weight_t(plain_s);
        mok::gemm::rows_times_weight_t(down_s);
        mok::gemm::rows_times_weight(dgrad_s);
        CHECK_CUDA(cudaDeviceSynchronize());
        for (int g : {0, G - 1}) {
          if (counts[g] == 0) continue;
          const int row = starts[g] + counts[g] - 1;
          err = std::max(err, rel_err_row(x, c.h, w13, 0, row, g, 2 * c.i, c.h, out_gu, 2 * c.i));
          err = std::max(err, rel_err_row(hid, c.i, wd, 0, row, g, c.h, c.i, out_y, c.h));
          err = std::max(err, rel_err_row(dy, c.h, wd, 1, row, g, c.i, c.h, out_dh, c.i));
        }
      }
      // The SwiGLU-backward dgrad (its values are test_gemm.cu's): every kept row of dg, du and
      // dot written, with the same bits with or without bf16(w h).
      {
        std::vector<char> kept(capacity, 0);
        for (int g = 0; g < G; ++g)
          for (int r = starts[g]; r < starts[g] + counts[g]; ++r) kept[r] = 1;
        std::vector<std::uint16_t> first_dg, first_du;
        std::vector<float> first_dot;
        int run = 0;
        for (bool wh : {true, false}) {
          {
            const mok::gemm::RowsTimesWeightArgs a = wh ? dgrad_swiglu_wh : dgrad_swiglu;
            CHECK_CUDA(cudaMemset(out_dg, 0xff, size_t(capacity) * c.i * 2));
            CHECK_CUDA(cudaMemset(out_du, 0xff, size_t(capacity) * c.i * 2));
            CHECK_CUDA(cudaMemset(out_dot, 0xff, size_t(capacity) * dot_chunks * 4));
            mok::gemm::rows_times_weight(a);
            CHECK_CUDA(cudaDeviceSynchronize());
            std::vector<std::uint16_t> dg(size_t(capacity) * c.i), du(dg.size());
            std::vector<float> dot(size_t(capacity) * dot_chunks);
            CHECK_CUDA(cudaMemcpy(dg.data(), out_dg, dg.size() * 2, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(du.data(), out_du, du.size() * 2, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(dot.data(), out_dot, dot.size() * 4, cudaMemcpyDeviceToHost));
            long long unwritten = 0;
            for (int r = 0; r < capacity; ++r) {
              if (!kept[r]) continue;
              for (int j = 0; j < c.i; ++j) {
                const size_t i = size_t(r) * c.i + j;
                unwritten += dg[i] == 0xffff || du[i] == 0xffff;
              }
              for (int ch = 0; ch < dot_chunks; ++ch)
                unwritten += std::isnan(dot[size_t(r) * dot_chunks + ch]);
            }
            if (run++ == 0) {
              first_dg = std::move(dg);
              first_du = std::move(du);
              first_dot = std::move(dot);
            } else if (dg != first_dg || du != first_du ||
                       std::memcmp(dot.data(), first_dot.data(), dot.size() * 4) != 0) {
              std::fprintf(stderr, "%s: the SwiGLU dgrad's bits differ (scaled_hidden %d)\n",
                           c.name, int(wh));
              return 1;
            }
            if (unwritten != 0) {
              std::fprintf(stderr, "%s: the SwiGLU dgrad left %lld kept values unwritten\n", c.name,
                           unwritten);
              return 1;
            }
          }
        }
      }
      // The e4m3 operands: x and hidden rows with 1 x 128 scales ([K / 128, capacity]), weights
      // with 128 x 128 block scales.
      std::uint8_t* x8 = alloc_e4m3(size_t(capacity) * c.h, 11);
      std::uint8_t* hid8 = alloc_e4m3(size_t(capacity) * c.i, 12);
      std::uint8_t* wg8 = alloc_e4m3(size_t(G) * c.i * c.h, 13);
      std::uint8_t* wu8 = alloc_e4m3(size_t(G) * c.i * c.h, 14);
      std::uint8_t* wd8 = alloc_e4m3(size_t(G) * c.h * c.i, 15);
      float* x8s = alloc_scales(size_t(c.h / 128) * capacity, 16);
      float* hid8s = alloc_scales(size_t(c.i / 128) * capacity, 17);
      float* wg8s = alloc_scales(size_t(G) * (c.i / 128) * (c.h / 128), 18);
      float* wu8s = alloc_scales(size_t(G) * (c.i / 128) * (c.h / 128), 19);
      float* wd8s = alloc_scales(size_t(G) * (c.h / 128) * (c.i / 128), 20);
      __nv_bfloat16 *out_g8, *out_u8;
      CHECK_CUDA(cudaMalloc(&out_g8, size_t(capacity) * c.i * 2));
      CHECK_CUDA(cudaMalloc(&out_u8, size_t(capacity) * c.i * 2));
      mok::gemm::GateUpForwardFp8Args gu8;
      gu8.segments = seg;
      gu8.x = {x8, c.h, x8s, capacity};
      gu8.w_gate = {wg8, wg8s};
      gu8.w_up = {wu8, wu8s};
      gu8.hidden = out_h;
      gu8.ld_out = c.i;
      gu8.hidden_size = c.h;
      gu8.intermediate_size = c.i;
      mok::gemm::RowsTimesWeightTFp8Args down8;
      down8.segments = seg;
      down8.a = {hid8, c.i, hid8s, capacity};
      down8.w = {wd8, wd8s};
      down8.out = out_y;
      down8.ld_out = c.h;
      down8.n = c.h;
      down8.k = c.i;
      {
        mok::gemm::GateUpForwardFp8Args gu8_s = gu8;  // with g and u stored, for the check
        gu8_s.gate = out_g8;
        gu8_s.up = out_u8;
        CHECK_CUDA(cudaMemset(out_g8, 0xff, size_t(capacity) * c.i * 2));
        CHECK_CUDA(cudaMemset(out_y, 0xff, size_t(capacity) * c.h * 2));
        mok::gemm::gate_up_forward_fp8(gu8_s);
        mok::gemm::rows_times_weight_t_fp8(down8);
        CHECK_CUDA(cudaDeviceSynchronize());
        for (int g : {0, G - 1}) {
          if (counts[g] == 0) continue;
          const int row = starts[g] + counts[g] - 1;
          err = std::max(err, rel_err_row_fp8(x8, c.h, x8s, capacity, wg8, wg8s, row, g, c.i, c.h,
                                              out_g8, c.i));
          err = std::max(err, rel_err_row_fp8(hid8, c.i, hid8s, capacity, wd8, wd8s, row, g, c.h,
                                              c.i, out_y, c.h));
        }
      }
      // The mainloop variants (only when asked for by name): the same two forward forms in
      // clusters of two CTAs sharing weight tiles (`pairs`), with the overlapped promotion
      // (`overlap`), or both; each checked bitwise against the plain launch over the whole
      // outputs before timing.
      struct Fp8Variant {
        const char* impl;
        bool pairs, overlap, wide;
      };
      const Fp8Variant fp8_variants[] = {{"mok-fp8-pairs", true, false, false},
                                         {"mok-fp8-overlap", false, true, false},
                                         {"mok-fp8-pairs-overlap", true, true, false},
                                         {"mok-fp8-wide", false, false, true}};
      const auto any_variant_named = [&] {
        for (const Fp8Variant& v : fp8_variants) {
          if (impls.find(std::string(",") + v.impl + ",") != std::string::npos) return true;
        }
        return false;
      };
      const auto named = [&](const char* impl) {
        return impls.find(std::string(",") + impl + ",") != std::string::npos;
      };
      std::vector<mok::gemm::GateUpForwardFp8Args> gu8v;
      std::vector<mok::gemm::RowsTimesWeightTFp8Args> down8v;
      for (const Fp8Variant& v : fp8_variants) {
        gu8v.push_back(gu8);
        gu8v.back().pairs = v.pairs;
        gu8v.back().overlap = v.overlap;
        gu8v.back().wide = v.wide;
        down8v.push_back(down8);
        down8v.back().pairs = v.pairs;
        down8v.back().overlap = v.overlap;
        down8v.back().wide = v.wide;
      }
      if (any_variant_named()) {
        std::vector<std::uint16_t> want_h(size_t(capacity) * c.i), got_h(want_h.size());
        std::vector<std::uint16_t> want_y(size_t(capacity) * c.h), got_y(want_y.size());
        auto forward = [&](const auto& up, const auto& down, std::vector<std::uint16_t>& h,
                           std::vector<std::uint16_t>& y) {
          CHECK_CUDA(cudaMemset(out_h, 0xff, h.size() * 2));
          CHECK_CUDA(cudaMemset(out_y, 0xff, y.size() * 2));
          mok::gemm::gate_up_forward_fp8(up);
          mok::gemm::rows_times_weight_t_fp8(down);
          CHECK_CUDA(cudaDeviceSynchronize());
          CHECK_CUDA(cudaMemcpy(h.data(), out_h, h.size() * 2, cudaMemcpyDeviceToHost));
          CHECK_CUDA(cudaMemcpy(y.data(), out_y, y.size() * 2, cudaMemcpyDeviceToHost));
        };
        forward(gu8, down8, want_h, want_y);
        for (size_t v = 0; v < std::size(fp8_variants); ++v) {
          if (!named(fp8_variants[v].impl)) continue;
          forward(gu8v[v], down8v[v], got_h, got_y);
          if (want_h != got_h || want_y != got_y) {
            std::fprintf(stderr, "%s: %s's e4m3 forward forms differ from mok-fp8's; not timing\n",
                         c.name, fp8_variants[v].impl);
            return 1;
          }
        }
      }
      // The e4m3 backward operands: dy rows with 1 x 128 scales along H ([H / 128, capacity]);
      // W_down's transposed copy [G, I, H] (the quantized weight's second orientation) with its
      // block scales; the token-axis copies of dy [H, capacity] and h [I, capacity] with scales
      // per 128 tokens ([capacity / 128, H], [capacity / 128, I]).
      std::uint8_t* dy8 = alloc_e4m3(size_t(capacity) * c.h, 21);
      float* dy8s = alloc_scales(size_t(c.h / 128) * capacity, 22);
      std::uint8_t* wdt8 = alloc_e4m3(size_t(G) * c.i * c.h, 23);
      float* wdt8s = alloc_scales(size_t(G) * (c.i / 128) * (c.h / 128), 24);
      std::uint8_t* dy8t = alloc_e4m3(size_t(c.h) * capacity, 25);
      std::uint8_t* hid8t = alloc_e4m3(size_t(c.i) * capacity, 26);
      float* dy8ts = alloc_scales(size_t(capacity / 128) * c.h, 27);
      float* hid8ts = alloc_scales(size_t(capacity / 128) * c.i, 28);
      mok::gemm::RowsTimesWeightFp8Args dgrad8;
      dgrad8.segments = seg;
      dgrad8.a = {dy8, c.h, dy8s, capacity};
      dgrad8.w_t = {wdt8, wdt8s};
      dgrad8.out = out_dh;
      dgrad8.ld_out = c.i;
      dgrad8.n = c.i;
      dgrad8.k = c.h;
      mok::gemm::RowsTimesWeightFp8Args dgrad8_swiglu = dgrad8;
      dgrad8_swiglu.out = nullptr;
      dgrad8_swiglu.swiglu = {sg, su, out_dg, out_du, row_w, out_dot, nullptr, std::nullopt};
      mok::gemm::WeightGradFp8Args wgrad8;
      wgrad8.grad.segments = seg;
      wgrad8.grad.out = out_dw;
      wgrad8.grad.ld_out = c.i;
      wgrad8.grad.m = c.h;
      wgrad8.grad.n = c.i;
      wgrad8.grad.tickets = tickets;
      wgrad8.a = {dy8t, capacity, dy8ts, c.h};
      wgrad8.b = {hid8t, capacity, hid8ts, c.i};
      // The SwiGLU backward that quantizes dg and du (`quantized`): rows forms [capacity, I] and
      // token-axis forms [I, capacity] of both, with their scales; timed without bf16 dg and du.
      const size_t q_cells = size_t(capacity) * c.i;
      std::uint8_t *q_rows[2], *q_tokens[2];
      float *q_rows_s[2], *q_tokens_s[2];
      for (int t = 0; t < 2; ++t) {
        CHECK_CUDA(cudaMalloc(&q_rows[t], q_cells));
        CHECK_CUDA(cudaMalloc(&q_tokens[t], q_cells));
        CHECK_CUDA(cudaMalloc(&q_rows_s[t], size_t(c.i / 128) * capacity * 4));
        CHECK_CUDA(cudaMalloc(&q_tokens_s[t], size_t(capacity / 128) * c.i * 4));
      }
      mok::gemm::RowsTimesWeightFp8Args dgrad8_q = dgrad8_swiglu;
      dgrad8_q.swiglu.d_gate = dgrad8_q.swiglu.d_up = nullptr;  // the layer's call: quantized only
      dgrad8_q.quantized.d_gate_rows = {q_rows[0], c.i, q_rows_s[0], capacity};
      dgrad8_q.quantized.d_up_rows = {q_rows[1], c.i, q_rows_s[1], capacity};
      dgrad8_q.quantized.d_gate_tokens = {q_tokens[0], capacity, q_tokens_s[0], c.i};
      dgrad8_q.quantized.d_up_tokens = {q_tokens[1], capacity, q_tokens_s[1], c.i};
      if (named("mok-fp8-quantized")) {
        const size_t cells = q_cells, dots = size_t(capacity) * dot_chunks;
        auto swiglu_outputs = [&](const mok::gemm::RowsTimesWeightFp8Args& a) {
          std::vector<std::uint16_t> bytes(2 * cells);
          std::vector<float> dot(dots);
          for (auto* b : {out_dg, out_du}) CHECK_CUDA(cudaMemset(b, 0xff, cells * 2));
          CHECK_CUDA(cudaMemset(out_dot, 0xff, dots * 4));
          mok::gemm::rows_times_weight_fp8(a);
          CHECK_CUDA(cudaDeviceSynchronize());
          CHECK_CUDA(cudaMemcpy(bytes.data(), out_dg, cells * 2, cudaMemcpyDeviceToHost));
          CHECK_CUDA(cudaMemcpy(bytes.data() + cells, out_du, cells * 2, cudaMemcpyDeviceToHost));
          CHECK_CUDA(cudaMemcpy(dot.data(), out_dot, dots * 4, cudaMemcpyDeviceToHost));
          return std::make_pair(bytes, dot);
        };
        const auto want = swiglu_outputs(dgrad8_swiglu);
        mok::gemm::RowsTimesWeightFp8Args both = dgrad8_q;  // bf16 dg and du too
        both.swiglu = dgrad8_swiglu.swiglu;
        const auto got = swiglu_outputs(both);
        bool same = want.first == got.first &&
                    std::memcmp(want.second.data(), got.second.data(), dots * 4) == 0;
        // The rows form of the last row of the first and last non-empty group, against
        // core/fp8.hpp's quantization of mok-fp8's bf16 row (the test checks every row).
        for (int g : {0, G - 1}) {
          if (counts[g] == 0) continue;
          const size_t row = size_t(starts[g] + counts[g] - 1);
          for (int t = 0; t < 2 && same; ++t) {
            std::vector<std::uint8_t> q(c.i);
            std::vector<float> s(c.i / 128);
            CHECK_CUDA(cudaMemcpy(q.data(), q_rows[t] + row * c.i, c.i, cudaMemcpyDeviceToHost));
            for (int b = 0; b < c.i / 128; ++b) {
              CHECK_CUDA(cudaMemcpy(&s[b], q_rows_s[t] + size_t(b) * capacity + row, 4,
                                    cudaMemcpyDeviceToHost));
              const std::uint16_t* v = want.first.data() + t * cells + row * c.i + 128 * b;
              std::uint32_t amax = 0;
              for (int i = 0; i < 128; ++i) amax = mok::fp8::amax_update(amax, bf16f(v[i]));
              const int e = mok::fp8::scale_exponent(amax);
              same = same && s[b] == mok::fp8::scale_of(e);
              for (int i = 0; i < 128; ++i) {
                same = same && q[128 * b + i] == mok::fp8::quantize_value(
                                                     bf16f(v[i]), mok::fp8::inverse_scale_of(e));
              }
            }
          }
        }
        if (!same) {
          std::fprintf(stderr, "%s: mok-fp8-quantized's dgrad-swiglu differs; not timing\n",
                       c.name);
          return 1;
        }
      }
      // The FP8 layer's down dgrad on wide tiles with q(dg) and q(du) in the rows form from its
      // epilogue, beside the bf16 dg and du (Fp8Kernels::dgrad_rows_epilogue), and without: the
      // same launch followed by the two rows passes it replaces (quantize_pass_fp8.cu, as the
      // layer launches them). The rows forms of both checked bytewise against each other first.
      mok::gemm::RowsTimesWeightFp8Args dgrad8_rows = dgrad8_swiglu;
      dgrad8_rows.wide = true;
      dgrad8_rows.quantized.d_gate_rows = {q_rows[0], c.i, q_rows_s[0], capacity};
      dgrad8_rows.quantized.d_up_rows = {q_rows[1], c.i, q_rows_s[1], capacity};
      mok::gemm::RowsTimesWeightFp8Args dgrad8_rows_plain = dgrad8_rows;  // 128 x 128 tiles
      dgrad8_rows_plain.wide = false;
      mok::gemm::RowsTimesWeightFp8Args dgrad8_wide = dgrad8_swiglu;
      dgrad8_wide.wide = true;
      mok::cuda::QuantizePassRowsParams rows_pass[2];
      for (int t = 0; t < 2; ++t) {
        mok::cuda::QuantizePassRowsParams& q = rows_pass[t];
        q.x = reinterpret_cast<const std::uint16_t*>(t == 0 ? out_dg : out_du);
        q.ld_x = c.i;
        q.rows = capacity;
        q.K = c.i;
        q.row_end = seg.starts + seg.num_groups;
        q.data = q_tokens[t];  // [capacity, I] bytes: the token-axis buffers' size
        q.ld = c.i;
        q.scales = q_tokens_s[t];
        q.scale_ld = capacity;
      }
      const auto dgrad_then_passes = [=] {
        mok::gemm::rows_times_weight_fp8(dgrad8_wide);
        for (const mok::cuda::QuantizePassRowsParams& q : rows_pass) {
          CHECK_CUDA(mok::cuda::launch_quantize_pass_rows(q, nullptr));
        }
      };
      if (named("mok-fp8-wide-rows") || named("mok-fp8-wide-passes") || named("mok-fp8-rows")) {
        const size_t rows_bytes = q_cells, scale_bytes = size_t(c.i / 128) * capacity * 4;
        // The epilogue's rows forms (into q_rows) against the passes' (into q_tokens), on the
        // groups' rows only: the passes also quantize the padding rows between groups (the GEMMs
        // never read them), the epilogue does not.
        const auto same_as_passes = [&](const mok::gemm::RowsTimesWeightFp8Args& with_rows) {
          for (int t = 0; t < 2; ++t) {
            CHECK_CUDA(cudaMemset(q_rows[t], 0, rows_bytes));
            CHECK_CUDA(cudaMemset(q_tokens[t], 0, rows_bytes));
            CHECK_CUDA(cudaMemset(q_rows_s[t], 0, scale_bytes));
            CHECK_CUDA(cudaMemset(q_tokens_s[t], 0, scale_bytes));
          }
          mok::gemm::rows_times_weight_fp8(with_rows);
          dgrad_then_passes();
          CHECK_CUDA(cudaDeviceSynchronize());
          bool same = true;
          for (int t = 0; t < 2 && same; ++t) {
            std::vector<std::uint8_t> a(rows_bytes), b(rows_bytes);
            std::vector<float> as(scale_bytes / 4), bs(scale_bytes / 4);
            CHECK_CUDA(cudaMemcpy(a.data(), q_rows[t], rows_bytes, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(b.data(), q_tokens[t], rows_bytes, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(as.data(), q_rows_s[t], scale_bytes, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(bs.data(), q_tokens_s[t], scale_bytes, cudaMemcpyDeviceToHost));
            for (int g = 0; g < G && same; ++g) {
              for (size_t row = size_t(starts[g]); row < size_t(starts[g] + counts[g]); ++row) {
                same = same && std::memcmp(&a[row * c.i], &b[row * c.i], c.i) == 0;
                for (int k = 0; k < c.i / 128; ++k) {
                  same = same && std::memcmp(&as[size_t(k) * capacity + row],
                                             &bs[size_t(k) * capacity + row], 4) == 0;
                }
              }
            }
          }
          return same;
        };
        if (!same_as_passes(dgrad8_rows) || !same_as_passes(dgrad8_rows_plain)) {
          std::fprintf(stderr, "%s: the dgrad epilogue's rows forms differ from the passes'; "
                       "not timing\n", c.name);
          return 1;
        }
      }
      // The input gradients of the variants, checked bitwise as the forward ones.
      std::vector<mok::gemm::RowsTimesWeightFp8Args> dgrad8v, dgrad8v_swiglu;
      for (const Fp8Variant& v : fp8_variants) {
        for (auto* list : {&dgrad8v, &dgrad8v_swiglu}) {
          list->push_back(list == &dgrad8v ? dgrad8 : dgrad8_swiglu);
          list->back().pairs = v.pairs;
          list->back().overlap = v.overlap;
          list->back().wide = v.wide;
        }
      }
      if (any_variant_named()) {
        const size_t cells = size_t(capacity) * c.i, dots = size_t(capacity) * dot_chunks;
        auto backward = [&](const mok::gemm::RowsTimesWeightFp8Args& plain,
                            const mok::gemm::RowsTimesWeightFp8Args& swiglu) {
          std::vector<std::uint16_t> bytes(3 * cells);
          std::vector<float> dot(dots);
          for (auto* b : {out_dh, out_dg, out_du}) CHECK_CUDA(cudaMemset(b, 0xff, cells * 2));
          CHECK_CUDA(cudaMemset(out_dot, 0xff, dots * 4));
          mok::gemm::rows_times_weight_fp8(plain);
          mok::gemm::rows_times_weight_fp8(swiglu);
          CHECK_CUDA(cudaDeviceSynchronize());
          int i = 0;
          for (auto* b : {out_dh, out_dg, out_du}) {
            CHECK_CUDA(
                cudaMemcpy(bytes.data() + cells * i++, b, cells * 2, cudaMemcpyDeviceToHost));
          }
          CHECK_CUDA(cudaMemcpy(dot.data(), out_dot, dots * 4, cudaMemcpyDeviceToHost));
          return std::make_pair(bytes, dot);
        };
        const auto want = backward(dgrad8, dgrad8_swiglu);
        for (size_t v = 0; v < std::size(fp8_variants); ++v) {
          if (!named(fp8_variants[v].impl)) continue;
          const auto got = backward(dgrad8v[v], dgrad8v_swiglu[v]);
          if (want.first != got.first ||
              std::memcmp(want.second.data(), got.second.data(), dots * 4) != 0) {
            std::fprintf(stderr,
                         "%s: %s's e4m3 input gradients differ from mok-fp8's; not "
                         "timing\n",
                         c.name, fp8_variants[v].impl);
            return 1;
          }
        }
      }
      // The weight gradient of the overlap variants (there is no paired K-grouped form), and the
      // staged store (`tma_store`, bf16 tiles through shared memory and TMA; wgrad only) alone
      // and with the overlap, checked bitwise the same way.
      mok::gemm::WeightGradFp8Args wgrad8o = wgrad8;
      wgrad8o.overlap = true;
      mok::gemm::WeightGradFp8Args wgrad8s = wgrad8, wgrad8os = wgrad8o;
      wgrad8s.tma_store = wgrad8os.tma_store = true;
      if (named("mok-fp8-overlap") || named("mok-fp8-pairs-overlap") || named("mok-fp8-staged") ||
          named("mok-fp8-overlap-staged")) {
        const size_t cells = size_t(G) * c.h * c.i;
        auto dw = [&](const mok::gemm::WeightGradFp8Args& a) {
          std::vector<std::uint16_t> out(cells);
          CHECK_CUDA(cudaMemset(out_dw, 0xff, cells * 2));
          mok::gemm::weight_grad_fp8(a);
          CHECK_CUDA(cudaDeviceSynchronize());
          CHECK_CUDA(cudaMemcpy(out.data(), out_dw, cells * 2, cudaMemcpyDeviceToHost));
          return out;
        };
        const std::vector<std::uint16_t> want_dw = dw(wgrad8);
        if (want_dw != dw(wgrad8o) || want_dw != dw(wgrad8s) || want_dw != dw(wgrad8os)) {
          std::fprintf(stderr,
                       "%s: the overlapped or staged e4m3 weight gradient differs; not timing\n",
                       c.name);
          return 1;
        }
      }
      {
        CHECK_CUDA(cudaMemset(out_dh, 0xff, size_t(capacity) * c.i * 2));
        CHECK_CUDA(cudaMemset(out_dw, 0xff, size_t(G) * c.h * c.i * 2));
        mok::gemm::rows_times_weight_fp8(dgrad8);
        mok::gemm::weight_grad_fp8(wgrad8);
        CHECK_CUDA(cudaDeviceSynchronize());
        for (int g : {0, G - 1}) {
          if (counts[g] == 0) continue;
          const int row = starts[g] + counts[g] - 1;
          err = std::max(err, rel_err_row_fp8(dy8, c.h, dy8s, capacity, wdt8, wdt8s, row, g, c.i,
                                              c.h, out_dh, c.i));
          const int m_row = c.h - 1;
          float* ref = nullptr;
          CHECK_CUDA(cudaMalloc(&ref, c.i * 4));
          ref_wgrad_fp8_kernel<<<(c.i + 127) / 128, 128>>>(
              dy8t, dy8ts, c.h, hid8t, hid8ts, c.i, capacity, starts[g], counts[g], m_row, ref);
          err = std::max(err, rel_err_against(ref, c.i, out_dw + (size_t(g) * c.h + m_row) * c.i));
        }
      }
      if (!(err < 1.0 / 128)) {  // 2 bf16 ulps relative: a wrong kernel, not rounding
        std::fprintf(stderr, "%s: relative error %.3g on a checked row; not timing\n", c.name, err);
        return 1;
      }
      const char* routing = skew ? "skewed" : "uniform";
      const double flops = 2.0 * double(rows) * c.h * c.i;  // one H x I projection
      struct Item {
        const char* pass;
        std::string impl;
        double flops;
        std::function<void()> fn;
      };
      std::vector<Item> items;
      items.push_back({"gemm1", "mok", 2 * flops, [=] { mok::gemm::gate_up_forward(gu); }});
      items.push_back(
          {"gemm1", "mok-unfused", 2 * flops, [=] { mok::gemm::rows_times_weight_t(plain); }});
      items.push_back({"gemm2", "mok", flops, [=] { mok::gemm::rows_times_weight_t(down); }});
      items.push_back(
          {"gemm1", "mok-fp8", 2 * flops, [=] { mok::gemm::gate_up_forward_fp8(gu8); }});
      items.push_back(
          {"gemm2", "mok-fp8", flops, [=] { mok::gemm::rows_times_weight_t_fp8(down8); }});
      items.push_back({"dgrad", "mok", flops, [=] { mok::gemm::rows_times_weight(dgrad); }});
      items.push_back(
          {"dgrad-swiglu", "mok", flops, [=] { mok::gemm::rows_times_weight(dgrad_swiglu); }});
      items.push_back({"dgrad-swiglu-wh", "mok", flops,
                       [=] { mok::gemm::rows_times_weight(dgrad_swiglu_wh); }});
      items.push_back({"wgrad", "mok", flops, [=] { mok::gemm::weight_grad(wgrad); }});
      items.push_back(
          {"dgrad", "mok-fp8", flops, [=] { mok::gemm::rows_times_weight_fp8(dgrad8); }});
      items.push_back({"dgrad-swiglu", "mok-fp8", flops,
                       [=] { mok::gemm::rows_times_weight_fp8(dgrad8_swiglu); }});
      items.push_back({"wgrad", "mok-fp8", flops, [=] { mok::gemm::weight_grad_fp8(wgrad8); }});
      for (size_t v = 0; v < std::size(fp8_variants); ++v) {
        const char* impl = fp8_variants[v].impl;
        const auto up = gu8v[v];
        const auto dn = down8v[v];
        const auto dg = dgrad8v[v], dgs = dgrad8v_swiglu[v];
        items.push_back({"gemm1", impl, 2 * flops, [=] { mok::gemm::gate_up_forward_fp8(up); }});
        items.push_back({"gemm2", impl, flops, [=] { mok::gemm::rows_times_weight_t_fp8(dn); }});
        items.push_back({"dgrad", impl, flops, [=] { mok::gemm::rows_times_weight_fp8(dg); }});
        items.push_back(
            {"dgrad-swiglu", impl, flops, [=] { mok::gemm::rows_times_weight_fp8(dgs); }});
        if (fp8_variants[v].overlap) {  // K-grouped: overlap only
          items.push_back({"wgrad", impl, flops, [=] { mok::gemm::weight_grad_fp8(wgrad8o); }});
        }
      }
      items.push_back(
          {"wgrad", "mok-fp8-staged", flops, [=] { mok::gemm::weight_grad_fp8(wgrad8s); }});
      items.push_back({"wgrad", "mok-fp8-overlap-staged", flops,
                       [=] { mok::gemm::weight_grad_fp8(wgrad8os); }});
      items.push_back({"dgrad-swiglu", "mok-fp8-quantized", flops,
                       [=] { mok::gemm::rows_times_weight_fp8(dgrad8_q); }});
      items.push_back({"dgrad-swiglu", "mok-fp8-wide-rows", flops,
                       [=] { mok::gemm::rows_times_weight_fp8(dgrad8_rows); }});
      items.push_back({"dgrad-swiglu", "mok-fp8-wide-passes", flops, dgrad_then_passes});
      items.push_back({"dgrad-swiglu", "mok-fp8-rows", flops,
                       [=] { mok::gemm::rows_times_weight_fp8(dgrad8_rows_plain); }});
      // NOTES: a warm-up round over every item before the measured ones. Without it the first item
      // of a kind measured 1-8% slower than the same kernel on the same data measured again after
      // the others (v4: wgrad automatic vs "mok-repeat", docs/perf/NOTES.md).
      std::erase_if(items, [&](const Item& it) {
        const bool variant = it.impl.rfind("mok-fp8-", 0) == 0;  // a mainloop variant
        return (impls.empty() && variant) ||                     // only when named
               (!passes.empty() &&
                passes.find(std::string(",") + it.pass + ",") == std::string::npos) ||
               (!impls.empty() && impls.find("," + it.impl + ",") == std::string::npos);
      });
      for (const Item& it : items) time_median_ms(it.fn, flush, flush_bytes, 5);
      std::vector<std::vector<double>> round_ms(items.size());
      std::vector<std::vector<ClockSampler::Window>> windows(items.size());
      for (int r = 0; r < rounds; ++r) {
        for (std::size_t i = 0; i < items.size(); ++i) {
          const double t0 = clocks.now();
          round_ms[i].push_back(time_median_ms(items[i].fn, flush, flush_bytes, reps));
          windows[i].push_back({t0, clocks.now()});
        }
      }
      for (std::size_t i = 0; i < items.size(); ++i) {
        const Item& it = items[i];
        std::vector<double> v = round_ms[i];
        std::sort(v.begin(), v.end());
        const double ms = v[v.size() / 2];
        const double tf = it.flops / (ms * 1e-3) / 1e12;
        // The SM clock over the item's timed rounds (flushes included: 256 MB of memset, about
        // 2-5% of a round's time at these shapes).
        const std::optional<ClockSampler::Summary> clk = clocks.over(windows[i]);
        char clk_text[64] = "", clk_json[96] = "";
        if (clk) {
          std::snprintf(clk_text, sizeof(clk_text), "  %.0f MHz", clk->sm_mhz_median);
          std::snprintf(clk_json, sizeof(clk_json), ", \"sm_mhz\": %.0f, \"clock_samples\": %d",
                        clk->sm_mhz_median, clk->samples);
        }
        std::printf("%-14s %-8s %-15s %-24s %10.4f %9.1f %9.2e  [%.4f, %.4f]%s\n", c.name,
                    routing, it.pass, it.impl.c_str(), ms, tf, err, v.front(), v.back(), clk_text);
        std::fprintf(
            json,
            "{\"suite\": \"gemm\", \"case\": \"%s\", \"routing\": \"%s\", \"pass\": \"%s\", "
            "\"impl\": \"%s\", \"median_ms\": %.5f, \"tflops\": %.2f, \"rel_err\": %.3e, "
            "\"rows\": %lld, \"rounds\": %d, \"round_min_ms\": %.5f, \"round_max_ms\": %.5f%s}\n",
            c.name, routing, it.pass, it.impl.c_str(), ms, tf, err, rows, rounds, v.front(),
            v.back(), clk_json);
        std::fflush(json);
      }
      for (void* p :
           {(void*)x,        (void*)w13,     (void*)wg,      (void*)wu,     (void*)wd,
            (void*)hid,      (void*)dy,      (void*)out_h,   (void*)out_gu, (void*)out_y,
            (void*)out_dh,   (void*)out_dw,  (void*)sg,      (void*)su,     (void*)out_dg,
            (void*)out_du,   (void*)out_wh,  (void*)out_dot, (void*)row_w,  (void*)d_starts,
            (void*)d_counts, (void*)tickets, (void*)x8,      (void*)hid8,   (void*)wg8,
            (void*)wu8,      (void*)wd8,     (void*)x8s,     (void*)hid8s,  (void*)wg8s,
            (void*)wu8s,     (void*)wd8s,    (void*)out_g8,  (void*)out_u8, (void*)dy8,
            (void*)dy8s,     (void*)wdt8,    (void*)wdt8s,   (void*)dy8t,   (void*)hid8t,
            (void*)dy8ts,    (void*)hid8ts}) {
        cudaFree(p);
      }
      for (int t = 0; t < 2; ++t) {
        for (void* p :
             {(void*)q_rows[t], (void*)q_tokens[t], (void*)q_rows_s[t], (void*)q_tokens_s[t]}) {
          cudaFree(p);
        }
      }
    }
  }
  std::fclose(json);
  return 0;
}
