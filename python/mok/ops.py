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
      -> tokens_per_expert [num_local_experts] int32      validates every id in [-1, num_experts)
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

The grouped GEMM forms the layer is built from, on CUDA tensors (mok/_grouped_gemm.py has the
details): grouped_gate_up, grouped_rows_times_weight_t, grouped_rows_times_weight,
grouped_weight_grad; rows in groups given by int32 device tensors (starts [G + 1], rows [G]).

`workspace` is a workspace handle (mok.functional.Workspace.handle_for(config), or 0 for the
automatic workspace). `forward` is differentiable: its gradient runs `backward`. A workspace of a
torch.distributed group of several ranks runs the layer ops as expert parallelism across
processes (CPU tensors, a gloo group: mok/_host_ep.py); every rank of the group must call them in
the same order.
"""

import torch

from mok import _C, _checks, _workspace

# Tests set this to fill every output mok allocates with NaN (integers with -1) before the kernel
# writes it, so an element the kernel forgets shows up.
poison_outputs = False

_LAYER_ARGS = ("Tensor routed_gate_weights, Tensor routed_up_weights, "
               "Tensor routed_down_weights, Tensor? shared_gate_weights, "
               "Tensor? shared_up_weights, Tensor? shared_down_weights")


def _new(shape, dtype, device):
    if poison_outputs:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _views(*tensors):
    return [_checks.view_of(t) for t in tensors]


_CONTEXT_ARGS = ("Tensor x_routed, Tensor gate_routed, Tensor up_routed, Tensor hidden_routed, "
                 "Tensor? gate_shared, Tensor? up_shared, Tensor? hidden_shared")
_CONTEXT_OUT = "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor"
# Clamped SwiGLU (MoK's swiglu_limit; None: plain SwiGLU): silu(min(g, L)) * clamp(u, -L, L), a
# finite positive float (the C++ core checks it and names a bad value). Last, with a default, so
# calls that leave it out are today's.
_SWIGLU_LIMIT_ARG = "float? swiglu_limit=None"


def _layer(handle, x, topk_experts, topk_weights, weights, *, with_topk_weights=True,
           with_down=True):
    ws, config = _workspace.resolve(handle)
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


def _new_context(ws, config, shape):
    # NOTES: never poisoned: rows a forward does not fill (padding, slots of other ranks) are never
    # read, and filling the context would cost a pass over it per call.
    return tuple(torch.empty(s, dtype=shape.activation_dtype, device=shape.device)
                 for s in context_shapes(ws, config, shape))


def _context_views(context):
    """The seven context tensors as view tuples (None for the absent shared ones)."""
    return [None if (t is None or (i >= 4 and t.dim() == 1 and t.numel() == 0))
            else _checks.view_of(t) for i, t in enumerate(context)]


# The layer ops' undecorated bodies, for call(); and the two probes of PyTorch's state it reads
# (private; where a PyTorch lacks one, every call goes through the dispatcher).
_BODIES = {}
_DISPATCH_STACK = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def _body(op_def):
    """Decorator under torch.library.custom_op: keeps the undecorated function for call()."""
    def keep(fn):
        op = op_def(fn)
        _BODIES[op] = fn
        return op
    return keep


def _untraced(args):
    """True where running an op's body directly is what its dispatch would do: eager (no
    torch.compile, no dispatch or function mode, no functorch transform), plain CPU or CUDA tensors
    (torch.Tensor or Parameter: no fake, meta or subclass tensors), and nothing for autograd to
    record (grad mode off, or no input that requires grad)."""
    if torch.compiler.is_compiling() or _DISPATCH_STACK is None or _DISPATCH_STACK() > 0 \
            or _FUNCTORCH_ACTIVE is None or _FUNCTORCH_ACTIVE():
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if torch.overrides.has_torch_function(tensors):  # a function mode, or a subclass's override
        return False
    grad = torch.is_grad_enabled()
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type in ("cpu", "cuda")
               and not (grad and t.requires_grad) for t in tensors)


def call(op, *args):
    """op(*args) (forward, recompute_forward_context, backward): through PyTorch's dispatcher, or,
    where nothing would see the difference (_untraced), straight into the op's body, the same
    function the dispatcher runs. NOTES (session 19, H200 host): the dispatch of a Python custom
    op (autograd and fake-tensor registration, the output alias check) costs about 45 us of host
    time a call, 0.3 of a small layer's forward (T 1024: 152 us in all); mok.functional's calls,
    which MoK's API leaves outside autograd, and the backward of `forward`'s autograd save it."""
    if _untraced(args):
        return _BODIES[op](*args)
    return op(*args)


def _call(fn, core, device, *args, **kwargs):
    """Runs a C++ entry point; for CUDA on the device's current PyTorch stream (no waiting)."""
    with core.lock:
        if device.type != "cuda":
            return fn(core.native, *args, **kwargs)
        with torch.cuda.device(device):
            core.native.set_stream(torch.cuda.current_stream(device).cuda_stream)
            return fn(core.native, *args, **kwargs)


