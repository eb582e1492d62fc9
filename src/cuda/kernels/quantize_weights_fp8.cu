// Weights [E, N, K] bf16 -> FP8 in 128x128 blocks, both orientations from one read
// (mok::QuantizedWeights: data [E, N, K] + scales [E, N/128, K/128], data_t [E, K, N] + scales_t
// [E, K/128, N/128]; data_t holds data's bytes transposed). One CTA per block: every thread loads 8
// rows x 8 consecutive values (coalesced 16-byte loads, kept in registers), the CTA's amax gives
// the scale, the bytes go to data (8 per thread and row) and to shared memory, from which the
// transposed copy is written.
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/fp8_quantize.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = kTransposeThreads;  // 256
constexpr int kRowsPerPass = kThreads / 16;  // 16 threads x 8 values cover a 128-wide row
constexpr int kPasses = fp8::kBlock / kRowsPerPass;

__global__ void __launch_bounds__(kThreads) quantize_weights_fp8_kernel(fp8::WeightParams p) {
  __shared__ __align__(16) std::uint8_t q_tile[fp8::kBlock][fp8::kBlock];
  __shared__ std::uint32_t scratch[kThreads / 32];
  const std::int64_t kblocks = p.K / fp8::kBlock, nblocks = p.N / fp8::kBlock;
  const std::int64_t kb = blockIdx.x % kblocks, nb = (blockIdx.x / kblocks) % nblocks,
                     e = blockIdx.x / (kblocks * nblocks);
  const int c8 = threadIdx.x % 16, r0 = threadIdx.x / 16;
  const std::uint16_t* w = p.w + (e * p.N + nb * fp8::kBlock) * p.K + kb * fp8::kBlock + c8 * 8;
  uint4 raw[kPasses];
  std::uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    raw[i] = *reinterpret_cast<const uint4*>(w + (r0 + i * kRowsPerPass) * p.K);
    const std::uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      amax = fp8::amax_update(amax, bf16_bits_to_float(words[j] & 0xffffu));
      amax = fp8::amax_update(amax, bf16_bits_to_float(words[j] >> 16));
    }
  }
  const int exponent = fp8::scale_exponent(cta_amax(amax, scratch, kThreads));
  const float inv = fp8::inverse_scale_of(exponent);
  std::uint8_t* out = p.out.data + (e * p.N + nb * fp8::kBlock) * p.K + kb * fp8::kBlock + c8 * 8;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const std::uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
    std::uint32_t q[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      q[h] = quantize4(bf16_bits_to_float(words[2 * h] & 0xffffu),
                       bf16_bits_to_float(words[2 * h] >> 16),
                       bf16_bits_to_float(words[2 * h + 1] & 0xffffu),
                       bf16_bits_to_float(words[2 * h + 1] >> 16), inv);
    }
    const int r = r0 + i * kRowsPerPass;
    *reinterpret_cast<uint2*>(out + r * p.K) = make_uint2(q[0], q[1]);
    *reinterpret_cast<uint2*>(&q_tile[r][c8 * 8]) = make_uint2(q[0], q[1]);
  }
  __syncthreads();
  store_block_transposed(&q_tile[0][0], fp8::kBlock,
                         p.out.data_t + (e * p.K + kb * fp8::kBlock) * p.N + nb * fp8::kBlock, p.N);
  if (threadIdx.x == 0) {
    const float s = fp8::scale_of(exponent);
    p.out.scales[fp8::weight_scale_index(e, nb, kb, p.N, p.K)] = s;
    p.out.scales_t[fp8::weight_scale_index(e, kb, nb, p.K, p.N)] = s;
  }
}

}  // namespace

void launch_quantize_weights_fp8(const fp8::WeightParams& p, int device, void* stream) {
  require_current_device(device);
  const std::int64_t blocks = p.E * (p.N / fp8::kBlock) * (p.K / fp8::kBlock);
  if (blocks == 0) return;
  quantize_weights_fp8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                                static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("quantize_weights_fp8");
}

}  // namespace mok::cuda
