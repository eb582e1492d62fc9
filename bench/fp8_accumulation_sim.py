#!/usr/bin/env python3
"""The FP8 tensor cores' sum of one K block as a model, against the bounds of
tests/cpp/test_gemm_fp8.cu (docs/perf/NOTES.md, "2026-12-05, c190c88").

Model: a K block of 128 e4m3 x e4m3 products, summed in steps of 32 (one wgmma k32 each) into an
accumulator that starts at zero; each step sums its products in groups of --group, each group with
the incoming accumulator aligned to the group's largest exponent and truncated to --bits fraction
bits, the group's result truncated the same way. Inputs drawn as the test draws its bytes (nine in
ten with exponent field 5..9, else any finite e4m3). Prints the worst error over --trials blocks
as a fraction of the old allowance (2^-9 of the block's sum of |products|) and of the test's
bound (38 * 2^-12 of each step's largest magnitude), and the median ratio of the two bounds.

    python3 bench/fp8_accumulation_sim.py [--bits 12] [--group 32] [--trials 5000] [--seed 1]
"""
import argparse
import math

import numpy as np


def e4m3_values(b):
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e == 0, m * 2.0**-9, (8 + m) * 2.0**(e.astype(float) - 10))
    return np.where(b & 0x80, -v, v)


def draw(rng, n):
    b = rng.integers(0, 256, n, dtype=np.int64)
    near_one = rng.integers(0, 10, n) != 0
    b = np.where(near_one, (b & 0x87) | (rng.integers(5, 10, n) << 3), b)
    b[(b & 0x7F) == 0x7F] = 0  # NaN bytes: drawn again in the test; zero here
    return e4m3_values(b)


def truncate(x, exponent, bits):
    ulp = 2.0**(exponent - bits)
    return np.trunc(x / ulp) * ulp


def exponent_of(x):
    return math.floor(math.log2(x)) if x > 0 else 0


def block(products, bits, group):
    """(the model's sum, the exact sum, the test's bound) of one block."""
    acc = exact = bound = 0.0
    for s0 in range(0, len(products), 32):
        step = products[s0:s0 + 32]
        magnitude = max(abs(exact), float(np.abs(step).max()))
        running = exact
        for j in range(0, len(step), 8):
            running += step[j:j + 8].sum()
            magnitude = max(magnitude, abs(running))
        bound += 38 * 2.0**-12 * magnitude
        for g in range(0, len(step), group):
            terms = np.concatenate([[acc], step[g:g + group]])
            aligned = truncate(terms, exponent_of(float(np.abs(terms).max())), bits).sum()
            acc = float(truncate(aligned, exponent_of(abs(aligned)), bits))
        exact += float(step.sum())
    return acc, exact, bound


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=12)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    worst_old = worst_new = 0.0
    ratios = []
    for _ in range(args.trials):
        p = draw(rng, 128) * draw(rng, 128)
        got, exact, bound = block(p, args.bits, args.group)
        old = 2.0**-9 * float(np.abs(p).sum())
        worst_old = max(worst_old, abs(got - exact) / old)
        worst_new = max(worst_new, abs(got - exact) / bound)
        ratios.append(bound / old)
    print(f"{args.bits} fraction bits, groups of {args.group}, {args.trials} blocks: worst error "
          f"{worst_old:.3f} of the old allowance, {worst_new:.3f} of the test's bound; the bound "
          f"is {float(np.median(ratios)):.2f}x the old allowance (median)")


if __name__ == "__main__":
    main()
