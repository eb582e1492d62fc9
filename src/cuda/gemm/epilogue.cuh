// Epilogues: from one consumer warpgroup's fp32 accumulators (its 64-row half of the tile: 64 x
// 256, or 64 x 128 in the 128 x 128 e4m3 forms) to global memory. Most store straight from
// registers (bf16 pairs, gathered into 16-byte stores a lane by quad_gather, or fp32 pairs),
// masking rows past the group and columns past n. Besides those, this file holds
//   - held rows (HeldRows, hold_plain, store_held): a RowsBf16 tile's rows kept in registers and
//     stored while the next tile's first K block runs;
//   - stores staged in shared memory: the bf16 weight gradient's TMA store (store_tile_tma,
//     stmatrix into the ring's staging tile, then tma_store_2d) and the quantizing SwiGLU
//     backward's token-axis blocks (staging_piece, store_token_block);
//   - quantized (e4m3) outputs: hidden from the gate/up epilogue, dg and du from the SwiGLU
//     backward, in the rows form (store_row_block_fp8) and the token-axis form (store_token_block),
//     with the standalone quantizers' bits;
//   - a tile's accumulators before its K loop (init_accumulators: zeros, or the fp32 output a
//     continued reduction resumes) and the SwiGLU backward's prefetch of g and u into L2
//     (prefetch_swiglu_rows).
// Every rounding step is spelled out so the CPU reference can follow it
// (src/reference/reference.hpp).
//
// What a GEMM stores is a compile-time policy type (namespace epilogue, at the end): the engine
// (engine.cuh) calls E::store<F>(...) for each tile; the launcher (launch.cu) picks the type from
// the arguments. Within a policy, only data-dependent choices are made at run time: the rows and
// columns a tile has, the scatter destinations, and a K-grouped group's pass step (carry slot or
// output).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/fp8.hpp"
#include "core/numerics.hpp"
#include "cuda/gemm/descriptor.cuh"
#include "cuda/gemm/forms.cuh"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/ptx/e4m3.cuh"
#include "cuda/ptx/fence.cuh"
#include "cuda/ptx/prefetch.cuh"
#include "cuda/ptx/tma.cuh"

namespace mok::gemm {

// Row (within the 128-row tile) and column (within the tile) of accumulator 4j + 2h + e, for
// consumer warpgroup `wg`, warp `warp` of it and `lane` (see ptx/wgmma.cuh for the layout of one
// m64n256 block).
__device__ __forceinline__ int acc_row(int wg, int warp, int lane, int h) {
  return wg * 64 + warp * 16 + lane / 4 + 8 * h;
}
__device__ __forceinline__ int acc_col(int lane, int j) {
  return 8 * j + 2 * (lane % 4);
}

// M-grouped forms: whether the group has the row that accumulator rows (b, h) of this lane hold,
// that row's index in the row buffers, and its first element in a row buffer with leading
// dimension ld_out.
struct GroupRow {
  bool ok;
  int index;
  long long offset;
};
__device__ __forceinline__ GroupRow group_row(const TileInfo& t, const GemmParams& p, int wg,
                                              int warp, int lane, int h) {
  const int r = t.m0 + acc_row(wg, warp, lane, h);
  return {r < t.row_count, t.row_base + r, static_cast<long long>(t.row_base + r) * p.ld_out};
}

__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

// The two bf16 of a packed pair (low = first) as floats.
__device__ __forceinline__ float low_bf16(std::uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float high_bf16(std::uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// Within a quad (4 lanes holding the same rows), lane q holds v_i = its bf16 pair of column chunk
// 4c+i (i = 0..3). Returns chunk 4c+q whole (8 consecutive bf16, pairs from lanes 0..3), so each
// lane can store 16 bytes: a warp then writes 8 rows x 64 contiguous bytes per instruction instead
// of 8 rows x 16 bytes. A 4 x 4 transpose in two butterfly rounds (4 shuffles). All 32 lanes must
// call it.
__device__ __forceinline__ uint4 quad_gather(std::uint32_t v0, std::uint32_t v1, std::uint32_t v2,
                                             std::uint32_t v3, int q) {
  const bool odd = (q & 1) != 0, upper = (q & 2) != 0;
  // Lanes q and q ^ 2 swap halves: each keeps the chunks 2 (q / 2) and 2 (q / 2) + 1, as its own
  // pairs (k) and its partner's (r).
  const std::uint32_t k0 = upper ? v2 : v0, k1 = upper ? v3 : v1;
  const std::uint32_t r0 = __shfl_xor_sync(0xffffffffu, upper ? v0 : v2, 2);
  const std::uint32_t r1 = __shfl_xor_sync(0xffffffffu, upper ? v1 : v3, 2);
  // Lanes q and q ^ 1 swap chunks: each keeps chunk q, from lanes q (m0), q ^ 2 (m1), q ^ 1 (n0)
  // and q ^ 3 (n1).
  const std::uint32_t m0 = odd ? k1 : k0, m1 = odd ? r1 : r0;
  const std::uint32_t n0 = __shfl_xor_sync(0xffffffffu, odd ? k0 : k1, 1);
  const std::uint32_t n1 = __shfl_xor_sync(0xffffffffu, odd ? r0 : r1, 1);
  // In lane order: lanes (q & 2), (q & 2) + 1 are {m0, n0} (odd q: swapped), the other two {m1,
  // n1}.
  const std::uint32_t a = odd ? n0 : m0, b = odd ? m0 : n0;
  const std::uint32_t c = odd ? n1 : m1, d = odd ? m1 : n1;
  return upper ? make_uint4(c, d, a, b) : make_uint4(a, b, c, d);
}

// One row's 1x128 block of bf16 pairs held by a quad as the SwiGLU epilogues hold it (lane q:
// w[c], the pairs of columns 8 (4c + q) .. + 7), quantized as quantize_pass_fp8.cu's rows kernel
// quantizes it from memory: the block's amax across the quad, then each lane's 4 pieces of 8 bytes
// to out + 8 (4c + q) and (lane 0 of the quad) the scale, when `store`. Every lane of the warp
// calls it (the amax crosses the quad's lanes, which hold one row: rows never mix).
__device__ __forceinline__ void store_row_block_fp8(const std::uint32_t (&w)[4][4], int q,
                                                    bool store, std::uint8_t* out, float* scale) {
  std::uint32_t amax = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      amax = fp8::amax_update(amax, low_bf16(w[c][e]));
      amax = fp8::amax_update(amax, high_bf16(w[c][e]));
    }
  }
  amax = ptx::quad_amax(amax);
  const int e = fp8::scale_exponent(amax);
  const float inverse = fp8::inverse_scale_of(e);
  if (!store) return;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const std::uint32_t(&v)[4] = w[c];
    *reinterpret_cast<uint2*>(out + 8 * (4 * c + q)) = make_uint2(
        ptx::quantize4(low_bf16(v[0]), high_bf16(v[0]), low_bf16(v[1]), high_bf16(v[1]), inverse),
        ptx::quantize4(low_bf16(v[2]), high_bf16(v[2]), low_bf16(v[3]), high_bf16(v[3]), inverse));
  }
  if (q == 0) *scale = fp8::scale_of(e);
}

