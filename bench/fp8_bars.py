"""The FP8 benchmarks' bars (issues 42 and 43) and the tables that set measurements against them,
shared by bench/bench_layer.py (the end of a run), bench/bench_gemm.py (README-gemm.md) and
bench/merge_results.py (docs/perf/README.md). Reads result records (PERF.md's schema) only: no
torch, no GPU.

Layer (issue 43), suite "layer-fp8": forward+backward, each path alone at the power limit, FP8
over mok bf16 (the time of `mok-unfused`, the default config, over the FP8 path's time, same run):
  pre-quantized weights (`mok-fp8`):            dsv3-ep8slice 1.4, qwen3-30b-a3b 1.3,
                                                 mixtral-8x7b 1.5, dsv3-ep1 1.6;
  with the per-step quantization (`mok-fp8-quant`): 1.25, 1.2, 1.4, and at least 1.0 on dsv3-ep1;
and mok's FP8 faster than the torchao recipe (`torchao-fp8`, or this repository's writing of it,
`torch-fp8`, where torchao did not run) in every case, with a smaller error against the f64 layer.
The bars are the all-FP8 recipe's; mok's other FP8 recipe, bf16 routed weight gradients
(`mok-fp8-bf16-wgrad`, torchao's own choice for the weight gradients), is tabled beside it against
the same bf16 time and the same peer, for information.
The bars are set on PERF.md's routing (uniform); skewed rows show the same ratios against the
same bars, reported apart.

GEMM (issue 42), suites "gemm-solo" (each form alone: bench_gemm's impl filter) and "gemm" (the
forms interleaved round by round): FP8 over bf16 at dsv3-ep8slice and qwen3-30b-a3b, uniform:
gate/up (with SwiGLU) and down 1.6, dgrad forms 1.5, the k-grouped weight gradient 1.4; FP8
gate/up on dsv3-ep8slice at least 1,100 TFLOP/s; every FP8 form faster than
torch._scaled_grouped_mm (`torch-fp8`) at the same shape.
"""

BF16 = "mok-unfused"
FP8 = "mok-fp8"
FP8_QUANT = "mok-fp8-quant"
FP8_BF16_WGRAD = "mok-fp8-bf16-wgrad"  # precision "fp8-bf16-wgrad": shown beside, no bar of its own
PEERS = ("torchao-fp8", "torch-fp8")  # the first one present is the peer
LAYER_BARS = {"dsv3-ep8slice": (1.4, 1.25), "qwen3-30b-a3b": (1.3, 1.2),
              "mixtral-8x7b": (1.5, 1.4), "dsv3-ep1": (1.6, 1.0)}  # (FP8, FP8 with quantization)
BAR_PASS = "fwdbwd"
BAR_ROUTING = "uniform"
CASE_ORDER = ("dsv3-ep8slice", "dsv3-ep1", "qwen3-30b-a3b", "mixtral-8x7b")

GEMM_BARS = {"gemm1": 1.6, "gemm2": 1.6, "dgrad": 1.5, "dgrad-swiglu": 1.5, "wgrad": 1.4}
GEMM_BAR_CASES = ("dsv3-ep8slice", "qwen3-30b-a3b")
GEMM1_TFLOPS_BAR = ("dsv3-ep8slice", 1100.0)
GEMM_PASSES = ("gemm1", "gemm2", "dgrad", "dgrad-swiglu", "wgrad")
MiB = 1 << 20


def _timed(c):
    return isinstance(c.get("median_ms"), (int, float))


def _order(key):
    case, routing, pss = (tuple(key) + ("", ""))[:3]
    rank = CASE_ORDER.index(case) if case in CASE_ORDER else len(CASE_ORDER)
    return (rank, case, routing != "uniform", routing, pss)


def verdict(ratio, bar):
    """'pass' / 'FAIL' of ratio against bar (at least); '-' without either."""
    if ratio is None or bar is None:
        return "-"
    return "pass" if ratio >= bar else "FAIL"


def _ratio(a, b):
    """a's time over b's (b faster: above 1), or None."""
    return a["median_ms"] / b["median_ms"] if a is not None and b is not None else None


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def _worst(errors):
    """(largest rel_l1, smallest cosine) over out and every gradient, or (None, None)."""
    if not errors:
        return None, None
    return (max(e["rel_l1"] for e in errors.values()), min(e["cosine"] for e in errors.values()))


