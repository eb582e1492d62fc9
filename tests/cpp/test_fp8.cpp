// mok's FP8 on the host (core/fp8.hpp, src/reference/fp8_quant.cpp, fp8_gemm.cpp): the scalar
// maths against independent oracles (search over e4m3's values; the scale by search) and against
// MoK's kernel expression for the scale; every quantizer form element by element on sources that
// cover random, wide-range, tiny, all-zero, saturating and non-finite blocks; the round-trip
// bound; the transposed weight copy; MoK's MX layout; the MX-to-block conversion and its counted
// loss; the block-promoted products against exact sums. GPU == CPU: test_fp8_gpu.cu.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/fp8.hpp"
#include "core/fp8_layout.hpp"
#include "core/fp8_params.hpp"
#include "fp8_test_helpers.hpp"
#include "mok/error.hpp"
#include "mok/fp8.hpp"
#include "mok/problem.hpp"
#include "reference/fp8_gemm.hpp"
#include "reference/fp8_quant.hpp"
#include "test_seed.hpp"

namespace mok::test {
namespace {

using namespace fp8_cases;
using fp8::e4m3_t;

std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// MoK's kernel, as written there: max(amax * (1/448 as a float literal), 1e-12), rounded up to a
// power of two with saturation (cvt.rp.satfinite.ue8m0x2.f32; an infinite input saturates to
// 2^127). Returns the exponent.
int mok_kernel_exponent(float amax) {
  const float f = std::fmax(amax * 0.002232142857f, 1e-12f);
  const std::uint32_t b = bits_of(f);
  int byte = static_cast<int>(b >> 23) + ((b & 0x7fffffu) != 0 ? 1 : 0);
  if (byte > 254) byte = 254;
  return byte - 127;
}

TEST(Fp8Scalar, ScaleExponentIsMokKernelRuleOnEveryBf16) {
  for (std::uint32_t u = 0; u <= 0x7f80u; ++u) {  // every non-negative bf16 up to +inf
    const float a = bf16_to_float(static_cast<bf16_t>(u));
    ASSERT_EQ(fp8::scale_exponent(bits_of(a)), mok_kernel_exponent(a)) << "amax " << a;
    ASSERT_EQ(fp8::scale_exponent(bits_of(a)), scale_exponent_oracle(&a, 1)) << "amax " << a;
  }
}

TEST(Fp8Scalar, ScaleExponentIsMokKernelRuleAroundEveryPowerOfTwoInFp32) {
  std::mt19937_64 rng(next_seed());
  std::uniform_int_distribution<std::uint32_t> mantissa(0, 0x7fffff);
  for (std::uint32_t biased = 0; biased < 255; ++biased) {
    std::vector<std::uint32_t> ms = {0,        1,        2,        0x5ffffe, 0x5fffff,
                                     0x600000, 0x600001, 0x600002, 0x7ffffe, 0x7fffff};
    for (int i = 0; i < 64; ++i) ms.push_back(mantissa(rng));
    for (std::uint32_t m : ms) {
      const std::uint32_t b = (biased << 23) | m;
      const float a = bits_to_float(b);
      ASSERT_EQ(fp8::scale_exponent(b), mok_kernel_exponent(a)) << "amax bits " << std::hex << b;
      ASSERT_EQ(fp8::scale_exponent(b), scale_exponent_oracle(&a, 1)) << "amax " << a;
    }
  }
  EXPECT_EQ(fp8::scale_exponent(bits_of(std::numeric_limits<float>::infinity())), 127);
  EXPECT_EQ(fp8::scale_exponent(0), fp8::kMinScaleExponent);
}

TEST(Fp8Scalar, ScalesAndInversesArePowersOfTwo) {
  for (int e = fp8::kMinScaleExponent; e <= fp8::kMaxScaleExponent; ++e) {
    EXPECT_EQ(fp8::scale_of(e), std::ldexp(1.0f, e));
    EXPECT_EQ(fp8::exponent_of_scale(fp8::scale_of(e)), e);
    EXPECT_EQ(fp8::inverse_scale_of(e), e == 127 ? 0.0f : std::ldexp(1.0f, -e)) << e;
  }
}

TEST(Fp8Scalar, E4m3DecodeMatchesTheOracle) {
  for (int q = 0; q < 256; ++q) {
    const double want = e4m3_value(static_cast<std::uint8_t>(q));
    const float got = fp8::e4m3_to_float(static_cast<e4m3_t>(q));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << q;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << q;
      EXPECT_EQ(std::signbit(got), (q & 0x80) != 0) << q;
    }
  }
}

void expect_e4m3(float v) {
  ASSERT_EQ(fp8::e4m3_from_float_exact(v), e4m3_oracle(v))
      << "v = " << v << " (bits " << std::hex << bits_of(v) << ")";
}

TEST(Fp8Scalar, E4m3EncodeMatchesTheOracleOnFloatsAcrossTheRange) {
  // A sweep of all float bit patterns (both signs, NaNs included) with a stride that visits
  // every exponent and many mantissas...
  for (std::uint64_t b = 0; b <= 0xffffffffull; b += 4099) {
    expect_e4m3(bits_to_float(static_cast<std::uint32_t>(b)));
  }
  // ...and every e4m3 value, every midpoint between neighbours (the ties), and the floats
  // around both.
  for (int c = 0; c < 127; ++c) {
    const double lo = e4m3_value(static_cast<std::uint8_t>(c));
    const double hi = c < 126 ? e4m3_value(static_cast<std::uint8_t>(c + 1)) : 480.0;
    for (double t : {lo, (lo + hi) / 2}) {
      float f = static_cast<float>(t);
      for (int i = 0; i < 4; ++i) f = std::nextafter(f, 0.0f);
      for (int i = 0; i < 9; ++i, f = std::nextafter(f, 1e30f)) {
        expect_e4m3(f);
        expect_e4m3(-f);
      }
    }
  }
  for (float f : {464.0f, 465.0f, 1e30f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                  std::ldexp(1.0f, -10), std::ldexp(1.0f, -11), std::ldexp(3.0f, -11), 0.0f}) {
    expect_e4m3(f);
    expect_e4m3(-f);
  }
  EXPECT_EQ(fp8::e4m3_from_float_exact(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(fp8::e4m3_from_float_exact(-0.0f), 0x80);
}

// ---- the quantizer forms ----

// Checks one quantized block: its scale is the oracle's, each byte is the oracle's, and the
// dequantized value is within half an e4m3 ulp of x: |x - q s| <= max(2^-4 |x|, 2^-10 s).
void check_block(const float* x, std::int64_t n, std::int64_t x_stride, const e4m3_t* q,
                 std::int64_t q_stride, float scale, const char* what) {
  const int e = scale_exponent_oracle(x, n, x_stride);
  ASSERT_EQ(scale, std::ldexp(1.0f, e)) << what;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x[i * x_stride];
    const e4m3_t got = q[i * q_stride];
    ASSERT_EQ(got, quantized_oracle(v, e)) << what << ": element " << i << " = " << v;
    if (e == 127 || std::isnan(v)) continue;  // a block with an infinity keeps no values
    const double back = e4m3_value(got) * scale;
    const double bound = std::max(std::ldexp(std::fabs(v), -4), std::ldexp(scale, -10));
    ASSERT_LE(std::fabs(back - v), bound) << what << ": element " << i << " = " << v;
  }
}

class Fp8Forms : public ::testing::TestWithParam<bool> {};  // the source is bf16 (else fp32)

TEST_P(Fp8Forms, RowsFormMatchesTheOracles) {
  const bool bf16 = GetParam();
  std::mt19937_64 rng(next_seed());
  const std::int64_t M = 29, K = 384;
  const std::vector<float> x = make_source(M, K, 1, 128, bf16, rng);
  const std::vector<bf16_t> xb = to_bf16(x);
  std::vector<e4m3_t> data(M * K, 0xAB);
  std::vector<float> scales(K / 128 * M, std::numeric_limits<float>::quiet_NaN());
  reference::quantize_rows_fp8({bf16 ? static_cast<const void*>(xb.data()) : x.data(),
                                bf16 ? fp8::Source::bf16 : fp8::Source::f32, M, K, data.data(),
                                scales.data()});
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t kb = 0; kb < K / 128; ++kb) {
      check_block(&x[m * K + kb * 128], 128, 1, &data[m * K + kb * 128], 1,
                  scales[fp8::row_scale_index(m, kb, M)], "rows form");
    }
  }
}

