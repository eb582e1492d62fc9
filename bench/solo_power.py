#!/usr/bin/env python3
"""What each path of `bench_virtual_ranks --solo` cost in cycles and energy: its solo phases lined
up with the SM clock and board power that nvidia-smi sampled meanwhile.

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \\
               --format=csv,noheader -lms 20 > smi.csv &
    bench_virtual_ranks --case qwen3-30b-a3b --ranks 1 --dense --solo 4 > qwen3.log
    python3 bench/solo_power.py smi.csv qwen3.log [more logs] [--json out.json]

For every phase (each path's solo calls, and the dense GEMM of --dense): the median call, the
clock's median and mean, the mean power and temperature over the phase, and per call the mega
cycles (ms x mean MHz / 1000) and the joules (ms x mean W / 1000). At the power limit the board
holds ~700 W whatever runs, so a path's time is its energy over that power: a path that saves
cycles but spends them at a higher power gains less time than the cycles say (docs/perf/NOTES.md,
the 2026-12-04 cec3016 entry). nvidia-smi's timestamps are read as UTC (the device machine's zone).
"""
import argparse
import datetime
import json
import re
import statistics

_SOLO = re.compile(r"^(?P<case>\S+)\s+(?P<routing>uniform|skewed)\s+W (?P<w>\d+)")
_PHASE = re.compile(r"solo (?P<path>\w+)\s+(?P<ms>[\d.]+) ms .*wall clock (?P<a>[\d.]+) to "
                    r"(?P<b>[\d.]+)")
_DENSE = re.compile(r"^dense bf16 GEMM timed over wall clock (?P<a>[\d.]+) to (?P<b>[\d.]+)")
# mok's own engine on the dense GEMM's product, timed right after it (--dense).
_OWN_DENSE = re.compile(r"^mok dense bf16 GEMM timed over wall clock (?P<a>[\d.]+) to (?P<b>[\d.]+)")
_RATE = re.compile(r"^dense bf16 GEMM sustained (?P<tflops>[\d.]+) TFLOP/s: "
                   r"the layer's [\d.]+ TFLOP in (?P<ms>[\d.]+) ms")
_OWN_RATE = re.compile(r"^mok dense bf16 GEMM sustained (?P<tflops>[\d.]+) TFLOP/s, "
                       r"(?P<ratio>[\d.]+) x cuBLAS's")


def read_samples(path):
    """(unix seconds, MHz, W, degrees C or None) per parseable line of nvidia-smi's CSV."""
    samples = []
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            if len(fields) < 3:
                continue
            try:
                t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
                at = t.replace(tzinfo=datetime.timezone.utc).timestamp()
                mhz = float(fields[1].split()[0])
                watts = float(fields[2].split()[0])
            except ValueError:
                continue
            temp = float(fields[3]) if len(fields) > 3 and fields[3].isdigit() else None
            samples.append((at, mhz, watts, temp))
    return samples


def phase_record(samples, a, b, ms):
    inside = [s for s in samples if a <= s[0] <= b]
    if len(inside) < 5:
        return None
    mhz = [s[1] for s in inside]
    watts = statistics.mean(s[2] for s in inside)
    temps = [s[3] for s in inside if s[3] is not None]
    rec = {"samples": len(inside), "sm_mhz_median": statistics.median(mhz),
           "sm_mhz_mean": round(statistics.mean(mhz), 1), "power_w_mean": round(watts, 1),
           "temperature_c_mean": round(statistics.mean(temps), 1) if temps else None}
    if ms is not None:
        rec["median_ms"] = ms
        rec["mcycles_per_call"] = round(ms * rec["sm_mhz_mean"] / 1000, 4)
        rec["joules_per_call"] = round(ms * watts / 1000, 4)
    return rec


