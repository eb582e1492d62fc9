#!/usr/bin/env python3
"""Train a small Qwen3-MoE-shaped Hugging Face model with its experts on mok, and the same model
with Transformers' default experts ("grouped_mm"), side by side.

Random init from a config (no download), bf16, next-token loss on a fixed synthetic corpus (a
random Markov chain, so there is something to learn). Both runs start from the same weights, see
the same batches and use the same AdamW; only experts_implementation differs. Prints both loss
curves (averaged over windows) and the median step time of each.

    python examples/hf_finetune.py                      # CPU sizes (mok's reference backend)
    python examples/hf_finetune.py --device cuda --hidden 2048 --moe-intermediate 768 \\
        --experts 128 --topk 8 --layers 4 --seq 2048 --batch 4 --steps 300

Needs `pip install .[transformers]`.
"""

import argparse
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import mok.integrations.transformers as mok_hf

WINDOW = 25
# Two bf16 runs differ by rounding from the first step on (and where a router's top-k scores tie
# within a rounding, by a routing choice); averaged over windows the curves stay close. 5% flags a
# real divergence, not rounding.
CURVE_TOLERANCE = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--moe-intermediate", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=63)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impls", default="mok,grouped_mm")
    return p.parse_args(argv)


def config(args):
    heads = max(args.hidden // 64, 2)
    return Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.topk, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=args.seq + 1)


def corpus(args):
    """Token sequences from a random sparse Markov chain over the vocabulary."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    successors = torch.randint(0, args.vocab, (args.vocab, 4), generator=gen)
    seqs = torch.empty(args.steps, args.batch, args.seq, dtype=torch.int64)
    state = torch.randint(0, args.vocab, (args.steps, args.batch), generator=gen)
    for i in range(args.seq):
        seqs[:, :, i] = state
        pick = torch.randint(0, 4, state.shape, generator=gen)
        state = successors[state, pick]
    return seqs


def train(impl, args, batches):
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config(args), dtype=torch.bfloat16)
    model.to(args.device).train()
    model.set_experts_implementation(impl)
    if impl == "mok":
        mok_hf.check(model)  # every experts module checked now (else: at its first call)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times = [], []
    for step in range(args.steps):
        ids = batches[step].to(args.device)
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return losses, statistics.median(times[min(5, args.steps - 1):])


def main(argv=None):
    args = parse_args(argv)
    batches = corpus(args)
    impls = args.impls.split(",")
    runs = {impl: train(impl, args, batches) for impl in impls}
    print(f"{'step':>6}" + "".join(f"{impl:>14}" for impl in impls))
    for w in range(0, args.steps, WINDOW):
        means = [statistics.fmean(runs[i][0][w:w + WINDOW]) for i in impls]
        print(f"{w:>6}" + "".join(f"{m:14.4f}" for m in means))
    for impl in impls:
        print(f"{impl}: median step {1e3 * runs[impl][1]:.2f} ms on {args.device}")
    first = runs[impls[0]][0]
    ok = statistics.fmean(first[-WINDOW:]) < statistics.fmean(first[:WINDOW])
    for impl in impls[1:]:
        other = runs[impl][0]
        for w in range(0, args.steps, WINDOW):
            a, b = statistics.fmean(first[w:w + WINDOW]), statistics.fmean(other[w:w + WINDOW])
            ok = ok and abs(a - b) <= CURVE_TOLERANCE * b
    print("curves agree and the loss falls" if ok else "CHECK FAILED: the curves differ or the "
          "loss does not fall")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
