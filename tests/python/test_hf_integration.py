"""mok inside Hugging Face Transformers (mok.integrations.transformers): "mok" experts.

Skipped visibly where Transformers is not installed (CI does not install it: pip install
.[transformers]); the first test (import mok never imports Transformers) always runs.

- Every experts class of the installed Transformers (@use_experts_implementation, enumerated from
  transformers.models) is built small on the CPU: where mok runs it, its "mok" forward and
  backward are compared with its own eager forward on the same inputs (float64: mok's exact mode,
  tolerance of fp64 summation order; bf16: both against the float64 eager of the same values,
  tolerances derived from bf16 rounding, conftest.py); where mok refuses it, the first call
  raises mok's error naming the reason, never computing something else.
- The issue's families as whole tiny models (2 layers, H 128, I 64, 8 experts, top-2, odd token
  counts): logits, loss and the experts' weight gradients against eager; a short training run
  following eager's curve; state_dict untouched; the refusals by name.
- CUDA (skipped without a GPU): the same module comparison on the GPU layer at larger shapes,
  torch.compile(fullgraph=True) and CUDA-graph capture of a decoder layer.
"""

import contextlib
import importlib
import importlib.util
import inspect
import math
import pkgutil
import subprocess
import sys

import pytest
import torch
from conftest import (DEVICES, F64_TOLERANCE, GRAD_TOLERANCE, OUT_TOLERANCE, SEED,
                      TRANSFORMERS_SKIP_REASON, rel_error, requires_cuda)

import mok

HAVE_TRANSFORMERS = TRANSFORMERS_SKIP_REASON is None  # installed, and new enough for mok
requires_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS,
    reason=f"{TRANSFORMERS_SKIP_REASON}: the Hugging Face integration's tests not run")


def test_import_mok_leaves_transformers_alone():
    code = ("import sys, mok, mok.functional, mok.ops, mok.integrations\n"
            "assert 'transformers' not in sys.modules, 'import mok imported transformers'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


if HAVE_TRANSFORMERS:
    import transformers
    import transformers.models
    from transformers import AutoConfig, AutoModelForCausalLM

    import mok.integrations.transformers as mok_hf
    from mok import _layer_ops
else:  # the parametrizations below stay empty
    mok_hf = None

# The families, as the model_type of their causal LM (qwen3_5_moe's is its text model).
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "olmoe", "minimax",
            "qwen3_5_moe_text"]

# Small sizes for any family's config: only the fields a config has are set. H 128, I 64 (the
# routed experts; 128 for dense MLPs and mixtral-style experts), 8 experts, top-2, 2 layers.
SIZES = dict(vocab_size=128, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, num_experts=8, num_local_experts=8,
             n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             n_group=1, topk_group=1, first_k_dense_replace=0, decoder_sparse_step=1,
             mlp_only_layers=[], max_position_embeddings=128, kv_lora_rank=32, q_lora_rank=64,
             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)
T_ODD = 29  # tokens of the module tests


def has_field(config, name):
    """Whether `config` has the field. A heterogeneous config (per-layer fields, e.g. gemma4's
    head_dim) raises its own error for a global read of a per-layer field: it has it."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 (transformers' AmbiguousGlobalPerLayerAttributeError)
        return name in vars(config)


def small_config(config_class, **extra):
    """`config_class` with SIZES where it has the field (head_dim left to MLA configs, which
    derive it), `layer_types` cut to 2 layers keeping one of each kind (where it is a field, not
    a property derived from others, as jamba's)."""
    base = config_class()
    kw = {k: v for k, v in SIZES.items() if has_field(base, k)}
    if has_field(base, "qk_rope_head_dim"):
        kw.pop("head_dim", None)
    derived = isinstance(getattr(config_class, "layer_types", None), property)
    types = None if derived else getattr(base, "layer_types", None)
    if types:
        types = list(types)
        kinds = [types[0]] + [t for t in types if t != types[0]]
        kw["layer_types"] = kinds[:2] if len(kinds) > 1 else types[:2]
    kw.update(extra)
    return config_class(**kw)


# The fields an experts module reads for its shapes. A family whose architecture validators
# reject SIZES as a whole (attention heads that must match, an indexer's layer plan, a rope
# section summing to its head dim) gets its default config with only these set small.
EXPERT_FIELDS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                 "num_local_experts", "n_routed_experts", "moe_num_experts",
                 "num_experts_per_tok")


