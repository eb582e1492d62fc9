#include "reference/fp8_quant.hpp"

#include <algorithm>
#include <vector>

#include "core/bf16.hpp"
#include "core/fp8_layout.hpp"

namespace mok::reference {
namespace {

using fp8::e4m3_t;

float load(const fp8::ActivationParams& p, std::int64_t i) {
  return p.source == fp8::Source::bf16 ? bf16_to_float(static_cast<const bf16_t*>(p.x)[i])
                                       : static_cast<const float*>(p.x)[i];
}

// Quantizes n values read through `at(i)` as one block: writes q_i through `put(i, q)` and
// returns the block's scale.
template <typename At, typename Put>
float quantize_block(std::int64_t n, At at, Put put) {
  std::uint32_t amax = 0;
  for (std::int64_t i = 0; i < n; ++i) amax = fp8::amax_update(amax, at(i));
  const int e = fp8::scale_exponent(amax);
  const float inv = fp8::inverse_scale_of(e);
  for (std::int64_t i = 0; i < n; ++i) put(i, fp8::quantize_value(at(i), inv));
  return fp8::scale_of(e);
}

// The E8M0 byte of a 32-block (MoK's scale tensors).
std::uint8_t e8m0_byte(float scale) {
  return static_cast<std::uint8_t>(fp8::exponent_of_scale(scale) + fp8::kE8m0Bias);
}

// One orientation of MoK's quantizer: rows [R, C] of x (element (r, c) at x[r * rs + c * cs]),
// 1x32 blocks along C, into data [R, C] and the MX scales of an [R, C] tensor.
void mx_one_orientation(const std::uint16_t* x, std::int64_t R, std::int64_t C, std::int64_t rs,
                        std::int64_t cs, e4m3_t* data, std::uint8_t* scales) {
  for (std::int64_t r = 0; r < R; ++r) {
    for (std::int64_t j = 0; j < C / fp8::kMxBlock; ++j) {
      const std::int64_t c0 = j * fp8::kMxBlock;
      const float s = quantize_block(
          fp8::kMxBlock, [&](std::int64_t i) { return bf16_to_float(x[r * rs + (c0 + i) * cs]); },
          [&](std::int64_t i, e4m3_t q) { data[r * C + c0 + i] = q; });
      scales[fp8::mx_scale_index(r, j, C)] = e8m0_byte(s);
    }
  }
}

// Writes block (nb, kb) of expert e's quantized weight in both orientations from `q` (the
// block's bytes, [128][128] row-major along K) and its scale.
void store_weight_block(const fp8::BlockWeights& out, std::int64_t e, std::int64_t nb,
                        std::int64_t kb, std::int64_t N, std::int64_t K, const e4m3_t* q,
                        float scale) {
  constexpr std::int64_t B = fp8::kBlock;
  for (std::int64_t i = 0; i < B; ++i) {
    for (std::int64_t j = 0; j < B; ++j) {
      const std::int64_t n = nb * B + i, k = kb * B + j;
      out.data[(e * N + n) * K + k] = q[i * B + j];
      out.data_t[(e * K + k) * N + n] = q[i * B + j];
    }
  }
  out.scales[fp8::weight_scale_index(e, nb, kb, N, K)] = scale;
  out.scales_t[fp8::weight_scale_index(e, kb, nb, K, N)] = scale;
}

}  // namespace

void quantize_rows_fp8(const fp8::ActivationParams& p) {
  for (std::int64_t m = 0; m < p.M; ++m) {
    for (std::int64_t kb = 0; kb < p.K / fp8::kBlock; ++kb) {
      const std::int64_t k0 = kb * fp8::kBlock;
      p.scales[fp8::row_scale_index(m, kb, p.M)] = quantize_block(
          fp8::kBlock, [&](std::int64_t i) { return load(p, m * p.K + k0 + i); },
          [&](std::int64_t i, e4m3_t q) { p.data[m * p.K + k0 + i] = q; });
    }
  }
}

void quantize_token_axis_fp8(const fp8::ActivationParams& p) {
  for (std::int64_t mb = 0; mb < p.M / fp8::kBlock; ++mb) {
    const std::int64_t m0 = mb * fp8::kBlock;
    for (std::int64_t k = 0; k < p.K; ++k) {
      p.scales[fp8::token_scale_index(mb, k, p.K)] = quantize_block(
          fp8::kBlock, [&](std::int64_t i) { return load(p, (m0 + i) * p.K + k); },
          [&](std::int64_t i, e4m3_t q) { p.data[k * p.M + m0 + i] = q; });
    }
  }
}

void quantize_weights_fp8(const fp8::WeightParams& p) {
  constexpr std::int64_t B = fp8::kBlock;
  std::vector<e4m3_t> q(B * B);
  for (std::int64_t e = 0; e < p.E; ++e) {
    for (std::int64_t nb = 0; nb < p.N / B; ++nb) {
      for (std::int64_t kb = 0; kb < p.K / B; ++kb) {
        const std::uint16_t* w = p.w + (e * p.N + nb * B) * p.K + kb * B;
        const float s = quantize_block(
            B * B, [&](std::int64_t i) { return bf16_to_float(w[(i / B) * p.K + i % B]); },
            [&](std::int64_t i, e4m3_t v) { q[i] = v; });
        store_weight_block(p.out, e, nb, kb, p.N, p.K, q.data(), s);
      }
    }
  }
}

void mxfp8_quantize(const fp8::MxParams& p) {
  for (std::int64_t e = 0; e < p.E; ++e) {
    const std::uint16_t* x = p.x + e * p.M * p.N;
    // Flattened rows: expert e's rows are rows e*M .. e*M + M - 1 of the scale layout.
    if (p.data != nullptr) {
      mx_one_orientation(x, p.M, p.N, p.N, 1, p.data + e * p.M * p.N,
                         p.scales + e * (p.M / fp8::kBlock) * (p.N / fp8::kBlock) * 512);
    }
    if (p.data_t != nullptr) {
      mx_one_orientation(x, p.N, p.M, 1, p.N, p.data_t + e * p.M * p.N,
                         p.scales_t + e * (p.N / fp8::kBlock) * (p.M / fp8::kBlock) * 512);
    }
  }
}

std::int64_t mx_weights_to_blocks(const fp8::MxToBlocksParams& p) {
  constexpr std::int64_t B = fp8::kBlock;
  std::vector<e4m3_t> q(B * B);
  std::int64_t inexact = 0;
  for (std::int64_t e = 0; e < p.E; ++e) {
    for (std::int64_t nb = 0; nb < p.N / B; ++nb) {
      for (std::int64_t kb = 0; kb < p.K / B; ++kb) {
        const std::int64_t row0 = e * p.N + nb * B;  // flattened row of the MX scale layout
        auto byte = [&](std::int64_t i, std::int64_t jj) {
          return p.scales[fp8::mx_scale_index(row0 + i, kb * 4 + jj, p.K)];
        };
        int max_byte = -1;
        for (std::int64_t i = 0; i < B; ++i) {
          for (std::int64_t jj = 0; jj < 4; ++jj)
            max_byte = fp8::mx_max_byte(max_byte, byte(i, jj));
        }
        const int eb = fp8::mx_block_exponent(max_byte);
        for (std::int64_t i = 0; i < B; ++i) {
          for (std::int64_t j = 0; j < B; ++j) {
            const fp8::Rebased r =
                fp8::mx_rebase(p.data[(row0 + i) * p.K + kb * B + j], byte(i, j / 32), eb);
            q[i * B + j] = r.q;
            inexact += r.exact ? 0 : 1;
          }
        }
        store_weight_block(p.out, e, nb, kb, p.N, p.K, q.data(), fp8::scale_of(eb));
      }
    }
  }
  if (p.inexact != nullptr) *p.inexact = inexact;
  return inexact;
}

}  // namespace mok::reference
