"""One rank of the multi-process expert-parallel tests (CPU tensors, gloo), run by torchrun:

    torchrun --standalone --nproc-per-node W tests/python/host_ep_worker.py --suite S --seed N

tests/python/test_host_ep.py launches it for W = 2 and 4. Suites:

  layer     every rank's output, forward context, gradients (plain and fp32 main-grad),
            recompute_forward_context, mok.moe and mok.nn.MoE against one process holding every
            expert over the same global inputs, bit for bit; routings: random with -1 slots,
            skewed, all rows on one rank's expert, empty ranks, all slots unused; the shared
            expert's weight gradients against one process over the rank's own tokens. The FP8
            layer the same way: mok.moe with precision "fp8" and "fp8-bf16-wgrad" (random,
            skewed and empty-rank routings), mok.nn.MoE with "fp8", and MoK's calls with MX
            tuples (forward, backward, main grads, recompute). With W = 4 also two EP
            subgroups of 2 ranks running different problems at once.
  errors    (W = 2) mismatched shapes, configs and precisions named on every rank, a bad id on
            one rank raised on every rank, one rank's own argument error raised on every rank,
            different calls; the group still works afterwards. Then a rank that never calls:
            the other raises mok.TimeoutError within the group's timeout, no hang.
  dead      (W = 2) a rank that exits: the other raises mok's error, no hang.

Inputs are drawn anew each run from --seed (the same on every rank, so every rank can build the
global problem); outputs are poisoned (NaN) before mok writes them. Each rank prints
"[rank R] host EP SUITE: passed" when every check held, and exits 1 otherwise.
"""

import argparse
import copy
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import make_layer  # noqa: E402
import poison  # noqa: E402

import mok  # noqa: E402
import mok.ops  # noqa: E402
from mok import functional as mf  # noqa: E402

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64,
             torch.int32: torch.int32, torch.int64: torch.int64}


def same_bits(a, b):
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])))


class Checks:
    def __init__(self, rank):
        self.rank, self.failures, self.count = rank, [], 0

    def bits(self, what, got, want):
        self.count += 1
        if not same_bits(got, want):
            diff = (got.double() - want.double()).abs()
            self.failures.append(f"{what}: not bitwise equal (max |diff| "
                                 f"{diff.nan_to_num(1e9).max()}, NaN {int(diff.isnan().sum())})")

    def true(self, what, ok):
        self.count += 1
        if not ok:
            self.failures.append(what)

    def finish(self, label):
        """Prints every failure, or "[rank R] LABEL: passed (N checks)", and ends the process
        (exit status 1 on a failure): see end_process."""
        for f in self.failures:
            print(f"[rank {self.rank}] FAILED {f}", flush=True)
        if not self.failures:
            print(f"[rank {self.rank}] {label}: passed ({self.count} checks)", flush=True)
        end_process(1 if self.failures else 0)


