// mok's FP8 (docs/architecture.md, "The FP8 layer"): e4m3 values with power-of-two fp32 scales
// per 1x128 block of activations and per 128x128 block of weights; and MoK's MXFP8 (1x32 blocks,
// E8M0 scales).
//
//   mok::QuantizedWeights q = mok::quantized_weights_views(
//       mok::quantized_weights_layout(E, N, K), buffer, device);   // buffer: layout.bytes bytes
//   mok::quantize_weights(w, q, stream);                          // w bf16 [E, N, K]
//
// Every call runs where its views are: host views on the CPU reference (src/reference/
// fp8_quant.cpp), CUDA views on the GPU (one launch on `stream`, a cudaStream_t, on the current
// device, which must be the views'; no host synchronization). Both give the same bits. Views are
// row-major contiguous; on a CUDA device each starts at a multiple of 16 bytes. Bad arguments
// raise mok::Error naming the argument, the expected and the actual value.
//
// The numbers (core/fp8.hpp has the derivation): a block's scale is s = 2^e, e = ceil(log2(amax /
// 448)) clamped to [-39, 127] as MoK clamps its E8M0 scales (amax = 0 gives 2^-39; NaNs are left
// out of amax; an infinite amax gives 2^127 and the block's finite values 0); each value is
// q = e4m3(x / s), rounded to nearest even. The dequantized value q s is within max(2^-4 |x|,
// 2^-10 s) of x.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mok/tensor.hpp"

namespace mok {

// A routed weight [E, N, K] in 128x128 blocks, in both orientations from the same blocks (the
// transposed copy holds the same bytes and scales, transposed): the forward reads `data`, the
// dgrad `data_t` (wgmma reads FP8 operands K-major only).
struct QuantizedWeights {
  TensorView data;      // fp8_e4m3 [E, N, K]
  TensorView scales;    // float32 [E, N/128, K/128]: scales[e, n/128, k/128] is s of (n, k)
  TensorView data_t;    // fp8_e4m3 [E, K, N]: data_t[e, k, n] = data[e, n, k]
  TensorView scales_t;  // float32 [E, K/128, N/128]
};

// Where a QuantizedWeights lives in one buffer: data, data_t, scales, scales_t in that order,
// each at a multiple of 256 bytes.
struct QuantizedWeightsLayout {
  std::int64_t E = 0, N = 0, K = 0;
  std::size_t data_offset = 0, data_t_offset = 0, scales_offset = 0, scales_t_offset = 0;
  std::size_t bytes = 0;
};

// N and K multiples of 128, all three positive (else mok::Error naming them).
QuantizedWeightsLayout quantized_weights_layout(std::int64_t E, std::int64_t N, std::int64_t K);
QuantizedWeights quantized_weights_views(const QuantizedWeightsLayout& layout, void* buffer,
                                         Device device = {});

// bf16 w [E, N, K] (N, K multiples of 128) -> out, every block read once.
void quantize_weights(const TensorView& w, const QuantizedWeights& out, void* stream = nullptr);

// MoK's MX weight (data fp8_e4m3 [E, N, K], scales uint8 [E*N/128, K/128, 32, 16], MoK's
// mxfp8_quantize layout) -> mok's blocks: each block's scale is its largest 1x32 scale, each
// value rebased onto it. Exact unless a value falls into e4m3's subnormals: in a 1x32 sub-block
// whose scale is 2^d times smaller than its block's, values below 2^(d-6) times the sub-block's
// scale lose bits and those below 2^(d-10) times it become 0 (the error stays within 2^-10 of
// the block's scale). A 255 scale byte (E8M0's NaN) makes its values NaN. `inexact_count`
// (int64 [1], on the views' device) receives the number of values that changed.
void mx_weights_to_blocks(const TensorView& data, const TensorView& scales,
                          const QuantizedWeights& out, const TensorView& inexact_count,
                          void* stream = nullptr);

// Activations x [M, K] (bf16 or float32), 1x128 blocks along K (K a multiple of 128):
// data fp8_e4m3 [M, K], scales float32 [K/128, M] (scales[kb, m] is s of x[m, kb*128 ..]).
void quantize_rows(const TensorView& x, const TensorView& data, const TensorView& scales,
                   void* stream = nullptr);

// The token-axis form (128x1 blocks, the 1x128 blocks of x^T; M a multiple of 128), what a
// weight gradient reads: data fp8_e4m3 [K, M] (x^T), scales float32 [M/128, K].
void quantize_token_axis(const TensorView& x, const TensorView& data, const TensorView& scales,
                         void* stream = nullptr);

// MoK's mxfp8_quantize: bf16 x [M, N] or [E, M, N] (M, N multiples of 128) -> x_fp8 (x's shape,
// fp8_e4m3) with x_sc (uint8 [E*M/128, N/128, 32, 16]) and/or x_fp8_t ([N, M] or [E, N, M]) with
// x_sc_t (uint8 [E*N/128, M/128, 32, 16]); an absent pair is not computed (at least one given).
// 1x32 blocks along the last axis, E8M0 scale bytes; bit-exact with MoK's.
void mxfp8_quantize(const TensorView& x, const TensorView& x_fp8, const TensorView& x_sc,
                    const TensorView& x_fp8_t, const TensorView& x_sc_t, void* stream = nullptr);

}  // namespace mok
