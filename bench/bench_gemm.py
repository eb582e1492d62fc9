"""torch._grouped_mm and dense cuBLAS baselines for the grouped GEMM benchmark, and the merge.

Usage: python3 bench/bench_gemm.py MOK_JSONL OUT_DIR [--baselines-from GEMM_JSON] [--commit TEXT]
                                    [--note TEXT] [--solo JSONL ...]
Runs the same problems as bench_gemm.cu (same cases, same per-expert row counts), times them the
same way (CUDA events, 5 warm-ups, median of 20 runs, 256 MB L2 flush before each, ROUNDS rounds
over all problems of a case and routing, the median of the rounds' medians and their spread),
merges the mok results, and writes OUT_DIR/gemm.json (PERF.md's schema, suite "gemm") and README-gemm.md.
--baselines-from takes the torch and dense rows of an earlier gemm.json instead of timing them
(to merge another mok build measured in that same run); it needs no GPU.

FP8 (issue 42): "torch-fp8" rows are torch._scaled_grouped_mm with rowwise e4m3 scales, fast
accumulation, bf16 out, operands quantized outside the timing, as torchao's FP8 MoE recipe calls
it: gemm1, gemm2 and dgrad (2-D x 3-D, one scale per row of the left operand and per output
column of each expert's weight) and wgrad (2-D x 2-D, groups along the tokens, one scale per
group and column of both operands: bench/torch_fp8_moe.py; its groups must be 16-row multiples,
so a skewed routing's groups are padded with rows of data, whose extra products it pays for and
the FLOPs leave out). --solo JSONL (repeatable): bench_gemm.cu runs filtered to one impl (each
form alone at the power limit); their rows become suite "gemm-solo". README-gemm.md ends with the
FP8 forms against their bf16 forms and torch-fp8 under issue 42's bars (bench/fp8_bars.py).
"""
import argparse
import datetime
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fp8_bars  # noqa: E402
from gpu_clocks import ClockSampler  # noqa: E402

CASES = [("dsv3-ep8slice", 4096, 7168, 2048, 32, 8), ("dsv3-ep1", 4096, 7168, 2048, 256, 8),
         ("qwen3-30b-a3b", 16384, 2048, 768, 128, 8), ("mixtral-8x7b", 8192, 4096, 14336, 8, 2)]
BF16_TFLOPS, HBM_TBPS = 790.0, 4.22  # PERF.md ceilings on one H200
REPS = 20
ROUNDS = 5


