// Checking an FP8 layer result (api.hpp, Fp8Weights; docs/architecture.md, "The FP8 layer"), as
// `mok run --precision fp8` (and fp8-bf16-wgrad) does, two ways:
//
// 1. Against the CPU FP8 layer (the reference: src/reference/fp8_layer.hpp) over weights quantized
//    on the host (the device's quantizer gives the same bits). A result of the CPU backend is that
//    computation, so it must agree bit for bit. A CUDA result differs where wgmma's fp32 sum of a
//    K block's e4m3 products and the reference's exact one fall on two sides of a bf16 rounding:
//    that value moves by one bf16 ulp, and an operand quantized from it may move to the next e4m3
//    value (2^-3 of one term of the next GEMM). Such flips are scattered, so whole tensors agree
//    within sum|diff| / sum|ref| <= 2^-5, and no row strays by more than 1/4 (a flip moves one
//    element by at most an e4m3 step, 2^-3 of it, while a row of the wrong expert, a missing
//    block scale or a block read from the wrong place is off by 50% or more). The bounds are
//    tests/cpp/test_fp8_layer_gpu.cpp's.
// 2. Against the f64 layer of the unquantized bf16 values (check.hpp's check_against_f64, whose
//    entries carry MoK's measures) with MoK's MXFP8 bounds: abs max 1.0 on out and d_x (a weight
//    gradient's size grows with its expert's rows, so an absolute bound says nothing there), sum
//    |diff| / sum |ref| 0.1 and cosine 0.996 on every output and gradient.
//
// Large layers are compared on a sample, as the f64 check samples them (the same tokens and
// experts): every output of the sampled tokens (their rows are computed alone: the rows form
// quantizes each row by itself, and the combine reduces each token by itself), and, for each
// sampled expert, the weight gradients of kFp8SampleColumns consecutive intermediate columns
// over all the expert's rows (a column's token-axis blocks are quantized by themselves). Each is
// computed with the reference's own products and roundings, so on the CPU backend the sample
// agrees bit for bit too. The shared expert's weight gradients are compared only in a full check
// (a sample of them would run the shared expert over every token). With the bf16 routed weight
// gradients (BackwardOptions::fp8_weight_grads false) the reference computes them as the layer
// did, with the reference's own products (Fp8Products::fp8_weight_grads): every element an fp32
// sum over the expert's rows in order, so a sample of columns has the whole tensor's bits.
#pragma once

#include <string>
#include <vector>

#include "synthetic/check.hpp"

namespace mok {

// MoK's MXFP8 tolerances (its tests).
inline constexpr double kMxfp8AbsMax = 1.0;    // out and d_x
inline constexpr double kMxfp8RelSum = 0.1;    // everything
inline constexpr double kMxfp8Cosine = 0.996;  // everything

// Whether abs max is bounded for this output (out and d_x only).
bool mxfp8_abs_max_applies(const std::string& name);
bool within_mxfp8_bounds(const ErrorEntry& e);
bool within_mxfp8_bounds(const CheckReport& r);

// The CUDA FP8 layer against the CPU FP8 layer.
inline constexpr double kFp8ReferenceRelSum = 0x1.0p-5;
inline constexpr double kFp8ReferenceRowRelSum = 0.25;
inline constexpr std::int64_t kFp8SampleColumns = 4;

struct Fp8ReferenceEntry {
  std::string name;
  std::int64_t compared = 0;          // values
  std::int64_t differing = 0;         // values whose bits differ (NaN counts)
  double rel_sum = 0;                 // sum |got - ref| / sum |ref|
  double worst_row = 0;               // the largest sum |got - ref| / sum |ref| of one row
  std::int64_t worst_row_index = -1;  // of the compared rows
  std::int64_t bad_rows = 0;          // rows over kFp8ReferenceRowRelSum
  bool bitwise = false;               // the bound: no differing value (else the two bounds)
  bool passed() const;
};

struct Fp8ReferenceReport {
  bool sampled = false;
  bool bitwise = false;
  std::vector<Fp8ReferenceEntry> entries;
  bool passed() const;
  const Fp8ReferenceEntry* find(const std::string& name) const;  // null: not compared
};

// `got` holds bf16 inputs and what a backend's FP8 layer produced from them (forward and
// backward). `bitwise`: the backend was the CPU one. `fp8_weight_grads`: the BackwardOptions the
// layer's backward was given (false: the routed weight gradients are the bf16 layer's products,
// and the reference computes them so). Full or sampled as check_against_f64 decides with the same
// options.
Fp8ReferenceReport check_against_fp8_reference(const LayerData& got, bool bitwise,
                                               bool fp8_weight_grads,
                                               const CheckOptions& options = {});

// Both checks as a table, one line per output and gradient, each error beside its bound.
std::string fp8_summary(const CheckReport& f64, const Fp8ReferenceReport& reference);

}  // namespace mok
