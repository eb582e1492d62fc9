"""Bad calls as an adversarial user makes them (issue 41): each case raises mok's error naming the
argument, the expected and the actual value (or, where documented, computes a defined result
without reading or writing out of bounds), and the next good call still gives the good call's
bits. CPU tensors here; the CUDA forms of the cases that differ on the GPU are in test_gpu.py.
"""

import dataclasses
import pickle
import re

import pytest
import torch
from conftest import make_layer, requires_cuda

import mok
from mok import functional

T, H, I, E, K, S = 6, 64, 64, 4, 2, 64


def raises(error, message):
    return pytest.raises(error, match=re.escape(message))


class Layer:
    """One layer through mok.functional, and its good results (forward and backward) to compare
    every later good call with."""

    def __init__(self, data, swiglu_limit=None):
        self.data, self.limit = data, swiglu_limit
        self.config = functional.MoKConfig()
        self.ws = functional.create_workspace(self.config, None, device=data.x.device,
                                              num_local_tokens=T, hidden_size=H, topk=K)
        self.schedule = self.build_schedule(data.topk_experts)
        self.want = self.step()

    def build_schedule(self, ids):
        return functional.build_schedule(self.ws, self.config, ids, num_local_experts=E)

    def args(self, **replace):
        """forward's arguments (MoK's order), some replaced by name."""
        g, u, d, sg, su, sd = self.data.weights
        args = dict(x=self.data.x, router_weights=self.data.topk_weights, shared_gate_weights=sg,
                    shared_up_weights=su, shared_down_weights=sd, routed_gate_weights=g,
                    routed_up_weights=u, routed_down_weights=d)
        args.update(replace)
        return args

    def forward(self, schedule=None, swiglu_limit="layer", **replace):
        return functional.forward(self.config, self.ws, schedule or self.schedule,
                                  **self.args(**replace), swiglu_limit=self._limit(swiglu_limit))

    def recompute(self, schedule=None, swiglu_limit="layer", **replace):
        args = self.args(**replace)
        for unused in ("router_weights", "shared_down_weights", "routed_down_weights"):
            del args[unused]
        return functional.recompute_forward_context(self.config, self.ws,
                                                    schedule or self.schedule, **args,
                                                    swiglu_limit=self._limit(swiglu_limit))

    def backward(self, ctx, schedule=None, swiglu_limit="layer", **replace):
        return functional.backward(self.config, self.ws, schedule or self.schedule, ctx,
                                   self.data.d_out, **self.args(**replace),
                                   swiglu_limit=self._limit(swiglu_limit))

    def _limit(self, value):
        return self.limit if value == "layer" else value

    def step(self):
        out, ctx = self.forward()
        return out, self.backward(ctx)

    def assert_good(self):
        """A good forward and backward now: the first good call's bits."""
        out, grads = self.step()
        assert torch.equal(out, self.want[0]), "out"
        for i, (a, b) in enumerate(zip(grads, self.want[1])):
            assert (a is None and b is None) or torch.equal(a, b), f"gradient {i}"


@pytest.fixture
def layer(gen):
    return Layer(make_layer(gen, T, H, I, E, K, S))


def _copy(t):
    return t.detach().clone()


# --- mok.functional.backward and the forward context it is given ----------------------------

def test_backward_without_the_forwards_swiglu_limit(gen):
    """MoK's API passes the limit on every call: forgetting it in backward is the easiest
    mistake. The context remembers it."""
    layer = Layer(make_layer(gen, T, H, I, E, K, S), swiglu_limit=0.3)
    _, ctx = layer.forward()
    with raises(ValueError, "mok: invalid swiglu_limit: expected 0.3 (the swiglu_limit of the "
                            "forward that made the forward context), got None"):
        layer.backward(ctx, swiglu_limit=None)
    with raises(ValueError, "mok: invalid swiglu_limit: expected 0.3 (the swiglu_limit of the "
                            "forward that made the forward context), got 0.5"):
        layer.backward(ctx, swiglu_limit=0.5)
    layer.assert_good()


@pytest.mark.parametrize("argument", ["x", "router_weights", "routed_gate_weights",
                                      "routed_down_weights", "shared_up_weights"])
