"""One rank of the MoK-compatibility tests at several ranks (CPU tensors, gloo), run by torchrun:

    torchrun --standalone --nproc-per-node W tests/python/mok_compat_ep_worker.py --suite S --seed N

tests/python/test_mok_compat_ep.py launches it for W = 2 and 4. Every rank calls MoK's public API
the way MoK's own distributed tests and integrations do (mok.functional: MoKConfig, get_workspace
with a process group, build_schedule, forward, backward, recompute_forward_context,
validate_inputs, validate_workspace_args, clear_workspace_cache), with each rank holding its own
tokens and its E/W experts. Suites:

  layer     MoK's shapes scaled down (Kimi-K2-, GLM-, Qwen3.5-, DSV4-Pro-like, minimums) and
            routings (uniform top-k, skewed, every slot on one expert of the last rank, a rank
            whose experts get nothing, -1 slots with one rank routing nothing), positional and
            keyword calls, int32 and int64 ids, MoK's default and minimum configs, shared experts
            per rank (as MoK's tests draw them) or replicated. On every rank:
              - the schedule's MoK fields (peer_rank, peer_token_idx, num_tokens,
                tokens_per_expert, top_experts) and rows_per_expert, whole tensors, against a
                table derived here from every rank's ids in mok's documented order (source rank,
                then t, then j) and padding (128 rows, -1 padding rows, worst-case length);
              - output, the context's shared fields and its routed rows, every gradient and the
                fp32 main grads against the independent fp64 reference (moe_reference.py) over
                the global tokens, with MoK's tolerances (output abs max 0.5 and sum|diff| /
                sum|ref| <= 0.01, gradient cosine >= 0.9999);
              - bitwise against one process running mok with every expert over all ranks' tokens
                (output, d_x, d_router_weights, the routed weight gradients, the context rows of
                this rank's experts; with per-rank shared experts only what does not depend on
                them), and recompute_forward_context bit for bit with forward's context and the
                gradients from it.
            With W = 4 also on EP subgroups {0, 2} and {1, 3} (DP x EP: EP rank != global rank)
            running different problems at once; with W = 2 on a subgroup object of both ranks.
  api       MoKWorkspace's fields with WORLD and a subgroup; get_workspace's cache (same
            arguments: same workspace; another group or capacity factor: another);
            validate_workspace_args (a group this rank is not in, a bad size); validate_inputs
            (positional and keyword, and MoK's failure cases); forward / recompute /
            build_schedule raising on every rank for MoK's bad arguments, and the group working
            afterwards; clear_workspace_cache as a barrier on each cached workspace's group
            (rank 0 arrives late; every rank waits for it) that drops the cache.

Inputs are drawn from --seed, the same on every rank (so every rank can build the global problem
and its reference); outputs are poisoned (NaN) before mok writes them. Each rank prints
"[rank R] mok compat EP SUITE: passed" when every check held, and exits 1 otherwise.
"""

import argparse
import datetime
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_ep_worker import Checks  # noqa: E402
import poison  # noqa: E402
from moe_reference import forward_and_grads  # noqa: E402
from test_mok_compat import ABS_MAX, COSINE, GRAD_NAMES, REL_SUM  # noqa: E402

import mok.ops  # noqa: E402
from mok import functional  # noqa: E402
from mok.functional import get_workspace  # noqa: E402

SEGMENT = 128  # mok's schedule padding (docs/mok-compat.md, MoKSchedule)
ERRORS = (TypeError, ValueError)  # README, "Coming from MoK": catch both

# MoK's configs: its default (positional, MoK's field order) and its "all combined minimums".
CONFIGS = {
    "default": lambda: functional.MoKConfig(40, 28, 4096, 131072, 0.5, 2048),
    "minimums": lambda: functional.MoKConfig(
        fwd_num_comm_sms=2, bwd_num_comm_sms=2, minibatch_size=256, macrobatch_size=256,
        schedule_capacity_multiplier=1.5, all_gather_top_experts_chunk_bytes=16),
}


@dataclass
class Case:
    name: str
    T: int  # tokens per rank
    H: int
    I: int  # noqa: E741
    E: int  # experts over all ranks
    k: int
    routing: str  # uniform, skewed, one_expert, empty_rank, unused_slots
    shared: str  # per_rank (MoK's tests), replicated, none
    keywords: bool
    ids_dtype: torch.dtype
    config: str


