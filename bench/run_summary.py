#!/usr/bin/env python3
"""One line per `mok run --json` output file: times and the check (used by scripts/gpu-suite)."""
import json
import sys

status = 0
for path in sys.argv[1:]:
    try:
        j = json.load(open(path))
    except (OSError, ValueError):
        print(f"{path}: no JSON ({open(path).read()[-300:]!r})")
        status = 1
        continue
    c = j["check"]
    print(f"{j['preset']:15s} {j['routing']:8s} fwd {j['fwd_ms']:8.3f} ms  bwd {j['bwd_ms']:8.3f} ms  "
          f"check {'passed' if c['passed'] else 'FAILED'}  out {c['out_rel_err']:.2e}  "
          f"grads {c['grad_rel_err_max']:.2e}")
    status |= 0 if c["passed"] else 1
sys.exit(status)