def experts_sized_config(config_class):
    """The default `config_class` (its text_config, if composite) with EXPERT_FIELDS set small
    after construction; a field holding a list (ernie4_5_vl_moe's text and vision sizes) gets a
    list of the small size."""
    config = config_class()
    config = getattr(config, "text_config", None) or config
    for name in EXPERT_FIELDS:
        if has_field(config, name):
            old = vars(config).get(name)
            setattr(config, name, [SIZES[name]] * len(old) if isinstance(old, list)
                    else SIZES[name])
    return config


def tiny_model(model_type, dtype, **extra):
    torch.manual_seed(SEED % 2**31)
    config = small_config(type(AutoConfig.for_model(model_type)), **extra)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if mok_hf.is_experts_module(m)]


def experts_classes():
    """(family, experts class) for every @use_experts_implementation class in the installed
    Transformers' modeling modules (those that import here)."""
    found = []
    if not HAVE_TRANSFORMERS:
        return found
    for info in pkgutil.iter_modules(transformers.models.__path__):
        name = f"transformers.models.{info.name}.modeling_{info.name}"
        if importlib.util.find_spec(name) is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (a family with a missing optional dependency)
            continue
        for cls in vars(module).values():
            if (isinstance(cls, type) and issubclass(cls, torch.nn.Module)
                    and cls.__module__ == name and hasattr(cls, "_apply_gate")
                    and hasattr(cls.forward, "__wrapped__")):
                found.append((info.name, cls))
    return found


EXPERTS_CLASSES = experts_classes()


def experts_kwargs(cls):
    """An explicit `intermediate_size` argument of `cls` (ernie4_5_vl's text and vision experts,
    built from one config) gets the small size."""
    if "intermediate_size" in inspect.signature(cls.__init__).parameters:
        return {"intermediate_size": SIZES["moe_intermediate_size"]}
    return {}


def build_small_experts(family, cls, dtype=torch.float64):
    """An instance of `cls` from a small config of its family (each config class of the family
    and its text_config tried in turn; where SIZES fail a validator, the default config with
    EXPERT_FIELDS set small), its weights drawn uniform in +-1/sqrt(fan_in)."""
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    errors = []
    for config_class in [c for c in vars(configs).values() if isinstance(c, type)
                         and issubclass(c, transformers.PretrainedConfig)
                         and c.__module__ == configs.__name__]:
        try:
            try:
                config = small_config(config_class)
                config = getattr(config, "text_config", None) or config
            except Exception:  # noqa: BLE001 (an architecture validator rejects SIZES)
                config = experts_sized_config(config_class)
            config._experts_implementation = "eager"
            args, kwargs = (), experts_kwargs(cls)
            # On the meta device first: a config whose small form is still large (a composite
            # config's defaults) is not allocated.
            with torch.device("meta"):
                try:
                    cls(config, *args, **kwargs)
                except TypeError:  # classes that also take their layer's index
                    args = (0,)
                numel = sum(p.numel() for p in cls(config, *args, **kwargs).parameters())
            if numel > 2**24:
                raise ValueError(f"{numel} parameters at these sizes")
            module = cls(config, *args, **kwargs).to(dtype)
        except Exception as e:  # noqa: BLE001 (the next config class of the family)
            errors.append(f"{config_class.__name__}: {type(e).__name__}: {e}")
            continue
        if any(p.numel() == 0 for p in module.parameters()):
            errors.append(f"{config_class.__name__}: empty parameters")
            continue
        gen = torch.Generator().manual_seed(SEED % 2**31)
        with torch.no_grad():
            for p in module.parameters():
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound)
        return module
    pytest.skip(f"{cls.__name__}: no small instance from {family}'s configs (not a mok "
                f"question: the family's own constructor): {errors}")


def routing(gen, T, E, k, dtype):
    """Distinct experts per token (as a top-k gives them), positive weights summing to 1."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, dtype=torch.float64) + 0.1
    return ids, (w / w.sum(dim=1, keepdim=True)).to(dtype)


def run_experts(module, implementation, x, ids, w, d_out):
    """The module's output and the gradients of x, top_k_weights, gate_up_proj, down_proj."""
    module.zero_grad(set_to_none=True)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if implementation == "eager":
        out = type(module).forward.__wrapped__(module, x, ids, w)
    else:
        module.config._experts_implementation = implementation
        out = module(x, ids, w)
    out.backward(d_out)
    return (out.detach(), x.grad, w.grad, module.gate_up_proj.grad.clone(),
            module.down_proj.grad.clone())


NAMES = ("output", "d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")