def test_context_of_other_tensors(layer, argument):
    """A context computed from other tensors (equal values, other memory: the forward of another
    layer or another step) is refused, naming the argument."""
    _, ctx = layer.forward()
    other = _copy(layer.args()[argument])
    with raises(ValueError, f"mok: invalid {argument}: expected the {argument} of the forward "
                            "that made the forward context, got another tensor"):
        layer.backward(ctx, **{argument: other})
    _, other_ctx = layer.forward(**{argument: other})
    with raises(ValueError, f"mok: invalid {argument}: expected the {argument} of the forward"):
        layer.backward(other_ctx)
    layer.assert_good()


def test_context_of_recompute_on_another_x(layer):
    ctx = layer.recompute(x=_copy(layer.data.x))
    with raises(ValueError, "mok: invalid x: expected the x of the recompute_forward_context "
                            "that made the forward context, got another tensor"):
        layer.backward(ctx)
    # recompute_forward_context reads neither router weights nor down weights, so its context
    # does not tie them: backward reads its own (here equal values in other memory).
    ctx = layer.recompute()
    grads = layer.backward(ctx, router_weights=_copy(layer.data.topk_weights),
                           routed_down_weights=_copy(layer.data.weights[2]))
    for a, b in zip(grads, layer.want[1]):
        assert torch.equal(a, b)
    layer.assert_good()


def test_schedule_for_other_ids(layer):
    _, ctx = layer.forward()
    other_ids = torch.roll(layer.data.topk_experts, 1, dims=0)
    with raises(ValueError, "mok: invalid schedule: expected the schedule of the forward that "
                            "made the forward context, got another schedule"):
        layer.backward(ctx, schedule=layer.build_schedule(other_ids))
    layer.assert_good()


def test_ids_edited_in_place_between_forward_and_backward(layer):
    """The schedule holds the caller's int64 ids (it aliases them): an in-place edit after the
    forward would make backward route the gradients elsewhere."""
    ids = layer.data.topk_experts.clone()
    schedule = layer.build_schedule(ids)
    assert schedule.topk_experts is ids
    _, ctx = layer.forward(schedule=schedule)
    saved = ids.clone()
    ids[0, 0] = (int(ids[0, 0]) + 1) % E
    with raises(ValueError, "mok: invalid schedule.topk_experts: expected the "
                            "schedule.topk_experts of the forward that made the forward context, "
                            "unchanged since, got the same tensor changed in place since "
                            "(version 0 then, 1 now)"):
        layer.backward(ctx, schedule=schedule)
    ids.copy_(saved)  # the values restored: still changed since the forward (the version says)
    with raises(ValueError, "mok: invalid schedule.topk_experts"):
        layer.backward(ctx, schedule=schedule)
    layer.assert_good()


def test_weights_changed_in_place_between_forward_and_backward(layer):
    """An optimizer step between forward and backward, say: backward would differentiate other
    weights than the forward's."""
    g = _copy(layer.data.weights[0])
    _, ctx = layer.forward(routed_gate_weights=g)
    g.mul_(1.5)
    with raises(ValueError, "mok: invalid routed_gate_weights: expected the routed_gate_weights "
                            "of the forward that made the forward context, unchanged since"):
        layer.backward(ctx, routed_gate_weights=g)
    layer.assert_good()


def test_context_fields_swapped(layer):
    _, ctx = layer.forward()
    swapped = dataclasses.replace(ctx, gate_routed=ctx.up_routed, up_routed=ctx.gate_routed)
    with raises(ValueError, "mok: invalid forward_context.gate_routed: expected the tensor "
                            "forward returned as gate_routed, got up_routed's tensor"):
        layer.backward(swapped)
    _, other = layer.forward()
    mixed = dataclasses.replace(ctx, hidden_shared=other.hidden_shared)
    with raises(ValueError, "mok: invalid forward_context.hidden_shared: expected the tensor "
                            "forward returned as hidden_shared, got another tensor"):
        layer.backward(mixed)
    ctx.hidden_routed.add_(1)  # the context changed in place
    with raises(ValueError, "mok: invalid forward_context.hidden_routed: expected the tensor "
                            "forward returned as hidden_routed, unchanged since"):
        layer.backward(ctx)
    layer.assert_good()


