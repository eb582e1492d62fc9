"""MoK users' calls, written the way Mixture-of-Kittens' own tests make them: the functional API
(positional and keyword forms, the schedule's and the context's fields) and the ops layer (also
under torch.compile(fullgraph=True)), bf16, against the independent fp64 reference
(moe_reference.py) with MoK's tolerances: output abs max <= 0.5 and sum|diff| / sum|ref| <= 0.01,
every gradient's cosine similarity >= 0.9999; and mok's own relative-error bounds (conftest), since
a cosine cannot see a gradient off by a constant factor. MoK's model shapes are scaled down to run
on a CPU in seconds (their H : I proportions and k kept); every output mok allocates is poisoned
(conftest). The CUDA variants run the same checks on a GPU and skip here."""

import pytest
import torch
from conftest import (DEVICES, GRAD_TOLERANCE, OUT_TOLERANCE, make_layer, rel_error,
                      requires_cuda)
from moe_reference import forward_and_grads, slot_outputs

import mok
import mok.functional as functional
import mok.ops

# MoK's tolerances (bf16).
ABS_MAX = 0.5
REL_SUM = 0.01
COSINE = 0.9999

# (T, H, I, E, k): MoK's shapes scaled to a CPU; the shared expert is I wide, as in MoK's tests.
SHAPES = {
    "kimi-k2-like": (48, 448, 128, 16, 8),  # H 7168, I 2048, k 8
    "glm-like": (40, 384, 128, 16, 8),  # H 6144
    "qwen3.5-like": (40, 256, 64, 20, 10),  # H 4096, I 1024, k 10
    "dsv4-pro-like": (40, 256, 192, 12, 6),  # I 3072, k 6
    "minimum": (1, 64, 64, 1, 1),
}
GRAD_NAMES = ("d_x", "d_router_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
              "d_shared_gate", "d_shared_up", "d_shared_down")


def check_close(name, got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten output?)"
    diff = (got - ref).abs()
    assert diff.max() <= ABS_MAX, f"{name}: abs max {float(diff.max())}"
    rel = float(diff.sum() / ref.abs().sum().clamp(min=1e-30))
    assert rel <= REL_SUM, f"{name}: relative sum {rel}"


def check_cosine(name, got, ref):
    got, ref = got.detach().double().cpu().flatten(), ref.detach().double().cpu().flatten()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if ref.norm() == 0:
        assert got.norm() == 0, name
        return
    cos = float(torch.dot(got, ref) / (got.norm() * ref.norm()).clamp(min=1e-300))
    assert cos >= COSINE, f"{name}: cosine {cos}"


def layer_data(gen, name, device):
    T, H, I, E, k = SHAPES[name]
    return make_layer(gen, T, H, I, E, k, I).to(device), (T, H, I, E, k)


def check_against_reference(data, out, grads):
    cpu = data.to("cpu")
    ref_out, *ref = forward_and_grads(cpu.x, cpu.topk_experts, cpu.topk_weights, cpu.weights,
                                      cpu.d_out)
    check_close("output", out, ref_out)
    # mok's own bounds beside MoK's: a cosine cannot see a gradient off by a constant factor.
    assert rel_error(out, ref_out) <= OUT_TOLERANCE, ("output", rel_error(out, ref_out))
    # mok's order of the reference: d_x, d_w, gate, up, down, shared gate, up, down: MoK's too.
    # d_router_weights[t, j] = <d_out[t], y[t, j]>: relative to sum_h |d_out[t, h] y[t, j, h]| (a
    # cancelling dot product makes |ref| meaningless; test_layer.py measures it so too).
    y = slot_outputs(cpu.x, cpu.topk_experts, *cpu.weights[:3])
    scales = {"d_router_weights": (cpu.d_out.double().abs().unsqueeze(1) * y.abs()).sum(dim=-1)}
    for name, g, r in zip(GRAD_NAMES, grads, ref):
        check_cosine(name, g, r)
        err = rel_error(g, r, scale=scales.get(name))
        assert err <= GRAD_TOLERANCE, (name, err)


