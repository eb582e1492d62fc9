"""mok's layer (mok.moe and mok.functional) against the independent fp64 reference."""

import random

import pytest
import torch
from conftest import (DEVICES, F64_TOLERANCE, GRAD_TOLERANCE, OUT_TOLERANCE, SEED, make_layer,
                      rel_error)
from moe_reference import forward_and_grads, slot_outputs

import mok
from mok import functional

GRAD_NAMES = ("d_x", "d_topk_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
              "d_shared_gate", "d_shared_up", "d_shared_down")

# (T, H, I, E, k, S, routing): the odd shapes of issue 3, then two drawn anew each run.
FIXED_SHAPES = [
    (1, 64, 64, 1, 1, 0, "random"),         # one token, one expert, k = 1, no shared expert
    (3, 64, 128, 4, 2, 64, "random"),       # three tokens, -1 slots
    (257, 128, 64, 8, 3, 128, "random"),    # T not a multiple of anything
    (257, 64, 64, 6, 2, 0, "one_expert"),   # every row on one expert, the others empty
    (33, 64, 64, 5, 1, 64, "random"),       # k = 1 with a shared expert
    (4, 64, 64, 4, 2, 64, "none"),          # every slot -1: only the shared expert contributes
]


def _random_shapes(n):
    rng = random.Random(SEED)
    shapes = []
    for _ in range(n):
        E = rng.randint(1, 8)
        shapes.append((rng.randint(1, 300), rng.choice([64, 128]), rng.choice([64, 128, 192]), E,
                       rng.randint(1, min(E, 4)), rng.choice([0, 64]), "random"))
    return shapes


SHAPES = FIXED_SHAPES + _random_shapes(2)


def _ids(shape):
    T, H, I, E, k, S, routing = shape
    return f"T{T}-H{H}-I{I}-E{E}-k{k}-S{S}-{routing}"


def run_moe(data):
    """mok.moe forward + backward: (out, gradients in mok's order, None when absent)."""
    x, w, *weights = data.requiring_grad()
    out = mok.moe(x, data.topk_experts, w, *weights)
    out.backward(data.d_out)
    return out.detach(), (x.grad, w.grad, *[t.grad if t is not None else None for t in weights])


def check_against_reference(data, out, grads, out_tol, grad_tol):
    """out and the gradients (mok's order; any device) against the fp64 reference of `data`."""
    data = data.to("cpu")
    ref_out, *ref_grads = forward_and_grads(data.x, data.topk_experts, data.topk_weights,
                                            data.weights, data.d_out)
    errors = {"out": (rel_error(out, ref_out), out_tol)}
    for name, got, ref in zip(GRAD_NAMES, grads, ref_grads):
        if ref is None:
            assert got is None, f"{name}: expected None (no shared expert)"
            continue
        errors[name] = (rel_error(got, ref), grad_tol)
    # d_topk_weights[t, j] = <d_out[t], y[t, j]> is one dot product per entry: with few entries
    # (T = 1) a cancelling sum makes the error relative to |ref| meaningless. The rounding bound
    # holds relative to sum_h |d_out[t, h] * y[t, j, h]| instead: measure it against that.
    y = slot_outputs(data.x, data.topk_experts, *data.weights[:3])
    scale = (data.d_out.to(torch.float64).abs().unsqueeze(1) * y.abs()).sum(dim=-1)
    errors["d_topk_weights"] = (rel_error(grads[1], ref_grads[1], scale=scale), grad_tol)
    bad = {n: e for n, (e, tol) in errors.items() if not e <= tol}
    assert not bad, f"seed {SEED}: relative errors over tolerance: {bad} (all: {errors})"


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_bf16_matches_fp64_reference(gen, shape):
    data = make_layer(gen, *shape[:6], routing=shape[6])
    out, grads = run_moe(data)
    assert out.dtype == torch.bfloat16
    assert grads[1].dtype == torch.float32
    check_against_reference(data, out, grads, OUT_TOLERANCE, GRAD_TOLERANCE)


@pytest.mark.parametrize("shape", [(5, 7, 9, 3, 2, 5, "random"), (1, 3, 2, 1, 1, 0, "random"),
                                   (64, 24, 40, 6, 3, 0, "one_expert")], ids=_ids)
def test_float64_mode_is_exact(gen, shape):
    """The CPU backend's float64 mode: no bf16 alignment rules, fp64 everywhere."""
    data = make_layer(gen, *shape[:6], routing=shape[6], dtype=torch.float64)
    out, grads = run_moe(data)
    assert out.dtype == torch.float64
    check_against_reference(data, out, grads, F64_TOLERANCE, F64_TOLERANCE)