def phases(log_path, samples):
    out, case, routing = [], None, None  # case: "<name> W<ranks>"
    with open(log_path) as f:
        for line in f:
            m = _SOLO.match(line)
            if m:
                case, routing = f"{m['case']} W{m['w']}", m["routing"]
                continue
            m = _PHASE.search(line)
            if m:
                rec = phase_record(samples, float(m["a"]), float(m["b"]), float(m["ms"]))
                out.append({"case": case, "routing": routing, "path": m["path"], **(rec or {})})
                continue
            m = _DENSE.search(line)
            if m:
                rec = phase_record(samples, float(m["a"]), float(m["b"]), None)
                out.append({"case": case, "routing": None, "path": "dense", **(rec or {})})
                continue
            m = _OWN_DENSE.search(line)
            if m:
                rec = phase_record(samples, float(m["a"]), float(m["b"]), None)
                out.append({"case": case, "routing": None, "path": "mok-dense", **(rec or {})})
                continue
            m = _OWN_RATE.search(line)
            own_rec = [r for r in out if r["path"] == "mok-dense"]
            if m and own_rec:
                own_rec[-1]["tflops"] = float(m["tflops"])
                own_rec[-1]["over_cublas"] = float(m["ratio"])
                continue
            m = _RATE.search(line)
            dense_rec = [r for r in out if r["path"] == "dense"]
            if m and dense_rec:
                dense_rec[-1]["tflops"] = float(m["tflops"])
                dense_rec[-1]["layer_ms_at_dense_rate"] = float(m["ms"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("smi_csv")
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--json")
    args = ap.parse_args()
    samples = read_samples(args.smi_csv)
    records = [r for log in args.logs for r in phases(log, samples)]
    print(f"{'case':18s} {'routing':8s} {'path':8s} {'ms':>8s} {'MHz':>6s} {'W':>6s} {'C':>5s} "
          f"{'Mcyc/call':>10s} {'J/call':>7s}")
    for r in records:
        if "samples" not in r:
            print(f"{r['case'] or '':18s} {r['routing'] or '':8s} {r['path']:8s} (too few samples)")
            continue
        ms = f"{r['median_ms']:8.3f}" if "median_ms" in r else f"{'':8s}"
        cyc = f"{r['mcycles_per_call']:10.3f}" if "mcycles_per_call" in r else f"{'':10s}"
        joules = f"{r['joules_per_call']:7.3f}" if "joules_per_call" in r else f"{'':7s}"
        temp = f"{r['temperature_c_mean']:5.1f}" if r["temperature_c_mean"] is not None else "    -"
        print(f"{r['case'] or '':18s} {r['routing'] or '':8s} {r['path']:8s} {ms} "
              f"{r['sm_mhz_mean']:6.0f} {r['power_w_mean']:6.1f} {temp} {cyc} {joules}")
    # Unfused over fused, per routing: time, cycles, energy; each path alone over the dense time.
    by = {(r["case"], r["routing"], r["path"]): r for r in records if "median_ms" in r}
    dense = {r["case"]: r["layer_ms_at_dense_rate"] for r in records
             if "layer_ms_at_dense_rate" in r}
    for (case, routing, path), f in by.items():
        u = by.get((case, routing, "unfused"))
        if path != "fused" or u is None:
            continue
        line = (f"{case} {routing}: unfused/fused time {u['median_ms'] / f['median_ms']:.3f}, "
                f"cycles {u['mcycles_per_call'] / f['mcycles_per_call']:.3f}, "
                f"energy {u['joules_per_call'] / f['joules_per_call']:.3f}")
        if case in dense:
            line += (f"; over the dense time: unfused {u['median_ms'] / dense[case]:.3f}, "
                     f"fused {f['median_ms'] / dense[case]:.3f}")
        print(line)
    for r in records:
        if r["path"] == "mok-dense" and "over_cublas" in r:
            print(f"{r['case']}: mok's dense engine {r['tflops']:.1f} TFLOP/s, "
                  f"{r['over_cublas']:.3f} x cuBLAS's rate")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records}, f, indent=1)


if __name__ == "__main__":
    main()
