// Checking a bf16 layer result against the exact (f64) layer on the same bf16 numbers.
//
// Tolerances (relative Frobenius error, ||got - ref|| / ||ref||): each bf16 store rounds a value
// with relative error at most u = 2^-8. To first order, errors of successive stores add, with the
// layer's linear maps carrying them at unit gain on well-scaled data. So the bound is u times the
// number of bf16 stores on the longest path to the output (reference.hpp lists them):
//   out:            g/u, h, y, out                                   -> 4 stores
//   d_x:            g/u, h (not on d_x's path), dy, dg/du, dx_row, d_x -> 5 stores
//   d_topk_weights: g/u, h, y                                         -> 3 stores
//   weight grads:   g/u, h or dy, dg/du, grad                         -> 4 stores
// We use 4u for the output and 6u for every gradient (one store of margin for the accumulations
// in fp32 over up to 10^5 terms).
//
// NOTES: d_topk_weights[t, j] = <d_out[t], y[t, j]> is one dot product per element, and a dot
// product's rounding error scales with ||d_out[t]|| ||y[t, j]|| / sqrt(H) (its typical size for
// unrelated vectors), not with its value, which cancellation can make arbitrarily small. Its error
// is therefore measured against that scale: sqrt(sum (got - ref)^2 / sum ||d_out||^2 ||y||^2 / H).
// With many slots the two measures agree; with one token and k = 1 only the scaled one is sound.
#pragma once

#include <string>
#include <vector>

#include "synthetic/synthetic.hpp"

namespace mok {

inline constexpr double kBf16UnitRoundoff = 0x1.0p-8;
inline constexpr double kForwardTolerance = 4 * kBf16UnitRoundoff;
inline constexpr double kGradientTolerance = 6 * kBf16UnitRoundoff;

struct ErrorEntry {
  std::string name;  // "out", "d_x", "d_routed_gate_weights", ...
  double rel_err = 0;
  double tolerance = 0;
  std::int64_t compared = 0;                            // elements compared
  bool passed() const { return rel_err <= tolerance; }  // false for NaN
  // MoK's measures of the same values (its tests' tolerances are in these terms; the FP8 layer is
  // checked with them: `mok run --precision fp8`): max |got - ref|, sum |got - ref| / sum |ref|,
  // and the cosine of got and ref. NaN in either makes them NaN.
  double abs_max = 0, rel_sum = 0, cosine = 1;
};

struct CheckReport {
  bool sampled = false;  // compared a sample of tokens and weight slices, not everything
  std::vector<ErrorEntry> entries;
  bool passed() const;
  double out_rel_err() const;
  double grad_rel_err_max() const;
  std::string summary() const;  // one line per entry
};

struct CheckOptions {
  int num_threads = 0;
  // Full comparison when the f64 layer costs at most this many FLOPs (forward + backward), else a
  // sampled one.
  double max_full_flops = 2e10;
  std::int64_t sample_tokens = 16;
  std::int64_t sample_experts = 4;
  std::int64_t sample_columns = 4;  // intermediate indices per sampled expert
  std::uint64_t seed = 1;
  bool check_backward = true;
};

// `got` holds bf16 inputs and the outputs a backend produced (forward and, if asked, backward).
CheckReport check_against_f64(const LayerData& got, const CheckOptions& options = {});
// Whether the checks of this problem compare a sample (the f64 layer would cost more than
// options.max_full_flops).
bool uses_sample(const Problem& p, const CheckOptions& options);

// Which tokens and experts a sampled check compares (the f64 check and the FP8 reference check
// sample the same ones): `count` distinct indices of [0, n), 0 and n - 1 among them, sorted.
std::vector<std::int64_t> sample_indices(std::int64_t n, std::int64_t count, std::uint64_t seed);
// The slots (t*k + j, increasing) of each local expert.
std::vector<std::vector<std::int64_t>> slots_by_local_expert(const LayerData& d);
// The sampled local experts: sample_experts of them, and the busiest and the idlest.
std::vector<std::int64_t> sampled_experts(const std::vector<std::vector<std::int64_t>>& slots_of,
                                          const CheckOptions& options);

// Relative Frobenius error of two equally long sequences.
double relative_error(const std::vector<double>& got, const std::vector<double>& ref);
// ||got - ref|| / scale_norm (NaN-propagating; 0/0 = 0).
double scaled_error(const std::vector<double>& got, const std::vector<double>& ref,
                    double scale_norm);

}  // namespace mok
