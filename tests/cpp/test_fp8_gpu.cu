// mok's FP8 quantization kernels against the CPU reference, bit for bit (the API on device views
// against the API on host views), on sources whose blocks cycle through random, wide-range, tiny,
// all-zero, saturating and non-finite values (fp8_test_helpers.hpp); outputs poisoned before each
// launch (0xFF: an e4m3 NaN the kernels never write, a NaN scale), each launch run twice for
// the same bits; and the conversion instruction against the integer form on every float. Each
// test skips visibly without a Hopper GPU.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/fp8.hpp"
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "fp8_test_helpers.hpp"
#include "gpu_buffer.hpp"
#include "mok/fp8.hpp"
#include "test_seed.hpp"

namespace mok::test {
namespace {

using namespace fp8_cases;
using fp8::e4m3_t;

constexpr Device kGpu{DeviceKind::cuda, 0};

// Every float bit pattern in [begin, begin + n): the instruction (fp8::e4m3_from_float on the
// device, and the paired form quantize4 uses) against the integer form.
__global__ void count_conversion_mismatches(std::uint64_t begin, std::uint64_t n,
                                            unsigned long long* count, unsigned* first) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    const auto bits = static_cast<std::uint32_t>(begin + i);
    const float v = __uint_as_float(bits), w = __uint_as_float(bits ^ 0x80000000u);
    const std::uint32_t want = fp8::e4m3_from_float_exact(v);
    const std::uint32_t pair = cuda::e4m3x2(v, w);
    if (fp8::e4m3_from_float(v) != want || (pair & 0xffu) != want ||
        (pair >> 8) != fp8::e4m3_from_float_exact(w)) {
      atomicAdd(count, 1ull);
      atomicMin(first, bits);
    }
  }
}

TEST(Fp8Gpu, ConversionInstructionIsTheIntegerFormOnEveryFloat) {
  MOK_REQUIRE_HOPPER();
  DeviceBuffer<unsigned long long> count(1);
  DeviceBuffer<unsigned> first(1);
  count.upload({0});
  first.upload({0xffffffffu});
  const std::uint64_t total = std::uint64_t{1} << 32, chunk = std::uint64_t{1} << 30;
  for (std::uint64_t begin = 0; begin < total; begin += chunk) {
    count_conversion_mismatches<<<4096, 256>>>(begin, chunk, count.get(), first.get());
  }
  MOK_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(count.download()[0], 0ull)
      << "first mismatching float bits: 0x" << std::hex << first.download()[0];
}

template <typename T>
TensorView on_gpu(DeviceBuffer<T>& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.get(), t, shape, kGpu);
}
template <typename T>
TensorView on_host(std::vector<T>& v, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(v.data(), t, shape);
}

// Runs `launch` twice on poisoned outputs; expects the same bits both times and returns them.
template <typename T, typename F>
std::vector<T> twice(DeviceBuffer<T>& out, F launch) {
  out.poison();
  launch();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<T> first = out.download();
  out.poison();
  launch();
  const std::vector<T> second = out.download();
  EXPECT_TRUE(std::memcmp(first.data(), second.data(), first.size() * sizeof(T)) == 0)
      << "two runs gave different bits";
  return first;
}

template <typename T>
void expect_bitwise(const std::vector<T>& gpu, const std::vector<T>& cpu, const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size()
                     << " elements differ, the first at " << first;
}

class Fp8GpuActivations : public ::testing::TestWithParam<bool> {};  // bf16 source (else fp32)

// Uploads x as the source dtype; returns the host view's storage too.
struct Source {
  std::vector<float> f32;
  std::vector<bf16_t> bf16;
  bool is_bf16 = true;
  TensorView host(std::int64_t M, std::int64_t K) {
    return is_bf16 ? on_host(bf16, DType::bf16, {M, K}) : on_host(f32, DType::f32, {M, K});
  }
};

TEST_P(Fp8GpuActivations, RowsFormIsTheCpuBitwise) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const std::int64_t M = 333, K = 640;
  Source s{make_source(M, K, 1, 128, GetParam(), rng), {}, GetParam()};
  s.bf16 = to_bf16(s.f32);
  DeviceBuffer<bf16_t> xb(s.bf16);
  DeviceBuffer<float> xf(s.f32);
  const TensorView x = s.is_bf16 ? on_gpu(xb, DType::bf16, {M, K}) : on_gpu(xf, DType::f32, {M, K});
  DeviceBuffer<e4m3_t> data(M * K);
  DeviceBuffer<float> scales(K / 128 * M);
  std::vector<e4m3_t> want_data(M * K);
  std::vector<float> want_scales(K / 128 * M);
  quantize_rows(s.host(M, K), on_host(want_data, DType::fp8_e4m3, {M, K}),
                on_host(want_scales, DType::f32, {K / 128, M}));
  auto run = [&] {
    quantize_rows(x, on_gpu(data, DType::fp8_e4m3, {M, K}),
                  on_gpu(scales, DType::f32, {K / 128, M}));
  };
  scales.poison();
  expect_bitwise(twice(data, run), want_data, "data");
  expect_bitwise(scales.download(), want_scales, "scales");
}

