#!/usr/bin/env python3
"""Measure the two ceilings of PERF.md on this GPU: dense bf16 GEMM (8192^3, cuBLAS through
torch) and device-to-device copy bandwidth (bytes read + written). Writes docs/perf/ceilings.json
(or the path given)."""
import datetime
import json
import os
import pathlib
import subprocess
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402


def main(out_path):
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: x @ y, reps=30, warmup=5)
    tflops = 2 * n**3 / (ms * 1e9)
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    ms_copy = median_ms(lambda: dst.copy_(src), reps=20, warmup=5)
    tbps = 2 * src.numel() * 4 / (ms_copy * 1e9)
    # The device machine gets a copy of the tree without .git: the caller passes MOK_COMMIT.
    commit = os.environ.get("MOK_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name(), "commit": commit,
              "date": datetime.date.today().isoformat(),
              "ceilings": {"bf16_tflops": round(tflops, 1), "hbm_tbps": round(tbps, 3)}}
    print(json.dumps(result))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/perf/ceilings.json")