TEST_P(Fp8Forms, TokenAxisFormMatchesTheOraclesAndIsTheRowsFormOfTheTranspose) {
  const bool bf16 = GetParam();
  std::mt19937_64 rng(next_seed());
  const std::int64_t M = 384, K = 77;  // K needs no alignment in this form
  const std::vector<float> x = make_source(M, K, 128, 1, bf16, rng);
  const std::vector<bf16_t> xb = to_bf16(x);
  const void* src = bf16 ? static_cast<const void*>(xb.data()) : x.data();
  const fp8::Source source = bf16 ? fp8::Source::bf16 : fp8::Source::f32;
  std::vector<e4m3_t> data(K * M, 0xAB);
  std::vector<float> scales(M / 128 * K, std::numeric_limits<float>::quiet_NaN());
  reference::quantize_token_axis_fp8({src, source, M, K, data.data(), scales.data()});
  for (std::int64_t mb = 0; mb < M / 128; ++mb) {
    for (std::int64_t k = 0; k < K; ++k) {
      check_block(&x[mb * 128 * K + k], 128, K, &data[k * M + mb * 128], 1,
                  scales[fp8::token_scale_index(mb, k, K)], "token-axis form");
    }
  }
  // The rows form of x^T [K, M] has the token-axis layout (data [K, M], scales [M/128, K]).
  std::vector<float> xt(K * M);
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t k = 0; k < K; ++k) xt[k * M + m] = x[m * K + k];
  }
  std::vector<e4m3_t> data_rows(K * M, 0xCD);
  std::vector<float> scales_rows(M / 128 * K, 0.0f);
  reference::quantize_rows_fp8(
      {xt.data(), fp8::Source::f32, K, M, data_rows.data(), scales_rows.data()});
  EXPECT_EQ(data_rows, data);
  for (std::size_t i = 0; i < scales.size(); ++i) ASSERT_EQ(scales_rows[i], scales[i]) << i;
}