TEST_P(Fp8GpuActivations, TokenAxisFormIsTheCpuBitwise) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  for (const auto [M, K] : {std::array<std::int64_t, 2>{384, 77}, {256, 1000}}) {
    Source s{make_source(M, K, 128, 1, GetParam(), rng), {}, GetParam()};
    s.bf16 = to_bf16(s.f32);
    DeviceBuffer<bf16_t> xb(s.bf16);
    DeviceBuffer<float> xf(s.f32);
    const TensorView x =
        s.is_bf16 ? on_gpu(xb, DType::bf16, {M, K}) : on_gpu(xf, DType::f32, {M, K});
    DeviceBuffer<e4m3_t> data(K * M);
    DeviceBuffer<float> scales(M / 128 * K);
    std::vector<e4m3_t> want_data(K * M);
    std::vector<float> want_scales(M / 128 * K);
    quantize_token_axis(s.host(M, K), on_host(want_data, DType::fp8_e4m3, {K, M}),
                        on_host(want_scales, DType::f32, {M / 128, K}));
    auto run = [&] {
      quantize_token_axis(x, on_gpu(data, DType::fp8_e4m3, {K, M}),
                          on_gpu(scales, DType::f32, {M / 128, K}));
    };
    scales.poison();
    expect_bitwise(twice(data, run), want_data, "data");
    expect_bitwise(scales.download(), want_scales, "scales");
  }
}

INSTANTIATE_TEST_SUITE_P(Source, Fp8GpuActivations, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "bf16" : "fp32"; });

// A QuantizedWeights in one device buffer and its host twin.
struct Weights {
  QuantizedWeightsLayout layout;
  DeviceBuffer<std::uint8_t> device;
  std::vector<std::uint8_t> host;
  Weights(std::int64_t E, std::int64_t N, std::int64_t K)
      : layout(quantized_weights_layout(E, N, K)), device(layout.bytes), host(layout.bytes) {}
  QuantizedWeights on_device() { return quantized_weights_views(layout, device.get(), kGpu); }
  QuantizedWeights on_host() { return quantized_weights_views(layout, host.data()); }
};

TEST(Fp8Gpu, WeightsAreTheCpuBitwise) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 3, N = 384, K = 256;
  const std::vector<float> w = make_experts(E, N, K, 128, 128, true, rng);
  std::vector<bf16_t> wb = to_bf16(w);
  DeviceBuffer<bf16_t> wd(wb);
  Weights q(E, N, K);
  quantize_weights(on_host(wb, DType::bf16, {E, N, K}), q.on_host());
  const std::vector<std::uint8_t> got = twice(q.device, [&] {
    quantize_weights(on_gpu(wd, DType::bf16, {E, N, K}), q.on_device());
  });
  // The whole buffer: both orientations' bytes and scales (the padding between them included:
  // the CPU leaves it as allocated, so compare the four regions).
  const QuantizedWeightsLayout& l = q.layout;
  const std::size_t elems = E * N * K, scale_bytes = elems / 16384 * 4;
  auto region = [&](const std::vector<std::uint8_t>& v, std::size_t at, std::size_t n) {
    return std::vector<std::uint8_t>(v.begin() + at, v.begin() + at + n);
  };
  expect_bitwise(region(got, l.data_offset, elems), region(q.host, l.data_offset, elems), "data");
  expect_bitwise(region(got, l.data_t_offset, elems), region(q.host, l.data_t_offset, elems),
                 "data_t");
  expect_bitwise(region(got, l.scales_offset, scale_bytes),
                 region(q.host, l.scales_offset, scale_bytes), "scales");
  expect_bitwise(region(got, l.scales_t_offset, scale_bytes),
                 region(q.host, l.scales_t_offset, scale_bytes), "scales_t");
}