def compare_module(module, dtype, device="cpu", T=T_ODD):
    """mok against eager on one experts module: float64 both ways (tight), or bf16 mok and bf16
    eager each against the float64 eager of the same values (derived tolerances)."""
    gen = torch.Generator().manual_seed(SEED % 2**31)
    E, _, H = module.gate_up_proj.shape
    k = 2
    ids, w = routing(gen, T, E, k, torch.float64)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    d_out = torch.randn(T, H, generator=gen, dtype=torch.float64)
    module.to(device, dtype)
    args = [t.to(device) for t in (x.to(dtype), ids, w.to(dtype), d_out.to(dtype))]
    state = {n: t.clone() for n, t in module.state_dict().items()}
    got = run_experts(module, "mok", *args)
    after = module.state_dict()
    assert list(after) == list(state)
    for n, t in state.items():  # keys, shapes and values untouched by a call
        assert after[n].shape == t.shape and torch.equal(after[n], t), n
    exact = module.to("cpu", torch.float64)
    want = run_experts(exact, "eager", *[t.to("cpu", torch.float64) if t.is_floating_point()
                                         else t.cpu() for t in args])
    # A family whose gate function computes in fp32 whatever the model's dtype (e.g. beam's
    # _apply_gate) differs from mok's float64 exact mode by fp32 rounding: u32 = 2^-24 per store,
    # about four on the longest gradient path.
    f64 = F64_TOLERANCE if gate_is_float64(exact) else 8 * 2.0**-24
    tolerances = ((f64,) * 5 if dtype == torch.float64
                  else (OUT_TOLERANCE,) + (GRAD_TOLERANCE,) * 4)
    for name, g, r, tol in zip(NAMES, got, want, tolerances):
        err = rel_error(g, r)
        assert err <= tol, f"seed {SEED}: {type(module).__name__} {name}: {err:.3g} > {tol:.3g}"


def gate_is_float64(module):
    """Whether the module's gate function keeps float64 (its result is silu(g) * u to fp64
    rounding, or its clamped form's)."""
    g = torch.linspace(-6, 6, 64, dtype=torch.float64)
    u = g.flip(0)
    interleaved = not getattr(module, "is_concatenated", True)
    packed = (torch.stack((g, u), -1).reshape(1, 128) if interleaved
              else torch.cat((g, u)).reshape(1, 128))
    with torch.no_grad():
        got = module._apply_gate(packed).reshape(64)
    limit = mok_hf.plan(module).swiglu_limit
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return bool(((got - torch.nn.functional.silu(g) * u).abs() <= 1e-12).all())


def refusal_of(module):
    """mok's error message for `module`, or None where mok runs it."""
    return mok_hf.unsupported_reason(module)


# ---- registration ------------------------------------------------------------------------------


@requires_transformers
def test_registered_in_the_experts_interface():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["mok"] is mok_hf.experts_forward
    model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok")
    assert model.config._experts_implementation == "mok"
    model.set_experts_implementation("eager")
    assert model.config._experts_implementation == "eager"
    model.set_experts_implementation("mok")
    assert model.config._experts_implementation == "mok"
    assert [n for n, _ in experts_modules(model)] == mok_hf.check(model)


# ---- every experts class of the installed Transformers -----------------------------------------


@requires_transformers
def test_family_report():
    """Which experts classes mok runs and which it refuses, and why (shown with -s)."""
    runs, refused = [], []
    unbuilt = []
    for family, cls in EXPERTS_CLASSES:
        try:
            reason = refusal_of(build_small_experts(family, cls))
        except pytest.skip.Exception as e:
            unbuilt.append((family, cls.__name__, str(e)))
            continue
        (runs if reason is None else refused).append((family, cls.__name__, reason))
    print(f"\nTransformers {transformers.__version__}: {len(runs)} experts classes run on mok, "
          f"{len(refused)} refused, {len(unbuilt)} not built small here")
    for family, name, _ in runs:
        print(f"  runs     {family:24s} {name}")
    for family, name, reason in refused:
        print(f"  refused  {family:24s} {name}: {reason}")
    for family, name, why in unbuilt:
        print(f"  unbuilt  {family:24s} {name}: {why}")
    ran = {family for family, _, _ in runs}
    for family in FAMILIES:
        assert family.removesuffix("_text") in ran, f"{family} does not run on mok"
    assert all(reason.startswith("mok: invalid ") for _, _, reason in refused)


@requires_transformers
@pytest.mark.parametrize("family,cls", EXPERTS_CLASSES,
                         ids=[f"{f}.{c.__name__}" for f, c in EXPERTS_CLASSES])
def test_experts_class(family, cls):
    module = build_small_experts(family, cls)
    reason = refusal_of(module)
    if reason is not None:
        # Refused: the first call raises mok's error naming the reason (no silent fallback).
        x = torch.zeros(3, module.config.hidden_size, dtype=torch.float64)
        module.config._experts_implementation = "mok"
        module.__dict__.pop("_mok_plan", None)
        with pytest.raises((ValueError, TypeError)) as e:
            module(x, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2, dtype=torch.float64))
        assert str(e.value) == reason
        return
    compare_module(module, torch.float64)
    compare_module(module, torch.bfloat16)


