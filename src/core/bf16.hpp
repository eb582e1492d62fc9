// bf16 <-> float on the host, bit-exact with CUDA's __float2bfloat16_rn / __bfloat162float:
// round to nearest, ties to even; NaN stays NaN (quiet); infinities and overflow to inf preserved.
#pragma once

#include <cstdint>
#include <cstring>

namespace mok {

using bf16_t = std::uint16_t;  // raw bf16 bits on the host

inline float bf16_to_float(bf16_t v) {
  std::uint32_t bits = std::uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline bf16_t float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>(bits >> 16);
}

// The value a float takes once stored as bf16.
inline float round_to_bf16(float f) {
  return bf16_to_float(float_to_bf16(f));
}

}  // namespace mok
