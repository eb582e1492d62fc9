// Device building blocks of mok's FP8 quantization (core/fp8.hpp's maths), for the quantization
// kernels of this folder and for the pulls, which quantize rows as they land (transfer.cu). The
// GEMM epilogues that quantize do not include it; they share quantize4 (below) and give the bits:
//   warp_quantize_block128  one 1x128 block held by a warp, 4 values a lane: the activation rows
//                           form when a warp holds 128 values of a row, the token-axis form when
//                           it holds 128 rows of a column (which values a lane holds is the
//                           caller's choice: the maths is elementwise after the warp's amax)
//   quantize4               four values of a block of known inverse scale, packed (cuda/ptx/
//                           e4m3.cuh, which the GEMM epilogues that quantize share)
//   quantize_vector         one 1x128 block of bf16 held by a half-warp, 8 values a lane
//   store_block_transposed  a 128x128 block of bytes from shared memory into a transposed copy
//   quantize_token_tile     a 128-row x 64-column tile in the token-axis form (the weight
//                           gradients' operands), from bf16 or float rows
//   quantize_token_tile_rows  the same tile from bf16 rows, read whole and transposed in shared
//                           memory (ldmatrix)
// Every value goes through the same instruction as fp8::e4m3_from_float on the device, so all of
// them give the CPU reference's bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <string>

#include "core/fp8.hpp"
#include "cuda/kernels/transfer.cuh"
#include "cuda/ptx/e4m3.cuh"
#include "cuda/ptx/tma.cuh"
#include "mok/error.hpp"

namespace mok::cuda {

// bf16 bits -> float (exact, as core/bf16.hpp's bf16_to_float).
__device__ inline float bf16_bits_to_float(std::uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

// e4m3x2 and quantize4 (cuda/ptx/e4m3.cuh), shared with the GEMM epilogues that quantize.
using ptx::e4m3x2;
using ptx::quantize4;

// The block amax (bits, core/fp8.hpp's amax_update) across the 32 lanes of a warp.
__device__ inline std::uint32_t warp_amax(std::uint32_t amax_bits) {
  return __reduce_max_sync(0xffffffffu, amax_bits);
}

// One 128-value block held by a full warp (every lane calls it), four values a lane: returns the
// lane's four bytes packed (v[0] in the low byte) and the block's scale in *scale.
__device__ inline std::uint32_t warp_quantize_block128(const float (&v)[4], float* scale) {
  std::uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = fp8::amax_update(amax, v[i]);
  const int e = fp8::scale_exponent(warp_amax(amax));
  *scale = fp8::scale_of(e);
  return quantize4(v[0], v[1], v[2], v[3], fp8::inverse_scale_of(e));
}

// The FP8 rows form of one 16-byte vector of bf16 per lane, the 16 lanes of a half-warp holding
// one 1x128 block (a lane's 8 values in order): the lane's 8 bytes, and the block's scale in
// *scale. Every lane of the warp calls it (the amax crosses lanes within each half).
__device__ inline uint2 quantize_vector(const uint4& v, float* scale) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  float f[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_bits_to_float(words[i] & 0xffffu);
    f[2 * i + 1] = bf16_bits_to_float(words[i] >> 16);
  }
  std::uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fp8::amax_update(amax, f[i]);
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) {
    const std::uint32_t other = __shfl_xor_sync(0xffffffffu, amax, offset);
    amax = other > amax ? other : amax;
  }
  const int e = fp8::scale_exponent(amax);
  *scale = fp8::scale_of(e);
  const float inverse = fp8::inverse_scale_of(e);
  return make_uint2(quantize4(f[0], f[1], f[2], f[3], inverse),
                    quantize4(f[4], f[5], f[6], f[7], inverse));
}

// The transposed copy of one 128x128 block: q[i][j] (shared memory, rows of `q_stride` bytes,
// i along N, j along K) to out[j][i] of an output with rows of `ld` bytes (out points at the
// block's first element). 256 threads (all call it after the block is in shared memory): a
// thread writes 16 consecutive bytes of four output rows; a warp's lanes take consecutive j, so
// its shared-memory reads of one row i are conflict-free.
inline constexpr int kTransposeThreads = 256;