INSTANTIATE_TEST_SUITE_P(Source, Fp8Forms, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "bf16" : "fp32"; });

TEST(Fp8Weights, BothOrientationsFromTheSameBlocks) {
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 3, N = 256, K = 384;
  const std::vector<float> w = make_experts(E, N, K, 128, 128, true, rng);
  const std::vector<bf16_t> wb = to_bf16(w);
  std::vector<e4m3_t> data(E * N * K, 0xAB), data_t(E * N * K, 0xCD);
  std::vector<float> scales(E * N * K / 16384, -1.0f), scales_t(E * N * K / 16384, -2.0f);
  reference::quantize_weights_fp8(
      {wb.data(), E, N, K, {data.data(), scales.data(), data_t.data(), scales_t.data()}});
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t nb = 0; nb < N / 128; ++nb) {
      for (std::int64_t kb = 0; kb < K / 128; ++kb) {
        const float s = scales[fp8::weight_scale_index(e, nb, kb, N, K)];
        ASSERT_EQ(scales_t[fp8::weight_scale_index(e, kb, nb, K, N)], s);
        // The block, row by row, against the oracles (its scale from all 128 x 128 values).
        const float* wblock = &w[(e * N + nb * 128) * K + kb * 128];
        std::vector<float> flat(128 * 128);
        std::vector<e4m3_t> qflat(128 * 128);
        for (int i = 0; i < 128; ++i) {
          for (int j = 0; j < 128; ++j) {
            flat[i * 128 + j] = wblock[i * K + j];
            qflat[i * 128 + j] = data[(e * N + nb * 128 + i) * K + kb * 128 + j];
          }
        }
        check_block(flat.data(), 128 * 128, 1, qflat.data(), 1, s, "weight block");
      }
    }
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t k = 0; k < K; ++k) {
        ASSERT_EQ(data_t[(e * K + k) * N + n], data[(e * N + n) * K + k])
            << e << " " << n << " " << k;
      }
    }
  }
}

// ---- MoK's MX quantizer ----

// MoK's scale layout written out as its reference builds it (tests/utils.py: the bytes [R, C/32]
// reshaped [R/128, 128, C/128, 4], dims 1 and 2 swapped, [.., 4, 32, 4] with the 4 and 32
// swapped): byte (r, j) lands at [r / 128][j / 4][r % 32][(r % 128) / 32][j % 4].
std::int64_t mok_reference_scale_offset(std::int64_t r, std::int64_t j, std::int64_t C) {
  const std::int64_t a = r / 128, rb = (r % 128) / 32, r32 = r % 32, b = j / 4, kk = j % 4;
  return (((a * (C / 128) + b) * 32 + r32) * 4 + rb) * 4 + kk;
}

