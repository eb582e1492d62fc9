"""Clamped SwiGLU (`swiglu_limit`, MoK's semantics) through mok.functional, mok.moe and
mok.nn.MoE, against an independent PyTorch reference written here:

    h = silu(min(g, L)) * clamp(u, -L, L),   g = x W_gate^T, u = x W_up^T

in every expert, the shared one included, with the clamp's gradient 1 on the closed interval (a
pre-activation exactly on a limit passes its gradient) and 0 outside it. The clamp is written with
torch.where: torch.clamp's own gradient at a limit changed in torch 2.14 (0 there), and a test
that leaned on it would follow the installed torch. The reference below loops over (token, slot)
pairs in fp32 (or float64) with autograd; it calls nothing of mok.

Inputs sit on a grid (x and the gate/up weights in {-1, -1/2, 0, 1/2, 1}, H = 64): every g and u
is a multiple of 1/4 below 64 in magnitude, exact in bf16, fp32 and float64, so mok's bf16 layer
and the reference clamp exactly the same elements, and many sit exactly on +-L. Down weights,
router weights and d_out are random. CUDA variants skip without a GPU, with a reason saying so.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import (GRAD_TOLERANCE, OUT_TOLERANCE, SEED, LayerData,
                      rel_error, requires_cuda)

import mok
from mok import functional

T, H, I, E, K, S = 45, 64, 128, 5, 2, 64
LIMITS = [0.5, 1.0, 7.0]


def grid_layer(gen, dtype=torch.bfloat16):
    def grid(*shape):
        return (torch.randint(-2, 3, shape, generator=gen).to(torch.float64) / 2).to(dtype)

    x = grid(T, H)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids[torch.rand(T, K, generator=gen) < 0.15] = -1
    w = torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).to(torch.float64 if dtype == torch.float64
                                            else torch.float32)
    down = (torch.rand(E, H, I, generator=gen, dtype=torch.float64) * 2 - 1) * I**-0.5
    s_down = (torch.rand(H, S, generator=gen, dtype=torch.float64) * 2 - 1) * S**-0.5
    weights = (grid(E, I, H), grid(E, I, H), down.to(dtype), grid(S, H), grid(S, H),
               s_down.to(dtype))
    d_out = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype) * 0.1
    return LayerData(x, ids.contiguous(), w.contiguous(), weights, d_out)


# ---- the independent reference ----

def clamped_swiglu(g, u, limit):
    if limit is not None:  # gradient 1 on [-L, L] and on g <= L, limits included (torch.where's)
        g = torch.where(g > limit, limit, g)
        u = torch.where(u > limit, limit, torch.where(u < -limit, -limit, u))
    return F.silu(g) * u


def reference(data, limit, dtype=torch.float32):
    """(out, grads in mok's order, g and u of every used row) in `dtype`, by autograd."""
    leaves = [t.detach().to(dtype).requires_grad_(True)
              for t in (data.x, data.topk_weights, *data.weights)]
    x, w, gate, up, down, s_gate, s_up, s_down = leaves
    out = torch.zeros(T, H, dtype=dtype)
    seen = []
    for t in range(T):
        for j in range(K):
            e = int(data.topk_experts[t, j])
            if e < 0:
                continue
            g, u = gate[e] @ x[t], up[e] @ x[t]
            seen.append(torch.stack([g.detach(), u.detach()]))
            out[t] = out[t] + w[t, j] * (down[e] @ clamped_swiglu(g, u, limit))
    g, u = x @ s_gate.T, x @ s_up.T
    seen += [torch.stack([g.detach(), u.detach()], dim=1).reshape(2, -1)]
    out = out + clamped_swiglu(g, u, limit) @ s_down.T
    out.backward(data.d_out.to(dtype))
    return out.detach(), [t.grad for t in leaves], torch.cat(seen, dim=-1)


def run_moe(data, limit, device="cpu"):
    d = data.to(device)
    x, w, *weights = d.requiring_grad()
    out = mok.moe(x, d.topk_experts, w, *weights, swiglu_limit=limit)
    out.backward(d.d_out)
    return out.detach().cpu(), [t.grad.cpu() for t in (x, w, *weights)]


GRAD_NAMES = ("d_x", "d_topk_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
              "d_shared_gate", "d_shared_up", "d_shared_down")


def check(data, out, grads, limit, out_tol=OUT_TOLERANCE, grad_tol=GRAD_TOLERANCE,
          dtype=torch.float32):
    ref_out, ref_grads, gu = reference(data, limit, dtype)
    g, u = gu[0], gu[1]
    # The clamp acts on every side, and values sit exactly on the limit.
    assert (g > limit).sum() > 0 and (u > limit).sum() > 0 and (u < -limit).sum() > 0
    assert ((g == limit) | (u.abs() == limit)).sum() > 0
    errors = {"out": (rel_error(out, ref_out), out_tol)}
    for name, got, ref in zip(GRAD_NAMES, grads, ref_grads):
        errors[name] = (rel_error(got, ref), grad_tol)
    # d_topk_weights: one dot product per entry, its rounding measured against the scale of the
    # products (as tests/python/test_layer.py does).
    y = torch.zeros(T, K, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(data.topk_experts[t, j])
            if e >= 0:
                wg, wu, wd = (wt[e].double() for wt in data.weights[:3])
                xt = data.x[t].double()
                y[t, j] = wd @ clamped_swiglu(wg @ xt, wu @ xt, limit)
    scale = (data.d_out.double().abs().unsqueeze(1) * y.abs()).sum(dim=-1)
    errors["d_topk_weights"] = (rel_error(grads[1], ref_grads[1], scale=scale), grad_tol)
    bad = {n: e for n, (e, tol) in errors.items() if not e <= tol}
    assert not bad, f"seed {SEED}, swiglu_limit {limit}: over tolerance: {bad} (all: {errors})"
    # And the clamp matters: the unclamped reference is far off.
    plain_out = reference(data, None, dtype)[0]
    assert rel_error(out, plain_out) > 10 * out_tol


@pytest.mark.parametrize("limit", LIMITS)
def test_moe_matches_fp32_reference(gen, limit):
    data = grid_layer(gen)
    out, grads = run_moe(data, limit)
    check(data, out, grads, limit)


@pytest.mark.parametrize("limit", LIMITS)
def test_float64_mode_is_exact(gen, limit):
    """The CPU backend's float64 mode against the same reference in float64: equal to rounding."""
    data = grid_layer(gen, torch.float64)
    out, grads = run_moe(data, limit)
    check(data, out, grads, limit, out_tol=1e-12, grad_tol=1e-12, dtype=torch.float64)


@pytest.mark.parametrize("limit", LIMITS)
def test_torch_backend_takes_the_layers_side_at_the_limit(gen, limit):
    """mok.reference (mok.nn.MoE's backend="torch") in float64 against the same reference: on the
    grid many pre-activations sit exactly on a limit, where its gradient must pass as in mok's
    layer whatever torch.clamp's gradient is in the installed torch."""
    data = grid_layer(gen, torch.float64)
    x, w, *weights = data.requiring_grad()
    out = mok.reference.moe(x, data.topk_experts, w, *weights, swiglu_limit=limit)
    out.backward(data.d_out)
    check(data, out.detach(), [t.grad for t in (x, w, *weights)], limit, out_tol=1e-12,
          grad_tol=1e-12, dtype=torch.float64)


def _functional_call(data, limit):
    config = functional.MoKConfig()
    ws = functional.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                                  topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    out, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd, g,
                                  u, d, limit)
    again = functional.recompute_forward_context(config, ws, schedule, data.x, sg, su, g, u,
                                                 swiglu_limit=limit)
    grads = functional.backward(config, ws, schedule, ctx, data.d_out, data.x, data.topk_weights,
                                sg, su, sd, g, u, d, swiglu_limit=limit)
    return out, ctx, again, grads


@pytest.mark.parametrize("limit", [1.0, 7])
def test_functional_is_bitwise_moe(gen, limit):
    """MoK's call sequence (limit positional in forward, keyword elsewhere; an int accepted as
    MoK accepts one): bitwise mok.moe, and recompute_forward_context gives the same context."""
    data = grid_layer(gen)
    out, ctx, again, grads = _functional_call(data, limit)
    m_out, m_grads = run_moe(data, float(limit))
    assert torch.equal(out, m_out)
    # functional.backward's order: d_x, d_w, routed gate, up, down, shared gate, up, down.
    for name, a, b in zip(GRAD_NAMES, grads, m_grads):
        assert torch.equal(a, b), name
    used = data.topk_experts.reshape(-1) >= 0  # the CPU context: one row per slot (used ones)
    for name in ("gate_routed", "up_routed", "hidden_routed"):
        assert torch.equal(getattr(ctx, name)[used], getattr(again, name)[used]), name
    for name in ("gate_shared", "up_shared", "hidden_shared"):
        assert torch.equal(getattr(ctx, name), getattr(again, name)), name
    # The context keeps g and u unclamped, as MoK's does; h is clamped.
    assert ctx.gate_shared.float().max() > limit
    ref_h = clamped_swiglu(ctx.gate_shared.float(), ctx.up_shared.float(), float(limit))
    assert rel_error(ctx.hidden_shared, ref_h) <= 2**-8


def test_inactive_limit_is_bitwise_unclamped(gen):
    data = grid_layer(gen)
    plain_out, plain_grads = run_moe(data, None)
    out, grads = run_moe(data, 1.0e6)  # |g|, |u| <= 64 on the grid
    assert torch.equal(out, plain_out)
    for name, a, b in zip(GRAD_NAMES, grads, plain_grads):
        assert torch.equal(a, b), name


def test_nn_moe_against_its_torch_backend(gen):
    torch.manual_seed(SEED)
    layer = mok.nn.MoE(H, I, E, K, shared_intermediate_size=S, swiglu_limit=0.05)
    base = mok.nn.MoE(H, I, E, K, shared_intermediate_size=S, swiglu_limit=0.05,
                      backend="torch")
    base.load_state_dict(layer.state_dict())
    assert "swiglu_limit=0.05" in repr(layer)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    out, _ = layer(x)
    ref, _ = base(x)
    assert rel_error(out, ref) <= 2 * OUT_TOLERANCE
    plain = mok.nn.MoE(H, I, E, K, shared_intermediate_size=S)
    plain.load_state_dict(layer.state_dict())
    assert rel_error(plain(x)[0], ref) > 2 * OUT_TOLERANCE  # 0.05 clamps default-init layers


def test_compiled_moe_with_limit(gen):
    data = grid_layer(gen)
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: mok.moe(*a, swiglu_limit=1.0), fullgraph=True)
    assert torch.equal(fn(*data.args()), run_moe(data, 1.0)[0])


