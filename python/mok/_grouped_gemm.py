"""The grouped GEMM forms as torch.library custom ops (mok.ops.grouped_*).

Rows of a row buffer belong to groups: group g is rows [starts[g], starts[g] + rows[g]) (int32
CUDA tensors, starts [G + 1], rows [G]; segments may be padded, or packed with starts the exclusive
prefix sum of rows). The sizes stay on the device: no op reads them on the host, so the ops run
inside CUDA graphs with sizes that change between replays. bf16 operands, row-major contiguous,
on one CUDA device; launched on PyTorch's current stream.

  grouped_gate_up(x [R, H], w_gate [G, I, H], w_up [G, I, H], starts, rows, with_preactivations)
      -> (hidden [R, I], gate [R, I], up [R, I])    hidden = silu(g) * u; gate / up empty [0]
                                                     unless with_preactivations
  grouped_rows_times_weight_t(a [R, K], w [G, N, K], starts, rows, row_scale [R] fp32 or None)
      -> out [R, N] = row_scale * (a W^T)           (the down projection)
  grouped_rows_times_weight(a [R, K], w [G, K, N], starts, rows) -> out [R, N] = a W   (dgrad)
  grouped_weight_grad(a [R, M], b [R, N], starts, rows, out_fp32)
      -> out [G, M, N] = a[rows of g]^T b[rows of g]  (wgrad; a fixed reduction order: same bits
                                                       every run; empty groups give zeros; CTAs
                                                       may draw tiles from a ticket counter pair
                                                       of this call's own)

Output rows outside every group are not written (they hold whatever the allocation held).
"""

import torch

from mok import _checks, _native


def _require_cuda(name, t):
    _checks.require_tensor(name, t)
    if t.device.type != "cuda":
        _checks.fail(f"{name}.device", "a CUDA device (the grouped GEMMs run on the GPU)",
                     _checks.device_name(t.device))


def _dims(name, t, ndim):
    _checks.require_tensor(name, t)
    if t.dim() != ndim:
        _checks.fail(f"{name}.shape", f"{ndim} dimensions", _checks.shape_text(t.shape))
    return tuple(t.shape)


@torch.library.custom_op("mok::grouped_gate_up", mutates_args=(),
                         schema="(Tensor x, Tensor w_gate, Tensor w_up, Tensor starts, "
                                "Tensor rows, bool with_preactivations) -> "
                                "(Tensor, Tensor, Tensor)")
def grouped_gate_up(x, w_gate, w_up, starts, rows, with_preactivations):
    """(hidden [R, I], gate, up): hidden = silu(x W_gate^T) * (x W_up^T) per group, in one GEMM;
    gate and up [R, I] (the pre-activations) with with_preactivations, else empty [0]."""
    _require_cuda("x", x)
    R, _ = _dims("x", x, 2)
    _, I, _ = _dims("w_gate", w_gate, 3)
    hidden = _native.new_output((R, I), x.dtype, x.device)
    shape = (R, I) if with_preactivations else (0,)
    gate = _native.new_output(shape, x.dtype, x.device)
    up = _native.new_output(shape, x.dtype, x.device)
    pre = (gate, up) if with_preactivations else (None, None)
    _native.launch(_native.lib.grouped_gate_up, x.device,
                   *_native.views(x, w_gate, w_up, starts, rows, hidden, *pre))
    return hidden, gate, up


@grouped_gate_up.register_fake
def _(x, w_gate, w_up, starts, rows, with_preactivations):
    R, _ = _dims("x", x, 2)
    _, I, _ = _dims("w_gate", w_gate, 3)
    shape = (R, I) if with_preactivations else (0,)
    return x.new_empty((R, I)), x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("mok::grouped_rows_times_weight_t", mutates_args=(),
                         schema="(Tensor a, Tensor w, Tensor starts, Tensor rows, "
                                "Tensor? row_scale) -> Tensor")
def grouped_rows_times_weight_t(a, w, starts, rows, row_scale):
    """out [R, N] = row_scale * (a W^T) per group (w [G, N, K]; row_scale [R] fp32 or None):
    the down projection."""
    _require_cuda("a", a)
    R, _ = _dims("a", a, 2)
    _, N, _ = _dims("w", w, 3)
    out = _native.new_output((R, N), a.dtype, a.device)
    _native.launch(_native.lib.grouped_rows_times_weight_t, a.device,
                   *_native.views(a, w, starts, rows, row_scale, out))
    return out


@grouped_rows_times_weight_t.register_fake
def _(a, w, starts, rows, row_scale):
    R, _ = _dims("a", a, 2)
    _, N, _ = _dims("w", w, 3)
    return a.new_empty((R, N))


@torch.library.custom_op("mok::grouped_rows_times_weight", mutates_args=(),
                         schema="(Tensor a, Tensor w, Tensor starts, Tensor rows) -> Tensor")
def grouped_rows_times_weight(a, w, starts, rows):
    """out [R, N] = a W per group (w [G, K, N]): the input gradient."""
    _require_cuda("a", a)
    R, _ = _dims("a", a, 2)
    _, _, N = _dims("w", w, 3)
    out = _native.new_output((R, N), a.dtype, a.device)
    _native.launch(_native.lib.grouped_rows_times_weight, a.device,
                   *_native.views(a, w, starts, rows, out))
    return out


@grouped_rows_times_weight.register_fake
def _(a, w, starts, rows):
    R, _ = _dims("a", a, 2)
    _, _, N = _dims("w", w, 3)
    return a.new_empty((R, N))


@torch.library.custom_op("mok::grouped_weight_grad", mutates_args=(),
                         schema="(Tensor a, Tensor b, Tensor starts, Tensor rows, bool out_fp32)"
                                " -> Tensor")
def grouped_weight_grad(a, b, starts, rows, out_fp32):
    """out [G, M, N] = a[rows of g]^T b[rows of g] (fp32 with out_fp32, else a's dtype): the
    weight gradient, in a fixed reduction order; an empty group's slice is zeros."""
    _require_cuda("a", a)
    _, M = _dims("a", a, 2)
    _, N = _dims("b", b, 2)
    (G,) = _dims("rows", rows, 1)
    out = _native.new_output((G, M, N), torch.float32 if out_fp32 else a.dtype, a.device)
    # The launch's own ticket counter pair (WeightGradArgs::tickets): zeroed on the stream, fixed
    # size, no host sync, so concurrent calls and CUDA graph replays never share one.
    tickets = torch.zeros(2, dtype=torch.int32, device=a.device)
    _native.launch(_native.lib.grouped_weight_grad, a.device,
                   *_native.views(a, b, starts, rows, out, tickets), False)
    return out


@grouped_weight_grad.register_fake
def _(a, b, starts, rows, out_fp32):
    _, M = _dims("a", a, 2)
    _, N = _dims("b", b, 2)
    (G,) = _dims("rows", rows, 1)
    return a.new_empty((G, M, N), dtype=torch.float32 if out_fp32 else a.dtype)
