"""The autograd-aware layer: `mok.moe(...)` and the module `mok.nn.MoE`.

    layer = mok.nn.MoE(hidden_size=1024, intermediate_size=512, num_experts=64, topk=6,
                       shared_intermediate_size=1024, router="sigmoid")
    out, stats = layer(x)                # x [..., hidden_size], bf16
    loss = task_loss(out) + 1e-3 * stats.load_balancing_loss
    loss.backward()                      # gradients reach x, the experts and the router
    layer.update_balancing_bias(stats.tokens_per_expert)   # sigmoid router: after optimizer.step()
"""

import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mok import _checks, _fp8_layer, _layer_ops, _native, _workspace, reference
from mok._config import MoKConfig

__all__ = ["MoE", "MoEStats", "moe", "moe_packed"]


def moe(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
        routed_down_weights, shared_gate_weights=None, shared_up_weights=None,
        shared_down_weights=None, *, workspace=None, swiglu_limit=None, precision="bf16"):
    """One MoE layer, differentiable in x, topk_weights and every weight.

        out[t] = S(x[t]) + sum_{j, topk_experts[t, j] >= 0} topk_weights[t, j] * F_e(x[t])
        F_e(v) = W_down[e] (silu(W_gate[e] v) * (W_up[e] v))

    x [T, H] bf16 (or float64 on the CPU backend), topk_experts int64 [T, k] (ids in [0, E) or -1),
    topk_weights [T, k] fp32 (float64 with float64 x), routed weights [E, I, H], [E, I, H],
    [E, H, I], shared [S, H], [S, H], [H, S] or None. `workspace`: a mok.functional workspace, or
    None for the automatic one. `swiglu_limit` L (None: plain SwiGLU): MoK's clamped SwiGLU,
    silu(min(g, L)) * clamp(u, -L, L) in every expert, the shared one included. Works under
    torch.compile(fullgraph=True): it is one custom op (mok::forward) whose gradient is another
    (mok::backward).

    precision="fp8": the FP8 layer (docs/architecture.md, "The FP8 layer"): every routed-expert
    GEMM on e4m3 operands with power-of-two block scales, the rest as in bf16; bf16 x and weights,
    H and I multiples of 128, CPU or CUDA tensors (CUDA: the launches' forward path). The routed
    weights stay the bf16 parameters (their gradients are returned); each is quantized when it
    changed since its last use (its version counter: an optimizer step), not per call, and on
    every call inside a CUDA graph capture (mok/_fp8_layer.py). precision="fp8-bf16-wgrad": the
    same FP8 layer with its three routed weight gradients computed as the bf16 layer computes
    them, from the bf16 rows (no token-axis quantization; closer to the f64 layer).
    """
    if workspace is not None and not isinstance(workspace, _workspace.Workspace):
        _checks.fail("workspace", "None (the automatic workspace) or a mok.functional workspace",
                     type(workspace).__name__, TypeError)
    # Types first, so that a wrong one is mok's error naming it wherever the call goes (the
    # dispatcher's own schema error names no argument of ours).
    for name, t in (("x", x), ("topk_experts", topk_experts), ("topk_weights", topk_weights),
                    ("routed_gate_weights", routed_gate_weights),
                    ("routed_up_weights", routed_up_weights),
                    ("routed_down_weights", routed_down_weights)):
        _checks.require_tensor(name, t)
    for name, t in (("shared_gate_weights", shared_gate_weights),
                    ("shared_up_weights", shared_up_weights),
                    ("shared_down_weights", shared_down_weights)):
        if t is not None:
            _checks.require_tensor(name, t)
    return _moe(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
                routed_down_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
                workspace=workspace, swiglu_limit=swiglu_limit, precision=precision)


