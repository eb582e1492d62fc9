// Argument checks shared by every backend: each failure names the argument, the expected and the
// actual value (dtype, shape, strides, device, or the offending expert id).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "mok/api.hpp"

namespace mok {

// What a view must look like. An empty `shape` list means "must be absent".
void check_view(const char* name, const TensorView& v, DType dtype,
                std::initializer_list<std::int64_t> shape, Device device);

// Same, but accepts either of two dtypes (weight gradients: bf16 or f32).
void check_view_either(const char* name, const TensorView& v, DType a, DType b,
                       std::initializer_list<std::int64_t> shape, Device device);

void check_absent(const char* name, const TensorView& v, const char* why);

// Inputs and weights of a forward/backward call on `device` at precision `act`.
void check_inputs(const Problem& p, DType act, Device device, const Inputs& in, const Weights& w);

// Every topk_experts entry in [-1, E). Host-readable ids only (CPU backend).
void check_expert_ids_host(const Problem& p, const TensorView& topk_experts);

void check_grads(const Problem& p, DType act, Device device, const Grads& g,
                 const BackwardOptions& options);

}  // namespace mok