# ---- the families as whole models ------------------------------------------------------


def model_step(model, implementation, ids, routing=None, autocast=False):
    """Logits, loss and parameter gradients of one step. `routing`: None, or a dict that the step
    fills with every experts module's top_k_index when empty and, when filled, imposes on the
    step (see pinned_routing). `autocast`: the forward under torch.autocast(dtype=bf16)."""
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    with pinned_routing(model, routing), torch.autocast(ids.device.type, dtype=torch.bfloat16,
                                                        enabled=autocast):
        out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@contextlib.contextmanager
def pinned_routing(model, routing):
    """Records (routing empty) or imposes (filled) each experts module's expert choices.

    In bf16 two implementations' outputs differ by a rounding, and a later layer's router may then
    pick another expert for a token whose two best scores lie within that rounding: a whole row of
    a different function, a heavy tail in the logits' error that more rows do not average away
    (over 30 draws of the deepseek_v3 model, 0.005-0.006 without a flip and up to 0.05 with one;
    2026-12-07, torch 2.11). Imposing the first run's choices on the second leaves the rounding
    alone; the router weights still come from each run's own router, with their gradients."""
    if routing is None:
        yield
        return
    record = not routing

    def hook(name):
        def pre_hook(module, args, kwargs):
            given = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
            if record:
                routing[name] = given.detach().clone()
                return None
            pinned = routing[name]
            assert pinned.shape == given.shape, name
            if "top_k_index" in kwargs:
                return args, {**kwargs, "top_k_index": pinned}
            return (args[0], pinned, *args[2:]), kwargs
        return pre_hook

    handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True)
               for n, m in experts_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@requires_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_float64(family):
    """The exact mode: logits, loss and every parameter's gradient as eager's (fp64 order)."""
    model = tiny_model(family, torch.float64)
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(SEED % 2**31))
    logits_e, loss_e, grads_e = model_step(model, "eager", ids)
    logits_m, loss_m, grads_m = model_step(model, "mok", ids)
    assert rel_error(logits_m, logits_e) <= F64_TOLERANCE
    assert abs(float(loss_m) - float(loss_e)) <= F64_TOLERANCE * abs(float(loss_e))
    assert grads_m.keys() == grads_e.keys()
    for name in grads_e:
        # Gradients pass through a few layers of sums: a few times the one-layer bound.
        assert rel_error(grads_m[name], grads_e[name]) <= 100 * F64_TOLERANCE, name


@requires_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_bf16(family):
    """bf16: the whole model against eager, with eager's expert choices (pinned_routing: a routing
    tie would make the models' outputs differ by whole rows); the experts modules compare more
    strictly (test_experts_class)."""
    model = tiny_model(family, torch.bfloat16)
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(SEED % 2**31))
    expect_same_step(model, ids, "eager")


def expect_same_step(model, ids, baseline):
    """One step of `model` with `baseline`'s experts and with mok's, mok's under the expert choices
    of the first (pinned_routing): logits, loss and the experts' weight gradients within bf16
    bounds."""
    routing = {}
    logits_e, loss_e, grads_e = model_step(model, baseline, ids, routing)
    assert len(routing) == len(experts_modules(model)) > 0
    logits_m, loss_m, grads_m = model_step(model, "mok", ids, routing)
    # The logits' own bf16 rounding (2^-9) and every layer's, which the two paths do differently:
    # 0.002-0.006 measured over 12-30 draws of each family (2026-12-07, torch 2.11 and 2.15).
    assert rel_error(logits_m, logits_e) <= 4 * 2.0**-8
    assert abs(float(loss_m) - float(loss_e)) <= 2.0**-8 * float(loss_e)
    # The experts' weight gradients within the bf16 gradient bound (conftest): 0.005-0.009
    # measured over 6 draws of each family against eager (2026-12-07, torch 2.11). A gradient
    # off by a factor (or an unwritten one) fails here; finiteness alone did not see it.
    for name, _ in experts_modules(model):
        for param in ("gate_up_proj", "down_proj"):
            key = f"{name}.{param}"
            assert rel_error(grads_m[key], grads_e[key]) <= GRAD_TOLERANCE, \
                (key, rel_error(grads_m[key], grads_e[key]))


@requires_transformers
@pytest.mark.parametrize("family,dtype,tolerance", [("qwen3_moe", torch.float64, 1e-9),
                                                    ("deepseek_v3", torch.float64, 1e-9),
                                                    ("qwen3_moe", torch.bfloat16, 0.03)])
