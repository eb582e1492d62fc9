"""mok's layer ops as torch.library custom ops (namespace ``mok::``): build_schedule,
schedule_table, forward, recompute_forward_context, backward, backward_main_grad, and `forward`'s
autograd formula. mok/ops.py documents them; their fake implementations are in mok/_fake.py.

`call(op, *args)` runs an op the cheapest way nobody could tell from its dispatch (mok.functional
and mok.moe call through it).
"""

import torch

from mok import _checks, _host_ep, _layer_tensors, _native, _workspace
from mok._layer_tensors import (CONTEXT_ARGS, CONTEXT_OUT, LAYER_ARGS, SWIGLU_LIMIT_ARG,
                                 check_context, check_layer_call, context_shapes, context_views)
from mok._native import lib, views

# The layer ops' undecorated bodies, for call(); and the two probes of PyTorch's state it reads
# (private; where a PyTorch lacks one, every call goes through the dispatcher).
_BODIES = {}
_DISPATCH_STACK = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def keep_body(op_def):
    """Decorator under torch.library.custom_op: keeps the undecorated function for call() (the
    layer ops here and the FP8 ones of mok/_fp8_layer.py)."""
    def keep(fn):
        op = op_def(fn)
        _BODIES[op] = fn
        return op
    return keep


def untraced(args):
    """True where running an op's body directly is what its dispatch would do: eager (no
    torch.compile, no dispatch or function mode, no functorch transform), plain CPU or CUDA tensors
    (torch.Tensor or Parameter: no fake, meta or subclass tensors, none with torch's negation or
    conjugation bit, which the dispatcher resolves into a copy first), and nothing for autograd to
    record (grad mode off, or no input that requires grad)."""
    if torch.compiler.is_compiling() or _DISPATCH_STACK is None or _DISPATCH_STACK() > 0 \
            or _FUNCTORCH_ACTIVE is None or _FUNCTORCH_ACTIVE():
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if torch.overrides.has_torch_function(tensors):  # a function mode, or a subclass's override
        return False
    grad = torch.is_grad_enabled()
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type in ("cpu", "cuda")
               and not (grad and t.requires_grad) and not t.is_neg() and not t.is_conj()
               for t in tensors)


def call(op, *args):
    """op(*args) (forward, recompute_forward_context, backward): through PyTorch's dispatcher, or,
    where nothing would see the difference (untraced), straight into the op's body, the same
    function the dispatcher runs. NOTES (2026-12-04, an H200 machine's host; docs/perf/NOTES.md,
    "A layer call's host time"): the dispatch of a Python custom op (autograd and fake-tensor
    registration, the output alias check) costs about 45 us of host time a call, 0.3 of a small
    layer's forward (T 1024: 152 us in all); mok.functional's calls, which MoK's API leaves
    outside autograd, and the backward of `forward`'s autograd save it."""
    if untraced(args):
        return _BODIES[op](*args)
    return op(*args)


@torch.library.custom_op(
    "mok::build_schedule", mutates_args=(),
    schema="(Tensor topk_experts, int num_experts, int num_local_experts, int first_local_expert)"
           " -> Tensor")
def build_schedule(topk_experts, num_experts, num_local_experts, first_local_expert):
    """int32 [num_local_experts]: rows per local expert; validates every id on the CPU."""
    _checks.check_schedule_inputs(topk_experts, num_experts, num_local_experts,
                                  first_local_expert)
    return _layer_tensors.count_rows(topk_experts, num_experts, num_local_experts,
                                     first_local_expert)


_SCHEDULE_OUT = "(Tensor table, Tensor expert_counts, Tensor expert_src_counts, " \
                "Tensor segment_starts, Tensor ring_plan)"


@torch.library.custom_op(
    "mok::schedule_table", mutates_args=(),
    schema="(Tensor[] topk_experts, int num_experts, int ep_rank, int minibatch_size, "
           "int macrobatch_size) -> " + _SCHEDULE_OUT)