__device__ inline void store_block_transposed(const std::uint8_t* q, int q_stride,
                                              std::uint8_t* out, std::int64_t ld) {
  const int j = threadIdx.x % 128;
#pragma unroll 1
  for (int chunk = threadIdx.x / 128; chunk < 8; chunk += kTransposeThreads / 128) {
    std::uint32_t w[4];
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      std::uint32_t packed = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        packed |= static_cast<std::uint32_t>(q[(chunk * 16 + word * 4 + b) * q_stride + j])
                  << (8 * b);
      }
      w[word] = packed;
    }
    *reinterpret_cast<uint4*>(out + j * ld + chunk * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// 16 consecutive source values of one row, from column `col` of `row` (bf16 bits or float):
// vector loads when `vectors` (the row and K allow 16-byte loads: the caller decides once per
// launch), else one element at a time; columns at or past K read as 0.
__device__ inline void load_chunk16(const std::uint16_t* row, std::int64_t col, std::int64_t K,
                                    bool vectors, float (&v)[16]) {
  if (vectors && col + 16 <= K) {
    const uint4* p = reinterpret_cast<const uint4*>(row + col);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w = p[h];
      const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[8 * h + 2 * i] = bf16_bits_to_float(words[i] & 0xffffu);
        v[8 * h + 2 * i + 1] = bf16_bits_to_float(words[i] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = col + i < K ? bf16_bits_to_float(row[col + i]) : 0.0f;
  }
}
__device__ inline void load_chunk16(const float* row, std::int64_t col, std::int64_t K,
                                    bool vectors, float (&v)[16]) {
  if (vectors && col + 16 <= K) {
    const float4* p = reinterpret_cast<const float4*>(row + col);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 w = p[q];
      v[4 * q] = w.x;
      v[4 * q + 1] = w.y;
      v[4 * q + 2] = w.z;
      v[4 * q + 3] = w.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = col + i < K ? row[col + i] : 0.0f;
  }
}

// Whether rows of `ld` elements of T from `x` allow load_chunk16's 16-byte loads.
template <class T>
__host__ __device__ inline bool chunk_vectors_ok(const T* x, std::int64_t ld) {
  return reinterpret_cast<std::uintptr_t>(x) % 16 == 0 && (ld * sizeof(T)) % 16 == 0;
}

// The token-axis form of one tile of 128 rows (one block along the tokens) and kTokenTileCols
// columns from k0, from rows of T (bf16 bits or float): row r of the block at x + r * ld_x,
// rows r >= valid_rows read as 0; `vectors` as load_chunk16's. With `row_weights` (the block's
// rows' weights, or null) row r is first bf16(row_weights[r] * x): one multiply, one rounding,
// the bits transfer.cuh's scale_pair writes (the layer's dy = bf16(w d_out), never stored).
// Written: data[k * ld + r] (data at the block's first row: the transpose; ld and data 8-byte
// aligned) and scales[k] (the block's row of scales), for k0 <= k < K. Every thread of a CTA of
// kTokenTileThreads calls it. NOTES: the tile is staged column-major in shared memory (a column's
// 128 rows contiguous, rows of 132 floats: a warp's stores of one column element each and its
// 16-byte reads of 8 rows each are conflict-free). Loads are 32-byte sectors of a row (16 columns);
// each column is then quantized by 4 adjacent lanes (32 rows each, the amax across them by two
// shuffles) and stored as 8-byte pieces: 128 contiguous bytes a column.
inline constexpr int kTokenTileCols = 64;
inline constexpr int kTokenTileThreads = 256;

template <class T>
__device__ inline void quantize_token_tile(const T* x, std::int64_t ld_x, std::int64_t valid_rows,
                                           bool vectors, std::int64_t k0, std::int64_t K,
                                           std::uint8_t* data, std::int64_t ld, float* scales,
                                           const float* row_weights = nullptr) {
  static_assert(kTokenTileThreads == 256 && kTokenTileCols == 64, "the mapping below");
  constexpr int kStride = fp8::kBlock + 4;
  __shared__ __align__(16) float tile[kTokenTileCols][kStride];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  {
    // Warp w: columns 16 (w % 4) .. +15 of rows lane + 32 (w / 4) + 64 j.
    const int c0 = 16 * (warp % 4);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = lane + 32 * (warp / 4) + 64 * j;
      float v[16];
      if (r < valid_rows) {
        load_chunk16(x + r * ld_x, k0 + c0, K, vectors, v);
        if (row_weights != nullptr) {
          const float w = row_weights[r];
#pragma unroll
          for (int i = 0; i < 16; ++i)
            v[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(w, v[i])));
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) tile[c0 + i][r] = v[i];
    }
  }
  __syncthreads();
  // Thread t: column t / 4, rows 32 j + 8 (t % 4) + e (j < 4, e < 8).
  const int c = threadIdx.x / 4, part = threadIdx.x % 4;
  float v[4][8];
  std::uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 f = *reinterpret_cast<const float4*>(&tile[c][32 * j + 8 * part + 4 * h]);
      v[j][4 * h] = f.x;
      v[j][4 * h + 1] = f.y;
      v[j][4 * h + 2] = f.z;
      v[j][4 * h + 3] = f.w;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fp8::amax_update(amax, v[j][e]);
  }
  amax = ptx::quad_amax(amax);
  const std::int64_t k = k0 + c;
  if (k >= K) return;  // past the last column: nothing to store (no barrier follows)
  const int e = fp8::scale_exponent(amax);
  const float inverse = fp8::inverse_scale_of(e);
  std::uint8_t* column = data + k * ld + 8 * part;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    *reinterpret_cast<uint2*>(column + 32 * j) =
        make_uint2(quantize4(v[j][0], v[j][1], v[j][2], v[j][3], inverse),
                   quantize4(v[j][4], v[j][5], v[j][6], v[j][7], inverse));
  }
  if (part == 0) scales[k] = fp8::scale_of(e);
}

