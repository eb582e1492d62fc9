"""The benchmarks' own logic, on the CPU: what bench/bench_layer.py's mok implementations hand to
mok (no layer runs here; mok.functional's entry points are replaced by recorders), and the tools
that read the benchmarks' output (traces, power samples, A/B results)."""
import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_layer as bl  # noqa: E402


@pytest.mark.parametrize("path", ["launches", "fused"])
def test_mok_impl_makes_every_call_with_its_forward_path(monkeypatch, path):
    # The forward path is a MoKConfig field: every call MokImpl makes (and so the C++ workspace
    # the first one creates) must carry the implementation's. When it was an environment variable
    # the C++ layer read at its creation, bench_layer's "fused" rows once timed the launches.
    import mok.functional as mf

    seen = []

    def record(name, result=None):
        def call(*args, **kwargs):
            config = next(a for a in (*args, *kwargs.values()) if isinstance(a, mf.MoKConfig))
            seen.append((name, config))
            return result
        return call

    monkeypatch.setattr(mf, "get_workspace", record("get_workspace", "workspace"))
    monkeypatch.setattr(mf, "build_schedule", record("build_schedule", "schedule"))
    monkeypatch.setattr(mf, "forward", record("forward", ("out", "ctx")))
    monkeypatch.setattr(mf, "backward", record("backward"))
    T, H, I, E, k = 4, 8, 16, 3, 2
    inp = {"x": torch.zeros(T, H), "ids": torch.zeros(T, k, dtype=torch.int64),
           "w": torch.zeros(T, k), "w_gate": torch.zeros(E, I, H), "w_up": torch.zeros(E, I, H),
           "w_down": torch.zeros(E, H, I), "shared": None, "d_out": torch.zeros(T, H)}
    impl = bl.MokImpl(path=path, minibatch=1024)
    impl.setup(inp)
    assert impl.forward() == "out"
    impl.backward("out")
    calls = [name for name, _ in seen]
    assert calls == ["get_workspace", "build_schedule", "forward", "backward"]
    for name, config in seen:
        assert config.forward_path == path, f"{name} ran with forward_path={config.forward_path!r}"
        assert config.minibatch_size == 1024, f"{name} lost the implementation's minibatch_size"


def _trace_words(ctas, tiles, tickets=None):
    """A trace as the megakernel lays it out (src/cuda/kernels/fused_forward.hpp)."""
    kinds = {"gate_up": 0, "down": 1, "shared_gate_up": 2, "shared_down": 3}
    tickets = len(tiles) if tickets is None else tickets
    words = [tickets, len(ctas), 7, 0]
    for start, pulled, end in ctas:
        words += [start, pulled, end, 0]
    for free, turned, ready, begin, landed, multiplied, end, cta, kind, block in tiles:
        words += [free, turned, ready, begin, landed, multiplied, end,
                  cta | kinds[kind] << 16 | block << 32]
    words += [0] * 8 * (tickets - len(tiles))
    return words