def mok_call_sequence(data, T, H, k, E, *, keywords):
    """MoK's README/test sequence; `keywords`: the keyword form of every call."""
    g, u, d, sg, su, sd = data.weights
    config = functional.MoKConfig()
    if keywords:
        workspace = functional.get_workspace(config=config, group=None, device=data.x.device,
                                             num_local_tokens=T, hidden_size=H, topk=k)
        schedule = functional.build_schedule(workspace=workspace, config=config,
                                             top_experts=data.topk_experts, num_local_experts=E)
        out, ctx = functional.forward(
            config=config, workspace=workspace, schedule=schedule, x=data.x,
            router_weights=data.topk_weights, shared_gate_weights=sg, shared_up_weights=su,
            shared_down_weights=sd, routed_gate_weights=g, routed_up_weights=u,
            routed_down_weights=d)
        grads = functional.backward(
            config=config, workspace=workspace, schedule=schedule, forward_context=ctx,
            grad_output=data.d_out, x=data.x, router_weights=data.topk_weights,
            shared_gate_weights=sg, shared_up_weights=su, shared_down_weights=sd,
            routed_gate_weights=g, routed_up_weights=u, routed_down_weights=d)
    else:
        workspace = functional.get_workspace(config, None, device=data.x.device,
                                             num_local_tokens=T, hidden_size=H, topk=k)
        schedule = functional.build_schedule(workspace, config, data.topk_experts,
                                             num_local_experts=E)
        out, ctx = functional.forward(config, workspace, schedule, data.x, data.topk_weights,
                                      sg, su, sd, g, u, d)
        grads = functional.backward(config, workspace, schedule, ctx, data.d_out, data.x,
                                    data.topk_weights, sg, su, sd, g, u, d)
    return config, workspace, schedule, out, ctx, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keywords", [False, True], ids=["positional", "keywords"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_functional_matches_the_reference(gen, device, keywords, shape):
    data, (T, H, I, E, k) = layer_data(gen, shape, device)
    config, ws, schedule, out, ctx, grads = mok_call_sequence(data, T, H, k, E,
                                                              keywords=keywords)
    assert isinstance(ctx, functional.MoKForwardContext)
    for field in ("x_routed", "gate_shared", "gate_routed", "up_shared", "up_routed",
                  "hidden_shared", "hidden_routed"):
        assert isinstance(getattr(ctx, field), torch.Tensor), field
    assert ctx.gate_shared.shape == (T, I) and ctx.hidden_shared.shape == (T, I)
    assert len(grads) == 8
    check_against_reference(data, out, grads)
    functional.validate_inputs(config, ws, schedule, data.x, data.topk_weights, data.d_out)


def expected_rows(ids, E_local, rank=0):
    """MoK's schedule, derived directly: per local expert the (peer_rank, slot) of each row, in
    mok's order (source rank, then t, then j) and its segment padded to 128 rows."""
    W, T, k = ids.shape
    peer_rank, peer_slot, tokens_per_expert = [], [], []
    for e in range(rank * E_local, (rank + 1) * E_local):
        rows = [(src, s) for src in range(W) for s in range(T * k)
                if int(ids[src].reshape(-1)[s]) == e]
        padded = -(-len(rows) // 128) * 128
        tokens_per_expert.append(padded)
        peer_rank += [r for r, _ in rows] + [-1] * (padded - len(rows))
        peer_slot += [s for _, s in rows] + [-1] * (padded - len(rows))
    return peer_rank, peer_slot, tokens_per_expert


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_schedule_fields_in_moks_terms(gen, device, ids_dtype):
    T, H, I, E, k = SHAPES["qwen3.5-like"]
    data = make_layer(gen, T, H, I, E, k, 0)
    ids = data.topk_experts.to(device, ids_dtype)
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device=device, num_local_tokens=T,
                                     hidden_size=H, topk=k)
    schedule = functional.build_schedule(ws, config, ids, num_local_experts=E)
    want_rank, want_slot, want_tpe = expected_rows(data.topk_experts.unsqueeze(0), E)
    n = len(want_rank)
    assert schedule.peer_rank.dtype == torch.int32 and schedule.peer_token_idx.dtype == torch.int32
    assert schedule.peer_rank.shape == (T * k + E * 127,)  # mok's worst case
    assert schedule.peer_rank[:n].tolist() == want_rank
    assert schedule.peer_token_idx[:n].tolist() == want_slot
    assert (schedule.peer_rank[n:] == -1).all() and (schedule.peer_token_idx[n:] == -1).all()
    assert schedule.tokens_per_expert.tolist() == want_tpe
    assert schedule.num_tokens.tolist() == [n]
    assert schedule.top_experts.dtype == torch.int32
    assert torch.equal(schedule.top_experts.cpu(), data.topk_experts.to(torch.int32))
    # The alias of mok's earlier keyword gives the same schedule.
    again = functional.build_schedule(ws, config, topk_experts=ids, num_local_experts=E)
    assert torch.equal(again.peer_rank, schedule.peer_rank)


