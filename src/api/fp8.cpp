// mok/fp8.hpp: validate the views, then run the CPU reference (host views) or one CUDA launch
// (device views); both compute core/fp8.hpp's bits.
#include "mok/fp8.hpp"

#include <limits>
#include <string>

#include "core/fp8_params.hpp"
#include "core/validate.hpp"
#include "cuda/kernels/fp8_quantize.hpp"
#include "mok/error.hpp"
#include "reference/fp8_quant.hpp"

namespace mok {
namespace {

constexpr std::int64_t B = fp8::kBlock;

// The device of the first operand (every other view must be on it).
Device device_of(const char* name, const TensorView& v) {
  if (!v.defined()) throw Error(name, "a tensor", "none");
  return v.device;
}

void require_ndim(const std::string& name, const TensorView& v, int ndim, const char* shape) {
  if (!v.defined()) throw Error(name, std::string("a tensor of shape ") + shape, "none");
  if (v.ndim != ndim) throw Error(name + ".shape", shape, v.shape_text());
}

void require_multiple(const std::string& name, std::int64_t value, std::int64_t of) {
  if (value <= 0 || value % of != 0) {
    throw Error(name, "a positive multiple of " + to_text(of), to_text(value));
  }
}

// Grids of one CTA per block or tile: below 2^31 of them.
void require_grid(const std::string& name, std::int64_t ctas, const TensorView& v) {
  if (ctas > std::numeric_limits<int>::max()) {
    throw Error(name, "fewer than 2^31 blocks of 128 x 128", v.shape_text());
  }
}

void check_aligned(Device d, std::initializer_list<std::pair<const char*, TensorView>> views) {
  if (d.kind != DeviceKind::cuda) return;
  for (const auto& [name, v] : views) check_aligned_16(name, v);
}

fp8::BlockWeights block_weights(const QuantizedWeights& q) {
  return {q.data.ptr<fp8::e4m3_t>(), q.scales.ptr<float>(), q.data_t.ptr<fp8::e4m3_t>(),
          q.scales_t.ptr<float>()};
}

// `out` of a weight [E, N, K] on `d`.
void check_quantized_weights(const QuantizedWeights& out, std::int64_t E, std::int64_t N,
                             std::int64_t K, Device d) {
  check_view("out.data", out.data, DType::fp8_e4m3, {E, N, K}, d);
  check_view("out.scales", out.scales, DType::f32, {E, N / B, K / B}, d);
  check_view("out.data_t", out.data_t, DType::fp8_e4m3, {E, K, N}, d);
  check_view("out.scales_t", out.scales_t, DType::f32, {E, K / B, N / B}, d);
  check_aligned(d, {{"out.data", out.data},
                    {"out.scales", out.scales},
                    {"out.data_t", out.data_t},
                    {"out.scales_t", out.scales_t}});
}

fp8::Source source_of(const TensorView& x) {
  return x.dtype == DType::bf16 ? fp8::Source::bf16 : fp8::Source::f32;
}

std::size_t align_256(std::size_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

QuantizedWeightsLayout quantized_weights_layout(std::int64_t E, std::int64_t N, std::int64_t K) {
  if (E <= 0) throw Error("E (experts)", "a positive count", to_text(E));
  require_multiple("N", N, B);
  require_multiple("K", K, B);
  // Bounded like every mok size (include/mok/problem.hpp): the byte counts fit an int64.
  if (N > (std::int64_t{1} << 24) || K > (std::int64_t{1} << 24) ||
      E > (std::int64_t{1} << 62) / (N * K)) {
    throw Error("E x N x K", "below 2^62 elements (N, K at most 2^24)",
                to_text(E) + " x " + to_text(N) + " x " + to_text(K));
  }
  QuantizedWeightsLayout l;
  l.E = E;
  l.N = N;
  l.K = K;
  const auto elems = static_cast<std::size_t>(E * N * K);
  const std::size_t scale_bytes = static_cast<std::size_t>(E * (N / B) * (K / B)) * sizeof(float);
  l.data_offset = 0;
  l.data_t_offset = align_256(elems);
  l.scales_offset = l.data_t_offset + align_256(elems);
  l.scales_t_offset = l.scales_offset + align_256(scale_bytes);
  l.bytes = l.scales_t_offset + align_256(scale_bytes);
  return l;
}

QuantizedWeights quantized_weights_views(const QuantizedWeightsLayout& l, void* buffer,
                                         Device device) {
  auto* base = static_cast<std::byte*>(buffer);
  QuantizedWeights q;
  q.data = TensorView::contiguous(base + l.data_offset, DType::fp8_e4m3, {l.E, l.N, l.K}, device);
  q.data_t =
      TensorView::contiguous(base + l.data_t_offset, DType::fp8_e4m3, {l.E, l.K, l.N}, device);
  q.scales =
      TensorView::contiguous(base + l.scales_offset, DType::f32, {l.E, l.N / B, l.K / B}, device);
  q.scales_t =
      TensorView::contiguous(base + l.scales_t_offset, DType::f32, {l.E, l.K / B, l.N / B}, device);
  return q;
}

void quantize_weights(const TensorView& w, const QuantizedWeights& out, void* stream) {
  const Device d = device_of("w", w);
  require_ndim("w", w, 3, "[E, N, K]");
  const std::int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  require_multiple("w.shape[1]", N, B);
  require_multiple("w.shape[2]", K, B);
  check_view("w", w, DType::bf16, {E, N, K}, d);
  check_aligned(d, {{"w", w}});
  check_quantized_weights(out, E, N, K, d);
  require_grid("w.shape", E * (N / B) * (K / B), w);
  const fp8::WeightParams p{w.ptr<const std::uint16_t>(), E, N, K, block_weights(out)};
  if (d.kind == DeviceKind::cpu) {
    reference::quantize_weights_fp8(p);
  } else {
    cuda::launch_quantize_weights_fp8(p, d.index, stream);
  }
}

void mx_weights_to_blocks(const TensorView& data, const TensorView& scales,
                          const QuantizedWeights& out, const TensorView& inexact_count,
                          void* stream) {
  const Device d = device_of("data", data);
  require_ndim("data", data, 3, "[E, N, K]");
  const std::int64_t E = data.shape[0], N = data.shape[1], K = data.shape[2];
  require_multiple("data.shape[1]", N, B);
  require_multiple("data.shape[2]", K, B);
  check_view("data", data, DType::fp8_e4m3, {E, N, K}, d);
  check_view("scales", scales, DType::u8, {E * N / B, K / B, 32, 16}, d);
  check_view("inexact_count", inexact_count, DType::i64, {1}, d);
  check_aligned(d, {{"data", data}, {"scales", scales}, {"inexact_count", inexact_count}});
  check_quantized_weights(out, E, N, K, d);
  require_grid("data.shape", E * (N / B) * (K / B), data);
  const fp8::MxToBlocksParams p{data.ptr<const fp8::e4m3_t>(),
                                scales.ptr<const std::uint8_t>(),
                                E,
                                N,
                                K,
                                block_weights(out),
                                inexact_count.ptr<std::int64_t>()};
  if (d.kind == DeviceKind::cpu) {
    reference::mx_weights_to_blocks(p);
  } else {
    cuda::launch_mx_weights_to_blocks(p, d.index, stream);
  }
}

void quantize_rows(const TensorView& x, const TensorView& data, const TensorView& scales,
                   void* stream) {
  const Device d = device_of("x", x);
  require_ndim("x", x, 2, "[M, K]");
  const std::int64_t M = x.shape[0], K = x.shape[1];
  require_multiple("x.shape[1]", K, B);
  check_view_either("x", x, DType::bf16, DType::f32, {M, K}, d);
  check_view("data", data, DType::fp8_e4m3, {M, K}, d);
  check_view("scales", scales, DType::f32, {K / B, M}, d);
  check_aligned(d, {{"x", x}, {"data", data}, {"scales", scales}});
  const fp8::ActivationParams p{
      x.data, source_of(x), M, K, data.ptr<fp8::e4m3_t>(), scales.ptr<float>()};
  if (d.kind == DeviceKind::cpu) {
    reference::quantize_rows_fp8(p);
  } else {
    cuda::launch_quantize_rows_fp8(p, d.index, stream);
  }
}

void quantize_token_axis(const TensorView& x, const TensorView& data, const TensorView& scales,
                         void* stream) {
  const Device d = device_of("x", x);
  require_ndim("x", x, 2, "[M, K]");
  const std::int64_t M = x.shape[0], K = x.shape[1];
  require_multiple("x.shape[0]", M, B);
  check_view_either("x", x, DType::bf16, DType::f32, {M, K}, d);
  check_view("data", data, DType::fp8_e4m3, {K, M}, d);
  check_view("scales", scales, DType::f32, {M / B, K}, d);
  check_aligned(d, {{"x", x}, {"data", data}, {"scales", scales}});
  require_grid("x.shape", (M / B) * ((K + 63) / 64), x);  // quantize_token_tile's tiles
  const fp8::ActivationParams p{
      x.data, source_of(x), M, K, data.ptr<fp8::e4m3_t>(), scales.ptr<float>()};
  if (d.kind == DeviceKind::cpu) {
    reference::quantize_token_axis_fp8(p);
  } else {
    cuda::launch_quantize_token_axis_fp8(p, d.index, stream);
  }
}

void mxfp8_quantize(const TensorView& x, const TensorView& x_fp8, const TensorView& x_sc,
                    const TensorView& x_fp8_t, const TensorView& x_sc_t, void* stream) {
  const Device d = device_of("x", x);
  if (!x.defined() || (x.ndim != 2 && x.ndim != 3)) {
    throw Error("x.shape", "[M, N] or [E, M, N]", x.shape_text());
  }
  const bool three = x.ndim == 3;
  const std::int64_t E = three ? x.shape[0] : 1, M = x.shape[x.ndim - 2], N = x.shape[x.ndim - 1];
  require_multiple("x.shape[" + to_text(x.ndim - 2) + "]", M, B);
  require_multiple("x.shape[" + to_text(x.ndim - 1) + "]", N, B);
  if (E <= 0) throw Error("x.shape[0]", "a positive count", to_text(E));
  if (three) {
    check_view("x", x, DType::bf16, {E, M, N}, d);
  } else {
    check_view("x", x, DType::bf16, {M, N}, d);
  }
  const bool normal = x_fp8.defined() || x_sc.defined();
  const bool transposed = x_fp8_t.defined() || x_sc_t.defined();
  if (!normal && !transposed) {
    throw Error("outputs", "x_fp8 and x_sc, or x_fp8_t and x_sc_t, or all four", "none");
  }
  if (normal) {
    if (three) {
      check_view("x_fp8", x_fp8, DType::fp8_e4m3, {E, M, N}, d);
    } else {
      check_view("x_fp8", x_fp8, DType::fp8_e4m3, {M, N}, d);
    }
    check_view("x_sc", x_sc, DType::u8, {E * M / B, N / B, 32, 16}, d);
  }
  if (transposed) {
    if (three) {
      check_view("x_fp8_t", x_fp8_t, DType::fp8_e4m3, {E, N, M}, d);
    } else {
      check_view("x_fp8_t", x_fp8_t, DType::fp8_e4m3, {N, M}, d);
    }
    check_view("x_sc_t", x_sc_t, DType::u8, {E * N / B, M / B, 32, 16}, d);
  }
  check_aligned(
      d, {{"x", x}, {"x_fp8", x_fp8}, {"x_sc", x_sc}, {"x_fp8_t", x_fp8_t}, {"x_sc_t", x_sc_t}});
  require_grid("x.shape", E * (M / B) * (N / B), x);
  const fp8::MxParams p{x.ptr<const std::uint16_t>(),
                        E,
                        M,
                        N,
                        normal ? x_fp8.ptr<fp8::e4m3_t>() : nullptr,
                        normal ? x_sc.ptr<std::uint8_t>() : nullptr,
                        transposed ? x_fp8_t.ptr<fp8::e4m3_t>() : nullptr,
                        transposed ? x_sc_t.ptr<std::uint8_t>() : nullptr};
  if (d.kind == DeviceKind::cpu) {
    reference::mxfp8_quantize(p);
  } else {
    cuda::launch_mxfp8_quantize(p, d.index, stream);
  }
}

}  // namespace mok