def test_training_follows_eager(family, dtype, tolerance):
    """A short AdamW run: mok's loss curve on eager's (float64: to summation order; bf16: within
    a few percent, the rounding of the two paths compounding over the steps)."""
    ids = torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(SEED % 2**31))
    expect_same_loss_curve(lambda: tiny_model(family, dtype), ids, "eager", tolerance)


def expect_same_loss_curve(make_model, ids, baseline, tolerance):
    """Eight AdamW steps of a fresh model from make_model() with `baseline`'s experts, then with
    mok's: mok's loss falls, and each step's loss is within `tolerance` (relative) of baseline's."""
    curves = {}
    for implementation in (baseline, "mok"):
        model = make_model()
        model.set_experts_implementation(implementation)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(8):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        curves[implementation] = losses
    assert curves["mok"][-1] < curves["mok"][0], curves
    for e, m in zip(curves[baseline], curves["mok"]):
        assert abs(m - e) <= tolerance * e, curves


@requires_transformers
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_is_the_plain_step(family, device):
    """model.gradient_checkpointing_enable(), as fine-tuning scripts call it: the experts rerun
    on mok in the backward, and the loss, the logits and every gradient (the router's auxiliary
    loss included, where the family has one) are the plain step's bit for bit."""
    extra = {"output_router_logits": True} if family == "qwen3_moe" else {}
    model = tiny_model(family, torch.bfloat16, **extra).to(device)
    model.train()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(SEED % 2**31))
    ids = ids.to(device)
    plain = model_step(model, "mok", ids)
    # Transformers 5.25 renamed the call and the property (the old names warn); 5.7 has only
    # the old ones.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    checkpointed = model_step(model, "mok", ids)
    assert torch.equal(checkpointed[0], plain[0]) and torch.equal(checkpointed[1], plain[1])
    assert checkpointed[2].keys() == plain[2].keys()
    for name, grad in plain[2].items():
        assert torch.equal(checkpointed[2][name], grad), f"seed {SEED}: {name}"