def _moe(x, topk_experts, topk_weights, routed_gate_weights, routed_up_weights,
         routed_down_weights, shared_gate_weights=None, shared_up_weights=None,
         shared_down_weights=None, *, workspace=None, swiglu_limit=None, precision="bf16",
         quantize_routed=None):
    """moe, and for precision="fp8" the routed weights' quantizations from `quantize_routed`
    (a function returning them) instead of mok's cache (MoE's is_first_microbatch)."""
    handle = 0 if workspace is None else workspace.handle
    swiglu_limit = _checks.check_swiglu_limit(swiglu_limit)
    if _fp8_layer.is_fp8(_fp8_layer.check_precision(precision)):
        return _fp8_layer.moe(x, topk_experts, topk_weights, routed_gate_weights,
                              routed_up_weights, routed_down_weights, shared_gate_weights,
                              shared_up_weights, shared_down_weights, handle, swiglu_limit,
                              quantize_routed=quantize_routed,
                              fp8_weight_grads=precision == "fp8")
    # call: the op itself wherever autograd records it or something traces it.
    out, *_context = _layer_ops.call(_layer_ops.forward, x, topk_experts, topk_weights,
                                     routed_gate_weights, routed_up_weights, routed_down_weights,
                                     shared_gate_weights, shared_up_weights, shared_down_weights,
                                     handle, swiglu_limit)
    return out


def moe_packed(x, topk_experts, topk_weights, gate_up_weights, down_weights, *,
               interleaved=False, workspace=None, swiglu_limit=None, precision="bf16"):
    """mok.moe on packed gate/up weights: `gate_up_weights` [E, 2I, H] holds each expert's W_gate
    and W_up, concatenated (rows [0, I) gate, [I, 2I) up) or, with `interleaved`, in alternate
    rows (even gate, odd up); `down_weights` [E, H, I]. The halves are read in place (row-strided
    views: no copy of the weights per call), and the weights' gradient comes back packed the same
    way, [E, 2I, H]. Routed experts only (no shared expert), one rank. The form Hugging Face
    Transformers stores its experts in (mok.integrations.transformers). precision="fp8": mok.moe's
    FP8 layer over the two halves (views), each half quantized once per version of the packed
    tensor."""
    if workspace is not None and not isinstance(workspace, _workspace.Workspace):
        _checks.fail("workspace", "None (the automatic workspace) or a mok.functional workspace",
                     type(workspace).__name__, TypeError)
    for name, t in (("x", x), ("topk_experts", topk_experts), ("topk_weights", topk_weights),
                    ("gate_up_weights", gate_up_weights), ("down_weights", down_weights)):
        _checks.require_tensor(name, t)
    if not isinstance(interleaved, bool):
        _checks.fail("interleaved", "a bool", type(interleaved).__name__, TypeError)
    return packed_experts(x, topk_experts, topk_weights, gate_up_weights, down_weights,
                          interleaved=interleaved, workspace=workspace, swiglu_limit=swiglu_limit,
                          precision=precision)


def packed_experts(x, topk_experts, topk_weights, gate_up_weights, down_weights, *, interleaved,
                   workspace, swiglu_limit, precision, quantize_routed=None):
    """moe_packed after its type checks, for mok.integrations.transformers (not in __all__);
    `quantize_routed` as for _moe (the integration's is_first_microbatch)."""
    handle = 0 if workspace is None else workspace.handle
    if _fp8_layer.is_fp8(_fp8_layer.check_precision(precision)):
        return _fp8_layer.moe_packed(x, topk_experts, topk_weights, gate_up_weights, down_weights,
                                     interleaved, handle, _checks.check_swiglu_limit(swiglu_limit),
                                     fp8_weight_grads=precision == "fp8",
                                     quantize_routed=quantize_routed)
    out, *_context = _layer_ops.call(_layer_ops.forward_packed, x, topk_experts, topk_weights,
                                     gate_up_weights, down_weights, handle, interleaved,
                                     _checks.check_swiglu_limit(swiglu_limit))
    return out


def _ep_rank_size(group, device, num_experts, backend):
    """(rank, size) of the module's EP group (0, 1 without one), checked as mok.functional checks
    a workspace's group."""
    if group is None:
        return 0, 1
    rank, size = _workspace.group_rank_size(group)
    if size == 1:
        return 0, 1
    _workspace.check_group(group, torch.device(device or "cpu"), rank)
    if backend != "mok":
        _checks.fail("backend", "'mok' with a group of several ranks (the torch baseline runs "
                     "one process)", repr(backend))
    if num_experts % size:
        _checks.fail("num_experts", f"a multiple of the group's {size} ranks", num_experts)
    return rank, size