def test_context_rebuilt_by_hand_is_the_callers(layer):
    """A context built with MoKForwardContext(...) (e.g. from tensors an offloading hook gave
    back) carries no origin: backward computes from it without a check, as documented."""
    _, ctx = layer.forward()
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx) if f.name != "origin"}
    rebuilt = functional.MoKForwardContext(**{n: t.clone() for n, t in fields.items()})
    assert rebuilt.origin is None and ctx.origin is not None
    grads = layer.backward(rebuilt)
    for a, b in zip(grads, layer.want[1]):
        assert torch.equal(a, b)
    unpickled = pickle.loads(pickle.dumps(ctx))  # other memory: its origin is not kept
    assert unpickled.origin is None
    for a, b in zip(layer.backward(unpickled), layer.want[1]):
        assert torch.equal(a, b)


def test_moe_and_the_module_need_no_origin(gen):
    """mok.moe and mok.nn.MoE: autograd keeps the context with its inputs (and refuses a saved
    tensor changed in place, as for any op)."""
    data = make_layer(gen, T, H, I, E, K, S)
    x, w, *weights = data.requiring_grad()
    out = mok.moe(x, data.topk_experts, w, *weights)
    with torch.no_grad():
        weights[0].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(data.d_out)
    x, w, *weights = data.requiring_grad()
    mok.moe(x, data.topk_experts, w, *weights).backward(data.d_out)
    assert torch.isfinite(x.grad).all()


# --- tensors with torch's negation bit ---------------------------------------------------------

def _neg(t):
    """A lazy negated view whose values are t's: its memory holds -t (torch._neg_view of -t)."""
    return torch._neg_view((-t).detach().clone())


def test_negated_views_through_functional(layer):
    """forward and backward read a negated view's values, not its memory (the dispatcher
    resolves the bit); build_schedule keeps the ids' values."""
    data = layer.data
    for name in ("x", "router_weights", "routed_up_weights", "shared_gate_weights"):
        out, ctx = layer.forward(**{name: _neg(layer.args()[name])})
        assert torch.equal(out, layer.want[0]), name
    x = _neg(data.x)
    out, ctx = layer.forward(x=x)
    grads = layer.backward(ctx, x=x)
    for a, b in zip(grads, layer.want[1]):
        assert torch.equal(a, b)
    schedule = layer.build_schedule(_neg(data.topk_experts))
    assert not schedule.topk_experts.is_neg()
    assert torch.equal(schedule.topk_experts, data.topk_experts)
    out, _ = layer.forward(schedule=schedule)
    assert torch.equal(out, layer.want[0])
    layer.assert_good()


def test_negated_main_grads_are_refused(layer):
    """main_grads are added into in place: a negated view cannot take the sum."""
    _, ctx = layer.forward()
    g, u, d, sg, su, sd = layer.data.weights
    main = [torch.zeros(w.shape) for w in (sg, g, su, u, sd, d)]
    main[1] = torch._neg_view(main[1])
    with raises(ValueError, "mok: invalid main_routed_gate: expected a tensor whose memory holds "
                            "its values (backward adds into it"):
        functional.backward(layer.config, layer.ws, layer.schedule, ctx, layer.data.d_out,
                            **layer.args(), main_grads=tuple(main))
    layer.assert_good()


def test_a_negated_view_never_becomes_a_pointer():
    """Where a tensor becomes a pointer for mok's C++ core (mok._native.view_of, the one place),
    a negated view is refused by name rather than read as raw memory."""
    from mok import _native

    ids = torch.tensor([[1, -1], [2, 0]])
    with raises(ValueError, "mok: invalid topk_experts: expected a tensor whose memory holds its "
                            "values (mok reads the memory: resolve torch's negation or "
                            "conjugation bit first, topk_experts.resolve_neg() / "
                            ".resolve_conj()), got a negated view"):
        _native.lib.check_expert_ids(_native.view_of(torch._neg_view(ids)), E)
    _native.lib.check_expert_ids(_native.view_of(ids), E)


