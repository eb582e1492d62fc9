#!/usr/bin/env python3
"""Merge the per-suite measurement files of docs/perf/ into docs/perf/results.json (the schema
docs/perf/method.md describes), render the tables in docs/perf/README.md and draw the layer suite
against its baselines in docs/perf/layer.png (matplotlib, optional: without it the PNG is left as
it is and the script says so).

Each part file (docs/perf/{ceilings,schedule,gemm,layer,layer_small,layer_ep,layer_fused,
layer_fp8}.json, whichever exist) holds
{"gpu", "commit", "date", "cases": [...]} (ceilings.json: {"gpu", "commit", "date", "ceilings"}).
A case keeps the commit and date of the run that measured it, since suites are measured at
different times; the top-level commit and date are those of the newest part.

The FP8 suites (issues 42 and 43: layer_fp8.json's "layer-fp8" and "layer-fp8-interleaved",
gemm.json's FP8 forms) get their tables against the issues' bars with pass/FAIL
(bench/fp8_bars.py) and their own plot, docs/perf/layer_fp8.png: mok bf16, mok's FP8 paths, the
FP8 peer and torch, each alone at the power limit, labelled with the speedup over mok bf16.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fp8_bars  # noqa: E402

try:  # optional: only the plot needs it
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None

PERF = pathlib.Path(__file__).resolve().parent.parent / "docs" / "perf"
PARTS = ["ceilings", "schedule", "gemm", "layer", "layer_small", "layer_ep", "layer_fused",
         "layer_fp8"]
PLOT = "layer.png"
PLOT_FP8 = "layer_fp8.png"
# The standard suite (docs/perf/method.md), in the plot's order.
STANDARD_CASES = ["dsv3-ep8slice", "dsv3-ep1", "qwen3-30b-a3b", "mixtral-8x7b"]
# The layer suite's implementations as the plot names them; any other impl that is not a mok
# variant is a peer and is plotted too, under its own name.
IMPL_LABELS = {"torch": "PyTorch baseline", "mok-unfused": "mok (launches, default)",
               "mok-fused": "mok (forward megakernel)", "mok-fp8": "mok FP8 (weights quantized)",
               "mok-fp8-quant": "mok FP8 (with the weight quantization)",
               "mok-fp8-bf16-wgrad": "mok FP8, bf16 weight gradients",
               "torchao-fp8": "torchao FP8 rowwise", "torch-fp8": "FP8 rowwise recipe (torch)"}
MOK_VARIANTS = ("mok-unfused-1pass", "mok-unfused-2pass")  # ring experiments, not plotted
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
            "700 W limit (docs/perf/NOTES.md, \"What we know\").", "",
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
            "instead (docs/perf/method.md).", "",
            "| case | W | routing | unfused ms | fused ms | unfused / fused | MHz (unfused / fused) "
            "| J a call | over dense | commit |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + rows + [""]


def plot_layer(cases, gpu, path, suite="layer", base="torch"):
    """The standard suite's layer times (suite "layer", or the FP8 suite "layer-fp8"): per case,
    forward and forward+backward, uniform and skewed routing, mok's paths, the PyTorch baseline
    and any peer in the file; the roofline floor as a dotted line; each bar labelled with `base`'s
    time over its. The bf16 suite is drawn from one run (the newest commit that measured `base`),
    the FP8 suite row by row as its tables take it (fp8_bars.runs_by_row: each case and routing
    from one run). Returns a line saying what was drawn, or why not."""
    if plt is None:
        return (f"matplotlib is not installed: {path} was NOT redrawn "
                "(python3 -m pip install matplotlib, then run this script again)")
    layer = [c for c in cases if c.get("suite") == suite and c.get("case") in STANDARD_CASES
             and isinstance(c.get("median_ms"), (int, float)) and c.get("impl") not in MOK_VARIANTS]
    base_runs = sorted({(c["date"], c["commit"]) for c in layer if c["impl"] == base})
    if not base_runs:
        return f"no {suite} results with {IMPL_LABELS.get(base, base)}: {path} not drawn"
    if suite == "layer":
        layer = [c for c in layer if c["commit"] == base_runs[-1][1]]
    else:
        layer = fp8_bars.runs_by_row(layer, suite, base)
    runs = sorted({(c["date"], c["commit"], c["routing"]) for c in layer})
    drawn = "; ".join(f"{r}: {commit}, {date}" for date, commit, r in runs) if suite != "layer" \
        else f"commit {runs[-1][1]}, {runs[-1][0]}"
    gpu = " / ".join(sorted({str(c.get("gpu", gpu)) for c in layer}))  # the drawn run's card
    have = {c["impl"] for c in layer}
    order = ("torch", "mok-unfused", "mok-fused", "mok-fp8", "mok-fp8-quant")
    impls = [i for i in order if i in have]
    impls += sorted(have - set(impls))  # peers
    colors = {"torch": "#8c8c8c", "mok-unfused": "#1f5fa8", "mok-fused": "#7fb0e0",
              "mok-fp8": "#b2182b", "mok-fp8-quant": "#ef8a62"}
    peer_colors = iter(["#d95f02", "#1b9e77", "#7570b3", "#e7298a"])
    colors.update({i: next(peer_colors, "#666666") for i in impls if i not in colors})
    by_key = {(c["case"], c["pass"], c["routing"], c["impl"]): c for c in layer}
    present = [case for case in STANDARD_CASES if any(k[0] == case for k in by_key)]
    passes = [("fwd", "forward"), ("fwdbwd", "forward + backward")]
    routings = [r for r in ("uniform", "skewed") if any(k[2] == r for k in by_key)]
    fig, axes = plt.subplots(len(passes), len(present), figsize=(3.1 * len(present), 6.4),
                             squeeze=False)
    width = 0.8 / len(impls)
    handles = {}  # the first bar of each impl, for the legend
    for row, (pss, pass_name) in enumerate(passes):
        for col, case in enumerate(present):
            ax = axes[row][col]
            top = 0.0
            for j, impl in enumerate(impls):
                for x, routing in enumerate(routings):
                    c = by_key.get((case, pss, routing, impl))
                    if c is None:
                        continue
                    pos = x - 0.4 + width * (j + 0.5)
                    bar = ax.bar(pos, c["median_ms"], width * 0.92, color=colors[impl])
                    handles.setdefault(IMPL_LABELS.get(impl, impl), bar)
                    top = max(top, c["median_ms"])
                    ref = by_key.get((case, pss, routing, base))
                    if impl != base and ref is not None:
                        ax.text(pos, c["median_ms"] * 0.97,
                                f"{ref['median_ms'] / c['median_ms']:.2f}x", ha="center",
                                va="top", fontsize=7, rotation=90,
                                color="#0b2545" if impl == "mok-fused" else "white",
                                fontweight="bold")
            floor = next((c["floor_ms"] for c in layer if c["case"] == case and c["pass"] == pss
                          and isinstance(c.get("floor_ms"), (int, float))), None)
            if floor:
                handles.setdefault("roofline floor", ax.axhline(
                    floor, color="black", linestyle=":", linewidth=1))
            ax.set_xticks(range(len(routings)), routings, fontsize=8)
            ax.set_ylim(0, top * 1.1)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(f"{case}, {pass_name}", fontsize=8.5)
            if col == 0:
                ax.set_ylabel("ms per call (lower is better)", fontsize=8)
    ncol = min(len(handles), max(2, len(present)))  # a legend row as wide as the figure
    rows = -(-len(handles) // ncol)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center",
               ncol=ncol, fontsize=8, frameon=False)
    what = ("bf16" if suite == "layer" else "FP8 against bf16, each path alone")
    fig.suptitle(f"MoE layer time, one {gpu} at its 700 W limit, {what}\n({drawn}); "
                 f"labels: speedup over the {IMPL_LABELS.get(base, base)}", fontsize=9.5)
    fig.tight_layout(rect=(0, 0.035 * rows, 1, 0.95))
    save_png(fig, path)
    plt.close(fig)
    return f"{path}: drawn from {drawn}"


def save_png(fig, path, colors=64):
    """The figure as a palette PNG (a few dozen colours: flat bars and text), a third of the bytes
    of matplotlib's RGBA file, since docs/ has a size budget (tests/python/test_docs.py)."""
    import io
    from PIL import Image  # matplotlib's own dependency
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90, format="png", metadata={"Software": None})
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    image.save(path, format="PNG", optimize=True)


