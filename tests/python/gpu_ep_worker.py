"""One rank of the multi-process expert-parallel tests on CUDA, run by torchrun, one GPU per
rank (NCCL group; the layer's rows move through PyTorch symmetric memory):

    torchrun --standalone --nproc-per-node W tests/python/gpu_ep_worker.py --seed N

tests/python/test_gpu_ep.py launches it. Every rank checks, bit for bit, its output, d_x, router
weight gradients and its experts' weight gradients against one process running the whole layer
(every expert, every rank's tokens) on its own GPU; routings random (with -1 slots), skewed
(half of all slots on rank 0's first expert), empty ranks (only rank 0's experts chosen) and
every slot on the last rank's last expert; each then a training step captured in a CUDA graph and
replayed with new inputs in place, against the same step run eagerly. The FP8 layer (mok.moe with
precision "fp8" and "fp8-bf16-wgrad", random and skewed routings) likewise, bit for bit against one
process running it over every rank's tokens (host_ep_worker.fp8_case), and an FP8 step captured in
a CUDA graph against the same step run eagerly (fp8_graph_case). Last, a rank that never
calls forward: the others' device waits give up within the bound and their next call raises mok's
error naming the rank that did not arrive (no rank hangs). Prints "[rank R] GPU EP: passed" when
every check held; exits 1 otherwise.
"""

import argparse
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
from host_ep_worker import Checks, fp8_case, route  # noqa: E402

import mok  # noqa: E402
import mok._workspace  # noqa: E402
import mok.ops  # noqa: E402
from mok import functional as mf  # noqa: E402

CASES = [  # T per rank, H, I, E, k, S, routing
    (48, 128, 128, 16, 4, 64, "random"),
    (40, 128, 192, 8, 2, 0, "skewed"),
    (32, 128, 128, 16, 4, 64, "empty_ranks"),
    (24, 128, 128, 16, 2, 0, "last_rank"),
]
FP8_CASES = [("fp8", "random"), ("fp8", "skewed"), ("fp8-bf16-wgrad", "random")]
NEVER_ARRIVES_TIMEOUT_S = 3


def whole_layer(config, data, E, device):
    """forward + backward of every rank's tokens with every expert, in this process."""
    T, H = data.x.shape
    k = data.topk_experts.shape[1]
    ws = mf.create_workspace(config, None, device=device, num_local_tokens=T, hidden_size=H,
                             topk=k)
    sched = mf.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    out, ctx = mf.forward(config, ws, sched, data.x, data.topk_weights, sg, su, sd, g, u, d)
    grads = mf.backward(config, ws, sched, ctx, data.d_out, data.x, data.topk_weights, sg, su,
                        sd, g, u, d)
    return out, grads, sched.rows_per_expert


def layer_case(chk, config, case, seed, device):
    T, H, I, E, k, S, routing = case
    W, r = dist.get_world_size(), dist.get_rank()
    El = E // W
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, W * T, H, I, E, k, S)
    route(data, routing, W, T, E, gen)
    data = data.to(device)
    name = f"W={W} rank {r} T={T} E={E} k={k} S={S} {routing}"
    ref_out, ref_grads, ref_counts = whole_layer(config, data, E, device)

    mine, local = slice(r * T, (r + 1) * T), slice(r * El, (r + 1) * El)
    ws = mf.create_workspace(config, dist.group.WORLD, device=device, num_local_tokens=T,
                             hidden_size=H, topk=k)
    x, ids, w, d_out = (t[mine].clone() for t in (data.x, data.topk_experts, data.topk_weights,
                                                   data.d_out))
    g, u, d = (t[local].clone() for t in data.weights[:3])
    sg, su, sd = data.weights[3:]
    sched = mf.build_schedule(ws, config, ids, num_local_experts=El)
    out, ctx = mf.forward(config, ws, sched, x, w, sg, su, sd, g, u, d)
    grads = mf.backward(config, ws, sched, ctx, d_out, x, w, sg, su, sd, g, u, d)
    chk.bits(f"{name}: rows_per_expert", sched.rows_per_expert, ref_counts[local])
    chk.bits(f"{name}: out", out, ref_out[mine])
    chk.bits(f"{name}: d_x", grads[0], ref_grads[0][mine])
    chk.bits(f"{name}: d_topk_weights", grads[1], ref_grads[1][mine])
    for n, i in (("gate", 2), ("up", 3), ("down", 4)):
        chk.bits(f"{name}: d_routed_{n}", grads[i], ref_grads[i][local])

    # A whole step captured in a CUDA graph (after the eager warm-up above created the team),
    # replayed with new inputs copied in place: the eager step's bits.
    x2, w2, d2 = x + 0.5, w.flip(1).contiguous(), d_out * 2
    eager_out, eager_ctx = mf.forward(config, ws, sched, x2, w2, sg, su, sd, g, u, d)
    eager_grads = mf.backward(config, ws, sched, eager_ctx, d2, x2, w2, sg, su, sd, g, u, d)
    xs, ws_, ds = x.clone(), w.clone(), d_out.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_ctx = mf.forward(config, ws, sched, xs, ws_, sg, su, sd, g, u, d)
        g_grads = mf.backward(config, ws, sched, g_ctx, ds, xs, ws_, sg, su, sd, g, u, d)
    xs.copy_(x2), ws_.copy_(w2), ds.copy_(d2)
    graph.replay()
    torch.cuda.synchronize()
    chk.bits(f"{name}: graph replay out", g_out, eager_out)
    for i in (0, 1, 2, 3, 4):
        chk.bits(f"{name}: graph replay gradient {i}", g_grads[i], eager_grads[i])


