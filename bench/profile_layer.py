#!/usr/bin/env python3
"""Where a layer call's time goes: host time of each Python step, CUDA-event time, and the
kernels of one call (torch.profiler), for mok through mok.functional and for the PyTorch baseline.

    python3 bench/profile_layer.py [--cases a,b] [--routing uniform] [--out DIR]
"""
import argparse
import json
import re
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_layer as bl  # noqa: E402
from timing import median_ms  # noqa: E402


def host_ms(fn, reps=10):
    """Host time of fn() alone (the GPU drained before each call)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def short_name(key):
    """A kernel's name without namespaces, argument lists or template noise, so the GEMM forms
    (FormKind 0-4 and their epilogues) stay distinguishable."""
    key = re.sub(r"\(anonymous namespace\)::|mok::[a-z_]+::|void |\(mok::gemm::FormKind\)", "", key)
    key = re.sub(r"\((CUtensorMap_st|KernelParams|[A-Za-z_:]+Params)[^)]*\)$", "", key)
    return key[:120]


def kernels(fn, trace=None):
    """Kernels of one call of fn(): [(name, count, total us)] by total time, and the GPU busy sum.
    With `trace`, the call's timeline is also written there (Chrome trace JSON)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type == torch.autograd.DeviceType.CUDA and us > 0:
            rows.append((short_name(e.key), e.count, us))
    rows.sort(key=lambda r: -r[2])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(bl.CASES))
    ap.add_argument("--routing", default="uniform", choices=bl.ROUTINGS)
    ap.add_argument("--impls", default="mok,torch")
    ap.add_argument("--out", default=".")
    ap.add_argument("--trace", action="store_true", help="also write each call's Chrome trace")
    args = ap.parse_args()
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    report = {}
    for case in args.cases.split(","):
        weights = bl.make_weights(case, 7)
        inp = bl.make_inputs(case, args.routing, 0, weights)
        for name in args.impls.split(","):
            impl = bl.IMPLS[name][0]()  # mok, mok-1pass, mok-2pass, mok-fused..., torch
            impl.setup(inp)

            def fwd():
                with torch.no_grad():
                    return impl.forward()

            def fwdbwd():
                impl.backward(impl.forward())

            r = {"fwd_ms": median_ms(fwd, 10), "fwdbwd_ms": median_ms(fwdbwd, 10),
                 "fwd_host_ms": host_ms(fwd), "fwdbwd_host_ms": host_ms(fwdbwd)}
            trace = str(pathlib.Path(args.out, f"trace_{case}_{name}.json")) if args.trace else None
            fks = kernels(fwd)
            r["fwd_kernel_sum_ms"] = sum(k[2] for k in fks) / 1e3
            r["fwd_kernels"] = fks
            ks = kernels(fwdbwd, trace)
            r["fwdbwd_kernel_sum_ms"] = sum(k[2] for k in ks) / 1e3
            r["kernels"] = ks
            report[f"{case}/{name}"] = r
            print(f"== {case} {args.routing} {name}: fwd {r['fwd_ms']:.3f} ms (host {r['fwd_host_ms']:.3f}),"
                  f" fwd+bwd {r['fwdbwd_ms']:.3f} ms (host {r['fwdbwd_host_ms']:.3f}), kernel sum"
                  f" {r['fwdbwd_kernel_sum_ms']:.3f} ms", flush=True)
            print(f"   forward kernels ({r['fwd_kernel_sum_ms']:.3f} ms in all):")
            for kname, count, us in fks[:12]:
                print(f"   {us / 1e3:8.3f} ms  x{count:<3d} {kname}")
            print("   forward+backward kernels:")
            for kname, count, us in ks[:25]:
                print(f"   {us / 1e3:8.3f} ms  x{count:<3d} {kname}")
            impl = None
            bl.release_memory()  # the next implementation starts from no workspace
        pathlib.Path(args.out, "profile_layer.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