def end_process(code):
    """destroy_process_group(), then os._exit(code) with stdout and stderr flushed. NOTES (issue
    41): no interpreter finalization, so that no thread of a library (gloo's worker threads
    releasing a collective's tensors) can take the GIL while it runs and abort the process after
    the checks passed."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a group that does not shut down fails the run too)
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def single(config, T, H, k):
    return mf.create_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                               topk=k)


def run_one_process(config, data, E, main=None):
    """forward + backward of the whole problem in one process: (out, ctx, grads, counts)."""
    T, H = data.x.shape
    k = data.topk_experts.shape[1]
    ws = single(config, T, H, k)
    sched = mf.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    out, ctx = mf.forward(config, ws, sched, data.x, data.topk_weights, sg, su, sd, g, u, d)
    grads = mf.backward(config, ws, sched, ctx, data.d_out, data.x, data.topk_weights, sg, su, sd,
                        g, u, d, main_grads=main)
    return out, ctx, grads, sched.rows_per_expert


def route(data, routing, W, T, E, gen):
    """Rewrites the global ids for the routings the conftest helper does not draw."""
    ids = data.topk_experts
    El = E // W
    if routing == "skewed":  # every other slot on expert 0 (rank 0 takes half of all rows)
        ids.view(-1)[::2] = 0
    elif routing == "empty_ranks":  # only rank 0's experts: the other ranks compute nothing
        ids.copy_(torch.randint(El, ids.shape, generator=gen))
    elif routing == "last_rank":  # every slot on the last rank's last expert
        ids.fill_(E - 1)


def layer_case(chk, group, config, case, seed):
    T, H, I, E, k, S, routing, dtype = case
    W, r = dist.get_world_size(group), dist.get_rank(group)
    El = E // W
    gen = torch.Generator().manual_seed(seed)
    base = "one_expert" if routing == "one_expert" else "none" if routing == "none" else "random"
    data = make_layer(gen, W * T, H, I, E, k, S, dtype=dtype, routing=base)
    route(data, routing, W, T, E, gen)
    name = f"W={W} rank {r} T={T} E={E} k={k} S={S} {routing} {str(dtype)[6:]}"
    mine = slice(r * T, (r + 1) * T)
    local = slice(r * El, (r + 1) * El)
    ref_out, ref_ctx, ref_grads, ref_counts = run_one_process(config, data, E)

    ws = mf.create_workspace(config, group, device="cpu", num_local_tokens=T, hidden_size=H,
                             topk=k)
    x, ids, w, d_out = (data.x[mine].clone(), data.topk_experts[mine].clone(),
                        data.topk_weights[mine].clone(), data.d_out[mine].clone())
    g, u, d = (t[local].clone() for t in data.weights[:3])
    sg, su, sd = data.weights[3:]
    sched = mf.build_schedule(ws, config, ids, num_local_experts=El)
    chk.bits(f"{name}: rows_per_expert", sched.rows_per_expert, ref_counts[local])
    out, ctx = mf.forward(config, ws, sched, x, w, sg, su, sd, g, u, d)
    chk.bits(f"{name}: out", out, ref_out[mine])

    # The context: rows of this rank's experts' slots (every rank's), and its own shared rows.
    rows = ((data.topk_experts >= r * El) & (data.topk_experts < (r + 1) * El)).reshape(-1)
    for field in ("gate_routed", "up_routed", "hidden_routed"):
        chk.bits(f"{name}: ctx.{field}", getattr(ctx, field)[rows], getattr(ref_ctx, field)[rows])
    if S > 0:
        for field in ("gate_shared", "up_shared", "hidden_shared"):
            chk.bits(f"{name}: ctx.{field}", getattr(ctx, field), getattr(ref_ctx, field)[mine])

    grads = mf.backward(config, ws, sched, ctx, d_out, x, w, sg, su, sd, g, u, d)
    d_x, d_w, dg, du, dd, dsg, dsu, dsd = grads
    chk.bits(f"{name}: d_x", d_x, ref_grads[0][mine])
    chk.bits(f"{name}: d_topk_weights", d_w, ref_grads[1][mine])
    for n, got, want in (("gate", dg, ref_grads[2]), ("up", du, ref_grads[3]),
                         ("down", dd, ref_grads[4])):
        chk.bits(f"{name}: d_routed_{n}", got, want[local])
    if S > 0:  # a data-parallel replica's: the gradient of this rank's own tokens
        own = make_layer(torch.Generator().manual_seed(0), T, H, I, E, k, S, dtype=dtype)
        own.x, own.topk_experts, own.topk_weights, own.d_out = (data.x[mine], data.topk_experts[
            mine], data.topk_weights[mine], data.d_out[mine])
        own.weights = data.weights
        own_grads = run_one_process(config, own, E)[2]
        for n, got, want in zip(("gate", "up", "down"), (dsg, dsu, dsd), own_grads[5:]):
            chk.bits(f"{name}: d_shared_{n}", got, want)
    else:
        chk.true(f"{name}: no shared gradients", dsg is None and dsu is None and dsd is None)

    # Activation checkpointing: the same context, the same gradients.
    ctx2 = mf.recompute_forward_context(config, ws, sched, x, sg, su, g, u)
    for field in ("gate_routed", "up_routed", "hidden_routed"):
        chk.bits(f"{name}: recomputed ctx.{field}", getattr(ctx2, field)[rows],
                 getattr(ctx, field)[rows])
    grads2 = mf.backward(config, ws, sched, ctx2, d_out, x, w, sg, su, sd, g, u, d)
    for i, (a, b) in enumerate(zip(grads2, grads)):
        if a is not None:
            chk.bits(f"{name}: gradient {i} from the recomputed context", a, b)

    # fp32 main-grad accumulation: the same sums added into the same starting values.
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    start = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(wide)
             if t is not None else None for t in data.weights]
    ref_main = [t.clone() if t is not None else None for t in start]
    run_one_process(config, data, E, main=(ref_main[3], ref_main[0], ref_main[4], ref_main[1],
                                           ref_main[5], ref_main[2]))
    ep_main = [t[local].clone() for t in start[:3]] + [
        t.clone() if t is not None else None for t in start[3:]]
    d_x_m, d_w_m, *_ = mf.backward(config, ws, sched, ctx, d_out, x, w, sg, su, sd, g, u, d,
                                   main_grads=(ep_main[3], ep_main[0], ep_main[4], ep_main[1],
                                               ep_main[5], ep_main[2]))
    chk.bits(f"{name}: d_x with main grads", d_x_m, d_x)
    chk.bits(f"{name}: d_topk_weights with main grads", d_w_m, d_w)
    for i, n in enumerate(("gate", "up", "down")):
        chk.bits(f"{name}: main grad routed {n}", ep_main[i], ref_main[i][local])

    # mok.moe: autograd over the same layer.
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, g, u, d)]
    shared = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (sg, su, sd)]
    out_moe = mok.moe(leaves[0], ids, leaves[1], *leaves[2:], *shared, workspace=ws)
    out_moe.backward(d_out)
    chk.bits(f"{name}: mok.moe out", out_moe.detach(), out)
    for i, (leaf, want) in enumerate(zip(leaves, (d_x, d_w, dg, du, dd))):
        chk.bits(f"{name}: mok.moe gradient {i}", leaf.grad, want)
    counts = ws.call_counts
    chk.true(f"{name}: call counts {counts}", counts == (2, 1, 4))


LAYER_CASES = [  # T, H, I, E, k, S, routing, dtype (E a multiple of 4: W = 2 and 4)
    (7, 64, 64, 8, 3, 64, "random", torch.bfloat16),
    (5, 64, 128, 8, 2, 0, "skewed", torch.bfloat16),
    (6, 64, 64, 8, 2, 64, "one_expert", torch.bfloat16),
    (4, 64, 64, 4, 2, 64, "empty_ranks", torch.bfloat16),
    (3, 64, 64, 8, 2, 0, "last_rank", torch.bfloat16),
    (4, 64, 64, 4, 2, 64, "none", torch.bfloat16),
    (1, 8, 4, 4, 1, 4, "random", torch.float64),
]


def module_case(chk, group, seed, precision="bf16"):
    """mok.nn.MoE with a group: its experts' gradients and its output against one process
    running mok.moe over every rank's routed tokens with every expert (the FP8 layer: H and I
    multiples of 128)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, S = (6, 64, 64, 8, 2, 64) if precision == "bf16" else (6, 128, 128, 8, 2, 128)
    torch.manual_seed(seed)  # the same router and shared expert on every rank
    layer = mok.nn.MoE(H, I, E, k, S, router="sigmoid", group=group, precision=precision)
    chk.true("MoE holds its rank's experts", layer.routed_gate_weights.shape[0] == E // W)
    with torch.no_grad():  # distinct experts per rank
        for p in (layer.routed_gate_weights, layer.routed_up_weights, layer.routed_down_weights):
            p.add_(0.01 * (r + 1))
    gen = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(W * T, H, generator=gen).to(torch.bfloat16)
    d_all = torch.randn(W * T, H, generator=gen).to(torch.bfloat16)
    x = x_all[r * T:(r + 1) * T].clone().requires_grad_(True)
    out, stats = layer(x)
    out.backward(d_all[r * T:(r + 1) * T])
    # What the module routed, and its experts, from every rank.
    ids, weights, _ = layer.route(x.detach())
    gathered = []
    for t in (ids, weights.detach(), layer.routed_gate_weights.detach(),
              layer.routed_up_weights.detach(), layer.routed_down_weights.detach()):
        parts = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(parts, t.contiguous(), group=group)
        gathered.append(torch.cat(parts))
    ids_all, w_all, g_all, u_all, d_all_w = gathered
    leaves = [t.clone().requires_grad_(True) for t in (g_all, u_all, d_all_w)]
    shared = (layer.shared_gate_weights.detach(), layer.shared_up_weights.detach(),
              layer.shared_down_weights.detach())
    ref = mok.moe(x_all, ids_all, w_all, *leaves, *shared, precision=precision)
    ref.backward(d_all)
    local = slice(r * (E // W), (r + 1) * (E // W))
    chk.bits(f"MoE rank {r}: out", out.detach(), ref.detach()[r * T:(r + 1) * T])
    for n, p, leaf in zip(("gate", "up", "down"), (layer.routed_gate_weights,
                          layer.routed_up_weights, layer.routed_down_weights), leaves):
        chk.bits(f"MoE rank {r}: d_routed_{n}", p.grad, leaf.grad[local])
    chk.true(f"MoE rank {r}: router gradient finite",
             bool(torch.isfinite(layer.router_weight.grad).all()))
    clone = copy.deepcopy(layer)  # a copy keeps the group
    chk.true(f"MoE rank {r}: a copy's workspace has the group", clone._workspace.group is group)
    with torch.no_grad():
        chk.bits(f"MoE rank {r}: a copy's out", clone(x.detach())[0], out.detach())


def fp8_case(chk, group, precision, routing, seed, device="cpu"):
    """mok.moe with precision "fp8" or "fp8-bf16-wgrad" across the group against one process
    running it over every rank's tokens with every expert: out, d_x, d_topk_weights and this
    rank's experts' gradients bit for bit; the shared expert's gradients against one process over
    this rank's own tokens (a data-parallel replica's). `device` "cuda:N": the CUDA team over
    symmetric memory (gpu_ep_worker.py), one GPU per rank."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, S = 5, 128, 128, max(4, 2 * W), 2, 128
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, W * T, H, I, E, k, S, routing="one_expert" if routing ==
                      "one_expert" else "random")
    route(data, routing, W, T, E, gen)
    data = data.to(device)
    name = f"W={W} rank {r} {precision} {routing} {device}"
    mine, local = slice(r * T, (r + 1) * T), slice(r * (E // W), (r + 1) * (E // W))

    def run(x, ids, tw, d_out, routed, workspace):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, tw, *routed)]
        shared = [t.detach().clone().requires_grad_(True) for t in data.weights[3:]]
        out = mok.moe(leaves[0], ids, leaves[1], *leaves[2:], *shared, workspace=workspace,
                      precision=precision)
        out.backward(d_out)
        return out.detach(), [t.grad for t in leaves + shared]

    ref_out, ref = run(data.x, data.topk_experts, data.topk_weights, data.d_out,
                       data.weights[:3], None)
    own_out, own = run(data.x[mine], data.topk_experts[mine], data.topk_weights[mine],
                       data.d_out[mine], data.weights[:3], None)
    ws = mf.create_workspace(mf.MoKConfig(), group, device=device, num_local_tokens=T,
                             hidden_size=H, topk=k)
    out, got = run(data.x[mine], data.topk_experts[mine], data.topk_weights[mine],
                   data.d_out[mine], [t[local] for t in data.weights[:3]], ws)
    chk.bits(f"{name}: out", out, ref_out[mine])
    chk.bits(f"{name}: out (own tokens, one process)", out, own_out)
    chk.bits(f"{name}: d_x", got[0], ref[0][mine])
    chk.bits(f"{name}: d_topk_weights", got[1], ref[1][mine])
    for i, n in enumerate(("gate", "up", "down")):
        chk.bits(f"{name}: d_routed_{n}", got[2 + i], ref[2 + i][local])
        chk.bits(f"{name}: d_shared_{n}", got[5 + i], own[5 + i])


def mx_case(chk, group, seed):
    """MoK's calls with MX tuples (mok.functional: forward, backward, backward with fp32 main
    grads, recompute_forward_context) across the group, each rank holding the MX tuples of its
    own experts (mxfp8_quantize of its slice), against one process calling them with every
    expert's tuples over every rank's tokens: out, d_x, d_router_weights, the local experts'
    gradients and main grads, the context's rows of this rank's experts, bit for bit."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, S = 5, 128, 128, 4, 2, 0
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, W * T, H, I, E, k, S)
    mine, local = slice(r * T, (r + 1) * T), slice(r * (E // W), (r + 1) * (E // W))
    config = mf.MoKConfig()

    def calls(ws, x, ids, w, d_out, routed, El):
        (g, gs, gt, gts), (u, us, ut, uts), (d, ds, dt, dts) = (
            mok.ops.mxfp8_quantize(t.contiguous(), True, True) for t in routed)
        sched = mf.build_schedule(ws, config, ids, num_local_experts=El)
        out, ctx = mf.forward(config, ws, sched, x, w, None, None, None, (g, gs), (u, us),
                              (d, ds))
        grads = mf.backward(config, ws, sched, ctx, d_out, x, w, None, None, None,
                            (g, gs, gt, gts), (u, us, ut, uts), (dt, dts))
        main = tuple(torch.zeros(t.shape) if t is not None else None
                     for t in (None, grads[2], None, grads[3], None, grads[4]))
        mf.backward(config, ws, sched, ctx, d_out, x, w, None, None, None, (g, gs, gt, gts),
                    (u, us, ut, uts), (dt, dts), main_grads=main)
        again = mf.recompute_forward_context(config, ws, sched, x, None, None, (g, gs), (u, us))
        return out, ctx, grads, main, again

    one = mf.create_workspace(config, None, device="cpu", num_local_tokens=W * T, hidden_size=H,
                              topk=k)
    ref = calls(one, data.x, data.topk_experts, data.topk_weights, data.d_out, data.weights[:3], E)
    ws = mf.create_workspace(config, group, device="cpu", num_local_tokens=T, hidden_size=H,
                             topk=k)
    got = calls(ws, data.x[mine], data.topk_experts[mine], data.topk_weights[mine],
                data.d_out[mine], [t[local] for t in data.weights[:3]], E // W)
    name = f"MX W={W} rank {r}"
    chk.bits(f"{name}: out", got[0], ref[0][mine])
    chk.bits(f"{name}: d_x", got[2][0], ref[2][0][mine])
    chk.bits(f"{name}: d_router_weights", got[2][1], ref[2][1][mine])
    for i, n in enumerate(("gate", "up", "down")):
        chk.bits(f"{name}: d_routed_{n}", got[2][2 + i], ref[2][2 + i][local])
        chk.bits(f"{name}: main grad routed {n}", got[3][1 + 2 * i], ref[3][1 + 2 * i][local])
    rows = ((data.topk_experts >= local.start) & (data.topk_experts < local.stop)).reshape(-1)
    for field in ("gate_routed", "up_routed", "hidden_routed"):
        chk.bits(f"{name}: ctx.{field}", getattr(got[1], field)[rows],
                 getattr(ref[1], field)[rows])
        chk.bits(f"{name}: recomputed ctx.{field}", getattr(got[4], field)[rows],
                 getattr(ref[4], field)[rows])


def suite_layer(chk, seed):
    config = mf.MoKConfig()
    world = dist.group.WORLD
    for i, case in enumerate(LAYER_CASES):
        layer_case(chk, world, config, case, seed + i)
    module_case(chk, world, seed)
    for i, (precision, routing) in enumerate((("fp8", "random"), ("fp8-bf16-wgrad", "skewed"),
                                              ("fp8", "empty_ranks"))):
        fp8_case(chk, world, precision, routing, seed + 200 + i)
    module_case(chk, world, seed + 300, precision="fp8")
    mx_case(chk, world, seed + 400)
    if dist.get_world_size() == 4:  # two EP groups of 2 ranks, different problems at once
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[dist.get_rank() // 2]
        case = (5, 64, 64, 4, 2, 64, "random", torch.bfloat16)
        layer_case(chk, mine, config, case, seed + 100 + dist.get_rank() // 2)


def expect_error(chk, what, kind, parts, fn):
    chk.count += 1
    try:
        fn()
    except kind as e:
        if os.environ.get("MOK_TEST_VERBOSE"):
            print(f"[rank {chk.rank}] {what}: {type(e).__name__}: {e}", flush=True)
        missing = [p for p in parts if p not in str(e)]
        if missing:
            chk.failures.append(f"{what}: {missing} not in: {e}")
        return
    except Exception as e:  # noqa: BLE001
        chk.failures.append(f"{what}: expected {kind.__name__}, got {type(e).__name__}: {e}")
        return
    chk.failures.append(f"{what}: no error")


def suite_errors(chk, seed, timeout):
    r = dist.get_rank()
    config = mf.MoKConfig()
    H, I, E, k, S = 64, 128, 4, 2, 64
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, 2 * 5, H, I, E, k, S)

    def call(T=5, I_=I, cfg=config, ids=None, x_dtype=None, op="forward"):
        ws = mf.create_workspace(cfg, dist.group.WORLD, device="cpu", num_local_tokens=T,
                                 hidden_size=H, topk=k)
        x = data.x[r * 5:r * 5 + T].clone()
        if x_dtype is not None:
            x = x.to(x_dtype)
        the_ids = (data.topk_experts[r * 5:r * 5 + T] if ids is None else ids).clone()
        w = data.topk_weights[r * 5:r * 5 + T].clone()
        g, u, d = (t[r * 2:r * 2 + 2] for t in data.weights[:3])
        g, u, d = g[:, :I_].contiguous(), u[:, :I_].contiguous(), d[:, :, :I_].contiguous()
        sched = mf.MoKSchedule(the_ids, E, 2, 2 * r, ws.handle)  # skips build_schedule's check
        if op == "forward":
            return mf.forward(cfg, ws, sched, x, w, *data.weights[3:], g, u, d)
        return mf.recompute_forward_context(cfg, ws, sched, x, *data.weights[3:5], g, u)

    expect_error(chk, "different T", ValueError,
                 ["num_tokens (x.shape[0])", "the same value on every rank", "5 on rank 0",
                  "4 on rank 1"], lambda: call(T=5 if r == 0 else 4))
    expect_error(chk, "different I", ValueError,
                 ["intermediate_size (routed_gate_weights.shape[1])", "128 on rank 0",
                  "64 on rank 1"], lambda: call(I_=I if r == 0 else I // 2))
    cfg1 = mf.MoKConfig(minibatch_size=4096 if r == 0 else 2048)
    expect_error(chk, "different config", ValueError,
                 ["config.minibatch_size", "4096 on rank 0", "2048 on rank 1"],
                 lambda: call(cfg=cfg1))
    bad = data.topk_experts[r * 5:r * 5 + 5].clone()
    if r == 1:
        bad[3, 1] = 7
    expect_error(chk, "bad id on rank 1, forward", ValueError,
                 ["topk_experts[3, 1] of rank 1", "[-1, 4)", "got 7"], lambda: call(ids=bad))
    ws = mf.create_workspace(config, dist.group.WORLD, device="cpu", num_local_tokens=5,
                             hidden_size=H, topk=k)
    expect_error(chk, "bad id on rank 1, build_schedule", ValueError,
                 ["topk_experts[3, 1] of rank 1", "got 7"],
                 lambda: mf.build_schedule(ws, config, bad, num_local_experts=2))
    expect_error(chk, "one rank's own argument error", TypeError,
                 ["x.dtype", "float32"] if r == 1 else
                 ["rank 1 of the EP group rejected its forward call", "x.dtype"],
                 lambda: call(x_dtype=torch.float32 if r == 1 else None))
    expect_error(chk, "different calls", RuntimeError,
                 ["called different ops", "forward on rank 0",
                  "recompute_forward_context on rank 1"],
                 lambda: call(op="forward" if r == 0 else "recompute"))
    # Ranks calling the layer in different precisions (the header's precision field).
    data8 = make_layer(gen, 2 * 5, 128, 128, E, k, 0)

    def call8(precision):
        ws = mf.create_workspace(config, dist.group.WORLD, device="cpu", num_local_tokens=5,
                                 hidden_size=128, topk=k)
        return mok.moe(data8.x[r * 5:r * 5 + 5], data8.topk_experts[r * 5:r * 5 + 5],
                       data8.topk_weights[r * 5:r * 5 + 5],
                       *(t[r * 2:r * 2 + 2] for t in data8.weights[:3]), workspace=ws,
                       precision=precision)

    expect_error(chk, "different precisions", ValueError,
                 ["precision", "the same value on every rank", "'fp8' on rank 0",
                  "'fp8-bf16-wgrad' on rank 1"],
                 lambda: call8("fp8" if r == 0 else "fp8-bf16-wgrad"))
    expect_error(chk, "bf16 and FP8", ValueError,
                 ["precision", "'bf16' on rank 0", "'fp8' on rank 1"],
                 lambda: call8("bf16" if r == 0 else "fp8"))
    # On CUDA a group of several ranks runs through symmetric memory (its suite needs a GPU per
    # rank: test_gpu_ep.py); without the CUDA backend asking for it is mok's own error.
    if mok.backend_available("cuda"):
        ws = mf.get_workspace(config, dist.group.WORLD, device="cuda", num_local_tokens=5,
                              hidden_size=H, topk=k)
        chk.true("a CUDA workspace of the group", (ws.ep_size, ws.ep_rank) == (2, r))
    else:
        expect_error(chk, "a group of several ranks on CUDA without the CUDA backend",
                     RuntimeError, ["the CUDA backend is not available"],
                     lambda: mf.get_workspace(config, dist.group.WORLD, device="cuda",
                                              num_local_tokens=5, hidden_size=H, topk=k))
    out, _ = call()  # the group still works after all of the above
    chk.true("a good call after the errors", bool(torch.isfinite(out.float()).all()))

    # A rank that never calls: rank 0 waits the group's timeout and raises mok.TimeoutError.
    if r == 1:
        time.sleep(timeout + 4)
        return
    start = time.monotonic()
    expect_error(chk, "a rank that never calls", mok.TimeoutError,
                 ["forward on rank 0", "gave up waiting for the call's header",
                  "did not call forward"], call)
    took = time.monotonic() - start
    chk.true(f"timed out within the bound ({took:.1f} s for a {timeout} s timeout)",
             timeout - 0.5 <= took <= timeout + 5)


def suite_dead(chk, seed):
    r = dist.get_rank()
    if r == 1:
        os._exit(0)  # dies without a word
    time.sleep(1)
    config = mf.MoKConfig()
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, 4, 64, 64, 4, 2, 0)
    ws = mf.create_workspace(config, dist.group.WORLD, device="cpu", num_local_tokens=4,
                             hidden_size=64, topk=2)
    start = time.monotonic()
    expect_error(chk, "a rank that died", RuntimeError, ["mok: forward on rank 0"],
                 lambda: mf.forward(config, ws, mf.MoKSchedule(data.topk_experts, 4, 2, 0,
                                                               ws.handle),
                                    data.x, data.topk_weights, None, None, None,
                                    *(t[:2] for t in data.weights[:3])))
    chk.true("raised within the bound", time.monotonic() - start < 30)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", choices=("layer", "errors", "dead"), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="the group's timeout, s")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)
    poison.install()  # every output mok allocates starts as NaN (-1 for integers)
    rank = dist.get_rank()
    chk = Checks(rank)
    try:
        if args.suite == "layer":
            suite_layer(chk, args.seed)
        elif args.suite == "errors":
            suite_errors(chk, args.seed, args.timeout)
        else:
            suite_dead(chk, args.seed)
    except Exception:  # noqa: BLE001
        chk.failures.append("unexpected error:\n" + traceback.format_exc())
    chk.finish(f"host EP {args.suite}")


if __name__ == "__main__":
    main()