def fp8_graph_case(chk, precision, seed, device):
    """An FP8 step across the team (mok.moe forward, then torch.autograd.grad of every input and
    weight) captured in a CUDA graph after eager warm-up calls, replayed with new inputs copied in
    place: the bits of the same step run eagerly. The graph quantizes the weights on each replay
    (mok/_fp8_layer.py), so a replay after the weights changed in place must match too."""
    W, r = dist.get_world_size(), dist.get_rank()
    T, H, I, E, k, S = 24, 128, 256, 2 * W, 2, 128
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, W * T, H, I, E, k, S)
    route(data, "random", W, T, E, gen)
    data = data.to(device)
    mine, local = slice(r * T, (r + 1) * T), slice(r * (E // W), (r + 1) * (E // W))
    name = f"W={W} rank {r} {precision} graph"
    ws = mf.create_workspace(mf.MoKConfig(), dist.group.WORLD, device=device, num_local_tokens=T,
                             hidden_size=H, topk=k)
    ids = data.topk_experts[mine].clone()
    leaves = [t.detach().clone().requires_grad_(True) for t in
              (data.x[mine], data.topk_weights[mine], *(t[local] for t in data.weights[:3]),
               *data.weights[3:])]
    d_out = data.d_out[mine].clone()

    def step():
        out = mok.moe(leaves[0], ids, leaves[1], *leaves[2:], workspace=ws, precision=precision)
        return (out, *torch.autograd.grad(out, leaves, d_out))

    def set_inputs(x, d, scale):
        with torch.no_grad():
            leaves[0].copy_(x)
            d_out.copy_(d)
            leaves[4].mul_(scale)  # the down weights change in place: a new quantization

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: the workspace, the quantized weights
            step()
    torch.cuda.current_stream().wait_stream(side)
    x0, d0 = leaves[0].detach().clone(), d_out.clone()
    set_inputs(x0 + 0.5, d0 * 2, 2.0)
    eager = [t.clone() for t in step()]
    set_inputs(x0, d0, 0.5)  # back to the captured state
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    set_inputs(x0 + 0.5, d0 * 2, 2.0)
    graph.replay()
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(static, eager)):
        chk.bits(f"{name}: replay {'out' if i == 0 else f'gradient {i - 1}'}", got, want)


def never_arrives(chk, config, seed, device):
    """The last rank builds the schedule with the others, then never calls forward: every other
    rank's forward gives up on the device within the bound (its synchronize returns), and its next
    call raises mok's error naming the rank whose arrivals did not come."""
    W, r = dist.get_world_size(), dist.get_rank()
    T, H, I, E, k, S = 16, 128, 128, 2 * W, 2, 0
    gen = torch.Generator().manual_seed(seed)
    data = make_layer(gen, W * T, H, I, E, k, S).to(device)
    mine, local = slice(r * T, (r + 1) * T), slice(r * (E // W), (r + 1) * (E // W))
    x, ids, w = (t[mine].clone() for t in (data.x, data.topk_experts, data.topk_weights))
    g, u, d = (t[local].clone() for t in data.weights[:3])
    sg, su, sd = data.weights[3:]
    # The bound of this workspace's device waits: read when its team is made (mok._workspace).
    mok._workspace.barrier_timeout_ms = NEVER_ARRIVES_TIMEOUT_S * 1000
    ws = mf.create_workspace(config, dist.group.WORLD, device=device, num_local_tokens=T,
                             hidden_size=H, topk=k)
    sched = mf.build_schedule(ws, config, ids, num_local_experts=E // W)
    torch.cuda.synchronize()
    dist.barrier()
    if r == W - 1:
        time.sleep(NEVER_ARRIVES_TIMEOUT_S + 3)  # never calls forward
    else:
        start = time.monotonic()
        mf.forward(config, ws, sched, x, w, sg, su, sd, g, u, d)
        torch.cuda.synchronize()  # returns: the device waits gave up
        took = time.monotonic() - start
        chk.true(f"rank {r}: the device waits gave up within the bound ({took:.1f} s for "
                 f"{NEVER_ARRIVES_TIMEOUT_S} s)",
                 NEVER_ARRIVES_TIMEOUT_S - 0.5 <= took <= NEVER_ARRIVES_TIMEOUT_S + 5)
        chk.count += 1
        try:
            mf.build_schedule(ws, config, ids, num_local_experts=E // W)
            chk.failures.append(f"rank {r}: the call after the timeout raised nothing")
        except RuntimeError as e:
            for part in (f"timed out on rank {r}", f"arrivals from rank {W - 1}"):
                if part not in str(e):
                    chk.failures.append(f"rank {r}: {part!r} not in: {e}")
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
    poison.install()  # every output mok allocates starts as NaN (-1 for integers)
    rank = dist.get_rank()
    chk = Checks(rank)
    try:
        for i, case in enumerate(CASES):
            layer_case(chk, mf.MoKConfig(), case, args.seed + i, device)
        for i, (precision, routing) in enumerate(FP8_CASES):
            fp8_case(chk, dist.group.WORLD, precision, routing, args.seed + 100 + i, device)
        for i, precision in enumerate(("fp8", "fp8-bf16-wgrad")):
            fp8_graph_case(chk, precision, args.seed + 200 + i, device)
        never_arrives(chk, mf.MoKConfig(), args.seed + len(CASES), device)
    except Exception:  # noqa: BLE001
        chk.failures.append("unexpected error:\n" + traceback.format_exc())
    chk.finish("GPU EP")


if __name__ == "__main__":
    main()