// SwiGLU: in the accumulators, the first half of the columns is the gate tile, the second
// the up tile of the same kTileN / 2 output columns.
//   g = bf16(acc_g), u = bf16(acc_u), hidden = bf16(silu(g) * u) (numerics::swiglu_fast)
// kPreActivations: g and u are stored too (p.gate_out, p.up_out).
// kClamped: hidden = bf16(silu(min(g, L)) * clamp(u, -L, L)), L = p.swiglu_limit
// (numerics::swiglu_clamped_fast); g and u are stored unclamped. NOTES: a template parameter, not
// a runtime flag, so the unclamped instantiations' code is what it was (docs/perf/NOTES.md,
// ## clamped SwiGLU, has the ptxas counts of both).
// kQuantizedHidden (e4m3 tiles of 128 output columns: a row's 1x128 block of hidden is the quad's
// after the column loop): hidden quantized as well, for the down GEMM that reads it
// (GateUpForwardFp8Args::hidden_quantized; Fp8Params::q_rows[0]), with the rows quantizer's bits
// (store_row_block_fp8).
template <class F, bool kPreActivations, bool kClamped, bool kQuantizedHidden = false>
__device__ __forceinline__ void store_swiglu(const float (&acc)[F::kAcc], const TileInfo& t,
                                             const GemmParams& p, int wg, int warp, int lane,
                                             const Fp8Params* fp8 = nullptr) {
  static_assert(!kQuantizedHidden || (F::kFp8 && F::kOutTileN == 128),
                "quantized hidden: e4m3 tiles of 128 output columns (one 1x128 block a row)");
  auto* hidden = static_cast<__nv_bfloat16*>(p.out);
  float limit = 0.0f;
  if constexpr (kClamped) limit = p.swiglu_limit;
  const int n0 = t.n0 * F::kOutTileN;
  const int q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const GroupRow row = group_row(t, p, wg, warp, lane, h);
    std::uint32_t held[F::kTileN / 64][4];  // kQuantizedHidden: the row's block, as stored
#pragma unroll
    for (int c = 0; c < F::kTileN / 64; ++c) {
      std::uint32_t hv[4], gv[4], uv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 4 * (4 * c + i) + 2 * h;
        constexpr int kUp = F::kAcc / 2;
        // NOTES: rounded as bf16 pairs (one packed conversion for two values) and unpacked:
        // the same bits as two scalar roundings, half the conversion-pipe work (v6).
        gv[i] = pack_bf16x2(acc[a], acc[a + 1]);
        uv[i] = pack_bf16x2(acc[kUp + a], acc[kUp + a + 1]);
        const float g0 = low_bf16(gv[i]), g1 = high_bf16(gv[i]);
        const float u0 = low_bf16(uv[i]), u1 = high_bf16(uv[i]);
        if constexpr (kClamped) {
          hv[i] = pack_bf16x2(numerics::swiglu_clamped_fast(g0, u0, limit),
                              numerics::swiglu_clamped_fast(g1, u1, limit));
        } else {
          hv[i] = pack_bf16x2(numerics::swiglu_fast(g0, u0), numerics::swiglu_fast(g1, u1));
        }
      }
      const int col = n0 + 8 * (4 * c + q);
      const bool ok = row.ok && col < p.n;
      const uint4 hs = quad_gather(hv[0], hv[1], hv[2], hv[3], q);
      if (ok) *reinterpret_cast<uint4*>(hidden + row.offset + col) = hs;
      if constexpr (kQuantizedHidden) {
        held[c][0] = hs.x, held[c][1] = hs.y, held[c][2] = hs.z, held[c][3] = hs.w;
      }
      if constexpr (kPreActivations) {
        const uint4 gs = quad_gather(gv[0], gv[1], gv[2], gv[3], q);
        const uint4 us = quad_gather(uv[0], uv[1], uv[2], uv[3], q);
        if (ok) {
          *reinterpret_cast<uint4*>(p.gate_out + row.offset + col) = gs;
          *reinterpret_cast<uint4*>(p.up_out + row.offset + col) = us;
        }
      }
    }
    if constexpr (kQuantizedHidden) {  // n is a multiple of 128: the block is whole
      const Fp8Params& f = *fp8;
      store_row_block_fp8(
          held, q, row.ok, f.q_rows[0] + static_cast<long long>(row.index) * f.q_rows_ld + n0,
          f.q_rows_scales[0] + static_cast<long long>(n0 / 128) * f.q_rows_scale_ld + row.index);
    }
  }
}

// Where a K-grouped tile's group keeps its sum in this launch: the output (as the policy E stores
// it: fp32 or bf16, added to or not), or (a pass plan's kOpen and kCarry groups, a data-dependent
// choice) its fp32 carry slot.
struct GroupOutput {
  void* base;  // the group's [m, n] matrix
  long long ld;
  int fp32;
  int accumulate;
};

