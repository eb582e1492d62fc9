// The scalar maths of mok's FP8 (docs/architecture.md, "The FP8 layer"), one definition for the
// host reference and the CUDA kernels: e4m3 <-> float, the power-of-two block scale, the
// quantization of one value. Integer and power-of-two arithmetic only, so host and device agree bit
// for bit.
//
// e4m3 (OCP "E4M3FN", torch.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
// infinities; S.1111.111 is NaN; the largest finite value is 448 (S.1111.110); subnormals
// m * 2^-9, m in 1..7. mok stores e4m3 values as bytes (DType::fp8_e4m3).
//
// The block scale, MoK's rule (MoK's csrc/mxfp8.cuh, quantize_single_block, read for its
// semantics):
//   amax   the largest |x| of the block; NaN elements are ignored (MoK takes the maximum with
//          __hmax, which returns the other operand of a NaN); a block of NaNs only has amax 0
//   e      ceil(log2(amax / 448)), clamped to [-39, 127]: MoK computes max(amax * (1/448 as a
//          float), 1e-12) and rounds it up to a power of two, saturating (cvt.rp.satfinite.
//          ue8m0x2.f32); 1e-12 rounds up to 2^-39, so amax below 448 * 2^-39 (about 8.1e-10, zero
//          included) gets 2^-39; an infinite amax saturates to 2^127. For every finite amax of a
//          bf16 or fp32 block this equals the exact ceil(log2(amax / 448)) computed below from the
//          bits (tests/cpp/test_fp8.cpp checks it against MoK's float expression on every bf16
//          value and the fp32 values around each power of two).
//          NOTES: MoK's Python reference quantizer (tests/utils.py) clamps at 2^-127 instead; it
//          and MoK's kernel differ only for blocks with amax below 8.1e-10, where mok follows the
//          kernel (what MoK's users get).
//   s      2^e, a normal fp32 (an E8M0 byte e + 127 in MoK's scale tensors).
//   q      e4m3_rn(x * 2^-e): x times an exact power of two, then rounded once to nearest, ties to
//          even, saturating to +-448 (cvt.rn.satfinite.e4m3x2.f32, as MoK's kernel). Since
//          |x| <= 448 s the saturation never triggers for a finite block. NaN gives 0x7F (the
//          canonical NaN, sign dropped, as the instruction writes it). A block whose amax is
//          infinite has e = 127, whose inverse MoK builds as the float of bits (254 - 254) << 23,
//          that is 0: its finite elements become +-0 and its infinities and NaNs 0x7F (NaN). mok
//          keeps that rule, so an MX block and a mok block of the same values hold the same bytes.
//   dequantized value  decode(q) * s; for a finite block, |x - decode(q) s| <= max(2^-4 |x|,
//          2^-10 s) (half an e4m3 ulp: 2^-4 relative in the normal range, 2^-10 in units of s in
//          the subnormal range below 2^-6).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/numerics.hpp"  // MOK_HOST_DEVICE

namespace mok::fp8 {

using e4m3_t = std::uint8_t;  // raw e4m3 bits

inline constexpr int kBlock = 128;   // mok's scale blocks: 1x128 (activations), 128x128 (weights)
inline constexpr int kMxBlock = 32;  // MoK's MX blocks: 1x32 along K
inline constexpr float kE4m3Max = 448.0f;
inline constexpr int kMinScaleExponent = -39;  // MoK's clamp: 1e-12 rounded up
inline constexpr int kMaxScaleExponent = 127;  // E8M0's largest finite scale (saturation)
inline constexpr int kE8m0Bias = 127;
inline constexpr e4m3_t kE4m3Nan = 0x7F;

MOK_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}

