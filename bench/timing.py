"""CUDA-event timing shared by the Python benchmarks (PERF.md's method)."""
import torch


def median_ms(fn, reps=20, warmup=5):
    """Median over `reps` calls of fn(), each between two CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