def runs_by_row(records, suite, base=BF16):
    """The timed records of `suite`, for each (case, routing) those of one run (date, commit): the
    run that measured `base` and the most implementations of that row (ties: the newest). Every
    comparison within a row is then a same-run one, while rows may come from different runs (a
    later run of the skewed routing alone does not hide the uniform rows of an earlier one, and a
    rerun of a few paths does not displace a complete row)."""
    recs = [c for c in records if c.get("suite") == suite and _timed(c)]
    runs = {}  # (case, routing) -> {(date, commit): the impls it measured}
    for c in recs:
        run = (c.get("date", ""), c.get("commit", ""))
        runs.setdefault((c["case"], c["routing"]), {}).setdefault(run, set()).add(c["impl"])
    chosen = {row: max((len(impls),) + run for run, impls in by_run.items() if base in impls)[1:]
              for row, by_run in runs.items() if any(base in i for i in by_run.values())}
    return [c for c in recs
            if chosen.get((c["case"], c["routing"])) == (c.get("date", ""), c.get("commit", ""))]


def layer_index(records, suite):
    """{(case, routing, pass, impl): record}, each row from one run (runs_by_row)."""
    return {(c["case"], c["routing"], c["pass"], c["impl"]): c for c in runs_by_row(records, suite)}


def layer_rows(records, suite="layer-fp8"):
    """One dict per (case, routing, pass) with a bf16 record: the FP8 paths' speedups over it,
    their bars and verdicts (forward+backward only), and the peer's time against mok's."""
    idx = layer_index(records, suite)
    impls = {k[3] for k in idx}
    peer = next((p for p in PEERS if p in impls), None)
    rows = []
    for key in sorted({k[:3] for k in idx if k[3] == BF16}, key=_order):
        case, routing, pss = key
        base = idx[key + (BF16,)]
        fp8, quant = idx.get(key + (FP8,)), idx.get(key + (FP8_QUANT,))
        wgrad = idx.get(key + (FP8_BF16_WGRAD,))
        other = idx.get(key + (peer,)) if peer else None
        bars = LAYER_BARS.get(case, (None, None)) if pss == BAR_PASS else (None, None)
        r8, rq = _ratio(base, fp8), _ratio(base, quant)
        rows.append({"case": case, "routing": routing, "pass": pss, "bf16_ms": base["median_ms"],
                     "fp8_ms": fp8 and fp8["median_ms"], "fp8_speedup": r8, "fp8_bar": bars[0],
                     "fp8_verdict": verdict(r8, bars[0]),
                     "quant_ms": quant and quant["median_ms"], "quant_speedup": rq,
                     "quant_bar": bars[1], "quant_verdict": verdict(rq, bars[1]),
                     "peer": peer, "peer_ms": other and other["median_ms"],
                     "fp8_over_peer": _ratio(other, fp8), "quant_over_peer": _ratio(other, quant),
                     "wgrad_ms": wgrad and wgrad["median_ms"], "wgrad_speedup": _ratio(base, wgrad),
                     "wgrad_over_peer": _ratio(other, wgrad),
                     "commit": base.get("commit") or "-"})
    return rows


def layer_lines(records, suite="layer-fp8"):
    """Markdown: the FP8 layer against mok bf16 and the peer (same run), the bars' verdicts, the
    f64 errors, and the memory per layer; empty without FP8 layer results."""
    rows = layer_rows(records, suite)
    if not any(r["fp8_ms"] is not None or r["quant_ms"] is not None for r in rows):
        return []
    peer = next((r["peer"] for r in rows if r["peer"]), None)
    lines = [f"## FP8 layer against mok bf16, each path alone at the power limit ({suite})", "",
             "Speedup: mok bf16's time (`mok-unfused`, the default config) over the FP8 path's, "
             "same run. `mok-fp8`: weights quantized beforehand; `mok-fp8-quant`: the per-step "
             "weight quantization inside every call; `mok-fp8-bf16-wgrad`: the weight gradients "
             "in bf16 (precision 'fp8-bf16-wgrad'; no bar). Bars (issue 43) on forward+backward, "
             f"{BAR_ROUTING} routing; skewed rows against the same bars for information. Peer: "
             f"{peer or 'none in this run'} (its time over mok's: above 1, mok is faster).", "",
             "| case | routing | pass | bf16 ms | fp8 ms | speedup | bar | | fp8+quant ms | "
             "speedup | bar | | bf16-wgrad ms | speedup | peer ms | peer / fp8 | peer / fp8+quant | "
             "peer / bf16-wgrad | commit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['routing']} | {r['pass']} | {r['bf16_ms']:.3f} | "
            f"{_fmt(r['fp8_ms'])} | {_fmt(r['fp8_speedup'], '.2f')}x | {_fmt(r['fp8_bar'], '.2f')} "
            f"| {r['fp8_verdict']} | {_fmt(r['quant_ms'])} | {_fmt(r['quant_speedup'], '.2f')}x | "
            f"{_fmt(r['quant_bar'], '.2f')} | {r['quant_verdict']} | {_fmt(r['wgrad_ms'])} | "
            f"{_fmt(r['wgrad_speedup'], '.2f')}x | {_fmt(r['peer_ms'])} | "
            f"{_fmt(r['fp8_over_peer'], '.2f')} | {_fmt(r['quant_over_peer'], '.2f')} | "
            f"{_fmt(r['wgrad_over_peer'], '.2f')} | {r['commit']} |")
    lines += [""] + bar_summary(rows) + [""] + peer_lines(records, suite) + error_lines(
        records, suite) + memory_lines(records, suite)
    return lines


