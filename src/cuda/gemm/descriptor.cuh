// One GEMM's descriptor: its tensor maps and parameters, built by the host (launch.cu) and passed
// to the kernel as one __grid_constant__ parameter, so the engine (engine.cuh) reads every field
// and takes every map's address in parameter space, without a copy. A megakernel holds one per
// GEMM it runs (one ring geometry per pass: every descriptor's form shares it).
//
// Launch-level choices of what the epilogue stores (pre-activations, row scale, scatter, SwiGLU
// backward, fp32 or bf16, accumulate) are not here: they are the kernel's epilogue policy type
// (epilogue.cuh), and the pointers below that a policy does not use are ignored. What stays a
// run-time field is what depends on the data or only moves loads: the group tables, the pass plan
// (whose per-group steps pick a carry slot or the output), the second product of RowsW.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/gemm/scheduler.cuh"

namespace mok::gemm {

// Where a launch that gave up on a wait says which one (never hang, never trap): the caller's, in
// mapped pinned host memory (grouped_gemm.hpp, TimeoutReport, reads it). The first wait to give up
// after the host cleared it fills the fields, then sets `timed_out`.
struct WaitTimeoutReport {
  int timed_out;  // 1 once a wait gave up (written last)
  int barrier_id;
  unsigned parity;
  int block;
  int thread;
  unsigned smem_address;
  unsigned long long timeout_ns;
};

// What only the e4m3 kernels read, their second parameter (NOTES: not in GemmParams, so that the
// forward megakernel's four descriptors stay within the 4 KiB of kernel parameters): the fp32
// scales of the operands (powers of two; docs/architecture.md, "The FP8 layer"),
//   a[kb * a_ld + row]                            A's row `row` (of the row buffer), K block kb
//   b[(g * b_n_blocks + nb) * b_k_blocks + kb]    group g's weight block (nb, kb), B rows
//                                                 [128 nb, 128 nb + 128)
//   b2: gate/up: W_up's, as b; an input gradient with a second product (k_blocks_first): the
//   second weight's, with a2 its rows' (a2_ld = a_ld), for K blocks from k_blocks_first on.
// The K-grouped form (weight gradients over the token-axis copies, both operands 1 x 128 along the
// tokens): a[tb * a_ld + i] for A's row i (of m) and token block tb, b[tb * b_ld + j] for B's
// row j (of n); token blocks of 128 rows of the row buffers (segments are 128-row aligned).
struct Fp8Params {
  const float* a;
  const float* a2;
  long long a_ld;
  const float* b;
  const float* b2;
  int b_n_blocks;
  int b_k_blocks;
  long long b_ld;
  // and the SwiGLU backward's quantized dg and du (epilogue::SwigluBackward's kQuantized;
  // RowsTimesWeightFp8Args::quantized), [0] dg and [1] du: the rows form, 1x128 along n (data
  // [rows, q_rows_ld], scales [n / 128, q_rows_scale_ld]), and the token-axis form (data
  // [n, q_tokens_ld], scales [rows / 128, q_tokens_scale_ld]). Last, so that the fields before
  // them keep their offsets in the kernels that read none of these.
  std::uint8_t* q_rows[2];
  float* q_rows_scales[2];
  long long q_rows_ld, q_rows_scale_ld;
  std::uint8_t* q_tokens[2];
  float* q_tokens_scales[2];
  long long q_tokens_ld, q_tokens_scale_ld;
};

struct GemmParams {
  SchedulerParams sched;
  // Mainloop.
  int b_rows_per_group;  // rows of B's tensor map per group (n for W^T forms, k for W)
  int k_blocks_first;    // RowsW with a second product: its first K block (0: none)
  // Epilogue (the policy reads the fields it needs).
  int m;  // K-grouped: output rows per group
  int n;  // output columns
  void* out;
  long long ld_out;
  long long out_group_stride;  // K-grouped: elements between groups' outputs
  __nv_bfloat16* gate_out;     // gate/up with pre-activations
  __nv_bfloat16* up_out;
  // RowsWT with a row scale: the output scale; RowsW with the SwiGLU epilogue and a row scale: the
  // dh scale.
  const float* row_scale;
  const __nv_bfloat16* swiglu_gate;  // RowsW with the SwiGLU epilogue (SwigluBackwardEpilogue)
  const __nv_bfloat16* swiglu_up;
  __nv_bfloat16* d_gate;
  __nv_bfloat16* d_up;
  float* swiglu_dot;        // ... with dot partials: [rows, ceil(n / 128)]
  const int* scatter_rows;  // M-grouped bf16 with a scatter (RowScatter)
  unsigned scatter_slots;
  void* const* scatter_peers;
  float* carry;  // K-grouped with a pass plan (sched.steps): the fp32 carry slots [slots, m, n]
  // Tile order (K-grouped).
  unsigned* tickets;  // the launch's ticket counter pair, or null (static order)
  int tile_order;     // a TileOrder (automatic or fixed without `tickets`)
  // Waits.
  unsigned long long wait_timeout_ns;  // every engine wait gives up after this long
  WaitTimeoutReport* timeout_report;   // the caller's, in mapped pinned host memory, or null
  unsigned* timeout_lock;  // device word beside it: zero unless a CTA is writing the report
  // The SwiGLU epilogues with a clamp (kClamped): the limit L. Last, so the fields before it keep
  // their offsets (the unclamped kernels read nothing new).
  float swiglu_limit;
  // SwigluBackward<true, true, *, true>: bf16(row_scale h) [rows, n], ld_out (after the limit for
  // the same reason: the other kernels' fields keep their offsets).
  __nv_bfloat16* scaled_hidden;
  // The bf16 wgrad's TMA store (F::kTmaStore): rows of the output's tensor map per group
  // (out_group_stride / ld_out; m when dense). Last, for the same reason.
  int out_map_group_rows;
};

struct GemmDescriptor {
  CUtensorMap a;
  CUtensorMap b;
  CUtensorMap a2;   // RowsW with a second product: its A (else a copy of `a`)
  CUtensorMap b2;   // gate/up: W_up; RowsW with a second product: its W (else a copy of `b`)
  CUtensorMap out;  // the TMA-store epilogue's output (else a copy of `a`, never read)
  GemmParams p;
};
// NOTES: kernel parameters are limited to 4 KiB (without the large-parameter opt-in of CUDA 12.1).
static_assert(sizeof(GemmDescriptor) <= 4096, "the descriptor is one kernel parameter");

}  // namespace mok::gemm