@pytest.mark.parametrize("which", ["x", "routed_gate_weights", "shared_up_weights",
                                   "topk_weights"])
def test_negated_view_through_moe_with_autograd(gen, which):
    """mok.moe on a negated view of a leaf: the output and every gradient are those of the plain
    tensor holding the same values (the leaf's gradient is the negation of the plain one's)."""
    data = make_layer(gen, T, H, I, E, K, S)
    names = ("x", "topk_weights", "routed_gate_weights", "routed_up_weights",
             "routed_down_weights", "shared_gate_weights", "shared_up_weights",
             "shared_down_weights")
    values = dict(zip(names, (data.x, data.topk_weights, *data.weights)))

    def run(negate):
        leaves = {n: (-v if negate and n == which else v).detach().clone().requires_grad_(True)
                  for n, v in values.items()}
        args = {n: torch._neg_view(t) if negate and n == which else t for n, t in leaves.items()}
        out = mok.moe(args["x"], data.topk_experts, args["topk_weights"],
                      *[args[n] for n in names[2:]])
        out.backward(data.d_out)
        return out, {n: t.grad for n, t in leaves.items()}

    plain_out, plain = run(False)
    out, grads = run(True)
    assert torch.equal(out, plain_out)
    for n in names:
        want = -plain[n] if n == which else plain[n]
        assert torch.equal(grads[n], want), n


# --- mok.nn.MoE's constructor ------------------------------------------------------------------

MOE_SHAPE = dict(hidden_size=64, intermediate_size=64, num_experts=4, topk=2)


@pytest.mark.parametrize("change,error,message", [
    (dict(shared_intermediate_size=-64), ValueError,
     "invalid shared_intermediate_size: expected an int >= 0, got -64"),
    (dict(shared_intermediate_size="64"), TypeError,
     "invalid shared_intermediate_size: expected an int, got str '64'"),
    (dict(shared_intermediate_size=32), ValueError,
     "invalid shared_intermediate_size: expected 0 or a multiple of 64 for bfloat16, got 32"),
    (dict(hidden_size=True), TypeError, "invalid hidden_size: expected an int, got bool True"),
    (dict(intermediate_size=64.0), TypeError,
     "invalid intermediate_size: expected an int, got float 64.0"),
    (dict(intermediate_size=96), ValueError,
     "invalid intermediate_size: expected a multiple of 64 for bfloat16, got 96"),
    (dict(num_experts=0), ValueError, "invalid num_experts: expected a positive int, got 0"),
    (dict(num_experts=2**70), ValueError,
     f"invalid num_experts: expected an int in [1, {2**63 - 1}], got {2**70}"),
    (dict(topk=False), TypeError, "invalid topk: expected an int, got bool False"),
    (dict(topk=5), ValueError, "invalid topk: expected in [1, num_experts = 4], got 5"),
    (dict(route_scale=float("nan")), ValueError,
     "invalid route_scale: expected a finite number > 0.0, got nan"),
    (dict(route_scale=float("inf")), ValueError,
     "invalid route_scale: expected a finite number > 0.0, got inf"),
    (dict(route_scale=0), ValueError, "invalid route_scale: expected a finite number > 0.0, got 0"),
    (dict(route_scale=True), TypeError,
     "invalid route_scale: expected a finite number > 0.0, got bool True"),
    (dict(route_scale="2.5"), TypeError,
     "invalid route_scale: expected a finite number > 0.0, got str '2.5'"),
    (dict(bias_update_rate=-1e-3), ValueError,
     "invalid bias_update_rate: expected a finite number >= 0.0, got -0.001"),
    (dict(router="relu"), ValueError,
     "invalid router: expected 'softmax' or 'sigmoid', got 'relu'"),
    (dict(router=["softmax"]), ValueError,
     "invalid router: expected 'softmax' or 'sigmoid', got ['softmax']"),
    (dict(backend=None), ValueError, "invalid backend: expected 'mok' or 'torch', got None"),
    (dict(config={"minibatch_size": 128}), TypeError,
     "invalid config: expected None (the default MoKConfig) or a MoKConfig, got dict"),
    (dict(group=0), TypeError,
     "invalid group: expected None (one process) or a torch.distributed ProcessGroup, got int"),
    (dict(device="gpu0"), ValueError,
     "invalid device: expected None or a torch.device (or its name), got 'gpu0'"),
    (dict(dtype=torch.float16), TypeError,
     "invalid dtype: expected torch.bfloat16, torch.float32 (computed in bf16 under autocast or "
     "FSDP's mixed precision) or torch.float64 (the cpu backend), got torch.float16"),
    (dict(dtype="bfloat16"), TypeError,
     "invalid dtype: expected torch.bfloat16, torch.float32 (computed in bf16 under autocast or "
     "FSDP's mixed precision) or torch.float64 (the cpu backend), got bfloat16"),
    (dict(swiglu_limit=float("nan")), ValueError,
     "invalid swiglu_limit: expected None or a finite positive number, got nan"),
    (dict(dtype=torch.float64, precision="fp8"), TypeError,
     "invalid dtype: expected torch.bfloat16 or torch.float32 for precision='fp8', got "
     "torch.float64"),
])
def test_moe_module_arguments(gen, change, error, message):
    """Every constructor argument is checked before anything is built: mok's error naming it.
    Then a good module of the same shape works."""
    with raises(error, "mok: " + message):
        mok.nn.MoE(**{**MOE_SHAPE, **change})
    layer = mok.nn.MoE(**MOE_SHAPE, shared_intermediate_size=64)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).requires_grad_(True)
    out, _ = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("x,error,message", [
    ([1.0, 2.0], TypeError, "invalid x: expected a torch.Tensor, got list"),
    (torch.zeros(5, 32, dtype=torch.bfloat16), ValueError,
     "invalid x.shape[-1]: expected 64 (the module's hidden_size), got 32"),
    (torch.zeros((), dtype=torch.bfloat16), ValueError,
     "invalid x.shape[-1]: expected 64 (the module's hidden_size), got a 0-d tensor"),
])
def test_moe_module_call_checks_x(x, error, message):
    layer = mok.nn.MoE(**MOE_SHAPE)
    with raises(error, "mok: " + message):
        layer(x)


