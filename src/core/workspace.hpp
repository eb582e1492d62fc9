// What a Workspace holds, per backend. Internal: backends include this, users do not.
#pragma once

#include <memory>

#include "cuda/runtime.hpp"
#include "mok/api.hpp"
#include "reference/reference.hpp"

namespace mok {

struct Workspace::Impl {
  Problem problem;
  Config config;
  WorkspaceOptions options;
  Backend backend = Backend::cpu;
  std::unique_ptr<reference::State> cpu;  // backend == cpu
  std::unique_ptr<cuda::Layer> gpu;       // backend == cuda
  void* stream = nullptr;                 // cudaStream_t of the next calls (cuda backend)
  Workspace::CallCounts calls;
};

}  // namespace mok
