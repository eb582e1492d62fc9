"""Fake (meta) implementations of mok's ops: output shapes and dtypes from metadata alone.

They run the same argument checks as the real ops (mok/_checks.py), so torch.compile reports a bad
call while tracing, with the same message. Expert ids are data and are checked at run time.
"""

import torch

from mok import _checks, _workspace
from mok.ops import _check_context, _checks_schedule, _schedule_outputs


def _layer(handle, x, topk_experts, topk_weights, weights, *, with_topk_weights=True):
    shape = _checks.check_layer(x, topk_experts, topk_weights, *weights,
                                with_topk_weights=with_topk_weights)
    _workspace.resolve(handle).check_shape(shape)
    return shape


@torch.library.register_fake("mok::build_schedule")
def _build_schedule(topk_experts, num_experts, num_local_experts, first_local_expert):
    _checks.require_tensor("topk_experts", topk_experts)
    _checks_schedule(topk_experts, num_experts, num_local_experts, first_local_expert)
    return topk_experts.new_empty((num_local_experts,), dtype=torch.int32)


@torch.library.register_fake("mok::schedule_table")
def _schedule_table(topk_experts, num_experts, ep_rank, minibatch_size, macrobatch_size):
    return _schedule_outputs(topk_experts, num_experts)


@torch.library.register_fake("mok::forward")
def _forward(x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up, shared_down,
             workspace):
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape = _layer(workspace, x, topk_experts, topk_weights, weights)
    return x.new_empty((shape.num_tokens, shape.hidden_size)), _context()


def _context():
    return torch.empty((1,), dtype=torch.int64, device="cpu")


@torch.library.register_fake("mok::recompute_forward_context")
def _recompute_forward_context(x, topk_experts, gate, up, down, shared_gate, shared_up,
                               shared_down, workspace):
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    _layer(workspace, x, topk_experts, None, weights, with_topk_weights=False)
    return _context()


@torch.library.register_fake("mok::backward")
def _backward(d_out, x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up,
              shared_down, context, workspace):
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape = _layer(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    _check_context(context)
    shared = [w.new_empty(w.shape) if w is not None else x.new_empty(0)
              for w in (shared_gate, shared_up, shared_down)]
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape),
            gate.new_empty(gate.shape), up.new_empty(up.shape), down.new_empty(down.shape),
            *shared)


@torch.library.register_fake("mok::backward_main_grad")
def _backward_main_grad(d_out, x, topk_experts, topk_weights, gate, up, down, shared_gate,
                        shared_up, shared_down, main_gate, main_up, main_down, main_shared_gate,
                        main_shared_up, main_shared_down, context, workspace):
    weights = (gate, up, down, shared_gate, shared_up, shared_down)
    shape = _layer(workspace, x, topk_experts, topk_weights, weights)
    _checks.check_d_out(d_out, shape)
    _checks.check_main_grads(shape, (main_gate, main_up, main_down, main_shared_gate,
                                     main_shared_up, main_shared_down))
    _check_context(context)
    return x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape)
