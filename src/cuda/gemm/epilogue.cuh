// Epilogues: from one consumer warpgroup's 64 x 256 fp32 accumulators straight to global memory
// (bf16 pairs or fp32 pairs), masking rows past the group and columns past n. Every rounding step
// is spelled out so the CPU reference can follow it (src/reference/reference.hpp).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/numerics.hpp"
#include "cuda/gemm/forms.cuh"

namespace mok::gemm {

// Row (within the 128-row tile) and column (within the tile) of accumulator 4j + 2h + e, for
// consumer warpgroup `wg`, warp `warp` of it and `lane` (see ptx/wgmma.cuh for the layout).
__device__ __forceinline__ int acc_row(int wg, int warp, int lane, int h) {
  return wg * 64 + warp * 16 + lane / 4 + 8 * h;
}
__device__ __forceinline__ int acc_col(int lane, int j) {
  return 8 * j + 2 * (lane % 4);
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

__device__ __forceinline__ std::uint32_t pick4(std::uint32_t a, std::uint32_t b, std::uint32_t c,
                                               std::uint32_t d, int i) {
  return i == 0 ? a : i == 1 ? b : i == 2 ? c : d;
}

// Within a quad (4 lanes holding the same rows), lane q holds v_i = its bf16 pair of column chunk
// 4c+i (i = 0..3). Returns chunk 4c+q whole (8 consecutive bf16, pairs from lanes 0..3), so each
// lane can store 16 bytes: a warp then writes 8 rows x 64 contiguous bytes per instruction instead
// of 8 rows x 16 bytes. All 32 lanes must call it.
__device__ __forceinline__ uint4 quad_gather(std::uint32_t v0, std::uint32_t v1, std::uint32_t v2,
                                             std::uint32_t v3, int q) {
  const std::uint32_t r0 = pick4(v0, v1, v2, v3, q);
  const std::uint32_t r1 = __shfl_xor_sync(0xffffffffu, pick4(v0, v1, v2, v3, q ^ 1), 1);
  const std::uint32_t r2 = __shfl_xor_sync(0xffffffffu, pick4(v0, v1, v2, v3, q ^ 2), 2);
  const std::uint32_t r3 = __shfl_xor_sync(0xffffffffu, pick4(v0, v1, v2, v3, q ^ 3), 3);
  // r_s came from lane q^s and is its pair of chunk 4c+q; the pair of lane p sits at r_{p^q}.
  return make_uint4(pick4(r0, r1, r2, r3, q), pick4(r0, r1, r2, r3, q ^ 1),
                    pick4(r0, r1, r2, r3, q ^ 2), pick4(r0, r1, r2, r3, q ^ 3));
}

// SwiGLU: accumulators 0..63 are the gate tile, 64..127 the up tile of the same 128 columns.
//   g = bf16(acc_g), u = bf16(acc_u), hidden = bf16(silu(g) * u) (numerics::swiglu_fast)
__device__ __forceinline__ void store_swiglu(const float (&acc)[kTileN / 2], const TileInfo& t,
                                             const KernelParams& p, int wg, int warp, int lane) {
  auto* hidden = static_cast<__nv_bfloat16*>(p.out);
  const int n0 = t.n0 * (kTileN / 2);
  const int q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = t.m0 + acc_row(wg, warp, lane, h);
    const bool row_ok = r < t.row_count;
    const long long row = static_cast<long long>(t.row_base + r) * p.ld_out;
#pragma unroll
    for (int c = 0; c < kTileN / 64; ++c) {
      std::uint32_t hv[4], gv[4], uv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 4 * (4 * c + i) + 2 * h;
        const float g0 = round_bf16(acc[a]), g1 = round_bf16(acc[a + 1]);
        const float u0 = round_bf16(acc[64 + a]), u1 = round_bf16(acc[64 + a + 1]);
        hv[i] = pack_bf16x2(numerics::swiglu_fast(g0, u0), numerics::swiglu_fast(g1, u1));
        gv[i] = pack_bf16x2(g0, g1);
        uv[i] = pack_bf16x2(u0, u1);
      }
      const int col = n0 + 8 * (4 * c + q);
      const bool ok = row_ok && col < p.n;
      const uint4 hs = quad_gather(hv[0], hv[1], hv[2], hv[3], q);
      if (ok) *reinterpret_cast<uint4*>(hidden + row + col) = hs;
      if (p.gate_out != nullptr) {
        const uint4 gs = quad_gather(gv[0], gv[1], gv[2], gv[3], q);
        const uint4 us = quad_gather(uv[0], uv[1], uv[2], uv[3], q);
        if (ok) {
          *reinterpret_cast<uint4*>(p.gate_out + row + col) = gs;
          *reinterpret_cast<uint4*>(p.up_out + row + col) = us;
        }
      }
    }
  }
}