def _autocast_inputs(x, weights):
    """Under torch.autocast (bf16: _checks.autocast_bf16): x and the float32 weights in bf16, as
    F.linear casts them (float64 stays float64); differentiable, so float32 parameters get
    float32 gradients."""
    def cast(t):
        return t.to(torch.bfloat16) if t is not None and t.dtype == torch.float32 else t

    return cast(x), tuple(cast(w) for w in weights)


_ROUTED_NAMES = ("routed_gate_weights", "routed_up_weights", "routed_down_weights")


class MoEStats(NamedTuple):
    """The router's load statistics for one call."""

    tokens_per_expert: torch.Tensor    # [E] float32: routed rows per expert (no gradient)
    router_probs: torch.Tensor         # [E]: mean routing probability per expert (differentiable)
    load_balancing_loss: torch.Tensor  # []: E * sum_e f_e * P_e (Switch-style; differentiable)


_ROUTERS = ("softmax", "sigmoid")
_BACKENDS = ("mok", "torch")


class MoE(torch.nn.Module):
    """A drop-in MoE block: a PyTorch router, then mok's expert layer.

    router="softmax": probabilities softmax(x W_r^T), the top-k of them, renormalised to sum to 1.
    router="sigmoid": DeepSeek-V3 routing: scores sigmoid(x W_r^T); the top-k are chosen on
      scores + a balancing bias (selection only: the bias never scales an output and gets no
      gradient; update it with update_balancing_bias); the chosen scores, renormalised, times
      `route_scale`, weight the experts.
    The router runs in fp32 (float64 for a float64 module); its gradient flows through the router
    weights into W_r. Experts and shared expert are SwiGLU, in `dtype` (bf16, or float64 for the
    CPU backend's exact mode). Initialisation as torch.nn.Linear (uniform in +-1/sqrt(fan_in)).
    Mixed precision: with dtype=torch.float32 (or after .float()) the parameters are fp32 master
    weights and the layer computes in bf16 under torch.autocast(dtype=torch.bfloat16), which
    casts x and the weights per call as F.linear does, or under FSDP2 (fully_shard) with
    MixedPrecisionPolicy(param_dtype=torch.bfloat16), which hands over bf16 weights (FSDP2 needs
    one parameter dtype per group: the bf16 default, with its fp32 router, cannot be sharded).
    Activation checkpointing: torch.utils.checkpoint with use_reentrant=False recomputes the layer
    bit for bit; the reentrant form drops the gradient of MoEStats (not a tensor output).
    swiglu_limit L: clamped SwiGLU in every expert (silu(min(g, L)) * clamp(u, -L, L), MoK's and
    DeepSeek-V4's form); None (default): plain SwiGLU.
    precision="fp8" or "fp8-bf16-wgrad": the FP8 layer (mok.moe's precision; bf16 dtype, H and I
    multiples of 128, CPU or CUDA, with or without a group). The routed weights stay
    bf16 parameters, quantized again whenever they changed (an optimizer step), in every call a
    CUDA graph captures, and in every call under FSDP2 (its unsharded weights share their memory
    with its all-gather buffer); after a change PyTorch's version counter cannot see (through
    `.data`, or graph replays that stepped the optimizer), call quantize_weights().
    Gradient accumulation under FSDP2 (or autocast, whose bf16 copies are new tensors every call)
    would quantize every micro-batch; forward's `is_first_microbatch` (TransformerEngine's
    argument) makes it once a step: True quantizes the weights of that call and keeps the result
    on the module, False reuses what the last True call kept, whatever the weights hold now (the
    caller's promise that they have not changed: pass True after every optimizer step). None
    (default): mok's cache decides. No effect in bf16; not inside torch.compile. What True keeps
    (an FP8 copy of the routed weights in both orientations, the bf16 weights' bytes; under FSDP2
    unsharded, every layer's for the whole step) stays until release_kept_weights() or the next
    True.

    forward(x [..., hidden_size], *, is_first_microbatch=None) -> (out [..., hidden_size],
    MoEStats).
    backend="torch" computes the experts with mok.reference (pure PyTorch) instead: the baseline.

    group: a torch.distributed group of W ranks for expert parallelism across processes (gloo with
    CPU tensors; with CUDA tensors, over PyTorch's symmetric memory: tested as ranks on threads of
    one GPU, not yet run on several GPUs): this rank's module holds experts [r*E/W, (r+1)*E/W)
    (routed weights [E/W, ...]) and routes its own tokens over all E. Every rank must call it with
    the same number of tokens. The router and the shared expert are replicated, as in data
    parallelism: give them the same initial values on every rank (e.g. the same seed, or a
    broadcast) and reduce their gradients across the group as a data-parallel job does; the experts'
    gradients need no reduction.
    """

    def __init__(self, hidden_size, intermediate_size, num_experts, topk,
                 shared_intermediate_size=0, router="softmax", *, route_scale=1.0,
                 bias_update_rate=1e-3, config=None, backend="mok", group=None, device=None,
                 dtype=torch.bfloat16, swiglu_limit=None, precision="bf16"):
        super().__init__()
        # Every argument checked here, before anything is built: a bad one raises mok's error
        # naming it (a wrong type: TypeError), never a layer that silently computes something
        # else (a negative shared size dropping the shared expert, a NaN scale).
        hidden_size = _checks.check_int("hidden_size", hidden_size, minimum=1)
        intermediate_size = _checks.check_int("intermediate_size", intermediate_size, minimum=1)
        num_experts = _checks.check_int("num_experts", num_experts, minimum=1)
        topk = _checks.check_int("topk", topk, minimum=1)
        shared_intermediate_size = _checks.check_int("shared_intermediate_size",
                                                     shared_intermediate_size, minimum=0)
        if topk > num_experts:
            _checks.fail("topk", f"in [1, num_experts = {num_experts}]", topk)
        if not isinstance(router, str) or router not in _ROUTERS:
            _checks.fail("router", " or ".join(repr(r) for r in _ROUTERS), repr(router))
        route_scale = _checks.check_real("route_scale", route_scale)
        bias_update_rate = _checks.check_real("bias_update_rate", bias_update_rate,
                                              inclusive=True)
        if config is not None and not isinstance(config, MoKConfig):
            _checks.fail("config", "None (the default MoKConfig) or a MoKConfig",
                         type(config).__name__, TypeError)
        if not isinstance(backend, str) or backend not in _BACKENDS:
            _checks.fail("backend", " or ".join(repr(b) for b in _BACKENDS), repr(backend))
        if group is not None and not isinstance(group, dist.ProcessGroup):
            _checks.fail("group", "None (one process) or a torch.distributed ProcessGroup",
                         type(group).__name__, TypeError)
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                _checks.fail("device", "None or a torch.device (or its name)", repr(device),
                             TypeError if isinstance(e, TypeError) else ValueError)
        if not isinstance(dtype, torch.dtype) or dtype not in (*_checks.ACTIVATION_DTYPES,
                                                                torch.float32):
            _checks.fail("dtype", "torch.bfloat16, torch.float32 (computed in bf16 under "
                         "autocast or FSDP's mixed precision) or torch.float64 (the cpu backend)",
                         str(dtype), TypeError)
        compute_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
        self.swiglu_limit = _checks.check_swiglu_limit(swiglu_limit)
        self.precision = _fp8_layer.check_precision(precision)
        if _fp8_layer.is_fp8(self.precision):
            if backend != "mok":
                _checks.fail("precision", "'bf16' with backend='torch' (the pure-PyTorch "
                             "baseline has no FP8 layer)", repr(self.precision))
            if compute_dtype != torch.bfloat16:
                _checks.fail("dtype", "torch.bfloat16 or torch.float32 for precision='fp8'",
                             str(dtype), TypeError)
            for name, size in (("hidden_size", hidden_size),
                               ("intermediate_size", intermediate_size)):
                if size % 128:
                    _checks.fail(name, "a multiple of 128 for precision='fp8'", size)
        ep_rank, ep_size = _ep_rank_size(group, device, num_experts, backend)
        if backend == "mok":  # mok's own rules on the sizes (bf16: multiples of 64), now
            _native.lib.validate_problem(
                num_tokens=1, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_experts=num_experts, topk=topk,
                shared_intermediate_size=shared_intermediate_size, ep_size=ep_size,
                ep_rank=ep_rank, activation_dtype=_checks.dtype_name(compute_dtype))
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.topk = num_experts, topk
        self.shared_intermediate_size = shared_intermediate_size
        self.router, self.route_scale, self.bias_update_rate = router, route_scale, bias_update_rate
        self.backend = backend
        self.ep_rank, self.ep_size = ep_rank, ep_size  # the group: self.group (the workspace's)
        router_dtype = _checks.router_dtype(dtype)
        E, I, H, S = num_experts, intermediate_size, hidden_size, shared_intermediate_size
        El = num_experts // ep_size  # this rank's experts
        p = dict(device=device, dtype=dtype)
        self.router_weight = torch.nn.Parameter(
            torch.empty(E, H, device=device, dtype=router_dtype))
        if router == "sigmoid":
            self.register_buffer("router_bias", torch.zeros(E, device=device, dtype=router_dtype))
        else:
            self.router_bias = None
        self.routed_gate_weights = torch.nn.Parameter(torch.empty(El, I, H, **p))
        self.routed_up_weights = torch.nn.Parameter(torch.empty(El, I, H, **p))
        self.routed_down_weights = torch.nn.Parameter(torch.empty(El, H, I, **p))
        if S > 0:
            self.shared_gate_weights = torch.nn.Parameter(torch.empty(S, H, **p))
            self.shared_up_weights = torch.nn.Parameter(torch.empty(S, H, **p))
            self.shared_down_weights = torch.nn.Parameter(torch.empty(H, S, **p))
        else:
            for name in ("shared_gate_weights", "shared_up_weights", "shared_down_weights"):
                self.register_parameter(name, None)
        # Scratch shared with every module of this config (and, through it, of this shape): the
        # forward context is autograd's, so nothing of one layer's call outlives it there.
        self._workspace = (_workspace.for_config(config) if group is None else
                           _workspace.for_group(config, group, ep_rank, ep_size))
        self._mok_fp8_kept = None  # is_first_microbatch=True's (_fp8_layer.kept_quantizations)
        self.reset_parameters()

    @property
    def group(self):
        """The EP group (None: one process). NOTES: kept by the workspace only, whose copies keep
        it: a process group cannot be deep-copied."""
        return self._workspace.group

    @torch.no_grad()
    def reset_parameters(self):
        def linear_init(w):  # torch.nn.Linear's default, drawn in fp32 then rounded once
            bound = 1.0 / math.sqrt(w.shape[-1])
            w.copy_(torch.empty(w.shape, device=w.device).uniform_(-bound, bound))

        for w in (self.router_weight, self.routed_gate_weights, self.routed_up_weights,
                  self.routed_down_weights, self.shared_gate_weights, self.shared_up_weights,
                  self.shared_down_weights):
            if w is not None:
                linear_init(w)
        if self.router_bias is not None:
            self.router_bias.zero_()

    def extra_repr(self):
        ep = f", ep_rank={self.ep_rank}, ep_size={self.ep_size}" if self.ep_size > 1 else ""
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, "
                f"shared_intermediate_size={self.shared_intermediate_size}, "
                f"router={self.router!r}, backend={self.backend!r}{ep}"
                + (f", precision={self.precision!r}" if self.precision != "bf16" else "")
                + (f", swiglu_limit={self.swiglu_limit}" if self.swiglu_limit is not None else ""))

    def route(self, x):
        """x [T, H] -> (topk_experts int64 [T, k], topk_weights [T, k], MoEStats)."""
        E, k = self.num_experts, self.topk
        # fp32 (float64 for float64 x) whatever the router weight's dtype: FSDP's mixed precision
        # hands it over in its param_dtype.
        dtype = _checks.router_dtype(x.dtype)
        logits = F.linear(x.to(dtype), self.router_weight.to(dtype))
        if self.router == "softmax":
            probs = logits.softmax(dim=-1)
            chosen, topk_experts = probs.topk(k, dim=-1)
            topk_weights = chosen / chosen.sum(dim=-1, keepdim=True)
        else:
            scores = logits.sigmoid()
            _, topk_experts = (scores + self.router_bias).topk(k, dim=-1)
            chosen = scores.gather(1, topk_experts)
            topk_weights = chosen / chosen.sum(dim=-1, keepdim=True) * self.route_scale
            probs = scores / scores.sum(dim=-1, keepdim=True)
        with torch.no_grad():
            counts = torch.zeros(E, device=x.device, dtype=torch.float32)
            counts.scatter_add_(0, topk_experts.reshape(-1),
                                torch.ones(topk_experts.numel(), device=x.device))
        router_probs = probs.mean(dim=0)
        fraction = counts / topk_experts.numel()
        balance = E * (fraction.to(router_probs.dtype) * router_probs).sum()
        return topk_experts, topk_weights.contiguous(), MoEStats(counts, router_probs, balance)

    def forward(self, x, *, is_first_microbatch=None):
        """(out, MoEStats) for tokens x [..., hidden_size]: out has x's shape; the class
        docstring says what the stats hold and what is_first_microbatch does."""
        _checks.require_tensor("x", x)
        shape = x.shape
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            _checks.fail("x.shape[-1]", f"{self.hidden_size} (the module's hidden_size)",
                         x.shape[-1] if x.dim() else "a 0-d tensor")
        _fp8_layer.check_is_first_microbatch(is_first_microbatch)
        weights = (self.routed_gate_weights, self.routed_up_weights, self.routed_down_weights,
                   self.shared_gate_weights, self.shared_up_weights, self.shared_down_weights)
        autocast = _checks.autocast_bf16(x.device.type)
        if autocast:
            x, weights = _autocast_inputs(x, weights)
        elif self.routed_gate_weights.dtype == torch.float32:
            _checks.fail("routed_gate_weights.dtype", "bfloat16 at the call (float32 parameters "
                         "are computed in bf16 under torch.autocast(dtype=torch.bfloat16) or "
                         "FSDP's MixedPrecisionPolicy(param_dtype=torch.bfloat16))", "float32",
                         TypeError)
        x2 = x.reshape(-1, self.hidden_size).contiguous()
        # Under autocast, the router in fp32 and the layer in its own dtypes, as without it.
        with torch.autocast(x.device.type, enabled=False) if autocast else nullcontext():
            topk_experts, topk_weights, stats = self.route(x2)
            if self.backend == "mok":
                out = _moe(x2, topk_experts, topk_weights, *weights, workspace=self._workspace,
                           swiglu_limit=self.swiglu_limit, precision=self.precision,
                           quantize_routed=_fp8_layer.kept_quantizations(
                               self, _ROUTED_NAMES, weights[:3], is_first_microbatch)
                           if _fp8_layer.is_fp8(self.precision) else None)
            else:
                out = reference.moe(x2, topk_experts, topk_weights, *weights,
                                    swiglu_limit=self.swiglu_limit)
        return out.reshape(shape), stats

    def release_kept_weights(self):
        """Frees the FP8 weights is_first_microbatch=True kept (as many bytes as the bf16 routed
        weights; under FSDP2 unsharded, so every layer's at once): e.g. before the optimizer
        step. A call with False then raises until the next True."""
        _fp8_layer.release_kept(self)

    def quantize_weights(self):
        """precision='fp8': quantize the routed weights now. Needed only after a change their
        version counter does not show (an in-place change through `.data`); an optimizer step
        and any other in-place or replacing change is seen by the next forward."""
        if not _fp8_layer.is_fp8(self.precision):
            _checks.fail("precision", "'fp8' or 'fp8-bf16-wgrad' (only the FP8 layer quantizes "
                         "its weights)", repr(self.precision))
        _fp8_layer.requantize(self.routed_gate_weights, self.routed_up_weights,
                              self.routed_down_weights)

    @torch.no_grad()
    def update_balancing_bias(self, tokens_per_expert, rate=None):
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts and
        lower it for over-loaded ones by `rate` (default bias_update_rate). Sigmoid router only."""
        if self.router_bias is None:
            _checks.fail("router", "'sigmoid' (only it has a balancing bias)", repr(self.router))
        load = tokens_per_expert.to(self.router_bias.dtype)
        rate = self.bias_update_rate if rate is None else rate
        self.router_bias.add_(rate * torch.sign(load.mean() - load))
