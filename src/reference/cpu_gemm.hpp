// The CPU reference's one matrix kernel: C (+)= A * B with strided operands, blocked for cache.
//
// NOTES: every C element is accumulated by exactly one task, over k in increasing order, with a
// plain multiply then add (the reference is built with -ffp-contract=off). Task boundaries depend
// only on the shapes, so the result is bitwise independent of the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/thread_pool.hpp"

namespace mok::reference {

// A(m, k) = a[m * a_m + k * a_k];  B(k, n) = b[k * b_k + n * b_n];  C(m, n) = c[m * ldc + n].
template <typename Real>
struct GemmArgs {
  std::int64_t M, N, K;
  const Real* a;
  std::int64_t a_m, a_k;
  const Real* b;
  std::int64_t b_k, b_n;
  Real* c;
  std::int64_t ldc;
  bool accumulate = false;  // C += A*B instead of C = A*B
};

// acc[m][0..kTileN) += sum over kk of A(m, k0 + kk) * packed[kk][0..kTileN), kk increasing.
inline constexpr std::int64_t kTileM = 64, kTileN = 64, kTileK = 256;

template <typename Real>
struct TileKernel {
  static void run(Real (*acc)[kTileN], const GemmArgs<Real>& g, std::int64_t m0, std::int64_t mt,
                  std::int64_t k0, std::int64_t kt, const Real* packed) {
    for (std::int64_t m = 0; m < mt; ++m) {
      Real* row = acc[m];
      const Real* a_row = g.a + (m0 + m) * g.a_m + k0 * g.a_k;
      for (std::int64_t kk = 0; kk < kt; ++kk) {
        const Real a = a_row[kk * g.a_k];
        const Real* bk = packed + kk * kTileN;
        for (std::int64_t n = 0; n < kTileN; ++n) row[n] += a * bk[n];
      }
    }
  }
};

#if defined(__GNUC__) && defined(__x86_64__)
// NOTES: the same loop compiled for AVX2 (wider vectors, still a separate multiply and add per
// element, no FMA), so its results are bitwise those of the baseline path; picked at run time.
template <typename Real>
__attribute__((target("avx2"))) void tile_kernel_avx2(Real (*acc)[kTileN], const GemmArgs<Real>& g,
                                                      std::int64_t m0, std::int64_t mt,
                                                      std::int64_t k0, std::int64_t kt,
                                                      const Real* packed) {
  for (std::int64_t m = 0; m < mt; ++m) {
    Real* row = acc[m];
    const Real* a_row = g.a + (m0 + m) * g.a_m + k0 * g.a_k;
    for (std::int64_t kk = 0; kk < kt; ++kk) {
      const Real a = a_row[kk * g.a_k];
      const Real* bk = packed + kk * kTileN;
      for (std::int64_t n = 0; n < kTileN; ++n) row[n] += a * bk[n];
    }
  }
}
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

template <typename Real>
void gemm(ThreadPool& pool, const GemmArgs<Real>& g) {
  if (g.M <= 0 || g.N <= 0) return;
  const std::int64_t tiles_m = (g.M + kTileM - 1) / kTileM;
  const std::int64_t tiles_n = (g.N + kTileN - 1) / kTileN;
  pool.run(tiles_m * tiles_n, [&](std::int64_t tile) {
    const std::int64_t m0 = (tile / tiles_n) * kTileM, n0 = (tile % tiles_n) * kTileN;
    const std::int64_t mt = std::min(kTileM, g.M - m0), nt = std::min(kTileN, g.N - n0);
    alignas(64) Real acc[kTileM][kTileN];
    std::vector<Real> packed(static_cast<std::size_t>(kTileK * kTileN));
    for (std::int64_t m = 0; m < mt; ++m) {
      for (std::int64_t n = 0; n < kTileN; ++n) {
        acc[m][n] = (g.accumulate && n < nt) ? g.c[(m0 + m) * g.ldc + n0 + n] : Real(0);
      }
    }
    for (std::int64_t k0 = 0; k0 < g.K; k0 += kTileK) {
      const std::int64_t kt = std::min(kTileK, g.K - k0);
      // B tile, packed k-major so the inner loop runs over contiguous n.
      for (std::int64_t kk = 0; kk < kt; ++kk) {
        Real* dst = &packed[kk * kTileN];
        const Real* src = g.b + (k0 + kk) * g.b_k + n0 * g.b_n;
        for (std::int64_t n = 0; n < nt; ++n) dst[n] = src[n * g.b_n];
        for (std::int64_t n = nt; n < kTileN; ++n) dst[n] = Real(0);
      }
#if defined(__GNUC__) && defined(__x86_64__)
      if (cpu_has_avx2()) {
        tile_kernel_avx2<Real>(acc, g, m0, mt, k0, kt, packed.data());
        continue;
      }
#endif
      TileKernel<Real>::run(acc, g, m0, mt, k0, kt, packed.data());
    }
    for (std::int64_t m = 0; m < mt; ++m) {
      std::copy(acc[m], acc[m] + nt, g.c + (m0 + m) * g.ldc + n0);
    }
  });
}

// One expert's three weight gradients over its `rows` rows, reduced over the rows in order:
// d_down [H, N] = dy^T h, d_gate [N, H] = dg^T xr, d_up [N, H] = du^T xr (dy, xr [rows, H]; h,
// dg, du [rows, N]). The bf16 layer's, and the FP8 layer's with BackwardOptions::fp8_weight_grads
// false.
template <typename Real>
void weight_grad_products(ThreadPool& pool, std::int64_t rows, std::int64_t H, std::int64_t N,
                          const Real* dy, const Real* h, const Real* dg, const Real* du,
                          const Real* xr, Real* d_down, Real* d_gate, Real* d_up) {
  gemm<Real>(pool, {H, N, rows, dy, 1, H, h, N, 1, d_down, N});
  gemm<Real>(pool, {N, H, rows, dg, 1, N, xr, H, 1, d_gate, H});
  gemm<Real>(pool, {N, H, rows, du, 1, N, xr, H, 1, d_up, H});
}

}  // namespace mok::reference