struct MxOut {
  std::vector<e4m3_t> data, data_t;
  std::vector<std::uint8_t> sc, sc_t;
};

MxOut run_mx(const std::vector<bf16_t>& xb, std::int64_t E, std::int64_t M, std::int64_t N,
             bool normal, bool transposed) {
  MxOut o{std::vector<e4m3_t>(E * M * N, 0xAB), std::vector<e4m3_t>(E * M * N, 0xAB),
          std::vector<std::uint8_t>(E * M * N / 32, 0xEE),
          std::vector<std::uint8_t>(E * M * N / 32, 0xEE)};
  reference::mxfp8_quantize({xb.data(), E, M, N, normal ? o.data.data() : nullptr,
                             normal ? o.sc.data() : nullptr, transposed ? o.data_t.data() : nullptr,
                             transposed ? o.sc_t.data() : nullptr});
  return o;
}

// One orientation: rows [R, C] of x (x[r * rs + c * cs] per expert) against the oracles.
void check_mx(const std::vector<float>& x, std::int64_t E, std::int64_t R, std::int64_t C,
              std::int64_t rs, std::int64_t cs, const std::vector<e4m3_t>& data,
              const std::vector<std::uint8_t>& sc) {
  for (std::int64_t e = 0; e < E; ++e) {
    const float* xe = &x[e * R * C];
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t j = 0; j < C / 32; ++j) {
        std::vector<float> block(32);
        for (int i = 0; i < 32; ++i) block[i] = xe[r * rs + (j * 32 + i) * cs];
        const std::uint8_t byte = sc[mok_reference_scale_offset(e * R + r, j, C)];
        check_block(block.data(), 32, 1, &data[(e * R + r) * C + j * 32], 1,
                    std::ldexp(1.0f, byte - 127), "MX block");
      }
    }
  }
}

TEST(Fp8Mx, QuantizeMatchesTheOraclesInMokLayout) {
  std::mt19937_64 rng(next_seed());
  for (const auto [E, M, N] : {std::array<std::int64_t, 3>{1, 256, 384}, {3, 128, 256}}) {
    std::vector<float> x;
    for (std::int64_t e = 0; e < E; ++e) {
      // Blocks of 32 x 32 cycle the kinds: every 1x32 block of both orientations lies in one.
      const std::vector<float> xe = make_source(M, N, 32, 32, true, rng);
      x.insert(x.end(), xe.begin(), xe.end());
    }
    const std::vector<bf16_t> xb = to_bf16(x);
    const MxOut both = run_mx(xb, E, M, N, true, true);
    check_mx(x, E, M, N, N, 1, both.data, both.sc);
    check_mx(x, E, N, M, 1, N, both.data_t, both.sc_t);
    // One orientation alone: the same bytes, the other outputs untouched.
    const MxOut normal = run_mx(xb, E, M, N, true, false);
    const MxOut transposed = run_mx(xb, E, M, N, false, true);
    EXPECT_EQ(normal.data, both.data);
    EXPECT_EQ(normal.sc, both.sc);
    EXPECT_EQ(transposed.data_t, both.data_t);
    EXPECT_EQ(transposed.sc_t, both.sc_t);
    EXPECT_EQ(normal.data_t, std::vector<e4m3_t>(E * M * N, 0xAB));
    EXPECT_EQ(transposed.sc, std::vector<std::uint8_t>(E * M * N / 32, 0xEE));
  }
}

// ---- MX -> 128x128 blocks ----

struct Converted {
  std::vector<e4m3_t> data, data_t;
  std::vector<float> scales, scales_t;
  std::int64_t inexact = -1;
};

Converted convert(const std::vector<e4m3_t>& q, const std::vector<std::uint8_t>& sc, std::int64_t E,
                  std::int64_t N, std::int64_t K) {
  Converted c{std::vector<e4m3_t>(E * N * K, 0xAB), std::vector<e4m3_t>(E * N * K, 0xAB),
              std::vector<float>(E * N * K / 16384, -1.0f),
              std::vector<float>(E * N * K / 16384, -1.0f)};
  const std::int64_t got = reference::mx_weights_to_blocks(
      {q.data(),
       sc.data(),
       E,
       N,
       K,
       {c.data.data(), c.scales.data(), c.data_t.data(), c.scales_t.data()},
       &c.inexact});
  EXPECT_EQ(got, c.inexact);
  return c;
}