MOK_HOST_DEVICE inline float bits_float(std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

// The running block maximum: `amax_bits` (the bits of a non-negative float, 0 to start) and the
// next element. NaN is ignored (see the top of this file); +-inf counts as inf. On the bits: for
// non-negative floats the integer order is the value order.
MOK_HOST_DEVICE inline std::uint32_t amax_update(std::uint32_t amax_bits, float x) {
  const std::uint32_t a = float_bits(x) & 0x7fffffffu;
  return a <= 0x7f800000u && a > amax_bits ? a : amax_bits;
}

// e = ceil(log2(amax / 448)) clamped to [kMinScaleExponent, kMaxScaleExponent], from the bits of
// amax (>= 0, not NaN). amax = (1 + f) 2^E (normal), 448 = 1.75 * 2^8, so amax / 448 =
// ((1 + f) / 1.75) 2^(E - 8) with (1 + f) / 1.75 in [0.571, 1.143): the ceiling is E - 8 when
// 1 + f <= 1.75 (mantissa field <= 0x600000) and E - 7 above. Subnormal amax (< 2^-126) is far
// below the clamp.
MOK_HOST_DEVICE inline int scale_exponent(std::uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return kMaxScaleExponent;  // inf (NaN never gets here)
  const int biased = static_cast<int>(amax_bits >> 23);
  if (biased == 0) return kMinScaleExponent;  // zero or subnormal
  const int e = biased - 127 - 8 + ((amax_bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  return e < kMinScaleExponent ? kMinScaleExponent : e;
}

// 2^e for e in [kMinScaleExponent, kMaxScaleExponent] (a normal float).
MOK_HOST_DEVICE inline float scale_of(int e) {
  return bits_float(static_cast<std::uint32_t>(e + 127) << 23);
}

// What the values are multiplied by before rounding: 2^-e, except 0 for e = 127 (MoK builds the
// inverse as the float of bits (254 - byte) << 23; see the top of this file).
MOK_HOST_DEVICE inline float inverse_scale_of(int e) {
  return bits_float(static_cast<std::uint32_t>(127 - e) << 23);
}

// The exponent of a mok fp32 scale (a power of two 2^e, e in the range above).
MOK_HOST_DEVICE inline int exponent_of_scale(float s) {
  return static_cast<int>(float_bits(s) >> 23) - 127;
}

// float -> e4m3, round to nearest, ties to even, saturating to +-448; NaN -> 0x7F. The integer
// form, bit-exact with cvt.rn.satfinite.e4m3x2.f32 (tests/cpp/test_fp8_gpu.cu compares the two
// on every float).
MOK_HOST_DEVICE inline e4m3_t e4m3_from_float_exact(float v) {
  const std::uint32_t b = float_bits(v);
  const auto sign = static_cast<e4m3_t>((b >> 24) & 0x80u);
  const std::uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return kE4m3Nan;
  // |v| > 464 (448 + half an ulp) saturates; 464 itself ties to 448 (even mantissa), and so
  // does everything in [448, 464).
  if (a >= 0x43e00000u) return static_cast<e4m3_t>(sign | 0x7eu);  // |v| >= 448
  if (a >= 0x3c800000u) {                                          // |v| >= 2^-6: normal
    // Keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped ones to nearest even (a carry
    // moves into the exponent, as it should), then rebias the exponent (127 -> 7).
    const std::uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    return static_cast<e4m3_t>(sign | (r - (120u << 3)));
  }
  // Subnormal range: m = round(|v| * 2^9) in 0..8 (8 is the smallest normal, 0x08).
  const int biased = static_cast<int>(a >> 23);
  if (biased < 127 - 10) return sign;  // |v| < 2^-10: below half the smallest subnormal
  const std::uint32_t significand = (a & 0x7fffffu) | 0x800000u;
  const int shift = 14 - (biased - 127);  // significand * 2^(E - 23) * 2^9 = significand >> shift
  std::uint32_t m = significand >> shift;
  const std::uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (m & 1u))) ++m;
  return static_cast<e4m3_t>(sign | m);
}

// float -> e4m3 as the quantizers use it: on the GPU the conversion instruction (what MoK's
// kernels use), on the host the integer form above; the same bits (checked on every float).
MOK_HOST_DEVICE inline e4m3_t e4m3_from_float(float v) {
#if defined(__CUDA_ARCH__)
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
  return static_cast<e4m3_t>(pair & 0xffu);
#else
  return e4m3_from_float_exact(v);
#endif
}

// e4m3 -> float (exact; NaN -> a quiet NaN of the same sign).
MOK_HOST_DEVICE inline float e4m3_to_float(e4m3_t q) {
  const std::uint32_t sign = static_cast<std::uint32_t>(q & 0x80u) << 24;
  const std::uint32_t exp = (q >> 3) & 0xfu, man = q & 0x7u;
  if (exp == 0xfu && man == 0x7u) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) {
    // m * 2^-9, exact in fp32 (m * 2^-9 as the product of two exact floats).
    const float v = static_cast<float>(man) * bits_float((127u - 9u) << 23);
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// One value of a block of exponent e: e4m3_from_float(x * inverse_scale_of(e)).
MOK_HOST_DEVICE inline e4m3_t quantize_value(float x, float inverse_scale) {
  return e4m3_from_float(x * inverse_scale);
}

// The exponent of a 128x128 block of an MX weight (mx_weights_to_blocks): the largest of its
// 128 x 4 E8M0 bytes, skipping 255 (E8M0's NaN), as the running maximum mx_max_byte (start at
// -1), then mx_block_exponent: that byte's exponent clamped to mok's scale range; a block of NaN
// scales only gets kMinScaleExponent.
inline constexpr std::uint8_t kE8m0Nan = 0xFF;

MOK_HOST_DEVICE inline int mx_max_byte(int max_byte, std::uint8_t b) {
  return b != kE8m0Nan && b > max_byte ? b : max_byte;
}

MOK_HOST_DEVICE inline int mx_block_exponent(int max_byte) {
  const int e = max_byte < 0 ? kMinScaleExponent : max_byte - kE8m0Bias;
  if (e < kMinScaleExponent) return kMinScaleExponent;
  return e > kMaxScaleExponent ? kMaxScaleExponent : e;
}

// The MX-to-block conversion of one value (mx_weights_to_blocks): q held under the scale
// 2^(E - d), d >= 0, becomes q' under 2^E, its block's largest exponent. q' = e4m3_rn(decode(q) *
// 2^-d): exact while the value stays representable; where it falls into e4m3's subnormals, low
// bits are rounded off (to nearest even), and below 2^-10 it becomes +-0. `exact` says whether
// decode(q') 2^d == decode(q). NaN stays NaN (0x7F) and counts as exact.
struct Rebased {
  e4m3_t q;
  bool exact;
};

MOK_HOST_DEVICE inline Rebased rebase_value(e4m3_t q, int d) {
  if ((q & 0x7fu) == 0x7fu) return {kE4m3Nan, true};
  if (d == 0) return {q, true};
  // NOTES: beyond d = 20 every e4m3 value (< 2^9) lands below 2^-10 and rounds to +-0; the cut
  // at 30 keeps 2^-d a normal float and decode(q) 2^-d exact (>= 2^-39).
  if (d > 30) return {static_cast<e4m3_t>(q & 0x80u), (q & 0x7fu) == 0};
  const float v = e4m3_to_float(q) * scale_of(-d);
  const e4m3_t r = e4m3_from_float(v);
  return {r, e4m3_to_float(r) == v};
}

// One element of that conversion: q under the E8M0 byte b, in a block of exponent e_block
// (>= b's exponent). Under a NaN scale (b = 255) the value is NaN: 0x7F, counted as exact.
MOK_HOST_DEVICE inline Rebased mx_rebase(e4m3_t q, std::uint8_t b, int e_block) {
  if (b == kE8m0Nan) return {kE4m3Nan, true};
  return rebase_value(q, e_block - (static_cast<int>(b) - kE8m0Bias));
}

}  // namespace mok::fp8
