"""mok's kernels as torch.library custom ops (namespace ``mok::``).

Every op checks its arguments (mok/_checks.py: ValueError / TypeError naming the argument and the
expected vs actual dtype, shape, device or strides), has a fake implementation (mok/_fake.py) for
torch.compile and meta tensors, and runs mok's C++ core: CPU tensors on the CPU reference backend,
CUDA tensors on the CUDA backend, on PyTorch's current stream, without waiting for the device
(where that backend cannot run, mok's own error says why; nothing here falls back to anything
else).

Ops and their tensors (row-major contiguous; T tokens, H hidden, I and S intermediate sizes,
E local experts, k slots; bf16 activations with fp32 router weights, or all float64 on the CPU
backend's exact mode):

  build_schedule(topk_experts [T, k] int64, num_experts, num_local_experts, first_local_expert)
      -> rows_per_expert [num_local_experts] int32        validates every id in [-1, num_experts)
  schedule_table(topk_experts [every rank's, int64 [T, k] CPU], num_experts, ep_rank,
                 minibatch_size, macrobatch_size)
      -> (table, expert_counts, expert_src_counts, segment_starts, ring_plan)   the host twin of
                                                  the device's schedule: an oracle for tests
  forward(x [T, H], topk_experts, topk_weights [T, k], routed gate/up [E, I, H], down [E, H, I],
          shared gate/up [S, H], down [H, S] (or None), workspace)
      -> (out [T, H], *context)
  backward(d_out [T, H], <forward's inputs>, *context, workspace)
      -> (d_x, d_topk_weights, d_routed_gate, d_routed_up, d_routed_down,
          d_shared_gate, d_shared_up, d_shared_down)     the shared ones empty [0] when absent
  backward_main_grad(d_out, <forward's inputs>, main_routed_gate, main_routed_up, main_routed_down,
                     main_shared_gate, main_shared_up, main_shared_down, *context, workspace)
      -> (d_x, d_topk_weights)          weight gradients added into fp32 buffers (main grads)
  recompute_forward_context(x, topk_experts, routed gate, up, shared gate, up, workspace)
      -> context

`context` is the forward context, seven tensors the caller owns (MoK's MoKForwardContext fields,
in this order): x_routed [R_x, H], gate_routed, up_routed, hidden_routed [R, I], gate_shared,
up_shared, hidden_shared [T, S] (empty [0] tensors without a shared expert). Their row counts
come from the workspace (CUDA: the rows of one ring pass; CPU: one row per slot, no x rows).
backward reads them and never recomputes them; recompute_forward_context writes the same bits as
forward (activation checkpointing).

MoK's MXFP8 forms (mok/_mx_calls.py), wherever mok's FP8 layer runs:
dispatch_mlp_swiglu_combine_{fwd,bwd}_mxfp8 with MoK's argument lists, on mok's FP8 layer;
mx_weights_to_blocks(data float8_e4m3fn [E, N, K], scales uint8 [E*N/128, K/128, 32, 16])
    -> (blocks [2, E*N*K]: data then data_t; scales; scales_t; inexact_count)
    MoK's MX weight in mok's 128x128 blocks, what those ops and mok.functional convert.

The grouped GEMM forms the layer is built from, on CUDA tensors (mok/_grouped_gemm.py has the
details): grouped_gate_up, grouped_rows_times_weight_t, grouped_rows_times_weight,
grouped_weight_grad; rows in groups given by int32 device tensors (starts [G + 1], rows [G]).

`workspace` is a workspace handle (`ws.handle_for(config)` of a mok.functional.Workspace `ws`, or 0
for the automatic workspace). `forward` is differentiable: its gradient runs `backward`. A workspace
of a torch.distributed group of several ranks runs the layer ops as expert parallelism across
processes (CPU tensors, a gloo group: mok/_host_ep.py; CUDA tensors: the C++ team over symmetric
memory, not yet run on several GPUs); every rank of the group must call them in the same order.
"""

# mok's layer ops (mok/_layer_ops.py), with their fake implementations (mok/_fake.py).
from mok import _fake  # noqa: F401  (registers the fake implementations)
from mok._layer_ops import (  # noqa: F401
    backward, backward_main_grad, build_schedule, forward, recompute_forward_context,
    schedule_table)
# The grouped GEMM forms: see mok/_grouped_gemm.py.
from mok._grouped_gemm import (  # noqa: F401
    grouped_gate_up, grouped_rows_times_weight, grouped_rows_times_weight_t, grouped_weight_grad)
# MoK's ops layer, same names and schemas: mok.ops.schedule, all_gather_top_experts,
# barrier_all, dispatch_mlp_swiglu_combine_{fwd,bwd}_bf16, fwd_epilogue, bwd_epilogue,
# mxfp8_quantize (MoK's, bit for bit: mok/_fp8.py) (see mok/_kittens_compat.py); the MXFP8 layer
# ops on mok's FP8 layer, MoK's MX weights converted to mok's blocks (mok/_mx_calls.py).
from mok._kittens_compat import (  # noqa: F401
    all_gather_top_experts, barrier_all, bwd_epilogue, dispatch_mlp_swiglu_combine_bwd_bf16,
    dispatch_mlp_swiglu_combine_fwd_bf16, fwd_epilogue, mxfp8_quantize, schedule)
from mok._mx_calls import (  # noqa: F401
    dispatch_mlp_swiglu_combine_bwd_mxfp8, dispatch_mlp_swiglu_combine_fwd_mxfp8,
    mx_weights_to_blocks)

__all__ = [
    "all_gather_top_experts", "backward", "backward_main_grad", "barrier_all", "build_schedule",
    "bwd_epilogue", "dispatch_mlp_swiglu_combine_bwd_bf16", "dispatch_mlp_swiglu_combine_bwd_mxfp8",
    "dispatch_mlp_swiglu_combine_fwd_bf16", "dispatch_mlp_swiglu_combine_fwd_mxfp8", "forward",
    "fwd_epilogue", "grouped_gate_up", "grouped_rows_times_weight", "grouped_rows_times_weight_t",
    "grouped_weight_grad", "mx_weights_to_blocks", "mxfp8_quantize", "recompute_forward_context",
    "schedule", "schedule_table"]

# help(mok.ops.X) shows the op's own docstring, not torch's CustomOpDef text (documentation only;
# where a PyTorch keeps the function elsewhere, torch's text stays).
for _name in __all__:
    _op = globals()[_name]
    _op.__doc__ = getattr(getattr(_op, "_init_fn", None), "__doc__", None) or _op.__doc__
del _name, _op