@requires_transformers
def test_exit_after_a_model_ran_reports_no_leak():
    """A script that ran a model on mok exits without nanobind's leak report: the shared
    workspaces' C++ workspaces are freed at exit (mok/_workspace.py), not after the extension's
    teardown, where the report listed them."""
    code = ("import torch, mok.integrations.transformers\n"
            "from transformers import Qwen3MoeConfig, AutoModelForCausalLM\n"
            "cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=128,\n"
            "    moe_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,\n"
            "    num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2)\n"
            "model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,\n"
            "                                         experts_implementation='mok')\n"
            "model(torch.randint(0, 128, (2, 5))).logits.sum().backward()\n"
            "print(len(mok._workspace.automatic()._cores) > 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True", proc.stdout  # a C++ workspace existed at exit
    assert "leaked" not in proc.stderr, proc.stderr


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install .[transformers])")
def test_older_transformers_refused_at_import_naming_it():
    """Before 5.7.0 Transformers refuses a registered experts_implementation by name (measured
    with 5.0.0 to 5.6.2), so mok's integration refuses to load there, naming the version. Runs
    with any Transformers: the version is replaced before the integration's import."""
    assert mok.TRANSFORMERS_MINIMUM == (5, 7)
    code = ("import transformers\n"
            "transformers.__version__ = {!r}\n"
            "try:\n"
            "    import mok.integrations.transformers\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    print('imported')\n")
    for version, expected in [
            ("5.6.2", "mok: invalid transformers version: expected 5.7 or newer, got 5.6.2"),
            ("5.0.0", "mok: invalid transformers version: expected 5.7 or newer, got 5.0.0"),
            ("4.57.6", "mok: invalid transformers version: expected 5.7 or newer, got 4.57.6"),
            ("5.7.0", "imported"), ("5.26.0.dev0", "imported"), ("6.0.0", "imported")]:
        proc = subprocess.run([sys.executable, "-c", code.format(version)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected, (version, proc.stdout)


def experts_of(family):
    for fam, cls in EXPERTS_CLASSES:
        if fam == family:
            return build_small_experts(fam, cls)
    pytest.skip(f"no {family} experts class in Transformers {transformers.__version__}")


@requires_transformers
@pytest.mark.parametrize("family,reason", [
    ("gpt_oss", ("has_bias", "expected False (mok's experts have no bias), got True")),
    ("aria", ("is_transposed", "expected False: gate_up_proj [E, 2I, H]")),
    ("nemotron_h", ("has_gate", "expected True (SwiGLU experts")),
    ("muse_spark", ("has_post_expert_norm", "expected False")),
    ("gemma4", ("gate function", "expected silu(gate) * up (SwiGLU)", "act_fn GELUTanh")),
])
def test_refused_forms(family, reason):
    message = refusal_of(experts_of(family))
    assert message is not None and all(r in message for r in reason), message


@requires_transformers
@pytest.mark.parametrize("extra,reason", [
    (dict(hidden_act="gelu"), ("gate function", "expected silu(gate) * up", "act_fn GELU")),
    (dict(moe_intermediate_size=96), ("intermediate size", "multiple of 64", "got 96")),
    (dict(hidden_size=160, head_dim=40), ("hidden size", "multiple of 64", "got 160")),
])
def test_refused_at_first_call_and_by_check(extra, reason):
    model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok", **extra)
    ids = torch.randint(0, 128, (1, 7))
    with pytest.raises(ValueError, match=r"mok: invalid Qwen3MoeExperts ") as e:
        model(ids)
    assert all(r in str(e.value) for r in reason), str(e.value)
    with pytest.raises(ValueError, match=r"mok: invalid Qwen3MoeExperts "):
        mok_hf.check(model)
    model.set_experts_implementation("eager")  # the model itself still works
    assert torch.isfinite(model(ids).logits).all()


@requires_transformers
def test_fp32_weights_need_autocast():
    model = tiny_model("qwen3_moe", torch.float32, experts_implementation="mok")
    assert mok_hf.check(model)  # they run under autocast
    with pytest.raises(TypeError, match=r"mok: invalid Qwen3MoeExperts gate_up_proj.dtype "
                       r"\(experts_implementation='mok'\): expected bfloat16 \(or float64, the "
                       r"exact mode\), or float32 under torch.autocast\(dtype=torch.bfloat16\): "
                       r"convert the model, e.g. model.to\(torch.bfloat16\), got float32"):
        model(torch.randint(0, 128, (1, 5)))
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(
            TypeError, match=r"mok: invalid Qwen3MoeExperts autocast dtype \(experts_implementation"
            r"='mok'\): expected torch.bfloat16 \(mok's layer computes in bf16\), got "
            r"torch.float16"):
        model(torch.randint(0, 128, (1, 5)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(torch.randint(0, 128, (1, 5))).logits).all()
    model.to(torch.bfloat16)  # converted, it runs
    assert torch.isfinite(model(torch.randint(0, 128, (1, 5))).logits).all()


@requires_transformers
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_autocast_over_an_fp32_model(family, device):
    """An fp32 model under torch.autocast(dtype=bf16) (what Trainer(bf16=True) runs when the model
    was loaded in fp32): mok casts the experts' weights and hidden states to bf16 per call, as
    autocast casts them for eager's linear layers, and returns fp32 hidden states, with fp32
    gradients for the fp32 weights. Against eager under the same autocast, with eager's expert
    choices (pinned_routing), within the bf16 model's bounds (test_whole_model_bf16)."""
    model = tiny_model(family, torch.float32).to(device)
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(SEED % 2**31))
    ids = ids.to(device)
    routing = {}
    logits_e, loss_e, grads_e = model_step(model, "eager", ids, routing, autocast=True)
    logits_m, loss_m, grads_m = model_step(model, "mok", ids, routing, autocast=True)
    assert logits_m.dtype == logits_e.dtype
    assert rel_error(logits_m, logits_e) <= 4 * 2.0**-8
    assert abs(float(loss_m) - float(loss_e)) <= 2.0**-8 * float(loss_e)
    assert grads_m.keys() == grads_e.keys()
    for name, module in experts_modules(model):
        for w in ("gate_up_proj", "down_proj"):
            got, want = grads_m[f"{name}.{w}"], grads_e[f"{name}.{w}"]
            assert got.dtype == torch.float32
            assert rel_error(got, want) <= GRAD_TOLERANCE, f"seed {SEED}: {name}.{w}"


@requires_transformers
def test_configure():
    with pytest.raises(ValueError, match=r"mok: invalid precision: expected 'bf16', 'fp8' or "
                       r"'fp8-bf16-wgrad', got 'fp4'"):
        mok_hf.configure(precision="fp4")
    with pytest.raises(TypeError, match="mok: invalid config: expected None"):
        mok_hf.configure(config=3)
    import mok.functional as mf
    mok_hf.configure(mf.MoKConfig(minibatch_size=256))
    try:
        model = tiny_model("qwen3_moe", torch.float64, experts_implementation="mok")
        assert torch.isfinite(model(torch.randint(0, 128, (1, 9))).logits).all()
    finally:
        mok_hf.configure()


@requires_transformers
def test_expert_parallel_sentinels_are_unused_slots():
    """Transformers' expert parallelism marks other ranks' experts with ids >= num_experts: mok
    treats them as unused slots (-1), as eager's sentinel handling does (no output, no
    gradient)."""
    module = experts_of("qwen3_moe")
    module._is_expert_parallel = True
    E = module.gate_up_proj.shape[0]
    gen = torch.Generator().manual_seed(SEED % 2**31)
    ids, w = routing(gen, 9, E, 2, torch.float64)
    x = torch.randn(9, module.gate_up_proj.shape[2], generator=gen, dtype=torch.float64)
    sentinel = ids.clone()
    sentinel[::3, 1] = E  # a slot on another rank
    kept = ids.clone()
    kept[::3, 1] = 0
    w_kept = w.clone()
    w_kept[::3, 1] = 0.0
    module.config._experts_implementation = "mok"
    d_out = torch.randn(9, x.shape[1], generator=gen, dtype=torch.float64)
    results = []
    for top_k_index, top_k_weights in ((sentinel, w), (kept, w_kept)):
        module.zero_grad(set_to_none=True)
        x_, w_ = x.clone().requires_grad_(), top_k_weights.clone().requires_grad_()
        out = module(x_, top_k_index, w_)
        out.backward(d_out)
        results.append((out.detach(), x_.grad, w_.grad, module.gate_up_proj.grad.clone(),
                        module.down_proj.grad.clone()))
    (out, d_x, d_w, d_gu, d_d), (ref, ref_x, ref_w, ref_gu, ref_d) = results
    assert torch.equal(out, ref)
    assert torch.equal(d_x, ref_x) and torch.equal(d_gu, ref_gu) and torch.equal(d_d, ref_d)
    # The sentinel slots get no gradient; the others the same as with the slots dropped.
    assert bool((d_w[::3, 1] == 0).all())
    other = torch.ones_like(d_w, dtype=torch.bool)
    other[::3, 1] = False
    assert torch.equal(d_w[other], ref_w[other])


@requires_transformers
def test_compile_fullgraph_of_a_moe_block():
    """torch.compile(fullgraph=True) of a MoE block (router, mok's experts) traces mok's custom
    ops (CPU: aot_eager; the GPU test compiles with inductor): the same bits as eager."""
    model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok")
    mok_hf.check(model)  # checked before tracing
    block = model.model.layers[0].mlp
    x = torch.randn(2, 17, 128, dtype=torch.bfloat16, requires_grad=True)
    ref = block(x)
    ref.float().square().sum().backward()
    d_ref, x.grad = x.grad, None
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    out.float().square().sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, d_ref)


@requires_transformers
def test_compile_needs_a_checked_module():
    model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok")
    block = model.model.layers[0].mlp
    with pytest.raises(Exception, match="checked before torch.compile traces it"):
        torch.compile(block, fullgraph=True, backend="aot_eager")(
            torch.randn(1, 5, 128, dtype=torch.bfloat16))


# ---- CUDA (the GPU layer) ----------------------------------------------------------------------


@requires_transformers
@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_experts_module(family):
    """The GPU layer on each family's experts (bf16), against the float64 eager of the same
    values, at the small shape and at H 1024, I 512, 32 experts, T 1001."""
    module = next(m for _, m in experts_modules(tiny_model(family, torch.bfloat16)))
    compare_module(module, torch.bfloat16, device="cuda")
    model = tiny_model(family, torch.bfloat16, hidden_size=1024, moe_intermediate_size=512,
                       intermediate_size=512, num_experts=32, num_local_experts=32,
                       n_routed_experts=32, num_hidden_layers=2)  # = len(layer_types)
    module = next(m for _, m in experts_modules(model))
    compare_module(module, torch.bfloat16, device="cuda", T=1001)


@requires_transformers
@requires_cuda
def test_gpu_whole_model_and_training():
    """On the GPU against Transformers' default experts ("grouped_mm"): one step's logits, loss and
    experts' gradients with the same expert choices (pinned_routing), within the CPU test's bf16
    bounds (test_whole_model_bf16); then a short AdamW run on grouped_mm's loss curve
    (test_training_follows_eager's bf16 bound)."""
    gen = torch.Generator().manual_seed(SEED % 2**31)
    ids = torch.randint(0, 128, (4, 33), generator=gen).cuda()
    expect_same_step(tiny_model("qwen3_moe", torch.bfloat16).cuda(), ids, "grouped_mm")
    expect_same_loss_curve(lambda: tiny_model("qwen3_moe", torch.bfloat16).cuda(), ids,
                           "grouped_mm", 0.03)


@requires_transformers
@requires_cuda
def test_gpu_compile_and_graph_capture_of_a_decoder_layer():
    model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok").cuda()
    mok_hf.check(model)  # checked before tracing (the check runs Python on the CPU)
    layer = model.model.layers[0].mlp
    x = torch.randn(2, 17, 128, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    # aot_eager: mok's op traced into one graph gives eager's bits. Inductor (the default backend)
    # fuses the router's cast of its top-k weights to bf16 into fp32 code without the rounding
    # (unless emulate_precision_casts), so mok receives other routing weights: close, not equal.
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), eager)
    assert rel_error(torch.compile(layer, fullgraph=True)(x), eager) <= OUT_TOLERANCE
    static_x = x.clone()
    layer(static_x)  # the shape's workspace exists before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


