// mok::gemm_ops on the CUDA backend: view checks, then the launchers of grouped_gemm.hpp.
#include "core/gemm_ops.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>

#include "core/validate.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "mok/error.hpp"

namespace mok::gemm_ops {
namespace {

using bf16 = __nv_bfloat16;

// The CUDA device of the first operand: every other view must be on it.
Device cuda_device_of(const char* name, const TensorView& v) {
  if (!v.defined()) throw Error(name, "a tensor", "absent");
  if (v.device.kind != DeviceKind::cuda) throw Error(std::string(name) + ".device", "a CUDA device", "cpu");
  return v.device;
}

std::int64_t dim(const char* name, const TensorView& v, int ndim, int d) {
  if (!v.defined() || v.ndim != ndim) {
    throw Error(std::string(name) + ".shape", to_text(ndim) + " dimensions",
                v.defined() ? v.shape_text() : "absent");
  }
  return v.shape[d];
}

std::int64_t rows_of(const char* name, const TensorView& v) {
  const std::int64_t r = dim(name, v, 2, 0);
  if (r > std::numeric_limits<int>::max()) {
    throw Error(std::string(name) + ".shape[0]", "below 2^31 rows", to_text(r));
  }
  return r;
}

// The groups' views, checked; their count.
int group_count(const Groups& g, Device device) {
  const std::int64_t G = dim("rows", g.rows, 1, 0);
  if (G < 1 || G > gemm::kMaxGroups) {
    throw Error("rows.shape[0]", "in [1, " + to_text(gemm::kMaxGroups) + "]", to_text(G));
  }
  check_view("rows", g.rows, DType::i32, {G}, device);
  check_view("starts", g.starts, DType::i32, {G + 1}, device);
  return static_cast<int>(G);
}

gemm::RowSegments segments(const Groups& g, int num_groups, std::int64_t capacity_rows) {
  return {g.starts.ptr<const int>(), g.rows.ptr<const int>(), num_groups,
          static_cast<int>(capacity_rows), 0};
}

void check_groups_match(const char* name, std::int64_t weight_groups, int groups) {
  if (weight_groups != groups) {
    throw Error(std::string(name) + ".shape[0]", to_text(groups) + " (the groups in rows)",
                to_text(weight_groups));
  }
}

}  // namespace

void gate_up(const TensorView& x, const TensorView& w_gate, const TensorView& w_up,
             const Groups& groups, const TensorView& hidden, const TensorView& gate,
             const TensorView& up, void* stream) {
  const Device d = cuda_device_of("x", x);
  const std::int64_t R = rows_of("x", x), H = x.shape[1];
  const int G = group_count(groups, d);
  check_groups_match("w_gate", dim("w_gate", w_gate, 3, 0), G);
  const std::int64_t I = w_gate.shape[1];
  check_view("x", x, DType::bf16, {R, H}, d);
  check_view("w_gate", w_gate, DType::bf16, {G, I, H}, d);
  check_view("w_up", w_up, DType::bf16, {G, I, H}, d);
  check_view("hidden", hidden, DType::bf16, {R, I}, d);
  if (gate.defined() || up.defined()) {
    check_view("gate", gate, DType::bf16, {R, I}, d);
    check_view("up", up, DType::bf16, {R, I}, d);
  }
  gemm::GateUpForwardArgs a;
  a.segments = segments(groups, G, R);
  a.x = x.ptr<const bf16>();
  a.ld_x = H;
  a.w_gate = w_gate.ptr<const bf16>();
  a.w_up = w_up.ptr<const bf16>();
  a.hidden = hidden.ptr<bf16>();
  a.gate = gate.defined() ? gate.ptr<bf16>() : nullptr;
  a.up = up.defined() ? up.ptr<bf16>() : nullptr;
  a.ld_out = I;
  a.hidden_size = static_cast<int>(H);
  a.intermediate_size = static_cast<int>(I);
  a.stream = static_cast<cudaStream_t>(stream);
  gemm::gate_up_forward(a);
}

void rows_times_weight_t(const TensorView& a, const TensorView& w, const Groups& groups,
                         const TensorView& row_scale, const TensorView& out, void* stream) {
  const Device d = cuda_device_of("a", a);
  const std::int64_t R = rows_of("a", a), K = a.shape[1];
  const int G = group_count(groups, d);
  check_groups_match("w", dim("w", w, 3, 0), G);
  const std::int64_t N = w.shape[1];
  check_view("a", a, DType::bf16, {R, K}, d);
  check_view("w", w, DType::bf16, {G, N, K}, d);
  check_view("out", out, DType::bf16, {R, N}, d);
  if (row_scale.defined()) check_view("row_scale", row_scale, DType::f32, {R}, d);
  gemm::RowsTimesWeightTArgs args;
  args.segments = segments(groups, G, R);
  args.a = a.ptr<const bf16>();
  args.ld_a = K;
  args.w = w.ptr<const bf16>();
  args.out = out.ptr<bf16>();
  args.ld_out = N;
  args.row_scale = row_scale.defined() ? row_scale.ptr<const float>() : nullptr;
  args.n = static_cast<int>(N);
  args.k = static_cast<int>(K);
  args.stream = static_cast<cudaStream_t>(stream);
  gemm::rows_times_weight_t(args);
}

void rows_times_weight(const TensorView& a, const TensorView& w, const Groups& groups,
                       const TensorView& out, void* stream) {
  const Device d = cuda_device_of("a", a);
  const std::int64_t R = rows_of("a", a), K = a.shape[1];
  const int G = group_count(groups, d);
  check_groups_match("w", dim("w", w, 3, 0), G);
  const std::int64_t N = w.shape[2];
  check_view("a", a, DType::bf16, {R, K}, d);
  check_view("w", w, DType::bf16, {G, K, N}, d);
  check_view("out", out, DType::bf16, {R, N}, d);
  gemm::RowsTimesWeightArgs args;
  args.segments = segments(groups, G, R);
  args.a = a.ptr<const bf16>();
  args.ld_a = K;
  args.w = w.ptr<const bf16>();
  args.out = out.ptr<bf16>();
  args.ld_out = N;
  args.n = static_cast<int>(N);
  args.k = static_cast<int>(K);
  args.stream = static_cast<cudaStream_t>(stream);
  gemm::rows_times_weight(args);
}

// `tickets`: an int32 [2] tensor of zeros on the same device (the launch's ticket counter pair,
// WeightGradArgs::tickets; the launch leaves it zero), or absent for the static tile order.
void weight_grad(const TensorView& a, const TensorView& b, const Groups& groups,
                 const TensorView& out, const TensorView& tickets, bool accumulate, void* stream) {
  const Device d = cuda_device_of("a", a);
  const std::int64_t R = rows_of("a", a), M = a.shape[1];
  const std::int64_t N = dim("b", b, 2, 1);
  const int G = group_count(groups, d);
  check_view("a", a, DType::bf16, {R, M}, d);
  check_view("b", b, DType::bf16, {R, N}, d);
  check_view_either("out", out, DType::bf16, DType::f32, {G, M, N}, d);
  if (tickets.defined()) check_view("tickets", tickets, DType::i32, {2}, d);
  gemm::WeightGradArgs args;
  args.segments = segments(groups, G, R);
  args.a = a.ptr<const bf16>();
  args.ld_a = M;
  args.b = b.ptr<const bf16>();
  args.ld_b = N;
  args.out = out.data;
  args.ld_out = N;
  args.out_fp32 = out.dtype == DType::f32;
  args.accumulate = accumulate;
  args.m = static_cast<int>(M);
  args.n = static_cast<int>(N);
  args.tickets =
      tickets.defined() ? reinterpret_cast<unsigned*>(tickets.ptr<std::int32_t>()) : nullptr;
  args.stream = static_cast<cudaStream_t>(stream);
  gemm::weight_grad(args);
}

}  // namespace mok::gemm_ops