template <class E>
__device__ __forceinline__ GroupOutput group_output(const TileInfo& t, const GemmParams& p) {
  if (p.sched.steps != nullptr) {
    const int code = __ldg(p.sched.steps + t.group);
    const int step = code & ((1 << kPassSlotShift) - 1);
    if (step == kOpen || step == kCarry) {
      const long long slot = code >> kPassSlotShift;  // < slots (runs_group)
      return {p.carry + slot * p.m * p.n, p.n, 1, 0};
    }
  }
  const std::size_t bytes = E::kFp32 ? 4 : 2;
  return {static_cast<std::uint8_t*>(p.out) + t.group * p.out_group_stride * bytes, p.ld_out,
          E::kFp32 ? 1 : 0, E::kAccumulate ? 1 : 0};
}

// K-grouped fp32 accumulation: the accumulators start from the values the reduction carries: the
// output's (continue_reduction), or the group's carry slot (a pass plan's kCarry and kClose
// groups). The exact inverse of store_plain's fp32 path; elements outside [m, n] start at zero.
template <class F>
__device__ __forceinline__ void load_fp32_accumulators(float (&acc)[F::kAcc], const TileInfo& t,
                                                       const GemmParams& p, int wg, int warp,
                                                       int lane) {
  const int n0 = t.n0 * F::kTileN;
  const float* seed;
  long long ld;
  if (p.sched.steps != nullptr) {
    const long long slot = __ldg(p.sched.steps + t.group) >> kPassSlotShift;
    seed = p.carry + slot * p.m * p.n;
    ld = p.n;
  } else {
    seed = static_cast<const float*>(p.out) + t.group * p.out_group_stride;
    ld = p.ld_out;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = t.m0 + acc_row(wg, warp, lane, h);
    const long long offset = static_cast<long long>(r) * ld;
#pragma unroll
    for (int j = 0; j < F::kTileN / 8; ++j) {
      const int col = n0 + acc_col(lane, j);
      float2 v = make_float2(0.0f, 0.0f);
      if (r < p.m && col < p.n) {
        v = *reinterpret_cast<const float2*>(seed + offset + col);
      }
      acc[4 * j + 2 * h] = v.x;
      acc[4 * j + 2 * h + 1] = v.y;
    }
  }
}

// Plain store of the accumulators: out[row, col] = round(scale_row * acc) (E::kRowScale: scaled).
// M-grouped: rows of the row buffer (E::kScatter: to their home slots instead); K-grouped: rows of
// the group's [m, n] output. E::kFp32: fp32 pairs (E::kAccumulate: added to the output's values).
template <class F, class E>
__device__ __forceinline__ void store_plain(const float (&acc)[F::kAcc], const TileInfo& t,
                                            const GemmParams& p, int wg, int warp, int lane) {
  constexpr bool kKGrouped = F::kKGrouped;
  const int n0 = t.n0 * F::kTileN;
  const int q = lane % 4;
  // M-grouped: the rows of `out`; K-grouped: the group's matrix (the output or a carry slot).
  static_assert(!(kKGrouped && (E::kRowScale || E::kScatter)), "rows of the row buffer only");
  GroupOutput o{p.out, p.ld_out, E::kFp32 ? 1 : 0, E::kAccumulate ? 1 : 0};
  if constexpr (kKGrouped) o = group_output<E>(t, p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = t.m0 + acc_row(wg, warp, lane, h);
    long long offset;
    float scale = 1.0f;
    bool row_ok;
    if constexpr (kKGrouped) {
      row_ok = r < p.m;
      offset = static_cast<long long>(r) * o.ld;
    } else {
      row_ok = r < t.row_count;
      offset = static_cast<long long>(t.row_base + r) * o.ld;
      if constexpr (E::kRowScale) {
        if (row_ok) scale = __ldg(p.row_scale + t.row_base + r);
      }
    }
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(o.base) + offset;
    if constexpr (E::kScatter) {  // the row's slot on its home rank
      const int src = row_ok ? __ldg(p.scatter_rows + t.row_base + r) : -1;
      row_ok = src >= 0;
      if (row_ok) {
        const unsigned rank = static_cast<unsigned>(src) / p.scatter_slots;
        const unsigned slot = static_cast<unsigned>(src) - rank * p.scatter_slots;
        dst = static_cast<__nv_bfloat16*>(p.scatter_peers[rank]) +
              static_cast<long long>(slot) * p.ld_out;
      }
    }
    constexpr bool scaled = E::kRowScale;
    if (o.fp32) {
      if (!row_ok) continue;
#pragma unroll
      for (int j = 0; j < F::kTileN / 8; ++j) {
        const int col = n0 + acc_col(lane, j);
        if (col < p.n) {
          auto* out = reinterpret_cast<float2*>(static_cast<float*>(o.base) + offset + col);
          const int a = 4 * j + 2 * h;
          float2 v = make_float2(acc[a], acc[a + 1]);
          if (o.accumulate) {
            const float2 old = *out;
            v = make_float2(__fadd_rn(old.x, v.x), __fadd_rn(old.y, v.y));
          }
          *out = v;
        }
      }
      continue;
    }
#pragma unroll
    for (int c = 0; c < F::kTileN / 32; ++c) {
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

// A consumer warpgroup's bf16 rows of one tile (RowsBf16), held in registers from its
// epilogue until the next tile's first K block is issued, and stored then (store_held), while the
// tensor cores work: the tile's epilogue is only the rounding and the destination rows. A lane
// holds the pairs of its two rows (h) in the accumulator layout, as store_plain would pass them
// to quad_gather. NOTES: the down forward on qwen3-30b-a3b stores a 128 x 256 tile after only 12
// K blocks; holding its rows made it 2-4% faster on the H200 (docs/perf/NOTES.md, 85a3bf9).
struct HeldRows {
  std::uint32_t v[2][8][4];    // [h][c][i]: pair of column chunk 4c + i (store_plain's v[i])
  __nv_bfloat16* row[2] = {};  // row h's element at the tile's first column, or null
  int columns = 0;             // the tile's columns inside n
  bool any = false;            // rows are held (the same in every lane of the warpgroup)
};

// What a consumer loop keeps when its epilogue holds no rows: nothing (store_held: nothing).
struct NoHeldRows {};
__device__ __forceinline__ void store_held(NoHeldRows&, int) {}

// The epilogue of a RowsBf16 tile when its rows are held: store_plain's values and
// destinations, into `held` (empty: store_held ran since it was last filled). NOTES: the row
// scale and scatter lines repeat store_plain's: a helper shared by both (two forms tried) changed
// the SASS of every scattering kernel, the measured ones and the megakernel's included, so they
// stay as measured (85a3bf9).
template <class F, class E>
__device__ __forceinline__ void hold_plain(const float (&acc)[F::kAcc], const TileInfo& t,
                                           const GemmParams& p, int wg, int warp, int lane,
                                           HeldRows& held) {
  static_assert(!F::kKGrouped && F::kTileN == 256 && !E::kFp32, "M-grouped bf16 rows");
  const int n0 = t.n0 * F::kTileN;
  held.columns = p.n - n0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = t.m0 + acc_row(wg, warp, lane, h);
    bool row_ok = r < t.row_count;
    float scale = 1.0f;
    if constexpr (E::kRowScale) {
      if (row_ok) scale = __ldg(p.row_scale + t.row_base + r);
    }
    __nv_bfloat16* dst =
        static_cast<__nv_bfloat16*>(p.out) + static_cast<long long>(t.row_base + r) * p.ld_out;
    if constexpr (E::kScatter) {  // the row's slot on its home rank
      const int src = row_ok ? __ldg(p.scatter_rows + t.row_base + r) : -1;
      row_ok = src >= 0;
      if (row_ok) {
        const unsigned rank = static_cast<unsigned>(src) / p.scatter_slots;
        const unsigned slot = static_cast<unsigned>(src) - rank * p.scatter_slots;
        dst = static_cast<__nv_bfloat16*>(p.scatter_peers[rank]) +
              static_cast<long long>(slot) * p.ld_out;
      }
    }
    held.row[h] = row_ok ? dst + n0 : nullptr;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int a = 4 * (4 * c + i) + 2 * h;
        float v0 = acc[a], v1 = acc[a + 1];
        if constexpr (E::kRowScale) {
          v0 = __fmul_rn(scale, v0);
          v1 = __fmul_rn(scale, v1);
        }
        held.v[h][c][i] = pack_bf16x2(v0, v1);
      }
    }
  }
  held.any = true;
}