// Checks a conversion value by value: the block scale is 2^(largest sub-block exponent) (within
// mok's range), each value equals the MX value or is within half a subnormal step of the block
// scale (2^-10 s) of it, the inexact count is the number that changed, and the transposed copy
// holds the same bytes. Returns that count.
std::int64_t check_conversion(const std::vector<e4m3_t>& q, const std::vector<std::uint8_t>& sc,
                              std::int64_t E, std::int64_t N, std::int64_t K, const Converted& c) {
  std::int64_t changed = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t nb = 0; nb < N / 128; ++nb) {
      for (std::int64_t kb = 0; kb < K / 128; ++kb) {
        int emax = -1000;
        for (int i = 0; i < 128; ++i) {
          for (int jj = 0; jj < 4; ++jj) {
            const std::uint8_t b =
                sc[mok_reference_scale_offset(e * N + nb * 128 + i, kb * 4 + jj, K)];
            if (b != 255) emax = std::max(emax, b - 127);
          }
        }
        const int eb = std::max(emax, -39);
        const float s = c.scales[fp8::weight_scale_index(e, nb, kb, N, K)];
        EXPECT_EQ(s, std::ldexp(1.0f, eb));
        EXPECT_EQ(c.scales_t[fp8::weight_scale_index(e, kb, nb, K, N)], s);
        for (int i = 0; i < 128; ++i) {
          const std::int64_t n = nb * 128 + i;
          for (int j = 0; j < 128; ++j) {
            const std::int64_t k = kb * 128 + j;
            const std::uint8_t b = sc[mok_reference_scale_offset(e * N + n, k / 32, K)];
            const e4m3_t before = q[(e * N + n) * K + k], after = c.data[(e * N + n) * K + k];
            EXPECT_EQ(c.data_t[(e * K + k) * N + n], after);
            const double vb = e4m3_value(before), va = e4m3_value(after) * s;
            if (b == 255 || std::isnan(vb)) {
              EXPECT_EQ(after, 0x7F);
              continue;
            }
            const double mx = vb * std::ldexp(1.0, b - 127);
            if (va != mx) ++changed;
            EXPECT_LE(std::fabs(va - mx), std::ldexp(static_cast<double>(s), -10))
                << "element (" << e << ", " << n << ", " << k << ")";
          }
        }
      }
    }
  }
  EXPECT_EQ(c.inexact, changed);
  return changed;
}

TEST(Fp8MxToBlocks, ExactWithoutDeepSubBlocks) {
  // Sub-block exponents within 3 of their block's largest, values of e4m3 exponent field >= 4
  // (>= 2^-3): every rebased value stays a normal e4m3 value (>= 2^-6), so nothing is lost.
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 2, N = 256, K = 256;
  std::uniform_int_distribution<int> code(4 * 8, 0x7E), offset(0, 3), base(110, 190);
  std::vector<e4m3_t> q(E * N * K);
  for (auto& v : q) v = static_cast<e4m3_t>(code(rng) | (rng() & 1 ? 0x80 : 0));
  std::vector<std::uint8_t> sc(E * N * K / 32);
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t nb = 0; nb < N / 128; ++nb) {
      for (std::int64_t kb = 0; kb < K / 128; ++kb) {
        const int b0 = base(rng);
        for (int i = 0; i < 128; ++i) {
          for (int jj = 0; jj < 4; ++jj) {
            sc[fp8::mx_scale_index(e * N + nb * 128 + i, kb * 4 + jj, K)] =
                static_cast<std::uint8_t>(b0 - offset(rng));
          }
        }
      }
    }
  }
  const Converted c = convert(q, sc, E, N, K);
  EXPECT_EQ(check_conversion(q, sc, E, N, K, c), 0);
  EXPECT_EQ(c.inexact, 0);
}