// Eight bf16 of one row from column `col` (one 16-byte chunk), as load_chunk16 reads them: one
// vector load when `vectors` and the chunk ends within K, else element by element with columns at
// or past K read as 0.
__device__ inline uint4 load_chunk8(const std::uint16_t* row, std::int64_t col, std::int64_t K,
                                    bool vectors) {
  if (vectors && col + 8 <= K) return *reinterpret_cast<const uint4*>(row + col);
  std::uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t lo = col + 2 * i < K ? row[col + 2 * i] : 0u;
    const std::uint32_t hi = col + 2 * i + 1 < K ? row[col + 2 * i + 1] : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// a[i] for a runtime i in [0, 4) of a register array (selects: no local-memory indexing).
__device__ __forceinline__ std::uint32_t pick4(const std::uint32_t (&a)[4], int i) {
  return i == 0 ? a[0] : i == 1 ? a[1] : i == 2 ? a[2] : a[3];
}

// quantize_token_tile's tile, arguments and bits, from bf16 rows only, with whole rows read.
// Thread t loads 16 bytes (8 columns) of rows t / 8 + 32 j, so a warp's load is four 128-byte
// rows (quantize_token_tile's warps load 32-byte pieces of 32 rows: eight times the cache lines an
// instruction touches; NOTES, "2026-12-05, 70fd521"). The rows are staged as bf16 (16 KiB; the
// 16-byte chunk c of row r at chunk c ^ (r % 8), so that each 8-row read below is free of bank
// conflicts). Warp w reads columns 8w .. 8w + 7 of all 128 rows back transposed (four ldmatrix
// .x4 .trans): lane l then holds column 8w + l / 4, rows 8m + 2 (l % 4) and 8m + 2 (l % 4) + 1
// for m < 16. The column's amax is taken across its four lanes (quad_amax); the four lanes'
// e4m3 pairs are exchanged (three shuffles for two groups of 32 rows), so that lane l stores the 8
// contiguous bytes of rows 32q + 8 (l % 4) .. + 7 for q < 4: a warp's store is 32 bytes of each
// of 8 columns, as quantize_token_tile's.
__device__ inline void quantize_token_tile_rows(const std::uint16_t* x, std::int64_t ld_x,
                                                std::int64_t valid_rows, bool vectors,
                                                std::int64_t k0, std::int64_t K, std::uint8_t* data,
                                                std::int64_t ld, float* scales,
                                                const float* row_weights = nullptr) {
  static_assert(kTokenTileThreads == 256 && kTokenTileCols == 64 && fp8::kBlock == 128,
                "the mapping below");
  __shared__ __align__(128) uint4 tile[fp8::kBlock][kTokenTileCols / 8];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  {
    const int chunk = threadIdx.x % 8;
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // the four loads first, all in flight together
      const int r = threadIdx.x / 8 + 32 * j;
      v[j] = r < valid_rows ? load_chunk8(x + r * ld_x, k0 + 8 * chunk, K, vectors)
                            : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = threadIdx.x / 8 + 32 * j;
      if (row_weights != nullptr && r < valid_rows)
        v[j] = transfer::scale_vector(v[j], row_weights[r]);
      tile[r][chunk ^ (r % 8)] = v[j];
    }
  }
  __syncthreads();
  // pairs[m]: rows 8m + 2 part (low half) and 8m + 2 part + 1 of column c, bf16.
  const int c = 8 * warp + lane / 4, part = lane % 4;
  std::uint32_t pairs[16];
  const std::uint32_t base = ptx::smem_addr(tile);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int r = 32 * q + lane;  // lane l: row l % 8 of matrix l / 8, i.e. rows 32q .. 32q + 31
    ptx::ldmatrix_x4_trans(base + r * 128 + 16 * (warp ^ (r % 8)), pairs[4 * q], pairs[4 * q + 1],
                           pairs[4 * q + 2], pairs[4 * q + 3]);
  }
  std::uint32_t amax = 0;