BAD = [(-1.0, ValueError, "-1.0"), (0.0, ValueError, "0.0"), (0, ValueError, "0"),
       (float("nan"), ValueError, "nan"), (float("inf"), ValueError, "inf"),
       (-float("inf"), ValueError, "-inf"), ("7", TypeError, "'7'"), (True, TypeError, "True"),
       (torch.tensor(7.0), TypeError, "tensor(7.)")]


@pytest.mark.parametrize("bad,error,text", BAD, ids=[repr(b[0]) for b in BAD])
def test_bad_limits_raise_naming_the_value(gen, bad, error, text):
    data = grid_layer(gen)
    message = f"mok: invalid swiglu_limit: expected None or a finite positive number, got {text}"
    with pytest.raises(error) as info:
        _functional_call(data, bad)
    assert str(info.value) == message
    with pytest.raises(error) as info:
        mok.moe(*data.args(), swiglu_limit=bad)
    assert str(info.value) == message
    with pytest.raises(error) as info:
        mok.nn.MoE(H, I, E, K, swiglu_limit=bad)
    assert str(info.value) == message
    # The process (and the workspace) carry on.
    out, _ = run_moe(data, 1.0)
    assert torch.isfinite(out.float()).all()


def test_op_layer_refuses_a_limit_float32_cannot_hold(gen):
    """The custom op takes a Python float; the C++ core holds a float32 and names the value."""
    data = grid_layer(gen)
    for bad in (1e300, 1e-300):
        with pytest.raises(ValueError, match=r"invalid swiglu_limit: expected a finite positive "
                                             r"number as a float32, got 1e[+-]300"):
            torch.ops.mok.forward(*data.args(), 0, swiglu_limit=bad)
    with pytest.raises(ValueError, match="invalid swiglu_limit.*got -2"):
        torch.ops.mok.forward(*data.args(), 0, swiglu_limit=-2.0)