def schedule_table(topk_experts, num_experts, ep_rank, minibatch_size, macrobatch_size):
    """The schedule table of rank `ep_rank` from every rank's topk_experts (int64 [T, k] CPU
    tensors, one per rank of the EP group), by the schedule's host twin: the oracle of the device
    build. Returns int32 tensors (include/mok/schedule.hpp has the format): table [capacity],
    expert_counts [E_local], expert_src_counts [E_local, W], segment_starts [E_local + 1],
    ring_plan [8]."""
    outs = _layer_tensors.schedule_outputs(topk_experts, num_experts)
    _checks.check_int("ep_rank", ep_rank, minimum=0, maximum=len(topk_experts) - 1)
    _checks.check_int("minibatch_size", minibatch_size, minimum=1)
    _checks.check_int("macrobatch_size", macrobatch_size, minimum=0)
    if topk_experts[0].device.type != "cpu":
        _checks.fail("topk_experts.device", "cpu (the host twin; on the GPU the layer builds its "
                     "schedule on the device)", _checks.device_name(topk_experts[0].device))
    lib.schedule_table(views(*topk_experts), num_experts, ep_rank, minibatch_size,
                       macrobatch_size, *views(*outs))
    return outs


@keep_body(torch.library.custom_op(
    "mok::forward", mutates_args=(),
    schema=f"(Tensor x, Tensor topk_experts, Tensor topk_weights, {LAYER_ARGS}, int workspace, "
           f"{SWIGLU_LIMIT_ARG}) -> (Tensor, {CONTEXT_OUT})"))
def forward(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
            routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
            workspace, swiglu_limit=None):
    """(out [T, H], *context): the layer's forward; context is the seven tensors backward reads
    (mok.ops' module docstring lists them). Differentiable: its gradient runs `backward`."""
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    ws, config = _workspace.resolve(workspace)
    if ws.ep_size > 1 and x.device.type == "cpu":  # across processes: CPU backend, gloo
        return _host_ep.forward(ws, config, x, topk_experts, topk_weights, weights,
                                swiglu_limit=swiglu_limit)
    return _forward_one_rank(x, topk_experts, topk_weights, weights, workspace, swiglu_limit)


def _forward_one_rank(x, topk_experts, topk_weights, weights, workspace, swiglu_limit):
    """forward's body on one rank (the weights may be row-strided views): (out, *context)."""
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    out = _native.new_output((shape.num_tokens, shape.hidden_size), shape.activation_dtype,
                             shape.device)
    context = _layer_tensors.new_context(ws, config, shape)
    ws.core(shape, config).run(lib.forward, x.device,
                               *views(x, topk_experts, topk_weights, *weights, out),
                               *context_views(context), swiglu_limit=swiglu_limit)
    return (out, *context)


@keep_body(torch.library.custom_op(
    "mok::recompute_forward_context", mutates_args=(),
    schema="(Tensor x, Tensor topk_experts, Tensor routed_gate_weights, "
           "Tensor routed_up_weights, Tensor? shared_gate_weights, Tensor? shared_up_weights, "
           f"int workspace, {SWIGLU_LIMIT_ARG}) -> ({CONTEXT_OUT})"))
def recompute_forward_context(x, topk_experts, routed_gate_weights, routed_up_weights,
                              shared_gate_weights, shared_up_weights, workspace,
                              swiglu_limit=None):
    """The forward context `forward` returns for these inputs, the same bits, without the output
    (activation checkpointing recomputes it before backward)."""
    weights = (routed_gate_weights, routed_up_weights, None, shared_gate_weights,
               shared_up_weights, None)
    ws, config = _workspace.resolve(workspace)
    if ws.ep_size > 1 and x.device.type == "cpu":
        return _host_ep.recompute_forward_context(ws, config, x, topk_experts, weights,
                                                  swiglu_limit=swiglu_limit)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, None, weights,
                                         with_topk_weights=False, with_down=False)
    context = _layer_tensors.new_context(ws, config, shape)
    ws.core(shape, config).run(lib.recompute_forward_context, x.device,
                               *views(x, topk_experts, routed_gate_weights, routed_up_weights,
                                      shared_gate_weights, shared_up_weights),
                               *context_views(context), swiglu_limit=swiglu_limit)
    return context