@torch.library.custom_op(
    "mok::build_schedule", mutates_args=(),
    schema="(Tensor topk_experts, int num_experts, int num_local_experts, int first_local_expert)"
           " -> Tensor")
def build_schedule(topk_experts, num_experts, num_local_experts, first_local_expert):
    device = topk_experts.device
    check_schedule_inputs(topk_experts, num_experts, num_local_experts, first_local_expert)
    # Rows per local expert. NOTES: fixed-size scatter (no data-dependent shapes, no host
    # synchronization); the C++ schedule table (include/mok/schedule.hpp) can replace this seam.
    local = topk_experts.reshape(-1) - first_local_expert
    valid = (topk_experts.reshape(-1) >= 0) & (local >= 0) & (local < num_local_experts)
    slot = torch.where(valid, local, torch.full_like(local, num_local_experts))
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
    out = _new((num_local_experts,), torch.int32, device)
    out.copy_(counts[:num_local_experts])
    return out


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
    outs = _schedule_outputs(topk_experts, num_experts)
    if topk_experts[0].device.type != "cpu":
        _checks.fail("topk_experts.device", "cpu (the host twin; on the GPU the layer builds its "
                     "schedule on the device)", _checks.device_name(topk_experts[0].device))
    _C.schedule_table([_checks.view_of(t) for t in topk_experts], num_experts, ep_rank,
                      minibatch_size, macrobatch_size, *[_checks.view_of(t) for t in outs])
    return outs


def _schedule_outputs(topk_experts, num_experts):
    if not isinstance(topk_experts, (list, tuple)) or not topk_experts:
        _checks.fail("topk_experts", "a list with one tensor per rank", repr(topk_experts))
    first = topk_experts[0]
    for r, t in enumerate(topk_experts):
        _checks.require_tensor(f"topk_experts[{r}]", t)
        _checks.check_tensor(f"topk_experts[{r}]", t, torch.int64, tuple(first.shape), first.device)
    W = len(topk_experts)
    T, k = first.shape
    if num_experts < 1 or num_experts % W != 0:
        _checks.fail("num_experts", f"a positive multiple of the rank count {W}", num_experts)
    E_local = num_experts // W
    rows = _C.schedule_capacity_rows(T, k, num_experts, W)
    shapes = ((rows,), (E_local,), (E_local, W), (E_local + 1,), (8,))
    return tuple(_new(s, torch.int32, first.device) for s in shapes)


def check_schedule_inputs(topk_experts, num_experts, num_local_experts, first_local_expert):
    """The checks of build_schedule that need no device data: shapes, dtype, expert ranges; on
    the CPU every id too. Ids on the GPU are checked by the layer on the device (no host
    synchronization), raised at the latest by the next call."""
    _checks.require_tensor("topk_experts", topk_experts)
    _checks_schedule(topk_experts, num_experts, num_local_experts, first_local_expert)
    if topk_experts.device.type == "cpu":
        _C.check_expert_ids(_checks.view_of(topk_experts), num_experts)
    else:
        _C.require_backend("cuda")  # mok's error where the CUDA backend cannot run


def _checks_schedule(topk_experts, num_experts, num_local_experts, first_local_expert):
    if topk_experts.dim() != 2:
        _checks.fail("topk_experts.shape", "[num_local_tokens, topk]",
                     _checks.shape_text(topk_experts.shape))
    _checks.check_tensor("topk_experts", topk_experts, torch.int64, tuple(topk_experts.shape),
                         topk_experts.device)
    if num_experts < 1:
        _checks.fail("num_experts", "a positive integer", num_experts)
    if num_local_experts < 1 or num_experts % num_local_experts != 0:
        _checks.fail("num_local_experts", f"a positive divisor of num_experts = {num_experts}",
                     num_local_experts)
    if first_local_expert < 0 or first_local_expert + num_local_experts > num_experts:
        _checks.fail("first_local_expert", f"in [0, {num_experts - num_local_experts}]",
                     first_local_expert)
    if topk_experts.shape[1] > num_experts:
        _checks.fail("topk_experts.shape[1]", f"at most num_experts = {num_experts}",
                     topk_experts.shape[1])