def peer_lines(records, suite="layer-fp8"):
    """Markdown: for a row whose run (runs_by_row) did not time the peer, the newest other run
    that timed mok bf16, mok-fp8 and the peer together (time and f64 error, same run); empty
    when every row has its peer."""
    recs = [c for c in records if c.get("suite") == suite and _timed(c)]
    chosen = layer_index(records, suite)
    have_peer = {k[:2] for k in chosen if k[3] in PEERS}
    runs = {}  # (case, routing, date, commit) -> {(pass, impl): record}
    for c in recs:
        key = (c["case"], c["routing"], c.get("date", ""), c.get("commit", ""))
        runs.setdefault(key, {})[(c["pass"], c["impl"])] = c

    def err(worst):
        return "-" if worst[0] is None else f"{worst[0]:.4f} / {worst[1]:.5f}"
    out = []
    for case, routing in sorted({k[:2] for k in chosen} - have_peer, key=_order):
        found = sorted((k[2:], run) for k, run in runs.items() if k[:2] == (case, routing)
                       and {BF16, FP8} <= {i for _, i in run} and any(i in PEERS for _, i in run))
        if not found:
            continue
        (_, commit), run = found[-1]
        peer = next(p for p in PEERS if any(i == p for _, i in run))
        for pss in ("fwd", BAR_PASS):
            base, fp8, other = (run.get((pss, i)) for i in (BF16, FP8, peer))
            if base is None or fp8 is None or other is None:
                continue
            mine, theirs = (_worst(run.get(("fwd", i), {}).get("f64_errors")) for i in (FP8, peer))
            out.append(f"| {case} | {routing} | {pss} | {base['median_ms']:.3f} | "
                       f"{fp8['median_ms']:.3f} | {peer} | {other['median_ms']:.3f} | "
                       f"{_ratio(other, fp8):.2f} | {err(mine)} | {err(theirs)} | {commit} |")
    if not out:
        return []
    return ["Rows above without the peer, against it in another run that timed mok bf16, "
            "mok-fp8 and the peer together (errors: the largest sum|diff|/sum|ref| and the "
            "smallest cosine against the f64 layer):", "",
            "| case | routing | pass | bf16 ms | fp8 ms | peer | peer ms | peer / fp8 | "
            "mok-fp8 error | peer error | commit |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + out + [""]


def bar_summary(rows):
    """One line per routing: how many of the issue's bars were met, and the missed ones."""
    out = []
    for routing in dict.fromkeys(r["routing"] for r in rows):
        checked, missed = 0, []
        for r in rows:
            if r["routing"] != routing:
                continue
            for what, v, ratio, bar in (("fp8", r["fp8_verdict"], r["fp8_speedup"], r["fp8_bar"]),
                                        ("fp8+quant", r["quant_verdict"], r["quant_speedup"],
                                         r["quant_bar"])):
                if v == "-":
                    if bar is not None:  # a bar with no measurement is missed too
                        checked += 1
                        missed.append(f"{r['case']} {what} not measured")
                    continue
                checked += 1
                if v == "FAIL":
                    missed.append(f"{r['case']} {what} {ratio:.2f}x < {bar:.2f}x")
        faster = [r for r in rows if r["routing"] == routing and r["fp8_over_peer"] is not None]
        slower = [f"{r['case']} {r['pass']}" for r in faster if r["fp8_over_peer"] <= 1]
        label = "the issue's bars" if routing == BAR_ROUTING else "for information"
        line = (f"- {routing} ({label}): {checked - len(missed)} of {checked} bars met"
                + (f"; missed: {'; '.join(missed)}" if missed else ""))
        if faster:
            line += (f"; mok-fp8 faster than the peer in {len(faster) - len(slower)} of "
                     f"{len(faster)}" + (f" (not: {', '.join(slower)})" if slower else ""))
        out.append(line)
    return out


def error_lines(records, suite="layer-fp8"):
    """Markdown: each implementation's distance from the f64 layer (the check before timing):
    the largest rel_l1 and the smallest cosine over the output and every gradient."""
    idx = layer_index(records, suite)
    errs = {(k[0], k[1], k[3]): c["f64_errors"] for k, c in idx.items() if c.get("f64_errors")}
    if not errs:
        return []
    impls = sorted({k[2] for k in errs}, key=lambda i: (i != BF16, i not in (FP8, FP8_QUANT), i))
    lines = ["Distance from the f64 layer of the bf16 values (out and every gradient: largest "
             "sum|diff|/sum|ref|, smallest cosine; MoK's MXFP8 bounds 0.1 and 0.996):", "",
             "| case | routing | " + " | ".join(impls) + " | mok-fp8 smaller than the peer |",
             "| --- | --- | " + " | ".join("---" for _ in impls) + " | --- |"]
    peer = next((p for p in PEERS if p in impls), None)
    for case, routing in sorted({k[:2] for k in errs}, key=_order):
        cells = []
        for impl in impls:
            rel, cos = _worst(errs.get((case, routing, impl)))
            cells.append("-" if rel is None else f"{rel:.4f} / {cos:.5f}")
        mine, theirs = _worst(errs.get((case, routing, FP8)))[0], _worst(
            errs.get((case, routing, peer)))[0] if peer else None
        smaller = verdict(None if mine is None or theirs is None else theirs / mine, 1.0)
        lines.append(f"| {case} | {routing} | " + " | ".join(cells) + f" | {smaller} |")
    return lines + [""]


def memory_lines(records, suite="layer-fp8"):
    """Markdown: memory per layer (the `memory` of each implementation's forward record)."""
    idx = layer_index(records, suite)
    mem = {(k[0], k[1], k[3]): c["memory"] for k, c in idx.items()
           if k[2] == "fwd" and isinstance(c.get("memory"), dict)}
    if not mem:
        return []
    lines = ["Memory per layer, MiB (torch's allocator around one forward+backward: what the "
             "forward leaves held for the backward, the peak above the start; mok's own "
             "workspace, outside torch's allocator, and its forward context; the FP8 weight "
             "copies):", "",
             "| case | routing | impl | forward held | fwd+bwd peak | workspace | context | "
             "FP8 weights |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def mib(v):
        return "-" if not isinstance(v, (int, float)) else f"{v / MiB:.0f}"
    for case, routing, impl in sorted(mem, key=lambda k: _order(k[:2]) + (k[2],)):
        m = mem[(case, routing, impl)]
        lines.append(f"| {case} | {routing} | {impl} | {mib(m.get('forward_held_bytes'))} | "
                     f"{mib(m.get('fwdbwd_peak_bytes'))} | {mib(m.get('workspace_bytes'))} | "
                     f"{mib(m.get('context_bytes'))} | {mib(m.get('fp8_weight_bytes'))} |")
    return lines + [""]


def interleaved_lines(records, suite="layer-fp8-interleaved"):
    """Markdown: the same paths interleaved call by call (one clock for all: closer to a ratio of
    cycles than the solo times, which are ratios of energy at the power limit)."""
    rows = layer_rows(records, suite)
    if not any(r["fp8_ms"] is not None for r in rows):
        return []
    lines = [f"## FP8 layer against mok bf16, interleaved call by call ({suite})", "",
             "| case | routing | pass | bf16 ms | fp8 ms | speedup | fp8+quant ms | speedup | "
             "peer ms | peer / fp8 | commit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['routing']} | {r['pass']} | {r['bf16_ms']:.3f} | "
                     f"{_fmt(r['fp8_ms'])} | {_fmt(r['fp8_speedup'], '.2f')}x | "
                     f"{_fmt(r['quant_ms'])} | {_fmt(r['quant_speedup'], '.2f')}x | "
                     f"{_fmt(r['peer_ms'])} | {_fmt(r['fp8_over_peer'], '.2f')} | "
                     f"{r['commit']} |")
    return lines + [""]


def gemm_rows(records, suite):
    """One dict per (case, routing, pass) where suite holds a mok-fp8 form: its speedup over the
    bf16 form (impl "mok"), the bar, its TFLOP/s, and torch-fp8's time over its."""
    idx = {(c["case"], c["routing"], c["pass"], c["impl"]): c for c in records
           if c.get("suite") == suite and _timed(c)}
    rows = []
    for key in sorted({k[:3] for k in idx if k[3] == FP8}, key=_order):
        case, routing, pss = key
        fp8 = idx[key + (FP8,)]
        bf16, peer = idx.get(key + ("mok",)), idx.get(key + ("torch-fp8",))
        bar = GEMM_BARS.get(pss) if case in GEMM_BAR_CASES and routing == BAR_ROUTING else None
        ratio = _ratio(bf16, fp8)
        tf_bar = (GEMM1_TFLOPS_BAR[1] if (case, pss, routing) == (GEMM1_TFLOPS_BAR[0], "gemm1",
                                                                      BAR_ROUTING) else None)
        over_peer = _ratio(peer, fp8)
        rows.append({"case": case, "routing": routing, "pass": pss,
                     "bf16_ms": bf16 and bf16["median_ms"], "fp8_ms": fp8["median_ms"],
                     "speedup": ratio, "bar": bar, "verdict": verdict(ratio, bar),
                     "tflops": fp8.get("tflops"), "tflops_bar": tf_bar,
                     "tflops_verdict": verdict(fp8.get("tflops"), tf_bar),
                     "peer_ms": peer and peer["median_ms"], "fp8_over_peer": over_peer,
                     "peer_verdict": verdict(over_peer, 1.0 + 1e-9) if over_peer else "-"})
    return rows


def gemm_lines(records):
    """Markdown: the FP8 GEMM forms against their bf16 forms and torch._scaled_grouped_mm, solo
    (suite gemm-solo) and interleaved (gemm), with issue 42's bars."""
    lines = []
    for suite, how in (("gemm-solo", "each form alone (impl filter)"),
                       ("gemm", "the forms interleaved round by round")):
        rows = gemm_rows(records, suite)
        if not rows:
            continue
        lines += [f"## FP8 GEMM forms against bf16, {how} ({suite})", "",
                  "Speedup: the bf16 form's time over the FP8 form's. Bars (issue 42): "
                  f"{', '.join(f'{p} {b}x' for p, b in GEMM_BARS.items())} on "
                  f"{' and '.join(GEMM_BAR_CASES)}, uniform; FP8 gate/up on "
                  f"{GEMM1_TFLOPS_BAR[0]} at least {GEMM1_TFLOPS_BAR[1]:.0f} TFLOP/s; every FP8 "
                  "form faster than torch._scaled_grouped_mm (torch-fp8: its time over mok's "
                  "above 1).", "",
                  "| case | routing | pass | bf16 ms | fp8 ms | speedup | bar | | fp8 TFLOP/s | "
                  "bar | | torch-fp8 ms | torch-fp8 / fp8 | |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
                  "| --- |"]
        for r in rows:
            lines.append(
                f"| {r['case']} | {r['routing']} | {r['pass']} | {_fmt(r['bf16_ms'], '.4f')} | "
                f"{r['fp8_ms']:.4f} | {_fmt(r['speedup'], '.2f')}x | {_fmt(r['bar'], '.2f')} | "
                f"{r['verdict']} | {_fmt(r['tflops'], '.0f')} | {_fmt(r['tflops_bar'], '.0f')} | "
                f"{r['tflops_verdict']} | {_fmt(r['peer_ms'], '.4f')} | "
                f"{_fmt(r['fp8_over_peer'], '.2f')} | {r['peer_verdict']} |")
        missed = [f"{r['case']} {r['pass']} {r['speedup']:.2f}x < {r['bar']}x" for r in rows
                  if r["verdict"] == "FAIL"]
        missed += [f"{r['case']} {r['pass']} {r['tflops']:.0f} < {r['tflops_bar']:.0f} TFLOP/s"
                   for r in rows if r["tflops_verdict"] == "FAIL"]
        missed += [f"{r['case']} {r['routing']} {r['pass']} not faster than torch-fp8"
                   for r in rows if r["peer_verdict"] == "FAIL"]
        checked = sum(r[v] != "-" for r in rows for v in ("verdict", "tflops_verdict",
                                                           "peer_verdict"))
        lines += ["", f"- {checked - len(missed)} of {checked} bars met"
                  + (f"; missed: {'; '.join(missed)}" if missed else ""), ""]
    return lines
