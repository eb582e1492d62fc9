#!/usr/bin/env python3
"""Merge the per-suite measurement files of docs/perf/ into docs/perf/results.json (PERF.md's
schema) and render the table in docs/perf/README.md.

Each part file (docs/perf/{ceilings,schedule,gemm,layer,layer_small,layer_ep,layer_fused}.json, whichever exist) holds
{"gpu", "commit", "date", "cases": [...]} (ceilings.json: {"gpu", "commit", "date", "ceilings"}).
A case keeps the commit and date of the run that measured it, since suites are measured at
different times; the top-level commit and date are those of the newest part.
"""
import json
import pathlib
import sys

PERF = pathlib.Path(__file__).resolve().parent.parent / "docs" / "perf"
PARTS = ["ceilings", "schedule", "gemm", "layer", "layer_small", "layer_ep", "layer_fused"]
# layer_fused.json holds both bench_virtual_ranks suites: layer-fused (pairs) and layer-fused-solo.


def layer_summary(cases, ceilings):
    """The layer suite as mok against the PyTorch baseline of the same run, with each one's time
    over the roofline floor (issue 6) and mok's over its FLOPs at the dense GEMM rate a long run
    sustains under the power limit (ceilings.py); empty without layer results."""
    sustained = ceilings.get("bf16_tflops_sustained")
    layer = {(c["case"], c["routing"], c["pass"], c["impl"]): c for c in cases
             if c.get("suite") == "layer" and isinstance(c.get("median_ms"), (int, float))}
    keys = sorted({k[:3] for k in layer if k[3] == "torch"}, key=lambda k: (k[0], k[1] != "uniform", k[2]))
    rows = []
    for case, routing, pss in keys:
        tr = layer[(case, routing, pss, "torch")]
        for impl in ("mok", "mok-unfused", "mok-unfused-1pass", "mok-unfused-2pass", "mok-fused"):
            m = layer.get((case, routing, pss, impl))
            if m is None or m.get("commit") != tr.get("commit"):
                continue  # only same-run comparisons
            floor = m.get("floor_ms")
            over = (lambda v: f"{v / floor:.2f}x") if floor else (lambda v: "-")
            flops = m["tflops"] * m["median_ms"] * 1e9 if isinstance(m.get("tflops"), (int, float)) else None
            held = f"{m['median_ms'] / (flops / (sustained * 1e9)):.2f}x" if flops and sustained else "-"
            rows.append(f"| {case} | {routing} | {pss} | {impl} | {m['median_ms']:.3f} | {tr['median_ms']:.3f} | "
                        f"{tr['median_ms'] / m['median_ms']:.2f}x | {over(m['median_ms'])} | {over(tr['median_ms'])} | "
                        f"{held} | {m['commit']} |")
    if not rows:
        return []
    passes = []  # the ring's cost: the default config and two real passes over one pass
    for case, routing, pss in keys:
        one = layer.get((case, routing, pss, "mok-unfused-1pass"))
        if one is None:
            continue
        cells = []
        for impl in ("mok-unfused", "mok-unfused-2pass"):
            m = layer.get((case, routing, pss, impl))
            same = m is not None and m.get("commit") == one.get("commit")
            cells.append(f"{m['median_ms'] / one['median_ms']:.3f}x" if same else "-")
        passes.append(f"| {case} | {routing} | {pss} | {one['median_ms']:.3f} | {cells[0]} | {cells[1]} | "
                      f"{one['commit']} |")
    ring = ["## Ring passes: the default config and two real passes against one pass (same run)", "",
            "| case | routing | pass | 1 pass ms | default / 1 pass | 2 passes / 1 pass | commit |",
            "| --- | --- | --- | --- | --- | --- | --- |"] + passes + [""] if passes else []
    return ring + ["## Layer: mok against the PyTorch baseline (same run)", "",
            "Floor: the larger of FLOPs at `bf16_tflops` and bytes at `hbm_tbps`. Sustained: mok's time over",
            "its FLOPs at `bf16_tflops_sustained`, the rate cuBLAS holds in a long run under the H200's",
            "700 W limit (docs/perf/NOTES.md, ## layer, session 4).", "",
            "| case | routing | pass | impl | mok ms | torch ms | speedup | mok / floor | torch / floor | mok / sustained | commit |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [""]


def fused_summary(cases):
    """The forward megakernel (impl mok-fused) against the launches (mok-unfused) of the same run
    (bench_virtual_ranks: the two paths interleaved call by call), with each one's time over the
    same-run sustained dense GEMM time of the layer's FLOPs where the run measured it (--dense);
    empty without layer-fused results."""
    fused = {(c["case"], c["routing"], c["impl"]): c for c in cases
             if c.get("suite") == "layer-fused" and isinstance(c.get("median_ms"), (int, float))}

    def over(c):
        v = c.get("over_dense")
        return f"{v:.3f}" if isinstance(v, (int, float)) else "-"
    rows = []
    for case, routing, impl in sorted(fused, key=lambda k: (k[0], k[1] != "uniform")):
        if impl != "mok-fused" or (case, routing, "mok-unfused") not in fused:
            continue
        f, u = fused[(case, routing, "mok-fused")], fused[(case, routing, "mok-unfused")]
        rows.append(f"| {case} | {routing} | {u['median_ms']:.3f} | {f['median_ms']:.3f} | "
                    f"{f['pair_ratio_median']:.3f} ({f['pair_ratio_q1']:.3f}-{f['pair_ratio_q3']:.3f}) | "
                    f"{over(u)} | {over(f)} | {f['commit']} |")
    if not rows:
        return []
    return ["## Forward megakernel against the launches (same run)", "",
            "Unfused over fused: the median of per-pair ratios (quartiles). Over dense: the path's "
            "median over the time the layer's FLOPs take at the dense bf16 GEMM rate sustained in "
            "the same run (issue 16's bars: at most 1.12 on dsv3-ep8slice, 1.35 on qwen3-30b-a3b).",
            "",
            "| case | routing | unfused ms | fused ms | unfused / fused | unfused / dense | "
            "fused / dense | commit |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [""]


def fused_solo_summary(cases):
    """The two forward paths each alone at the power limit (bench_virtual_ranks --solo, clock and
    power sampled beside it: bench/solo_power.py); empty without layer-fused-solo results."""
    solo = {(c["case"], c.get("ranks", 1), c["routing"], c["impl"]): c for c in cases
            if c.get("suite") == "layer-fused-solo" and isinstance(c.get("median_ms"), (int, float))}
    rows = []
    for case, ranks, routing, impl in sorted(solo, key=lambda k: (k[0], k[1], k[2] != "uniform")):
        if impl != "mok-fused" or (case, ranks, routing, "mok-unfused") not in solo:
            continue
        f, u = solo[(case, ranks, routing, "mok-fused")], solo[(case, ranks, routing, "mok-unfused")]
        rows.append(f"| {case} | {ranks} | {routing} | {u['median_ms']:.3f} | {f['median_ms']:.3f} | "
                    f"{u['median_ms'] / f['median_ms']:.3f} | {u['sm_mhz_mean']:.0f} / "
                    f"{f['sm_mhz_mean']:.0f} | {u['joules_per_call']:.3f} / {f['joules_per_call']:.3f} | "
                    f"{u['over_dense']:.3f} / {f['over_dense']:.3f} | {f['commit']} |")
    if not rows:
        return []
    return ["## Forward megakernel against the launches, each alone at the power limit", "",
            "Each path's calls back to back (not interleaved), the board at its 700 W limit: a "
            "call's time is its energy over that power, so the time ratio is the energy ratio, "
            "and the per-pair ratio above (one clock for both) is close to the cycle ratio "
            "instead (docs/perf/NOTES.md, session 17).", "",
            "| case | W | routing | unfused ms | fused ms | unfused / fused | MHz (unfused / fused) "
            "| J a call | over dense | commit |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [""]


def main() -> int:
    merged = {"gpu": None, "commit": None, "date": None, "ceilings": {}, "cases": []}
    newest = ""
    for name in PARTS:
        path = PERF / f"{name}.json"
        if not path.exists():
            continue
        part = json.loads(path.read_text())
        if part.get("device", "cuda") != "cuda":  # bench_ep.py's CPU smoke runs
            print(f"{path}: a {part['device']} run, not a GPU measurement: not merged",
                  file=sys.stderr)
            continue
        for key in ("gpu", "commit", "date"):
            if key not in part:
                print(f"{path}: missing '{key}'", file=sys.stderr)
                return 1
        if part["date"] >= newest:
            newest = part["date"]
            merged.update(gpu=part["gpu"], commit=part["commit"], date=part["date"])
        if name == "ceilings":  # the measured ceilings; other parts may quote PERF.md's
            merged["ceilings"].update(part["ceilings"])
        for case in part.get("cases", []):
            case = dict(case)
            case.setdefault("commit", part["commit"])
            case.setdefault("date", part["date"])
            merged["cases"].append(case)
    (PERF / "results.json").write_text(json.dumps(merged, indent=1) + "\n")

    lines = ["# mok measurements", "",
             f"GPU: {merged['gpu']}. Ceilings measured: "
             + ", ".join(f"{k} = {v}" for k, v in merged["ceilings"].items()), "",
             "Generated by `bench/merge_results.py` from the files beside this one; "
             "every row names the commit and date it was measured at.", ""]
    lines += layer_summary(merged["cases"], merged["ceilings"])
    lines += fused_summary(merged["cases"])
    lines += fused_solo_summary(merged["cases"])
    lines += ["## All measurements", "",
              "| suite | case | routing | pass | impl | median ms | TFLOP/s | floor ms | commit | date |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in merged["cases"]:
        def fmt(key, spec):
            v = c.get(key)
            return format(v, spec) if isinstance(v, (int, float)) else "-"
        lines.append(f"| {c.get('suite')} | {c.get('case')} | {c.get('routing', '-')} | "
                     f"{c.get('pass', '-')} | {c.get('impl')} | {fmt('median_ms', '.4f')} | "
                     f"{fmt('tflops', '.1f')} | {fmt('floor_ms', '.3f')} | {c['commit']} | {c['date']} |")
    (PERF / "README.md").write_text("\n".join(lines) + "\n")
    print(f"{len(merged['cases'])} cases -> {PERF / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
