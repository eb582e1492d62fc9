// The grouped GEMM forms of src/cuda/gemm on TensorViews: the surface mok.ops gives PyTorch. Each
// call checks its views (dtype, shape, contiguity, one CUDA device) and enqueues one launch on
// `stream`; the group sizes stay in device memory (no host synchronization).
#pragma once

#include "mok/api.hpp"

namespace mok::gemm_ops {

// Row groups of the row buffers: group g is rows [starts[g], starts[g] + rows[g]). starts int32
// [G + 1] (non-decreasing; starts[g + 1] - starts[g] >= rows[g], so segments may be padded, e.g. to
// 128 rows as the layer's are, or packed: starts = exclusive prefix sum of rows), rows int32 [G];
// both on the device of the data. Rows outside every group are neither read into a kept value nor
// written.
struct Groups {
  TensorView starts;
  TensorView rows;
};

// hidden = bf16(silu(g) * u), g = bf16(x W_gate[e]^T), u = bf16(x W_up[e]^T) for the rows of e.
// x [R, H], w_gate / w_up [G, I, H], hidden [R, I]; gate / up: [R, I] or both absent.
void gate_up(const TensorView& x, const TensorView& w_gate, const TensorView& w_up,
             const Groups& groups, const TensorView& hidden, const TensorView& gate,
             const TensorView& up, void* stream);

// out = bf16(row_scale[r] * (a[r] W[e]^T)): a [R, K], w [G, N, K], out [R, N]; row_scale fp32 [R]
// or absent.
void rows_times_weight_t(const TensorView& a, const TensorView& w, const Groups& groups,
                         const TensorView& row_scale, const TensorView& out, void* stream);

// out = bf16(a[r] W[e]): a [R, K], w [G, K, N], out [R, N].
void rows_times_weight(const TensorView& a, const TensorView& w, const Groups& groups,
                       const TensorView& out, void* stream);

// out[e] = a[rows of e]^T b[rows of e], reduced in a fixed order: a [R, M], b [R, N], out
// [G, M, N] bf16 or fp32; `accumulate` (fp32 only) adds the sum to out. Empty groups give zeros
// (or leave out unchanged with accumulate). `tickets`: int32 [2] zeros on the same device, the
// launch's own tile counters (absent: the static tile order).
void weight_grad(const TensorView& a, const TensorView& b, const Groups& groups,
                 const TensorView& out, const TensorView& tickets, bool accumulate, void* stream);

}  // namespace mok::gemm_ops