# ---- CUDA ----

@requires_cuda
@pytest.mark.parametrize("limit", LIMITS + [1.0e6])
def test_cuda_matches_fp32_reference_and_repeats_bitwise(gen, limit):
    data = grid_layer(gen)
    out, grads = run_moe(data, limit, "cuda")
    if limit < 1e6:
        check(data, out, grads, limit)
    else:  # inactive: the unclamped CUDA layer's bits
        plain_out, plain_grads = run_moe(data, None, "cuda")
        assert torch.equal(out, plain_out)
        for name, a, b in zip(GRAD_NAMES, grads, plain_grads):
            assert torch.equal(a, b), name
    again_out, again_grads = run_moe(data, limit, "cuda")
    assert torch.equal(out, again_out)
    for name, a, b in zip(GRAD_NAMES, grads, again_grads):
        assert torch.equal(a, b), name


@requires_cuda
def test_cuda_functional_recompute_and_backward_with_limit(gen):
    data = grid_layer(gen).to("cuda")
    config = functional.MoKConfig()
    ws = functional.get_workspace(config, None, device=data.x.device, num_local_tokens=T,
                                  hidden_size=H, topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    out, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd, g,
                                  u, d, swiglu_limit=0.5)
    again = functional.recompute_forward_context(config, ws, schedule, data.x, sg, su, g, u,
                                                 swiglu_limit=0.5)
    # The rows forward filled (MoKForwardContext: padding rows hold unspecified values): the
    # routed tensors' rows of the first pass that the schedule assigns a source row.
    for name in ("x_routed", "gate_routed", "up_routed", "hidden_routed"):
        a, b = getattr(ctx, name), getattr(again, name)
        n = min(a.shape[0], schedule.peer_rank.numel())
        filled = schedule.peer_rank[:n] >= 0
        assert int(filled.sum()) > 0, name
        assert torch.equal(a[:n][filled], b[:n][filled]), name
    for name in ("gate_shared", "up_shared", "hidden_shared"):
        assert torch.equal(getattr(ctx, name), getattr(again, name)), name
    grads = functional.backward(config, ws, schedule, again, data.d_out, data.x,
                                data.topk_weights, sg, su, sd, g, u, d, swiglu_limit=0.5)
    check(data.to("cpu"), out.cpu(), [t.cpu() for t in grads], 0.5)

