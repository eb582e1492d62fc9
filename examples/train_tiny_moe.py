#!/usr/bin/env python3
"""Train a tiny model built on mok.nn.MoE, and the same model with a pure-PyTorch MoE.

The task is synthetic regression: targets come from a fixed random two-layer MLP (the teacher)
applied to Gaussian inputs. Both students start from the same weights, see the same batches and
use the same optimizer; only the expert computation differs (mok's layer vs mok.reference, plain
PyTorch). The script prints both loss curves and checks that the loss falls and that the curves
agree.

    python examples/train_tiny_moe.py                 # CPU (or GPU when mok's CUDA backend runs)
    python examples/train_tiny_moe.py --steps 100 --router softmax
    python examples/train_tiny_moe.py --precision fp8 --dim 128 --intermediate 128   # CPU

With --precision fp8 mok's student runs the FP8 layer (every routed-expert GEMM in e4m3; dims
multiples of 128) and its curve is compared with the bf16 PyTorch student's; --precision
fp8-bf16-wgrad runs the same layer with its routed weight gradients in bf16.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import mok

# Two bf16 runs differ by rounding from the first step on (each bf16 store: relative error up to
# u = 2^-8, and the two implementations round at different places), and training carries the
# differences forward. Averaged over windows of 25 steps the curves stay within u of each other
# here (0.1% to 0.2% over seeds); we allow 4u = 1.6%, the bound on one bf16 forward's output.
CURVE_TOLERANCE = 4 * 2.0**-8
WINDOW = 25
# The FP8 layer's outputs and gradients are off by about 5% relative per element (e4m3's 3
# mantissa bits; docs/architecture.md, "The FP8 layer"), but unbiased: windowed losses stay close
# (0.06% at most over 150 steps at dim 128, CPU, 2026-12-05 on 0df3a4d). The goal: within 1%.
FP8_CURVE_TOLERANCE = 0.01


class Teacher:
    """y = B gelu(A x): a fixed random two-layer MLP, 4x wider than the model dimension."""

    def __init__(self, dim, gen):
        self.a = torch.randn(4 * dim, dim, generator=gen) / dim**0.5
        self.b = torch.randn(dim, 4 * dim, generator=gen) / (4 * dim)**0.5

    def __call__(self, x):
        return F.gelu(x @ self.a.T) @ self.b.T


class Student(torch.nn.Module):
    """Residual MoE block between an fp32 input projection and an fp32 read-out."""

    def __init__(self, dim, args, backend):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        self.moe = mok.nn.MoE(dim, args.intermediate, args.experts, args.topk,
                              shared_intermediate_size=args.shared, router=args.router,
                              backend=backend, dtype=torch.bfloat16,
                              precision=args.precision if backend == "mok" else "bf16")
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.inp(x)
        y, stats = self.moe(F.rms_norm(h, (h.shape[-1],)).to(torch.bfloat16))
        return self.out(h + y.float()), stats


def train(model, args, device):
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for every model
    teacher = Teacher(args.dim, torch.Generator().manual_seed(args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.dim, generator=gen)
        y = teacher(x)
        x, y = x.to(device), y.to(device)
        pred, stats = model(x)
        loss = F.mse_loss(pred, y)
        (loss + args.balance * stats.load_balancing_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.router == "sigmoid":
            model.moe.update_balancing_bias(stats.tokens_per_expert)
        losses.append(loss.item())
    return losses


def windows(losses):
    return [sum(losses[i:i + WINDOW]) / len(losses[i:i + WINDOW])
            for i in range(0, len(losses), WINDOW)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--shared", type=int, default=64)
    p.add_argument("--router", choices=("softmax", "sigmoid"), default="sigmoid")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--balance", type=float, default=1e-3, help="load-balancing loss weight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("bf16", "fp8", "fp8-bf16-wgrad"), default="bf16",
                   help="mok's layer: bf16, or the FP8 layer (dims multiples of 128), its "
                        "weight gradients e4m3 (fp8) or bf16 (fp8-bf16-wgrad)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when mok can run "
                                                  "there, else cpu)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available()
                                          and mok.backend_available("cuda") else "cpu"))
    print(f"mok {mok.__version__} on {device}: dim={args.dim} experts={args.experts} "
          f"topk={args.topk} shared={args.shared} router={args.router} steps={args.steps} "
          f"precision={args.precision}")

    torch.manual_seed(args.seed)
    mok_model = Student(args.dim, args, "mok").to(device)
    torch_model = Student(args.dim, args, "torch").to(device)
    torch_model.load_state_dict(mok_model.state_dict())

    curves, seconds = {}, {}
    for name, model in (("mok", mok_model), ("torch", torch_model)):
        start = time.perf_counter()
        curves[name] = train(model, args, device)
        seconds[name] = time.perf_counter() - start

    a, b = windows(curves["mok"]), windows(curves["torch"])
    print(f"{'steps':>11} {'mok loss':>10} {'torch loss':>10} {'rel diff':>9}")
    for i, (la, lb) in enumerate(zip(a, b)):
        first, last = i * WINDOW, min((i + 1) * WINDOW, args.steps) - 1
        print(f"{first:>5}-{last:<5} {la:>10.5f} {lb:>10.5f} {abs(la - lb) / lb:>9.2%}")
    worst = max(abs(la - lb) / lb for la, lb in zip(a, b))
    fell = a[-1] / a[0]
    print(f"time: mok {seconds['mok']:.1f} s, torch {seconds['torch']:.1f} s")
    print(f"loss fell from {a[0]:.4f} to {a[-1]:.4f} ({fell:.1%} of the start)")
    tolerance = CURVE_TOLERANCE if args.precision == "bf16" else FP8_CURVE_TOLERANCE
    print(f"curves agree: largest relative difference {worst:.2%} (tolerance {tolerance:.2%})")
    ok = fell < 0.5 and worst <= tolerance
    print("OK" if ok else "FAILED: the loss did not fall by half, or the curves disagree")
    return {"mok": curves["mok"], "torch": curves["torch"], "worst": worst, "fell": fell,
            "ok": ok}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
