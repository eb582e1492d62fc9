"""The PyTorch MoE layer a user would write today (PERF.md's baseline), for benchmarks.

Rows are sorted by expert, gathered with index_select, pushed through torch._grouped_mm for the
fused gate/up projection and the down projection, activated with SwiGLU, scaled by the router
weight and scattered back with an fp32 index_add_; the shared expert runs as dense GEMMs. Autograd
gives the backward. Every routed slot must name an expert in [0, E) (no -1 slots: the baseline
would need a host synchronisation to drop them).
"""
import torch
import torch.nn.functional as F


def prepare_weights(w_gate, w_up, w_down):
    """Layouts _grouped_mm wants, made once outside the timed region: [E, H, 2I] and [E, I, H]."""
    gate_up = torch.cat([w_gate, w_up], dim=1).transpose(1, 2)  # [E, H, 2I], column-major per group
    down = w_down.transpose(1, 2)  # [E, I, H]
    return gate_up, down


def torch_moe(x, topk_experts, topk_weights, gate_up, down, shared=None):
    """x [T, H] bf16; topk_experts [T, k] int64; topk_weights [T, k] fp32;
    gate_up [E, H, 2I], down [E, I, H] from prepare_weights; shared = (W_gate, W_up, W_down) or None."""
    T, H = x.shape
    k = topk_experts.shape[1]
    E, _, two_i = gate_up.shape
    flat = topk_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // k
    xs = x.index_select(0, token)
    gu = torch._grouped_mm(xs, gate_up, offs=offs)
    g, u = gu[:, : two_i // 2], gu[:, two_i // 2:]
    h = F.silu(g) * u
    y = torch._grouped_mm(h, down, offs=offs)
    y = y * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    out.index_add_(0, token, y.float())
    if shared is not None:
        sg, su, sd = shared
        out += (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    return out.to(x.dtype)