// Stores the rows `held` holds, if any (as store_plain stores them), and empties it. Every lane of
// the warpgroup calls it.
__device__ __forceinline__ void store_held(HeldRows& held, int lane) {
  if (held.any) {
    const int q = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const uint4 s =
            quad_gather(held.v[h][c][0], held.v[h][c][1], held.v[h][c][2], held.v[h][c][3], q);
        const int col = 8 * (4 * c + q);
        if (held.row[h] != nullptr && col < held.columns) {
          *reinterpret_cast<uint4*>(held.row[h] + col) = s;
        }
      }
    }
  }
  held.any = false;
}

// The lines of g and u that store_swiglu_backward will read for this lane's rows of the tile,
// fetched into L2 (kEpilogueLeadBlocks K blocks ahead, mma_tile): each lane of a quad takes every
// fourth 128-byte line of its row's tile columns. The loads themselves stay in the store, so
// the bits cannot change.
template <class F>
__device__ __forceinline__ void prefetch_swiglu_rows(const TileInfo& t, const GemmParams& p, int wg,
                                                     int warp, int lane) {
  constexpr int kLines = F::kTileN * 2 / 128;  // bf16 columns of a tile row, in 128-byte lines
  const int n0 = t.n0 * F::kTileN;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const GroupRow row = group_row(t, p, wg, warp, lane, h);
#pragma unroll
    for (int i = 0; i < kLines; i += 4) {
      const int col = n0 + 64 * (i + lane % 4);
      if (row.ok && i + lane % 4 < kLines && col < p.n) {
        ptx::prefetch_l2(p.swiglu_gate + row.offset + col);
        ptx::prefetch_l2(p.swiglu_up + row.offset + col);
      }
    }
  }
}

// The staging tile of the SwiGLU backward that quantizes (kQuantized below; F::kStagingBytes): a
// 128 x 128 block of bf16, rows of 256 bytes, 16-byte piece k of row r at piece k ^
// staging_swizzle(r). NOTES: the swizzle keeps both sides free of bank conflicts: the epilogue's
// stores (a warp: 8 consecutive rows x 4 pieces; even and odd rows land in opposite halves of the
// 128-byte bank line) and store_token_block's reads (a warp: 4 rows 32 apart x 2 pieces; each row
// in its own quarter of the line).
__device__ __forceinline__ int staging_swizzle(int r) {
  return (4 * (r & 1)) ^ (2 * ((r >> 5) & 3));
}
__device__ __forceinline__ std::uint8_t* staging_piece(std::uint8_t* staging, int r, int k) {
  return staging + r * 256 + ((k ^ staging_swizzle(r)) * 16);
}

