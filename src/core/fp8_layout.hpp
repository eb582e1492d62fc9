// Where each FP8 scale lives: the layouts of mok's block-scaled tensors and of MoK's MX scales,
// one definition for the host reference, the CUDA kernels and the GEMM forms that read them.
//
// mok's forms (data e4m3 bytes row-major, scales fp32 powers of two; core/fp8.hpp has the maths):
//   activation rows, 1x128 along K      x [M, K]  ->  data [M, K],  scales [K/128, M]
//                                        block (m, kb) = x[m, kb*128 .. kb*128+127]
//   token-axis form, 128x1 blocks        x [M, K]  ->  data [K, M] (the transpose),
//     (1x128 along M of the transpose)               scales [M/128, K]
//                                        block (mb, k) = x[mb*128 .. mb*128+127, k]
//   weights, 128x128 blocks, both        w [E, N, K] -> data [E, N, K], scales [E, N/128, K/128]
//     orientations from the same blocks              data_t [E, K, N], scales_t [E, K/128, N/128]
//                                        data_t[e, k, n] = data[e, n, k] (the same bytes)
// Scales are k-block-major for the row form (scale[kb * M + m]) so the GEMM's producer reads the
// scales of one K block of consecutive rows contiguously.
//
// MoK's MX form (mxfp8_quantize): x [E, M, N] bf16 (E = 1 for 2-D) -> data [E, M, N] e4m3 with an
// E8M0 byte per 1x32 block along N, in the tcgen05 scale-factor layout uint8 [E*M/128, N/128,
// 32, 16]: for flattened row r = e*M + m and 32-block j = n / 32,
//   tile (r / 128, j / 4), inside it [r % 32][(r % 128) / 32 * 4 + j % 4]
// The transposed output is the same of x^T per expert: data_t [E, N, M], scales [E*N/128, M/128,
// 32, 16].
#pragma once

#include <cstdint>

#include "core/numerics.hpp"  // MOK_HOST_DEVICE

namespace mok::fp8 {

// Row form: the scale of row m, K block kb (M rows in all).
MOK_HOST_DEVICE constexpr std::int64_t row_scale_index(std::int64_t m, std::int64_t kb,
                                                       std::int64_t M) {
  return kb * M + m;
}

// Token-axis form: the scale of column k, row block mb (K columns in all).
MOK_HOST_DEVICE constexpr std::int64_t token_scale_index(std::int64_t mb, std::int64_t k,
                                                         std::int64_t K) {
  return mb * K + k;
}

// Weights: the scale of expert e, block (nb, kb) of an [E, N, K] tensor (the transposed copy is
// the same with (kb, nb) and (K, N)).
MOK_HOST_DEVICE constexpr std::int64_t weight_scale_index(std::int64_t e, std::int64_t nb,
                                                          std::int64_t kb, std::int64_t N,
                                                          std::int64_t K) {
  return (e * (N / 128) + nb) * (K / 128) + kb;
}

// MX: the byte of flattened row r (expert * rows + row), 32-block j, of a tensor of `cols`
// columns (a multiple of 128).
MOK_HOST_DEVICE constexpr std::int64_t mx_scale_index(std::int64_t r, std::int64_t j,
                                                      std::int64_t cols) {
  return (((r / 128) * (cols / 128) + j / 4) * 32 + r % 32) * 16 + (r % 128) / 32 * 4 + j % 4;
}

}  // namespace mok::fp8
