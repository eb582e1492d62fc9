#include "cuda/gemm/tensor_map.hpp"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

#include "mok/error.hpp"

namespace mok::gemm {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  // NOTES: the driver entry point keeps mok off libcuda at link time; resolved once.
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                           cudaEnableDefault, &status);
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
      throw Error("cuTensorMapEncodeTiled is not available from the CUDA driver (" +
                  std::string(cudaGetErrorString(e)) + ")");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A 2-D map whose box is box_rows x one 128-byte swizzle row of `element_bytes`-byte elements.
CUtensorMap make_tensor_map(CUtensorMapDataType type, int element_bytes, const void* base,
                            std::int64_t rows, std::int64_t cols, std::int64_t ld, int box_rows,
                            const char* what) {
  const std::string name(what);
  const int per_16_bytes = 16 / element_bytes;
  if (base == nullptr) throw Error(name, "a device pointer", "null");
  if (reinterpret_cast<std::uintptr_t>(base) % 16 != 0) {
    throw Error(name + " pointer", "16-byte alignment", to_text(base));
  }
  if (ld % per_16_bytes != 0 || ld < cols) {
    throw Error(name + " leading dimension",
                "a multiple of " + to_text(per_16_bytes) + " and >= " + to_text(cols), to_text(ld));
  }
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols),
                              static_cast<cuuint64_t>(rows > 0 ? rows : 1)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(name + " tensor map", "cuTensorMapEncodeTiled success",
                "error " + to_text(static_cast<int>(r)) + " (rows " + to_text(rows) + ", cols " +
                    to_text(cols) + ", ld " + to_text(ld) + ")");
  }
  return map;
}

}  // namespace

CUtensorMap make_tensor_map_bf16(const void* base, std::int64_t rows, std::int64_t cols,
                                 std::int64_t ld, int box_rows, const char* what) {
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows, cols, ld, box_rows, what);
}

CUtensorMap make_tensor_map_e4m3(const void* base, std::int64_t rows, std::int64_t cols,
                                 std::int64_t ld, int box_rows, const char* what) {
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, ld, box_rows, what);
}

}  // namespace mok::gemm
