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

// Which inputs a call reads: all of them (forward, backward), or only those the forward context
// depends on (recompute_forward_context: topk_weights, down and shared_down may be absent).
enum class InputUse : std::uint8_t { forward, context_only };

// Whether a call reads the routed weights of `Weights` (the bf16 layer) or not (the FP8 layer,
// which reads Fp8Weights: `Weights`' routed views may then be absent; present, they are checked).
enum class RoutedWeights : std::uint8_t { read, not_read };

// Inputs and weights of a call on `device` at precision `act`. On a CUDA device every bf16 view
// must also be 16-byte aligned (the kernels move 16-byte vectors and TMA boxes).
void check_inputs(const Problem& p, DType act, Device device, const Inputs& in, const Weights& w,
                  InputUse use = InputUse::forward, RoutedWeights routed = RoutedWeights::read);

// The weights alone (check_inputs' second half).
void check_weights(const Problem& p, DType act, Device device, const Weights& w,
                   InputUse use = InputUse::forward, RoutedWeights routed = RoutedWeights::read);

// The FP8 layer's arguments: H and I multiples of 128, a bf16 activation dtype, and each of
// `q`'s weights a QuantizedWeights of its routed weight's shape with all four views (the
// forward's and the dgrad's orientation). With InputUse::context_only q.down may be absent (all
// four views).
void check_fp8_layer(const Problem& p, DType act, Device device, const Fp8Weights& q,
                     InputUse use = InputUse::forward);

// Weights::swiglu_limit, when present: a finite positive float (the error names the value).
void check_swiglu_limit(const std::optional<float>& limit);

// `v` (when present) starts at a multiple of 16 bytes; the error names the view and its address.
void check_aligned_16(const char* name, const TensorView& v);

// Every topk_experts entry in [-1, E). Host-readable ids only (CPU backend).
void check_expert_ids_host(const Problem& p, const TensorView& topk_experts);

// Every rank's ids, concatenated in rank order ([ep_size * T, k], host-readable), in [-1, E);
// the error names the rank, the token and the slot.
void check_expert_ids_all_ranks(const Problem& p, const TensorView& topk_experts_all);

// Gradient views; on a CUDA device each also 16-byte aligned.
void check_grads(const Problem& p, DType act, Device device, const Grads& g,
                 const BackwardOptions& options);

}  // namespace mok
