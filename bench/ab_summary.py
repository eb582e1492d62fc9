#!/usr/bin/env python3
"""Summarize scripts/ab-layer's runs: OUT_DIR/NAME.roundN.json, one bench_layer.py results file
per package and round. For each (case, routing, pass): each package's medians in round order,
their mean, and the mean over the first package's (the baseline: below 1 faster).

    python3 bench/ab_summary.py OUT_DIR [--base NAME]
"""
import argparse
import json
import pathlib
import re
import statistics
import sys

NAME = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+?)\.round(?P<round>\d+)\.json$")


def load(out_dir):
    """{(case, routing, pass): {name: [median_ms in round order]}} and the names in file order."""
    runs = []
    for path in pathlib.Path(out_dir).glob("*.round*.json"):
        m = NAME.match(path.name)
        if m is None:
            continue
        runs.append((int(m["round"]), m["name"], path))
    cells, names = {}, []
    for rnd, name, path in sorted(runs):
        if name not in names:
            names.append(name)
        for c in json.loads(path.read_text())["cases"]:
            if isinstance(c.get("median_ms"), (int, float)):
                key = (c["case"], c["routing"], c["pass"])
                cells.setdefault(key, {}).setdefault(name, []).append(c["median_ms"])
    return cells, names


def lines(cells, names, base):
    out = [f"mean median ms per package, over {base}'s (< 1: faster); each round's median in brackets"]
    for (case, routing, pss), by in sorted(cells.items()):
        if base not in by:
            continue
        ref = statistics.mean(by[base])
        parts = []
        for n in names:
            if n in by:
                ms = by[n]
                runs = ", ".join(f"{v:.3f}" for v in ms)
                parts.append(f"{n} {statistics.mean(ms):.3f} ({runs}) {statistics.mean(ms) / ref:.3f}")
        out.append(f"{case:24s} {routing:7s} {pss:6s}  " + "  ".join(parts))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--base", help="the package the others are divided by (default: the first)")
    args = ap.parse_args()
    cells, names = load(args.out_dir)
    if not names:
        sys.exit(f"no NAME.roundN.json files in {args.out_dir}")
    base = args.base or names[0]
    if base not in names:
        sys.exit(f"--base {base}: not among the packages {names}")
    print("\n".join(lines(cells, names, base)))


if __name__ == "__main__":
    main()
