// What a Workspace holds. Internal: backends include this, users do not.
#pragma once

#include <memory>

#include "core/backend.hpp"
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

}  // namespace mok