def cases(W):
    """MoK's shapes (tests/utils.py: shapes) scaled to seconds on a CPU, H : I and k kept; E a
    multiple of 4 (W = 2 and 4); the minimum shapes with E = W as in MoK. NOTES: the minimum
    shapes keep 16 and 8 tokens per rank (MoK: 512, 7168): MoK's cosine bound is meant for whole
    tensors, and a d_router_weights of two entries (T = 2, k = 1) can miss it by bf16 rounding
    alone (seen: 0.99971, with the bits equal to the one-process layer's). Likewise one_expert
    routing, whose k slots of a token share one value: with 6 tokens a rank's d_router_weights
    held 6 values and missed at 0.999892 (seed 3990538685, 2026-12-07; 700 other draws gave
    0.99992 or more); with 16 tokens that draw gives 0.999997, 300 others 0.999977 or more."""
    i32, i64 = torch.int32, torch.int64
    return [
        Case("kimi-k2-like", 6, 448, 128, 16, 8, "uniform", "per_rank", False, i64, "default"),
        Case("kimi-k2-like", 5, 448, 128, 16, 8, "skewed", "replicated", True, i32, "default"),
        Case("glm-like", 4, 384, 128, 16, 8, "empty_rank", "replicated", False, i32, "minimums"),
        Case("qwen3.5-like", 5, 256, 64, 20, 10, "unused_slots", "per_rank", True, i64,
             "default"),
        Case("qwen3.5-like", 4, 256, 64, 20, 10, "unused_slots", "none", False, i32, "minimums"),
        Case("dsv4-pro-like", 16, 448, 192, 12, 6, "one_expert", "replicated", True, i64,
             "default"),
        Case("all-minimums", 16, 64, 64, W, 1, "uniform", "replicated", False, i64,
             "minimums"),
        Case("minimum-local-experts", 8, 64, 64, W, min(8, W), "skewed", "per_rank", True, i32,
             "default"),
    ]


# ---------------------------------------------------------------------------------------------
# Inputs, drawn as MoK's tests draw them (router logits -> top-k, softmax of the top values,
# weights randn * fan_in^-0.5), for every rank at once.


@dataclass
class Problem:
    x: torch.Tensor  # [W*T, H] bf16, rank r's tokens at [r*T, (r+1)*T)
    ids: torch.Tensor  # [W*T, k] int64, -1 unused
    router_weights: torch.Tensor  # [W*T, k] fp32
    routed: tuple  # gate [E, I, H], up [E, I, H], down [E, H, I]
    shared: list  # per rank (gate [I, H], up, down) or None
    d_out: torch.Tensor  # [W*T, H] bf16


def draw(case, W, seed):
    gen = torch.Generator().manual_seed(seed)
    T, H, I, E, k = case.T, case.H, case.I, case.E, case.k
    N = W * T
    El = E // W
    bf = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(bf)

    logits = torch.randn(N, E, generator=gen)
    if case.routing == "skewed":  # rank 0's experts win most slots
        logits[:, :El] += 2.5
    elif case.routing == "empty_rank":  # rank 1's experts are never chosen
        logits[:, El:2 * El] = float("-inf")
    values, ids = torch.topk(logits, k, dim=1)
    weights = torch.softmax(values, dim=-1)
    if case.routing == "one_expert":  # every slot of every token on the last rank's last expert
        ids.fill_(E - 1)
    elif case.routing == "unused_slots":  # -1 slots; the last rank's tokens route nowhere
        ids[torch.rand(N, k, generator=gen) < 0.3] = -1
        ids[(W - 1) * T:] = -1
    x = randn(N, H)
    routed = (randn(E, I, H, scale=H**-0.5), randn(E, I, H, scale=H**-0.5),
              randn(E, H, I, scale=I**-0.5))
    if case.shared == "none":
        shared = [None] * W
    else:
        one = lambda: (randn(I, H, scale=H**-0.5), randn(I, H, scale=H**-0.5),  # noqa: E731
                       randn(H, I, scale=I**-0.5))
        shared = [one()] * W if case.shared == "replicated" else [one() for _ in range(W)]
    d_out = randn(N, H, scale=H**-0.5)
    return Problem(x, ids.contiguous(), weights.contiguous(), routed, shared, d_out)


# ---------------------------------------------------------------------------------------------
# Checks that record a failure instead of raising (every rank must reach every collective).


