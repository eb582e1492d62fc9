"""mok's FP8 layer from Python (docs/architecture.md, "The FP8 layer"):
``mok.moe(..., precision="fp8")`` and ``mok.nn.MoE(..., precision="fp8")``.

Every routed-expert GEMM runs on e4m3 operands with power-of-two block scales; the shared expert,
the router weights, the combine and the reductions are the bf16 layer's, and so are the outputs
(bf16) and the gradients, which are those of the bf16 routed weights: the parameters stay bf16.

Weights are quantized (mok's 128x128 blocks, both orientations: include/mok/fp8.hpp) once per
version, not per call. The quantization of a weight tensor is cached by the tensor's identity and
checked against its version counter (PyTorch's ``_version``, which every in-place change bumps, an
optimizer's step included) and its data pointer, so a step's first call quantizes each weight
again and the calls after it reuse that. A weight whose memory another tensor holds as well (a
view, a ``.data`` still alive, FSDP2's all-gather buffer behind its unsharded parameters) is
quantized on every call instead: a write through that tensor moves neither the weight's counter
nor, often, its address (storage_shared). A change the version counter cannot see through a
tensor gone by the next call (``w.data.mul_(...)``) needs an explicit ``requantize``
(``mok.nn.MoE.quantize_weights()``).

The ops (torch.library, namespace ``mok::``): ``forward_fp8`` and ``backward_fp8`` are
``forward`` and ``backward`` (mok/ops.py) with one more argument, ``fp8_weights``: the twelve
tensors (data, scales, data_t, scales_t) of gate, up and down from ``quantize_weights``; and a
last one, ``fp8_weight_grads`` (default True; False for precision "fp8-bf16-wgrad": the backward's
routed weight gradients in bf16), which the forward op passes on to its gradient.
``forward_fp8`` is differentiable in x, topk_weights and the bf16 weights. CPU and CUDA tensors;
on CUDA the C++ workspace is made with the FP8 scratch (``WorkspaceOptions::fp8``), one beside the
bf16 layer's for the same shape (for "fp8-bf16-wgrad" without the token-axis copies, which only
e4m3 weight gradients read: ``WorkspaceOptions::fp8_token_axis``), and the forward path is the
launches (the megakernel has no FP8 form yet: a config with ``forward_path="fused"`` raises
mok's error). Across processes (a workspace of a gloo group, CPU tensors) the ops run
mok/_host_ep.py's exchange with the FP8 expert halves, bitwise one process holding every expert;
on CUDA (a workspace of a group over symmetric memory) the C++ team runs the FP8 layer as it runs
the bf16 one, each rank's FP8 scratch beside its own symmetric region (tested as threads on one
GPU; not yet run across processes on several GPUs).

Inside a CUDA graph capture the weights are quantized on every call, into the cached tensors: a
replay sees no version change (nothing runs on the host), so each replay quantizes the weights as
they are then. After replays that changed the weights (an optimizer step in the graph), an eager
call needs ``requantize`` first, as after any change the version counter cannot see. A graph
compiled by ``torch.compile`` quantizes on every run likewise (the op ``mok::quantize_weights``):
it has no host-side cache to consult.
"""

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mok import _checks, _host_ep, _layer_tensors, _native, _workspace
from mok._layer_ops import call, check_packed_workspace, keep_body, split_gate_up
from mok._layer_tensors import (CONTEXT_ARGS, CONTEXT_OUT, LAYER_ARGS, SWIGLU_LIMIT_ARG,
                                 check_context, check_layer_call, context_shapes, context_views)
from mok._config import PRECISIONS
from mok._native import lib, views

# The quantized routed weights: twelve tensors, not a Tensor[] (autograd's formula must return a
# gradient of the inputs' structure, and a list of None is not that of a list of tensors).
FP8_NAMES = tuple(f"{w}_{part}" for w in ("gate", "up", "down")
                  for part in ("fp8", "scales", "fp8_t", "scales_t"))
_FP8_ARGS = ", ".join(f"Tensor {n}" for n in FP8_NAMES)
# The backward's BackwardOptions::fp8_weight_grads (precision 'fp8-bf16-wgrad': False); the
# forward ops take it too, for their autograd formula to pass on.
_WGRAD_ARG = "bool fp8_weight_grads=True"

