// The few CUDA runtime facts the host side needs, available whether or not CUDA is compiled in.
#pragma once

#include <string>

namespace mok::cuda {

bool compiled();                // this build has the CUDA backend's sources
int device_count();             // 0 when not compiled or no device
std::string device_summary(int index);  // "NVIDIA H200, sm_90, 132 SMs" or the reason it failed

// Launches one small kernel on `index` and checks its result: the GPU smoke test.
// Returns an empty string on success, else what went wrong.
std::string smoke_test(int index);

}  // namespace mok::cuda