@_body(torch.library.custom_op(
    "mok::forward", mutates_args=(),
    schema=f"(Tensor x, Tensor topk_experts, Tensor topk_weights, {_LAYER_ARGS}, int workspace, "
           f"{_SWIGLU_LIMIT_ARG}) -> (Tensor, {_CONTEXT_OUT})"))
def forward(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
            routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
            workspace, swiglu_limit=None):
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    ws, config = _workspace.resolve(workspace)
    if ws.ep_size > 1 and x.device.type == "cpu":  # across processes: CPU backend, gloo
        return _host_ep.forward(ws, config, x, topk_experts, topk_weights, weights,
                                swiglu_limit=swiglu_limit)
    shape, ws, config = _layer(workspace, x, topk_experts, topk_weights, weights)
    out = _new((shape.num_tokens, shape.hidden_size), shape.activation_dtype, shape.device)
    context = _new_context(ws, config, shape)
    _call(_C.forward, ws.core(shape, config), x.device,
          *_views(x, topk_experts, topk_weights, *weights, out), *_context_views(context),
          swiglu_limit=swiglu_limit)
    return (out, *context)


@_body(torch.library.custom_op(
    "mok::recompute_forward_context", mutates_args=(),
    schema="(Tensor x, Tensor topk_experts, Tensor routed_gate_weights, "
           "Tensor routed_up_weights, Tensor? shared_gate_weights, Tensor? shared_up_weights, "
           f"int workspace, {_SWIGLU_LIMIT_ARG}) -> ({_CONTEXT_OUT})"))
def recompute_forward_context(x, topk_experts, routed_gate_weights, routed_up_weights,
                              shared_gate_weights, shared_up_weights, workspace,
                              swiglu_limit=None):
    weights = (routed_gate_weights, routed_up_weights, None, shared_gate_weights,
               shared_up_weights, None)
    ws, config = _workspace.resolve(workspace)
    if ws.ep_size > 1 and x.device.type == "cpu":
        return _host_ep.recompute_forward_context(ws, config, x, topk_experts, weights,
                                                  swiglu_limit=swiglu_limit)
    shape, ws, config = _layer(workspace, x, topk_experts, None, weights,
                               with_topk_weights=False, with_down=False)
    context = _new_context(ws, config, shape)
    _call(_C.recompute_forward_context, ws.core(shape, config), x.device,
          *_views(x, topk_experts, routed_gate_weights, routed_up_weights, shared_gate_weights,
                  shared_up_weights), *_context_views(context), swiglu_limit=swiglu_limit)
    return context


def _grad_buffers(shape, weight_dtype):
    T, H, I, E, k, S = (shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                        shape.num_experts, shape.topk, shape.shared_intermediate_size)
    act, dev = shape.activation_dtype, shape.device
    d_x = _new((T, H), act, dev)
    d_w = _new((T, k), _checks.router_dtype(act), dev)
    if weight_dtype is None:
        return d_x, d_w
    routed = [_new((E, I, H), weight_dtype, dev), _new((E, I, H), weight_dtype, dev),
              _new((E, H, I), weight_dtype, dev)]
    if shape.has_shared_expert:
        shared = [_new((S, H), weight_dtype, dev), _new((S, H), weight_dtype, dev),
                  _new((H, S), weight_dtype, dev)]
    else:
        shared = [None, None, None]
    return d_x, d_w, routed, shared


