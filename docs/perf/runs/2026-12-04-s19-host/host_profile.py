"""Session 19: where the host time of a mok layer call goes (drained calls pay it; a host that runs
ahead hides it). Per case: host time per call queued back to back, then cProfile of the same."""
import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, "bench")
import bench_layer as bl  # noqa: E402

for case, n in (("T1024-H1024-I512-E32-k2", 200), ("qwen3-30b-a3b", 40)):
    w = bl.make_weights(case, 7)
    inp = bl.make_inputs(case, False, 0, w)
    for name in ("mok", "torch"):
        impl = bl.IMPLS[name][0]()
        impl.setup(inp)
        for what, fn in (("fwd", lambda: impl.forward()),
                         ("fwdbwd", lambda: impl.backward(impl.forward()))):
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"== {case} {name} {what}: host {1e6 * (t1 - t0) / n:.1f} us a call, "
                  f"wall {1e6 * (t2 - t0) / n:.1f} us a call ({n} calls queued)", flush=True)
            if name != "mok":
                continue
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
            print(s.getvalue()[-6000:], flush=True)
        impl = None
        bl.release_memory()