# --- a schedule edited by hand before MoK's ops layer -----------------------------------------

class KittensLayer:
    """MoK's ops layer at one rank, as MoK code calls it: a schedule (mok.ops.schedule), the
    fused forward, its combine_buffer."""

    def __init__(self, data):
        self.data = data
        T, k = data.topk_experts.shape
        self.T, self.k = T, k
        self.schedule = self.schedule_of(data.topk_experts)

    def schedule_of(self, ids):
        all_ids = ids.to(torch.int32).reshape(1, self.T, self.k).contiguous()
        return tuple(t.clone() for t in mok.ops.schedule(all_ids, E, self.T * self.k, 0))

    def forward(self, schedule=None):
        """(combine_buffer, the op's outputs)."""
        g, u, d, sg, su, sd = self.data.weights
        x = self.data.x
        combine = torch.full((self.T * self.k, H), float("nan"), dtype=x.dtype, device=x.device)
        outs = mok.ops.dispatch_mlp_swiglu_combine_fwd_bf16(
            x, [1], combine, [1], sg, g, su, u, sd, d, *(schedule or self.schedule), self.k,
            None, 40, 131072, 4096)
        return combine, outs


def _corrupt(schedule, kind, slots):
    """(a hand-edited copy of the schedule, the routing it describes as slot -> expert changes
    {slot: expert or -1} (None: not described simply), the CPU error's argument and message)."""
    peer_rank, idx, num_tokens, tokens_per_expert = (t.clone() for t in schedule)
    rows = peer_rank.shape[0]
    used = (peer_rank >= 0).nonzero()[:, 0]
    r0, r1 = int(used[0]), int(used[-1])
    s0, s1 = int(idx[r0]), int(idx[r1])
    ends = torch.cumsum(tokens_per_expert.cpu().long(), 0)
    e0, e1 = (int(torch.searchsorted(ends, torch.tensor(r), right=True)) for r in (r0, r1))
    n = int(num_tokens[0])
    if kind == "slot past the end":
        idx[r0] = slots + 5
        change, message = {s0: -1}, (f"schedule_peer_token_idx[{r0}]: expected a slot t * topk "
                                     f"+ j in [0, {slots}), got {slots + 5}")
    elif kind == "negative slot":
        idx[r0] = -3
        change, message = {s0: -1}, (f"schedule_peer_token_idx[{r0}]: expected a slot t * topk "
                                     f"+ j in [0, {slots}), got -3")
    elif kind == "another rank":
        peer_rank[r0] = 3
        change, message = {s0: -1}, (f"schedule_peer_rank[{r0}]: expected -1 (padding) or 0 (this "
                                     "rank: mok runs MoK's ops on one rank), got 3")
    elif kind == "a slot twice":
        idx[r1] = s0
        change = {s0: max(e0, e1), s1: -1}
        message = (f"schedule_peer_token_idx[{r1}]: expected a slot no other row names, got slot "
                   f"{s0}, which row {r0} names too")
    elif kind == "num_tokens past the rows":
        num_tokens[0] = rows + 1
        change, message = None, f"num_tokens[0]: expected in [0, {rows}] (the schedule's rows), " \
                                f"got {rows + 1}"
    elif kind == "negative segment":
        tokens_per_expert[0] = -128
        change, message = None, "tokens_per_expert[0]: expected a row count >= 0, got -128"
    elif kind == "segments past num_tokens":
        tokens_per_expert[-1] += 128
        change, message = None, (f"tokens_per_expert: expected segments summing to num_tokens = "
                                 f"{n}, got segments summing to {n + 128}")
    return (peer_rank, idx, num_tokens, tokens_per_expert), change, message


