"""CUDA-event timing shared by the Python benchmarks (PERF.md's method).

With WALL_CLOCK (no GPU here, or a caller checking a benchmark's logic on CPU tensors sets it) the
same calls time wall clock instead."""
import time

import torch

WALL_CLOCK = not torch.cuda.is_available()


def synchronize():
    """torch.cuda.synchronize(), unless WALL_CLOCK."""
    if not WALL_CLOCK:
        torch.cuda.synchronize()


def event_ms(fn):
    """One call of fn() between two CUDA events, in ms (waits for the second)."""
    if WALL_CLOCK:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def median_ms(fn, reps=20, warmup=5, warmup_s=0.0):
    """Median over `reps` calls of fn(), each between two CUDA events, after `warmup` calls and,
    with `warmup_s`, after calls back to back for that many seconds. NOTES: the H200 holds its
    power limit by lowering the clock over about a second, so the first timings after an idle GPU
    (a new process, a data set-up) run at a clock a sustained training loop never sees; warming up
    for a few seconds measures every implementation in that sustained state."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        fn()
        synchronize()
    times = sorted(event_ms(fn) for _ in range(reps))
    return times[len(times) // 2]
