// The standalone row-transfer kernels: a grid-stride loop of warps over the rows of a pass, each
// row moved by transfer.cuh's device function.
#include "core/fp8.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/transfer.cuh"

namespace mok::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// Row i = every (gridDim.x * kWarpsPerBlock)-th row from this warp's, through `row`.
template <class Params, class Row>
__device__ __forceinline__ void each_row(const Params& p, Row row) {
  const std::int64_t rows = transfer::rows_in_pass(p.pass);
  const std::int64_t vectors = p.geo.hidden / transfer::kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t i = warp; i < rows; i += warps) row(p, i, lane, vectors);
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) scale_rows_kernel(ScaleRowsParams p) {
  each_row(p, [](const ScaleRowsParams& q, std::int64_t i, int lane, std::int64_t vectors) {
    transfer::scale_row(q, i, lane, vectors);
  });
}

// Warps over the source tokens (every rank's T): lane j < k reads slot j's row, the warp keeps
// those in the pass, and copies the token's row to each, kTokenBatch vectors a lane at a time
// (read once, written once per row; with p.fp8_rows quantized once and written beside it). Then
// warps over the pass's rows, 32 at a time: pull_row writes the padding rows among them (and
// their FP8 form here).
// kFp8: p.fp8_rows set (a kernel of its own: the bf16 pull keeps its registers).
constexpr int kTokenBatch = 4;
template <bool kFp8>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    pull_tokens_kernel(PullParams p, const std::int32_t* row_of_slot) {
  const std::int64_t rows = transfer::rows_in_pass(p.pass);
  const std::int64_t first = p.pass.row_offset, last = first + rows;
  const std::int64_t vectors = p.geo.hidden / transfer::kBf16PerVector;
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  const int k = static_cast<int>(p.geo.topk);
  const std::int64_t tokens = p.geo.tokens * p.geo.ranks;
  uint4* const ring = reinterpret_cast<uint4*>(p.ring);
  for (std::int64_t token = warp; token < tokens && rows > 0; token += warps) {
    std::int64_t row = -1;
    if (lane < k) {
      row = row_of_slot[token * k + lane];
      if (row < first || row >= last) row = -1;
    }
    unsigned kept = __ballot_sync(0xffffffffu, row >= 0);
    if (kept == 0u) continue;
    const int rank = static_cast<int>(token / p.geo.tokens);
    const std::int64_t t = token - std::int64_t{rank} * p.geo.tokens;
    if (p.row_weights != nullptr && row >= 0) {  // the weight beside the unscaled row
      const float* weights = p.scale_own != nullptr ? p.scale_own : p.scale_peers[rank];
      p.row_weights[row - first] = weights[t * k + lane];
    }
    const void* source = p.src_own != nullptr ? p.src_own : p.src_peers[rank];
    const uint4* from = reinterpret_cast<const uint4*>(source) + t * vectors;
    for (std::int64_t v0 = 0; v0 < vectors; v0 += 32 * kTokenBatch) {
      uint4 held[kTokenBatch];
#pragma unroll
      for (int b = 0; b < kTokenBatch; ++b) {
        const std::int64_t v = v0 + 32 * b + lane;
        if (v < vectors) held[b] = from[v];
        if constexpr (kFp8) {  // a half-warp past the row quantizes zeros (and stores nothing)
          if (v >= vectors) held[b] = make_uint4(0, 0, 0, 0);
        }
      }
      uint2 q[kTokenBatch];
      float scale[kTokenBatch];
      if constexpr (kFp8) {
#pragma unroll
        for (int b = 0; b < kTokenBatch; ++b) q[b] = quantize_vector(held[b], &scale[b]);
      }
      for (unsigned left = kept; left != 0u; left &= left - 1u) {
        const int j = __ffs(left) - 1;
        const std::int64_t i = __shfl_sync(0xffffffffu, row, j) - first;
        uint4* dst = ring + i * vectors;
#pragma unroll
        for (int b = 0; b < kTokenBatch; ++b) {
          const std::int64_t v = v0 + 32 * b + lane;
          if (v >= vectors) continue;
          dst[v] = held[b];
          if constexpr (kFp8) {
            reinterpret_cast<uint2*>(p.fp8_rows + i * p.geo.hidden)[v] = q[b];
            if (lane % 16 == 0) p.fp8_scales[(v / 16) * p.pass.ring_rows + i] = scale[b];
          }
        }
      }
    }
  }
  // Padding rows, found 32 at a time: pull_row writes them (zeros, and weight 0), and here their
  // FP8 form: zero bytes, each block's scale that of an all-zero block.
  for (std::int64_t base = 32 * warp; base < rows; base += 32 * warps) {
    const bool padding = base + lane < rows && p.pass.table[first + base + lane] < 0;
    for (unsigned pad = __ballot_sync(0xffffffffu, padding); pad != 0u; pad &= pad - 1u) {
      const std::int64_t i = base + __ffs(pad) - 1;
      transfer::pull_row(p, i, lane, vectors);
      if constexpr (!kFp8) continue;
      uint4* q = reinterpret_cast<uint4*>(p.fp8_rows + i * p.geo.hidden);
      for (std::int64_t v = lane; v < p.geo.hidden / 16; v += 32) q[v] = make_uint4(0, 0, 0, 0);
      for (std::int64_t kb = lane; kb < p.geo.hidden / fp8::kBlock; kb += 32) {
        p.fp8_scales[kb * p.pass.ring_rows + i] = fp8::scale_of(fp8::scale_exponent(0u));
      }
    }
  }
}

int grid_for(std::int64_t ring_rows) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const std::int64_t blocks = (ring_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const std::int64_t cap = std::int64_t{sms} * 8;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

}  // namespace

cudaError_t launch_pull_tokens(const PullParams& p, const std::int32_t* row_of_slot,
                               cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  const bool weights = p.scale_peers != nullptr || p.scale_own != nullptr;
  if (weights != (p.row_weights != nullptr)) {
    return cudaErrorInvalidValue;  // rows are copied as they are: weights go beside them or not
  }
  if ((p.fp8_rows != nullptr) != (p.fp8_scales != nullptr) ||
      (p.fp8_rows != nullptr && p.geo.hidden % fp8::kBlock != 0)) {
    return cudaErrorInvalidValue;
  }
  const std::int64_t tokens = p.geo.tokens * p.geo.ranks;
  const std::int64_t work = tokens > p.pass.ring_rows / 32 ? tokens : p.pass.ring_rows / 32;
  if (p.fp8_rows != nullptr) {
    pull_tokens_kernel<true><<<grid_for(work), kWarpsPerBlock * 32, 0, stream>>>(p, row_of_slot);
  } else {
    pull_tokens_kernel<false><<<grid_for(work), kWarpsPerBlock * 32, 0, stream>>>(p, row_of_slot);
  }
  return cudaGetLastError();
}

cudaError_t launch_scale_rows(const ScaleRowsParams& p, cudaStream_t stream) {
  if (p.pass.ring_rows <= 0) return cudaSuccess;
  scale_rows_kernel<<<grid_for(p.pass.ring_rows), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok::cuda