def routing_counts(t, e, k, skewed):  # same function as bench_gemm.cu
    total = t * k
    if not skewed:
        return [total // e + (1 if g < total % e else 0) for g in range(e)]
    c0 = total // 2
    rest, others = total - c0, e - 1
    return [c0] + [rest // others + (1 if g - 1 < rest % others else 0) for g in range(1, e)]


FLUSH = None


def median_ms(fn, reps=REPS):
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        FLUSH.fill_(r & 0xFF)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def first_working(variants):
    """The first (name, fn) whose call succeeds; torch's layout rules differ between versions."""
    import torch
    errors = []
    for name, fn in variants:
        try:
            out = fn()
            torch.cuda.synchronize()
            return name, fn, out
        except Exception as ex:  # noqa: BLE001 - report and try the next layout
            errors.append(f"{name}: {str(ex).splitlines()[0]}")
    raise RuntimeError("; ".join(errors))


def rel_err(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def time_baselines(cases=None):
    """torch._grouped_mm and dense cuBLAS rows for every case (or those named), routing and pass."""
    global FLUSH
    import torch
    dev = torch.device("cuda")
    FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    torch.manual_seed(0)
    rows_out = []
    for name, t, h, i, e, k in CASES:
        if cases is not None and name not in cases:
            continue
        for skewed in (False, True):
            routing = "skewed" if skewed else "uniform"
            counts = routing_counts(t, e, k, skewed)
            rows = sum(counts)
            offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
            x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
            hid = torch.randn(rows, i, device=dev, dtype=torch.bfloat16)
            dy = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
            w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * (h ** -0.5)
            wd = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * (i ** -0.5)
            flops1 = 2.0 * rows * h * i
            g0 = counts[0]
            forms = {
                "gemm1": (2 * flops1, [("x@w13^T", lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs))],
                          lambda out: rel_err(out[:g0], x[:g0].float() @ w13[0].float().t()),
                          (rows, 2 * i, h), rows * h * 2 + e * 2 * i * h * 2 + rows * i * 2),
                "gemm2": (flops1, [("h@wd^T", lambda: torch._grouped_mm(hid, wd.transpose(-2, -1), offs=offs))],
                          lambda out: rel_err(out[:g0], hid[:g0].float() @ wd[0].float().t()),
                          (rows, h, i), rows * i * 2 + e * h * i * 2 + rows * h * 2),
                "dgrad": (flops1, [("dy@wd", lambda: torch._grouped_mm(dy, wd, offs=offs)),
                                   ("dy@wd(colmajor)", lambda: torch._grouped_mm(
                                       dy, wd.transpose(-2, -1).contiguous().transpose(-2, -1), offs=offs))],
                          lambda out: rel_err(out[:g0], dy[:g0].float() @ wd[0].float()),
                          (rows, i, h), rows * h * 2 + e * h * i * 2 + rows * i * 2),
                "wgrad": (flops1, [("dy^T@h", lambda: torch._grouped_mm(dy.t(), hid, offs=offs)),
                                   ("dy^T@h(contig)", lambda: torch._grouped_mm(dy.t().contiguous(), hid, offs=offs))],
                          lambda out: rel_err(out[0], dy[:g0].float().t() @ hid[:g0].float()),
                          (h, i, rows), rows * h * 2 + rows * i * 2 + e * h * i * 2),
            }
            timed = []  # (pass, flops, floor, variant, fn, err): timed in rounds below
            for pss, (flops, variants, check, dense_shape, min_bytes) in forms.items():
                floor_ms = max(flops / (BF16_TFLOPS * 1e12), min_bytes / (HBM_TBPS * 1e12)) * 1e3
                try:
                    vname, fn, out = first_working(variants)
                    err = check(out)
                    del out
                    median_ms(fn, 5)  # a warm-up round, as bench_gemm.cu does for mok's items
                    timed.append((pss, flops, floor_ms, vname, fn, err))
                except Exception as ex:  # noqa: BLE001
                    print(f"{name} {routing} {pss} torch FAILED: {ex}", flush=True)
                    rows_out.append(dict(suite="gemm", case=name, routing=routing, **{"pass": pss}, impl="torch",
                                         error=str(ex)[:300], floor_ms=round(floor_ms, 5)))
                # Dense cuBLAS GEMM with the same FLOPs (M x N x K of the whole problem, one weight).
                m_, n_, k_ = dense_shape
                if not skewed:  # routing-independent: same total rows
                    a = torch.randn(m_, k_, device=dev, dtype=torch.bfloat16)
                    b = torch.randn(n_, k_, device=dev, dtype=torch.bfloat16)
                    ms = median_ms(lambda: torch.mm(a, b.t()))
                    rows_out.append(dict(suite="gemm", case=name, routing=routing, **{"pass": pss},
                                         impl="cublas-dense", median_ms=round(ms, 5),
                                         tflops=round(2.0 * m_ * n_ * k_ / ms / 1e9, 2), floor_ms=round(floor_ms, 5)))
                    del a, b
            # torch's FP8 on Hopper: torch._scaled_grouped_mm with rowwise scales (one per row of
            # x and per output column of each expert's weight), e4m3, bf16 output (impl "torch-fp8").
            fp8_timed = []
            try:
                forms8 = fp8_forms(torch, x, hid, dy, w13, wd, offs, g0, counts)
            except Exception as ex:  # noqa: BLE001  (e.g. out of memory on a smaller card)
                print(f"{name} {routing} torch-fp8 operands FAILED: {ex}", flush=True)
                rows_out.append(dict(suite="gemm", case=name, routing=routing, **{"pass": "all"},
                                     impl="torch-fp8", error=str(ex)[:300]))
                forms8 = {}
            for pss, (flops, fn, check) in forms8.items():
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    err = check(out)
                    del out
                    median_ms(fn, 5)
                    fp8_timed.append((pss, flops, None, "rowwise", fn, err))
                except Exception as ex:  # noqa: BLE001
                    print(f"{name} {routing} {pss} torch-fp8 FAILED: {ex}", flush=True)
                    rows_out.append(dict(suite="gemm", case=name, routing=routing, **{"pass": pss},
                                         impl="torch-fp8", error=str(ex)[:300]))
            timed = [(*t, "torch") for t in timed] + [(*t, "torch-fp8") for t in fp8_timed]
            per_round = [[median_ms(fn) for (_, _, _, _, fn, _, _) in timed] for _ in range(ROUNDS)]
            for j, (pss, flops, floor_ms, vname, fn, err, impl) in enumerate(timed):
                v = sorted(r[j] for r in per_round)
                ms = v[len(v) // 2]
                row = dict(suite="gemm", case=name, routing=routing, **{"pass": pss}, impl=impl,
                           median_ms=round(ms, 5), tflops=round(flops / ms / 1e9, 2), rel_err=err,
                           variant=vname, rounds=ROUNDS, round_min_ms=round(v[0], 5),
                           round_max_ms=round(v[-1], 5))
                if floor_ms is not None:
                    row["floor_ms"] = round(floor_ms, 5)
                rows_out.append(row)
                print(f"{name:14s} {routing:8s} {pss:6s} {impl:9s} {ms:9.4f} ms {flops / ms / 1e9:7.1f} TF/s "
                      f"err {err:.2e} [{v[0]:.4f}, {v[-1]:.4f}]", flush=True)
            del timed, per_round, fp8_timed, forms8
            del x, hid, dy, w13, wd
            torch.cuda.empty_cache()
    rows_out.extend(dense_fp8_rows(torch))
    return rows_out, torch.cuda.get_device_name(0), torch.__version__


def fp8_rowwise(torch, t):
    """e4m3 values and fp32 scales, one per row of the last two dims' rows (amax / 448); 3-D
    tensors one expert at a time (a whole [256, 4096, 7168] weight in fp32 is 28 GiB)."""
    if t.dim() == 3:
        parts = [fp8_rowwise(torch, t[e]) for e in range(t.shape[0])]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    s = t.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / 448.0
    return (t.float() / s).to(torch.float8_e4m3fn), s.squeeze(-1)


def fp8_forms(torch, x, hid, dy, w13, wd, offs, g0, counts):
    """pass -> (flops, fn, check): torch._scaled_grouped_mm on the layer's GEMM shapes."""
    from torch_fp8_moe import ALIGN, quantize_group_columns
    x8, xs = fp8_rowwise(torch, x)
    h8, hs = fp8_rowwise(torch, hid)
    dy8, dys = fp8_rowwise(torch, dy)
    w13_8, w13s = fp8_rowwise(torch, w13)  # [e, 2i, h], scales [e, 2i]
    wd8, wds = fp8_rowwise(torch, wd)      # [e, h, i], scales [e, h]
    # dgrad's weight: per expert and output column i (amax along h), as W_down^T [e, i, h].
    wdt8, wdts = fp8_rowwise(torch, wd.transpose(-2, -1).contiguous())
    rows, h = x.shape
    i = hid.shape[1]
    flops1 = 2.0 * rows * h * i

    def mm(a8, a_s, b8, b_s):
        return lambda: torch._scaled_grouped_mm(a8, b8.transpose(-2, -1), a_s, b_s, offs=offs,
                                                out_dtype=torch.bfloat16, use_fast_accum=True)
    # wgrad: dW_down[e] = dy[rows of e]^T h[rows of e], groups along the tokens, 16-row aligned.
    padded = [-(-c // ALIGN) * ALIGN for c in counts]
    offs_p = torch.tensor(padded, device=x.device).cumsum(0).to(torch.int32)
    dy_p = torch.randn(sum(padded), h, device=x.device, dtype=torch.bfloat16)
    h_p = torch.randn(sum(padded), i, device=x.device, dtype=torch.bfloat16)
    go8, go_inv = quantize_group_columns(dy_p, offs_p)
    hp8, hp_inv = quantize_group_columns(h_p, offs_p)
    p0 = padded[0]

    def wgrad():
        return torch._scaled_grouped_mm(go8.t(), hp8, go_inv, hp_inv, offs=offs_p,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)
    return {
        "gemm1": (2 * flops1, mm(x8, xs, w13_8, w13s),
                  lambda out: rel_err(out[:g0], x[:g0].float() @ w13[0].float().t())),
        "gemm2": (flops1, mm(h8, hs, wd8, wds),
                  lambda out: rel_err(out[:g0], hid[:g0].float() @ wd[0].float().t())),
        "dgrad": (flops1, mm(dy8, dys, wdt8, wdts),
                  lambda out: rel_err(out[:g0], dy[:g0].float() @ wd[0].float())),
        "wgrad": (flops1, wgrad,
                  lambda out: rel_err(out[0], dy_p[:p0].float().t() @ h_p[:p0].float())),
    }


def dense_fp8_rows(torch):
    """cuBLAS's FP8 rate on a dense 8192^3 (torch._scaled_mm, rowwise scales), PERF.md's anchor."""
    n = 8192
    try:
        a8, a_s = fp8_rowwise(torch, torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
        b8, b_s = fp8_rowwise(torch, torch.randn(n, n, device="cuda", dtype=torch.bfloat16))

        def fn():
            return torch._scaled_mm(a8, b8.t(), scale_a=a_s[:, None], scale_b=b_s[None, :],
                                    out_dtype=torch.bfloat16)
        fn()
        # The clock it sustains, against the forms' (bench_gemm.cu): 200 calls (about 0.2 s), so
        # that the 10 ms sampler sees the card settled at the power limit, not its first calls.
        with ClockSampler() as clocks:
            ms = median_ms(fn, 200)
        return [dict(suite="gemm", case="dense-8192", routing="none", **{"pass": "mm"},
                     impl="cublas-fp8-dense", median_ms=round(ms, 5),
                     tflops=round(2.0 * n ** 3 / ms / 1e9, 2), clocks=clocks.summary())]
    except Exception as ex:  # noqa: BLE001
        return [dict(suite="gemm", case="dense-8192", routing="none", **{"pass": "mm"},
                     impl="cublas-fp8-dense", error=str(ex)[:300])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mok_jsonl")
    ap.add_argument("out_dir")
    ap.add_argument("--baselines-from")
    ap.add_argument("--commit")
    ap.add_argument("--note", help="a sentence for the README, under the generated-by line")
    ap.add_argument("--cases", help="comma-separated case names to time (default: all four)")
    ap.add_argument("--solo", action="append", default=[],
                    help="bench_gemm.cu's rows of a run filtered to one impl (suite gemm-solo)")
    cli = ap.parse_args()
    mok_path, out_dir = cli.mok_jsonl, cli.out_dir
    if cli.baselines_from:
        with open(cli.baselines_from) as f:
            old = json.load(f)
        rows_out = [r for r in old["cases"] if r.get("impl") in ("torch", "torch-fp8", "cublas-dense", "cublas-fp8-dense")]
        gpu, torch_version, date = old["gpu"], old["torch"], old["date"]
    else:
        rows_out, gpu, torch_version = time_baselines(
            set(cli.cases.split(",")) if cli.cases else None)
        date = datetime.date.today().isoformat()

    floors = {(r["case"], r["routing"], r["pass"]): r["floor_ms"] for r in rows_out
              if r.get("floor_ms") is not None}  # torch-fp8 and the dense FP8 row have none
    with open(mok_path) as f:
        for line in f:
            r = json.loads(line)
            r.setdefault("suite", "gemm")
            r["floor_ms"] = floors.get((r["case"], r["routing"], r["pass"]))
            rows_out.append(r)
    for path in cli.solo:
        with open(path) as f:
            for line in f:
                r = dict(json.loads(line), suite="gemm-solo")
                r["floor_ms"] = floors.get((r["case"], r["routing"], r["pass"]))
                rows_out.append(r)
    commit = cli.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except Exception:  # noqa: BLE001
            commit = ""
    doc = {"gpu": gpu, "commit": commit, "date": date,
           "ceilings": {"bf16_tflops": BF16_TFLOPS, "hbm_tbps": HBM_TBPS},
           "torch": torch_version, "cases": rows_out}
    if cli.note:
        doc["note"] = cli.note
    with open(f"{out_dir}/gemm.json", "w") as f:
        json.dump(doc, f, indent=1)

    # Table: TFLOP/s per case, routing and pass; mok / torch ratio.
    idx = {(r["case"], r["routing"], r["pass"], r["impl"]): r for r in rows_out
           if r.get("suite", "gemm") == "gemm"}
    def spread(r):
        lo, hi = r.get("round_min_ms"), r.get("round_max_ms")
        return f"{lo:.3f}-{hi:.3f}" if lo is not None and hi is not None else ""

    lines = ["| case | routing | pass | floor ms | mok ms (rounds) | mok TFLOP/s | torch ms (rounds) | "
             "torch._grouped_mm TFLOP/s | mok / torch | dense cuBLAS TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def num(r, key):  # a missing or None value prints as nan
        v = r.get(key)
        return v if isinstance(v, (int, float)) else float("nan")

    def ratio(a, b):
        return f"{a['tflops'] / b['tflops']:.2f}x" if a.get("tflops") and b.get("tflops") else "n/a"

    for name, *_ in CASES:
        for routing in ("uniform", "skewed"):
            for pss in ("gemm1", "gemm2", "dgrad", "wgrad"):
                m = idx.get((name, routing, pss, "mok"), {})
                tr = idx.get((name, routing, pss, "torch"), {})
                d = idx.get((name, routing, pss, "cublas-dense"), idx.get((name, "uniform", pss, "cublas-dense"), {}))
                label = pss + (" (SwiGLU)" if pss == "gemm1" else "")
                lines.append(f"| {name} | {routing} | {label} | {num(m, 'floor_ms'):.3f} | "
                             f"{num(m, 'median_ms'):.3f} ({spread(m)}) | {num(m, 'tflops'):.0f} | "
                             f"{num(tr, 'median_ms'):.3f} ({spread(tr)}) | "
                             f"{num(tr, 'tflops'):.0f} | {ratio(m, tr)} | "
                             f"{num(d, 'tflops'):.0f} |")
            u = idx.get((name, routing, "gemm1", "mok-unfused"))
            m = idx.get((name, routing, "gemm1", "mok"))
            if u and m:
                lines.append(f"| {name} | {routing} | gemm1 plain (no SwiGLU) | | "
                             f"{u['median_ms']:.3f} ({spread(u)}) | {u['tflops']:.0f} | | | "
                             f"SwiGLU cost {m['median_ms'] / u['median_ms']:.3f}x | |")
    with open(f"{out_dir}/README-gemm.md", "w") as f:
        f.write(f"# Grouped GEMM benchmark ({doc['gpu']}, torch {torch_version}, {doc['date']})\n\n"
                "Generated by bench/bench_gemm.py from bench_gemm.cu's results; see docs/perf/NOTES.md (## gemm).\n\n")
        if cli.note:
            f.write(cli.note + "\n\n")
        f.write("\n".join(lines) + "\n")
        fp8 = fp8_bars.gemm_lines(rows_out)
        if fp8:
            f.write("\n" + "\n".join(fp8) + "\n")
    print("\n".join(lines + [""] + fp8_bars.gemm_lines(rows_out)))


if __name__ == "__main__":
    main()