def test_schedule_matches_the_host_twin(gen):
    """The schedule in MoK's terms is the host twin's table (mok.ops.schedule_table), decoded."""
    for W in (1, 2, 4):
        T, k, E = 29, 3, 4 * W
        ids = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
               for _ in range(W)]
        ids[0][3] = -1
        for rank in range(W):
            table, *_ = mok.ops.schedule_table(ids, E, rank, 128, 256)
            peer_rank, peer_slot, _, _ = mok.ops.schedule(torch.stack(ids).to(torch.int32),
                                                          E // W, T * k, rank)
            assert torch.equal(peer_rank, torch.where(table >= 0, table // (T * k), -1).int())
            assert torch.equal(peer_slot, torch.where(table >= 0, table % (T * k), -1).int())


def test_config_and_workspace_fields():
    config = functional.MoKConfig(40, 28, 4096, 131072, 0.5, 2048)  # MoK's positional order
    assert config.all_gather_top_experts_chunk_bytes == 2048
    with pytest.raises(ValueError, match="all_gather_top_experts_chunk_bytes"):
        functional.MoKConfig(all_gather_top_experts_chunk_bytes=100)
    functional.validate_workspace_args(config, None, device=torch.device("cpu"),
                                       num_local_tokens=5, hidden_size=64, topk=2)
    with pytest.raises(ValueError, match="num_local_tokens"):
        functional.validate_workspace_args(config, None, device="cpu", num_local_tokens=0,
                                           hidden_size=64, topk=2)
    ws = functional.get_workspace(config, None, device="cpu", num_local_tokens=5,
                                  hidden_size=64, topk=2)
    assert isinstance(ws, functional.MoKWorkspace)
    assert (ws.group_name, ws.ep_rank, ws.ep_size, ws.num_local_tokens, ws.hidden_size,
            ws.topk, ws.schedule_capacity) == ("", 0, 1, 5, 64, 2, 10)
    assert ws.device == torch.device("cpu")
    with pytest.raises(AttributeError, match="x_buffer_ptrs"):
        ws.x_buffer_ptrs
    # MoK's cache: the same arguments give the same workspace; a different capacity factor
    # another one; clear_workspace_cache drops them.
    same = functional.get_workspace(functional.MoKConfig(), None, device="cpu",
                                    num_local_tokens=5, hidden_size=64, topk=2)
    assert same is ws
    other = functional.get_workspace(functional.MoKConfig(schedule_capacity_multiplier=4.0),
                                     None, device="cpu", num_local_tokens=5, hidden_size=64,
                                     topk=2)
    assert other is not ws
    functional.clear_workspace_cache()
    assert functional.get_workspace(config, None, device="cpu", num_local_tokens=5,
                                    hidden_size=64, topk=2) is not ws


def test_validate_inputs_names_the_argument(gen):
    T, H, I, E, k = 8, 64, 64, 4, 2
    data = make_layer(gen, T, H, I, E, k, I)
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=T,
                                     hidden_size=H, topk=k)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    with pytest.raises(TypeError, match="mok: invalid x.dtype"):
        functional.validate_inputs(config, ws, schedule, data.x.float(), data.topk_weights)
    with pytest.raises(ValueError, match=r"mok: invalid x.shape: expected \[8, 64\], got \[7, 64\]"):
        functional.validate_inputs(config, ws, schedule, data.x[:-1], data.topk_weights)
    with pytest.raises(ValueError, match="router_weights.shape"):
        functional.validate_inputs(config, ws, schedule, data.x, data.topk_weights[:, :1])
    with pytest.raises(TypeError, match="schedule"):
        functional.validate_inputs(config, ws, object(), data.x, data.topk_weights)


class OneRankBuffers:
    """What MoK's functional code hands its ops at one rank (MoKWorkspace's buffers)."""

    def __init__(self, data, T, H, k):
        dev = data.x.device
        self.x_buffer = data.x.clone()
        self.combine_buffer = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16,
                                         device=dev)
        self.d_y_buffer = data.d_out.clone()
        self.d_x_routed_buffer = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16,
                                            device=dev)
        self.router_weight_buffer = data.topk_weights.clone()
        self.d_router_weight_buffer = torch.full((T, k), float("nan"), device=dev)
        self.all_gather = torch.full((1, T, k), -7, dtype=torch.int32, device=dev)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=dev)
        self.target = torch.zeros(1, dtype=torch.int32, device=dev)
        # The peer-pointer lists (one rank), taken once as MoK's workspace does.
        self._ptrs = {name: [t.data_ptr()] for name, t in vars(self).items()}

    def ptrs(self, name):
        return self._ptrs[name]


