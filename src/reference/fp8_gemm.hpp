// The FP8 reference's block-promoted products: what the FP8 GEMM forms compute, exactly, so their
// tests compare against a model of the arithmetic rather than against bf16. Host memory; layouts
// of core/fp8_layout.hpp.
//
// Every product sums, per 128-wide block of the reduction axis, the e4m3 products q_a q_b in
// f64, then scales that partial sum by s_a s_b and adds it to the result, blocks in increasing
// order (wgmma's per-block accumulation and its promotion; docs/architecture.md, "The FP8 layer",
// "What it computes"):
//   C = sum over blocks b (increasing) of (sum over i in b of q_a[i] q_b[i]) * s_a(b) * s_b(b)
// The inner sums are exact in f64 (e4m3 values are multiples of 2^-9 below 2^9: a product
// needs at most 8 significant bits, a sum of 128 of them fewer than 45), so is the scaling
// (powers of two); only the accumulation over blocks rounds, in f64.
#pragma once

#include <cstdint>

#include "core/fp8.hpp"

namespace mok::reference {

// Activation rows times a block-scaled weight (forward and both dgrads):
//   C[m - row_begin, n] = sum_kb (sum_k a[m, k] b[n, k]) * a_scales[kb * M + m] * b_scale(n, kb)
// for rows m in [row_begin, row_end) of a (rows form: data [M, K], scales [K/128, M]) and b one
// expert's [N, K] weight in 128x128 blocks (data [N, K], scales [N/128, K/128]: the normal copy
// for the forward, the transposed copy [K, N] for a dgrad, with N and K named as b's own axes).
// C is [row_end - row_begin, N], row-major. With `accumulate`, C's values are where each
// element's accumulator starts (two products into one accumulator, the gate/up dgrad: the second
// call's blocks continue the first's sum).
struct Fp8Rows {
  const fp8::e4m3_t* data = nullptr;  // [M, K]
  const float* scales = nullptr;      // [K/128, M]
  std::int64_t M = 0, K = 0;
};
struct Fp8BlockMatrix {
  const fp8::e4m3_t* data = nullptr;  // [N, K]
  const float* scales = nullptr;      // [N/128, K/128]
  std::int64_t N = 0, K = 0;
};
void fp8_rows_times_blocks(const Fp8Rows& a, std::int64_t row_begin, std::int64_t row_end,
                           const Fp8BlockMatrix& b, double* c, bool accumulate = false);

// The weight gradient (both operands 1x128 along the token axis):
//   C[i, j] = sum_mb (sum_m a[i, m] b[j, m]) * a_scales[mb * Na + i] * b_scales[mb * Nb + j]
// over the rows m in [row_begin, row_end) (row_begin a multiple of 128, the length too: mok's
// expert segments), a and b in the token-axis form of [M, Na] and [M, Nb] sources (data [Na, M]
// and [Nb, M], scales [M/128, Na] and [M/128, Nb]). C is [Na, Nb], row-major (dW_down = dy^T h:
// a = dy, b = h; dW_gate = dg^T x: a = dg, b = x). With `i_end` >= 0 only C's rows
// [i_begin, i_end) are computed, into c[(i - i_begin) * Nb + j] (one task's share).
struct Fp8TokenAxis {
  const fp8::e4m3_t* data = nullptr;  // [N, M]
  const float* scales = nullptr;      // [M/128, N]
  std::int64_t M = 0, N = 0;
};
void fp8_token_axis_product(const Fp8TokenAxis& a, const Fp8TokenAxis& b, std::int64_t row_begin,
                            std::int64_t row_end, double* c, std::int64_t i_begin = 0,
                            std::int64_t i_end = -1);

}  // namespace mok::reference
