"""An FP8 mok.nn.MoE under FSDP2 with gradient accumulation: a training step's time with the
weights quantized at every micro-batch (is_first_microbatch=None: FSDP2's unsharded weights share
their memory with its all-gather buffer, so mok's cache quantizes every call) against once a step
(True, then False), bf16 beside them. One process, one GPU (NCCL, world 1: FSDP2's own gathers
and reductions around the layer).

    torchrun --standalone --nproc-per-node 1 bench/fsdp_accumulation.py [--cases a,b]
        [--micro 4] [--no-sync] [--out results.json]
    torchrun --standalone --nproc-per-node 1 bench/fsdp_accumulation.py --device cpu --cases tiny
        (the same logic on CPU tensors, gloo, wall clock: what tests/python checks)

--no-sync reduces the gradients once a step, as training loops that accumulate do
(FSDP2's set_requires_gradient_sync(False) before every micro-batch but the last): FSDP2's
reduce-scatter then runs once a step instead of after every micro-batch.

Each path's outputs are checked first: the kept quantization's outputs bit for bit the
per-call ones, over every micro-batch of a step after an optimizer step. Then the step (SGD
included) is timed by CUDA events: warm-up, then the median of --reps steps, the paths
interleaved step by step (the power limit's clock drifts; PERF.md), fresh tokens each step."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402
from timing import event_ms, synchronize  # noqa: E402

import mok  # noqa: E402

# (T, H, I, E, k, S): PERF.md's cases that fit fp32 master weights, their gradients and FSDP2's
# bf16 copies on an 80 GB card; "tiny" checks the logic on CPU (not a default case).
CASES = {"dsv3-ep8slice": (4096, 7168, 2048, 32, 8, 2048),
         "qwen3-30b-a3b": (16384, 2048, 768, 128, 8, 0)}
TINY = {"tiny": (257, 256, 128, 8, 2, 128)}
SHAPES = {**CASES, **TINY}


def build(case, precision, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    T, H, I, E, k, S = SHAPES[case]
    torch.manual_seed(0)
    module = mok.nn.MoE(H, I, E, k, shared_intermediate_size=S, dtype=torch.float32,
                        precision=precision, device=device)
    fully_shard(module, mesh=init_device_mesh(device, (1,)), reshard_after_forward=True,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32))
    return module, torch.optim.SGD(module.parameters(), lr=1e-3)


def step(module, opt, xs, flags, no_sync=False):
    outs = []
    for i, (x, flag) in enumerate(zip(xs, flags)):
        if no_sync:
            module.set_requires_gradient_sync(i == len(xs) - 1)
        out, stats = module(x, is_first_microbatch=flag)
        (out.float().square().mean() + 1e-3 * stats.load_balancing_loss).backward()
        outs.append(out.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-sync", action="store_true",
                    help="reduce the gradients after the last micro-batch of a step only")
    ap.add_argument("--out")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
    else:
        timing.WALL_CLOCK = True
        dist.init_process_group("gloo")
    results = []
    for case in args.cases.split(","):
        T, H = SHAPES[case][:2]
        paths = {"bf16": ("bf16", [None] * args.micro),
                 "fp8 per call": ("fp8", [None] * args.micro),
                 "fp8 once a step": ("fp8", [True] + [False] * (args.micro - 1))}
        built = {p: build(case, p, args.device) for p in ("bf16", "fp8")}

        def tokens():
            return [torch.randn(T, H, device=args.device, dtype=torch.bfloat16)
                    for _ in range(args.micro)]

        # Correctness: after a step, the kept quantization gives the per-call bits.
        module, opt = built["fp8"]
        step(module, opt, tokens(), paths["fp8 once a step"][1], args.no_sync)
        xs = tokens()
        with torch.no_grad():
            per_call = [module(x)[0] for x in xs]
            kept = [module(x, is_first_microbatch=i == 0)[0] for i, x in enumerate(xs)]
        for i, (a, b) in enumerate(zip(per_call, kept)):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                sys.exit(f"{case}: micro-batch {i}: is_first_microbatch's output differs")
        times = {name: [] for name in paths}
        for rep in range(3 + args.reps):
            for name, (precision, flags) in paths.items():
                module, opt = built[precision]
                xs = tokens()
                synchronize()
                ms = event_ms(lambda: step(module, opt, xs, flags, args.no_sync))
                if rep >= 3:
                    times[name].append(ms)
        row = {"case": case, "micro_batches": args.micro, "no_sync": args.no_sync,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "commit": os.environ.get("MOK_COMMIT", "unknown")}
        for name, ts in times.items():
            row[name] = sorted(ts)[len(ts) // 2]
        print(json.dumps(row), flush=True)
        results.append(row)
        del built
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