// K-grouped fp32 accumulation: the accumulators start from the output's current values (the
// exact inverse of store_plain's fp32 path; elements outside [m, n] start at zero).
__device__ __forceinline__ void load_fp32_accumulators(float (&acc)[kTileN / 2], const TileInfo& t,
                                                       const KernelParams& p, int wg, int warp,
                                                       int lane) {
  const int n0 = t.n0 * kTileN;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = t.m0 + acc_row(wg, warp, lane, h);
    const long long offset = t.group * p.out_group_stride + static_cast<long long>(r) * p.ld_out;
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
      const int col = n0 + acc_col(lane, j);
      float2 v = make_float2(0.0f, 0.0f);
      if (r < p.m && col < p.n) {
        v = *reinterpret_cast<const float2*>(static_cast<const float*>(p.out) + offset + col);
      }
      acc[4 * j + 2 * h] = v.x;
      acc[4 * j + 2 * h + 1] = v.y;
    }
  }
}

// Plain store of a 64 x 256 block: out[row, col] = round(scale_row * acc) (scale only if given).
// M-grouped: rows of the row buffer; K-grouped: rows of the group's [m, n] output.
template <bool kKGrouped>
__device__ __forceinline__ void store_plain(const float (&acc)[kTileN / 2], const TileInfo& t,
                                            const KernelParams& p, int wg, int warp, int lane) {
  const int n0 = t.n0 * kTileN;
  const int q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = t.m0 + acc_row(wg, warp, lane, h);
    long long offset;
    float scale = 1.0f;
    bool row_ok;
    if constexpr (kKGrouped) {
      row_ok = r < p.m;
      offset = t.group * p.out_group_stride + static_cast<long long>(r) * p.ld_out;
    } else {
      row_ok = r < t.row_count;
      offset = static_cast<long long>(t.row_base + r) * p.ld_out;
      if (row_ok && p.row_scale != nullptr) scale = __ldg(p.row_scale + t.row_base + r);
    }
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + offset;
    if (!kKGrouped && p.scatter_rows != nullptr) {  // the row's slot on its home rank
      const int src = row_ok ? __ldg(p.scatter_rows + t.row_base + r) : -1;
      row_ok = src >= 0;
      if (row_ok) {
        const unsigned rank = static_cast<unsigned>(src) / p.scatter_slots;
        const unsigned slot = static_cast<unsigned>(src) - rank * p.scatter_slots;
        dst = static_cast<__nv_bfloat16*>(p.scatter_peers[rank]) +
              static_cast<long long>(slot) * p.ld_out;
      }
    }
    const bool scaled = !kKGrouped && p.row_scale != nullptr;
    if (p.out_fp32) {
      if (!row_ok) continue;
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
        const int col = n0 + acc_col(lane, j);
        if (col < p.n) {
          auto* out = reinterpret_cast<float2*>(static_cast<float*>(p.out) + offset + col);
          float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          if (p.accumulate) {
            const float2 old = *out;
            v = make_float2(__fadd_rn(old.x, v.x), __fadd_rn(old.y, v.y));
          }
          *out = v;
        }
      }
      continue;
    }
#pragma unroll
    for (int c = 0; c < kTileN / 32; ++c) {
      std::uint32_t v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 4 * (4 * c + i) + 2 * h;
        float v0 = acc[a], v1 = acc[a + 1];
        if (scaled) {
          v0 = __fmul_rn(scale, v0);
          v1 = __fmul_rn(scale, v1);
        }
        v[i] = pack_bf16x2(v0, v1);
      }
      const uint4 s = quad_gather(v[0], v[1], v[2], v[3], q);
      const int col = n0 + 8 * (4 * c + q);
      if (row_ok && col < p.n) *reinterpret_cast<uint4*>(dst + col) = s;
    }
  }
}

// The accumulators of a tile before its K loop: zeros, or the fp32 output's values when a
// reduction continues.
template <class F>
__device__ __forceinline__ void init_accumulators(float (&acc)[kTileN / 2], const TileInfo& t,
                                                  const KernelParams& p, int wg, int warp,
                                                  int lane) {
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.0f;
  if constexpr (F::kSeeded) load_fp32_accumulators(acc, t, p, wg, warp, lane);
}

// The form's epilogue for one consumer warpgroup's 64 x 256 accumulators.
template <class F>
__device__ __forceinline__ void store_tile(const float (&acc)[kTileN / 2], const TileInfo& t,
                                           const KernelParams& p, int wg, int warp, int lane) {
  if constexpr (F::kind == FormKind::kGateUp) {
    store_swiglu(acc, t, p, wg, warp, lane);
  } else {
    store_plain<F::kKGrouped>(acc, t, p, wg, warp, lane);
  }
}

}  // namespace mok::gemm
