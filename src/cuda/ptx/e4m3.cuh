// Conversions to e4m3 (sm_90a): the one instruction every FP8 quantizer of mok rounds with, for the
// quantization kernels (cuda/kernels/fp8_quantize.cuh) and the GEMM epilogues that quantize their
// outputs (cuda/gemm/epilogue.cuh), so that both give core/fp8.hpp's bits.
#pragma once

#include <cstdint>

namespace mok::ptx {

// Two e4m3 bytes from two floats, `lo` in the low byte: cvt.rn.satfinite.e4m3x2.f32, the
// instruction fp8::e4m3_from_float uses for one value.
__device__ __forceinline__ std::uint32_t e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// fp8::quantize_value of four values, packed little-endian (a in the low byte).
__device__ __forceinline__ std::uint32_t quantize4(float a, float b, float c, float d,
                                                   float inverse_scale) {
  return e4m3x2(a * inverse_scale, b * inverse_scale) |
         (e4m3x2(c * inverse_scale, d * inverse_scale) << 16);
}

// The largest of the amax bits (fp8::amax_update's) that the four lanes of a quad hold (lanes
// 4q .. 4q + 3), given to each of them: a 1x128 block spread over a quad (the GEMM epilogues that
// quantize, the token-axis quantizers). Every lane of the warp calls it.
__device__ __forceinline__ std::uint32_t quad_amax(std::uint32_t amax) {
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {
    const std::uint32_t other = __shfl_xor_sync(0xffffffffu, amax, offset);
    amax = other > amax ? other : amax;
  }
  return amax;
}

}  // namespace mok::ptx
