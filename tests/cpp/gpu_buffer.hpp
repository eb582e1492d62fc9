// Device memory for GPU tests: RAII buffers, checked CUDA calls, and a skip when no GPU.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/backend.hpp"

#define MOK_CUDA_OK(call)                                                              \
  do {                                                                                 \
    const cudaError_t mok_err_ = (call);                                               \
    ASSERT_EQ(mok_err_, cudaSuccess) << #call << ": " << cudaGetErrorString(mok_err_); \
  } while (0)

#define MOK_SKIP_WITHOUT_GPU()                                                    \
  do {                                                                            \
    if (mok::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

namespace mok::test {

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t count = 0) : count_(count) {
    if (count_ && cudaMalloc(&ptr_, count_ * sizeof(T)) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << count_ * sizeof(T) << " bytes failed";
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  std::size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  void poison() { cudaMemset(ptr_, 0xff, count_ * sizeof(T)); }  // NaN in every float format

 private:
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace mok::test