def check_close(chk, name, got, ref):
    """MoK's output tolerance: abs max <= 0.5 and sum|diff| / sum|ref| <= 0.01, whole tensor."""
    chk.count += 1
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        chk.failures.append(f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}")
        return
    if not bool(torch.isfinite(got).all()):
        chk.failures.append(f"{name}: {int((~torch.isfinite(got)).sum())} non-finite values "
                            "(an unwritten, poisoned output?)")
        return
    diff = (got - ref).abs()
    rel = float(diff.sum() / ref.abs().sum().clamp(min=1e-30))
    if got.numel() and (float(diff.max()) > ABS_MAX or rel > REL_SUM):
        chk.failures.append(f"{name}: abs max {float(diff.max()):.4g} (<= {ABS_MAX}), relative "
                            f"sum {rel:.4g} (<= {REL_SUM})")


def check_cosine(chk, name, got, ref):
    """MoK's gradient tolerance: cosine >= 0.9999; a zero reference demands exact zeros."""
    chk.count += 1
    if got is None:
        chk.failures.append(f"{name}: None")
        return
    got, ref = got.detach().double().flatten(), ref.detach().double().flatten()
    if got.shape != ref.shape:
        chk.failures.append(f"{name}: {got.numel()} values, reference {ref.numel()}")
        return
    if not bool(torch.isfinite(got).all()):
        chk.failures.append(f"{name}: non-finite values (an unwritten, poisoned output?)")
        return
    if float(ref.norm()) == 0:
        if float(got.norm()) != 0:
            chk.failures.append(f"{name}: reference is zero, got norm {float(got.norm())}")
        return
    cos = float(torch.dot(got, ref) / (got.norm() * ref.norm()).clamp(min=1e-300))
    if cos < COSINE:
        chk.failures.append(f"{name}: cosine {cos:.6f} (>= {COSINE})")


def expect_error(chk, what, kinds, parts, fn):
    """`fn()` raises one of `kinds` (a type or a tuple) whose message holds every one of
    `parts`."""
    chk.count += 1
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    try:
        fn()
    except kinds as e:
        missing = [p for p in parts if p not in str(e)]
        if missing:
            chk.failures.append(f"{what}: {missing} not in: {e}")
        return
    except Exception as e:  # noqa: BLE001
        chk.failures.append(f"{what}: expected {'/'.join(k.__name__ for k in kinds)}, got "
                            f"{type(e).__name__}: {e}")
        return
    chk.failures.append(f"{what}: no error")


def check_list(chk, name, got, want):
    chk.count += 1
    got = got.tolist()
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got),
                                                                                  len(want)))
        chk.failures.append(f"{name}: {len(got)} entries, want {len(want)}; first difference at "
                            f"{at}: {got[at:at + 4]} vs {want[at:at + 4]}")


# ---------------------------------------------------------------------------------------------
# Independent expectations.