#pragma unroll
  for (int m = 0; m < 16; ++m) {
    amax = fp8::amax_update(amax, bf16_bits_to_float(pairs[m] & 0xffffu));
    amax = fp8::amax_update(amax, bf16_bits_to_float(pairs[m] >> 16));
  }
  amax = ptx::quad_amax(amax);
  const int e = fp8::scale_exponent(amax);
  const float inverse = fp8::inverse_scale_of(e);
  const std::int64_t k = k0 + c;
  std::uint8_t* column = data + k * ld;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // x4[i]: this lane's e4m3 pairs of chunks 8h + i (low half) and 8h + 4 + i (high half).
    std::uint32_t x4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint32_t a = pairs[8 * h + i], b = pairs[8 * h + 4 + i];
      x4[i] = ptx::e4m3x2(bf16_bits_to_float(a & 0xffffu) * inverse,
                          bf16_bits_to_float(a >> 16) * inverse) |
              (ptx::e4m3x2(bf16_bits_to_float(b & 0xffffu) * inverse,
                           bf16_bits_to_float(b >> 16) * inverse)
               << 16);
    }
    // got[d]: lane part ^ d's pairs of this lane's chunks (8h + part, 8h + 4 + part).
    std::uint32_t got[4];
    got[0] = pick4(x4, part);
#pragma unroll
    for (int d = 1; d < 4; ++d) got[d] = __shfl_xor_sync(0xffffffffu, pick4(x4, part ^ d), d);
    std::uint32_t piece[4];  // piece[p]: lane p's pairs (rows 2p, 2p + 1 of each chunk)
#pragma unroll
    for (int p = 0; p < 4; ++p) piece[p] = pick4(got, p ^ part);
    if (k < K) {  // no early return: every lane takes part in the shuffles above
      *reinterpret_cast<uint2*>(column + 64 * h + 8 * part) = make_uint2(
          (piece[0] & 0xffffu) | (piece[1] << 16), (piece[2] & 0xffffu) | (piece[3] << 16));
      *reinterpret_cast<uint2*>(column + 64 * h + 32 + 8 * part) = make_uint2(
          (piece[0] >> 16) | (piece[1] & 0xffff0000u), (piece[2] >> 16) | (piece[3] & 0xffff0000u));
    }
  }
  if (k < K && part == 0) scales[k] = fp8::scale_of(e);
}

// The largest of every thread's amax in a CTA of `threads` (a multiple of 32, at most 1024);
// `scratch` holds threads / 32 words of shared memory. Every thread gets the result.
__device__ inline std::uint32_t cta_amax(std::uint32_t amax_bits, std::uint32_t* scratch,
                                         int threads) {
  const std::uint32_t w = warp_amax(amax_bits);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = w;
  __syncthreads();
  std::uint32_t m = 0;
  for (int i = 0; i < threads / 32; ++i) m = m > scratch[i] ? m : scratch[i];
  return m;
}

// Host side of every quantization launch: the views' device must be the current one (the launch
// runs there), and a failed launch raises mok::Error naming the kernel.
inline void require_current_device(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("no CUDA device can be used by the FP8 quantization kernels");
  }
  if (current != device) {
    throw Error("tensors' device", "the current CUDA device cuda:" + std::to_string(current),
                "cuda:" + std::to_string(device));
  }
}

inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Error(std::string(kernel) + " launch failed: " + cudaGetErrorString(e));
}

inline unsigned grid_for(std::int64_t work, int per_block) {
  const std::int64_t b = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 1048576 ? 1048576 : b));
}

}  // namespace mok::cuda