def test_trace_summary_reads_what_the_kernel_writes(tmp_path):
    import struct
    import trace_summary as ts

    # Two CTAs; CTA 0's pulls end at 2000 ns, CTA 1's at 500. Times in ns.
    ctas = [(1000, 2000, 9000), (1000, 500, 8000)]
    # (free, turned, ready, begin, landed, multiplied, end, CTA, kind, block)
    tiles = [
        (1000, 1000, 1100, 1100, 1300, 2900, 3100, 0, "gate_up", 0),  # 2 us, beside the pulls
        (2800, 3100, 3200, 3600, 4000, 5000, 5600, 0, "gate_up", 1),  # 2 us after; 0.5 us gap
        (1000, 1000, 0, 1000, 0, 0, 1000, 1, "gate_up", 2),  # an empty tile (no rows), 0 us
        (1000, 1000, 4000, 4000, 4200, 7800, 8000, 1, "down", 0),  # 4 us, waited 3 us
        (5000, 5600, 5700, 5700, 6100, 8700, 9000, 0, "down", 1),  # 3.3 us, 0.1 us gap
    ]
    path = tmp_path / "t.u64"
    words = _trace_words(ctas, tiles, tickets=6)  # one ticket never ran
    path.write_bytes(struct.pack(f"<{len(words)}Q", *words))
    launch = ts.parse(ts.read(path))
    assert launch["complete"] and len(launch["tiles"]) == 5
    r = ts.summarise(launch, tenths=2)
    assert r["span_us"] == pytest.approx(8.0)
    assert r["last_pull_us"] == pytest.approx(1.0)
    up = r["kinds"]["gate_up"]
    assert up["tiles"] == 3 and up["median_us"] == pytest.approx(2.0)
    assert up["beside_pulls"]["tiles"] == 1 and up["beside_pulls"]["median_us"] == pytest.approx(2)
    assert up["after_pulls"]["tiles"] == 2
    down = r["kinds"]["down"]
    assert down["tiles"] == 2 and down["mean_us"] == pytest.approx((4.0 + 3.3) / 2)
    assert down["wait_p99_us"] == pytest.approx(3.0)
    # Gaps: CTA 0 0.5 and 0.1 us; CTA 1 3 us (its empty tile ends at 1000, its down begins at
    # 4000).
    assert r["gaps_us"]["mean"] == pytest.approx((0.5 + 0.1 + 3.0) / 3)
    # First half [1000, 5000): gate_up busy 2000 + 1400 ns (+0 empty), down 1000, over 2 CTAs.
    assert r["timeline"][0]["gate_up"] == pytest.approx(3400 / (4000 * 2))
    assert r["timeline"][0]["down"] == pytest.approx(1000 / (4000 * 2))
    # The down tiles' parts (two loaded tiles: the p50 is the larger of each): first K block 0.2
    # and 0.4 us, K loop 3.6 and 2.6, epilogue 0.2 and 0.3, the Producer's draw 0 and 0.6.
    assert down["first_k_block_p50_us"] == pytest.approx(0.4)
    assert down["k_loop_p50_us"] == pytest.approx(3.6)
    assert down["epilogue_p50_us"] == pytest.approx(0.3)
    assert down["draw_p50_us"] == pytest.approx(0.6)
    # The next tile after a tile's end: CTA 0's second gate/up after its first (end 3100): free
    # -0.3, ready 0.1, landed 0.9 us; its down after that (end 5600): -0.6, 0.1, 0.5; CTA 1's down
    # after its empty tile (end 1000): 0, 3.0, 3.2.
    n = r["next_after_end_us"]
    assert n["free"]["p10"] == pytest.approx(-0.6)
    assert n["ready"]["p50"] == pytest.approx(0.1)
    assert n["landed"]["p50"] == pytest.approx(0.9) and n["landed"]["p90"] == pytest.approx(3.2)
    with pytest.raises(ValueError, match="not a trace"):
        bad = _trace_words(ctas, [(1, 1, 2, 3, 3, 3, 4, 5, "down", 0)])
        ts.parse(bad)