@keep_body(torch.library.custom_op(
    "mok::backward", mutates_args=(),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {LAYER_ARGS}, "
           f"{CONTEXT_ARGS}, int workspace, {SWIGLU_LIMIT_ARG}) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def backward(d_out, x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
             routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
             x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
             hidden_shared, workspace, swiglu_limit=None):
    """(d_x, d_topk_weights, d_routed_gate, d_routed_up, d_routed_down, d_shared_gate,
    d_shared_up, d_shared_down) from d_out and forward's inputs and context (never recomputed);
    the shared ones empty [0] without a shared expert."""
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    ws, config = _workspace.resolve(workspace)
    if ws.ep_size > 1 and x.device.type == "cpu":
        d_x, d_w, *routed_shared = _host_ep.backward(ws, config, d_out, x, topk_experts,
                                                     topk_weights, weights, context,
                                                     swiglu_limit=swiglu_limit)
        return (d_x, d_w, *[g if g is not None else x.new_empty(0) for g in routed_shared])
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context(context, context_shapes(ws, config, shape), shape)
    d_x, d_w, routed, shared = _layer_tensors.grad_buffers(shape, shape.activation_dtype)
    ws.core(shape, config).run(lib.backward, x.device,
                               *views(x, topk_experts, topk_weights, *weights),
                               *context_views(context), *views(d_out, d_x, d_w, *routed, *shared),
                               swiglu_limit=swiglu_limit)
    shared = [g if g is not None else x.new_empty(0) for g in shared]
    return (d_x, d_w, *routed, *shared)


# The layer on packed gate/up weights: one [E, 2I, H] tensor holding each expert's W_gate and
# W_up, concatenated (rows [0, I) gate, [I, 2I) up) or interleaved (even rows gate, odd rows up):
# the form Hugging Face Transformers stores (`gate_up_proj`). The halves are row-strided views
# that mok reads in place (no copy of the weights per call); the gradient comes back packed the
# same way. One rank, no shared expert.
_PACKED_ARGS = "Tensor gate_up_weights, Tensor down_weights"
_PACKED_FLAGS = f"int workspace, bool interleaved, {SWIGLU_LIMIT_ARG}"


def split_gate_up(gate_up, interleaved):
    """(gate, up) views [E, I, H] of packed [E, 2I, H] weights (checked first)."""
    _checks.check_packed_gate_up(gate_up)
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], gate_up[:, half:]


def check_packed_workspace(workspace):
    ws, _ = _workspace.resolve(workspace)
    if ws.ep_size > 1:
        _checks.fail("workspace", "a workspace of one rank (the packed form runs without expert "
                     "parallelism)", f"a workspace of {ws.ep_size} ranks")


@keep_body(torch.library.custom_op(
    "mok::forward_packed", mutates_args=(),
    schema=f"(Tensor x, Tensor topk_experts, Tensor topk_weights, {_PACKED_ARGS}, "
           f"{_PACKED_FLAGS}) -> (Tensor, {CONTEXT_OUT})"))
def forward_packed(x, topk_experts, topk_weights, gate_up_weights, down_weights, workspace,
                   interleaved, swiglu_limit=None):
    """`forward` on packed gate/up weights [E, 2I, H] (halves concatenated, or interleaved
    rows), read in place; one rank, no shared expert."""
    check_packed_workspace(workspace)
    gate, up = split_gate_up(gate_up_weights, interleaved)
    return _forward_one_rank(x, topk_experts, topk_weights,
                             (gate, up, down_weights, None, None, None), workspace, swiglu_limit)


@keep_body(torch.library.custom_op(
    "mok::backward_packed", mutates_args=(),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {_PACKED_ARGS}, "
           f"{CONTEXT_ARGS}, {_PACKED_FLAGS}) -> (Tensor, Tensor, Tensor, Tensor)"))
def backward_packed(d_out, x, topk_experts, topk_weights, gate_up_weights, down_weights,
                    x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                    hidden_shared, workspace, interleaved, swiglu_limit=None):
    """(d_x, d_topk_weights, d_gate_up [E, 2I, H] packed as gate_up_weights, d_down)."""
    check_packed_workspace(workspace)
    gate, up = split_gate_up(gate_up_weights, interleaved)
    weights = (gate, up, down_weights, None, None, None)
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context(context, context_shapes(ws, config, shape), shape)
    d_x, d_w = _layer_tensors.grad_buffers(shape, None)
    act, device = shape.activation_dtype, shape.device
    d_gate_up = _native.new_output(tuple(gate_up_weights.shape), act, device)
    d_down = _native.new_output(tuple(down_weights.shape), act, device)
    # Both backends store d_gate and d_up straight into the halves of d_gate_up (row-strided
    # views, as the weights are read): no copy of the gradient.
    d_gate, d_up = split_gate_up(d_gate_up, interleaved)
    ws.core(shape, config).run(lib.backward, x.device,
                               *views(x, topk_experts, topk_weights, *weights),
                               *context_views(context),
                               *views(d_out, d_x, d_w, d_gate, d_up, d_down, None, None, None),
                               swiglu_limit=swiglu_limit)
    return d_x, d_w, d_gate_up, d_down