def ops_forward(b, data, T, k, E, *, ops=torch.ops.mok, limit=None):
    g, u, d, sg, su, sd = data.weights
    top = data.topk_experts.to(torch.int32)
    ops.all_gather_top_experts(top, b.all_gather, b.ptrs("all_gather")[0], 0, 16)
    ops.barrier_all(b.barrier, b.ptrs("barrier"), b.ptrs("barrier")[0], b.target)
    peer_rank, peer_slot, num_tokens, tokens_per_expert = ops.schedule(b.all_gather, E, T * k * 2,
                                                                       0)
    outs = ops.dispatch_mlp_swiglu_combine_fwd_bf16(
        b.x_buffer, b.ptrs("x_buffer"), b.combine_buffer, b.ptrs("combine_buffer"), sg, g, su, u,
        sd, d, peer_rank, peer_slot, num_tokens, tokens_per_expert, k, limit, 40, 131072, 4096)
    out = ops.fwd_epilogue(outs[7], b.combine_buffer, b.router_weight_buffer, top)
    return out, outs, (peer_rank, peer_slot, num_tokens, tokens_per_expert)


def ops_backward(b, data, T, k, context, schedule, limit=None):
    g, u, d, sg, su, sd = data.weights
    x_routed, gate_shared, gate_routed, up_shared, up_routed, hidden_shared, hidden_routed = \
        context
    grads = torch.ops.mok.dispatch_mlp_swiglu_combine_bwd_bf16(
        b.d_y_buffer, b.ptrs("d_y_buffer"), b.d_x_routed_buffer, b.ptrs("d_x_routed_buffer"),
        b.router_weight_buffer, b.ptrs("router_weight_buffer"), b.d_router_weight_buffer,
        b.ptrs("d_router_weight_buffer"), sg, g, su, u, sd, d, x_routed, gate_shared,
        gate_routed, up_shared, up_routed, hidden_shared, hidden_routed, b.x_buffer,
        b.ptrs("x_buffer"), *schedule, k, limit, 28, 131072, 4096)
    d_x = torch.ops.mok.bwd_epilogue(grads[0], b.d_x_routed_buffer)
    (d_sg, d_g, d_su, d_u, d_sd, d_d) = grads[9:]
    return d_x, b.d_router_weight_buffer, d_g, d_u, d_d, d_sg, d_su, d_sd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ops_layer_matches_the_reference(gen, device, shape):
    """MoK's functional sequence over its ops at one rank: all_gather_top_experts, barrier_all,
    schedule, the fused forward, fwd_epilogue; the fused backward, bwd_epilogue."""
    data, (T, H, I, E, k) = layer_data(gen, shape, device)
    b = OneRankBuffers(data, T, H, k)
    out, outs, schedule = ops_forward(b, data, T, k, E)
    assert torch.equal(b.all_gather[0], data.topk_experts.to(torch.int32))
    y_shared, y_routed = outs[7], outs[8]
    # combine_buffer: every slot's expert output, unweighted (unused slots zero), whole tensor.
    want = slot_outputs(data.x.cpu(), data.topk_experts.cpu(), *[w.cpu() for w in data.weights[:3]])
    check_close("combine_buffer", b.combine_buffer.reshape(T, k, H), want)
    context = outs[:7]
    grads = ops_backward(b, data, T, k, context, schedule)
    check_against_reference(data, out, grads)
    # y_routed holds the combine rows in schedule order.
    peer_rank, peer_slot = schedule[0], schedule[1]
    used = peer_rank >= 0
    assert torch.equal(y_routed[used], b.combine_buffer[peer_slot[used].long()])
    assert (y_routed[~used] == 0).all()
    assert y_shared.shape == (T, H)