def test_functional_matches_moe_bitwise(gen):
    data = make_layer(gen, 37, 64, 64, 6, 2, 64)
    out, grads = run_moe(data)
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=37,
                                     hidden_size=64, topk=2)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=6)
    g, u, d, sg, su, sd = data.weights
    f_out, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd,
                                    g, u, d)
    f_grads = functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                  data.topk_weights, sg, su, sd, g, u, d)
    assert torch.equal(out, f_out)
    for name, a, b in zip(GRAD_NAMES, grads, f_grads):
        assert torch.equal(a, b), name


def _functional_step(data, config):
    """mok.functional's forward and backward of `data` with `config`: (out, context, grads)."""
    T, H = data.x.shape
    E, k = data.weights[0].shape[0], data.topk_experts.shape[1]
    ws = functional.create_workspace(config, None, device=data.x.device, num_local_tokens=T,
                                     hidden_size=H, topk=k)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    out, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd,
                                  g, u, d)
    grads = functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                data.topk_weights, sg, su, sd, g, u, d)
    return out, ctx, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring", [(4096, 0), (128, 256)], ids=["one-pass", "several-passes"])
def test_forward_paths_give_the_same_bits(gen, device, ring):
    """MoKConfig.forward_path "fused" (the forward megakernel on CUDA) and "launches" (the
    default), with the megakernel's stage automatic or one tile: the same output, forward
    context and gradients, bit for bit. A 128-row minibatch and a 256-row ring make the CUDA
    layer run several ring passes."""
    minibatch, macrobatch = ring
    data = make_layer(gen, 300, 128, 64, 6, 3, 64).to(device)
    base = functional.MoKConfig(minibatch_size=minibatch, macrobatch_size=macrobatch)
    want_out, want_ctx, want_grads = _functional_step(data, base)
    check_against_reference(data, want_out, want_grads, OUT_TOLERANCE, GRAD_TOLERANCE)
    for stage in (0, 128):
        config = functional.MoKConfig(minibatch_size=minibatch, macrobatch_size=macrobatch,
                                      forward_path="fused", fused_stage_rows=stage)
        out, ctx, grads = _functional_step(data, config)
        what = f"fused, stage {stage}"
        assert torch.equal(out, want_out), f"{what}: out"
        for field in ("gate_shared", "up_shared", "hidden_shared"):
            assert torch.equal(getattr(ctx, field), getattr(want_ctx, field)), f"{what}: {field}"
        for name, a, b in zip(GRAD_NAMES, grads, want_grads):
            assert torch.equal(a, b), f"{what}: {name}"


def test_readme_example_round_trip(gen):
    """MoK's README example (functional layer, with the shared expert), in bf16 on CPU tensors,
    then its manual activation-checkpointing variant."""
    T, H, I, E, k = 96, 128, 64, 8, 4
    data = make_layer(gen, T, H, I, E, k, 128)
    x, topk_experts, router_weights, d_output = (data.x, data.topk_experts, data.topk_weights,
                                                 data.d_out)
    w_routed_gate, w_routed_up, w_routed_down, w_shared_gate, w_shared_up, w_shared_down = \
        data.weights

    config = functional.MoKConfig()
    workspace = functional.get_workspace(config, None, device=x.device, num_local_tokens=T,
                                         hidden_size=H, topk=k)
    schedule = functional.build_schedule(workspace, config, topk_experts, num_local_experts=E)
    output, forward_context = functional.forward(
        config, workspace, schedule, x, router_weights, w_shared_gate, w_shared_up,
        w_shared_down, w_routed_gate, w_routed_up, w_routed_down)
    gradients = functional.backward(
        config, workspace, schedule, forward_context, d_output, x, router_weights, w_shared_gate,
        w_shared_up, w_shared_down, w_routed_gate, w_routed_up, w_routed_down)
    assert len(gradients) == 8
    check_against_reference(data, output, gradients, OUT_TOLERANCE, GRAD_TOLERANCE)

    # Manual activation checkpointing: discard the context, run another layer through the same
    # workspace, rebuild the context (gate/up weights only, MoK's signature) before backward.
    _, discarded_forward_context = functional.forward(
        config, workspace, schedule, x, router_weights, w_shared_gate, w_shared_up,
        w_shared_down, w_routed_gate, w_routed_up, w_routed_down)
    del discarded_forward_context
    other = make_layer(gen, T, H, I, E, k, 128)
    functional.forward(config, workspace, functional.build_schedule(
        workspace, config, other.topk_experts, num_local_experts=E), other.x, other.topk_weights,
        *other.weights[3:], *other.weights[:3])
    forward_context = functional.recompute_forward_context(
        config, workspace, schedule, x, w_shared_gate, w_shared_up, w_routed_gate, w_routed_up)
    assert isinstance(forward_context, functional.MoKForwardContext)
    again = functional.backward(
        config, workspace, schedule, forward_context, d_output, x, router_weights, w_shared_gate,
        w_shared_up, w_shared_down, w_routed_gate, w_routed_up, w_routed_down)
    for name, a, b in zip(GRAD_NAMES, gradients, again):
        assert torch.equal(a, b), name


