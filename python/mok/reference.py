"""The same layer in plain PyTorch: the baseline a user would write today.

Rows are sorted by expert, gathered, run through each expert's SwiGLU with ordinary matmuls and
scattered back; the k slots are weighted and summed in fp32 and rounded once, like mok. It reads
routing data on the host (per-expert row counts), so it is a baseline, not a graph-friendly kernel.
Autograd gives every gradient. mok.nn.MoE(backend="torch") uses it; mok's tests have their own,
independent reference.
"""

import torch
import torch.nn.functional as F


def clamp_closed(t, low=None, high=None):
    """t clamped to [low, high] (None: no bound) with mok's gradient: 1 on the closed interval, the
    limits included, 0 outside. torch.clamp's own gradient at a limit is not the same in every
    torch version (1 up to torch 2.13; from 2.14, 0 with number bounds and 1/2 with tensor
    bounds), so the clamp is written with torch.where, whose gradient has not changed."""
    if high is not None:
        t = torch.where(t > high, high, t)
    if low is not None:
        t = torch.where(t < low, low, t)
    return t


def swiglu_expert(x, gate, up, down, swiglu_limit=None):
    """down (silu(gate x) * (up x)) for rows x [n, H]; weights [N, H], [N, H], [H, N]. With
    `swiglu_limit` L: down (silu(min(gate x, L)) * clamp(up x, -L, L)) (MoK's clamped SwiGLU),
    the gradient passing where a pre-activation sits exactly on a limit, as in mok's layer."""
    g, u = F.linear(x, gate), F.linear(x, up)
    if swiglu_limit is not None:
        g, u = clamp_closed(g, high=swiglu_limit), clamp_closed(u, -swiglu_limit, swiglu_limit)
    return F.linear(F.silu(g) * u, down)


def moe(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
        routed_down_weights, shared_gate_weights=None, shared_up_weights=None,
        shared_down_weights=None, *, swiglu_limit=None):
    """mok.moe's result for its positional arguments and swiglu_limit, in plain PyTorch: the bf16
    layer's maths in x's dtype (bf16, or float64), without mok.moe's workspace and precision
    arguments. The baseline the benchmarks time."""
    T, H = x.shape
    k = topk_experts.shape[1]
    E = routed_gate_weights.shape[0]
    flat = topk_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert; -1 slots first
    counts = torch.bincount(flat + 1, minlength=E + 1).tolist()
    rows = x.index_select(0, order[counts[0]:] // k)
    outputs, start = [], 0
    for e in range(E):
        n = counts[e + 1]
        if n:
            outputs.append(swiglu_expert(rows[start:start + n], routed_gate_weights[e],
                                         routed_up_weights[e], routed_down_weights[e],
                                         swiglu_limit))
        start += n
    y = x.new_zeros(T * k, H)
    if outputs:
        y = y.index_copy(0, order[counts[0]:], torch.cat(outputs))
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = topk_weights.masked_fill(topk_experts < 0, 0).to(acc_dtype)
    out = (w.unsqueeze(-1) * y.view(T, k, H).to(acc_dtype)).sum(dim=1)
    if shared_gate_weights is not None:
        out = out + swiglu_expert(x, shared_gate_weights, shared_up_weights,
                                  shared_down_weights, swiglu_limit).to(acc_dtype)
    return out.to(x.dtype)
