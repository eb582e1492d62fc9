#!/usr/bin/env python3
"""Why a routing with duplicate (token, expert) pairs favours a recipe that quantizes w * d_out.

    python3 bench/fp8_duplicate_rounding.py [--seed 0]

bench_layer.py's skewed routing sets every other top-k slot to expert 0, so at k = 8 a token
reaches expert 0 four times, with four router weights. mok's FP8 backward quantizes the pulled
d_out row once, unscaled, and applies the router weight after the down dgrad (the router-weight
gradient needs the unscaled product): the copies share one rounding, and their errors add in step.
A recipe that quantizes w * d_out per copy rounds each differently, and part of the error cancels.
This prints both for 1, 2 and 4 copies of every token: e4m3, 1x128 blocks, power-of-two scales
rounded up as mok's, products in float64 against the exact float64 product. CPU only.
"""

import argparse

import torch

from torch_fp8_moe import quantize_along


def quantize_rows(x):
    """e4m3 in 1x128 blocks along the last axis (the recipe's quantizer per block: scales are
    powers of two, 2^-ceil(log2(amax / 448)) as mok's), dequantized."""
    q, inv = quantize_along(x.reshape(*x.shape[:-1], -1, 128), -1)
    return (q.double() * inv.double()).reshape(x.shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    T, H, I, k = 4096, 1024, 512, 8
    w_down = torch.randn(H, I, dtype=torch.float64) / H ** 0.5
    d_out = torch.randn(T, H, dtype=torch.float64)
    weights = torch.softmax(torch.randn(T, k, dtype=torch.float64), -1)
    print(f"seed {args.seed}: T {T}, H {H}, I {I}; sum|diff|/sum|ref| of sum_j w_j d_out W")

    def err(got, exact):
        return float((got - exact).abs().sum() / exact.abs().sum())
    for copies in (1, 2, 4):
        w = weights[:, :copies]
        exact = (w.sum(1, keepdim=True) * d_out) @ w_down
        once = w.sum(1, keepdim=True) * (quantize_rows(d_out) @ w_down)
        per_copy = sum(quantize_rows(w[:, j:j + 1] * d_out) @ w_down for j in range(copies))
        print(f"  {copies} copies: q(d_out), w after {err(once, exact):.5f}   "
              f"q(w d_out) per copy {err(per_copy, exact):.5f}")


if __name__ == "__main__":
    main()