def write_results(merged, path):
    """results.json with one case per line (the same data as indent=1, a third of the bytes)."""
    head = {k: v for k, v in merged.items() if k != "cases"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append(' "cases": [')
    lines += [f"  {json.dumps(c)}," for c in merged["cases"][:-1]]
    lines += [f"  {json.dumps(c)}" for c in merged["cases"][-1:]]
    lines += [" ]", "}"]
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == merged
    path.write_text(text)


def main() -> int:
    merged = {"gpu": None, "commit": None, "date": None, "ceilings": {}, "cases": []}
    newest = ""
    ceilings_gpu = None
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
            merged.update(commit=part["commit"], date=part["date"])
            if ceilings_gpu is None:
                merged["gpu"] = part["gpu"]
        if name == "ceilings":  # the measured ceilings; other parts may quote PERF.md's
            merged["ceilings"].update(part["ceilings"])
            ceilings_gpu = merged["gpu"] = part["gpu"]  # the top-level card: the ceilings'
        for case in part.get("cases", []):
            case = dict(case)
            case.setdefault("commit", part["commit"])
            case.setdefault("date", part["date"])
            case.setdefault("gpu", part["gpu"])  # parts may come from different cards
            merged["cases"].append(case)
    write_results(merged, PERF / "results.json")
    plotted = plot_layer(merged["cases"], merged["gpu"], PERF / PLOT)
    def on_card(lines, suite):  # a section measured on another card names it in its heading
        cards = sorted({c["gpu"] for c in merged["cases"] if c.get("suite") == suite})
        if lines and lines[0].startswith("## ") and cards and cards != [merged["gpu"]]:
            lines[0] += f" (on {', '.join(cards)})"
        return lines

    fp8 = (on_card(fp8_bars.layer_lines(merged["cases"], "layer-fp8"), "layer-fp8")
           + on_card(fp8_bars.interleaved_lines(merged["cases"], "layer-fp8-interleaved"),
                     "layer-fp8-interleaved")
           + fp8_bars.gemm_lines(merged["cases"]))
    plotted_fp8 = None
    if any(c.get("suite") == "layer-fp8" for c in merged["cases"]):
        plotted_fp8 = plot_layer(merged["cases"], merged["gpu"], PERF / PLOT_FP8,
                                 suite="layer-fp8", base="mok-unfused")

    # Suites some of whose records another card measured (each record names its card).
    elsewhere = {}
    for c in merged["cases"]:
        if c["gpu"] != merged["gpu"]:
            elsewhere.setdefault(c["gpu"], set()).add(c.get("suite"))
    others = "".join(f" On {gpu}: {', '.join(sorted(map(str, suites)))}."
                     for gpu, suites in sorted(elsewhere.items()))
    lines = ["# mok measurements", "",
             f"GPU: {merged['gpu']}, unless named below. Ceilings measured: "
             + ", ".join(f"{k} = {v}" for k, v in merged["ceilings"].items()) + "." + others, "",
             "Generated by `bench/merge_results.py` from the files beside this one; "
             "every row names the commit and date it was measured at. How each suite measures: "
             "[method.md](method.md); what the numbers mean over time: [NOTES.md](NOTES.md).", "",
             f"![the layer suite against the PyTorch baseline]({PLOT})", ""]
    if plotted_fp8 is not None and (PERF / PLOT_FP8).exists():
        lines += [f"![the FP8 layer against mok bf16 and the FP8 peer]({PLOT_FP8})", ""]
    lines += layer_summary(merged["cases"], merged["ceilings"])
    lines += fp8
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
    print(plotted, file=sys.stderr if plt is None else sys.stdout)
    if plotted_fp8 is not None:
        print(plotted_fp8, file=sys.stderr if plt is None else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
