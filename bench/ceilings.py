#!/usr/bin/env python3
"""Measure the two ceilings of PERF.md on this GPU: dense bf16 GEMM (8192^3, cuBLAS through
torch) and device-to-device copy bandwidth (bytes read + written). Writes docs/perf/ceilings.json
(or the path given).

Also the dense GEMM rate a long run sustains (`bf16_tflops_sustained`): the same product, back to
back for several seconds, timed after the first two. The H200 holds its 700 W power limit by
lowering the SM clock, and a GEMM at full rate draws more than that, so a loop of 30 products
(PERF.md's method) measures a rate a training step longer than about a second never sees (NOTES,
the 2026-12-02 6aff195 entry). The SM clock and power over both timings are recorded beside them."""
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_clocks import ClockSampler  # noqa: E402
from timing import median_ms  # noqa: E402


def sustained_ms(fn, seconds=6.0, settle_s=2.0):
    """Median time of fn() over calls issued back to back for `seconds`, leaving out the first
    `settle_s` (while the clock comes down to where the power limit holds it)."""
    events = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((time.perf_counter() - start, a, b))
        if len(events) % 16 == 0:
            b.synchronize()  # keep the host within a few calls of the GPU
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for t, a, b in events if t >= settle_s)
    return times[len(times) // 2]


def main(out_path):
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    with ClockSampler() as clk:
        ms = median_ms(lambda: x @ y, reps=30, warmup=5)
    tflops = 2 * n**3 / (ms * 1e9)
    with ClockSampler() as clk_sustained:
        ms_sustained = sustained_ms(lambda: x @ y)
    tflops_sustained = 2 * n**3 / (ms_sustained * 1e9)
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    ms_copy = median_ms(lambda: dst.copy_(src), reps=20, warmup=5)
    tbps = 2 * src.numel() * 4 / (ms_copy * 1e9)
    # The device machine gets a copy of the tree without .git: the caller passes MOK_COMMIT.
    commit = os.environ.get("MOK_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name(), "commit": commit,
              "date": datetime.date.today().isoformat(),
              "ceilings": {"bf16_tflops": round(tflops, 1), "hbm_tbps": round(tbps, 3),
                           "bf16_tflops_sustained": round(tflops_sustained, 1)},
              "clocks": {"bf16_tflops": clk.summary(), "bf16_tflops_sustained": clk_sustained.summary()}}
    print(json.dumps(result))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/perf/ceilings.json")
