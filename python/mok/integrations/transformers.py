"""Hugging Face Transformers' MoE experts on mok: ``experts_implementation="mok"``.

    import mok.integrations.transformers as mok_hf   # registers "mok" in the ExpertsInterface
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 experts_implementation="mok")
    model.set_experts_implementation("mok")   # or switch a model already built
    mok_hf.check(model)                       # every experts module checked now (else: first call)

Transformers 5 routes the experts block of every MoE family through one interface: the experts
class is decorated with ``@use_experts_implementation`` and its forward(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) calls the function registered under the model's
``experts_implementation``. Importing this module registers mok's there. The model's router and
its shared experts stay Transformers modules; mok computes the routed experts, forward and
backward, from the module's own parameters used in place (``gate_up_proj`` [E, 2I, H], gate then
up or interleaved rows, read as row-strided views, and ``down_proj`` [E, H, I]): gradients land in
``gate_up_proj.grad`` and ``down_proj.grad`` and flow back into hidden_states and top_k_weights,
as eager computes them.

What runs: SwiGLU experts, i.e. a gate function (the class's ``_apply_gate``) equal to
silu(gate) * up, or to MoK's clamped form silu(min(gate, L)) * clamp(up, -L, L) with the module's
own limit; no bias, no post-expert norm, not transposed; H and I multiples of 64; bf16 weights (on
CUDA: the GPU layer; on the CPU: mok's reference), float64 on the CPU (the reference's exact
mode), or float32 under torch.autocast(dtype=torch.bfloat16) (cast to bf16 per call). Anything
else raises mok's error naming the reason at the module's first call (or at check(model)): never
a silent fallback. docs/transformers.md has the family table.

Workspaces: every experts module of one shape shares one (mok's automatic workspace, or the one
of the MoKConfig given to configure()). A module is checked once, at its first call or by
check(model); under torch.compile the check must have run before tracing (check(model), or one
eager call).
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import transformers

from mok import _checks, _fp8_layer, _versions, _workspace, nn
from mok._config import MoKConfig

_versions.check_version("transformers", transformers.__version__,
                        _versions.TRANSFORMERS_MINIMUM)

import transformers.integrations.moe as hf_moe  # noqa: E402

NAME = "mok"  # the experts_implementation this module registers
PRECISIONS = _fp8_layer.PRECISIONS  # configure(precision=...)


@dataclass(frozen=True)
class _Settings:
    """What configure() set: the precision and the workspace (of the MoKConfig) every call uses.
    NOTES: the workspace is looked up here, once, not per call, so that a traced call reads a
    constant (its handle) and takes no lock."""

    precision: str
    workspace: _workspace.Workspace


_settings = _Settings("bf16", _workspace.for_config(None))


def configure(config=None, *, precision="bf16"):
    """The MoKConfig every "mok" experts call uses (None: the default) and the precision: "bf16",
    or "fp8", mok's FP8 layer (bf16 weights, H and I multiples of 128; each weight quantized once
    per version, docs/architecture.md "The FP8 layer"), or "fp8-bf16-wgrad", the same with bf16
    weight gradients (mok.moe's precision). Experts of one shape share the config's workspace.
    Each call sets both: configure(precision="fp8") alone goes back to the default MoKConfig."""
    global _settings
    if config is not None and not isinstance(config, MoKConfig):
        _checks.fail("config", "None (the default MoKConfig) or a MoKConfig",
                     type(config).__name__, TypeError)
    _fp8_layer.check_precision(precision)
    _settings = _Settings(precision, _workspace.for_config(config))


@dataclass(frozen=True)
class Plan:
    """How mok runs one experts module: the packing of gate_up_proj and the SwiGLU limit."""

    interleaved: bool
    swiglu_limit: float | None


_PLAN_ATTR = "_mok_plan"  # the module's checked Plan (a plain attribute: no parameter, no buffer)


def is_experts_module(module):
    """Whether `module` is an instance of a class decorated with @use_experts_implementation."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_bias")


def _refuse(module, what, expected, actual, error=ValueError):
    _checks.fail(f"{type(module).__name__} {what} (experts_implementation={NAME!r})", expected,
                 actual, error)