def expected_schedule(ids, W, T, k, El, rank):
    """This rank's table in MoK's terms from every rank's ids [W*T, k], derived directly from
    mok's documented order and padding: per local expert its rows in source rank, then slot
    t*k+j order, padded to 128 rows with -1; the table W*T*k + El*127 rows long, -1 beyond."""
    per_rank = ids.reshape(W, T * k).tolist()
    peer_rank, peer_slot, padded, unpadded = [], [], [], []
    for e in range(rank * El, (rank + 1) * El):
        rows = [(src, s) for src in range(W) for s in range(T * k) if per_rank[src][s] == e]
        n = -(-len(rows) // SEGMENT) * SEGMENT
        padded.append(n)
        unpadded.append(len(rows))
        peer_rank += [src for src, _ in rows] + [-1] * (n - len(rows))
        peer_slot += [s for _, s in rows] + [-1] * (n - len(rows))
    length = W * T * k + El * (SEGMENT - 1)
    fill = [-1] * (length - len(peer_rank))
    return peer_rank + fill, peer_slot + fill, padded, unpadded


def shared_reference(x, sg, su):
    """fp64 gate, up, hidden of the shared expert (what MoK's reference keeps)."""
    x, sg, su = x.double(), sg.double(), su.double()
    gate, up = x @ sg.T, x @ su.T
    return gate, up, torch.nn.functional.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# The layer suite.


def call_sequence(case, config, ws, x, ids, w, shared, routed, d_out, El):
    """MoK's calls in its tests' two forms. Returns (schedule, out, ctx, grads, ctx2, grads2)."""
    sg, su, sd = shared if shared is not None else (None, None, None)
    g, u, d = routed
    if case.keywords:
        schedule = functional.build_schedule(workspace=ws, config=config, top_experts=ids,
                                             num_local_experts=El)
        functional.validate_inputs(config=config, workspace=ws, schedule=schedule, x=x,
                                   router_weights=w, grad_output=d_out)
        kw = dict(config=config, workspace=ws, schedule=schedule, x=x, router_weights=w,
                  shared_gate_weights=sg, shared_up_weights=su, shared_down_weights=sd,
                  routed_gate_weights=g, routed_up_weights=u, routed_down_weights=d)
        out, ctx = functional.forward(**kw)
        grads = functional.backward(forward_context=ctx, grad_output=d_out, **kw)
        ctx2 = functional.recompute_forward_context(
            config=config, workspace=ws, schedule=schedule, x=x, shared_gate_weights=sg,
            shared_up_weights=su, routed_gate_weights=g, routed_up_weights=u)
        grads2 = functional.backward(forward_context=ctx2, grad_output=d_out, **kw)
    else:
        schedule = functional.build_schedule(ws, config, ids, num_local_experts=El)
        functional.validate_inputs(config, ws, schedule, x, w, d_out)
        out, ctx = functional.forward(config, ws, schedule, x, w, sg, su, sd, g, u, d, None)
        grads = functional.backward(config, ws, schedule, ctx, d_out, x, w, sg, su, sd, g, u, d,
                                    None)
        ctx2 = functional.recompute_forward_context(config, ws, schedule, x, sg, su, g, u, None)
        grads2 = functional.backward(config, ws, schedule, ctx2, d_out, x, w, sg, su, sd, g, u,
                                     d, None)
    return schedule, out, ctx, grads, ctx2, grads2


def one_process(config, p, shared, E, swiglu_limit=None):
    """mok in one process with every expert over every rank's tokens (the promised bits)."""
    N, H = p.x.shape
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=N,
                                     hidden_size=H, topk=p.ids.shape[1])
    schedule = functional.build_schedule(ws, config, p.ids, num_local_experts=E)
    sg, su, sd = shared if shared is not None else (None, None, None)
    out, ctx = functional.forward(config, ws, schedule, p.x, p.router_weights, sg, su, sd,
                                  *p.routed, swiglu_limit=swiglu_limit)
    grads = functional.backward(config, ws, schedule, ctx, p.d_out, p.x, p.router_weights, sg,
                                su, sd, *p.routed, swiglu_limit=swiglu_limit)
    return out, ctx, grads


