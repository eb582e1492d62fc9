// What the FP8 tests share (CPU: test_fp8.cpp; GPU: test_fp8_gpu.cu): sources whose blocks cover
// every case the quantizers treat apart, and oracles written independently of core/fp8.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/bf16.hpp"

namespace mok::test::fp8_cases {

// The kinds of blocks: every tensor of the tests cycles through all of them block by block.
enum class Kind : int {
  random,      // N(0, 1)
  wide,        // +-2^U(-60, 60): most elements far below the block's amax (e4m3 subnormals, 0)
  tiny,        // |x| < 448 * 2^-39: the scale clamp (bf16 subnormals included)
  zero,        // +-0 only
  saturating,  // amax at bf16's largest finite value, or exactly 448 * 2^k, or just above it
  nonfinite,   // NaN, +-inf among finite values, or NaN only
  count
};
inline constexpr int kKinds = static_cast<int>(Kind::count);

inline float bits_to_float(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// One block of n values of `kind` (variant v picks the sub-case), rounded to bf16 when `bf16`.
inline void fill_block(Kind kind, int v, float* out, std::int64_t n, bool bf16,
                       std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(n - 1));
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t i = 0; i < n; ++i) {
    float x = 0.0f;
    switch (kind) {
      case Kind::random:
        x = normal(rng);
        break;
      case Kind::wide:
        x = std::ldexp(1.0f + 0.5f * unit(rng), static_cast<int>(60.0f * unit(rng)));
        x = unit(rng) < 0 ? -x : x;
        break;
      case Kind::tiny:
        // Scales down to bf16's subnormals (2^-133) and up to just below the clamp's amax.
        x = std::ldexp(unit(rng), -31 - static_cast<int>(std::abs(unit(rng)) * 100.0f));
        break;
      case Kind::zero:
        x = (i % 3 == 0) ? -0.0f : 0.0f;
        break;
      case Kind::saturating:
        x = normal(rng) * std::ldexp(1.0f, 100);
        break;
      case Kind::nonfinite:
        x = normal(rng);
        break;
      case Kind::count:
        break;
    }
    out[i] = x;
  }
  if (kind == Kind::saturating) {
    // Pin the amax: bf16's largest finite value; exactly 448 * 2^k (the scale is 2^k); or the
    // next bf16 above that (2^(k+1)).
    const std::int64_t at = pick(rng);
    const int k = static_cast<int>(unit(rng) * 30.0f);
    const float pinned[3] = {3.3895313892515355e38f, std::ldexp(448.0f, k),
                             std::ldexp(450.0f, k)};  // 450 = 448 + one bf16 ulp
    out[at] = (v % 2 ? -1.0f : 1.0f) * pinned[v % 3];
    if (v % 3 != 0) {
      for (std::int64_t i = 0; i < n; ++i) {
        if (i != at) out[i] = std::ldexp(0.1f * normal(rng), k + 6);  // below the pinned amax
      }
    }
  }
  if (kind == Kind::nonfinite) {
    switch (v % 4) {
      case 0:  // a few NaNs among finite values: ignored by the scale, 0x7F in the data
        out[pick(rng)] = nan;
        out[pick(rng)] = -nan;
        break;
      case 1:  // +inf: scale 2^127, finite values +-0
        out[pick(rng)] = inf;
        break;
      case 2:  // -inf and NaN
        out[pick(rng)] = -inf;
        out[pick(rng)] = nan;
        break;
      default:  // NaN only: amax 0, the clamp's scale
        for (std::int64_t i = 0; i < n; ++i) out[i] = nan;
        break;
    }
  }
  if (bf16) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = round_to_bf16(out[i]);
  }
}

// e4m3 by search over its values (no bit tricks): the nearest finite value, ties to the even
// code, saturating at 448, NaN -> 0x7F, the sign kept (also on zero).
inline std::uint8_t e4m3_oracle(double v) {
  static const std::array<double, 127> values = [] {
    std::array<double, 127> t{};
    for (int c = 0; c < 127; ++c) {
      const int e = c >> 3, m = c & 7;
      t[c] = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    }
    return t;
  }();
  if (std::isnan(v)) return 0x7F;
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(v);
  if (a >= 448.0) return sign | 0x7E;
  const auto hi = static_cast<int>(std::lower_bound(values.begin(), values.end(), a) -
                                   values.begin());  // values[hi] >= a
  if (values[hi] == a) return sign | hi;
  const int lo = hi - 1;
  const double dl = a - values[lo], dh = values[hi] - a;
  const int c = dl < dh ? lo : (dh < dl ? hi : (lo % 2 == 0 ? lo : hi));
  return static_cast<std::uint8_t>(sign | c);
}

inline double e4m3_value(std::uint8_t q) {
  const int c = q & 0x7F;
  if (c == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  const int e = c >> 3, m = c & 7;
  const double a = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (q & 0x80) ? -a : a;
}

// The scale exponent by search: the least e with amax <= 448 * 2^e, clamped to [-39, 127];
// NaN elements ignored, inf -> 127.
inline int scale_exponent_oracle(const float* x, std::int64_t n, std::int64_t stride = 1) {
  double amax = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double a = std::fabs(static_cast<double>(x[i * stride]));
    if (!std::isnan(a)) amax = std::max(amax, a);
  }
  if (std::isinf(amax)) return 127;
  int e = -39;
  while (std::ldexp(448.0, e) < amax) ++e;
  return e;
}

// The quantized byte of x in a block of exponent e, by the oracles: x / 2^e, except that a
// block of exponent 127 multiplies by 0 (MoK's inverse; core/fp8.hpp).
inline std::uint8_t quantized_oracle(float x, int e) {
  const double v = e == 127 ? static_cast<double>(x) * 0.0 : std::ldexp(static_cast<double>(x), -e);
  return e4m3_oracle(v);
}

// A source [rows, cols] whose blocks (block_rows x block_cols) cycle through every Kind and
// variant. The values are bf16 values when `bf16` (the source is then read as bf16).
inline std::vector<float> make_source(std::int64_t rows, std::int64_t cols, std::int64_t block_rows,
                                      std::int64_t block_cols, bool bf16, std::mt19937_64& rng) {
  std::vector<float> x(rows * cols);
  std::vector<float> block(block_rows * block_cols);
  int index = 0;
  for (std::int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += block_cols, ++index) {
      const auto kind = static_cast<Kind>(index % kKinds);
      fill_block(kind, index / kKinds, block.data(), block_rows * block_cols, bf16, rng);
      for (std::int64_t i = 0; i < block_rows && r0 + i < rows; ++i) {
        for (std::int64_t j = 0; j < block_cols && c0 + j < cols; ++j) {
          x[(r0 + i) * cols + c0 + j] = block[i * block_cols + j];
        }
      }
    }
  }
  return x;
}

// `experts` such sources one after the other ([experts, rows, cols], e.g. a weight tensor).
inline std::vector<float> make_experts(std::int64_t experts, std::int64_t rows, std::int64_t cols,
                                       std::int64_t block_rows, std::int64_t block_cols, bool bf16,
                                       std::mt19937_64& rng) {
  std::vector<float> x;
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::vector<float> xe = make_source(rows, cols, block_rows, block_cols, bf16, rng);
    x.insert(x.end(), xe.begin(), xe.end());
  }
  return x;
}

inline std::vector<bf16_t> to_bf16(const std::vector<float>& x) {
  std::vector<bf16_t> v(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) v[i] = float_to_bf16(x[i]);
  return v;
}

}  // namespace mok::test::fp8_cases
