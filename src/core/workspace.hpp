// What a Workspace holds. Internal: backends include this, users do not.
#pragma once

#include <memory>

#include "core/backend.hpp"
#include "core/validate.hpp"
#include "mok/api.hpp"

namespace mok {

struct Workspace::Impl {
  Problem problem;
  Config config;
  WorkspaceOptions options;
  Backend backend = Backend::cpu;
  std::unique_ptr<LayerBackend> layer;  // cpu: the reference; cuda: the CUDA layer
  void* stream = nullptr;               // cudaStream_t of the next calls (cuda backend)
  Workspace::CallCounts calls;
};

// Shared by the entry points (src/api/api.cpp, src/api/host_ep.cpp).
Device device_of(const Workspace::Impl& ws);
// The forward context's views against the workspace's layout (shapes, dtype, device).
void check_context(const Workspace& ws, const ForwardContext& c);
// Throws unless the workspace runs its calls by itself: one rank, or a cuda rank of a team across
// processes (`call` names the entry point refused; the cpu backend's ranks go through host_ep).
void require_one_rank(const Workspace::Impl& ws, const char* call);
// The FP8 layer's own requirements beside the bf16 layer's checks: on the cuda backend a workspace
// made with WorkspaceOptions::fp8 (else mok::Error naming it), then validate.hpp's
// check_fp8_layer.
void check_fp8_call(const Workspace::Impl& ws, const Fp8Weights& q, InputUse use);
// An FP8 backward's weight gradients: e4m3 ones (BackwardOptions::fp8_weight_grads) on the cuda
// backend need a workspace made with WorkspaceOptions::fp8_token_axis (else mok::Error naming it).
void check_fp8_weight_grads(const Workspace::Impl& ws, const BackwardOptions& options);

}  // namespace mok