CORRUPTIONS = ["slot past the end", "negative slot", "another rank", "a slot twice",
               "num_tokens past the rows", "negative segment", "segments past num_tokens"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_hand_edited_schedule_is_checked_on_the_cpu(gen, kind):
    """On CPU tensors every value of the schedule is checked before anything runs."""
    layer = KittensLayer(make_layer(gen, T, H, I, E, K, S, unused_fraction=0.0))
    want, _ = layer.forward()
    bad, _, message = _corrupt(layer.schedule, kind, T * K)
    with raises(ValueError, "mok: invalid " + message):
        layer.forward(bad)
    got, _ = layer.forward()
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_hand_edited_schedule_never_indexes_out_of_bounds(gen, kind):
    """What the ops layer trusts on CUDA (mok/_kittens_compat.py's docstring), checked on the
    function that reads the schedule: every slot and expert it hands on is in bounds, and where
    the edit describes a routing, it is that routing."""
    from mok import _kittens_compat

    layer = KittensLayer(make_layer(gen, T, H, I, E, K, S, unused_fraction=0.0))
    slots = T * K
    bad, change, _ = _corrupt(layer.schedule, kind, slots)
    ids, slot, used = _kittens_compat.slot_experts(*bad, slots)
    assert ((slot >= 0) & (slot <= slots)).all() and ((ids >= -1) & (ids < E)).all()
    assert (slot[~used] == slots).all()
    if change is not None:
        want = layer.data.topk_experts.reshape(-1, 1).clone()
        for s, e in change.items():
            want[s] = e
        assert torch.equal(ids, want)


@requires_cuda
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_cuda_hand_edited_schedule_stays_in_bounds(gen, kind):
    """On CUDA the schedule's values are trusted (no host read): an edited schedule computes the
    layer of the routing it describes, bit for bit, with every slot of combine_buffer written and
    no device error (an out-of-bounds index would be a device-side assert); the next good call
    gives the good bits."""
    layer = KittensLayer(make_layer(gen, T, H, I, E, K, S, unused_fraction=0.0).to("cuda"))
    want, _ = layer.forward()
    bad, change, _ = _corrupt(layer.schedule, kind, T * K)
    got, outs = layer.forward(bad)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all(), "a slot of combine_buffer left unwritten"
    if change is not None:
        ids = layer.data.topk_experts.reshape(-1).clone()
        for s, e in change.items():
            ids[s] = e
        described, _ = layer.forward(layer.schedule_of(ids.reshape(T, K)))
        assert torch.equal(got, described)
    again, _ = layer.forward()
    assert torch.equal(again, want)


# --- errors that name the right thing ----------------------------------------------------------

@pytest.mark.parametrize("call", ["forward", "recompute", "backward", "moe"])
@pytest.mark.parametrize("bad_x,message", [
    (lambda x: torch.cat([x, x[:1]]), f"x.shape[0]: expected {T} (the workspace's "
                                      f"num_local_tokens), got {T + 1}"),
    (lambda x: torch.cat([x, x], dim=1), f"x.shape[1]: expected {H} (the workspace's "
                                         f"hidden_size), got {2 * H}"),
    (lambda x: x.to("meta"), "x.device: expected cpu (the workspace's device), got meta"),
])
def test_x_is_checked_against_the_workspace_first(layer, call, bad_x, message):
    """An x that does not fit the workspace is named as x (not as topk_experts or the weights,
    which disagree with it first in a layer's own checks)."""
    x = bad_x(layer.data.x)
    with raises(ValueError, "mok: invalid " + message):
        if call == "forward":
            layer.forward(x=x)
        elif call == "recompute":
            layer.recompute(x=x)
        elif call == "backward":
            layer.backward(layer.forward()[1], x=x)
        else:
            g, u, d, sg, su, sd = layer.data.weights
            mok.moe(x, layer.data.topk_experts, layer.data.topk_weights, g, u, d, sg, su, sd,
                    workspace=layer.ws)
    layer.assert_good()


def test_missing_or_wrong_objects_are_named(layer):
    g, u, d, sg, su, sd = layer.data.weights
    config, ws, data = layer.config, layer.ws, layer.data
    with raises(TypeError, "mok: invalid schedule: expected a MoKSchedule, got NoneType"):
        functional.forward(config, ws, None, **layer.args())
    _, ctx = layer.forward()
    with raises(TypeError, "mok: invalid schedule: expected a MoKSchedule, got NoneType"):
        functional.backward(config, ws, None, ctx, data.d_out, **layer.args())
    with raises(TypeError, "mok: invalid schedule: expected a MoKSchedule, got NoneType"):
        functional.recompute_forward_context(config, ws, None, data.x, sg, su, g, u)
    with raises(TypeError, "mok: invalid workspace: expected a Workspace, got int"):
        functional.forward(config, 42, layer.schedule, **layer.args())
    with raises(TypeError, "mok: invalid workspace: expected None (the automatic workspace) or a "
                           "mok.functional workspace, got int"):
        mok.moe(data.x, data.topk_experts, data.topk_weights, g, u, d, sg, su, sd, workspace=42)
    with raises(TypeError, "mok: invalid config: expected a MoKConfig, got dict"):
        functional.forward({}, ws, layer.schedule, **layer.args())
    x = data.x.clone().requires_grad_(True)  # through the dispatcher (autograd records it)
    with raises(TypeError, "mok: invalid topk_weights: expected a torch.Tensor, got list"):
        mok.moe(x, data.topk_experts, data.topk_weights.tolist(), g, u, d, sg, su, sd)
    with raises(TypeError, "mok: invalid shared_up_weights: expected a torch.Tensor, got str"):
        mok.moe(x, data.topk_experts, data.topk_weights, g, u, d, sg, "su", sd)
    layer.assert_good()


@pytest.mark.parametrize("field,value,message", [
    ("fwd_num_comm_sms", 2**40, "expected an int in [-2147483648, 2147483647] (the C++ Config's "
                                f"int), got {2**40}"),
    ("bwd_num_comm_sms", -2**31 - 1, "expected an int in [-2147483648, 2147483647] (the C++ "
                                     f"Config's int), got {-2**31 - 1}"),
    ("minibatch_size", 2**70, f"expected an int in [-{2**63}, {2**63 - 1}] (the C++ Config's "
                              f"int64), got {2**70}"),
    ("macrobatch_size", 2**64, f"expected an int in [-{2**63}, {2**63 - 1}] (the C++ Config's "
                               f"int64), got {2**64}"),
    ("fused_stage_rows", 2**63, f"expected an int in [-{2**63}, {2**63 - 1}] (the C++ Config's "
                                f"int64), got {2**63}"),
    ("schedule_capacity_multiplier", 10**400, "expected a finite positive number, got 1000"),
])
def test_config_values_beyond_the_cxx_types(layer, field, value, message):
    """MoKConfig's ints beyond their C++ type: mok's error naming the field (not nanobind's
    signature dump)."""
    with raises(ValueError, f"mok: invalid config.{field}: {message}"):
        functional.MoKConfig(**{field: value})
    layer.assert_good()


@pytest.mark.parametrize("value,error,message", [
    (2**40, ValueError, f"expected an int in [1, 1048576], got {2**40}"),
    (2**26, ValueError, f"expected an int in [1, 1048576], got {2**26}"),
    (True, TypeError, "expected an int, got bool True"),
    (4.0, TypeError, "expected an int, got float 4.0"),
    (0, ValueError, "expected a positive int, got 0"),
])
def test_build_schedule_bounds_num_local_experts(layer, value, error, message):
    """Bounded before anything is allocated from it (2**26 experts would first allocate about a
    gigabyte): mok's bound of 2^20 experts in all (include/mok/problem.hpp)."""
    with raises(error, f"mok: invalid num_local_experts: {message}"):
        functional.build_schedule(layer.ws, layer.config, layer.data.topk_experts,
                                  num_local_experts=value)
    if type(value) is int:  # the op's schema takes an int (torch turns a bool into one)
        with raises(error, f"mok: invalid num_local_experts: {message}"):
            mok.ops.schedule(layer.data.topk_experts.int().reshape(1, T, K), value, T * K, 0)
    layer.assert_good()


def test_schedule_sizes_are_bounded_before_allocating(layer):
    ids = layer.data.topk_experts
    with raises(ValueError, "mok: invalid num_experts: expected at most 1048576 (mok's bound: "
                            "each expert pads the schedule to a 128-row tile), got "
                            f"{2**62}"):
        mok.ops.schedule_table([ids], 2**62, 0, 4096, 0)
    with raises(ValueError, f"mok: invalid num_experts: expected an int in [1, 1048576], got "
                            f"{2**40}"):
        mok.ops.build_schedule(ids, 2**40, 2**40, 0)
    with raises(ValueError, "mok: invalid ep_rank: expected an int in [0, 0], got 3"):
        mok.ops.schedule_table([ids], E, 3, 4096, 0)
    table = mok.ops.schedule_table([ids], E, 0, 4096, 0)[0]
    assert table.shape[0] == T * K + E * 127
    layer.assert_good()


def test_moe_module_bounds_its_sizes():
    with raises(ValueError, "mok: invalid num_experts: expected at most 1048576"):
        mok.nn.MoE(64, 64, 2**26, 2)
    with raises(ValueError, "mok: invalid num_local_experts * max(hidden_size, "
                            "intermediate_size): expected at most 2147483647"):
        mok.nn.MoE(64, 2**26, 64, 2, device="meta")
    mok.nn.MoE(64, 64, 4, 2)


@pytest.mark.parametrize("version", ["2.9.0", "2.9.1+cu128", "2.10.0a0+git1234", "2.11.0+cu130",
                                     "2.15.0+cu132", "3.0.0"])
def test_torch_versions_mok_runs_on(version):
    mok._versions.check_version("torch", version, mok.TORCH_MINIMUM)


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.6.0", "2.4.1+cu121", "1.13.1", "nightly"])
def test_older_torch_refused_at_import_naming_it(version):
    with pytest.raises(ImportError) as e:
        mok._versions.check_version("torch", version, mok.TORCH_MINIMUM)
    assert str(e.value) == f"mok: invalid torch version: expected 2.9 or newer, got {version}"
    assert mok.TORCH_MINIMUM == (2, 9)
    # The installed one passes: mok imported.
    mok._versions.check_version("torch", torch.__version__, mok.TORCH_MINIMUM)