@torch.library.custom_op(
    "mok::backward_main_grad",
    mutates_args=("main_routed_gate", "main_routed_up", "main_routed_down", "main_shared_gate",
                  "main_shared_up", "main_shared_down"),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {LAYER_ARGS}, "
           "Tensor(a!) main_routed_gate, Tensor(b!) main_routed_up, Tensor(c!) main_routed_down, "
           "Tensor(d!)? main_shared_gate, Tensor(e!)? main_shared_up, "
           f"Tensor(f!)? main_shared_down, {CONTEXT_ARGS}, int workspace, {SWIGLU_LIMIT_ARG}) "
           "-> (Tensor, Tensor)")
def backward_main_grad(d_out, x, topk_experts, topk_weights, routed_gate_weights,
                       routed_up_weights, routed_down_weights, shared_gate_weights,
                       shared_up_weights, shared_down_weights, main_routed_gate, main_routed_up,
                       main_routed_down, main_shared_gate, main_shared_up, main_shared_down,
                       x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                       hidden_shared, workspace, swiglu_limit=None):
    """(d_x, d_topk_weights), as `backward`, with the weight gradients added into the fp32
    main_* buffers (Megatron's main grads) instead of returned."""
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    main = (main_routed_gate, main_routed_up, main_routed_down, main_shared_gate, main_shared_up,
            main_shared_down)
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    ws, config = _workspace.resolve(workspace)
    if ws.ep_size > 1 and x.device.type == "cpu":
        d_x, d_w, *_ = _host_ep.backward(ws, config, d_out, x, topk_experts, topk_weights,
                                         weights, context, main=main, swiglu_limit=swiglu_limit)
        return d_x, d_w
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    _checks.check_main_grads(shape, main)
    for name, g in zip(("main_routed_gate", "main_routed_up", "main_routed_down",
                        "main_shared_gate", "main_shared_up", "main_shared_down"), main):
        _checks.check_aligned(name, g)  # the C++ core would name them d_..._weights
    check_context(context, context_shapes(ws, config, shape), shape)
    d_x, d_w = _layer_tensors.grad_buffers(shape, None)
    ws.core(shape, config).run(lib.backward, x.device,
                               *views(x, topk_experts, topk_weights, *weights),
                               *context_views(context), *views(d_out, d_x, d_w, *main),
                               accumulate_weight_grads=True, swiglu_limit=swiglu_limit)
    return d_x, d_w


# Autograd for `forward`: one backward launch gives every gradient, from the context the forward
# returned (saved by autograd).
def _setup_context(ctx, inputs, output):
    *tensors, workspace, swiglu_limit = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.workspace = workspace
    ctx.swiglu_limit = swiglu_limit


def _backward_formula(ctx, d_out, *_d_context):
    x, topk_experts, topk_weights, *rest = ctx.saved_tensors
    weights, context = rest[:6], rest[6:]
    grads = call(backward, d_out.contiguous(), x, topk_experts, topk_weights, *weights, *context,
                 ctx.workspace, ctx.swiglu_limit)
    d_x, d_w, d_gate, d_up, d_down, d_sgate, d_sup, d_sdown = grads
    shared = (d_sgate, d_sup, d_sdown) if weights[3] is not None else (None, None, None)
    return (d_x, None, d_w, d_gate, d_up, d_down, *shared, None, None)


torch.library.register_autograd("mok::forward", _backward_formula, setup_context=_setup_context)


def _setup_packed_context(ctx, inputs, output):
    *tensors, workspace, interleaved, swiglu_limit = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.workspace, ctx.interleaved, ctx.swiglu_limit = workspace, interleaved, swiglu_limit


def _packed_backward_formula(ctx, d_out, *_d_context):
    x, topk_experts, topk_weights, gate_up, down, *context = ctx.saved_tensors
    d_x, d_w, d_gate_up, d_down = call(backward_packed, d_out.contiguous(), x, topk_experts,
                                       topk_weights, gate_up, down, *context, ctx.workspace,
                                       ctx.interleaved, ctx.swiglu_limit)
    return d_x, None, d_w, d_gate_up, d_down, None, None, None


torch.library.register_autograd("mok::forward_packed", _packed_backward_formula,
                                setup_context=_setup_packed_context)
