#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's exports of one profiled launch:

    python3 bench/ncu_stalls.py SASS_CSV [DETAILS_TXT] [--top 20]

SASS_CSV is `ncu -i R.ncu-rep --page source --csv --print-source sass` (one row per SASS
instruction, its warp-state samples in columns); DETAILS_TXT, optional, is `--page details` of the
same report, whose headline figures (clock, duration, busiest pipeline, L2, DRAM, issue slots)
are printed first. Then the stall reasons summed over the kernel, and the instructions holding
the most samples, each with its leading reasons. Columns are found by name, so a different
Nsight Compute version changes what is printed, not whether it runs: with no sample column it
prints the columns it found instead.
"""
import argparse
import csv
import re
import sys

HEADLINES = ("SM Frequency", "Duration", "Compute (SM) Throughput", "L2 Cache Throughput",
             "DRAM Throughput", "Issue Slots Busy", "Executed Ipc Active", "Registers Per Thread",
             "highest-utilized pipeline")


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def headlines(details_path):
    """The headline lines of the details page, in its order."""
    lines = []
    with open(details_path, errors="replace") as f:
        for line in f:
            if any(h in line for h in HEADLINES):
                lines.append(re.sub(r"\s+", " ", line.strip()))
    return lines


def read_rows(csv_path):
    """The CSV's header and rows, skipping whatever Nsight Compute prints before the header (the
    header is the first line naming a Source or Address column)."""
    with open(csv_path, newline="", errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines)
                  if "Source" in line or "Address" in line), None)
    if start is None:
        return [], []
    rows = list(csv.reader(lines[start:]))
    return rows[0], rows[1:]


def stall_report(header, rows, top):
    """Text lines: reasons summed, then the top instructions by samples."""
    out = []
    total_col = next((i for i, h in enumerate(header) if "Warp Stall Sampling (All" in h), None)
    if total_col is None:
        return ["no warp-stall sample column; columns: " + ", ".join(header)]
    source_col = next((i for i, h in enumerate(header) if h.strip() == "Source"), None)
    address_col = next((i for i, h in enumerate(header) if "Address" in h), None)
    # Per-reason sample columns: named after a stall reason, numeric in every row that has them.
    reason_cols = [i for i, h in enumerate(header)
                   if i != total_col and re.search(r"stall", h, re.IGNORECASE)
                   and "Sampling" not in h]
    samples = [(number(r[total_col]) or 0.0, r) for r in rows if len(r) > total_col]
    total = sum(s for s, _ in samples)
    if total <= 0:
        return ["no warp-stall samples in the export"]
    out.append(f"warp-state samples: {total:.0f} over {len(samples)} instructions")
    if reason_cols:
        sums = []
        for i in reason_cols:
            sums.append((sum(number(r[i]) or 0.0 for _, r in samples if len(r) > i), header[i]))
        sums.sort(reverse=True)
        out.append("by reason (share of all samples):")
        for value, name in sums[:12]:
            if value > 0:
                out.append(f"  {100 * value / total:5.1f}%  {name}")
    out.append(f"top {top} instructions by samples:")
    samples.sort(key=lambda x: -x[0])
    for value, r in samples[:top]:
        where = r[address_col] if address_col is not None and len(r) > address_col else "?"
        text = r[source_col].strip() if source_col is not None and len(r) > source_col else ""
        reasons = sorted(((number(r[i]) or 0.0, header[i]) for i in reason_cols if len(r) > i),
                         reverse=True)[:3]
        why = ", ".join(f"{name} {v:.0f}" for v, name in reasons if v > 0)
        out.append(f"  {100 * value / total:5.1f}%  {where:>8}  {text[:70]:70}  {why}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass_csv")
    ap.add_argument("details", nargs="?")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    if args.details:
        print("\n".join(headlines(args.details)))
    header, rows = read_rows(args.sass_csv)
    if not header:
        print(f"{args.sass_csv}: no header line naming Source or Address")
        return 1
    print("\n".join(stall_report(header, rows, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
