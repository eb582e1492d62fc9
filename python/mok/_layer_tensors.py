"""The tensors of a layer call beside its inputs: the forward context, the outputs and gradient
buffers mok allocates, the schedule table's outputs, and the checks that tie them to a workspace.

Shared by the real ops (mok/_layer_ops.py), their fake implementations (mok/_fake.py) and the
expert parallelism across processes (mok/_host_ep.py); metadata only where a fake implementation
calls it.
"""

import torch

from mok import _checks, _native, _workspace

# The layer ops' schema pieces (mok/_layer_ops.py for bf16, mok/_fp8_layer.py for FP8): the routed
# and shared weights, the forward context, and the clamped SwiGLU's limit (MoK's swiglu_limit; None:
# plain SwiGLU; a finite positive float, which the C++ core checks and names; last, with a default,
# so calls that leave it out are today's).
LAYER_ARGS = ("Tensor routed_gate_weights, Tensor routed_up_weights, "
              "Tensor routed_down_weights, Tensor? shared_gate_weights, "
              "Tensor? shared_up_weights, Tensor? shared_down_weights")
CONTEXT_ARGS = ("Tensor x_routed, Tensor gate_routed, Tensor up_routed, Tensor hidden_routed, "
                "Tensor? gate_shared, Tensor? up_shared, Tensor? hidden_shared")
CONTEXT_OUT = "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor"
SWIGLU_LIMIT_ARG = "float? swiglu_limit=None"

CONTEXT_NAMES = ("x_routed", "gate_routed", "up_routed", "hidden_routed", "gate_shared",
                 "up_shared", "hidden_shared")


def check_layer_call(handle, x, topk_experts, topk_weights, weights, *, with_topk_weights=True,
                     with_down=True):
    """A layer op's workspace handle and tensors: (LayerShape, workspace, config)."""
    ws, config = _workspace.resolve(handle)
    ws.check_x(x)
    shape = _checks.check_layer(x, topk_experts, topk_weights, *weights,
                                with_topk_weights=with_topk_weights, with_down=with_down,
                                ep_size=ws.ep_size)
    ws.check_shape(shape)
    return shape, ws, config


def context_shapes(ws, config, shape):
    """The seven context tensors' shapes for a layer of `shape` run through `ws` with `config`."""
    x_rows, rows = ws.context_rows(shape, config)
    T, H, I, S = (shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                  shape.shared_intermediate_size)
    shared = (T, S) if S > 0 else (0,)
    return ((x_rows, H), (rows, I), (rows, I), (rows, I), shared, shared, shared)


def new_context(ws, config, shape):
    """The seven context tensors a forward writes. NOTES: never poisoned (torch.empty, not
    _native.new_output): rows a forward does not fill (padding, slots of other ranks) are never
    read, and filling the context would cost a pass over it per call."""
    return tuple(torch.empty(s, dtype=shape.activation_dtype, device=shape.device)
                 for s in context_shapes(ws, config, shape))


def context_views(context):
    """The seven context tensors as view tuples (None for the absent shared ones)."""
    return [None if (t is None or (i >= 4 and t.dim() == 1 and t.numel() == 0))
            else _native.view_of(t) for i, t in enumerate(context)]


def check_context(context, shapes, shape):
    """The seven forward-context tensors against the shapes the workspace gives (metadata only:
    the fake implementations run it too)."""
    for name, t, want in zip(CONTEXT_NAMES, context, shapes):
        if name.endswith("_shared") and not shape.has_shared_expert:
            if t is not None and t.numel() != 0:
                _checks.fail(f"forward_context.{name}", "None or an empty tensor (the layer has "
                             "no shared expert)", f"a tensor {_checks.shape_text(t.shape)}")
            continue
        _checks.check_tensor(f"forward_context.{name}", t, shape.activation_dtype, want,
                             shape.device)


def grad_buffers(shape, weight_dtype):
    """backward's outputs: (d_x, d_topk_weights), and with a `weight_dtype` the routed and shared
    weight gradients ([gate, up, down] each; the shared ones None without a shared expert)."""
    T, H, I, E, k, S = (shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                        shape.num_experts, shape.topk, shape.shared_intermediate_size)
    act, dev = shape.activation_dtype, shape.device
    new = _native.new_output
    d_x = new((T, H), act, dev)
    d_w = new((T, k), _checks.router_dtype(act), dev)
    if weight_dtype is None:
        return d_x, d_w
    routed = [new((E, I, H), weight_dtype, dev), new((E, I, H), weight_dtype, dev),
              new((E, H, I), weight_dtype, dev)]
    if shape.has_shared_expert:
        shared = [new((S, H), weight_dtype, dev), new((S, H), weight_dtype, dev),
                  new((H, S), weight_dtype, dev)]
    else:
        shared = [None, None, None]
    return d_x, d_w, routed, shared


def count_rows(topk_experts, num_experts, num_local_experts, first_local_expert):
    """int32 [num_local_experts]: the rows each local expert gets from `topk_experts` (checked
    by the caller). NOTES: fixed-size scatter (no data-dependent shapes, no host
    synchronization); the C++ schedule table (include/mok/schedule.hpp) can replace this seam."""
    device = topk_experts.device
    local = topk_experts.reshape(-1) - first_local_expert
    valid = (topk_experts.reshape(-1) >= 0) & (local >= 0) & (local < num_local_experts)
    slot = torch.where(valid, local, torch.full_like(local, num_local_experts))
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
    out = _native.new_output((num_local_experts,), torch.int32, device)
    out.copy_(counts[:num_local_experts])
    return out


def schedule_outputs(topk_experts, num_experts):
    """The schedule table op's outputs (int32: table, expert_counts, expert_src_counts,
    segment_starts, ring_plan) for every rank's ids, after checking them."""
    if not isinstance(topk_experts, (list, tuple)) or not topk_experts:
        _checks.fail("topk_experts", "a list with one tensor per rank", repr(topk_experts))
    first = topk_experts[0]
    for r, t in enumerate(topk_experts):
        _checks.require_tensor(f"topk_experts[{r}]", t)
        _checks.check_tensor(f"topk_experts[{r}]", t, torch.int64, tuple(first.shape),
                             first.device)
    W = len(topk_experts)
    T, k = first.shape
    num_experts = _checks.check_int("num_experts", num_experts, minimum=1)
    if num_experts % W != 0:
        _checks.fail("num_experts", f"a positive multiple of the rank count {W}", num_experts)
    E_local = num_experts // W
    # The C++ core bounds the sizes (Problem::validate) before this sizes any output from them.
    rows = _native.lib.schedule_capacity_rows(T, k, num_experts, W)
    shapes = ((rows,), (E_local,), (E_local, W), (E_local + 1,), (8,))
    return tuple(_native.new_output(s, torch.int32, first.device) for s in shapes)