// The token-axis form of the 128 x 128 bf16 block in the staging tile (one tile's dg or du: its
// rows are one 128-row token block of the group, rows past the group's count staged as 0), as
// quantize_token_tile (cuda/kernels/fp8_quantize.cuh) writes it from memory: per column, the
// scale of its 128 rows and their bytes in row order. The 256 consumer threads (`thread`) each
// take two adjacent columns over 32 rows, thread % 4 the quarter (the four quarters of a column
// are adjacent lanes: their amax crosses them by shuffles), and store each column's 32 bytes.
// data: the block's first byte (column n0, row row0 of the [n, ld] copy; 16-byte aligned, ld a
// multiple of 16); scales: the block's scales from column n0 (8-byte aligned).
__device__ __forceinline__ void store_token_block(std::uint8_t* staging, int thread,
                                                  std::uint8_t* data, long long ld, float* scales) {
  const int pair = thread / 4, quarter = thread % 4;
  const int piece = pair / 4, word = pair % 4;  // where the pair's columns sit in a staged row
  std::uint32_t v[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = 32 * quarter + i;
    v[i] = *reinterpret_cast<const std::uint32_t*>(staging_piece(staging, r, piece) + 4 * word);
  }
  std::uint32_t amax[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    amax[0] = fp8::amax_update(amax[0], low_bf16(v[i]));
    amax[1] = fp8::amax_update(amax[1], high_bf16(v[i]));
  }
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const std::uint32_t other = __shfl_xor_sync(0xffffffffu, amax[c], offset);
      amax[c] = other > amax[c] ? other : amax[c];
    }
  }
  float scale[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int e = fp8::scale_exponent(amax[c]);
    scale[c] = fp8::scale_of(e);
    const float inverse = fp8::inverse_scale_of(e);
    const auto value = [&](int i) { return c == 0 ? low_bf16(v[i]) : high_bf16(v[i]); };
    std::uint32_t q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      q[j] = ptx::quantize4(value(4 * j), value(4 * j + 1), value(4 * j + 2), value(4 * j + 3),
                            inverse);
    }
    std::uint8_t* column = data + (2 * pair + c) * ld + 32 * quarter;
    *reinterpret_cast<uint4*>(column) = make_uint4(q[0], q[1], q[2], q[3]);
    *reinterpret_cast<uint4*>(column + 16) = make_uint4(q[4], q[5], q[6], q[7]);
  }
  if (quarter == 0) *reinterpret_cast<float2*>(scales + 2 * pair) = make_float2(scale[0], scale[1]);
}

// The down dgrad with the SwiGLU backward (SwigluBackwardEpilogue): dh = bf16(acc) as store_plain
// would store it (kRowScale: bf16(row_scale[r] * acc)), then, per 8 columns of a row, 16
// bytes of g and u in and 16 bytes of dg and du out. The loads of kBatch such pieces are issued
// before the first is used.
// kDot: also dot[r][c] = sum over the kDotColumns columns of chunk c of acc * h, h = bf16(silu(g) *
// u) (swiglu_fast, as the gate/up epilogue rounds it). A batch of pieces is exactly one chunk (a
// tile holds two). NOTES: the order is
// fixed: each lane of a quad (the 4 lanes holding one row) sums the chunk's columns it holds in
// its accumulators (32: columns 8j + 2q and 8j + 2q + 1 of the chunk, j = 0..15), in increasing
// accumulator index with __fmaf_rn from 0, then the quad adds its lanes' sums with __fadd_rn in a
// fixed butterfly (lanes q ^ 1, then q ^ 2; fp32 addition commutes, so all four lanes hold the
// same bits). h comes from g and u in the
// stored layout (8 consecutive columns a lane, after quad_gather); quad_gather is a 4 x 4
// transpose of the quad's pairs (an involution), so applying it to the packed h pairs puts h in
// the accumulator layout.
// kClamped: dg, du = bf16(swiglu_backward_clamped_fast(g, u, dh, L)) (zero where the clamp acts)
// and h = bf16(swiglu_clamped_fast(g, u, L)), the forward epilogue's hidden bit for bit.
// kScaledHidden (with kRowScale and kDot): bf16(scale * h) to p.scaled_hidden as well.
// kQuantized (e4m3; RowsTimesWeightFp8Args::quantized): dg and du also quantized for the GEMMs
// that read them, with the standalone quantizers' bits:
//   rows: each row's 1x128 block from the quad that holds it (a batch of pieces is one block:
//     store_row_block_fp8, fp8->q_rows), beside dg and du in bf16; any tile width;
//   rows_and_tokens (128-wide tiles with a staging tile): and the tile's token block column by
//     column (store_token_block, fp8->q_tokens) from the staging tile, where both warpgroups
//     stage dg, then du (four barriers of the 256 consumer threads: staged, read, staged, read;
//     the last one keeps the next tile's dg from overwriting du while it is read). dg and du in
//     bf16 only where p.d_gate is set.
enum class QuantizedDgDu { none, rows, rows_and_tokens };
template <class F, bool kRowScale, bool kDot, bool kClamped, bool kScaledHidden,
          QuantizedDgDu kQuantized = QuantizedDgDu::none>
