"""MoK's accuracy test at MoK's model shapes on one GPU: mok.functional's forward, backward and
recompute_forward_context, bf16, against an fp32 PyTorch reference computed on the same GPU, with
MoK's tolerances (output: abs max <= 0.5 and sum|diff| / sum|ref| <= 0.01; every gradient: cosine
similarity >= 0.9999), and mok's own relative-error bounds (conftest). The shapes keep the models'
H, I, k and shared expert (T = 512, MoK's smallest; 16 to 32 experts, so the weights fit beside the
reference's fp32 copies); the DeepSeek-V4-like case also runs with a swiglu_limit of 0.5, which
clamps about a fifth of the gate and two fifths of the up pre-activations of these inputs. Outputs
mok allocates are poisoned (conftest). Skips without a CUDA GPU; tests/python/test_mok_compat.py
has the same calls at CPU-sized shapes."""

import pytest
import torch
import torch.nn.functional as F
from conftest import GRAD_TOLERANCE, OUT_TOLERANCE, rel_error, requires_cuda

import mok.functional as functional

ABS_MAX = 0.5
REL_SUM = 0.01
COSINE = 0.9999

# name: (T, H, I, E, k, S, swiglu_limit)
SHAPES = {
    "kimi-k2-like": (512, 7168, 2048, 16, 8, 2048, None),
    "glm-like": (512, 6144, 1536, 16, 8, 1536, None),
    "qwen3.5-like": (512, 4096, 1024, 32, 10, 1024, None),
    "dsv4-pro-like": (512, 7168, 3072, 16, 6, 3072, None),
    "dsv4-pro-like-clamped": (512, 7168, 3072, 16, 6, 3072, 0.5),
    "minimum": (512, 256, 256, 4, 1, 0, None),
}
GRAD_NAMES = ("d_x", "d_router_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
              "d_shared_gate", "d_shared_up", "d_shared_down")


def draw(gen, T, H, I, E, k, S):
    """MoK-style inputs on the GPU: router logits -> top-k ids (distinct per token), softmax of
    the top values; weights uniform in +-fan_in^-0.5; x and d_out standard normal."""
    dev = torch.device("cuda")

    def uniform(shape, fan_in):
        return ((torch.rand(shape, generator=gen) * 2 - 1) * fan_in ** -0.5).to(
            torch.bfloat16).to(dev)

    logits = torch.randn(T, E, generator=gen)
    top, ids = logits.topk(k, dim=1)
    w = torch.softmax(top, dim=1).to(dev)
    routed = (uniform((E, I, H), H), uniform((E, I, H), H), uniform((E, H, I), I))
    shared = ((uniform((S, H), H), uniform((S, H), H), uniform((H, S), S)) if S > 0
              else (None, None, None))
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    d_out = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    return x, ids.to(dev), w.contiguous(), routed, shared, d_out


def expert(v, w_gate, w_up, w_down, limit):
    g, u = v @ w_gate.T, v @ w_up.T
    if limit is not None:
        # MoK's clamped SwiGLU: silu(min(g, L)) * clamp(u, -L, L). mok (as MoK) keeps g and u in
        # bf16 and clamps those; so does the reference, or the elements within a bf16 rounding of
        # +-L would take different sides of the kink here and in mok (the gradient jumps there:
        # about 0.1% of the elements at L 0.5, enough to cost the cosine bound; NOTES, clamped
        # SwiGLU). The rounding passes the gradient through unchanged.
        g = g.to(torch.bfloat16).float().clamp(max=limit)
        u = u.to(torch.bfloat16).float().clamp(-limit, limit)
    return (F.silu(g) * u) @ w_down.T


def reference(x, ids, w, routed, shared, d_out, limit):
    """fp32 output and gradients (autograd), expert by expert over the rows routed to it."""
    leaves = [t.detach().float().requires_grad_(True) if t is not None else None
              for t in (x, w, *routed, *shared)]
    xs, ws, gate, up, down, sg, su, sd = leaves
    out = torch.zeros_like(xs)
    for e in range(gate.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        y = expert(xs[t], gate[e], up[e], down[e], limit)
        out = out.index_add(0, t, y * ws[t, j].unsqueeze(1))
    if sg is not None:
        out = out + expert(xs, sg, su, sd, limit)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad((out * d_out.float()).sum(), present))
    return out.detach(), [next(grads) if t is not None else None for t in leaves]


def check_close(name, got, ref):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten output?)"
    diff = (got - ref).abs()
    assert diff.max() <= ABS_MAX, f"{name}: abs max {float(diff.max())}"
    rel = float(diff.sum() / ref.abs().sum())
    assert rel <= REL_SUM, f"{name}: relative sum {rel}"


def check_cosine(name, got, ref):
    got, ref = got.float().flatten(), ref.float().flatten()
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten output?)"
    cos = float(F.cosine_similarity(got, ref, dim=0))
    assert cos >= COSINE, f"{name}: cosine {cos}"


@requires_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
def test_functional_at_moks_shapes_on_the_gpu(gen, shape):
    # An fp32 reference, not a TF32 one; the setting is restored for the tests after this one.
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check_at_shape(gen, shape)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def check_at_shape(gen, shape):
    T, H, I, E, k, S, limit = SHAPES[shape]
    x, ids, w, routed, shared, d_out = draw(gen, T, H, I, E, k, S)
    sg, su, sd = shared
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device=x.device, num_local_tokens=T,
                                     hidden_size=H, topk=k)
    schedule = functional.build_schedule(ws, config, ids, num_local_experts=E)
    out, ctx = functional.forward(config, ws, schedule, x, w, sg, su, sd, *routed,
                                  swiglu_limit=limit)
    grads = functional.backward(config, ws, schedule, ctx, d_out, x, w, sg, su, sd, *routed,
                                swiglu_limit=limit)
    ref_out, ref_grads = reference(x, ids, w, routed, shared, d_out, limit)
    check_close(f"{shape}: output", out, ref_out)
    # mok's own bounds beside MoK's (the fp32 reference's own error is far below them): a cosine
    # cannot see a gradient off by a constant factor.
    assert rel_error(out, ref_out) <= OUT_TOLERANCE, (shape, "output", rel_error(out, ref_out))
    for name, got, want in zip(GRAD_NAMES, grads, ref_grads):
        if want is None:
            assert got is None, f"{shape}: {name} without a shared expert"
            continue
        check_cosine(f"{shape}: {name}", got, want)
        assert rel_error(got, want) <= GRAD_TOLERANCE, (shape, name, rel_error(got, want))
    # recompute_forward_context gives forward's context, and backward from it the same bits.
    ctx2 = functional.recompute_forward_context(config, ws, schedule, x, sg, su, routed[0],
                                                routed[1], swiglu_limit=limit)
    grads2 = functional.backward(config, ws, schedule, ctx2, d_out, x, w, sg, su, sd, *routed,
                                 swiglu_limit=limit)
    for name, a, b in zip(GRAD_NAMES, grads2, grads):
        if b is not None:
            assert torch.equal(a, b), f"{shape}: {name} from the recomputed context"
    if limit is not None:  # the limit acts on these inputs
        plain, _ = functional.forward(config, ws, schedule, x, w, sg, su, sd, *routed)
        assert not torch.equal(plain, out), f"{shape}: swiglu_limit {limit} changed nothing"
