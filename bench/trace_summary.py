#!/usr/bin/env python3
"""What a forward megakernel launch did, from its raw trace (bench_virtual_ranks --trace --trace-out
PREFIX writes PREFIX-<case>-<routing>.u64; the layout is in src/cuda/kernels/fused_forward.hpp).

    python3 bench/trace_summary.py FILE.u64 [FILE.u64 ...] [--json OUT]

Per task kind: tiles, the Consumers' time per tile (median and mean), split by whether the tile
began before or after its CTA's pulling warps were done (the pulls run beside the tiles and share
the SM's memory traffic), and its parts (waiting for the first K block, the K loop, the
epilogue); the Producer's draws and dependency waits; the gaps between one CTA's tiles
(percentiles); when, relative to the end of a CTA's tile, the Producer was free for the next one,
had its dependency met, and the next tile's first K block landed (so how long the tensor cores
had nothing between two tiles); and, per tenth of the launch, what share of the CTAs was in a
tile of each kind.
"""
import argparse
import json
import pathlib
import statistics
import struct
import sys

KINDS = ("gate_up", "down", "shared_gate_up", "shared_down")
WORDS = 8  # a ticket's words (kTraceTicketWords)


def read(path):
    """The trace's u64 words."""
    data = pathlib.Path(path).read_bytes()
    if len(data) % 8 != 0 or len(data) < 32:
        raise ValueError(f"{path}: {len(data)} bytes is not a trace (u64 words, a 4-word header)")
    return struct.unpack(f"<{len(data) // 8}Q", data)