def _probe_gate(module, interleaved):
    """The module's gate function against SwiGLU and MoK's clamped SwiGLU, in float64 on the CPU
    over gate and up values in [-10, 10]: the swiglu_limit it matches (None: plain SwiGLU), or
    refused. NOTES: a probe rather than a list of classes, so a family's own _apply_gate (or
    act_fn) is judged by what it computes, in whatever Transformers version is installed; an
    _apply_gate computing in fp32 (e.g. beam's) passes within fp32 rounding."""
    n = 256
    g = torch.linspace(-10.0, 10.0, n, dtype=torch.float64)
    u = torch.linspace(10.0, -10.0, n, dtype=torch.float64).roll(n // 3)
    packed = (torch.stack((g, u), dim=-1).reshape(1, 2 * n) if interleaved
              else torch.cat((g, u)).reshape(1, 2 * n))
    try:
        with torch.no_grad():
            got = module._apply_gate(packed)
    except Exception as e:  # noqa: BLE001 (any failure means: not a gate mok can stand in for)
        _refuse(module, "gate function", "silu(gate) * up over [T, 2I] gate/up rows",
                f"{type(e).__name__}: {e}")
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (1, n):
        _refuse(module, "gate function", f"an output of shape [1, {n}] for gate/up [1, {2 * n}]",
                f"{getattr(got, 'shape', type(got).__name__)}")
    got = got.to(torch.float64).reshape(n)

    def matches(want):
        return bool(((got - want).abs() <= 1e-5 * (1.0 + want.abs())).all())

    silu = torch.nn.functional.silu
    if matches(silu(g) * u):
        return None
    for limit in _limit_candidates(module):
        if matches(silu(g.clamp(max=limit)) * u.clamp(-limit, limit)):
            return limit
    act = getattr(module, "act_fn", None)
    _refuse(module, "gate function", "silu(gate) * up (SwiGLU), or silu(min(gate, L)) * "
            "clamp(up, -L, L) with the module's swiglu_limit L",
            f"another function ({type(module).__name__}._apply_gate, act_fn "
            f"{type(act).__name__ if act is not None else 'none'})")


def _limit_candidates(module):
    """The clamp limits a module may hold (the names the families use), finite and positive."""
    config = getattr(module, "config", None)
    values = [getattr(module, "swiglu_limit", None), getattr(module, "limit", None),
              getattr(config, "swiglu_limit", None)]
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0]