def test_run_to_run_and_thread_count_bitwise(gen):
    data = make_layer(gen, 129, 64, 128, 7, 3, 64)
    first_out, first_grads = run_moe(data)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            ws = functional.create_workspace(functional.MoKConfig(), None, device="cpu",
                                             num_local_tokens=129, hidden_size=64, topk=3)
            x, w, *weights = data.requiring_grad()
            out = mok.moe(x, data.topk_experts, w, *weights, workspace=ws)
            out.backward(data.d_out)
            assert torch.equal(out, first_out), f"out differs with {n} threads"
            got = (x.grad, w.grad, *[t.grad for t in weights])
            for name, a, b in zip(GRAD_NAMES, got, first_grads):
                assert torch.equal(a, b), f"{name} differs with {n} threads"
    finally:
        torch.set_num_threads(threads)


def test_context_follows_the_call_not_the_tensors(gen):
    """A context belongs to the call that returned it: a second forward over the same tensor
    objects, changed in place behind autograd's back (as gradcheck does through .data) and
    restored, does not change what the first call's backward reads."""
    data = make_layer(gen, 21, 64, 64, 4, 2, 64)
    alone_out, alone_grads = run_moe(data)
    x, w, *weights = data.requiring_grad()
    out = mok.moe(x, data.topk_experts, w, *weights)
    saved = weights[2].data.clone()
    weights[2].data.mul_(2)  # down weights; .data: no version bump
    mok.moe(x, data.topk_experts, w, *weights)
    weights[2].data.copy_(saved)
    out.backward(data.d_out)
    assert torch.equal(out, alone_out)
    for name, g, ref in zip(GRAD_NAMES, [x.grad, w.grad] + [t.grad for t in weights], alone_grads):
        assert torch.equal(g, ref), name


def test_main_grads_accumulate_in_fp32(gen):
    T, H, I, E, k, S = 40, 64, 64, 4, 2, 64
    data = make_layer(gen, T, H, I, E, k, S)
    g, u, d, sg, su, sd = data.weights
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=T,
                                     hidden_size=H, topk=k)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    out, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd,
                                  g, u, d)
    # MoK's order: shared gate, routed gate, shared up, routed up, shared down, routed down.
    start = [torch.randn(t.shape, generator=gen) for t in (sg, g, su, u, sd, d)]
    main = [t.clone() for t in start]
    grads = functional.backward(config, ws, schedule, ctx, data.d_out, data.x, data.topk_weights,
                                sg, su, sd, g, u, d, main_grads=tuple(main))
    assert grads[2] is main[1] and grads[5] is main[0]
    assert all(t.dtype == torch.float32 for t in grads[2:])
    s_sg, s_g, s_su, s_u, s_sd, s_d = start
    added = (grads[2] - s_g, grads[3] - s_u, grads[4] - s_d, grads[5] - s_sg, grads[6] - s_su,
             grads[7] - s_sd)
    check_against_reference(data, out, (grads[0], grads[1], *added), OUT_TOLERANCE,
                            GRAD_TOLERANCE)


def test_schedule_counts_rows_per_expert(gen):
    data = make_layer(gen, 77, 64, 64, 9, 3, 0)
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=77,
                                     hidden_size=64, topk=3)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=9)
    ids = data.topk_experts.reshape(-1)
    expected = torch.stack([(ids == e).sum() for e in range(9)]).to(torch.int32)
    assert torch.equal(schedule.rows_per_expert, expected)
    # MoK's tokens_per_expert: each expert's segment, padded to mok's 128-row tile
    assert torch.equal(schedule.tokens_per_expert, (expected + 127) // 128 * 128)
    assert schedule.topk_experts is data.topk_experts
