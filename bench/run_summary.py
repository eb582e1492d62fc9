#!/usr/bin/env python3
"""One line per `mok run --json` output file: times and the check (used by scripts/gpu-suite).

A run with `precision` (e.g. "fp8") says so; every check object in the file (`check`, and any
other key starting with "check", e.g. an FP8 run's check against the f64 layer beside the one
against the FP8 reference) is printed and must have passed."""
import json
import sys


def check_text(name, c):
    return (f"{name} {'passed' if c['passed'] else 'FAILED'}  out {c['out_rel_err']:.2e}  "
            f"grads {c['grad_rel_err_max']:.2e}")


status = 0
for path in sys.argv[1:]:
    try:
        j = json.load(open(path))
    except (OSError, ValueError):
        print(f"{path}: no JSON ({open(path).read()[-300:]!r})")
        status = 1
        continue
    checks = {k: v for k, v in j.items() if k.startswith("check") and isinstance(v, dict)}
    precision = f" {j['precision']:5s}" if "precision" in j else ""
    print(f"{j['preset']:15s} {j['routing']:8s}{precision} fwd {j['fwd_ms']:8.3f} ms  "
          f"bwd {j['bwd_ms']:8.3f} ms  " + "  ".join(check_text(k, c) for k, c in checks.items()))
    status |= 0 if checks and all(c["passed"] for c in checks.values()) else 1
sys.exit(status)