_PRECISIONS_TEXT = ", ".join(map(repr, PRECISIONS[:-1])) + f" or {PRECISIONS[-1]!r}"


def check_precision(precision):
    """One of PRECISIONS (mok's error naming `precision` otherwise); returns it."""
    if not isinstance(precision, str):
        _checks.fail("precision", _PRECISIONS_TEXT, f"{type(precision).__name__} {precision!r}",
                     TypeError)
    if precision not in PRECISIONS:
        _checks.fail("precision", _PRECISIONS_TEXT, repr(precision))
    return precision


def is_fp8(precision):
    """Whether a checked precision runs the FP8 layer."""
    return precision != "bf16"


def check_device(name, t):
    """The FP8 layer runs on the CPU and CUDA backends."""
    if t.device.type not in ("cpu", "cuda"):
        _checks.fail(f"{name}.device", "cpu or cuda for precision='fp8'",
                     _checks.device_name(t.device))


def quantize_weights(w):
    """(data, scales, data_t, scales_t) of a bf16 weight w [E, N, K] (N, K multiples of 128):
    float8_e4m3fn [E, N, K], float32 [E, N/128, K/128] and the same transposed ([E, K, N],
    [E, K/128, N/128]), every block quantized once (mok::quantize_weights)."""
    _checks.require_tensor("w", w)
    if w.dim() != 3:
        _checks.fail("w.shape", "[E, N, K]", _checks.shape_text(w.shape))
    w = w.detach()
    if not w.is_contiguous():  # e.g. a row-strided half of packed weights: one copy per version
        w = w.contiguous()
    E, N, K = w.shape
    new, dev = _native.new_output, w.device
    out = (new((E, N, K), torch.float8_e4m3fn, dev), new((E, N // 128, K // 128), torch.float32,
                                                          dev),
           new((E, K, N), torch.float8_e4m3fn, dev), new((E, K // 128, N // 128), torch.float32,
                                                          dev))
    if dev.type == "cuda":
        _native.launch(lib.quantize_weights, dev, *views(w, *out))
    else:
        lib.quantize_weights(*views(w, *out), 0)
    return out


# weight tensor -> (its state when quantized, the quantization); entries die with their tensors.
_CACHE = WeakIdKeyDictionary()


def tensor_state(w):
    """What a cached quantization of `w` is checked against: version counter, data pointer,
    layout (the FP8 weights' cache here, MX weights' conversions in mok/_mx_calls.py)."""
    return (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)


def storage_shared(t):
    """Whether a tensor other than `t` holds t's memory. Then t can change without t's version
    counter moving and at the same address, and a cached quantization of t cannot be trusted:
    FSDP2 (fully_shard) writes its all-gathered weights into its unsharded parameters through
    such a tensor, its all-gather buffer, every step, with the parameter's counter at 0 and, on a
    GPU, often at the same address (NOTES, 2026-12-07). Counted from the storage's references,
    less the one of the storage object asked for them, t's own and, where t is a view, its base's
    (a base shares t's version counter): any other tensor's (another view, a `.data` still alive)
    counts. Without that count (a PyTorch that lacks it), every weight counts as shared:
    quantized on every call, never stale."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return True
    storage = t.untyped_storage()
    return count(storage._cdata) > 2 + (t._base is not None)


@torch.library.custom_op("mok::quantize_weights", mutates_args=())
def quantize_weights_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    """quantize_weights as an op (what a compiled graph runs: it has no host-side cache)."""
    return quantize_weights(w)


@quantize_weights_op.register_fake
def _(w):
    E, N, K = w.shape
    return (w.new_empty((E, N, K), dtype=torch.float8_e4m3fn),
            w.new_empty((E, N // 128, K // 128), dtype=torch.float32),
            w.new_empty((E, K, N), dtype=torch.float8_e4m3fn),
            w.new_empty((E, K // 128, N // 128), dtype=torch.float32))


def _quantize_into(w, q):
    """quantize_weights(w) into the tensors of an earlier quantization of the same layout."""
    w = w.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    _native.launch(lib.quantize_weights, w.device, *views(w, *q))


def _quantizations(owner, tag, sources, shared=None):
    """The cached quantizations of the weights sources(owner) (owner itself, or views of it), kept
    under owner's identity and `tag`, made again when owner changed since (version, data pointer,
    layout); inside a CUDA graph capture and in a compiled graph made again every time (the
    module docstring says why), and so is the quantization of a weight whose memory another
    tensor holds (`shared`: storage_shared(owner), asked before mok made views of it)."""
    if torch.compiler.is_compiling():  # each run of the compiled graph quantizes
        return tuple(quantize_weights_op(w.detach()) for w in sources(owner))
    if storage_shared(owner) if shared is None else shared:
        _CACHE.pop(owner, None)  # its entries could only go stale
        return tuple(quantize_weights(w) for w in sources(owner))
    entries = _CACHE.get(owner)
    if entries is None:
        entries = _CACHE[owner] = {}
    entry = entries.get(tag)
    state = tensor_state(owner)
    if owner.is_cuda and torch.cuda.is_current_stream_capturing():
        if entry is not None and entry[0][2:] == state[2:]:
            for w, q in zip(sources(owner), entry[1]):
                _quantize_into(w, q)  # no allocation: the graph writes the cached tensors
            entries[tag] = (state, entry[1], sources)
            return entry[1]
        # The graph's memory: not cached for eager calls.
        return tuple(quantize_weights(w) for w in sources(owner))
    if entry is not None and entry[0] == state:
        return entry[1]
    qs = tuple(quantize_weights(w) for w in sources(owner))
    entries[tag] = (state, qs, sources)
    return qs


def quantized(w):
    """The cached quantization of `w` (_quantizations)."""
    return _quantizations(w, "whole", lambda t: (t,))[0]


def quantized_halves(gate_up, interleaved, shared=None):
    """The cached quantizations of the gate and up halves of packed weights (split_gate_up), kept
    with the packed tensor: its views are new tensors on every call."""
    return _quantizations(gate_up, ("halves", interleaved),
                          lambda t: split_gate_up(t, interleaved), shared)


def requantize(*weights):
    """Quantizes the given weights now (None entries skipped), whatever the cache holds: after a
    change their version counter cannot see. Packed weights: each of their cached forms."""
    for w in weights:
        if w is None:
            continue
        entries = _CACHE.get(w) or {"whole": (None, None, lambda t: (t,))}
        _CACHE[w] = {tag: (tensor_state(w), tuple(quantize_weights(s) for s in sources(w)),
                           sources)
                     for tag, (_state_then, _q, sources) in entries.items()}


def check_is_first_microbatch(value):
    """is_first_microbatch must be None, True or False (in bf16 too, where it has no effect)."""
    if value is not None and not isinstance(value, bool):
        _checks.fail("is_first_microbatch", "None, True or False", type(value).__name__,
                     TypeError)
    return value


def kept_quantizations(owner, names, sources, is_first_microbatch):
    """TransformerEngine's is_first_microbatch for a module's routed weights (`sources`: gate, up,
    down as this call gets them, autocast's or FSDP2's copies included; `names` name them): None
    returns None (mok's cache decides); True a function that quantizes them and keeps the result
    on `owner`; False one that returns what True kept, whatever the weights hold now (the
    caller's promise that they have not changed), after checking that it was made for weights of
    this shape, dtype and device. What True keeps stays until the next True or release_kept: an
    FP8 copy of the weights in both orientations, as many bytes as the bf16 weights (under FSDP2,
    unsharded: every layer's for the whole step)."""
    if check_is_first_microbatch(is_first_microbatch) is None:
        return None
    if torch.compiler.is_compiling():
        _checks.fail("is_first_microbatch", "None inside torch.compile (a compiled graph "
                     "quantizes the weights on every run)", is_first_microbatch)
    layouts = tuple((tuple(w.shape), w.dtype, w.device) for w in sources)
    if is_first_microbatch:
        def quantize():
            quantizations = tuple(quantize_weights(w) for w in sources)
            owner._mok_fp8_kept = (layouts, quantizations)
            return quantizations
        return quantize
    kept = getattr(owner, "_mok_fp8_kept", None)
    if kept is None:
        _checks.fail("is_first_microbatch", "True at an earlier call (False reuses the "
                     "quantized weights of the last call with True; none are kept)", False)
    for name, then, now in zip(names, kept[0], layouts):
        if then != now:
            _checks.fail("is_first_microbatch", f"True again after {name} changed (its "
                         f"quantization kept for {_layout_text(then)}, the call's "
                         f"{_layout_text(now)})", False)
    return lambda: kept[1]


def release_kept(owner):
    """Frees what kept_quantizations' True kept on `owner` (a later False raises until the next
    True)."""
    owner._mok_fp8_kept = None


def _layout_text(layout):
    shape, dtype, device = layout
    return (f"{_checks.shape_text(shape)} {_checks.dtype_name(dtype)} on "
            f"{_checks.device_name(device)}")


def moe(x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up, shared_down,
        handle, swiglu_limit, quantize_routed=None, packed=None, fp8_weight_grads=True):
    """mok.moe's body for precision='fp8' (its arguments checked there). `quantize_routed`:
    a function returning the quantizations of gate, up and down (default: quantized() of each).
    `packed`: (gate_up, interleaved) when gate and up are its halves (moe_packed).
    `fp8_weight_grads` False: precision='fp8-bf16-wgrad'."""
    check_device("x", x)
    for name, w in (("routed_gate_weights", gate), ("routed_up_weights", up),
                    ("routed_down_weights", down)):
        check_device(name, w)
        if w.dtype != torch.bfloat16:
            _checks.fail(f"{name}.dtype", "bfloat16 for precision='fp8'",
                         _checks.dtype_name(w.dtype), TypeError)
    if torch.compiler.is_compiling():
        # NOTES: resolving the workspace handle takes a lock, which torch.compile cannot trace;
        # the ops' fake implementations make the layer's checks while tracing, and the op checks
        # the device when it runs.
        hidden, intermediate = x.shape[-1], gate.shape[-2]
    else:
        if packed is not None:
            check_packed_workspace(handle)
        # The layer's own checks first (metadata only), so a bad shape is named as the layer
        # names it, not as the weight quantizer would.
        shape, _ws, _config = check_layer_call(handle, x, topk_experts, topk_weights,
                                               (gate, up, down, shared_gate, shared_up,
                                                shared_down))
        hidden, intermediate = shape.hidden_size, shape.intermediate_size
    for name, size in (("hidden_size", hidden), ("intermediate_size", intermediate)):
        if size % 128:
            _checks.fail(name, "a multiple of 128 for precision='fp8'", size)
    if quantize_routed is None:
        fp8_weights = [*quantized(gate), *quantized(up), *quantized(down)]
    else:
        fp8_weights = [t for q in quantize_routed() for t in q]
    if packed is not None:
        gate_up, interleaved = packed
        out, *_context = call(forward_fp8_packed, x, topk_experts, topk_weights, gate_up, down,
                              *fp8_weights, handle, interleaved, swiglu_limit, fp8_weight_grads)
        return out
    out, *_context = call(forward_fp8, x, topk_experts, topk_weights, gate, up, down, shared_gate,
                          shared_up, shared_down, *fp8_weights, handle, swiglu_limit,
                          fp8_weight_grads)
    return out


def moe_packed(x, topk_experts, topk_weights, gate_up, down, interleaved, handle, swiglu_limit,
               fp8_weight_grads=True, quantize_routed=None):
    """mok.moe_packed's body for precision='fp8': the FP8 layer over views of the packed gate/up
    weights (forward_fp8_packed: their gradient comes back packed), the halves' quantizations
    cached with the packed tensor, or from `quantize_routed` (kept_quantizations)."""
    # Asked before the views below hold its memory too (a compiled graph quantizes every run).
    shared = (None if torch.compiler.is_compiling() or quantize_routed is not None
              else storage_shared(gate_up))
    gate, up = split_gate_up(gate_up, interleaved)
    if quantize_routed is None:
        def quantize_routed():
            return (*quantized_halves(gate_up, interleaved, shared), quantized(down))
    return moe(x, topk_experts, topk_weights, gate, up, down, None, None, None, handle,
               swiglu_limit, quantize_routed=quantize_routed, packed=(gate_up, interleaved),
               fp8_weight_grads=fp8_weight_grads)


def _forward(x, topk_experts, topk_weights, weights, fp8_weights, workspace, swiglu_limit,
             fp8_weight_grads):
    """forward_fp8's body over the six weights (routed ones possibly row-strided views). The
    workspace is the one its backward will use: without the token-axis copies when
    `fp8_weight_grads` is False (_workspace.Workspace.core)."""
    ws, config = _workspace.resolve(workspace)
    check_device("x", x)
    if ws.ep_size > 1 and x.device.type == "cpu":  # across processes, CPU
        return _host_ep.forward(ws, config, x, topk_experts, topk_weights, weights,
                                swiglu_limit=swiglu_limit, fp8_weights=fp8_weights,
                                fp8_weight_grads=fp8_weight_grads)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    out = _native.new_output((shape.num_tokens, shape.hidden_size), shape.activation_dtype,
                             shape.device)
    context = _layer_tensors.new_context(ws, config, shape)
    ws.core(shape, config, fp8=True, token_axis=fp8_weight_grads).run(
        lib.forward, x.device, *views(x, topk_experts, topk_weights, *weights, out),
        *context_views(context), swiglu_limit=swiglu_limit,
        fp8_weights=tuple(views(*fp8_weights)))
    return (out, *context)


def _backward(d_out, x, topk_experts, topk_weights, weights, fp8_weights, context, workspace,
              swiglu_limit, fp8_weight_grads, packed_grads=None):
    """backward_fp8's body: (d_x, d_topk_weights, d_gate, d_up, d_down, *shared gradients). The
    packed form (no shared expert) passes `packed_grads(shape)`, called after the checks: the
    routed gradients' views (the halves of a packed gradient) and the tensors returned for them."""
    ws, config = _workspace.resolve(workspace)
    check_device("x", x)
    # Across processes on the CPU backend (the packed form refuses several ranks first).
    if ws.ep_size > 1 and x.device.type == "cpu":
        d_x, d_w, *routed_shared = _host_ep.backward(
            ws, config, d_out, x, topk_experts, topk_weights, weights, context,
            swiglu_limit=swiglu_limit, fp8_weights=fp8_weights, fp8_weight_grads=fp8_weight_grads)
        return (d_x, d_w, *[g if g is not None else x.new_empty(0) for g in routed_shared])
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context(context, context_shapes(ws, config, shape), shape)
    if packed_grads is None:
        d_x, d_w, routed, shared = _layer_tensors.grad_buffers(shape, shape.activation_dtype)
        returned = routed
    else:
        d_x, d_w = _layer_tensors.grad_buffers(shape, None)
        (routed, returned), shared = packed_grads(shape), (None, None, None)
    ws.core(shape, config, fp8=True, token_axis=fp8_weight_grads).run(
        lib.backward, x.device, *views(x, topk_experts, topk_weights, *weights),
        *context_views(context), *views(d_out, d_x, d_w, *routed, *shared),
        swiglu_limit=swiglu_limit, fp8_weights=tuple(views(*fp8_weights)),
        fp8_weight_grads=fp8_weight_grads)
    shared = [g if g is not None else x.new_empty(0) for g in shared]
    return (d_x, d_w, *returned, *shared)


@keep_body(torch.library.custom_op(
    "mok::forward_fp8", mutates_args=(),
    schema=f"(Tensor x, Tensor topk_experts, Tensor topk_weights, {LAYER_ARGS}, "
           f"{_FP8_ARGS}, int workspace, {SWIGLU_LIMIT_ARG}, {_WGRAD_ARG}) -> "
           f"(Tensor, {CONTEXT_OUT})"))
def forward_fp8(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
                routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
                gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t, workspace,
                swiglu_limit=None, fp8_weight_grads=True):
    fp8_weights = (gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                   up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t)
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    return _forward(x, topk_experts, topk_weights, weights, fp8_weights, workspace, swiglu_limit,
                    fp8_weight_grads)


@keep_body(torch.library.custom_op(
    "mok::backward_fp8", mutates_args=(),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {LAYER_ARGS}, "
           f"{_FP8_ARGS}, {CONTEXT_ARGS}, int workspace, {SWIGLU_LIMIT_ARG}, {_WGRAD_ARG}) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def backward_fp8(d_out, x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
                 routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
                 gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                 up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t, x_routed,
                 gate_routed, up_routed, hidden_routed, gate_shared, up_shared, hidden_shared,
                 workspace, swiglu_limit=None, fp8_weight_grads=True):
    fp8_weights = (gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                   up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t)
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    return _backward(d_out, x, topk_experts, topk_weights, weights, fp8_weights, context,
                     workspace, swiglu_limit, fp8_weight_grads)


# The FP8 layer on packed gate/up weights [E, 2I, H] (mok.moe_packed with precision='fp8'; the
# layouts of mok/_layer_ops.py's forward_packed): the halves read in place as row-strided views,
# their quantizations passed in (quantized_halves), and the gradient comes back packed, each half
# written in place by the backward (no copy, no scatter of two half-gradients by autograd). One
# rank, no shared expert.
_PACKED_SCHEMA_ARGS = f"Tensor gate_up_weights, Tensor down_weights, {_FP8_ARGS}"
_PACKED_SCHEMA_FLAGS = f"int workspace, bool interleaved, {SWIGLU_LIMIT_ARG}, {_WGRAD_ARG}"


@keep_body(torch.library.custom_op(
    "mok::forward_fp8_packed", mutates_args=(),
    schema=f"(Tensor x, Tensor topk_experts, Tensor topk_weights, {_PACKED_SCHEMA_ARGS}, "
           f"{_PACKED_SCHEMA_FLAGS}) -> (Tensor, {CONTEXT_OUT})"))
def forward_fp8_packed(x, topk_experts, topk_weights, gate_up_weights, down_weights, gate_fp8,
                       gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                       up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t, workspace,
                       interleaved, swiglu_limit=None, fp8_weight_grads=True):
    check_packed_workspace(workspace)
    fp8_weights = (gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                   up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t)
    gate, up = split_gate_up(gate_up_weights, interleaved)
    return _forward(x, topk_experts, topk_weights, (gate, up, down_weights, None, None, None),
                    fp8_weights, workspace, swiglu_limit, fp8_weight_grads)


@keep_body(torch.library.custom_op(
    "mok::backward_fp8_packed", mutates_args=(),
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, "
           f"{_PACKED_SCHEMA_ARGS}, {CONTEXT_ARGS}, {_PACKED_SCHEMA_FLAGS}) -> "
           "(Tensor, Tensor, Tensor, Tensor)"))
def backward_fp8_packed(d_out, x, topk_experts, topk_weights, gate_up_weights, down_weights,
                        gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales,
                        up_fp8_t, up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t,
                        x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                        hidden_shared, workspace, interleaved, swiglu_limit=None,
                        fp8_weight_grads=True):
    """(d_x, d_topk_weights, d_gate_up [E, 2I, H] packed as gate_up_weights, d_down)."""
    check_packed_workspace(workspace)
    fp8_weights = (gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                   up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t)
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    gate, up = split_gate_up(gate_up_weights, interleaved)

    def packed_grads(shape):  # after the layer's checks: nothing is allocated for a bad call
        new, act, device = _native.new_output, shape.activation_dtype, shape.device
        d_gate_up = new(tuple(gate_up_weights.shape), act, device)
        d_down = new(tuple(down_weights.shape), act, device)
        return (*split_gate_up(d_gate_up, interleaved), d_down), (d_gate_up, d_down)

    d_x, d_w, d_gate_up, d_down, *_shared = _backward(
        d_out, x, topk_experts, topk_weights, (gate, up, down_weights, None, None, None),
        fp8_weights, context, workspace, swiglu_limit, fp8_weight_grads,
        packed_grads=packed_grads)
    return d_x, d_w, d_gate_up, d_down


@torch.library.register_fake("mok::forward_fp8")
def _forward_fp8_fake(x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up,
                      shared_down, gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8,
                      up_scales, up_fp8_t, up_scales_t, down_fp8, down_scales, down_fp8_t,
                      down_scales_t, workspace, swiglu_limit=None, fp8_weight_grads=True):
    _checks.check_swiglu_limit(swiglu_limit)
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    return (x.new_empty((shape.num_tokens, shape.hidden_size)),
            *(x.new_empty(s) for s in context_shapes(ws, config, shape)))


@torch.library.register_fake("mok::backward_fp8")
def _backward_fp8_fake(d_out, x, topk_experts, topk_weights, gate, up, down, shared_gate,
                       shared_up, shared_down, gate_fp8, gate_scales, gate_fp8_t, gate_scales_t,
                       up_fp8, up_scales, up_fp8_t, up_scales_t, down_fp8, down_scales,
                       down_fp8_t, down_scales_t, x_routed, gate_routed, up_routed,
                       hidden_routed, gate_shared, up_shared, hidden_shared, workspace,
                       swiglu_limit=None, fp8_weight_grads=True):
    shared = [w.new_empty(w.shape) if w is not None else x.new_empty(0)
              for w in (shared_gate, shared_up, shared_down)]
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape),
            gate.new_empty(gate.shape), up.new_empty(up.shape), down.new_empty(down.shape),
            *shared)


@torch.library.register_fake("mok::forward_fp8_packed")
def _forward_fp8_packed_fake(x, topk_experts, topk_weights, gate_up, down, gate_fp8, gate_scales,
                             gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t, up_scales_t,
                             down_fp8, down_scales, down_fp8_t, down_scales_t, workspace,
                             interleaved, swiglu_limit=None, fp8_weight_grads=True):
    _checks.check_swiglu_limit(swiglu_limit)
    gate, up = split_gate_up(gate_up, interleaved)
    weights = (gate, up, down, None, None, None)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    return (x.new_empty((shape.num_tokens, shape.hidden_size)),
            *(x.new_empty(s) for s in context_shapes(ws, config, shape)))


@torch.library.register_fake("mok::backward_fp8_packed")
def _backward_fp8_packed_fake(d_out, x, topk_experts, topk_weights, gate_up, down, gate_fp8,
                              gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                              up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t,
                              x_routed, gate_routed, up_routed, hidden_routed, gate_shared,
                              up_shared, hidden_shared, workspace, interleaved,
                              swiglu_limit=None, fp8_weight_grads=True):
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    _checks.check_swiglu_limit(swiglu_limit)
    gate, up = split_gate_up(gate_up, interleaved)
    weights = (gate, up, down, None, None, None)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context(context, context_shapes(ws, config, shape), shape)
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape),
            gate_up.new_empty(gate_up.shape), down.new_empty(down.shape))


def _setup_context(ctx, inputs, output):
    *tensors, workspace, swiglu_limit, fp8_weight_grads = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.workspace, ctx.swiglu_limit = workspace, swiglu_limit
    ctx.fp8_weight_grads = fp8_weight_grads


def _backward_formula(ctx, d_out, *_d_context):
    saved = ctx.saved_tensors
    x, topk_experts, topk_weights = saved[:3]
    weights, fp8_weights, context = saved[3:9], saved[9:21], saved[21:]
    grads = call(backward_fp8, d_out.contiguous(), x, topk_experts, topk_weights, *weights,
                 *fp8_weights, *context, ctx.workspace, ctx.swiglu_limit, ctx.fp8_weight_grads)
    d_x, d_w, d_gate, d_up, d_down, d_sgate, d_sup, d_sdown = grads
    shared = (d_sgate, d_sup, d_sdown) if weights[3] is not None else (None, None, None)
    return (d_x, None, d_w, d_gate, d_up, d_down, *shared, *[None] * len(fp8_weights), None,
            None, None)


torch.library.register_autograd("mok::forward_fp8", _backward_formula,
                                setup_context=_setup_context)


def _setup_packed_context(ctx, inputs, output):
    *tensors, workspace, interleaved, swiglu_limit, fp8_weight_grads = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.workspace, ctx.interleaved, ctx.swiglu_limit = workspace, interleaved, swiglu_limit
    ctx.fp8_weight_grads = fp8_weight_grads


def _packed_backward_formula(ctx, d_out, *_d_context):
    saved = ctx.saved_tensors
    x, topk_experts, topk_weights, gate_up, down = saved[:5]
    fp8_weights, context = saved[5:5 + len(FP8_NAMES)], saved[5 + len(FP8_NAMES):]
    d_x, d_w, d_gate_up, d_down = call(backward_fp8_packed, d_out.contiguous(), x, topk_experts,
                                       topk_weights, gate_up, down, *fp8_weights, *context,
                                       ctx.workspace, ctx.interleaved, ctx.swiglu_limit,
                                       ctx.fp8_weight_grads)
    return (d_x, None, d_w, d_gate_up, d_down, *[None] * len(fp8_weights), None, None, None,
            None)


torch.library.register_autograd("mok::forward_fp8_packed", _packed_backward_formula,
                                setup_context=_setup_packed_context)
