#include "reference/fp8_gemm.hpp"

#include <array>

#include "core/fp8_layout.hpp"

namespace mok::reference {
namespace {

// The 256 e4m3 values as doubles.
const std::array<double, 256>& e4m3_values() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8::e4m3_to_float(static_cast<fp8::e4m3_t>(i));
    return t;
  }();
  return table;
}

// sum_{i < n} a[i] b[i] over e4m3 bytes, in f64 (exact: see the header).
double block_dot(const fp8::e4m3_t* a, const fp8::e4m3_t* b, std::int64_t n) {
  const std::array<double, 256>& v = e4m3_values();
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) sum += v[a[i]] * v[b[i]];
  return sum;
}

}  // namespace

void fp8_rows_times_blocks(const Fp8Rows& a, std::int64_t row_begin, std::int64_t row_end,
                           const Fp8BlockMatrix& b, double* c, bool accumulate) {
  constexpr std::int64_t B = fp8::kBlock;
  const std::int64_t K = a.K, blocks = K / B;
  for (std::int64_t m = row_begin; m < row_end; ++m) {
    for (std::int64_t n = 0; n < b.N; ++n) {
      double& out = c[(m - row_begin) * b.N + n];
      double acc = accumulate ? out : 0.0;
      for (std::int64_t kb = 0; kb < blocks; ++kb) {
        const double partial = block_dot(a.data + m * K + kb * B, b.data + n * K + kb * B, B);
        const double sa = a.scales[fp8::row_scale_index(m, kb, a.M)];
        const double sb = b.scales[(n / B) * blocks + kb];
        acc += partial * sa * sb;
      }
      out = acc;
    }
  }
}

void fp8_token_axis_product(const Fp8TokenAxis& a, const Fp8TokenAxis& b, std::int64_t row_begin,
                            std::int64_t row_end, double* c, std::int64_t i_begin,
                            std::int64_t i_end) {
  constexpr std::int64_t B = fp8::kBlock;
  if (i_end < 0) i_end = a.N;
  for (std::int64_t i = i_begin; i < i_end; ++i) {
    for (std::int64_t j = 0; j < b.N; ++j) {
      double acc = 0.0;
      for (std::int64_t m0 = row_begin; m0 < row_end; m0 += B) {
        const double partial = block_dot(a.data + i * a.M + m0, b.data + j * b.M + m0, B);
        const double sa = a.scales[fp8::token_scale_index(m0 / B, i, a.N)];
        const double sb = b.scales[fp8::token_scale_index(m0 / B, j, b.N)];
        acc += partial * sa * sb;
      }
      c[(i - i_begin) * b.N + j] = acc;
    }
  }
}

}  // namespace mok::reference