def layer_case(chk, group, case, seed):
    W, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k = case.T, case.H, case.I, case.E, case.k
    El = E // W
    p = draw(case, W, seed)
    name = (f"W={W} EP rank {r} {case.name} T={T} {case.routing} shared={case.shared} "
            f"{'keywords' if case.keywords else 'positional'} {str(case.ids_dtype)[6:]} "
            f"config={case.config}")
    mine, local = slice(r * T, (r + 1) * T), slice(r * El, (r + 1) * El)
    config = CONFIGS[case.config]()

    x, ids, w, d_out = (t[mine].clone() for t in (p.x, p.ids, p.router_weights, p.d_out))
    ids = ids.to(case.ids_dtype)
    routed = tuple(t[local].clone() for t in p.routed)
    shared = p.shared[r]
    ws = get_workspace(config, group, device=torch.device("cpu"), num_local_tokens=T,
                       hidden_size=H, topk=k)
    chk.true(f"{name}: workspace (ep_rank, ep_size) {(ws.ep_rank, ws.ep_size)}",
             (ws.ep_rank, ws.ep_size) == (r, W))
    schedule, out, ctx, grads, ctx2, grads2 = call_sequence(case, config, ws, x, ids, w, shared,
                                                            routed, d_out, El)

    # The schedule in MoK's terms against the table derived from every rank's ids.
    want_rank, want_slot, want_tpe, want_rows = expected_schedule(p.ids, W, T, k, El, r)
    for field in ("peer_rank", "peer_token_idx", "num_tokens", "tokens_per_expert",
                  "top_experts", "rows_per_expert"):
        t = getattr(schedule, field)
        chk.true(f"{name}: schedule.{field} int32 CPU, got {t.dtype} {t.device}",
                 t.dtype == torch.int32 and t.device.type == "cpu")
    check_list(chk, f"{name}: schedule.peer_rank", schedule.peer_rank, want_rank)
    check_list(chk, f"{name}: schedule.peer_token_idx", schedule.peer_token_idx, want_slot)
    check_list(chk, f"{name}: schedule.tokens_per_expert", schedule.tokens_per_expert, want_tpe)
    check_list(chk, f"{name}: schedule.num_tokens", schedule.num_tokens, [sum(want_tpe)])
    chk.true(f"{name}: int(schedule.num_tokens.item())",
             int(schedule.num_tokens.item()) == sum(want_tpe))
    check_list(chk, f"{name}: schedule.rows_per_expert", schedule.rows_per_expert, want_rows)
    check_list(chk, f"{name}: schedule.top_experts", schedule.top_experts.reshape(-1),
               p.ids[mine].reshape(-1).tolist())
    chk.true(f"{name}: schedule.topk_experts int64", schedule.topk_experts.dtype == torch.int64)

    # Against the independent fp64 reference: the routed part over every rank's tokens, the
    # shared part over this rank's own tokens with its own shared expert.
    ref_routed = forward_and_grads(p.x, p.ids, p.router_weights, (*p.routed, None, None, None),
                                   p.d_out)
    ref_out, ref_dx = ref_routed[0][mine], ref_routed[1][mine]
    ref_dw = ref_routed[2][mine]
    ref_dg, ref_du, ref_dd = (t[local] for t in ref_routed[3:6])
    ref_shared = (None, None, None)
    if shared is not None:
        none = torch.full((T, k), -1, dtype=torch.int64)
        own = forward_and_grads(x, none, w, (*routed, *shared), d_out)
        ref_out, ref_dx = ref_out + own[0], ref_dx + own[1]
        ref_shared = own[6:9]
    check_close(chk, f"{name}: output", out, ref_out)
    want_grads = (ref_dx, ref_dw, ref_dg, ref_du, ref_dd, *ref_shared)
    chk.true(f"{name}: backward returns 8 gradients", len(grads) == 8)
    for gname, got, want in zip(GRAD_NAMES, grads, want_grads):
        if want is None:
            chk.true(f"{name}: {gname} None without a shared expert", got is None)
        else:
            check_cosine(chk, f"{name}: {gname}", got, want)

    # The context: MoK's shared fields against the reference (as MoK's forward test checks
    # them); the routed rows of this rank's experts' slots (one row per global slot on CPU).
    chk.true(f"{name}: a MoKForwardContext", isinstance(ctx, functional.MoKForwardContext))
    chk.true(f"{name}: ctx.x_routed [0, H] on CPU, got {tuple(ctx.x_routed.shape)}",
             tuple(ctx.x_routed.shape) == (0, H))
    if shared is not None:
        for field, want in zip(("gate_shared", "up_shared", "hidden_shared"),
                               shared_reference(x, shared[0], shared[1])):
            check_close(chk, f"{name}: ctx.{field}", getattr(ctx, field), want)
    else:
        chk.true(f"{name}: shared context fields None",
                 ctx.gate_shared is None and ctx.up_shared is None and ctx.hidden_shared is None)
    flat_ids = p.ids.reshape(-1)
    rows = (flat_ids >= r * El) & (flat_ids < (r + 1) * El)
    slot_x = p.x.repeat_interleave(k, dim=0)[rows].double()
    slot_e = flat_ids[rows]
    gate_ref = torch.einsum("nh,nih->ni", slot_x, p.routed[0][slot_e].double())
    up_ref = torch.einsum("nh,nih->ni", slot_x, p.routed[1][slot_e].double())
    for field, want in (("gate_routed", gate_ref), ("up_routed", up_ref),
                        ("hidden_routed", torch.nn.functional.silu(gate_ref) * up_ref)):
        got = getattr(ctx, field)
        chk.true(f"{name}: ctx.{field} [W*T*k, I], got {tuple(got.shape)}",
                 tuple(got.shape) == (W * T * k, I))
        if tuple(got.shape) == (W * T * k, I):
            check_close(chk, f"{name}: ctx.{field} rows of this rank's experts", got[rows], want)

    # recompute_forward_context: forward's context bit for bit, and the same gradients from it.
    for field in ("gate_routed", "up_routed", "hidden_routed"):
        chk.bits(f"{name}: recomputed ctx.{field}", getattr(ctx2, field)[rows],
                 getattr(ctx, field)[rows])
    if shared is not None:
        for field in ("gate_shared", "up_shared", "hidden_shared"):
            chk.bits(f"{name}: recomputed ctx.{field}", getattr(ctx2, field), getattr(ctx, field))
    for gname, a, b in zip(GRAD_NAMES, grads2, grads):
        if b is not None:
            chk.bits(f"{name}: {gname} from the recomputed context", a, b)

    # Bitwise the one-process layer with every expert over every rank's tokens (README). With
    # per-rank shared experts there is no such one process for the output and d_x; the router
    # weights' and routed experts' gradients and the routed context do not depend on them.
    same_shared = case.shared != "per_rank"
    one_out, one_ctx, one_grads = one_process(config, p, p.shared[0], E)
    if same_shared:
        chk.bits(f"{name}: output == one process", out, one_out[mine])
        chk.bits(f"{name}: d_x == one process", grads[0], one_grads[0][mine])
    chk.bits(f"{name}: d_router_weights == one process", grads[1], one_grads[1][mine])
    for i, gname in enumerate(GRAD_NAMES[2:5]):
        chk.bits(f"{name}: {gname} == one process", grads[2 + i], one_grads[2 + i][local])
    for field in ("gate_routed", "up_routed", "hidden_routed"):
        chk.bits(f"{name}: ctx.{field} == one process", getattr(ctx, field)[rows],
                 getattr(one_ctx, field)[rows])

    # Clamped SwiGLU (MoK's swiglu_limit) across ranks: the same bits as the one-process layer
    # with the same limit, and a limit that clamps these pre-activations changes the result.
    limit = 0.25
    sg, su, sd = shared if shared is not None else (None, None, None)
    out_l, ctx_l = functional.forward(config, ws, schedule, x, w, sg, su, sd, *routed,
                                      swiglu_limit=limit)
    grads_l = functional.backward(config, ws, schedule, ctx_l, d_out, x, w, sg, su, sd, *routed,
                                  swiglu_limit=limit)
    one_out_l, _, one_grads_l = one_process(config, p, p.shared[0], E, swiglu_limit=limit)
    if same_shared:
        chk.bits(f"{name}: swiglu_limit {limit}: output == one process", out_l, one_out_l[mine])
        chk.bits(f"{name}: swiglu_limit {limit}: d_x == one process", grads_l[0],
                 one_grads_l[0][mine])
    chk.bits(f"{name}: swiglu_limit {limit}: d_router_weights == one process", grads_l[1],
             one_grads_l[1][mine])
    for i, gname in enumerate(GRAD_NAMES[2:5]):
        chk.bits(f"{name}: swiglu_limit {limit}: {gname} == one process", grads_l[2 + i],
                 one_grads_l[2 + i][local])
    chk.true(f"{name}: swiglu_limit {limit} changes the routed gradients",
             not torch.equal(one_grads_l[4], one_grads[4]))

    # MoK's main_grads (keyword form; fp32, MoK's order: shared gate, routed gate, shared up,
    # routed up, shared down, routed down), accumulated into random starting values.
    if case.keywords:
        gen = torch.Generator().manual_seed(seed + 7)
        shapes = [(I, H), (El, I, H), (I, H), (El, I, H), (H, I), (El, H, I)]
        start = [torch.randn(s, generator=gen) for s in shapes]
        if shared is None:
            start[0] = start[2] = start[4] = None
        main = [t.clone() if t is not None else None for t in start]
        sg, su, sd = shared if shared is not None else (None, None, None)
        result = functional.backward(config, ws, schedule, ctx, d_out, x, w, sg, su, sd,
                                     *routed, main_grads=tuple(main))
        chk.bits(f"{name}: d_x with main_grads", result[0], grads[0])
        chk.bits(f"{name}: d_router_weights with main_grads", result[1], grads[1])
        order = ((1, ref_dg, "routed gate"), (3, ref_du, "routed up"), (5, ref_dd, "routed down"),
                 (0, ref_shared[0], "shared gate"), (2, ref_shared[1], "shared up"),
                 (4, ref_shared[2], "shared down"))
        for i, want, mname in order:
            if want is None:
                continue
            chk.true(f"{name}: main grad {mname} accumulated in place",
                     main[i].data_ptr() in {t.data_ptr() for t in result[2:] if t is not None})
            check_cosine(chk, f"{name}: main grad {mname} - start", main[i] - start[i], want)