@requires_transformers
@pytest.mark.parametrize("device", DEVICES)
def test_set_is_first_microbatch_quantizes_once_a_step(device, quantizations):
    """Gradient accumulation in FP8 over experts weights another tensor's memory holds (as under
    FSDP2): by default every micro-batch quantizes each module's three weights (gate half, up
    half, down) again; after set_is_first_microbatch(model, True) for the first and False for
    the others, only the first does. Logits and accumulated gradients are bit for bit the
    default's."""
    mok_hf.configure(precision="fp8")
    try:
        model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok",
                           moe_intermediate_size=128).to(device)
        experts = experts_modules(model)
        aliases = [t.data for _, m in experts for t in (m.gate_up_proj, m.down_proj)]  # noqa: F841
        gen = torch.Generator().manual_seed(SEED % 2**31)
        batches = [torch.randint(0, 128, (2, T), generator=gen).to(device) for T in (9, 5, 13)]

        def accumulate(flags):
            model.zero_grad(set_to_none=True)
            logits, made = [], []
            for ids, flag in zip(batches, flags):
                assert len(mok_hf.set_is_first_microbatch(model, flag)) == len(experts)
                before = quantizations.calls
                out = model(ids).logits
                made.append(quantizations.calls - before)
                out.float().square().mean().backward()
                logits.append(out.detach())
            return logits, made, [p.grad.clone() for p in model.parameters()]

        want, made, want_grads = accumulate([None] * 3)
        assert made == [3 * len(experts)] * 3, made
        got, made, grads = accumulate([True, False, False])
        assert made == [3 * len(experts), 0, 0], made
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"micro-batch {i}"
        for (name, _), a, b in zip(model.named_parameters(), grads, want_grads):
            assert torch.equal(a, b), name
        with pytest.raises(TypeError, match="invalid is_first_microbatch: expected None, True "
                           "or False, got int"):
            mok_hf.set_is_first_microbatch(model, 1)
        mok_hf.set_is_first_microbatch(model, None)  # also frees what True kept
        mok_hf.set_is_first_microbatch(model, False)
        with pytest.raises(ValueError, match="invalid is_first_microbatch: expected True at an "
                           "earlier call"):
            model(batches[0])
        mok_hf.set_is_first_microbatch(model, None)
    finally:
        mok_hf.configure()