def _check_structure(module):
    """The decorator's flags and the parameters' shapes: the Plan, or mok's error."""
    if not getattr(module, "has_gate", True):
        _refuse(module, "has_gate", "True (SwiGLU experts: gate_up_proj)",
                "False (an up projection and an activation, no gate)")
    if getattr(module, "has_bias", False):
        _refuse(module, "has_bias", "False (mok's experts have no bias)", "True")
    if getattr(module, "has_post_expert_norm", False):
        _refuse(module, "has_post_expert_norm", "False (mok's experts end at down_proj)", "True")
    if getattr(module, "is_transposed", False):
        _refuse(module, "is_transposed", "False: gate_up_proj [E, 2I, H], read in place (a "
                "transposed [E, H, 2I] would need a copy per call, which mok does not make)",
                "True")
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        _refuse(module, "parameters", "gate_up_proj and down_proj tensors",
                f"{type(gate_up).__name__} and {type(down).__name__}")
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        _refuse(module, "gate_up_proj.shape", "[num_experts, 2 * intermediate, hidden]",
                _checks.shape_text(gate_up.shape))
    E, I2, H = gate_up.shape
    if tuple(down.shape) != (E, H, I2 // 2):
        _refuse(module, "down_proj.shape", _checks.shape_text((E, H, I2 // 2)),
                _checks.shape_text(down.shape))
    for name, size in (("hidden size", H), ("intermediate size", I2 // 2)):
        if size % 64:
            _refuse(module, name, "a multiple of 64 (mok's bf16 GEMM tiles)", size)
    interleaved = not getattr(module, "is_concatenated", True)
    return Plan(interleaved, _probe_gate(module, interleaved))


def plan(module):
    """The module's Plan, checked once and kept on the module (mok's error if it cannot run)."""
    found = module.__dict__.get(_PLAN_ATTR)
    if found is not None:
        return found
    if torch.compiler.is_compiling():
        _refuse(module, "check", "a module checked before torch.compile traces it: call "
                "mok.integrations.transformers.check(model), or run one eager call, first",
                "a module not checked yet")
    if not is_experts_module(module):
        _checks.fail("module", "an experts module (@use_experts_implementation)",
                     type(module).__name__, TypeError)
    found = _check_structure(module)
    module.__dict__[_PLAN_ATTR] = found
    return found


def _call_dtype(module, hidden_dtype=None):
    """Metadata only: the dtype mok computes this module in (the device picks the backend). The
    weights' own (bf16, or float64 on the CPU), or bf16 for float32 weights and activations under
    torch.autocast(dtype=torch.bfloat16), which casts them per call as it would for eager's
    linear layers. Without `hidden_dtype` (check(model), outside any call) float32 weights pass:
    they run under autocast."""
    w = module.gate_up_proj
    if module.down_proj.dtype != w.dtype:
        _refuse(module, "down_proj.dtype", _checks.dtype_name(w.dtype),
                _checks.dtype_name(module.down_proj.dtype), TypeError)
    autocast = hidden_dtype is not None and _checks.autocast_bf16(
        w.device.type, f"{type(module).__name__} autocast dtype (experts_implementation={NAME!r})")
    if autocast or hidden_dtype is None:
        cast = {torch.float32: torch.bfloat16}
        w_dtype = cast.get(w.dtype, w.dtype)
        hidden_dtype = w_dtype if hidden_dtype is None else cast.get(hidden_dtype, hidden_dtype)
    else:
        w_dtype = w.dtype
    on_cpu = w.device.type == "cpu"
    allowed = (torch.bfloat16, torch.float64) if on_cpu else (torch.bfloat16,)
    if w_dtype not in allowed:
        _refuse(module, "gate_up_proj.dtype", "bfloat16" + (" (or float64, the exact mode)"
                if on_cpu else "") + ", or float32 under torch.autocast(dtype=torch.bfloat16): "
                "convert the model, e.g. model.to(torch.bfloat16)", _checks.dtype_name(w.dtype),
                TypeError)
    if hidden_dtype != w_dtype:
        _refuse(module, "hidden_states.dtype", f"{_checks.dtype_name(w_dtype)}, the experts' "
                "dtype (mok casts activations only under torch.autocast)",
                _checks.dtype_name(hidden_dtype), TypeError)
    return w_dtype


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "mok" experts implementation: sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(
    hidden_states[t]) for every token, by mok's layer on the module's own weights (under
    torch.autocast, float32 ones cast to bf16 per call; the output in hidden_states' dtype)."""
    p = plan(self)
    dtype = _call_dtype(self, hidden_states.dtype)
    gate_up, down = self.gate_up_proj.to(dtype), self.down_proj.to(dtype)  # no-ops unless cast
    H = gate_up.shape[2]
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, H).to(dtype).contiguous()
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1, k).to(torch.int64)
    if getattr(self, "_is_expert_parallel", False):
        # Transformers' expert parallelism marks slots of other ranks' experts with ids >=
        # num_experts: mok's unused slot is -1 (no row, no gradient).
        ids = torch.where(ids < gate_up.shape[0], ids, torch.full_like(ids, -1))
    weights = top_k_weights.reshape(-1, k).to(_checks.router_dtype(x.dtype))
    first = getattr(self, "_mok_is_first_microbatch", None)  # set_is_first_microbatch
    quantize_routed = None
    if first is not None and _fp8_layer.is_fp8(_settings.precision):
        gate, up = _fp8_layer.split_gate_up(gate_up, p.interleaved)
        quantize_routed = _fp8_layer.kept_quantizations(self, _HALF_NAMES, (gate, up, down), first)
    autocast = torch.is_autocast_enabled(x.device.type)
    with torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
        out = nn.packed_experts(x, ids.contiguous(), weights.contiguous(), gate_up, down,
                                interleaved=p.interleaved, workspace=_settings.workspace,
                                swiglu_limit=p.swiglu_limit, precision=_settings.precision,
                                quantize_routed=quantize_routed)
    return out.to(hidden_states.dtype).reshape(shape)


_HALF_NAMES = ("gate_up_proj's gate half", "gate_up_proj's up half", "down_proj")


def set_is_first_microbatch(model, value):
    """Gradient accumulation with precision "fp8" (configure), where mok's cache quantizes the
    experts' weights at every call (FSDP2's unsharded weights, autocast's copies: docs/
    architecture.md, "From Python"): before each micro-batch's forward, True at a step's first
    (each experts module quantizes its weights and keeps them), False at the others (they reuse
    what the first kept, whatever the weights hold: pass True after every optimizer step), None
    (the default) to leave it to the cache again and free what True kept (an FP8 copy of each
    module's weights, as many bytes as its bf16 ones; under FSDP2 unsharded, so every layer's at
    once until then). mok.nn.MoE's is_first_microbatch for every experts module of `model`; no
    effect in bf16; not inside torch.compile. Returns the modules' names."""
    _fp8_layer.check_is_first_microbatch(value)
    names = []
    for name, module in model.named_modules():
        if is_experts_module(module):
            module._mok_is_first_microbatch = value
            if value is None:
                _fp8_layer.release_kept(module)
            names.append(name)
    return names


def unsupported_reason(module):
    """None where mok runs this experts module, else the reason (mok's error message)."""
    try:
        plan(module)
        _call_dtype(module)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def check(model):
    """Checks every experts module of `model` now (each one's Plan is kept); raises mok's error
    for the first that mok cannot run. Returns the names of the experts modules."""
    names = []
    for name, module in model.named_modules():
        if is_experts_module(module):
            plan(module)
            _call_dtype(module)
            names.append(name)
    return names


hf_moe.ExpertsInterface.register(NAME, experts_forward)