__device__ __forceinline__ void store_swiglu_backward(const float (&acc)[F::kAcc],
                                                      const TileInfo& t, const GemmParams& p,
                                                      int wg, int warp, int lane,
                                                      std::uint8_t* staging = nullptr,
                                                      const Fp8Params* fp8 = nullptr) {
  static_assert(F::kInputGradient, "the down dgrad's epilogue");
  static_assert(!kScaledHidden || (kRowScale && kDot), "bf16(w h) needs the scale and h");
  constexpr int kPieces = F::kTileN / 32;  // 16-byte pieces of a row a lane stores
  constexpr int kBatch = 4;
  static_assert(kPieces % kBatch == 0, "whole batches");
  constexpr bool kRows = kQuantized != QuantizedDgDu::none;
  constexpr bool kTokens = kQuantized == QuantizedDgDu::rows_and_tokens;
  static_assert(!kRows || F::kFp8, "quantized dg and du: e4m3 forms");
  static_assert(!kTokens || (kPieces == kBatch && !kScaledHidden &&
                             F::kStagingBytes == kTileM * F::kTileN * 2),
                "quantized token blocks of dg and du: 128-wide tiles with a staging tile");
  std::uint32_t du_held[2][kBatch][4];  // kRows: du of the block (kTokens: of both rows, staged
                                        // after dg)
  static_assert(kBatch * 32 == kDotColumns, "a batch of pieces is one dot chunk");
  const int n0 = t.n0 * F::kTileN;
  const int q = lane % 4;
  constexpr bool scaled = kRowScale;
  const int dot_columns = (p.n + kDotColumns - 1) / kDotColumns;
  float limit = 0.0f;
  if constexpr (kClamped) limit = p.swiglu_limit;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const GroupRow row = group_row(t, p, wg, warp, lane, h);
    float scale = 1.0f;
    if constexpr (kRowScale) {
      if (row.ok) scale = __ldg(p.row_scale + row.index);
    }
#pragma unroll
    for (int c0 = 0; c0 < kPieces; c0 += kBatch) {
      uint4 g[kBatch], u[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int col = n0 + 8 * (4 * (c0 + i) + q);
        g[i] = u[i] = make_uint4(0, 0, 0, 0);
        if (row.ok && col < p.n) {
          g[i] = __ldg(reinterpret_cast<const uint4*>(p.swiglu_gate + row.offset + col));
          u[i] = __ldg(reinterpret_cast<const uint4*>(p.swiglu_up + row.offset + col));
        }
      }
      float dot = 0.0f;
      std::uint32_t dg_row[kBatch][4];  // kRows: dg of this row's block
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = c0 + i;
        std::uint32_t v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int a = 4 * (4 * c + j) + 2 * h;
          float v0 = acc[a], v1 = acc[a + 1];
          if (scaled) {
            v0 = __fmul_rn(scale, v0);
            v1 = __fmul_rn(scale, v1);
          }
          v[j] = pack_bf16x2(v0, v1);
        }
        const uint4 dh = quad_gather(v[0], v[1], v[2], v[3], q);
        const std::uint32_t dh_w[4] = {dh.x, dh.y, dh.z, dh.w};
        const std::uint32_t g_w[4] = {g[i].x, g[i].y, g[i].z, g[i].w};
        const std::uint32_t u_w[4] = {u[i].x, u[i].y, u[i].z, u[i].w};
        std::uint32_t dg_w[4], du_w[4], h_w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float g0 = low_bf16(g_w[e]), g1 = high_bf16(g_w[e]);
          const float u0 = low_bf16(u_w[e]), u1 = high_bf16(u_w[e]);
          float dg0, du0, dg1, du1;
          if constexpr (kClamped) {
            numerics::swiglu_backward_clamped_fast(g0, u0, low_bf16(dh_w[e]), limit, &dg0, &du0);
            numerics::swiglu_backward_clamped_fast(g1, u1, high_bf16(dh_w[e]), limit, &dg1, &du1);
          } else {
            numerics::swiglu_backward_fast(g0, u0, low_bf16(dh_w[e]), &dg0, &du0);
            numerics::swiglu_backward_fast(g1, u1, high_bf16(dh_w[e]), &dg1, &du1);
          }
          dg_w[e] = pack_bf16x2(dg0, dg1);
          du_w[e] = pack_bf16x2(du0, du1);
          if constexpr (kDot && kClamped) {
            h_w[e] = pack_bf16x2(numerics::swiglu_clamped_fast(g0, u0, limit),
                                 numerics::swiglu_clamped_fast(g1, u1, limit));
          } else if constexpr (kDot) {
            h_w[e] = pack_bf16x2(numerics::swiglu_fast(g0, u0), numerics::swiglu_fast(g1, u1));
          }
        }
        if constexpr (kScaledHidden) {
          // bf16(w h) for the down weight gradient (SwigluBackwardEpilogue::scaled_hidden), in
          // the stored layout beside dg and du.
          const int col = n0 + 8 * (4 * c + q);
          if (row.ok && col < p.n) {
            std::uint32_t wh_w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              wh_w[e] = pack_bf16x2(__fmul_rn(scale, low_bf16(h_w[e])),
                                    __fmul_rn(scale, high_bf16(h_w[e])));
            }
            *reinterpret_cast<uint4*>(p.scaled_hidden + row.offset + col) =
                make_uint4(wh_w[0], wh_w[1], wh_w[2], wh_w[3]);
          }
        }
        if constexpr (kDot) {
          const uint4 hs = quad_gather(h_w[0], h_w[1], h_w[2], h_w[3], q);
          const std::uint32_t hs_w[4] = {hs.x, hs.y, hs.z, hs.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int a = 4 * (4 * c + j) + 2 * h;
            dot = __fmaf_rn(acc[a], low_bf16(hs_w[j]), dot);
            dot = __fmaf_rn(acc[a + 1], high_bf16(hs_w[j]), dot);
          }
        }
        const int col = n0 + 8 * (4 * c + q);
        if (row.ok && col < p.n && (!kTokens || p.d_gate != nullptr)) {
          *reinterpret_cast<uint4*>(p.d_gate + row.offset + col) =
              make_uint4(dg_w[0], dg_w[1], dg_w[2], dg_w[3]);
          *reinterpret_cast<uint4*>(p.d_up + row.offset + col) =
              make_uint4(du_w[0], du_w[1], du_w[2], du_w[3]);
        }
        if constexpr (kRows) {
#pragma unroll
          for (int e = 0; e < 4; ++e) dg_row[i][e] = dg_w[e], du_held[h][i][e] = du_w[e];
        }
      }
      if constexpr (kRows) {  // the batch's 128 columns from block0: n is a multiple of 128
        const Fp8Params& f = *fp8;
        const int block0 = n0 + 32 * c0;
        const long long at = static_cast<long long>(row.index) * f.q_rows_ld + block0;
        const long long scale_at =
            static_cast<long long>(block0 / 128) * f.q_rows_scale_ld + row.index;
        store_row_block_fp8(dg_row, q, row.ok, f.q_rows[0] + at, f.q_rows_scales[0] + scale_at);
        store_row_block_fp8(du_held[h], q, row.ok, f.q_rows[1] + at, f.q_rows_scales[1] + scale_at);
      }
      if constexpr (kTokens) {
        const int r = acc_row(wg, warp, lane, h);
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const std::uint32_t(&w)[4] = dg_row[i];
          *reinterpret_cast<uint4*>(staging_piece(staging, r, 4 * i + q)) =
              row.ok ? make_uint4(w[0], w[1], w[2], w[3]) : make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (kDot) {
        dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, 1));
        dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, 2));
        const int chunk = (n0 + 32 * c0) / kDotColumns;
        if (q == 0 && row.ok && chunk < dot_columns) {
          p.swiglu_dot[static_cast<long long>(row.index) * dot_columns + chunk] = dot;
        }
      }
    }
  }
  if constexpr (kTokens) {
    const int thread = wg * 128 + warp * 32 + lane;
    const long long row0 = t.row_base + t.m0;  // a multiple of 128: the tile is a token block
    const long long block = row0 / 128;
    const Fp8Params& f = *fp8;
    const auto tokens = [&](int which) {
      store_token_block(staging, thread, f.q_tokens[which] + n0 * f.q_tokens_ld + row0,
                        f.q_tokens_ld, f.q_tokens_scales[which] + block * f.q_tokens_scale_ld + n0);
    };
    ptx::named_barrier_sync(kConsumerBarrierId, kConsumerThreads);  // dg staged
    tokens(0);
    ptx::named_barrier_sync(kConsumerBarrierId, kConsumerThreads);  // dg read
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = group_row(t, p, wg, warp, lane, h).ok;
      const int r = acc_row(wg, warp, lane, h);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const std::uint32_t(&w)[4] = du_held[h][i];
        *reinterpret_cast<uint4*>(staging_piece(staging, r, 4 * i + q)) =
            ok ? make_uint4(w[0], w[1], w[2], w[3]) : make_uint4(0, 0, 0, 0);
      }
    }
    ptx::named_barrier_sync(kConsumerBarrierId, kConsumerThreads);  // du staged
    tokens(1);
    ptx::named_barrier_sync(kConsumerBarrierId, kConsumerThreads);  // du read
  }
}

