// The shape of one MoE layer on one rank (DESIGN.md section 1 and 2).
#pragma once

#include <cstdint>
#include <string>

#include "mok/tensor.hpp"

namespace mok {

// bf16 tiles need hidden, intermediate and shared sizes to be multiples of this (DESIGN.md rule 4).
inline constexpr std::int64_t kBf16SizeAlignment = 64;

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

  // Throws mok::Error naming the first field that is out of range. `activation_dtype` adds the
  // alignment rules of that precision (bf16: H, I, S multiples of kBf16SizeAlignment).
  void validate(DType activation_dtype) const;

  std::string to_string() const;
};

}  // namespace mok