def test_ops_layer_under_torch_compile(gen):
    data, (T, H, I, E, k) = layer_data(gen, "qwen3.5-like", "cpu")
    eager = OneRankBuffers(data, T, H, k)
    want, *_ = ops_forward(eager, data, T, k, E)
    b = OneRankBuffers(data, T, H, k)
    compiled = torch.compile(lambda: ops_forward(b, data, T, k, E)[0], fullgraph=True)
    got = compiled()
    assert torch.equal(got, want)
    assert torch.equal(b.combine_buffer, eager.combine_buffer)


def test_ops_errors_name_what_is_missing(gen):
    data, (T, H, I, E, k) = layer_data(gen, "minimum", "cpu")
    b = OneRankBuffers(data, T, H, k)
    two = torch.zeros((2, T, k), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"all_gather_top_experts_buffer.shape\[0\]"):
        torch.ops.mok.all_gather_top_experts(data.topk_experts.int(), two, 1, 0, 16)
    with pytest.raises(ValueError, match=r"len\(barrier_buffer_ptrs\)"):
        torch.ops.mok.barrier_all(b.barrier, [1, 2, 3, 4], 1, b.target)
    g, u, d, sg, su, sd = data.weights
    # Clamped SwiGLU: mok refuses a limit of 0 (MoK lets it through), naming the argument.
    _, _, schedule = ops_forward(OneRankBuffers(data, T, H, k), data, T, k, E)
    with pytest.raises(ValueError, match="swiglu_limit"):
        torch.ops.mok.dispatch_mlp_swiglu_combine_fwd_bf16(
            b.x_buffer, b.ptrs("x_buffer"), b.combine_buffer, b.ptrs("combine_buffer"), sg, g,
            su, u, sd, d, *schedule, k, 0.0, 40, 131072, 4096)
    with pytest.raises(ValueError, match="swiglu_limit"):
        functional.forward(functional.MoKConfig(), *_workspace_and_schedule(data, T, H, k, E),
                           data.x, data.topk_weights, sg, su, sd, g, u, d, swiglu_limit=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("limit", [0.5, 2.0])
def test_ops_layer_with_swiglu_limit_matches_functional(gen, device, limit):
    """MoK's op sequence with a swiglu_limit against mok.functional with the same limit (whose
    own tests check it against an independent fp32 reference: test_swiglu_limit.py). The limits
    clamp a large share of the pre-activations of these inputs; without the limit the results
    differ (checked), so the limit reaches the ops' layer calls. DeepSeek-V4-like: the models
    that use the limit."""
    data, (T, H, I, E, k) = layer_data(gen, "dsv4-pro-like", device)
    g, u, d, sg, su, sd = data.weights
    config = functional.MoKConfig()
    ws, schedule = _workspace_and_schedule(data, T, H, k, E)
    out_f, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd,
                                    g, u, d, swiglu_limit=limit)
    grads_f = functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                  data.topk_weights, sg, su, sd, g, u, d, swiglu_limit=limit)
    b = OneRankBuffers(data, T, H, k)
    out, outs, sched = ops_forward(b, data, T, k, E, limit=limit)
    grads = ops_backward(b, data, T, k, outs[:7], sched, limit=limit)
    # The ops compose the same layer: every gradient bit for bit the functional form's; the output
    # within one bf16 rounding (2^-7 of each value: the ops' combine sums in its own order).
    check_close("output", out.cpu(), out_f.float().cpu())
    step = (out.float() - out_f.float()).abs()
    assert bool((step <= 2.0**-7 * out_f.float().abs()).all()), float(step.max())
    for name, got, want in zip(GRAD_NAMES, grads, grads_f):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    b_plain = OneRankBuffers(data, T, H, k)
    out_plain, _, _ = ops_forward(b_plain, data, T, k, E)
    assert not torch.equal(out_plain, out), "the limit changed nothing: it was not applied"


def _workspace_and_schedule(data, T, H, k, E):
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device=data.x.device, num_local_tokens=T,
                                     hidden_size=H, topk=k)
    return ws, functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)


@requires_cuda
def test_cuda_schedule_fields_need_no_host_sync(gen):
    """On CUDA, build_schedule and the schedule's fields run without a device-to-host copy."""
    T, H, I, E, k = SHAPES["kimi-k2-like"]
    data = make_layer(gen, T, H, I, E, k, 0).to("cuda")
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device="cuda", num_local_tokens=T,
                                     hidden_size=H, topk=k)
    torch.cuda.set_sync_debug_mode("error")
    try:
        schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
        fields = (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
                  schedule.tokens_per_expert, schedule.top_experts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t.is_cuda for t in fields)
