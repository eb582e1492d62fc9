// MoK's mxfp8_quantize (core/fp8_layout.hpp): bf16 x [E, M, N] -> 1x32 E8M0-scaled e4m3 along N
// (data [E, M, N], scales [E*M/128, N/128, 32, 16]) and/or along M (data_t [E, N, M], scales
// [E*N/128, M/128, 32, 16]). One CTA per 128x128 tile, staged in shared memory; a thread
// quantizes two 1x32 blocks of each requested orientation (32 values, 32 bytes written as two
// 16-byte stores) and writes their scale bytes. The maths is core/fp8.hpp's, as MoK's kernel
// computes it (csrc/mxfp8.cuh).
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/fp8_quantize.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kStride = fp8::kBlock + 8;  // bf16 elements a staged row: 16-byte aligned rows

// 32 values -> 32 bytes at out (16-byte aligned) and the E8M0 byte of their scale.
__device__ inline std::uint8_t quantize_mx_block(const float (&v)[32], std::uint8_t* out) {
  std::uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fp8::amax_update(amax, v[i]);
  const int e = fp8::scale_exponent(amax);
  const float inv = fp8::inverse_scale_of(e);
  std::uint32_t q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    q[i] = quantize4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], inv);
  reinterpret_cast<uint4*>(out)[0] = make_uint4(q[0], q[1], q[2], q[3]);
  reinterpret_cast<uint4*>(out)[1] = make_uint4(q[4], q[5], q[6], q[7]);
  return static_cast<std::uint8_t>(e + fp8::kE8m0Bias);
}

__global__ void __launch_bounds__(kThreads) mxfp8_quantize_kernel(fp8::MxParams p) {
  __shared__ __align__(16) std::uint16_t tile[fp8::kBlock][kStride];
  const std::int64_t col_tiles = p.N / fp8::kBlock, row_tiles = p.M / fp8::kBlock;
  const std::int64_t tc = blockIdx.x % col_tiles, tr = (blockIdx.x / col_tiles) % row_tiles,
                     e = blockIdx.x / (col_tiles * row_tiles);
  const std::int64_t m0 = tr * fp8::kBlock, n0 = tc * fp8::kBlock;
  const std::uint16_t* x = p.x + (e * p.M + m0) * p.N + n0;
  for (int idx = threadIdx.x; idx < fp8::kBlock * 16; idx += kThreads) {  // 16-byte chunks
    const int r = idx / 16, c = (idx % 16) * 8;
    *reinterpret_cast<uint4*>(&tile[r][c]) = *reinterpret_cast<const uint4*>(x + r * p.N + c);
  }
  __syncthreads();
#pragma unroll 1
  for (int u = threadIdx.x; u < 512; u += kThreads) {
    float v[32];
    if (p.data != nullptr) {  // along N: row i, 32-block j of the tile
      const int i = u / 4, j = u % 4;
#pragma unroll
      for (int t = 0; t < 32; ++t) v[t] = bf16_bits_to_float(tile[i][32 * j + t]);
      const std::int64_t r = e * p.M + m0 + i;
      const std::uint8_t byte = quantize_mx_block(v, p.data + r * p.N + n0 + 32 * j);
      p.scales[fp8::mx_scale_index(r, n0 / 32 + j, p.N)] = byte;
    }
    if (p.data_t != nullptr) {  // along M: column c, 32-block jm of the tile
      const int c = u % 128, jm = u / 128;
#pragma unroll
      for (int t = 0; t < 32; ++t) v[t] = bf16_bits_to_float(tile[32 * jm + t][c]);
      const std::int64_t r = e * p.N + n0 + c;
      const std::uint8_t byte = quantize_mx_block(v, p.data_t + r * p.M + m0 + 32 * jm);
      p.scales_t[fp8::mx_scale_index(r, m0 / 32 + jm, p.M)] = byte;
    }
  }
}

}  // namespace

void launch_mxfp8_quantize(const fp8::MxParams& p, int device, void* stream) {
  require_current_device(device);
  const std::int64_t tiles = p.E * (p.M / fp8::kBlock) * (p.N / fp8::kBlock);
  if (tiles == 0) return;
  mxfp8_quantize_kernel<<<static_cast<unsigned>(tiles), kThreads, 0,
                          static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("mxfp8_quantize");
}

}  // namespace mok::cuda