TEST(Fp8MxToBlocks, CountsTheElementsOfDeepSubBlocks) {
  // MoK's own quantization of bf16 weights whose blocks cycle through every kind (wide-range
  // blocks hold sub-blocks far below their block's largest), plus one sub-block forced 20
  // exponents below: its values fall into e4m3's subnormals or to zero.
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 2, N = 256, K = 384;
  const std::vector<float> w = make_experts(E, N, K, 32, 32, true, rng);
  const MxOut mx = run_mx(to_bf16(w), E, N, K, true, false);
  std::vector<std::uint8_t> sc = mx.sc;
  sc[fp8::mx_scale_index(5, 1, K)] = 100;  // (row 5, sub-block 1) of a random block
  const Converted c = convert(mx.data, sc, E, N, K);
  const std::int64_t changed = check_conversion(mx.data, sc, E, N, K, c);
  EXPECT_GT(changed, 0);
  std::printf("[ mok ] MX -> blocks, every kind of block: %lld of %lld elements inexact\n",
              static_cast<long long>(changed), static_cast<long long>(E * N * K));
}

TEST(Fp8MxToBlocks, GaussianWeightsLoseFewElements) {
  // What a trained weight looks like (N(0, 0.02^2)): sub-blocks sit within a few exponents of
  // their block's largest, so only the smallest values (e4m3 subnormals after the rebase) round.
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 2, N = 256, K = 512;
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> w(E * N * K);
  for (auto& v : w) v = round_to_bf16(normal(rng));
  const MxOut mx = run_mx(to_bf16(w), E, N, K, true, false);
  const Converted c = convert(mx.data, mx.sc, E, N, K);
  const std::int64_t changed = check_conversion(mx.data, mx.sc, E, N, K, c);
  std::printf("[ mok ] MX -> blocks, N(0, 0.02^2) weights: %lld of %lld elements inexact\n",
              static_cast<long long>(changed), static_cast<long long>(E * N * K));
  EXPECT_LT(changed, E * N * K / 100);
}

// ---- block-promoted products ----

// Quantized operands of e4m3 values in [2^-3, 30] and scales in [2^-2, 2^2]: every term and
// every partial sum of the products below is a multiple of 2^-16 under 2^22, so any order of
// summation in f64 is exact, and the reference must equal the plain sum of dequantized products
// (its block partials, scales and block order are what is checked).
std::vector<e4m3_t> random_codes(std::int64_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> code(0x20, 0x5F);
  std::vector<e4m3_t> q(n);
  for (auto& v : q) v = static_cast<e4m3_t>(code(rng) | (rng() & 1 ? 0x80 : 0));
  return q;
}
std::vector<float> random_scales(std::int64_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> e(-2, 2);
  std::vector<float> s(n);
  for (auto& v : s) v = std::ldexp(1.0f, e(rng));
  return s;
}

TEST(Fp8Product, RowsTimesBlocksIsTheExactBlockScaledSum) {
  std::mt19937_64 rng(next_seed());
  const std::int64_t M = 37, K = 256, N = 256, r0 = 5, r1 = 33;
  const std::vector<e4m3_t> qa = random_codes(M * K, rng), qb = random_codes(N * K, rng);
  const std::vector<float> sa = random_scales(K / 128 * M, rng),
                           sb = random_scales(N / 128 * K / 128, rng);
  std::vector<double> c((r1 - r0) * N, std::numeric_limits<double>::quiet_NaN());
  reference::fp8_rows_times_blocks({qa.data(), sa.data(), M, K}, r0, r1,
                                   {qb.data(), sb.data(), N, K}, c.data());
  for (std::int64_t m = r0; m < r1; ++m) {
    for (std::int64_t n = 0; n < N; ++n) {
      double want = 0.0;
      for (std::int64_t k = 0; k < K; ++k) {
        want += (e4m3_value(qa[m * K + k]) * sa[(k / 128) * M + m]) *
                (e4m3_value(qb[n * K + k]) * sb[(n / 128) * (K / 128) + k / 128]);
      }
      ASSERT_EQ(c[(m - r0) * N + n], want) << m << " " << n;
    }
  }
}