// The bf16 wgrad epilogue through shared memory and TMA (F::kTmaStore). Each consumer warpgroup
// owns half of the staging tile: its 64 x 256 accumulators as four 64 x 64 boxes in the 128-byte
// swizzled layout the tensor map expects (16-byte piece k of row r at piece k ^ (r % 8)), written
// 16 x 16 per warp instruction (stmatrix); then one thread of the warpgroup stores the boxes that
// lie inside the group's [m, n] output (a 2-D map over the groups' rows, out_map_group_rows per
// group, box 64 x 64) as one bulk group, and the Consumers go on with the next tile while the copy
// engine writes. The half is written again only after that group has been read out of shared
// memory (the wait at the start).
template <class F>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmParams& p, int wg, int warp, int lane,
                                               std::uint8_t* staging, const CUtensorMap* map_out) {
  static_assert(F::kTmaStore && F::kTileN % 64 == 0, "bf16 wgrad tiles");
  constexpr std::uint32_t kBoxBytes = 64 * 128;
  const bool issuer = warp == 0 && lane == 0;
  const int barrier = kWarpgroupBarrierId + wg;
  std::uint8_t* half = staging + wg * (F::kStagingBytes / 2);
  if (issuer) ptx::tma_store_wait_read<0>();
  ptx::named_barrier_sync(barrier, 128);
  // Lane l addresses row l % 8 of matrix l / 8: matrices 0, 1 are rows 0-7, 8-15 of n8 block j,
  // matrices 2, 3 the same rows of block j + 1.
  const int matrix = lane / 8;
  const int row = warp * 16 + (matrix & 1) * 8 + lane % 8;  // within the warpgroup's 64 rows
  const std::uint32_t row_address = ptx::smem_addr(half) + row * 128;
  const int swizzle = row & 7;
#pragma unroll
  for (int j = 0; j < F::kTileN / 8; j += 2) {
    const int piece = j % 8 + (matrix >> 1);  // 16-byte piece of the box row (8 columns)
    const std::uint32_t address = row_address + (j / 8) * kBoxBytes + ((piece ^ swizzle) << 4);
    ptx::stmatrix_x4(address, pack_bf16x2(acc[4 * j], acc[4 * j + 1]),
                     pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]),
                     pack_bf16x2(acc[4 * j + 4], acc[4 * j + 5]),
                     pack_bf16x2(acc[4 * j + 6], acc[4 * j + 7]));
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(barrier, 128);
  if (issuer) {
    const int r0 = t.m0 + wg * 64;
    if (r0 < p.m) {
#pragma unroll
      for (int b = 0; b < F::kTileN / 64; ++b) {
        const int c0 = t.n0 * F::kTileN + b * 64;
        if (c0 < p.n) {
          ptx::tma_store_2d(map_out, half + b * kBoxBytes, c0, t.group * p.out_map_group_rows + r0);
        }
      }
    }
    ptx::tma_store_commit();
  }
}

// The accumulators of a tile before its K loop: zeros, or the fp32 output's values when a
// reduction continues.
template <class F>
__device__ __forceinline__ void init_accumulators(float (&acc)[F::kAcc], const TileInfo& t,
                                                  const GemmParams& p, int wg, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < F::kAcc; ++i) acc[i] = 0.0f;
  if constexpr (F::kSeeded) load_fp32_accumulators<F>(acc, t, p, wg, warp, lane);
}

// The epilogue policies: what a GEMM stores, fixed at compile time. Each has
//   template <class F> static void store(acc, tile, descriptor, wg, warp, lane, staging)
// for one consumer warpgroup's accumulators of one tile (staging: the ring's staging tile, for the
// TMA-store epilogue), and says which forms it serves (static_assert in store).
namespace epilogue {

// An epilogue that reads row buffers has a lead<F>(tile, params, wg, warp, lane), which the
// consumer runs inside the K loop (mma_tile's `lead`) to start those reads early.
template <class E, class F>
concept ReadsRows = requires(const TileInfo& t, const GemmParams& p) {
  E::template lead<F>(t, p, 0, 0, 0);
};

// An epilogue that writes e4m3 outputs has kWritesFp8 true and a store that also takes the e4m3
// kernel's Fp8Params (where those outputs go), which the engine then calls.
template <class E>
concept WritesFp8 = requires {
  requires E::kWritesFp8;
};

// An epilogue that can hold a tile's rows until the next tile's first K block (HeldRows) has
// kHolds<F> true for the forms where it does, and a hold<F>(acc, tile, descriptor, wg, warp, lane,
// held) that fills `held` instead of storing.
template <class E, class F>
concept HoldsRows = requires {
  requires E::template kHolds<F>;
};

// Gate/up: hidden = bf16(silu(g) * u); kPreActivations: g and u too (GateUpForwardArgs gate, up);
// kClamped: MoK's clamped SwiGLU with the limit GemmParams::swiglu_limit; kQuantizedHidden: and
// hidden quantized (Fp8Params::q_rows[0]; store_swiglu), with the store that takes the e4m3
// kernel's Fp8Params (WritesFp8).
template <bool kPreActivations, bool kClamped = false, bool kQuantizedHidden = false>
struct SwigluForward {
  static constexpr bool kWritesFp8 = kQuantizedHidden;
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging) {
    static_assert(F::kind == FormKind::kGateUp, "the gate/up epilogue");
    static_assert(!kQuantizedHidden, "the quantizing epilogue's store takes the Fp8Params");
    store_swiglu<F, kPreActivations, kClamped>(acc, t, d.p, wg, warp, lane);
  }
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging, const Fp8Params& fp8) {
    static_assert(F::kind == FormKind::kGateUp, "the gate/up epilogue");
    static_assert(kQuantizedHidden, "the store without quantized outputs takes no Fp8Params");
    store_swiglu<F, kPreActivations, kClamped, true>(acc, t, d.p, wg, warp, lane, &fp8);
  }
};

