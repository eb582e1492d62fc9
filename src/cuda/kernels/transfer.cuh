// Row transfers as device functions, one warp per row (16-byte vectors: H is a multiple of 64, so
// a row is a multiple of 128 bytes and every vector is aligned). The standalone kernels of
// transfer.cu are a grid-stride loop around them; the forward megakernel's pulling warps (its
// Producer warps 1-3, fused_forward.cuh's pull_rows) call pull_row for the row groups they draw.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/kernels/transfer.hpp"

namespace mok::cuda::transfer {

inline constexpr int kBf16PerVector = 8;  // 16 bytes

struct RowSource {
  int rank;
  std::int64_t slot;  // t*k + j on the source rank
};

// NOTES: 32-bit arithmetic: src is an int32 by the table's format, and 64-bit division would
// call a runtime routine with a stack frame.
__device__ inline RowSource decode(std::int32_t src, const RowGeometry& g) {
  const auto per_rank = static_cast<std::uint32_t>(g.tokens * g.topk);
  const auto u = static_cast<std::uint32_t>(src);
  return {static_cast<int>(u / per_rank), static_cast<std::int64_t>(u % per_rank)};
}

// Two bf16 values packed in 32 bits, each scaled by w: bf16(w * v), one multiply then one rounding
// (the reference's dy exactly).
__device__ inline std::uint32_t scale_pair(std::uint32_t packed, float w) {
  __nv_bfloat162 h;
  memcpy(&h, &packed, sizeof h);
  const float2 f = __bfloat1622float2(h);
  const __nv_bfloat162 r = __floats2bfloat162_rn(__fmul_rn(w, f.x), __fmul_rn(w, f.y));
  std::uint32_t out;
  memcpy(&out, &r, sizeof out);
  return out;
}

__device__ inline uint4 scale_vector(const uint4& in, float w) {
  return make_uint4(scale_pair(in.x, w), scale_pair(in.y, w), scale_pair(in.z, w),
                    scale_pair(in.w, w));
}

// dst[v] = src[v] for the vectors v = lane, lane + 32, ... below `vectors`, with kBatch loads of
// the lane in flight before their stores (a puller of a persistent kernel has few warps per SM: the
// loads in flight per warp are what its bandwidth is made of; the standalone kernels keep 1).
template <int kBatch>
__device__ inline void copy_vectors(uint4* dst, const uint4* src, int lane, std::int64_t vectors) {
  std::int64_t v = lane;
  if constexpr (kBatch > 1) {
    for (; v + 32 * (kBatch - 1) < vectors; v += 32 * kBatch) {
      uint4 held[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) held[j] = src[v + 32 * j];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) dst[v + 32 * j] = held[j];
    }
  }
  for (; v < vectors; v += 32) dst[v] = src[v];
}

// Rows of the table in this pass (the total lives in device memory: no host sync).
__device__ inline std::int64_t rows_in_pass(const PassRows& pass) {
  const std::int64_t left = static_cast<std::int64_t>(*pass.total_rows) - pass.row_offset;
  return left < 0 ? 0 : (left < pass.ring_rows ? left : pass.ring_rows);
}

// Each function moves ring row i of the pass by the 32 lanes of one warp; `vectors` is
// p.geo.hidden / kBf16PerVector (the caller's, computed once).
//
// Ring row i of the pass from its source row (PullParams). Padding
// rows become zeros (and weight 0), so nothing downstream ever reads stale data.
template <int kBatch = 1>
__device__ inline void pull_row(const PullParams& p, std::int64_t i, int lane,
                                std::int64_t vectors) {
  uint4* dst = reinterpret_cast<uint4*>(p.ring) + i * vectors;
  const std::int32_t src = p.pass.table[p.pass.row_offset + i];
  if (src < 0) {
    for (std::int64_t v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    if (p.row_weights != nullptr && lane == 0) p.row_weights[i] = 0.0f;
    return;
  }
  const RowSource s = decode(src, p.geo);
  const std::int64_t t =
      static_cast<std::uint32_t>(s.slot) / static_cast<std::uint32_t>(p.geo.topk);
  const void* source = p.src_own != nullptr ? p.src_own : p.src_peers[s.rank];
  const uint4* from = reinterpret_cast<const uint4*>(source) + t * vectors;
  const float* weights = p.scale_own;
  if (weights == nullptr && p.scale_peers != nullptr) weights = p.scale_peers[s.rank];
  if (weights == nullptr || p.row_weights != nullptr) {
    if (p.row_weights != nullptr && lane == 0) p.row_weights[i] = weights[s.slot];
    copy_vectors<kBatch>(dst, from, lane, vectors);
    return;
  }
  const float w = weights[s.slot];
  for (std::int64_t v = lane; v < vectors; v += 32) dst[v] = scale_vector(from[v], w);
}

// Ring row i scaled in place by its row weight (ScaleRowsParams); padding stays zero.
__device__ inline void scale_row(const ScaleRowsParams& p, std::int64_t i, int lane,
                                 std::int64_t vectors) {
  if (p.pass.table[p.pass.row_offset + i] < 0) return;
  const float w = p.row_weights[i];
  uint4* row = reinterpret_cast<uint4*>(p.ring) + i * vectors;
  for (std::int64_t v = lane; v < vectors; v += 32) row[v] = scale_vector(row[v], w);
}

}  // namespace mok::cuda::transfer