@requires_transformers
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_precision_runs_moks_fp8_layer_on_the_halves(device):
    """configure(precision="fp8"): each experts call is mok's FP8 layer over views of gate_up_proj
    (the same bits as mok.moe's on its halves), gradients land in the model's own parameters, and
    an intermediate size that is not a multiple of 128 is refused naming it."""
    mok_hf.configure(precision="fp8")
    try:
        model = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok",
                           moe_intermediate_size=128).to(device)
        logits = model(torch.randint(0, 128, (2, 9), device=device)).logits
        logits.float().square().mean().backward()
        for name, module in experts_modules(model):
            for p in (module.gate_up_proj, module.down_proj):
                assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name
        _, module = experts_modules(model)[0]
        gen = torch.Generator().manual_seed(SEED % 2**31)
        E, I2, H = module.gate_up_proj.shape
        x = torch.randn(11, H, generator=gen).bfloat16().to(device)
        ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(11)]).to(device)
        w = torch.rand(11, 2, generator=gen).to(device)
        with torch.no_grad():
            got = module(x, ids, w.to(x.dtype))
            gate, up = _layer_ops.split_gate_up(module.gate_up_proj,
                                                mok_hf.plan(module).interleaved)
            want = mok.moe(x, ids, w.to(x.dtype).float(), gate.contiguous(), up.contiguous(),
                           module.down_proj, precision="fp8")
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        small = tiny_model("qwen3_moe", torch.bfloat16, experts_implementation="mok").to(device)
        with pytest.raises(ValueError, match="intermediate_size: expected a multiple of 128 for "
                           "precision='fp8', got 64"):
            small(torch.randint(0, 128, (1, 5), device=device))
    finally:
        mok_hf.configure()
