#!/usr/bin/env python3
"""docs/perf/layer_fused.json from one H200 run of `bench_virtual_ranks --dense --solo S`
(scripts like docs/perf/runs/2026-12-04-516e55a-engine/run3.sh): its --json files and
bench/solo_power.py's --json over the same logs.

    python3 bench/fused_results.py --commit C --date D --runs RUN_DIR \\
        --solo-power solo_power.json solo-*.json [--out docs/perf/layer_fused.json]

Two suites, both forward only, impls mok-unfused (the launches) and mok-fused (the megakernel):
  layer-fused       the two paths interleaved call by call, queued (--dense implies --queued): each
                    path's median and the median of per-pair ratios (unfused over fused);
  layer-fused-solo  each path alone at the power limit (--solo): the median call, the SM clock,
                    power, cycles and joules solo_power.py measured over it.
Both carry over_dense: the path's time over the layer's FLOPs at the dense bf16 rate cuBLAS
sustained in the same process (issue 16's bar), and solo records the rate mok's own engine
sustained on that product (engine_dense_tflops_sustained), where the run measured it.
A W > 1 run is case "<case>-W<W>virtual", as before. A path that solo_power.py could not line up
with enough power samples is an error, not a record without them.
"""
import argparse
import json
import pathlib
import sys

_PAIRS_METHOD = (
    "bench_virtual_ranks --dense: the two paths interleaved call by call, each routing warmed up "
    "2 s back to back, {reps} pairs queued; over_dense: the median over the layer's FLOPs "
    "(6 T k H I + 6 T H S) at the dense bf16 rate cuBLAS sustained (8192^3, back to back, the "
    "median call after 2 s of 6) in the same process. {runs}")
_SOLO_METHOD = (
    "bench_virtual_ranks --dense --solo {solo:g}: each path alone, calls queued back to back for "
    "{solo:g} s, the median call of the last half (unfused first for uniform routing, fused first "
    "for skewed); SM clock and board power sampled by nvidia-smi every 20 ms over that half "
    "(bench/solo_power.py); over_dense: the median over the layer's FLOPs at the dense bf16 rate "
    "cuBLAS sustained in the same process; engine_dense_tflops_sustained: mok's own GEMM engine "
    "on that product right after it. {runs}")


def case_name(case, ranks):
    return case if ranks == 1 else f"{case}-W{ranks}virtual"


def convert(run_records, power_records, commit, date, runs):
    power = {(r["case"], r["routing"], r["path"]): r for r in power_records}
    engine = {r["case"]: r["tflops"] for r in power_records
              if r["path"] == "mok-dense" and "tflops" in r}
    out = []
    for r in run_records:
        name, ranks = case_name(r["case"], r["ranks"]), r["ranks"]
        base = {"case": name, "routing": r["routing"], "pass": r["pass"]}
        dense = {"dense_tflops_sustained": r["dense_tflops_sustained"], "dense_ms": r["dense_ms"]}
        for impl, path in (("mok-unfused", "unfused"), ("mok-fused", "fused")):
            out.append({"suite": "layer-fused", **base, "impl": impl,
                        "median_ms": r[f"{path}_ms"],
                        "pair_ratio_median": r["pair_ratio_median"],
                        "pair_ratio_q1": r["pair_ratio_q1"], "pair_ratio_q3": r["pair_ratio_q3"],
                        "reps": r["reps"], "over_dense": round(r[f"{path}_over_dense"], 4),
                        **dense, "method": _PAIRS_METHOD.format(reps=r["reps"], runs=runs),
                        "commit": commit, "date": date})
        if not r.get("solo_s"):
            continue
        key = f"{r['case']} W{ranks}"
        for impl, path in (("mok-unfused", "unfused"), ("mok-fused", "fused")):
            p = power.get((key, r["routing"], path))
            if p is None or "joules_per_call" not in p:
                raise SystemExit(f"no power samples for {key} {r['routing']} {path}")
            ms = r[f"solo_{path}_ms"]
            # The log prints 3 decimals, the JSON 4: they agree to the log's rounding.
            if abs(p["median_ms"] - ms) > 5.001e-4:
                raise SystemExit(f"{key} {r['routing']} {path}: the log's {p['median_ms']} ms is not "
                                 f"the JSON's {ms} ms (logs and JSON of different runs?)")
            rec = {"suite": "layer-fused-solo", **base, "ranks": ranks, "impl": impl,
                   "median_ms": ms, "sm_mhz_mean": p["sm_mhz_mean"],
                   "power_w_mean": p["power_w_mean"], "mcycles_per_call": p["mcycles_per_call"],
                   "joules_per_call": p["joules_per_call"],
                   "over_dense": round(ms / r["dense_ms"], 4), **dense}
            if key in engine:
                rec["engine_dense_tflops_sustained"] = engine[key]
            rec.update({"commit": commit, "date": date,
                        "method": _SOLO_METHOD.format(solo=r["solo_s"], runs=runs)})
            out.append(rec)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs_json", nargs="+", help="bench_virtual_ranks --json files")
    ap.add_argument("--solo-power", required=True, help="solo_power.py --json over the same logs")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--runs", required=True, help="where the run's logs are kept (for the method)")
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "docs" /
                                         "perf" / "layer_fused.json"))
    args = ap.parse_args(argv)
    run_records = [r for f in args.runs_json for r in json.loads(pathlib.Path(f).read_text())["records"]]
    power_records = json.loads(pathlib.Path(args.solo_power).read_text())["records"]
    cases = convert(run_records, power_records, args.commit, args.date, f"Logs: {args.runs}.")
    doc = {"gpu": args.gpu, "commit": args.commit, "date": args.date, "cases": cases}
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(cases)} records -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