TEST(Fp8Gpu, MxQuantizeIsTheCpuBitwise) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  for (const auto [E, M, N, three] :
       {std::array<std::int64_t, 4>{1, 256, 384, 0}, {3, 128, 256, 1}}) {
    const std::vector<float> x = make_experts(E, M, N, 32, 32, true, rng);
    std::vector<bf16_t> xb = to_bf16(x);
    DeviceBuffer<bf16_t> xd(xb);
    auto shape3 = [&](std::int64_t a, std::int64_t b) {
      return three ? std::vector<std::int64_t>{E, a, b} : std::vector<std::int64_t>{a, b};
    };
    auto view = [&](void* p, DType t, const std::vector<std::int64_t>& s, Device d) {
      TensorView v;
      v.data = p;
      v.dtype = t;
      v.ndim = static_cast<int>(s.size());
      v.device = d;
      std::int64_t stride = 1;
      for (int i = v.ndim - 1; i >= 0; --i) {
        v.shape[i] = s[i];
        v.strides[i] = stride;
        stride *= s[i];
      }
      return v;
    };
    const std::int64_t n = E * M * N;
    std::vector<e4m3_t> h_fp8(n), h_fp8_t(n);
    std::vector<std::uint8_t> h_sc(n / 32), h_sc_t(n / 32);
    mxfp8_quantize(view(xb.data(), DType::bf16, shape3(M, N), {}),
                   view(h_fp8.data(), DType::fp8_e4m3, shape3(M, N), {}),
                   on_host(h_sc, DType::u8, {E * M / 128, N / 128, 32, 16}),
                   view(h_fp8_t.data(), DType::fp8_e4m3, shape3(N, M), {}),
                   on_host(h_sc_t, DType::u8, {E * N / 128, M / 128, 32, 16}));
    DeviceBuffer<e4m3_t> fp8(n), fp8_t(n);
    DeviceBuffer<std::uint8_t> sc(n / 32), sc_t(n / 32);
    const TensorView xv = view(xd.get(), DType::bf16, shape3(M, N), kGpu);
    const TensorView v_fp8 = view(fp8.get(), DType::fp8_e4m3, shape3(M, N), kGpu),
                     v_sc = on_gpu(sc, DType::u8, {E * M / 128, N / 128, 32, 16}),
                     v_fp8_t = view(fp8_t.get(), DType::fp8_e4m3, shape3(N, M), kGpu),
                     v_sc_t = on_gpu(sc_t, DType::u8, {E * N / 128, M / 128, 32, 16});
    for (const auto [normal, transposed] :
         {std::array<bool, 2>{true, true}, {true, false}, {false, true}}) {
      SCOPED_TRACE(std::string("E = ") + std::to_string(E) + (normal ? ", normal" : "") +
                   (transposed ? ", transposed" : ""));
      fp8.poison();
      sc.poison();
      fp8_t.poison();
      sc_t.poison();
      const TensorView none;
      mxfp8_quantize(xv, normal ? v_fp8 : none, normal ? v_sc : none, transposed ? v_fp8_t : none,
                     transposed ? v_sc_t : none);
      MOK_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<e4m3_t> poisoned(n, 0xFF);
      expect_bitwise(fp8.download(), normal ? h_fp8 : poisoned, "x_fp8");
      expect_bitwise(fp8_t.download(), transposed ? h_fp8_t : poisoned, "x_fp8_t");
      const std::vector<std::uint8_t> poisoned_sc(n / 32, 0xFF);
      expect_bitwise(sc.download(), normal ? h_sc : poisoned_sc, "x_sc");
      expect_bitwise(sc_t.download(), transposed ? h_sc_t : poisoned_sc, "x_sc_t");
    }
  }
}

TEST(Fp8Gpu, MxToBlocksIsTheCpuBitwiseWithTheSameCount) {
  MOK_REQUIRE_HOPPER();
  std::mt19937_64 rng(next_seed());
  const std::int64_t E = 2, N = 256, K = 384;
  const std::vector<float> w = make_experts(E, N, K, 32, 32, true, rng);
  std::vector<bf16_t> wb = to_bf16(w);
  std::vector<e4m3_t> mx(E * N * K);
  std::vector<std::uint8_t> sc(E * N * K / 32);
  mxfp8_quantize(on_host(wb, DType::bf16, {E, N, K}), on_host(mx, DType::fp8_e4m3, {E, N, K}),
                 on_host(sc, DType::u8, {E * N / 128, K / 128, 32, 16}), {}, {});
  sc[fp8::mx_scale_index(5, 1, K)] = 100;    // one sub-block deep below its block's largest
  sc[fp8::mx_scale_index(300, 6, K)] = 255;  // an E8M0 NaN
  Weights q(E, N, K);
  std::int64_t want = -1;
  mx_weights_to_blocks(on_host(mx, DType::fp8_e4m3, {E, N, K}),
                       on_host(sc, DType::u8, {E * N / 128, K / 128, 32, 16}), q.on_host(),
                       TensorView::contiguous(&want, DType::i64, {1}));
  EXPECT_GT(want, 0);
  DeviceBuffer<e4m3_t> mxd(mx);
  DeviceBuffer<std::uint8_t> scd(sc);
  DeviceBuffer<std::int64_t> count(1);
  const std::vector<std::uint8_t> got = twice(q.device, [&] {
    count.poison();
    mx_weights_to_blocks(on_gpu(mxd, DType::fp8_e4m3, {E, N, K}),
                         on_gpu(scd, DType::u8, {E * N / 128, K / 128, 32, 16}), q.on_device(),
                         on_gpu(count, DType::i64, {1}));
  });
  EXPECT_EQ(count.download()[0], want);
  const QuantizedWeightsLayout& l = q.layout;
  const std::size_t elems = E * N * K, scale_bytes = elems / 16384 * 4;
  for (const auto [at, n] : {std::array<std::size_t, 2>{l.data_offset, elems},
                             {l.data_t_offset, elems},
                             {l.scales_offset, scale_bytes},
                             {l.scales_t_offset, scale_bytes}}) {
    expect_bitwise(std::vector<std::uint8_t>(got.begin() + at, got.begin() + at + n),
                   std::vector<std::uint8_t>(q.host.begin() + at, q.host.begin() + at + n),
                   "converted weights");
  }
}

}  // namespace
}  // namespace mok::test
