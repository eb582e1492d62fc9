// The FP8 layer's routed-expert GEMMs on the host (docs/architecture.md, "The FP8 layer"), exactly
// as the GPU layer is specified to compute them. reference.cpp runs them inside the bf16 layer's
// expert_forward / expert_backward (which round, apply SwiGLU and scale by the router weights the
// same way for both layers), and everything else (gathering rows, the shared expert, the
// combine, the home reductions) as in the bf16 layer.
//
// Each product quantizes its bf16 operands with the host quantizers (fp8_quant.hpp: the GPU's
// bits) and sums the block-promoted e4m3 products in f64 (fp8_gemm.hpp, blocks in increasing
// order); the f64 sum becomes an fp32 value where the bf16 layer has its fp32 GEMM result, and the
// bf16 layer's arithmetic follows from there. The operands:
//   gate_up        qx = rows(x) (1x128 along H)      x  W_gate, W_up (normal copies)
//   down           qh = rows(h) (1x128 along I)      x  W_down (normal copy)
//   down_dgrad     rows(d_out) (1x128 along H)       x  W_down (transposed copy)
//   gate_up_dgrad  rows(dg), rows(du) (along I)      x  W_gate, W_up (transposed copies), one
//                                                       accumulator: gate blocks, then up blocks
//   weight_grads   token-axis copies (128-row blocks of the expert's rows in schedule order, the
//                  last block zero-padded, so a block's scales come from its real rows only):
//                  dW_down = dy^T h, dW_gate = dg^T x, dW_up = du^T x; or, with
//                  fp8_weight_grads false, the same three products of the bf16 operands in fp32
// Every C element is computed by one task in a fixed order: bitwise independent of the thread
// count.
#pragma once

#include <cstdint>

#include "core/thread_pool.hpp"
#include "mok/api.hpp"
#include "reference/fp8_gemm.hpp"

namespace mok::reference {

// One local expert's quantized weights in both orientations (views into Fp8Weights).
struct Fp8Expert {
  Fp8BlockMatrix gate, up, down;        // [I, H], [I, H], [H, I]: the forward's
  Fp8BlockMatrix gate_t, up_t, down_t;  // [H, I], [H, I], [I, H]: the dgrads'
};

// Local expert e of `q` (host views, validated).
Fp8Expert fp8_expert(const Fp8Weights& q, std::int64_t e);

// The products of one expert over `rows` rows (reference.cpp's DenseProducts interface; N = I).
// Values in are floats holding bf16 values; results are fp32, unrounded.
struct Fp8Products {
  ThreadPool& pool;
  std::int64_t rows, H, N;
  Fp8Expert w;
  // BackwardOptions::fp8_weight_grads: false, weight_grads are the bf16 layer's products (fp32
  // sums over the rows in order) of the same bf16 operands.
  bool fp8_weight_grads = true;

  void gate_up(const float* xr, float* g, float* u) const;                // [rows, I] each
  void down(const float* h, float* y) const;                              // [rows, H]
  void down_dgrad(const float* d_outr, float* dh) const;                  // [rows, I]
  void gate_up_dgrad(const float* dg, const float* du, float* dx) const;  // [rows, H]
  void weight_grads(const float* dy, const float* h, const float* dg, const float* du,
                    const float* xr, float* d_down, float* d_gate, float* d_up) const;
};

}  // namespace mok::reference
