#include "reference/fp8_layer.hpp"

#include <algorithm>
#include <vector>

#include "core/fp8_layout.hpp"
#include "core/fp8_params.hpp"
#include "reference/cpu_gemm.hpp"
#include "reference/fp8_quant.hpp"

namespace mok::reference {
namespace {

constexpr std::int64_t B = fp8::kBlock;
constexpr std::int64_t kRowsPerTask = 8;  // C rows per task (any split gives the same bits)

// An activation operand in the rows form (1x128 along K), owning its storage.
struct RowsOperand {
  std::vector<fp8::e4m3_t> data;
  std::vector<float> scales;
  Fp8Rows view() const { return {data.data(), scales.data(), M, K}; }
  std::int64_t M = 0, K = 0;
};

RowsOperand quantize_rows_of(const float* x, std::int64_t M, std::int64_t K) {
  RowsOperand q;
  q.M = M;
  q.K = K;
  q.data.resize(static_cast<std::size_t>(M * K));
  q.scales.resize(static_cast<std::size_t>(K / B * M));
  quantize_rows_fp8({x, fp8::Source::f32, M, K, q.data.data(), q.scales.data()});
  return q;
}

// An operand in the token-axis form over M rows padded with zero rows to a multiple of 128: a
// zero never raises a block's amax, so every block's scale is that of its real rows, and the
// padded products are 0.
struct TokenOperand {
  std::vector<fp8::e4m3_t> data;
  std::vector<float> scales;
  std::int64_t M = 0, N = 0;  // M padded
  Fp8TokenAxis view() const { return {data.data(), scales.data(), M, N}; }
};

TokenOperand quantize_tokens_of(const float* x, std::int64_t rows, std::int64_t N) {
  TokenOperand q;
  q.M = (rows + B - 1) / B * B;
  q.N = N;
  std::vector<float> padded(static_cast<std::size_t>(q.M * N), 0.0f);
  std::copy_n(x, rows * N, padded.begin());
  q.data.resize(static_cast<std::size_t>(q.M * N));
  q.scales.resize(static_cast<std::size_t>(q.M / B * N));
  quantize_token_axis_fp8(
      {padded.data(), fp8::Source::f32, q.M, N, q.data.data(), q.scales.data()});
  return q;
}

// The f64 sums as the fp32 values the bf16 layer's arithmetic continues from.
void to_float(const std::vector<double>& c, float* out) {
  std::transform(c.begin(), c.end(), out, [](double v) { return static_cast<float>(v); });
}

// c [a.M, b.N] (+)= a x b (fp8_rows_times_blocks), rows split over the pool.
void rows_times_blocks(ThreadPool& pool, const RowsOperand& a, const Fp8BlockMatrix& b,
                       std::vector<double>& c, bool accumulate) {
  const std::int64_t tasks = (a.M + kRowsPerTask - 1) / kRowsPerTask;
  pool.run(tasks, [&](std::int64_t t) {
    const std::int64_t r0 = t * kRowsPerTask, r1 = std::min(a.M, r0 + kRowsPerTask);
    fp8_rows_times_blocks(a.view(), r0, r1, b, c.data() + r0 * b.N, accumulate);
  });
}

// out [a.N, b.N] = float(a^T b) over every token block (fp8_token_axis_product).
void token_axis_product(ThreadPool& pool, const TokenOperand& a, const TokenOperand& b,
                        float* out) {
  std::vector<double> c(static_cast<std::size_t>(a.N * b.N));
  const std::int64_t tasks = (a.N + kRowsPerTask - 1) / kRowsPerTask;
  pool.run(tasks, [&](std::int64_t t) {
    const std::int64_t i0 = t * kRowsPerTask, i1 = std::min(a.N, i0 + kRowsPerTask);
    fp8_token_axis_product(a.view(), b.view(), 0, a.M, c.data() + i0 * b.N, i0, i1);
  });
  to_float(c, out);
}

// Expert e's [N, K] matrix of an [E, N, K] quantized tensor (data and scales).
Fp8BlockMatrix expert_matrix(const TensorView& data, const TensorView& scales, std::int64_t e) {
  const std::int64_t N = data.shape[1], K = data.shape[2];
  return {data.ptr<const fp8::e4m3_t>() + e * N * K,
          scales.ptr<const float>() + e * (N / B) * (K / B), N, K};
}

}  // namespace

Fp8Expert fp8_expert(const Fp8Weights& q, std::int64_t e) {
  Fp8Expert x;
  x.gate = expert_matrix(q.gate.data, q.gate.scales, e);
  x.up = expert_matrix(q.up.data, q.up.scales, e);
  x.gate_t = expert_matrix(q.gate.data_t, q.gate.scales_t, e);
  x.up_t = expert_matrix(q.up.data_t, q.up.scales_t, e);
  if (q.down.data.defined()) {  // absent in recompute_forward_context
    x.down = expert_matrix(q.down.data, q.down.scales, e);
    x.down_t = expert_matrix(q.down.data_t, q.down.scales_t, e);
  }
  return x;
}

void Fp8Products::gate_up(const float* xr, float* g, float* u) const {
  const RowsOperand qx = quantize_rows_of(xr, rows, H);
  std::vector<double> c(static_cast<std::size_t>(rows * N));
  rows_times_blocks(pool, qx, w.gate, c, false);
  to_float(c, g);
  rows_times_blocks(pool, qx, w.up, c, false);
  to_float(c, u);
}

void Fp8Products::down(const float* h, float* y) const {
  std::vector<double> c(static_cast<std::size_t>(rows * H));
  rows_times_blocks(pool, quantize_rows_of(h, rows, N), w.down, c, false);
  to_float(c, y);
}

void Fp8Products::down_dgrad(const float* d_outr, float* dh) const {
  std::vector<double> c(static_cast<std::size_t>(rows * N));
  rows_times_blocks(pool, quantize_rows_of(d_outr, rows, H), w.down_t, c, false);
  to_float(c, dh);
}

void Fp8Products::gate_up_dgrad(const float* dg, const float* du, float* dx) const {
  std::vector<double> c(static_cast<std::size_t>(rows * H));
  rows_times_blocks(pool, quantize_rows_of(dg, rows, N), w.gate_t, c, false);
  rows_times_blocks(pool, quantize_rows_of(du, rows, N), w.up_t, c, /*accumulate=*/true);
  to_float(c, dx);
}

void Fp8Products::weight_grads(const float* dy, const float* h, const float* dg, const float* du,
                               const float* xr, float* d_down, float* d_gate, float* d_up) const {
  if (!fp8_weight_grads) {
    weight_grad_products<float>(pool, rows, H, N, dy, h, dg, du, xr, d_down, d_gate, d_up);
    return;
  }
  const TokenOperand tx = quantize_tokens_of(xr, rows, H);
  token_axis_product(pool, quantize_tokens_of(dy, rows, H), quantize_tokens_of(h, rows, N), d_down);
  token_axis_product(pool, quantize_tokens_of(dg, rows, N), tx, d_gate);
  token_axis_product(pool, quantize_tokens_of(du, rows, N), tx, d_up);
}

}  // namespace mok::reference
