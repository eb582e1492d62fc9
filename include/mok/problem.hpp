// The shape of one MoE layer on one rank (T tokens of width H, E experts of which this rank holds
// E / W, top-k routing, an optional shared expert).
#pragma once

#include <cstdint>
#include <string>

#include "mok/tensor.hpp"

namespace mok {

// bf16 tiles need hidden, intermediate and shared sizes to be multiples of this (T is arbitrary).
inline constexpr std::int64_t kBf16SizeAlignment = 64;

// Bounds on a Problem's sizes (Problem::validate), so that no size or product of sizes overflows
// what the code computes it in:
//   kMaxSize      every size (T, H, I, S, k): the kernels' TMA coordinates, row ids and tile
//                 counters are 32-bit, and so are the routed rows (ep_size * T * k plus each local
//                 expert's padding: the schedule table's int32 row ids) and the weight rows of a
//                 rank (num_local_experts * max(H, I): the rows of a weight's 2-D tensor map)
//   kMaxExperts   num_experts: each local expert pads its segment of the table to the 128-row
//                 tile and has int32 counters in the workspace; 2^20 experts already add 133M
//                 padding rows
//   kMaxElements  every tensor's elements (a layer's weights, x, the context at its worst-case
//                 rows), so that its bytes fit an int64 in any dtype
inline constexpr std::int64_t kMaxSize = 2147483647;  // 2^31 - 1
inline constexpr std::int64_t kMaxExperts = std::int64_t{1} << 20;
inline constexpr std::int64_t kMaxElements = std::int64_t{1} << 59;

struct Problem {
  std::int64_t num_tokens = 0;                // T: tokens held by this rank (any T >= 1)
  std::int64_t hidden_size = 0;               // H
  std::int64_t intermediate_size = 0;         // I: routed experts' intermediate size
  std::int64_t num_experts = 0;               // E: global expert count
  std::int64_t topk = 0;                      // k: routed slots per token
  std::int64_t shared_intermediate_size = 0;  // S: 0 means no shared expert
  int ep_size = 1;                            // W: ranks in the expert-parallel group
  int ep_rank = 0;                            // this rank, in [0, W)

  std::int64_t num_local_experts() const { return num_experts / ep_size; }
  std::int64_t first_local_expert() const { return num_local_experts() * ep_rank; }
  bool has_shared_expert() const { return shared_intermediate_size > 0; }

  // Rows this rank can receive in the worst case (every slot of every rank on this rank).
  std::int64_t max_routed_rows() const { return std::int64_t{ep_size} * num_tokens * topk; }

  // Routed + shared FLOPs of one forward pass for `routed_rows` rows, counted as MoK does.
  double forward_flops(std::int64_t routed_rows) const;

  // Throws mok::Error naming the first field (or product of fields) that is out of range: the
  // bounds above included. `activation_dtype` adds the alignment rules of that precision (bf16:
  // H, I, S multiples of kBf16SizeAlignment).
  void validate(DType activation_dtype) const;

  std::string to_string() const;
};

}  // namespace mok
