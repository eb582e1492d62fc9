// What every GPU test shares: the skip when no Hopper GPU is visible (MOK_REQUIRE_HOPPER), checked
// CUDA calls (MOK_CUDA_OK), and the one RAII device buffer (DeviceBuffer). Tensors of the layer's
// API (a TensorView over a HostTensor) use cuda::DeviceTensor (src/synthetic/device_layer.hpp),
// which the CLI shares; raw device memory in the tests is a DeviceBuffer.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace mok::test {

// Why this process cannot run mok's GPU tests, or "" if it can. The library's kernels are built
// for sm_90a only (Hopper: H100, H200, GH200), so a GPU test needs device 0 (the one the tests
// use) to be sm_90; on any other device its launches would fail rather than test anything.
inline std::string hopper_skip_reason() {
  static const std::string reason = []() -> std::string {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      return e != cudaSuccess
                 ? std::string("no CUDA device visible (") + cudaGetErrorString(e) + ")"
                 : std::string("no CUDA device visible");
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return "the properties of CUDA device 0 cannot be read";
    }
    if (prop.major != 9 || prop.minor != 0) {
      return std::string("CUDA device 0 is ") + prop.name + " (sm_" + std::to_string(prop.major) +
             std::to_string(prop.minor) + "), not a Hopper (sm_90) GPU: mok's kernels are sm_90a";
    }
    return "";
  }();
  return reason;
}

}  // namespace mok::test

// The first statement of every GPU test (or of its fixture's SetUp): skips the test, visibly
// ("[  SKIPPED ]" with the reason; ctest reports it as skipped, not passed), unless device 0 is a
// Hopper GPU.
#define MOK_REQUIRE_HOPPER()                                              \
  do {                                                                    \
    const std::string mok_skip_reason_ = mok::test::hopper_skip_reason(); \
    if (!mok_skip_reason_.empty()) GTEST_SKIP() << mok_skip_reason_;      \
  } while (0)

// A CUDA runtime call that must succeed (a fatal assertion: the test stops here otherwise).
#define MOK_CUDA_OK(call)                                                              \
  do {                                                                                 \
    const cudaError_t mok_err_ = (call);                                               \
    ASSERT_EQ(mok_err_, cudaSuccess) << #call << ": " << cudaGetErrorString(mok_err_); \
  } while (0)

namespace mok::test {

// `count` elements of T in device memory, freed with the buffer. Never a null pointer: an empty
// buffer holds one element's room, so a zero-size buffer passed where null means "absent" cannot
// change what a launch does. Failures of its CUDA calls fail the test (non-fatally).
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t count = 0) : count_(count) {
    const std::size_t bytes = std::max<std::size_t>(count_, 1) * sizeof(T);
    if (const cudaError_t e = cudaMalloc(&ptr_, bytes); e != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << bytes << " bytes: " << cudaGetErrorString(e);
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }

  // The first host.size() elements (at most size()) from the host.
  void upload(const std::vector<T>& host) {
    if (host.size() > count_) {
      ADD_FAILURE() << "upload of " << host.size() << " elements into a buffer of " << count_;
      return;
    }
    check(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
          "cudaMemcpy to the device");
  }
  // Every element, copied to the host (after the work on the default stream that wrote them).
  std::vector<T> download() const {
    std::vector<T> host(count_);
    check(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
    return host;
  }
  // Every byte 0xff: NaN in bf16, fp16, fp32 and fp64, so an element nothing wrote is visible.
  void poison() { check(cudaMemset(ptr_, 0xff, bytes()), "cudaMemset"); }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) ADD_FAILURE() << what << ": " << cudaGetErrorString(e);
  }

  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace mok::test
