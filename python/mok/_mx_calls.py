"""MoK's MXFP8 calling forms on mok's FP8 layer (docs/architecture.md, "The FP8 layer"):

  - mok.functional.forward with the routed weights as MoK's MX tuples (fp8, sc), and backward with
    gate and up as (fp8, sc, fp8_t, sc_t) and down as (fp8_t, sc_t): MoK's tuples as
    mok.ops.mxfp8_quantize returns them (fp8 float8_e4m3fn [E, N, K], sc uint8
    [E * N / 128, K / 128, 32, 16], the transposed pair of w^T [E, K, N]);
  - MoK's ops dispatch_mlp_swiglu_combine_fwd_mxfp8 / _bwd_mxfp8 (mok.ops, torch.ops.mok), with
    MoK's argument lists, composed of mok's FP8 layer as the bf16 ones are of the bf16 layer
    (mok/_kittens_compat.py);
  - mok::mx_weights_to_blocks, the conversion as an op (a fake implementation, so that a traced
    call converts inside its graph); and two FP8 layer ops mok/_fp8_layer.py lacks:
    mok::recompute_forward_context_fp8 and mok::backward_main_grad_fp8 (the backward adding the
    weight gradients into fp32 main grads: functional.backward's main_grads).

Hopper has no block-scaled MMA, so mok computes in its 128x128 weight blocks: each MX weight is
converted once per version (mok::mx_weights_to_blocks, include/mok/fp8.hpp: a block's scale is its
largest 1x32 scale, every value rebased onto it; exact unless a value falls into e4m3's
subnormals), cached by the MX data tensor's identity and checked against its version counter, data
pointer and layout and against the scales tensor's identity and state (as _fp8_layer.quantized
caches the quantization of bf16 weights). A call with MX tuples runs the FP8 layer
(_fp8_layer.forward_fp8 / backward_fp8) on the converted blocks: bitwise what those ops give for
these blocks.

Which orientation is converted:
  - gate and up: the normal pair (fp8, sc), also in backward, where the transposed pair is checked
    and not read. Backward then reads the very blocks forward read (the conversion forward made,
    from the cache), so its gradients are those of the function forward computed, and a backward
    that recomputes forward GEMMs (the CUDA backend's later ring passes) gets forward's bits. The
    transposed pair would give the same block scales (a 128x128 block's scale is the largest of
    its 1x32 scales, in either orientation: the same block amax) but values that may differ by the
    MX rounding (a value rebased from a smaller 1x32 scale may round differently).
  - down in backward: only (fp8_t, sc_t) is given. It is converted as a weight of the transposed
    shape [E, I, H] and the two orientations are swapped (data <-> data_t, scales <-> scales_t):
    the dgrad reads those blocks, forward read the conversion of (fp8, sc).

Gradients: the FP8 layer returns the gradients of the routed weights as bf16 [E, I, H], [E, I, H],
[E, H, I], with MoK's return structure (MoK's backward returns bf16 gradients for MX weights too):
the gradient of the layer with respect to the weights' dequantized values (the MX weights
converted to mok's blocks), computed in FP8 as the FP8 layer computes the gradients of its bf16
master weights; the caller applies them to its own master weights and quantizes again.

The FP8 ops take bf16 master weights beside the blocks: for their shapes and the gradients'
shapes only (the C++ FP8 layer never reads them: include/mok/api.hpp, Fp8Weights). MoK's MX calls
have no master weights, so that slot gets a bf16 view of the converted blocks' own bytes (data and
data_t are allocated together: 2 * E * N * K bytes, exactly a bf16 [E, N, K]): the shape and dtype
the ops check, at no memory.

recompute_forward_context with gate and up as (fp8, sc) gives forward's context again, bit for bit
(mok::recompute_forward_context_fp8, the FP8 layer's recompute).

With `main_grads` (fp32, MoK's order), backward adds the routed and shared weight gradients into
them in fp32, unrounded (mok::backward_main_grad_fp8: the FP8 layer's backward accumulating, as
mok::backward_main_grad is the bf16 layer's), and returns them in the gradients' places.

Expert parallelism across processes: on the CPU backend (a gloo group) every call above runs
through mok/_host_ep.py with the FP8 layer's expert halves, bitwise one process holding every
expert; on CUDA a group runs the C++ team as for the FP8 layer (tested as ranks on threads of one
GPU; not yet run on several GPUs).
"""

import weakref
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mok import _checks, _fp8_layer, _host_ep, _layer_tensors, _native, _workspace
from mok._kittens_compat import (check_schedule, no_routed_slots, one_rank, ring_knobs, rows_of,
                                 slot_experts)
from mok._layer_ops import call, keep_body
from mok._layer_tensors import (CONTEXT_ARGS, CONTEXT_OUT, LAYER_ARGS, SWIGLU_LIMIT_ARG,
                                check_context, check_layer_call, context_shapes, context_views)

B = 128  # mok's weight block (and MoK's scale-layout tile)
MX_DTYPE, SCALE_DTYPE = torch.float8_e4m3fn, torch.uint8


