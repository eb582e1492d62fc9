#!/usr/bin/env python3
"""The expert-parallel layer suite (suite "layer-ep"), one process per rank under torchrun:

    torchrun --standalone --nproc-per-node W bench/bench_ep.py [--device cpu|cuda]
             [--cases a,b] [--routings uniform,skewed] [--reps 20] [--warmup 5] [--quick]
             [--out FILE]

Every rank holds its own T tokens and E/W experts. Implementations, forward and forward+backward:
  mok         mok.moe with a workspace of the EP group (mok.functional.get_workspace(config,
              group, ...)): on CUDA the device moves the rows through PyTorch symmetric memory
              (no NVLink multicast); on the CPU the host form (gloo, mok's CPU reference
              backend). Where mok refuses the group, the script says why and times the others
  torch       the layer a user would write today: all_to_all_single dispatch of the routed rows to
              their experts' ranks (split sizes exchanged first: a host synchronisation), the
              PyTorch expert computation of bench_layer.py (bench/torch_moe.py, grouped_mm),
              all_to_all_single combine back, the fp32 weighted index_add_ at home; autograd
              through torch.distributed.nn's all_to_all_single
  mok-ep1     the same per-rank work without expert parallelism: mok.moe on this rank's T tokens
              with all E experts in one process (forward and forward+backward)
  a2a         the baseline's dispatch and combine alone (two all_to_all_single of the routed
              rows): its GB/s per rank is the transport's
Each time is the slowest rank's median (every rank takes its median of --reps calls, each call
between barriers; the maximum over ranks is recorded), after --warmup calls. On CUDA each call
is timed with CUDA events; on the CPU with perf_counter. Before timing, mok's and torch's outputs
are compared (relative Frobenius error, recorded). Rank 0 writes PERF.md's schema: {"gpu" (or
"cpu": the processor), "device", "commit", "date", "cases": [...]} with suite "layer-ep" and W in
each case, to --out (default docs/perf/layer_ep.json on CUDA; on the CPU nothing is written
unless --out is given: CPU numbers are smoke runs of the script, not measurements of mok's
speed).
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import event_ms  # noqa: E402
from torch_moe import prepare_weights, torch_moe  # noqa: E402

import mok  # noqa: E402
from mok import functional as mf  # noqa: E402

# Per-rank shapes. name: (T, H, I, E, k, S), E the global expert count.
CASES = {
    "dsv3-ep8slice": (4096, 7168, 2048, 256, 8, 2048),  # DeepSeek-V3 at EP 8: 32 experts a rank
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8, 0),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2, 0),  # 8 experts: W <= 8
    "small": (2048, 1024, 512, 64, 6, 0),
    "cpu-smoke": (256, 256, 128, 16, 2, 0),  # seconds on a CPU: a check of the script
}
QUICK = dict(reps=5, warmup=2)


def routing(T, E, k, skewed, gen):
    """bench_layer.py's routings: softmax top-k (uniform), or expert 0 on every other slot."""
    logits = torch.randn(T, E, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    if skewed:
        flat = ids.reshape(-1).clone()
        flat[0::2] = 0
        ids = flat.view(T, k)
    return ids.to(torch.int64), w.float()


def make_rank_data(case, skewed, seed, rank, W, device):
    T, H, I, E, k, S = CASES[case]
    El = E // W
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    r = lambda *s, scale: (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16)  # noqa: E731
    d = dict(x=r(T, H, scale=1.0), d_out=r(T, H, scale=1.0),
             gate=r(El, I, H, scale=H ** -0.5), up=r(El, I, H, scale=H ** -0.5),
             down=r(El, H, I, scale=I ** -0.5))
    shared_gen = torch.Generator().manual_seed(seed)  # replicated: the same on every rank
    s = lambda *shape, scale: (torch.randn(*shape, generator=shared_gen) * scale).to(  # noqa: E731
        torch.bfloat16)
    d["shared"] = (s(S, H, scale=H ** -0.5), s(S, H, scale=H ** -0.5),
                   s(H, S, scale=S ** -0.5)) if S else None
    d["ids"], d["w"] = routing(T, E, k, skewed, gen)
    return {n: (tuple(t.to(device) for t in v) if isinstance(v, tuple) else
                v.to(device) if v is not None else None) for n, v in d.items()}


def a2a(x, out_splits, in_splits, group, differentiable):
    fn = dist_fn.all_to_all_single if differentiable else _a2a_plain
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    return fn(out, x, out_splits, in_splits, group=group)


def _a2a_plain(out, x, out_splits, in_splits, group):
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class TorchEP:
    """The baseline: dispatch, PyTorch experts, combine."""

    def __init__(self, data, El, group, W):
        self.data, self.El, self.group, self.W = data, El, group, W
        self.gate_up, self.down = prepare_weights(data["gate"], data["up"], data["down"])

    def routes(self):
        """Slots sorted by destination rank, the split sizes both ways (a host synchronisation),
        and each sent row's local expert on its rank."""
        ids = self.data["ids"]
        k = ids.shape[1]
        flat = ids.reshape(-1)
        dest = flat // self.El
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.W)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        local = (flat.index_select(0, order) % self.El).unsqueeze(1)
        local_recv = a2a(local, recv_l, send_l, self.group, False)
        return order, order // k, send_l, recv_l, local_recv

    def __call__(self, x, w, gate_up, down, shared):
        order, token, send_l, recv_l, local_recv = self.routes()
        xs = x.index_select(0, token)
        x_recv = a2a(xs, recv_l, send_l, self.group, True)
        ones = torch.ones(x_recv.shape[0], 1, device=x.device)
        y_recv = torch_moe(x_recv, local_recv, ones, gate_up, down)  # one slot a row: y rows
        y = a2a(y_recv, send_l, recv_l, self.group, True)
        T, H = x.shape
        scaled = y.float() * w.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros(T, H, device=x.device, dtype=torch.float32).index_add(0, token, scaled)
        if shared is not None:
            sg, su, sd = shared
            out = out + (torch.nn.functional.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
        return out.to(x.dtype)

    def transport_only(self):
        order, token, send_l, recv_l, _ = self.routes()
        x_recv = a2a(self.data["x"].index_select(0, token), recv_l, send_l, self.group, False)
        a2a(x_recv, send_l, recv_l, self.group, False)


def slowest_median_ms(fn, reps, warmup, device, group):
    """The maximum over the group's ranks of each rank's median time of fn()."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        sync()
        if device.type == "cuda":
            times.append(event_ms(fn))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    t = torch.tensor([times[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def rel_err(a, b):
    a, b = a.double(), b.double()
    t = torch.stack([(a - b).norm() ** 2, b.norm() ** 2])
    dist.all_reduce(t)
    return float((t[0] / t[1]).sqrt().item())


def run_case(case, routing_name, args, device, group, W, rank):
    T, H, I, E, k, S = CASES[case]
    El = E // W
    data = make_rank_data(case, routing_name == "skewed", args.seed, rank, W, device)
    shared = data["shared"] or (None, None, None)
    records = []
    base = dict(suite="layer-ep", case=case, routing=routing_name, W=W, T=T, H=H, I=I, E=E, k=k,
                S=S)

    def leaves():
        return [t.detach().clone().requires_grad_(True) for t in
                (data["x"], data["w"], data["gate"], data["up"], data["down"])]

    impls = {}
    try:
        ws = mf.get_workspace(mf.MoKConfig(), group, device=device, num_local_tokens=T,
                              hidden_size=H, topk=k)

        def mok_fwd(x, w, g, u, d):
            return mok.moe(x, data["ids"], w, g, u, d, *shared, workspace=ws)

        impls["mok"] = mok_fwd
    except (ValueError, RuntimeError) as e:
        if rank == 0:
            print(f"[bench_ep] {case}: mok not timed: {e}", flush=True)
    baseline = TorchEP(data, El, group, W)

    def torch_fwd(x, w, g, u, d):
        gate_up, down = prepare_weights(g, u, d)
        return baseline(x, w, gate_up, down, data["shared"])

    impls["torch"] = torch_fwd

    outs = {n: fn(*[t.detach() for t in leaves()]) for n, fn in impls.items()}
    if "mok" in outs:
        err = rel_err(outs["mok"], outs["torch"])
        if rank == 0:
            print(f"[bench_ep] {case} {routing_name}: mok vs torch out rel err {err:.2e}",
                  flush=True)

    # Bytes each rank sends in the dispatch and the combine (rows to other ranks).
    dest = data["ids"].reshape(-1) // El
    remote = int((dest != rank).sum())
    a2a_bytes = torch.tensor([2 * remote * H * 2], dtype=torch.float64, device=device)
    dist.all_reduce(a2a_bytes, op=dist.ReduceOp.MAX, group=group)

    for name, fn in impls.items():
        for pss in ("fwd", "fwd+bwd"):
            def call(fn=fn, pss=pss):
                if pss == "fwd":
                    with torch.no_grad():
                        fn(data["x"], data["w"], data["gate"], data["up"], data["down"])
                else:
                    fn(*leaves()).backward(data["d_out"])
            ms = slowest_median_ms(call, args.reps, args.warmup, device, group)
            rec = dict(base, impl=name, **{"pass": pss}, median_ms=round(ms, 4))
            if name == "mok" and "torch" in outs:
                rec["out_rel_err"] = err
            records.append(rec)

    # The same per-rank work without expert parallelism: all E experts in this process.
    full = [torch.cat([data[n]] * W) for n in ("gate", "up", "down")]  # E experts' shapes
    ws1 = mf.get_workspace(mf.MoKConfig(), None, device=device, num_local_tokens=T,
                           hidden_size=H, topk=k)
    for pss in ("fwd", "fwd+bwd"):
        def call_ep1(pss=pss):
            if pss == "fwd":
                with torch.no_grad():
                    mok.moe(data["x"], data["ids"], data["w"], *full, *shared, workspace=ws1)
            else:
                ls = [t.detach().clone().requires_grad_(True) for t in (data["x"], data["w"],
                                                                        *full)]
                mok.moe(ls[0], data["ids"], ls[1], *ls[2:], *shared,
                        workspace=ws1).backward(data["d_out"])
        ms = slowest_median_ms(call_ep1, args.reps, args.warmup, device, group)
        records.append(dict(base, impl="mok-ep1", **{"pass": pss}, median_ms=round(ms, 4)))

    ms = slowest_median_ms(baseline.transport_only, args.reps, args.warmup, device, group)
    records.append(dict(base, impl="a2a", **{"pass": "fwd"}, median_ms=round(ms, 4),
                        a2a_bytes_per_rank=int(a2a_bytes.item()),
                        a2a_gbps_per_rank=round(float(a2a_bytes.item()) / (ms * 1e6), 3)))
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", default=None)
    parser.add_argument("--routings", default="uniform,skewed")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.reps, args.warmup = QUICK["reps"], QUICK["warmup"]
    cases = args.cases.split(",") if args.cases else (
        ["cpu-smoke"] if args.device == "cpu" else
        ["small", "qwen3-30b-a3b", "dsv3-ep8slice", "mixtral-8x7b"])
    world = int(os.environ.get("WORLD_SIZE", 1))
    for c in cases:
        if c not in CASES:
            parser.error(f"unknown case {c!r} (one of {', '.join(CASES)})")
        if CASES[c][3] % world != 0:
            parser.error(f"case {c}: {CASES[c][3]} experts do not split over {world} ranks")

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) \
        if args.device == "cuda" else torch.device("cpu")
    group, W, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    records = []
    for case in cases:
        if CASES[case][3] % W:
            parser.error(f"case {case}: E = {CASES[case][3]} is not a multiple of W = {W}")
        for routing_name in args.routings.split(","):
            records += run_case(case, routing_name, args, device, group, W, rank)
    if rank == 0:
        for r in records:
            print(f"[bench_ep] W={r['W']} {r['case']:>14} {r['routing']:>7} {r['pass']:>7} "
                  f"{r['impl']:>8} {r['median_ms']:10.3f} ms", flush=True)
        commit = os.environ.get("MOK_COMMIT", "unknown")
        on_gpu = device.type == "cuda"
        doc = {"gpu": torch.cuda.get_device_name() if on_gpu else None,
               "cpu": None if on_gpu else (platform.processor() or platform.machine()),
               "device": device.type, "commit": commit,
               "date": datetime.date.today().isoformat(), "cases": records}
        if not on_gpu:
            doc["note"] = ("CPU smoke run of bench_ep.py (gloo, mok's CPU reference backend): a "
                           "check of the script, not a measurement of mok's speed")
        out = args.out or ("docs/perf/layer_ep.json" if on_gpu else None)
        if out:
            pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(out).write_text(json.dumps(doc, indent=1) + "\n")
            print(f"[bench_ep] {len(records)} records -> {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
