// Host-built TMA tensor maps for row-major bf16 and e4m3 matrices, 128-byte swizzle.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok::gemm {

// A 2-D map over `rows` x `cols` bf16 (row-major, `ld` elements between rows) whose box is
// `box_rows` x 64 columns (64 bf16 = one 128-byte swizzle row). `what` names the operand in errors.
CUtensorMap make_tensor_map_bf16(const void* base, std::int64_t rows, std::int64_t cols,
                                 std::int64_t ld, int box_rows, const char* what);

// The same over e4m3 bytes: the box is `box_rows` x 128 columns (one 128-byte swizzle row).
CUtensorMap make_tensor_map_e4m3(const void* base, std::int64_t rows, std::int64_t cols,
                                 std::int64_t ld, int box_rows, const char* what);

}  // namespace mok::gemm