TEST(Fp8Product, TokenAxisIsTheExactBlockScaledSum) {
  std::mt19937_64 rng(next_seed());
  const std::int64_t M = 512, Na = 40, Nb = 24, r0 = 128, r1 = 384;
  const std::vector<e4m3_t> qa = random_codes(Na * M, rng), qb = random_codes(Nb * M, rng);
  const std::vector<float> sa = random_scales(M / 128 * Na, rng),
                           sb = random_scales(M / 128 * Nb, rng);
  std::vector<double> c(Na * Nb, std::numeric_limits<double>::quiet_NaN());
  reference::fp8_token_axis_product({qa.data(), sa.data(), M, Na}, {qb.data(), sb.data(), M, Nb},
                                    r0, r1, c.data());
  for (std::int64_t i = 0; i < Na; ++i) {
    for (std::int64_t j = 0; j < Nb; ++j) {
      double want = 0.0;
      for (std::int64_t m = r0; m < r1; ++m) {
        want += (e4m3_value(qa[i * M + m]) * sa[(m / 128) * Na + i]) *
                (e4m3_value(qb[j * M + m]) * sb[(m / 128) * Nb + j]);
      }
      ASSERT_EQ(c[i * Nb + j], want) << i << " " << j;
    }
  }
}

// ---- the C++ API (mok/fp8.hpp) on host views ----

TEST(Fp8Api, QuantizeWeightsIsTheReferenceInItsLayout) {
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 2, N = 128, K = 256;
  const std::vector<float> w = make_experts(E, N, K, 128, 128, true, rng);
  std::vector<bf16_t> wb = to_bf16(w);
  const QuantizedWeightsLayout layout = quantized_weights_layout(E, N, K);
  EXPECT_EQ(layout.data_t_offset, static_cast<std::size_t>(E * N * K));
  EXPECT_EQ(layout.bytes % 256, 0u);
  std::vector<std::uint8_t> buffer(layout.bytes, 0xFF);
  const QuantizedWeights q = quantized_weights_views(layout, buffer.data());
  quantize_weights(TensorView::contiguous(wb.data(), DType::bf16, {E, N, K}), q);
  std::vector<e4m3_t> data(E * N * K), data_t(E * N * K);
  std::vector<float> scales(E * N * K / 16384), scales_t(E * N * K / 16384);
  reference::quantize_weights_fp8(
      {wb.data(), E, N, K, {data.data(), scales.data(), data_t.data(), scales_t.data()}});
  EXPECT_EQ(0, std::memcmp(q.data.data, data.data(), data.size()));
  EXPECT_EQ(0, std::memcmp(q.data_t.data, data_t.data(), data_t.size()));
  EXPECT_EQ(0, std::memcmp(q.scales.data, scales.data(), scales.size() * 4));
  EXPECT_EQ(0, std::memcmp(q.scales_t.data, scales_t.data(), scales_t.size() * 4));
}

// The argument named by the mok::Error `f` raises.
template <typename F>
std::string rejected_argument(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.argument();
  }
  return "(nothing raised)";
}

