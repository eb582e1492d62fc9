"""Session 20: mok.ops.call's direct path against PyTorch's dispatcher, same process, same inputs.
Per case: drained calls (sync, event, build_schedule + forward [+ backward], event, sync: the
host's enqueue time counts, as in bench_layer) and queued calls (host us per call), the two ways
alternating in blocks; medians over every block."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "bench")
import bench_layer as bl  # noqa: E402
from mok import ops  # noqa: E402

direct = ops._untraced
dispatched = lambda args: False  # noqa: E731


def drained_ms(fn, n):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return ts


def queued_host_us(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / n


cases = [c for c in bl.SMALL_CASES] + ["qwen3-30b-a3b"]
for case in cases:
    w = bl.make_weights(case, 7)
    inp = bl.make_inputs(case, False, 0, w)
    impl = bl.MokImpl()
    impl.setup(inp)
    # The two ways give the same bits (out and d_x) before any timing.
    bits = {}
    for name, way in (("direct", direct), ("dispatched", dispatched)):
        ops._untraced = way
        with torch.no_grad():
            out = impl.forward().clone()
        impl.backward(out)
        bits[name] = out
    assert torch.equal(bits["direct"], bits["dispatched"]), case

    def fwd():
        with torch.no_grad():
            impl.forward()

    def fwdbwd():
        impl.backward(impl.forward())

    small = case != "qwen3-30b-a3b"
    blocks, n = (8, 25) if small else (4, 10)
    res = {}
    for label, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        for name in ("direct", "dispatched"):
            ops._untraced = direct if name == "direct" else dispatched
            for _ in range(5):
                fn()
        acc = {m: {"direct": [], "dispatched": []} for m in ("drained", "host")}
        for b in range(blocks):
            order = ("direct", "dispatched") if b % 2 == 0 else ("dispatched", "direct")
            for name in order:
                ops._untraced = direct if name == "direct" else dispatched
                acc["drained"][name] += drained_ms(fn, n)
                acc["host"][name].append(queued_host_us(fn, n))
        d = {m: {k: statistics.median(v) for k, v in acc[m].items()} for m in acc}
        print(f"{case:26s} {label:6s} drained ms direct {d['drained']['direct']:.4f} dispatched "
              f"{d['drained']['dispatched']:.4f} ratio {d['drained']['dispatched'] / d['drained']['direct']:.3f}"
              f" | queued host us direct {d['host']['direct']:.1f} dispatched {d['host']['dispatched']:.1f}",
              flush=True)
    ops._untraced = direct
    impl = None
    bl.release_memory()