// M-grouped plain bf16 rows: out = bf16(acc), or bf16(row_scale[r] * acc) (kRowScale), to `out`
// or scattered to the rows' home slots (kScatter: RowScatter).
template <bool kRowScaleOn, bool kScatterOn>
struct RowsBf16 {
  static constexpr bool kFp32 = false, kAccumulate = false;
  static constexpr bool kRowScale = kRowScaleOn, kScatter = kScatterOn;
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging) {
    static_assert(F::kind == FormKind::kRowsWT || F::kind == FormKind::kRowsW, "plain rows");
    store_plain<F, RowsBf16>(acc, t, d.p, wg, warp, lane);
  }
  // The rows are held and stored during the next tile's first K block (HeldRows), in the bf16
  // forms (HeldRows has a 256-wide tile's registers).
  template <class F>
  static constexpr bool kHolds = !F::kFp8;
  template <class F>
  __device__ __forceinline__ static void hold(const float (&acc)[F::kAcc], const TileInfo& t,
                                              const GemmDescriptor& d, int wg, int warp, int lane,
                                              HeldRows& held) {
    static_assert(F::kind == FormKind::kRowsWT || F::kind == FormKind::kRowsW, "plain rows");
    hold_plain<F, RowsBf16>(acc, t, d.p, wg, warp, lane, held);
  }
};

// RowsW with an fp32 output: the accumulators as they are.
struct RowsFp32 {
  static constexpr bool kFp32 = true, kAccumulate = false, kRowScale = false, kScatter = false;
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging) {
    static_assert(F::kInputGradient, "the fp32 dgrad output");
    store_plain<F, RowsFp32>(acc, t, d.p, wg, warp, lane);
  }
};

// RowsW (the down dgrad) with the SwiGLU backward: dg, du from dh (kRowScale: dh scaled per row),
// kDot: and the router-weight dot partials (SwigluBackwardEpilogue); kClamped: the clamped
// SwiGLU's backward (GemmParams::swiglu_limit); kScaledHidden (with both kRowScale and kDot):
// and bf16(w h) (SwigluBackwardEpilogue::scaled_hidden, GemmParams::scaled_hidden).
// kQuantized: and dg, du quantized (Fp8Params::q_rows, and q_tokens with rows_and_tokens;
// store_swiglu_backward), with the store that takes the e4m3 kernel's Fp8Params (WritesFp8).
template <bool kRowScale, bool kDot, bool kClamped = false, bool kScaledHidden = false,
          QuantizedDgDu kQuantized = QuantizedDgDu::none>
struct SwigluBackward {
  static constexpr bool kWritesFp8 = kQuantized != QuantizedDgDu::none;
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging) {
    static_assert(!kWritesFp8, "the quantizing epilogue's store takes the Fp8Params");
    store_swiglu_backward<F, kRowScale, kDot, kClamped, kScaledHidden>(acc, t, d.p, wg, warp, lane);
  }
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging, const Fp8Params& fp8) {
    static_assert(kWritesFp8, "the store without quantized outputs takes no Fp8Params");
    store_swiglu_backward<F, kRowScale, kDot, kClamped, kScaledHidden, kQuantized>(
        acc, t, d.p, wg, warp, lane, staging, &fp8);
  }
  // Before the end of the K loop (Engine::consume): g and u of the tile's rows into L2.
  template <class F>
  __device__ __forceinline__ static void lead(const TileInfo& t, const GemmParams& p, int wg,
                                              int warp, int lane) {
    prefetch_swiglu_rows<F>(t, p, wg, warp, lane);
  }
};

// K-grouped (wgrad): each group's [m, n] sum to the output (bf16, fp32, or fp32 added to it), or,
// by the group's pass step (data-dependent), to its fp32 carry slot. The bf16 wgrad
// (F::kTmaStore) stores its output tiles through the staging tile and TMA (d.out).
enum class GradOut { bf16, fp32, fp32_add };
template <GradOut kOut>
struct WeightGrad {
  static constexpr bool kFp32 = kOut != GradOut::bf16, kAccumulate = kOut == GradOut::fp32_add;
  static constexpr bool kRowScale = false, kScatter = false;
  template <class F>
  __device__ __forceinline__ static void store(const float (&acc)[F::kAcc], const TileInfo& t,
                                               const GemmDescriptor& d, int wg, int warp, int lane,
                                               std::uint8_t* staging) {
    static_assert(F::kKGrouped, "the K-grouped forms");
    if constexpr (F::kTmaStore && !kFp32) {
      if (!group_output<WeightGrad>(t, d.p).fp32) {  // bf16 to the output; carry slots are fp32
        store_tile_tma<F>(acc, t, d.p, wg, warp, lane, staging, &d.out);
        return;
      }
    }
    store_plain<F, WeightGrad>(acc, t, d.p, wg, warp, lane);
  }
};

}  // namespace epilogue

}  // namespace mok::gemm
