// Helpers of the GPU tests that run on Hopper only (the GEMM engine and its PTX wrappers): the
// skip when no sm_90 GPU is visible, fresh random seeds, and an RAII device buffer.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace mok::test {

inline bool have_hopper_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  return prop.major == 9;
}

// A new seed on every call, different in every run (tests print or trace the ones they use).
inline std::uint64_t fresh_seed() {
  static std::uint64_t s = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ std::random_device{}();
  return ++s;
}

template <typename T>
struct Buffer {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Buffer(std::size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)) != cudaSuccess) {
      p = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << count * sizeof(T) << " bytes failed";
    }
  }
  explicit Buffer(const std::vector<T>& h) : Buffer(h.size()) { upload(h); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::vector<T> host() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  void upload(const std::vector<T>& h) {
    cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  void poison() { cudaMemset(p, 0xff, n * sizeof(T)); }  // 0xffff...: NaN in bf16 and fp32
};

}  // namespace mok::test

#define REQUIRE_HOPPER() \
  if (!mok::test::have_hopper_gpu()) GTEST_SKIP() << "no Hopper (sm_90) GPU visible"
