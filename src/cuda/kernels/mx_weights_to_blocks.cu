// An MX weight (MoK's (fp8, sc): data [E, N, K], E8M0 scales [E*N/128, K/128, 32, 16] along K)
// -> mok's 128x128 blocks in both orientations (core/fp8.hpp's mx_block_exponent and mx_rebase:
// each value rebased onto its block's largest exponent; exact unless it falls into e4m3's
// subnormals). One CTA per block, laid out as quantize_weights_fp8.cu; the count of changed
// values is summed per CTA and added to *p.inexact (integer atomics: the same count every run).
#include "core/fp8_layout.hpp"
#include "cuda/kernels/fp8_quantize.cuh"
#include "cuda/kernels/fp8_quantize.hpp"

namespace mok::cuda {
namespace {

constexpr int kThreads = kTransposeThreads;  // 256
constexpr int kRowsPerPass = kThreads / 16;  // 16 threads x 8 values cover a 128-wide row
constexpr int kPasses = fp8::kBlock / kRowsPerPass;

__global__ void __launch_bounds__(kThreads) mx_weights_to_blocks_kernel(fp8::MxToBlocksParams p) {
  __shared__ __align__(16) std::uint8_t q_tile[fp8::kBlock][fp8::kBlock];
  __shared__ std::uint8_t sub_scales[fp8::kBlock][4];
  __shared__ int scratch[kThreads / 32];
  const std::int64_t kblocks = p.K / fp8::kBlock, nblocks = p.N / fp8::kBlock;
  const std::int64_t kb = blockIdx.x % kblocks, nb = (blockIdx.x / kblocks) % nblocks,
                     e = blockIdx.x / (kblocks * nblocks);
  const std::int64_t row0 = e * p.N + nb * fp8::kBlock;  // flattened row of the MX layout

  // The block's 128 x 4 scale bytes, and their largest (NaN bytes skipped).
  int max_byte = -1;
  for (int u = threadIdx.x; u < fp8::kBlock * 4; u += kThreads) {
    const int i = u / 4, jj = u % 4;
    const std::uint8_t b = p.scales[fp8::mx_scale_index(row0 + i, kb * 4 + jj, p.K)];
    sub_scales[i][jj] = b;
    max_byte = fp8::mx_max_byte(max_byte, b);
  }
  max_byte = __reduce_max_sync(0xffffffffu, max_byte);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = max_byte;
  __syncthreads();
  for (int i = 0; i < kThreads / 32; ++i) max_byte = max_byte > scratch[i] ? max_byte : scratch[i];
  const int eb = fp8::mx_block_exponent(max_byte);

  const int c8 = threadIdx.x % 16, r0 = threadIdx.x / 16;
  const std::uint8_t* in = p.data + row0 * p.K + kb * fp8::kBlock + c8 * 8;
  std::uint8_t* out = p.out.data + row0 * p.K + kb * fp8::kBlock + c8 * 8;
  int inexact = 0;
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = r0 + pass * kRowsPerPass;
    const uint2 raw = *reinterpret_cast<const uint2*>(in + r * p.K);
    const std::uint8_t b = sub_scales[r][c8 / 4];  // 8 values lie in one 32-block
    std::uint32_t q[2] = {0, 0};
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const std::uint32_t word = t < 4 ? raw.x : raw.y;
      const fp8::Rebased v =
          fp8::mx_rebase(static_cast<std::uint8_t>(word >> (8 * (t % 4))), b, eb);
      q[t / 4] |= static_cast<std::uint32_t>(v.q) << (8 * (t % 4));
      inexact += v.exact ? 0 : 1;
    }
    *reinterpret_cast<uint2*>(out + r * p.K) = make_uint2(q[0], q[1]);
    *reinterpret_cast<uint2*>(&q_tile[r][c8 * 8]) = make_uint2(q[0], q[1]);
  }
  __syncthreads();
  store_block_transposed(&q_tile[0][0], fp8::kBlock,
                         p.out.data_t + (e * p.K + kb * fp8::kBlock) * p.N + nb * fp8::kBlock, p.N);
  inexact = __reduce_add_sync(0xffffffffu, inexact);
  if (threadIdx.x % 32 == 0 && inexact != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p.inexact),
              static_cast<unsigned long long>(inexact));
  }
  if (threadIdx.x == 0) {
    const float s = fp8::scale_of(eb);
    p.out.scales[fp8::weight_scale_index(e, nb, kb, p.N, p.K)] = s;
    p.out.scales_t[fp8::weight_scale_index(e, kb, nb, p.K, p.N)] = s;
  }
}

}  // namespace

void launch_mx_weights_to_blocks(const fp8::MxToBlocksParams& p, int device, void* stream) {
  require_current_device(device);
  const auto s = static_cast<cudaStream_t>(stream);
  if (const cudaError_t err = cudaMemsetAsync(p.inexact, 0, sizeof(std::int64_t), s);
      err != cudaSuccess) {
    throw Error(std::string("mx_weights_to_blocks: zeroing the count failed: ") +
                cudaGetErrorString(err));
  }
  const std::int64_t blocks = p.E * (p.N / fp8::kBlock) * (p.K / fp8::kBlock);
  if (blocks == 0) return;
  mx_weights_to_blocks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(p);
  check_launch("mx_weights_to_blocks");
}

}  // namespace mok::cuda