def scale_shape(E, N, K):
    """MoK's scale layout of an MX weight [E, N, K] (mxfp8_quantize's x_sc)."""
    return (E * N // B, K // B, 32, 16)


def is_mx(*routed):
    """Whether a call passes its routed weights as MX tuples (MoK chooses precision by the weight
    argument: a tuple means MXFP8)."""
    return any(isinstance(w, (tuple, list)) for w in routed)


# ---------------------------------------------------------------------------------------------
# The conversion
# ---------------------------------------------------------------------------------------------

def _check_pair(data_name, data, scales_name, scales, shape, device):
    """An MX weight: data float8_e4m3fn `shape` [E, N, K] and its scales uint8 in MoK's layout,
    contiguous, on `device` (N, K multiples of 128 checked by the caller)."""
    _checks.check_tensor(data_name, data, MX_DTYPE, shape, device)
    _checks.require_tensor(scales_name, scales)
    if scales.dtype != SCALE_DTYPE:
        _checks.fail(f"{scales_name}.dtype", "uint8 (MoK's E8M0 scale bytes)",
                     _checks.dtype_name(scales.dtype), TypeError)
    want = scale_shape(*shape)
    if tuple(scales.shape) != want:
        _checks.fail(f"{scales_name}.shape", f"{_checks.shape_text(want)} (MoK's scale layout "
                     f"[E * N / 128, K / 128, 32, 16] of {data_name})",
                     _checks.shape_text(scales.shape))
    _checks.check_tensor(scales_name, scales, SCALE_DTYPE, want, device)


def _check_conversion_args(data, scales):
    _checks.require_tensor("data", data)
    if data.dim() != 3:
        _checks.fail("data.shape", "[E, N, K]", _checks.shape_text(data.shape))
    E, N, K = data.shape
    for axis, size in ((1, N), (2, K)):
        if size <= 0 or size % B:
            _checks.fail(f"data.shape[{axis}]", "a positive multiple of 128", size)
    _check_pair("data", data, "scales", scales, (E, N, K), data.device)
    return E, N, K


@torch.library.custom_op(
    "mok::mx_weights_to_blocks", mutates_args=(),
    schema="(Tensor data, Tensor scales) -> (Tensor, Tensor, Tensor, Tensor)")
def mx_weights_to_blocks(data, scales):
    """MoK's MX weight (data float8_e4m3fn [E, N, K], scales uint8 [E * N / 128, K / 128, 32,
    16]) in mok's 128x128 blocks (include/mok/fp8.hpp): (blocks float8_e4m3fn [2, E * N * K]:
    data [E, N, K] then data_t [E, K, N]; scales float32 [E, N / 128, K / 128]; scales_t
    [E, K / 128, N / 128]; inexact_count int64 [1], the values the rebasing changed). One
    allocation for both orientations: see the module docstring (the bf16 stand-in)."""
    E, N, K = _check_conversion_args(data, scales)
    new, dev = _native.new_output, data.device
    blocks = new((2, E * N * K), MX_DTYPE, dev)
    out = (blocks[0].view(E, N, K), new((E, N // B, K // B), torch.float32, dev),
           blocks[1].view(E, K, N), new((E, K // B, N // B), torch.float32, dev))
    count = new((1,), torch.int64, dev)
    args = _native.views(data, scales, *out, count)
    if dev.type == "cuda":
        _native.launch(_native.lib.mx_weights_to_blocks, dev, *args)
    else:
        _native.lib.mx_weights_to_blocks(*args, 0)
    return blocks, out[1], out[3], count


@mx_weights_to_blocks.register_fake
def _(data, scales):
    E, N, K = _check_conversion_args(data, scales)
    f32 = torch.float32
    return (data.new_empty((2, E * N * K)), data.new_empty((E, N // B, K // B), dtype=f32),
            data.new_empty((E, K // B, N // B), dtype=f32), data.new_empty((1,), dtype=torch.int64))


class Conversion(NamedTuple):
    """One MX weight in mok's blocks, in the orientation the layer reads it as."""

    blocks: tuple  # (data, scales, data_t, scales_t), _fp8_layer.quantize_weights' form
    stand_in: torch.Tensor  # bf16, the layer's weight shape: the blocks' bytes (not read)
    inexact_count: torch.Tensor  # int64 [1]


def _convert(data, scales, transposed):
    both, scales_n, scales_t, count = torch.ops.mok.mx_weights_to_blocks(data, scales)
    E, N, K = data.shape
    data_n, data_t = both[0].view(E, N, K), both[1].view(E, K, N)
    if transposed:  # a transposed weight [E, N, K] stands for the layer's [E, K, N]
        return Conversion((data_t, scales_t, data_n, scales_n),
                          both.view(torch.bfloat16).view(E, K, N), count)
    return Conversion((data_n, scales_n, data_t, scales_t),
                      both.view(torch.bfloat16).view(E, N, K), count)


# MX data tensor -> (the state of data and scales when converted, a weak reference to the scales
# tensor, the Conversion); entries die with their data tensors (the value refers to neither).
_CACHE = WeakIdKeyDictionary()


def _state(data, scales, transposed):
    return (_fp8_layer.tensor_state(data), _fp8_layer.tensor_state(scales), transposed)


def converted(data, scales, transposed=False):
    """The Conversion of MoK's MX weight (data, scales), made again when either tensor changed
    since (version counter, data pointer, layout) or another scales tensor comes with the data,
    and on every call when another tensor holds the memory of either (_fp8_layer.storage_shared).
    `transposed`: (data, scales) is the transposed pair (fp8_t, sc_t) of the layer's weight.
    While torch.compile traces, the conversion is traced into the graph (a fake tensor has no
    data pointer to cache by): convert outside the compiled region to convert once per step."""
    if torch.compiler.is_compiling():
        return _convert(data, scales, transposed)
    if _fp8_layer.storage_shared(data) or _fp8_layer.storage_shared(scales):
        # Memory another tensor holds too can change unseen (FSDP2's parameters): every call.
        _CACHE.pop(data, None)
        return _convert(data, scales, transposed)
    state = _state(data, scales, transposed)
    entry = _CACHE.get(data)
    if entry is not None and entry[0] == state and entry[1]() is scales:
        return entry[2]
    conversion = _convert(data, scales, transposed)
    _CACHE[data] = (state, weakref.ref(scales), conversion)
    return conversion


# ---------------------------------------------------------------------------------------------
# mok.functional with MX tuples
# ---------------------------------------------------------------------------------------------

_FORMS = {2: "(fp8, sc)", 4: "(fp8, sc, fp8_t, sc_t)"}


def _unpack(name, value, length, form=None):
    """MoK's MX tuple of `length` tensors (form: how it reads, for the message)."""
    form = form or _FORMS[length]
    if not isinstance(value, (tuple, list)):
        _checks.fail(name, f"an MXFP8 tuple {form}, as the other routed weights are (MoK: a "
                     "tuple means MXFP8)", type(value).__name__, TypeError)
    if len(value) != length:
        _checks.fail(f"len({name})", f"{length}: the MXFP8 tuple {form}", len(value))
    return tuple(value)


def _layer_sizes(x, gate_name, gate_data, num_local_experts=None):
    """(E, I, H) of a call with MX weights: H from x, I (and E unless given: the schedule's) from
    the gate data; H and I multiples of 128 (mok's blocks; MoK's scale layout needs them too)."""
    if x.dtype != torch.bfloat16:
        _checks.fail("x.dtype", "bfloat16 with MXFP8 weights", _checks.dtype_name(x.dtype),
                     TypeError)
    _checks.require_tensor(gate_name, gate_data)
    if gate_data.dim() != 3:
        _checks.fail(f"{gate_name}.shape", "[num_local_experts, intermediate_size, hidden_size]",
                     _checks.shape_text(gate_data.shape))
    H, (E, I) = x.shape[1], gate_data.shape[:2]
    if H % B:
        _checks.fail("hidden_size", "a multiple of 128 with MXFP8 weights", H)
    if I <= 0 or I % B:
        _checks.fail(f"{gate_name}.shape[1]", "a positive multiple of 128 (intermediate_size "
                     "with MXFP8 weights)", I)
    return (E if num_local_experts is None else num_local_experts), I, H


def _check_tuple(name, pairs, shapes, device):
    """The pairs of one MX tuple: pair p is elements 2p, 2p + 1 of `name`, of shape shapes[p]."""
    for p, ((data, scales), shape) in enumerate(zip(pairs, shapes)):
        _check_pair(f"{name}[{2 * p}]", data, f"{name}[{2 * p + 1}]", scales, shape, device)


def origin_inputs(x, schedule, router_weights, gate, up, shared):
    """What a context made with MX weights records (functional's ContextOrigin.inputs): gate's and
    up's normal pairs, which forward, recompute_forward_context and backward all take (None
    entries, e.g. recompute's router_weights, are left out). Down is not recorded: forward takes
    (fp8, sc), backward (fp8_t, sc_t), and nothing ties the two tensors together."""
    named = {"x": x, "schedule.topk_experts": schedule.topk_experts,
             "router_weights": router_weights, "routed_gate_weights[0]": gate[0],
             "routed_gate_weights[1]": gate[1], "routed_up_weights[0]": up[0],
             "routed_up_weights[1]": up[1]}
    named = {n: t for n, t in named.items() if t is not None}
    return {**named, **dict(zip(("shared_gate_weights", "shared_up_weights",
                                 "shared_down_weights"), shared))}


def forward(schedule, handle, x, router_weights, shared, routed, limit):
    """mok.functional.forward's body for MX tuples (its config, workspace, schedule, x and limit
    checked there): (out, the seven context tensors, origin_inputs). The context is the FP8
    layer's (bf16 g, u, h, as the bf16 layer's), not MoK's FP8 copies: pass it to backward."""
    gate, up, down = (_unpack(n, w, 2) for n, w in zip(
        ("routed_gate_weights", "routed_up_weights", "routed_down_weights"), routed))
    E, I, H = _layer_sizes(x, "routed_gate_weights[0]", gate[0], schedule.num_local_experts)
    _check_tuple("routed_gate_weights", [gate], [(E, I, H)], x.device)
    _check_tuple("routed_up_weights", [up], [(E, I, H)], x.device)
    _check_tuple("routed_down_weights", [down], [(E, H, I)], x.device)
    q = [converted(*gate), converted(*up), converted(*down)]
    out, *context = call(_fp8_layer.forward_fp8, x, schedule.topk_experts, router_weights,
                         *(c.stand_in for c in q), *shared,
                         *(t for c in q for t in c.blocks), handle, limit)
    return out, context, origin_inputs(x, schedule, router_weights, gate, up, shared)


def recompute_forward_context(schedule, handle, x, shared, routed, limit):
    """mok.functional.recompute_forward_context's body for MX tuples (gate and up (fp8, sc)):
    (forward's context again, bit for bit, from the same conversions; origin_inputs)."""
    gate, up = (_unpack(n, w, 2) for n, w in zip(("routed_gate_weights", "routed_up_weights"),
                                                  routed))
    E, I, H = _layer_sizes(x, "routed_gate_weights[0]", gate[0], schedule.num_local_experts)
    _check_tuple("routed_gate_weights", [gate], [(E, I, H)], x.device)
    _check_tuple("routed_up_weights", [up], [(E, I, H)], x.device)
    q = [converted(*gate), converted(*up)]
    context = call(recompute_forward_context_fp8, x, schedule.topk_experts,
                   *(c.stand_in for c in q), *shared, *(t for c in q for t in c.blocks), handle,
                   limit)
    return context, origin_inputs(x, schedule, None, gate, up, shared)


_GATE_UP_FP8_NAMES = _fp8_layer.FP8_NAMES[:8]


@keep_body(torch.library.custom_op(
    "mok::recompute_forward_context_fp8", mutates_args=(),
    schema="(Tensor x, Tensor topk_experts, Tensor routed_gate_weights, "
           "Tensor routed_up_weights, Tensor? shared_gate_weights, Tensor? shared_up_weights, "
           + ", ".join(f"Tensor {n}" for n in _GATE_UP_FP8_NAMES) + ", "
           f"int workspace, {SWIGLU_LIMIT_ARG}) -> ({CONTEXT_OUT})"))
def recompute_forward_context_fp8(x, topk_experts, routed_gate_weights, routed_up_weights,
                                  shared_gate_weights, shared_up_weights, gate_fp8, gate_scales,
                                  gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                                  up_scales_t, workspace, swiglu_limit=None):
    """The FP8 layer's forward context again (mok::recompute_forward_context with the gate's
    and up's blocks; the down weights are not read)."""
    ws, config = _workspace.resolve(workspace)
    _fp8_layer.check_device("x", x)
    weights = (routed_gate_weights, routed_up_weights, None, shared_gate_weights,
               shared_up_weights, None)
    blocks = (gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
              up_scales_t, None, None, None, None)  # down absent: all four views
    if ws.ep_size > 1 and x.device.type == "cpu":  # across processes, CPU
        return _host_ep.recompute_forward_context(ws, config, x, topk_experts, weights,
                                                  swiglu_limit=swiglu_limit, fp8_weights=blocks)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, None, weights,
                                         with_topk_weights=False, with_down=False)
    context = _layer_tensors.new_context(ws, config, shape)
    ws.core(shape, config, fp8=True).run(
        _native.lib.recompute_forward_context, x.device,
        *_native.views(x, topk_experts, routed_gate_weights, routed_up_weights,
                       shared_gate_weights, shared_up_weights),
        *context_views(context), swiglu_limit=swiglu_limit,
        fp8_weights=tuple(_native.views(*blocks)))
    return context


@recompute_forward_context_fp8.register_fake
def _(x, topk_experts, gate, up, shared_gate, shared_up, *rest, swiglu_limit=None):
    # rest: the gate's and up's eight FP8 tensors, the workspace (and swiglu_limit, by position)
    workspace, *limit = rest[8:]
    _checks.check_swiglu_limit(limit[0] if limit else swiglu_limit)
    weights = (gate, up, None, shared_gate, shared_up, None)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, None, weights,
                                         with_topk_weights=False, with_down=False)
    return tuple(x.new_empty(s) for s in context_shapes(ws, config, shape))


def backward_tuples(schedule, x, routed):
    """mok.functional.backward's MX tuples, checked: gate and up (fp8, sc, fp8_t, sc_t), down
    (fp8_t, sc_t)."""
    gate = _unpack("routed_gate_weights", routed[0], 4)
    up = _unpack("routed_up_weights", routed[1], 4)
    down = _unpack("routed_down_weights", routed[2], 2, "(fp8_t, sc_t) of the down weights")
    E, I, H = _layer_sizes(x, "routed_gate_weights[0]", gate[0], schedule.num_local_experts)
    for name, w in (("routed_gate_weights", gate), ("routed_up_weights", up)):
        _check_tuple(name, [w[:2], w[2:]], [(E, I, H), (E, H, I)], x.device)
    _check_tuple("routed_down_weights", [down], [(E, I, H)], x.device)
    return gate, up, down


def backward(schedule, handle, context, grad_output, x, router_weights, shared, tuples, limit,
             main_grads):
    """mok.functional.backward's body for MX tuples (backward_tuples; the context's origin and
    main_grads checked by functional): MoK's 8 gradients, the routed weights' bf16 (module
    docstring); with main_grads (MoK's order: shared gate, routed gate, shared up, routed up,
    shared down, routed down), those tensors in the weight gradients' places."""
    gate, up, down = tuples
    # Gate and up: their normal pairs, the blocks forward read (module docstring); down: its
    # transposed pair, converted and swapped.
    q = [converted(*gate[:2]), converted(*up[:2]), converted(*down, transposed=True)]
    layer = (grad_output, x, schedule.topk_experts, router_weights, *(c.stand_in for c in q),
             *shared, *(t for c in q for t in c.blocks))
    if main_grads is not None:
        msg, mrg, msu, mru, msd, mrd = main_grads
        d_x, d_w = backward_main_grad_fp8(*layer, mrg, mru, mrd, msg, msu, msd, *context, handle,
                                          limit)
        return d_x, d_w, mrg, mru, mrd, msg, msu, msd
    d_x, d_w, dg, du, dd, dsg, dsu, dsd = call(_fp8_layer.backward_fp8, *layer, *context, handle,
                                               limit)
    if shared[0] is None:
        dsg = dsu = dsd = None
    return d_x, d_w, dg, du, dd, dsg, dsu, dsd


_MAIN_NAMES = ("main_routed_gate", "main_routed_up", "main_routed_down", "main_shared_gate",
               "main_shared_up", "main_shared_down")


@torch.library.custom_op(
    "mok::backward_main_grad_fp8", mutates_args=_MAIN_NAMES,
    schema=f"(Tensor d_out, Tensor x, Tensor topk_experts, Tensor topk_weights, {LAYER_ARGS}, "
           + ", ".join(f"Tensor {n}" for n in _fp8_layer.FP8_NAMES) + ", "
           "Tensor(a!) main_routed_gate, Tensor(b!) main_routed_up, Tensor(c!) main_routed_down, "
           "Tensor(d!)? main_shared_gate, Tensor(e!)? main_shared_up, "
           f"Tensor(f!)? main_shared_down, {CONTEXT_ARGS}, int workspace, {SWIGLU_LIMIT_ARG}) "
           "-> (Tensor, Tensor)")
def backward_main_grad_fp8(d_out, x, topk_experts, topk_weights, routed_gate_weights,
                           routed_up_weights, routed_down_weights, shared_gate_weights,
                           shared_up_weights, shared_down_weights, gate_fp8, gate_scales,
                           gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t, up_scales_t,
                           down_fp8, down_scales, down_fp8_t, down_scales_t, main_routed_gate,
                           main_routed_up, main_routed_down, main_shared_gate, main_shared_up,
                           main_shared_down, x_routed, gate_routed, up_routed, hidden_routed,
                           gate_shared, up_shared, hidden_shared, workspace, swiglu_limit=None):
    """_fp8_layer.backward_fp8 with the weight gradients added into fp32 main grads (in place)
    instead of returned: (d_x, d_topk_weights)."""
    fp8_weights = (gate_fp8, gate_scales, gate_fp8_t, gate_scales_t, up_fp8, up_scales, up_fp8_t,
                   up_scales_t, down_fp8, down_scales, down_fp8_t, down_scales_t)
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    main = (main_routed_gate, main_routed_up, main_routed_down, main_shared_gate, main_shared_up,
            main_shared_down)
    context = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
               hidden_shared)
    ws, config = _workspace.resolve(workspace)
    _fp8_layer.check_device("x", x)
    if ws.ep_size > 1 and x.device.type == "cpu":  # across processes, CPU
        d_x, d_w, *_ = _host_ep.backward(ws, config, d_out, x, topk_experts, topk_weights,
                                         weights, context, main=main, swiglu_limit=swiglu_limit,
                                         fp8_weights=fp8_weights)
        return d_x, d_w
    shape, ws, config = _main_grad_call(d_out, x, topk_experts, topk_weights, weights, main,
                                        context, workspace)
    for name, g in zip(_MAIN_NAMES, main):
        _checks.check_aligned(name, g)
    d_x, d_w = _layer_tensors.grad_buffers(shape, None)
    ws.core(shape, config, fp8=True).run(
        _native.lib.backward, x.device, *_native.views(x, topk_experts, topk_weights, *weights),
        *context_views(context), *_native.views(d_out, d_x, d_w, *main),
        accumulate_weight_grads=True, swiglu_limit=swiglu_limit,
        fp8_weights=tuple(_native.views(*fp8_weights)))
    return d_x, d_w


def _main_grad_call(d_out, x, topk_experts, topk_weights, weights, main, context, workspace):
    """backward_main_grad_fp8's checks (metadata only: the fake implementation runs them too)."""
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    _checks.check_main_grads(shape, main)
    check_context(context, context_shapes(ws, config, shape), shape)
    return shape, ws, config


@backward_main_grad_fp8.register_fake
def _(d_out, x, topk_experts, topk_weights, *rest, swiglu_limit=None):
    # rest: the six weights, the twelve FP8 tensors, the six main grads, the context, the
    # workspace (and swiglu_limit, when passed by position).
    weights, main, context, (workspace, *limit) = rest[:6], rest[18:24], rest[24:31], rest[31:]
    _checks.check_swiglu_limit(limit[0] if limit else swiglu_limit)
    _main_grad_call(d_out, x, topk_experts, topk_weights, weights, main, context, workspace)
    return x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape)


# ---------------------------------------------------------------------------------------------
# MoK's MXFP8 ops
# ---------------------------------------------------------------------------------------------

def _op_sizes(x, w_shared_gate, w_routed_gate):
    """(E, I, H) of an MXFP8 op call, read off x and the gate's data (checked enough for that)."""
    rows_of("x", x)
    _checks.require_tensor("w_shared_gate", w_shared_gate)
    return _layer_sizes(x, "w_routed_gate", w_routed_gate)


def _not_produced(dtype, shape, like):
    """An empty [0, ...] tensor in a place where MoK returns an FP8 tensor or scales mok does not
    produce (the FP8 layer keeps bf16 context and fuses the intermediate gradients away)."""
    return like.new_empty((0, *shape), dtype=dtype)


def _fp8_layer_alone(x, routed_stand_ins, shared, fp8_blocks, limit):
    """The FP8 layer with no routed slot: the shared expert alone (forward's outputs)."""
    ids, w = no_routed_slots(x)
    return call(_fp8_layer.forward_fp8, x, ids, w, *routed_stand_ins, *shared, *fp8_blocks, 0,
                limit)


def _converted_for_op(pairs, fake):
    """Conversions of (data, scales, transposed) triples: cached for real tensors; a fake call
    (tracing) converts through the op's fake implementation, which allocates nothing real."""
    return [_convert(*p) if fake else converted(*p) for p in pairs]


def _fwd(x, x_ptrs, combine_buffer, combine_buffer_ptrs, w_shared_gate, w_routed_gate,
         w_routed_gate_sc, w_shared_up, w_routed_up, w_routed_up_sc, w_shared_down,
         w_routed_down, w_routed_down_sc, schedule_peer_rank, schedule_peer_token_idx,
         num_tokens, tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size,
         minibatch_size, *, fake):
    one_rank("x_ptrs", x_ptrs)
    one_rank("combine_buffer_ptrs", combine_buffer_ptrs)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    ring_knobs(num_comm_sms, macrobatch_size, minibatch_size)
    topk = _checks.check_int("topk", topk, minimum=1)
    E, I, H = _op_sizes(x, w_shared_gate, w_routed_gate)
    T, dev = x.shape[0], x.device
    _checks.check_tensor("combine_buffer", combine_buffer, x.dtype, (T * topk, H), dev)
    for (d, dn), (s, sn), shape in (((w_routed_gate, "w_routed_gate"),
                                     (w_routed_gate_sc, "w_routed_gate_sc"), (E, I, H)),
                                    ((w_routed_up, "w_routed_up"),
                                     (w_routed_up_sc, "w_routed_up_sc"), (E, I, H)),
                                    ((w_routed_down, "w_routed_down"),
                                     (w_routed_down_sc, "w_routed_down_sc"), (E, H, I))):
        _check_pair(dn, d, sn, s, shape, dev)
    check_schedule(schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert,
                   E, dev, T * topk, fake)
    ids, slot, used = slot_experts(schedule_peer_rank, schedule_peer_token_idx, num_tokens,
                                   tokens_per_expert, T * topk)
    q = _converted_for_op([(w_routed_gate, w_routed_gate_sc, False),
                           (w_routed_up, w_routed_up_sc, False),
                           (w_routed_down, w_routed_down_sc, False)], fake)
    stand_ins, blocks = [c.stand_in for c in q], [t for c in q for t in c.blocks]
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    # Every slot t * k + j as a token of its own, router weight 1 (the bf16 op's composition).
    x_slots = x.repeat_interleave(topk, dim=0)
    ones = torch.ones((T * topk, 1), dtype=torch.float32, device=dev)
    y_slots, x_routed, gate_routed, up_routed, hidden_routed, *_ = call(
        _fp8_layer.forward_fp8, x_slots, ids, ones, *stand_ins, None, None, None, *blocks, 0,
        limit)
    (y_shared, _, _, _, _, gate_shared, up_shared, hidden_shared) = _fp8_layer_alone(
        x, stand_ins, shared, blocks, limit)
    combine_buffer.copy_(y_slots)
    y_routed = torch.where(used.unsqueeze(1), y_slots[slot.clamp(max=T * topk - 1)],
                           torch.zeros((), dtype=y_slots.dtype, device=dev))
    sc = SCALE_DTYPE
    return (x_routed, _not_produced(sc, (H // B, 32, 16), x), gate_shared, gate_routed,
            _not_produced(sc, (I // B, 32, 16), x), up_shared, up_routed,
            _not_produced(sc, (I // B, 32, 16), x), hidden_shared, hidden_routed,
            _not_produced(sc, (I // B, 32, 16), x), y_shared, y_routed)


@torch.library.custom_op("mok::dispatch_mlp_swiglu_combine_fwd_mxfp8",
                         mutates_args=("combine_buffer",))
def dispatch_mlp_swiglu_combine_fwd_mxfp8(
        x: torch.Tensor, x_ptrs: list[int], combine_buffer: torch.Tensor,
        combine_buffer_ptrs: list[int], w_shared_gate: torch.Tensor, w_routed_gate: torch.Tensor,
        w_routed_gate_sc: torch.Tensor, w_shared_up: torch.Tensor, w_routed_up: torch.Tensor,
        w_routed_up_sc: torch.Tensor, w_shared_down: torch.Tensor, w_routed_down: torch.Tensor,
        w_routed_down_sc: torch.Tensor, schedule_peer_rank: torch.Tensor,
        schedule_peer_token_idx: torch.Tensor, num_tokens: torch.Tensor,
        tokens_per_expert: torch.Tensor, topk: int, swiglu_limit: float | None,
        num_comm_sms: int, macrobatch_size: int, minibatch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """MoK's fused MXFP8 forward: (x_fp8_t_routed, x_sc_t_routed, gate_shared, gate_fp8_routed,
    gate_sc_routed, up_shared, up_fp8_routed, up_sc_routed, hidden_shared, hidden_fp8_t_routed,
    hidden_sc_t_routed, y_shared, y_routed); combine_buffer[t * k + j] gets slot (t, j)'s expert
    output. Composed as the bf16 op is (mok/_kittens_compat.py), of mok's FP8 layer on the
    converted weights. The context places hold mok's FP8 layer's context, bf16 as the bf16
    layer's (x_fp8_t_routed: x_routed, gate_fp8_routed: gate_routed, up_fp8_routed: up_routed,
    hidden_fp8_t_routed: hidden_routed, mok's layout) and the scale places empty uint8
    [0, ..., 32, 16] tensors: pass them to the backward op unchanged."""
    return _fwd(x, x_ptrs, combine_buffer, combine_buffer_ptrs, w_shared_gate, w_routed_gate,
                w_routed_gate_sc, w_shared_up, w_routed_up, w_routed_up_sc, w_shared_down,
                w_routed_down, w_routed_down_sc, schedule_peer_rank, schedule_peer_token_idx,
                num_tokens, tokens_per_expert, topk, swiglu_limit, num_comm_sms,
                macrobatch_size, minibatch_size, fake=False)


@dispatch_mlp_swiglu_combine_fwd_mxfp8.register_fake
def _fwd_fake(*args):
    return _fwd(*args, fake=True)


def _bwd(d_y_buffer, d_y_buffer_ptrs, d_x_routed_buffer, d_x_routed_buffer_ptrs,
         router_weight_buffer, router_weight_buffer_ptrs, d_router_weight_buffer,
         d_router_weight_buffer_ptrs, w_shared_gate, w_routed_gate_T, w_routed_gate_T_sc,
         w_shared_up, w_routed_up_T, w_routed_up_T_sc, w_shared_down, w_routed_down_T,
         w_routed_down_T_sc, x_fp8_t_routed, x_sc_t_routed, gate_shared, gate_fp8_routed,
         gate_sc_routed, up_shared, up_fp8_routed, up_sc_routed, hidden_shared,
         hidden_fp8_t_routed, hidden_sc_t_routed, x, x_ptrs, w_routed_gate, w_routed_gate_sc,
         w_routed_up, w_routed_up_sc, schedule_peer_rank, schedule_peer_token_idx, num_tokens,
         tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size,
         *, fake):
    for name, ptrs in (("d_y_buffer_ptrs", d_y_buffer_ptrs),
                       ("d_x_routed_buffer_ptrs", d_x_routed_buffer_ptrs),
                       ("router_weight_buffer_ptrs", router_weight_buffer_ptrs),
                       ("d_router_weight_buffer_ptrs", d_router_weight_buffer_ptrs),
                       ("x_ptrs", x_ptrs)):
        one_rank(name, ptrs)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    ring_knobs(num_comm_sms, macrobatch_size, minibatch_size)
    topk = _checks.check_int("topk", topk, minimum=1)
    E, I, H = _op_sizes(x, w_shared_gate, w_routed_gate)
    T, dev = x.shape[0], x.device
    slots = T * topk
    _checks.check_tensor("d_y_buffer", d_y_buffer, x.dtype, (T, H), dev)
    _checks.check_tensor("d_x_routed_buffer", d_x_routed_buffer, x.dtype, (slots, H), dev)
    for name, t in (("router_weight_buffer", router_weight_buffer),
                    ("d_router_weight_buffer", d_router_weight_buffer)):
        _checks.check_tensor(name, t, torch.float32, (T, topk), dev)
    # Gate and up in both orientations (the transposed pair checked, not read: module
    # docstring), down transposed only, as MoK takes them.
    for (d, dn), (s, sn), shape in (
            ((w_routed_gate, "w_routed_gate"), (w_routed_gate_sc, "w_routed_gate_sc"), (E, I, H)),
            ((w_routed_gate_T, "w_routed_gate_T"), (w_routed_gate_T_sc, "w_routed_gate_T_sc"),
             (E, H, I)),
            ((w_routed_up, "w_routed_up"), (w_routed_up_sc, "w_routed_up_sc"), (E, I, H)),
            ((w_routed_up_T, "w_routed_up_T"), (w_routed_up_T_sc, "w_routed_up_T_sc"),
             (E, H, I)),
            ((w_routed_down_T, "w_routed_down_T"), (w_routed_down_T_sc, "w_routed_down_T_sc"),
             (E, I, H))):
        _check_pair(dn, d, sn, s, shape, dev)
    check_schedule(schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert,
                   E, dev, slots, fake)
    ids, slot, used = slot_experts(schedule_peer_rank, schedule_peer_token_idx, num_tokens,
                                   tokens_per_expert, slots)
    q = _converted_for_op([(w_routed_gate, w_routed_gate_sc, False),
                           (w_routed_up, w_routed_up_sc, False),
                           (w_routed_down_T, w_routed_down_T_sc, True)], fake)
    stand_ins, blocks = [c.stand_in for c in q], [t for c in q for t in c.blocks]
    x_slots = x.repeat_interleave(topk, dim=0)
    d_y_slots = d_y_buffer.repeat_interleave(topk, dim=0)
    w_slots = router_weight_buffer.reshape(slots, 1)
    # The context places hold mok's bf16 context (the forward op's docstring).
    d_x_slots, d_w_slots, d_gate, d_up, d_down, *_ = call(
        _fp8_layer.backward_fp8, d_y_slots, x_slots, ids, w_slots, *stand_ins, None, None, None,
        *blocks, x_fp8_t_routed, gate_fp8_routed, up_fp8_routed, hidden_fp8_t_routed, None,
        None, None, 0, limit)
    # The shared expert alone: its routed context rows are never read (no slot is routed).
    ids_none, w_none = no_routed_slots(x)
    ws, config = _workspace.resolve(0)
    shape = _checks.LayerShape(T, H, I, E, 1, w_shared_gate.shape[0], x.dtype, dev)
    unread = [x.new_empty(s) for s in context_shapes(ws, config, shape)[:4]]
    d_x_shared, _, _, _, _, d_shared_gate, d_shared_up, d_shared_down = call(
        _fp8_layer.backward_fp8, d_y_buffer, x, ids_none, w_none, *stand_ins, w_shared_gate,
        w_shared_up, w_shared_down, *blocks, *unread, gate_shared, up_shared, hidden_shared, 0,
        limit)
    if not fake:
        d_x_routed_buffer.copy_(d_x_slots)
        d_router_weight_buffer.copy_(d_w_slots.reshape(T, topk))
    d_x_routed = torch.where(used.unsqueeze(1), d_x_slots[slot.clamp(max=slots - 1)],
                             torch.zeros((), dtype=x.dtype, device=dev))
    bf, f8, sc = x.dtype, MX_DTYPE, SCALE_DTYPE
    return (d_x_shared, d_x_routed, _not_produced(bf, (I,), x), _not_produced(f8, (I,), x),
            _not_produced(sc, (I // B, 32, 16), x), _not_produced(bf, (I,), x),
            _not_produced(f8, (I,), x), _not_produced(sc, (I // B, 32, 16), x),
            _not_produced(bf, (I,), x), _not_produced(bf, (I,), x), _not_produced(f8, (H,), x),
            _not_produced(sc, (H // B, 32, 16), x), d_shared_gate, d_gate, d_shared_up, d_up,
            d_shared_down, d_down)


@torch.library.custom_op(
    "mok::dispatch_mlp_swiglu_combine_bwd_mxfp8",
    mutates_args=("d_x_routed_buffer", "d_router_weight_buffer", "x_fp8_t_routed",
                  "x_sc_t_routed", "gate_fp8_routed", "gate_sc_routed", "up_fp8_routed",
                  "up_sc_routed", "hidden_fp8_t_routed", "hidden_sc_t_routed"))
def dispatch_mlp_swiglu_combine_bwd_mxfp8(
        d_y_buffer: torch.Tensor, d_y_buffer_ptrs: list[int], d_x_routed_buffer: torch.Tensor,
        d_x_routed_buffer_ptrs: list[int], router_weight_buffer: torch.Tensor,
        router_weight_buffer_ptrs: list[int], d_router_weight_buffer: torch.Tensor,
        d_router_weight_buffer_ptrs: list[int], w_shared_gate: torch.Tensor,
        w_routed_gate_T: torch.Tensor, w_routed_gate_T_sc: torch.Tensor,
        w_shared_up: torch.Tensor, w_routed_up_T: torch.Tensor, w_routed_up_T_sc: torch.Tensor,
        w_shared_down: torch.Tensor, w_routed_down_T: torch.Tensor,
        w_routed_down_T_sc: torch.Tensor, x_fp8_t_routed: torch.Tensor,
        x_sc_t_routed: torch.Tensor, gate_shared: torch.Tensor, gate_fp8_routed: torch.Tensor,
        gate_sc_routed: torch.Tensor, up_shared: torch.Tensor, up_fp8_routed: torch.Tensor,
        up_sc_routed: torch.Tensor, hidden_shared: torch.Tensor,
        hidden_fp8_t_routed: torch.Tensor, hidden_sc_t_routed: torch.Tensor, x: torch.Tensor,
        x_ptrs: list[int], w_routed_gate: torch.Tensor, w_routed_gate_sc: torch.Tensor,
        w_routed_up: torch.Tensor, w_routed_up_sc: torch.Tensor,
        schedule_peer_rank: torch.Tensor, schedule_peer_token_idx: torch.Tensor,
        num_tokens: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
        swiglu_limit: float | None, num_comm_sms: int, macrobatch_size: int,
        minibatch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoK's fused MXFP8 backward: (d_x_shared, d_x_routed, d_gate_shared, d_gate_fp8_routed,
    d_gate_sc_routed, d_up_shared, d_up_fp8_routed, d_up_sc_routed, d_hidden_shared,
    d_hidden_routed, d_y_fp8_routed, d_y_sc_routed, d_w_shared_gate, d_w_routed_gate,
    d_w_shared_up, d_w_routed_up, d_w_shared_down, d_w_routed_down); d_x_routed_buffer and
    d_router_weight_buffer get each slot's d_x row and router-weight gradient. The intermediate
    gradients mok fuses away are empty [0, ...] tensors of MoK's dtypes; the weight gradients are
    bf16. The context tensors are read, never written (MoK declares them mutated)."""
    return _bwd(d_y_buffer, d_y_buffer_ptrs, d_x_routed_buffer, d_x_routed_buffer_ptrs,
                router_weight_buffer, router_weight_buffer_ptrs, d_router_weight_buffer,
                d_router_weight_buffer_ptrs, w_shared_gate, w_routed_gate_T, w_routed_gate_T_sc,
                w_shared_up, w_routed_up_T, w_routed_up_T_sc, w_shared_down, w_routed_down_T,
                w_routed_down_T_sc, x_fp8_t_routed, x_sc_t_routed, gate_shared, gate_fp8_routed,
                gate_sc_routed, up_shared, up_fp8_routed, up_sc_routed, hidden_shared,
                hidden_fp8_t_routed, hidden_sc_t_routed, x, x_ptrs, w_routed_gate,
                w_routed_gate_sc, w_routed_up, w_routed_up_sc, schedule_peer_rank,
                schedule_peer_token_idx, num_tokens, tokens_per_expert, topk, swiglu_limit,
                num_comm_sms, macrobatch_size, minibatch_size, fake=False)


@dispatch_mlp_swiglu_combine_bwd_mxfp8.register_fake
def _bwd_fake(*args):
    return _bwd(*args, fake=True)
