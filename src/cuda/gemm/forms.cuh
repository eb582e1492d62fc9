// The four GEMM forms the engine runs, as compile-time traits, and the kernel's parameters.
#pragma once

#include <cuda_bf16.h>

#include "cuda/gemm/scheduler.cuh"
#include "cuda/ptx/mbarrier.cuh"

namespace mok::gemm {

enum class FormKind {
  kGateUp,               // M-grouped rows x [W_gate; W_up]^T, SwiGLU epilogue
  kRowsWT,               // M-grouped rows x W^T (down forward, dense), optional row scale
  kRowsW,                // M-grouped rows x W (dgrad): B is N-major in memory
  kWeightGrad,           // K-grouped A^T B over each group's rows (wgrad): A and B M/N-major
  kWeightGradContinued,  // the same, accumulators seeded from the fp32 output
};

template <FormKind kKind>
struct Form {
  static constexpr FormKind kind = kKind;
  static constexpr bool kKGrouped =
      kKind == FormKind::kWeightGrad || kKind == FormKind::kWeightGradContinued;
  // NOTES: a separate instantiation, because accumulators defined by ordinary loads before the
  // first wgmma make ptxas serialize the wgmma pipeline (C7515) for the whole kernel.
  static constexpr bool kSeeded = kKind == FormKind::kWeightGradContinued;
  static constexpr int kTransA = kKGrouped ? 1 : 0;  // 1: A is M-major
  static constexpr int kTransB = kKind == FormKind::kRowsW || kKGrouped ? 1 : 0;
  static constexpr int kOutTileN = kKind == FormKind::kGateUp ? kTileN / 2 : kTileN;
  static constexpr int kBoxRowsA = kTransA ? kTileK : kTileM;
  // M-grouped forms load B in two halves (mainloop.cuh, load_b_half): 128 K-major rows a box.
  static constexpr int kBoxRowsB = kTransB ? kTileK : kTileN / 2;
  static constexpr int kCluster = kKGrouped ? 1 : kClusterM;
  static constexpr bool kTickets = kKGrouped && kWgradTickets;
};

struct KernelParams {
  SchedulerParams sched;
  int m;                 // K-grouped: output rows per group
  int n;                 // output columns
  int b_rows_per_group;  // rows of B's tensor map per group (n for W^T forms, k for W)
  void* out;
  long long ld_out;
  long long out_group_stride;  // K-grouped: elements between groups' outputs
  int out_fp32;
  __nv_bfloat16* gate_out;  // gate/up: optional pre-activations
  __nv_bfloat16* up_out;
  const float* row_scale;                  // RowsWT: optional
  const int* scatter_rows;                 // M-grouped bf16: optional RowScatter
  unsigned scatter_slots;
  void* const* scatter_peers;
  int k_blocks_first;                      // RowsW with a second product: its first K block
  int accumulate;                          // K-grouped fp32: out += the sum
  int ticket_slot;                         // K-grouped with tickets: its counter pair
  int tile_order;                          // K-grouped with tickets: a TileOrder
  ptx::WaitTimeoutReport* timeout_report;  // mapped host memory, or null
};

}  // namespace mok::gemm