@_body(torch.library.custom_op(
    "mok::backward", mutates_args=(),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {_LAYER_ARGS}, "
           f"{_CONTEXT_ARGS}, int workspace, {_SWIGLU_LIMIT_ARG}) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def backward(d_out, x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
             routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
             x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
             hidden_shared, workspace, swiglu_limit=None):
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
    shape, ws, config = _layer(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context(context, context_shapes(ws, config, shape), shape)
    d_x, d_w, routed, shared = _grad_buffers(shape, shape.activation_dtype)
    _call(_C.backward, ws.core(shape, config), x.device,
          *_views(x, topk_experts, topk_weights, *weights), *_context_views(context),
          *_views(d_out, d_x, d_w, *routed, *shared), swiglu_limit=swiglu_limit)
    shared = [g if g is not None else x.new_empty(0) for g in shared]
    return (d_x, d_w, *routed, *shared)


@torch.library.custom_op(
    "mok::backward_main_grad",
    mutates_args=("main_routed_gate", "main_routed_up", "main_routed_down", "main_shared_gate",
                  "main_shared_up", "main_shared_down"),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {_LAYER_ARGS}, "
           "Tensor(a!) main_routed_gate, Tensor(b!) main_routed_up, Tensor(c!) main_routed_down, "
           "Tensor(d!)? main_shared_gate, Tensor(e!)? main_shared_up, "
           f"Tensor(f!)? main_shared_down, {_CONTEXT_ARGS}, int workspace, {_SWIGLU_LIMIT_ARG}) "
           "-> (Tensor, Tensor)")
def backward_main_grad(d_out, x, topk_experts, topk_weights, routed_gate_weights,
                       routed_up_weights, routed_down_weights, shared_gate_weights,
                       shared_up_weights, shared_down_weights, main_routed_gate, main_routed_up,
                       main_routed_down, main_shared_gate, main_shared_up, main_shared_down,
                       x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                       hidden_shared, workspace, swiglu_limit=None):
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
    shape, ws, config = _layer(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    _checks.check_main_grads(shape, main)
    for name, g in zip(("main_routed_gate", "main_routed_up", "main_routed_down",
                        "main_shared_gate", "main_shared_up", "main_shared_down"), main):
        _checks.check_aligned(name, g)  # the C++ core would name them d_..._weights
    check_context(context, context_shapes(ws, config, shape), shape)
    d_x, d_w = _grad_buffers(shape, None)
    _call(_C.backward, ws.core(shape, config), x.device,
          *_views(x, topk_experts, topk_weights, *weights), *_context_views(context),
          *_views(d_out, d_x, d_w, *main), accumulate_weight_grads=True,
          swiglu_limit=swiglu_limit)
    return d_x, d_w


_CONTEXT_NAMES = ("x_routed", "gate_routed", "up_routed", "hidden_routed", "gate_shared",
                  "up_shared", "hidden_shared")


def check_context(context, shapes, shape):
    """The seven forward-context tensors against the shapes the workspace gives (metadata only:
    the fake implementations run it too)."""
    for name, t, want in zip(_CONTEXT_NAMES, context, shapes):
        if name.endswith("_shared") and not shape.has_shared_expert:
            if t is not None and t.numel() != 0:
                _checks.fail(f"forward_context.{name}", "None or an empty tensor (the layer has "
                             "no shared expert)", f"a tensor {_checks.shape_text(t.shape)}")
            continue
        _checks.check_tensor(f"forward_context.{name}", t, shape.activation_dtype, want,
                             shape.device)


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

from mok import _fake  # noqa: E402,F401  (registers the fake implementations)
from mok import _host_ep  # noqa: E402  (expert parallelism across processes, CPU backend)
# The grouped GEMM forms (issue 5): mok.ops.grouped_gate_up, grouped_rows_times_weight_t,
# grouped_rows_times_weight, grouped_weight_grad (see mok/_grouped_gemm.py).
from mok._grouped_gemm import (  # noqa: E402,F401
    grouped_gate_up, grouped_rows_times_weight, grouped_rows_times_weight_t, grouped_weight_grad)
# MoK's ops layer, same names and schemas (issue 17): mok.ops.schedule, all_gather_top_experts,
# barrier_all, dispatch_mlp_swiglu_combine_{fwd,bwd}_bf16, fwd_epilogue, bwd_epilogue, and the
# MXFP8 names, which raise (see mok/_mok_ops.py).
from mok._mok_ops import (  # noqa: E402,F401
    all_gather_top_experts, barrier_all, bwd_epilogue, dispatch_mlp_swiglu_combine_bwd_bf16,
    dispatch_mlp_swiglu_combine_bwd_mxfp8, dispatch_mlp_swiglu_combine_fwd_bf16,
    dispatch_mlp_swiglu_combine_fwd_mxfp8, fwd_epilogue, mxfp8_quantize, schedule)