def suite_layer(chk, seed):
    W, rank = dist.get_world_size(), dist.get_rank()
    for i, case in enumerate(cases(W)):
        layer_case(chk, dist.group.WORLD, case, seed + i)
    # EP subgroups. W = 4: DP x EP, EP groups {0, 2} and {1, 3} (the EP rank is not the global
    # rank), two different problems at once; W = 2: a subgroup object holding both ranks.
    if W == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        which = rank % 2
        mine = groups[which]
    else:
        which, mine = 0, dist.new_group([0, 1])
    case = Case("qwen3.5-like", 5, 256, 64, 20, 10, "skewed", "per_rank", True, torch.int32,
                "default")
    layer_case(chk, mine, case, seed + 100 + which)
    case = Case("kimi-k2-like", 4, 448, 128, 16, 8, "unused_slots", "replicated", False,
                torch.int64, "minimums")
    layer_case(chk, mine, case, seed + 200 + which)


# ---------------------------------------------------------------------------------------------
# The api suite.


def suite_api(chk, seed):
    W, rank = dist.get_world_size(), dist.get_rank()
    world = dist.group.WORLD
    T, H, I, E, k = 4, 256, 64, 4 * W, 2
    El = E // W
    sub = dist.new_group(list(range(W)))  # another group of the same ranks
    alone = dist.new_group([0])  # only rank 0 is in it
    config = functional.MoKConfig()

    # MoKWorkspace's scalar fields and get_workspace's cache.
    ws = get_workspace(config, world, device="cpu", num_local_tokens=T, hidden_size=H, topk=k)
    chk.true(f"workspace fields {(ws.group_name, ws.ep_rank, ws.ep_size)}",
             (ws.group_name, ws.ep_rank, ws.ep_size) == (world.group_name, rank, W))
    chk.true(f"workspace shape fields {(ws.num_local_tokens, ws.hidden_size, ws.topk)}",
             (ws.num_local_tokens, ws.hidden_size, ws.topk) == (T, H, k))
    chk.true(f"workspace.schedule_capacity {ws.schedule_capacity}, want W*T*k",
             ws.schedule_capacity == W * T * k)
    chk.true("workspace.device", ws.device == torch.device("cpu"))
    expect_error(chk, "a MoK buffer field", AttributeError, ["x_buffer_ptrs"],
                 lambda: ws.x_buffer_ptrs)
    again = get_workspace(functional.MoKConfig(), world, device=torch.device("cpu"),
                          num_local_tokens=T, hidden_size=H, topk=k)
    chk.true("get_workspace: the same arguments give the cached workspace", again is ws)
    other = get_workspace(functional.MoKConfig(schedule_capacity_multiplier=4.0), world,
                          device="cpu", num_local_tokens=T, hidden_size=H, topk=k)
    chk.true("get_workspace: another capacity factor gives another workspace", other is not ws)
    on_sub = get_workspace(config, sub, device="cpu", num_local_tokens=T, hidden_size=H, topk=k)
    chk.true("get_workspace: another group gives another workspace", on_sub is not ws)
    chk.true(f"subgroup workspace fields {(on_sub.group_name, on_sub.ep_rank, on_sub.ep_size)}",
             (on_sub.group_name, on_sub.ep_rank, on_sub.ep_size)
             == (sub.group_name, rank, W) and sub.group_name != world.group_name)

    # validate_workspace_args: keyword-only arguments as MoK's; a group this rank is not in.
    functional.validate_workspace_args(config, world, device=torch.device("cpu"),
                                       num_local_tokens=T, hidden_size=H, topk=k)
    functional.validate_workspace_args(config, sub, device="cpu", num_local_tokens=T,
                                       hidden_size=H, topk=k)
    expect_error(chk, "validate_workspace_args: num_local_tokens 0", ValueError,
                 ["num_local_tokens"],
                 lambda: functional.validate_workspace_args(
                     config, world, device="cpu", num_local_tokens=0, hidden_size=H, topk=k))
    expect_error(chk, "validate_workspace_args: a config that is not a MoKConfig", TypeError,
                 ["config"],
                 lambda: functional.validate_workspace_args(
                     object(), world, device="cpu", num_local_tokens=T, hidden_size=H, topk=k))
    if rank != 0:
        expect_error(chk, "validate_workspace_args: a group without this rank", ValueError,
                     ["group"],
                     lambda: functional.validate_workspace_args(
                         config, alone, device="cpu", num_local_tokens=T, hidden_size=H, topk=k))

    # A MoK-style problem: per-rank inputs, MoK's failure loop over forward's arguments.
    case = Case("api", T, H, I, E, k, "uniform", "per_rank", True, torch.int64, "default")
    p = draw(case, W, seed)
    mine, local = slice(rank * T, (rank + 1) * T), slice(rank * El, (rank + 1) * El)
    x, ids, w, d_out = (t[mine].clone() for t in (p.x, p.ids, p.router_weights, p.d_out))
    g, u, d = (t[local].clone() for t in p.routed)
    sg, su, sd = p.shared[rank]
    schedule = functional.build_schedule(ws, config, ids, num_local_experts=El)
    valid = dict(config=config, workspace=ws, schedule=schedule, x=x, router_weights=w,
                 shared_gate_weights=sg, shared_up_weights=su, shared_down_weights=sd,
                 routed_gate_weights=g, routed_up_weights=u, routed_down_weights=d)
    out, ctx = functional.forward(**valid)

    functional.validate_inputs(config, ws, schedule, x, w, d_out)
    functional.validate_inputs(config=config, workspace=ws, schedule=schedule, x=x)
    bad_inputs = (("x dtype", dict(x=x.float()), "x.dtype"),
                  ("x shape", dict(x=x[:-1]), "x.shape"),
                  ("router weight dtype", dict(router_weights=w.to(torch.bfloat16)),
                   "router_weights"),
                  ("router weight shape", dict(router_weights=w[:, :0]), "router_weights"),
                  ("grad_output shape", dict(grad_output=d_out[:, :-1]), "grad_output"),
                  ("schedule type", dict(schedule=object()), "schedule"))
    base = dict(config=config, workspace=ws, schedule=schedule, x=x, router_weights=w,
                grad_output=d_out)
    for what, override, names in bad_inputs:
        expect_error(chk, f"validate_inputs: {what}", ERRORS, [names],
                     lambda o=override: functional.validate_inputs(**(base | o)))

    # MoK's failure loop (tests/test_functional_forward.py): the same bad argument on every
    # rank raises on every rank (some before any exchange, some after the call's header).
    failures = (("config type", {"config": object()}),
                ("workspace type", {"workspace": object()}),
                ("schedule type", {"schedule": object()}),
                ("input dtype", {"x": x.float()}),
                ("input shape", {"x": x[:-1]}),
                ("router weight dtype", {"router_weights": w.to(torch.bfloat16)}),
                ("router weight shape", {"router_weights": w[:, :0]}),
                ("swiglu_limit 0, which mok refuses", {"swiglu_limit": 0.0}),
                ("MXFP8 weight tuple", {"routed_gate_weights": (g, g)}))
    for what, override in failures:
        expect_error(chk, f"forward: {what}", ERRORS, [],
                     lambda o=override: functional.forward(**(valid | o)))
    expect_error(chk, "recompute_forward_context: input shape", ERRORS, [],
                 lambda: functional.recompute_forward_context(config, ws, schedule, x[:-1], sg,
                                                              su, g, u))
    bad_ids = ids.clone()
    bad_ids[0, 0] = E
    expect_error(chk, "build_schedule: an id >= num_experts on every rank", ValueError,
                 ["topk_experts", f"got {E}"],
                 lambda: functional.build_schedule(ws, config, bad_ids, num_local_experts=El))
    expect_error(chk, "build_schedule: top_experts with the wrong shape", ValueError,
                 ["top_experts.shape"],
                 lambda: functional.build_schedule(ws, config, ids[:-1], num_local_experts=El))
    # The group still works after all of the above, bit for bit.
    out2, _ = functional.forward(**valid)
    chk.bits("forward after the failures", out2, out)

    # clear_workspace_cache: a barrier on each cached workspace's group (WORLD and the subgroup
    # here), then the cache is dropped. Rank 0 arrives late; every rank waits for it.
    late = 1.5
    if rank == 0:
        time.sleep(late)
    start = time.monotonic()
    functional.clear_workspace_cache()
    waited = time.monotonic() - start
    if rank != 0:
        chk.true(f"clear_workspace_cache waited for rank 0 ({waited:.2f} s of {late} s)",
                 waited >= late - 0.3)
    fresh = get_workspace(config, world, device="cpu", num_local_tokens=T, hidden_size=H, topk=k)
    chk.true("get_workspace after clear_workspace_cache: a new workspace", fresh is not ws)
    schedule = functional.build_schedule(fresh, config, ids, num_local_experts=El)
    out3, _ = functional.forward(config, fresh, schedule, x, w, sg, su, sd, g, u, d)
    chk.bits("forward on the new workspace", out3, out)
    functional.clear_workspace_cache()  # every rank again: the barrier on WORLD only


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", choices=("layer", "api"), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="the group's timeout, s")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)
    poison.install()  # every output mok allocates starts as NaN (-1 for integers)
    chk = Checks(dist.get_rank())
    start = time.monotonic()
    try:
        (suite_layer if args.suite == "layer" else suite_api)(chk, args.seed)
    except Exception:  # noqa: BLE001
        chk.failures.append("unexpected error:\n" + traceback.format_exc())
    print(f"[rank {chk.rank}] {args.suite}: {time.monotonic() - start:.1f} s", flush=True)
    chk.finish(f"mok compat EP {args.suite}")


if __name__ == "__main__":
    main()
