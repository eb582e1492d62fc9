// Device building blocks of mok's FP8 quantization (core/fp8.hpp's maths), for the quantization
// kernels of this folder and for the layer's epilogues and pulls (issue 42 part 2 fuses them):
//   warp_quantize_block128  one 1x128 block held by a warp, 4 values a lane: the activation rows
//                           form when a warp holds 128 values of a row, the token-axis form when
//                           it holds 128 rows of a column (which values a lane holds is the
//                           caller's choice: the maths is elementwise after the warp's amax)
//   quantize4               four values of a block of known inverse scale, packed
//   store_block_transposed  a 128x128 block of bytes from shared memory into a transposed copy
//   quantize_token_tile     a 128-row x 32-column tile in the token-axis form (the weight
//                           gradients' operands), from any source the caller reads
// Every value goes through the same instruction as fp8::e4m3_from_float on the device, so all of
// them give the CPU reference's bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <string>

#include "core/fp8.hpp"
#include "mok/error.hpp"

namespace mok::cuda {

// bf16 bits -> float (exact, as core/bf16.hpp's bf16_to_float).
__device__ inline float bf16_bits_to_float(std::uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

// Two e4m3 bytes from two floats, `lo` in the low byte: cvt.rn.satfinite.e4m3x2.f32, the
// instruction fp8::e4m3_from_float uses for one value.
__device__ inline std::uint32_t e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// fp8::quantize_value of four values, packed little-endian (a in the low byte).
__device__ inline std::uint32_t quantize4(float a, float b, float c, float d, float inverse_scale) {
  return e4m3x2(a * inverse_scale, b * inverse_scale) |
         (e4m3x2(c * inverse_scale, d * inverse_scale) << 16);
}

// The block amax (bits, core/fp8.hpp's amax_update) across the 32 lanes of a warp.
__device__ inline std::uint32_t warp_amax(std::uint32_t amax_bits) {
  return __reduce_max_sync(0xffffffffu, amax_bits);
}

// One 128-value block held by a full warp (every lane calls it), four values a lane: returns the
// lane's four bytes packed (v[0] in the low byte) and the block's scale in *scale.
__device__ inline std::uint32_t warp_quantize_block128(const float (&v)[4], float* scale) {
  std::uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = fp8::amax_update(amax, v[i]);
  const int e = fp8::scale_exponent(warp_amax(amax));
  *scale = fp8::scale_of(e);
  return quantize4(v[0], v[1], v[2], v[3], fp8::inverse_scale_of(e));
}

// The transposed copy of one 128x128 block: q[i][j] (shared memory, rows of `q_stride` bytes,
// i along N, j along K) to out[j][i] of an output with rows of `ld` bytes (out points at the
// block's first element). 256 threads (all call it after the block is in shared memory): a
// thread writes 16 consecutive bytes of four output rows; a warp's lanes take consecutive j, so
// its shared-memory reads of one row i are conflict-free.
inline constexpr int kTransposeThreads = 256;

__device__ inline void store_block_transposed(const std::uint8_t* q, int q_stride,
                                              std::uint8_t* out, std::int64_t ld) {
  const int j = threadIdx.x % 128;
#pragma unroll 1
  for (int chunk = threadIdx.x / 128; chunk < 8; chunk += kTransposeThreads / 128) {
    std::uint32_t w[4];
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      std::uint32_t packed = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        packed |= static_cast<std::uint32_t>(q[(chunk * 16 + word * 4 + b) * q_stride + j])
                  << (8 * b);
      }
      w[word] = packed;
    }
    *reinterpret_cast<uint4*>(out + j * ld + chunk * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The token-axis form of one tile of 128 rows (one block along the tokens) and kTokenTileCols
// columns from k0: `value(r, c)` is the source element at row r of the block and column k0 + c
// (called for c < K - k0 only; it gives 0 for rows the block leaves out). A CTA of
// kTokenTileThreads threads stages the tile in shared memory with coalesced loads, then each warp
// quantizes columns, one 128-row block each (lane l holds rows l, l+32, l+64, l+96: conflict-free
// reads of a column), into data[k * ld + r] (data at the block's first row, the transpose) and
// scales[k] (the block's row of scales). Every thread of the CTA calls it.
inline constexpr int kTokenTileCols = 32;
inline constexpr int kTokenTileThreads = 256;

template <class Value>
__device__ inline void quantize_token_tile(Value value, std::int64_t k0, std::int64_t K,
                                           std::uint8_t* data, std::int64_t ld, float* scales) {
  __shared__ float tile[fp8::kBlock][kTokenTileCols + 1];  // an odd row stride: 32 banks a column
  for (int idx = threadIdx.x; idx < fp8::kBlock * kTokenTileCols; idx += kTokenTileThreads) {
    const int r = idx / kTokenTileCols, c = idx % kTokenTileCols;
    tile[r][c] = k0 + c < K ? value(r, c) : 0.0f;  // columns past K are never stored
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int c = warp; c < kTokenTileCols; c += kTokenTileThreads / 32) {
    const std::int64_t k = k0 + c;
    if (k >= K) break;  // the same for the whole warp
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = tile[lane + 32 * i][c];
    float scale;
    const std::uint32_t q = warp_quantize_block128(v, &scale);
    std::uint8_t* column = data + k * ld;
#pragma unroll
    for (int i = 0; i < 4; ++i) column[lane + 32 * i] = static_cast<std::uint8_t>(q >> (8 * i));
    if (lane == 0) scales[k] = scale;
  }
}

// The largest of every thread's amax in a CTA of `threads` (a multiple of 32, at most 1024);
// `scratch` holds threads / 32 words of shared memory. Every thread gets the result.
__device__ inline std::uint32_t cta_amax(std::uint32_t amax_bits, std::uint32_t* scratch,
                                         int threads) {
  const std::uint32_t w = warp_amax(amax_bits);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = w;
  __syncthreads();
  std::uint32_t m = 0;
  for (int i = 0; i < threads / 32; ++i) m = m > scratch[i] ? m : scratch[i];
  return m;
}

// Host side of every quantization launch: the views' device must be the current one (the launch
// runs there), and a failed launch raises mok::Error naming the kernel.
inline void require_current_device(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("no CUDA device can be used by the FP8 quantization kernels");
  }
  if (current != device) {
    throw Error("tensors' device", "the current CUDA device cuda:" + std::to_string(current),
                "cuda:" + std::to_string(device));
  }
}

inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Error(std::string(kernel) + " launch failed: " + cudaGetErrorString(e));
}

inline unsigned grid_for(std::int64_t work, int per_block) {
  const std::int64_t b = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 1048576 ? 1048576 : b));
}

}  // namespace mok::cuda