def parse(words):
    """CTAs (start, pulls done, end) and tiles (dict per ticket that ran) of one launch."""
    tickets, grid, blocks = words[0], words[1], words[2]
    need = 4 + 4 * grid + WORDS * tickets
    if len(words) < 4 + 4 * grid:
        raise ValueError(f"a trace of {grid} CTAs needs {4 + 4 * grid} words, has {len(words)}")
    ctas = [dict(start=words[4 + 4 * c], pulled=words[5 + 4 * c], end=words[6 + 4 * c])
            for c in range(grid)]
    tiles = []
    for t in range(min(tickets, (len(words) - 4 - 4 * grid) // WORDS)):
        at = 4 + 4 * grid + WORDS * t
        free, turned, ready, begin, landed, multiplied, end, meta = words[at:at + WORDS]
        if end == 0:
            continue  # not run (the launch gave up) or not traced
        cta, kind, block = meta & 0xFFFF, (meta >> 16) & 0xFFFF, meta >> 32
        if cta >= grid or kind >= len(KINDS):
            raise ValueError(f"ticket {t}: CTA {cta} of {grid}, kind {kind}: not a trace")
        tiles.append(dict(ticket=t, cta=cta, kind=KINDS[kind], block=block, free=free,
                          turned=turned, ready=ready, begin=begin, landed=landed,
                          multiplied=multiplied, end=end))
    return dict(tickets=tickets, grid=grid, blocks=blocks, complete=len(words) >= need,
                ctas=ctas, tiles=tiles)


def percentile(values, q):
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def summarise(launch, tenths=10):
    ctas, tiles = launch["ctas"], launch["tiles"]
    t0 = min(c["start"] for c in ctas)
    t1 = max(c["end"] for c in ctas)
    span = t1 - t0
    report = dict(tickets=launch["tickets"], grid=launch["grid"], blocks=launch["blocks"],
                  span_us=span / 1e3, last_pull_us=(max(c["pulled"] for c in ctas) - t0) / 1e3,
                  kinds={}, gaps_us={}, timeline=[])
    for kind in KINDS:
        mine = [t for t in tiles if t["kind"] == kind]
        if not mine:
            continue
        us = [(t["end"] - t["begin"]) / 1e3 for t in mine]
        beside = [(t["end"] - t["begin"]) / 1e3 for t in mine
                  if t["begin"] < ctas[t["cta"]]["pulled"]]
        alone = [(t["end"] - t["begin"]) / 1e3 for t in mine
                 if t["begin"] >= ctas[t["cta"]]["pulled"]]
        waits = [(t["ready"] - t["turned"]) / 1e3 for t in mine if t["ready"] and t["turned"]]
        loaded = [t for t in mine if t["landed"]]
        part = lambda a, b: percentile([(t[b] - t[a]) / 1e3 for t in loaded], 0.5)
        report["kinds"][kind] = dict(
            first_k_block_p50_us=part("begin", "landed"), k_loop_p50_us=part("landed", "multiplied"),
            epilogue_p50_us=part("multiplied", "end"),
            draw_p50_us=percentile([(t["turned"] - t["free"]) / 1e3 for t in mine], 0.5),
            tiles=len(mine), median_us=statistics.median(us), mean_us=statistics.fmean(us),
            beside_pulls=dict(tiles=len(beside),
                              median_us=statistics.median(beside) if beside else 0.0),
            after_pulls=dict(tiles=len(alone),
                             median_us=statistics.median(alone) if alone else 0.0),
            wait_p50_us=percentile(waits, 0.5), wait_p99_us=percentile(waits, 0.99))
    gaps = []
    after = dict(free=[], ready=[], landed=[])  # the next tile's stamps after this one's end
    by_cta = {}
    for t in tiles:
        by_cta.setdefault(t["cta"], []).append(t)
    for mine in by_cta.values():
        mine.sort(key=lambda t: t["begin"])
        for a, b in zip(mine, mine[1:]):
            gaps.append((b["begin"] - a["end"]) / 1e3)
            for key in after:
                if b[key]:
                    after[key].append((b[key] - a["end"]) / 1e3)
    report["gaps_us"] = {f"p{int(q * 100)}": percentile(gaps, q) for q in (0.1, 0.5, 0.9, 0.99)}
    report["gaps_us"]["mean"] = statistics.fmean(gaps) if gaps else 0.0
    report["next_after_end_us"] = {
        key: {f"p{int(q * 100)}": percentile(v, q) for q in (0.1, 0.5, 0.9)}
        for key, v in after.items()}
    for i in range(tenths):
        lo, hi = t0 + span * i // tenths, t0 + span * (i + 1) // tenths
        share = {}
        for kind in KINDS:
            busy = sum(max(0, min(t["end"], hi) - max(t["begin"], lo))
                       for t in tiles if t["kind"] == kind)
            if busy:
                share[kind] = busy / ((hi - lo) * launch["grid"]) if hi > lo else 0.0
        report["timeline"].append(share)
    return report


def show(name, r):
    print(f"{name}: {r['tickets']} tickets over {r['grid']} CTAs, span {r['span_us']:.1f} us, "
          f"last pull landed at {r['last_pull_us']:.1f} us")
    for kind, k in r["kinds"].items():
        print(f"  {kind:15s} {k['tiles']:6d} tiles  median {k['median_us']:7.1f} us  mean "
              f"{k['mean_us']:7.1f}  beside pulls {k['beside_pulls']['median_us']:7.1f} "
              f"({k['beside_pulls']['tiles']})  after {k['after_pulls']['median_us']:7.1f} "
              f"({k['after_pulls']['tiles']})  wait p50 {k['wait_p50_us']:.1f} p99 "
              f"{k['wait_p99_us']:.1f} us")
        print(f"  {'':15s} parts (p50): first K block {k['first_k_block_p50_us']:.2f} us, K loop "
              f"{k['k_loop_p50_us']:.1f}, epilogue {k['epilogue_p50_us']:.2f}; the Producer's "
              f"draw {k['draw_p50_us']:.2f}")
    g = r["gaps_us"]
    print(f"  gaps between a CTA's tiles: mean {g['mean']:.2f} us, p10 {g['p10']:.2f}, p50 "
          f"{g['p50']:.2f}, p90 {g['p90']:.2f}, p99 {g['p99']:.2f}")
    n = r["next_after_end_us"]
    print("  the next tile after a tile's end (p10 / p50 / p90 us): "
          + "; ".join(f"{key} {v['p10']:.2f} / {v['p50']:.2f} / {v['p90']:.2f}"
                      for key, v in n.items()))
    for i, share in enumerate(r["timeline"]):
        parts = ", ".join(f"{k} {v:.0%}" for k, v in share.items())
        print(f"  tenth {i}: {parts}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    reports = {}
    for f in args.files:
        reports[f] = summarise(parse(read(f)))
        show(f, reports[f])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
