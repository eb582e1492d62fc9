"""A user's training step in the CPU form of expert parallelism, ending the way a user's script
ends: torchrun runs it in W processes (gloo, CPU tensors),

    torchrun --standalone --nproc-per-node 4 tests/python/ep_exit_worker.py [--api A] [--steps N]

Each rank runs forward + backward of a tiny layer through mok.functional (a cached workspace of
the group: get_workspace) and mok.nn.MoE(..., group=) (--api picks one or both), all-reduces
whether its results are finite, calls dist.destroy_process_group() and ends with sys.exit, as a
user's script does (an interpreter exit, not os._exit). Its exit status is the test.

Issue 41 saw one rank in about 16 such runs abort at exit (SIGABRT, "terminate called without an
active exception"): gloo's worker threads outlived destroy_process_group() because the group was
still referenced (by mok's cached workspaces, and by torch.distributed.nn.functional's defaults,
imported after init_process_group by mok's first call), and one of them, releasing the last
collective's tensors, took the GIL while the interpreter finalized. Each rank therefore also
checks that no gloo worker thread is left after destroy_process_group(), which fails every run
while the group is held, not only the rare run that aborts. scripts/ep-exit-loop runs it many
times; tests/python/test_ep_exit.py a few.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import mok
from mok import functional as mf

T, H, I, K, S = 4, 64, 64, 2, 64  # per rank: tokens, hidden, intermediate, topk, shared
EXPERTS_PER_RANK = 2


def functional_step(group, gen, W, r):
    """forward + backward through mok.functional: the sum of every gradient's squares."""
    E, El = EXPERTS_PER_RANK * W, EXPERTS_PER_RANK
    config = mf.MoKConfig()
    ws = mf.get_workspace(config, group, device="cpu", num_local_tokens=T, hidden_size=H, topk=K)
    bf = torch.bfloat16
    x = torch.randn(T, H, generator=gen).to(bf)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    g, u = ((torch.randn(El, I, H, generator=gen) * H**-0.5).to(bf) for _ in range(2))
    d = (torch.randn(El, H, I, generator=gen) * I**-0.5).to(bf)
    sg, su = ((torch.randn(S, H, generator=gen) * H**-0.5).to(bf) for _ in range(2))
    sd = (torch.randn(H, S, generator=gen) * S**-0.5).to(bf)
    d_out = torch.randn(T, H, generator=gen).to(bf)
    schedule = mf.build_schedule(ws, config, ids, num_local_experts=El)
    out, ctx = mf.forward(config, ws, schedule, x, w, sg, su, sd, g, u, d)
    grads = mf.backward(config, ws, schedule, ctx, d_out, x, w, sg, su, sd, g, u, d)
    return out.float().square().sum() + sum(t.float().square().sum() for t in grads)


def module_step(group, W, r):
    """forward + backward through mok.nn.MoE with the group: the loss plus its gradients'."""
    torch.manual_seed(1)  # the same router and shared expert on every rank
    layer = mok.nn.MoE(H, I, EXPERTS_PER_RANK * W, K, S, router="sigmoid", group=group)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + r)).to(torch.bfloat16)
    x.requires_grad_(True)
    out, stats = layer(x)
    loss = out.float().square().mean() + 1e-3 * stats.load_balancing_loss
    loss.backward()
    return loss.detach() + sum(p.grad.float().square().sum() for p in layer.parameters()
                               if p.grad is not None) + x.grad.float().square().sum()


def train(args):
    """The steps on every rank, then the last collective: whether every rank's results are
    finite (an all_reduce of a tensor Python owns, as a loss's or a metric's is)."""
    group, W, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + r)
    total = torch.zeros((), dtype=torch.float32)
    for _ in range(args.steps):
        if args.api in ("functional", "both"):
            total += functional_step(group, gen, W, r)
        if args.api in ("module", "both"):
            total += module_step(group, W, r)
    ok = torch.tensor([float(torch.isfinite(total))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok.item() == 1.0


def gloo_threads():
    """How many of gloo's worker threads (pt_gloo_runloop) this process runs; None where the
    threads' names cannot be read (no /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("functional", "module", "both"), default="both")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)  # W processes on a machine of few cores
    r = dist.get_rank()
    ok = train(args)
    dist.destroy_process_group()
    # The group's last reference gone, its worker threads are joined: none may be left to run
    # into interpreter exit (the race is rare; this check fails every run while one is left).
    left = gloo_threads()
    if not ok:
        print(f"[rank {r}] ep exit: FAILED non-finite results on some rank", flush=True)
        return 1
    if left:
        print(f"[rank {r}] ep exit: FAILED {left} gloo worker threads outlived "
              "destroy_process_group() (something still holds the group)", flush=True)
        return 1
    print(f"[rank {r}] ep exit: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