TEST(Fp8Api, BadArgumentsAreNamed) {
  std::vector<std::uint8_t> bytes(1 << 20);
  void* p = bytes.data();
  const auto view = [&](DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(p, t, shape);
  };
  const QuantizedWeights q = quantized_weights_views(quantized_weights_layout(1, 128, 256), p);
  EXPECT_EQ(rejected_argument([&] {
              quantize_weights(view(DType::bf16, {1, 100, 256}), q);
            }),
            "w.shape[1]");
  EXPECT_EQ(rejected_argument([&] {
              quantize_weights(view(DType::f32, {1, 128, 256}), q);
            }),
            "w.dtype");
  EXPECT_EQ(rejected_argument([&] {
              quantize_weights(view(DType::bf16, {128, 256}), q);
            }),
            "w.shape");
  QuantizedWeights wrong = q;
  wrong.scales.dtype = DType::bf16;
  EXPECT_EQ(rejected_argument([&] {
              quantize_weights(view(DType::bf16, {1, 128, 256}), wrong);
            }),
            "out.scales.dtype");
  wrong = q;
  wrong.data_t = view(DType::fp8_e4m3, {1, 128, 256});  // not transposed
  EXPECT_EQ(rejected_argument([&] {
              quantize_weights(view(DType::bf16, {1, 128, 256}), wrong);
            }),
            "out.data_t.shape");
  EXPECT_EQ(rejected_argument([&] { quantized_weights_layout(1, 128, 200); }), "K");
  EXPECT_EQ(rejected_argument([&] {
              quantize_rows(view(DType::i32, {4, 128}), view(DType::fp8_e4m3, {4, 128}),
                            view(DType::f32, {1, 4}));
            }),
            "x.dtype");
  EXPECT_EQ(rejected_argument([&] {
              quantize_rows(view(DType::bf16, {4, 64}), view(DType::fp8_e4m3, {4, 64}),
                            view(DType::f32, {1, 4}));
            }),
            "x.shape[1]");
  EXPECT_EQ(rejected_argument([&] {
              quantize_rows(view(DType::f32, {4, 128}), view(DType::u8, {4, 128}),
                            view(DType::f32, {1, 4}));
            }),
            "data.dtype");
  EXPECT_EQ(rejected_argument([&] {
              quantize_token_axis(view(DType::bf16, {100, 8}), view(DType::fp8_e4m3, {8, 100}),
                                  view(DType::f32, {1, 8}));
            }),
            "x.shape[0]");
  EXPECT_EQ(rejected_argument([&] {
              quantize_token_axis(view(DType::bf16, {128, 8}), view(DType::fp8_e4m3, {128, 8}),
                                  view(DType::f32, {1, 8}));
            }),
            "data.shape");
  const TensorView none;
  EXPECT_EQ(rejected_argument([&] {
              mxfp8_quantize(view(DType::bf16, {128, 128}), none, none, none, none);
            }),
            "outputs");
  EXPECT_EQ(rejected_argument([&] {
              mxfp8_quantize(view(DType::bf16, {128, 128}), view(DType::fp8_e4m3, {128, 128}), none,
                             none, none);
            }),
            "x_sc");
  EXPECT_EQ(rejected_argument([&] {
              mxfp8_quantize(view(DType::bf16, {128, 192}), none, none,
                             view(DType::fp8_e4m3, {192, 128}), view(DType::u8, {1, 1, 32, 16}));
            }),
            "x.shape[1]");
  EXPECT_EQ(rejected_argument([&] {
              mxfp8_quantize(view(DType::bf16, {2, 128, 128}), none, none,
                             view(DType::fp8_e4m3, {2, 128, 128}), view(DType::u8, {1, 1, 32, 16}));
            }),
            "x_sc_t.shape");
  EXPECT_EQ(rejected_argument([&] {
              mx_weights_to_blocks(view(DType::fp8_e4m3, {1, 128, 256}),
                                   view(DType::u8, {1, 2, 32, 16}), q, view(DType::i32, {1}));
            }),
            "inexact_count.dtype");
  // The layer refuses FP8 as its activation dtype.
  EXPECT_EQ(rejected_argument([&] {
              Problem{.num_tokens = 1,
                      .hidden_size = 128,
                      .intermediate_size = 128,
                      .num_experts = 1,
                      .topk = 1}
                  .validate(DType::fp8_e4m3);
            }),
            "activation dtype");
  EXPECT_STREQ(dtype_name(DType::fp8_e4m3), "fp8_e4m3");
  EXPECT_EQ(dtype_size(DType::fp8_e4m3), 1u);
}

TEST(Fp8Api, MxToBlocksCountsIntoItsView) {
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 1, N = 128, K = 256;
  std::vector<float> w = make_source(N, K, 32, 32, true, rng);
  std::vector<bf16_t> wb = to_bf16(w);
  std::vector<e4m3_t> mx(E * N * K);
  std::vector<std::uint8_t> sc(E * N * K / 32);
  mxfp8_quantize(TensorView::contiguous(wb.data(), DType::bf16, {N, K}),
                 TensorView::contiguous(mx.data(), DType::fp8_e4m3, {N, K}),
                 TensorView::contiguous(sc.data(), DType::u8, {N / 128, K / 128, 32, 16}), {}, {});
  const QuantizedWeightsLayout layout = quantized_weights_layout(E, N, K);
  std::vector<std::uint8_t> buffer(layout.bytes);
  std::int64_t count = -1;
  mx_weights_to_blocks(TensorView::contiguous(mx.data(), DType::fp8_e4m3, {E, N, K}),
                       TensorView::contiguous(sc.data(), DType::u8, {E * N / 128, K / 128, 32, 16}),
                       quantized_weights_views(layout, buffer.data()),
                       TensorView::contiguous(&count, DType::i64, {1}));
  const Converted c = convert(mx, sc, E, N, K);
  EXPECT_EQ(count, c.inexact);
  EXPECT_EQ(0, std::memcmp(buffer.data() + layout.data_offset, c.data.data(), c.data.size()));
}

}  // namespace
}  // namespace mok::test
