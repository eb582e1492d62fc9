#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "core/backend.hpp"

namespace mok::cuda {
namespace {

// y[i] = a * x[i] + i, over a grid-stride loop: touches every element, depends on the index.
__global__ void smoke_kernel(const float* x, float* y, float a, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    y[i] = a * x[i] + static_cast<float>(i);
  }
}

std::string error_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

}  // namespace

bool compiled() {
  return true;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_summary(int index) {
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, index); e != cudaSuccess) {
    return error_text("cudaGetDeviceProperties", e);
  }
  return std::string(prop.name) + ", sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor) + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
}

std::string smoke_test(int index) {
  constexpr int n = 1 << 20;
  if (cudaError_t e = cudaSetDevice(index); e != cudaSuccess) return error_text("cudaSetDevice", e);
  std::vector<float> host(n), back(n, -1.0f);
  for (int i = 0; i < n; ++i) host[i] = static_cast<float>(i % 97) * 0.5f;
  float *x = nullptr, *y = nullptr;
  std::string err;
  if (cudaError_t e = cudaMalloc(&x, n * sizeof(float)); e != cudaSuccess) {
    return error_text("cudaMalloc", e);
  }
  if (cudaError_t e = cudaMalloc(&y, n * sizeof(float)); e != cudaSuccess) {
    cudaFree(x);
    return error_text("cudaMalloc", e);
  }
  cudaMemcpy(x, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(y, 0xff, n * sizeof(float));  // poison: NaN everywhere
  smoke_kernel<<<132, 256>>>(x, y, 3.0f, n);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) err = error_text("launch", e);
  if (err.empty()) {
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) err = error_text("kernel", e);
  }
  if (err.empty()) {
    cudaMemcpy(back.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost);
    for (int i = 0; i < n && err.empty(); ++i) {
      const float want = 3.0f * host[i] + static_cast<float>(i);
      if (back[i] != want) {
        err = "y[" + std::to_string(i) + "] = " + std::to_string(back[i]) + ", expected " +
              std::to_string(want);
      }
    }
  }
  cudaFree(x);
  cudaFree(y);
  return err;
}

}  // namespace mok::cuda
