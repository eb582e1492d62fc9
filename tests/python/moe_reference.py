"""An independent fp64 reference of the MoE layer (DESIGN.md section 1), in plain PyTorch.

It does not call mok (nor mok.reference): every (token, slot) pair gathers its expert's weights and
runs the SwiGLU expert directly, so it shares no code or data layout with what it checks. Gradients
come from torch.autograd over this computation.
"""

import torch
import torch.nn.functional as F


def swiglu(v, w_gate, w_up, w_down):
    """Batched: v [T, H], w_gate/w_up [T, N, H], w_down [T, H, N] -> [T, H]."""
    g = torch.einsum("th,tnh->tn", v, w_gate)
    u = torch.einsum("th,tnh->tn", v, w_up)
    return torch.einsum("tn,thn->th", F.silu(g) * u, w_down)


def slot_outputs(x, topk_experts, gate, up, down):
    """y[t, j] = F_{e[t, j]}(x[t]) in float64, [T, k, H]; zero for unused slots."""
    x = x.to(torch.float64)
    ys = []
    for j in range(topk_experts.shape[1]):
        e = topk_experts[:, j].clamp(min=0)
        y = swiglu(x, gate[e].to(torch.float64), up[e].to(torch.float64),
                   down[e].to(torch.float64))
        ys.append(y * (topk_experts[:, j] >= 0).unsqueeze(1))
    return torch.stack(ys, dim=1)


def layer(x, topk_experts, topk_weights, gate, up, down, shared_gate=None, shared_up=None,
          shared_down=None):
    """out[t] = S(x[t]) + sum over used slots j of w[t, j] * F_{e[t, j]}(x[t]), in float64."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    for j in range(topk_experts.shape[1]):
        used = topk_experts[:, j] >= 0
        e = topk_experts[:, j].clamp(min=0)
        y = swiglu(x, gate[e], up[e], down[e])
        out = out + (topk_weights[:, j] * used).unsqueeze(1) * y
    if shared_gate is not None:
        n = x.shape[0]
        out = out + swiglu(x, shared_gate.expand(n, -1, -1), shared_up.expand(n, -1, -1),
                           shared_down.expand(n, -1, -1))
    return out


def forward_and_grads(x, topk_experts, topk_weights, weights, d_out):
    """fp64 output and the gradients of <out, d_out> with respect to x, topk_weights and every
    weight present (None for absent shared weights), in mok's order:
    (out, d_x, d_topk_weights, d_gate, d_up, d_down, d_shared_gate, d_shared_up, d_shared_down)."""
    leaves = [t.detach().to(torch.float64).requires_grad_(True) if t is not None else None
              for t in (x, topk_weights, *weights)]
    out = layer(leaves[0], topk_experts, *leaves[1:])
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad((out * d_out.to(torch.float64)).sum(), present))
    return (out.detach(), *[next(grads) if t is not None else None for t in leaves])