def test_solo_power_lines_phases_up_with_the_samples(tmp_path):
    import datetime

    import solo_power as sp

    # Samples every 0.1 s from t0: the unfused phase [t0 + 1, t0 + 2] at 1500 MHz and 700 W, the
    # fused phase [t0 + 3, t0 + 4] at 1400 MHz and 690 W, the dense one [t0 + 5, t0 + 6] at 1480.
    t0 = 1_800_000_000.0
    lines = []
    for i in range(70):
        t = t0 + 0.1 * i
        mhz, watts = (1400, 690.0) if 30 <= i <= 40 else (1480, 691.0) if i >= 50 else (1500, 700.0)
        stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
        lines.append(f"{stamp.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz} MHz, {watts} W, 60")
    lines.insert(3, "garbage, line")
    smi = tmp_path / "smi.csv"
    smi.write_text("\n".join(lines) + "\n")
    log = tmp_path / "run.log"
    log.write_text(
        "qwen3-30b-a3b  uniform W 1 queued unfused    2.800 ms  fused    2.600 ms  ...\n"
        f"  solo unfused    2.000 ms (median of 9 calls, wall clock {t0 + 0.95:.3f} to "
        f"{t0 + 2.05:.3f})\n"
        f"  solo fused      1.900 ms (median of 9 calls, wall clock {t0 + 2.95:.3f} to "
        f"{t0 + 4.05:.3f})\n"
        f"dense bf16 GEMM timed over wall clock {t0 + 4.95:.3f} to {t0 + 5.55:.3f}\n"
        f"mok dense bf16 GEMM timed over wall clock {t0 + 5.95:.3f} to {t0 + 6.95:.3f}\n"
        "mok dense bf16 GEMM sustained 670.2 TFLOP/s, 0.986 x cuBLAS's 680.0\n"
        "dense bf16 GEMM sustained 680.0 TFLOP/s: the layer's 1.237 TFLOP in 1.819 ms\n")
    records = sp.phases(log, sp.read_samples(smi))
    assert [r["path"] for r in records] == ["unfused", "fused", "dense", "mok-dense"]
    u, f, d, own = records
    assert own["tflops"] == 670.2 and own["over_cublas"] == 0.986 and own["samples"] == 10
    assert "layer_ms_at_dense_rate" not in own and d["tflops"] == 680.0
    assert u["case"] == "qwen3-30b-a3b W1" and u["routing"] == "uniform"
    assert u["sm_mhz_mean"] == pytest.approx(1500) and u["power_w_mean"] == pytest.approx(700)
    assert f["sm_mhz_mean"] == pytest.approx(1400) and f["samples"] == 11
    assert u["mcycles_per_call"] == pytest.approx(3.0)  # 2 ms at 1500 MHz
    assert f["joules_per_call"] == pytest.approx(1.9 * 0.690)
    assert d["sm_mhz_mean"] == pytest.approx(1480) and d["layer_ms_at_dense_rate"] == 1.819
    assert "median_ms" not in d


def test_fused_results_turns_a_solo_run_into_both_suites(tmp_path):
    import fused_results as fr

    run = {"suite": "layer-virtual-ranks", "case": "dsv3-ep8slice", "routing": "skewed", "ranks": 8,
           "pass": "fwd", "sync": False, "reps": 30, "unfused_ms": 6.3, "fused_ms": 5.6,
           "pair_ratio_median": 1.12, "pair_ratio_q1": 1.11, "pair_ratio_q3": 1.13, "solo_s": 6.0,
           "solo_unfused_ms": 6.0, "solo_fused_ms": 5.0, "trace": None,
           "dense_tflops_sustained": 680.0, "dense_ms": 4.0, "unfused_over_dense": 1.575,
           "fused_over_dense": 1.4}
    power = [{"case": "dsv3-ep8slice W8", "routing": "skewed", "path": p, "samples": 150,
              "sm_mhz_mean": mhz, "power_w_mean": 690.0, "median_ms": ms,
              "mcycles_per_call": ms * mhz / 1000, "joules_per_call": ms * 0.69}
             for p, ms, mhz in (("unfused", 6.0, 1500.0), ("fused", 5.0, 1400.0))]
    power.append({"case": "dsv3-ep8slice W8", "routing": None, "path": "mok-dense", "samples": 200,
                  "tflops": 675.0, "over_cublas": 0.993})
    out = fr.convert([run], power, "abc1234", "2026-12-04", "Logs: here.")
    by = {(r["suite"], r["impl"]): r for r in out}
    assert len(out) == 4 and {r["case"] for r in out} == {"dsv3-ep8slice-W8virtual"}
    pair = by[("layer-fused", "mok-fused")]
    assert pair["median_ms"] == 5.6 and pair["over_dense"] == 1.4 and pair["pair_ratio_median"] == 1.12
    solo_u, solo_f = by[("layer-fused-solo", "mok-unfused")], by[("layer-fused-solo", "mok-fused")]
    assert solo_u["median_ms"] == 6.0 and solo_u["over_dense"] == 1.5 and solo_u["ranks"] == 8
    assert solo_f["over_dense"] == 1.25 and solo_f["sm_mhz_mean"] == 1400.0
    assert solo_f["engine_dense_tflops_sustained"] == 675.0 and solo_f["commit"] == "abc1234"
    # A path without its power samples, or logs of another run, is refused, not recorded blind.
    with pytest.raises(SystemExit, match="no power samples"):
        fr.convert([run], power[1:], "abc1234", "2026-12-04", "")
    run["solo_unfused_ms"], power[0]["median_ms"] = 0.3125, 0.313  # the log's rounding: the same
    assert fr.convert([run], power, "abc1234", "2026-12-04", "")[2]["median_ms"] == 0.3125
    power[0]["median_ms"] = 0.314
    with pytest.raises(SystemExit, match="not the JSON's"):
        fr.convert([run], power, "abc1234", "2026-12-04", "")


