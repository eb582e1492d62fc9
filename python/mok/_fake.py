"""Fake (meta) implementations of mok's ops: output shapes and dtypes from metadata alone.

They run the same argument checks as the real ops (mok/_checks.py), so torch.compile reports a bad
call while tracing, with the same message. Expert ids are data and are checked at run time.
"""

import torch

from mok import _checks, _layer_ops  # noqa: F401  (_layer_ops defines the ops registered here)
from mok._layer_tensors import (check_context, check_layer_call, context_shapes,
                                schedule_outputs)


def _context(ws, config, shape, like):
    return tuple(like.new_empty(s) for s in context_shapes(ws, config, shape))


@torch.library.register_fake("mok::build_schedule")
def _build_schedule(topk_experts, num_experts, num_local_experts, first_local_expert):
    _checks.check_schedule_args(topk_experts, num_experts, num_local_experts, first_local_expert)
    return topk_experts.new_empty((num_local_experts,), dtype=torch.int32)


@torch.library.register_fake("mok::schedule_table")
def _schedule_table(topk_experts, num_experts, ep_rank, minibatch_size, macrobatch_size):
    return schedule_outputs(topk_experts, num_experts)


@torch.library.register_fake("mok::forward")
def _forward(x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up, shared_down,
             workspace, swiglu_limit=None):
    _checks.check_swiglu_limit(swiglu_limit)
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    return (x.new_empty((shape.num_tokens, shape.hidden_size)), *_context(ws, config, shape, x))


@torch.library.register_fake("mok::recompute_forward_context")
def _recompute_forward_context(x, topk_experts, gate, up, shared_gate, shared_up, workspace,
                               swiglu_limit=None):
    _checks.check_swiglu_limit(swiglu_limit)
    weights = (gate, up, None, shared_gate, shared_up, None)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, None, weights,
                                         with_topk_weights=False, with_down=False)
    return _context(ws, config, shape, x)


@torch.library.register_fake("mok::backward")
def _backward(d_out, x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up,
              shared_down, x_routed, gate_routed, up_routed, hidden_routed, gate_shared,
              up_shared, hidden_shared, workspace, swiglu_limit=None):
    _checks.check_swiglu_limit(swiglu_limit)
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context((x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                   hidden_shared), context_shapes(ws, config, shape), shape)
    shared = [w.new_empty(w.shape) if w is not None else x.new_empty(0)
              for w in (shared_gate, shared_up, shared_down)]
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape),
            gate.new_empty(gate.shape), up.new_empty(up.shape), down.new_empty(down.shape),
            *shared)


@torch.library.register_fake("mok::backward_main_grad")
def _backward_main_grad(d_out, x, topk_experts, topk_weights, gate, up, down, shared_gate,
                        shared_up, shared_down, main_gate, main_up, main_down, main_shared_gate,
                        main_shared_up, main_shared_down, x_routed, gate_routed, up_routed,
                        hidden_routed, gate_shared, up_shared, hidden_shared, workspace,
                        swiglu_limit=None):
    _checks.check_swiglu_limit(swiglu_limit)
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    _checks.check_main_grads(shape, (main_gate, main_up, main_down, main_shared_gate,
                                     main_shared_up, main_shared_down))
    check_context((x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                   hidden_shared), context_shapes(ws, config, shape), shape)
    return x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape)


@torch.library.register_fake("mok::forward_packed")
def _forward_packed(x, topk_experts, topk_weights, gate_up, down, workspace, interleaved,
                    swiglu_limit=None):
    _checks.check_swiglu_limit(swiglu_limit)
    _layer_ops.check_packed_workspace(workspace)
    gate, up = _layer_ops.split_gate_up(gate_up, interleaved)
    weights = (gate, up, down, None, None, None)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    return (x.new_empty((shape.num_tokens, shape.hidden_size)), *_context(ws, config, shape, x))


@torch.library.register_fake("mok::backward_packed")
def _backward_packed(d_out, x, topk_experts, topk_weights, gate_up, down, x_routed, gate_routed,
                     up_routed, hidden_routed, gate_shared, up_shared, hidden_shared, workspace,
                     interleaved, swiglu_limit=None):
    _checks.check_swiglu_limit(swiglu_limit)
    _layer_ops.check_packed_workspace(workspace)
    gate, up = _layer_ops.split_gate_up(gate_up, interleaved)
    weights = (gate, up, down, None, None, None)
    shape, ws, config = check_layer_call(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    check_context((x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                   hidden_shared), context_shapes(ws, config, shape), shape)
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape),
            gate_up.new_empty(gate_up.shape), down.new_empty(down.shape))