def _layer_file(path, name, cells):
    doc = {"gpu": "test", "commit": name, "date": "2026-12-04",
           "cases": [{"suite": "layer", "case": c, "routing": "uniform", "pass": p, "impl": "mok",
                      "median_ms": ms} for (c, p), ms in cells.items()]}
    path.write_text(json.dumps(doc))


def test_ab_summary_divides_each_package_by_the_base(tmp_path):
    import ab_summary

    # Two rounds of a base B and a change A (file order puts A first: the base is named).
    _layer_file(tmp_path / "A.round1.json", "A", {("qwen3", "fwd"): 2.0, ("qwen3", "fwdbwd"): 8.0})
    _layer_file(tmp_path / "B.round1.json", "B", {("qwen3", "fwd"): 2.2, ("qwen3", "fwdbwd"): 8.4})
    _layer_file(tmp_path / "A.round2.json", "A", {("qwen3", "fwd"): 2.2, ("qwen3", "fwdbwd"): 8.2})
    _layer_file(tmp_path / "B.round2.json", "B", {("qwen3", "fwd"): 2.2, ("qwen3", "fwdbwd"): 8.6})
    (tmp_path / "B.round3.log").write_text("not a results file")
    cells, names = ab_summary.load(tmp_path)
    assert names == ["A", "B"]
    assert cells[("qwen3", "uniform", "fwdbwd")] == {"A": [8.0, 8.2], "B": [8.4, 8.6]}
    out = ab_summary.lines(cells, names, "B")
    fwd = next(line for line in out if " fwd " in line)
    bwd = next(line for line in out if " fwdbwd " in line)
    assert "A 2.100 (2.000, 2.200) 0.955" in fwd and "B 2.200 (2.200, 2.200) 1.000" in fwd
    assert "A 8.100 (8.000, 8.200) 0.953" in bwd


def test_ab_layer_refuses_what_it_cannot_compare(tmp_path):
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ab-layer"
    for args, says in ((["A=."], "at least two"), (["A=.", f"B={tmp_path}/none"], "not a directory"),
                       (["A=.", "oops"], "is not NAME=DIR"), (["A=.", "A=."], "twice")):
        r = subprocess.run(["bash", str(script), str(tmp_path / "out"), *args],
                           capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert says in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("no_sync", [False, True], ids=["sync", "no_sync"])
def test_fsdp_accumulation_runs_its_three_paths(tmp_path, no_sync):
    # bench/fsdp_accumulation.py's logic on CPU (gloo, wall clock, the "tiny" case): its check
    # (the kept quantization's outputs bit for bit the per-call ones after a step) passes, and a
    # row carries each path's median.
    from conftest import torchrun

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fsdp_accumulation.py"
    out = tmp_path / "accum.json"
    torchrun(str(script), 1, ["--device", "cpu", "--cases", "tiny", "--micro", "3", "--reps", "1",
                              "--out", str(out)] + (["--no-sync"] if no_sync else []),
             300, "fsdp_accumulation")
    (row,) = json.loads(out.read_text())
    assert row["case"] == "tiny" and row["micro_batches"] == 3 and row["no_sync"] == no_sync
    for path in ("bf16", "fp8 per call", "fp8 once a step"):
        assert row[path] > 0, (path, row)
