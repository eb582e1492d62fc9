"""Session 19: the host time of one mok forward, piece by piece (T1024-H1024-I512-E32-k2 and
qwen3-30b-a3b): host microseconds per call, calls queued back to back."""
import sys
import time

import torch

sys.path.insert(0, "bench")
import bench_layer as bl  # noqa: E402
import mok.functional as mf  # noqa: E402
from mok import _C, ops  # noqa: E402


def host_us(fn, n):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / n, 1e6 * (t2 - t0) / n


for case, n in (("T1024-H1024-I512-E32-k2", 400), ("qwen3-30b-a3b", 40)):
    w = bl.make_weights(case, 7)
    inp = bl.make_inputs(case, False, 0, w)
    impl = bl.MokImpl()
    impl.setup(inp)
    impl.forward()
    sched = impl.schedule
    sg, su, sd = impl.shared
    weights = (inp["w_gate"], inp["w_up"], inp["w_down"], sg, su, sd)
    handle = impl.ws.handle_for(impl.config)
    x, ids, rw = inp["x"], sched.topk_experts, inp["w"]
    shape, ws, config = ops._layer(handle, x, ids, rw, weights)
    out = ops._new((shape.num_tokens, shape.hidden_size), shape.activation_dtype, shape.device)
    context = ops._new_context(ws, config, shape)
    views = ops._views(x, ids, rw, *weights, out)
    cviews = ops._context_views(context)
    core = ws.core(shape, config)
    raw = ops.forward._init_fn if hasattr(ops.forward, "_init_fn") else None

    def native_only():
        _C.forward(core.native, *views, *cviews, swiglu_limit=None)

    pieces = [
        ("bench MokImpl.forward (build_schedule + forward)", impl.forward),
        ("mf.build_schedule", lambda: mf.build_schedule(impl.ws, impl.config, inp["ids"],
                                                        num_local_experts=impl.E)),
        ("mf.forward", lambda: mf.forward(impl.config, impl.ws, sched, x, rw, sg, su, sd,
                                          *weights[:3])),
        ("torch.ops.mok.forward", lambda: torch.ops.mok.forward(x, ids, rw, *weights, handle)),
        ("ops._layer (checks)", lambda: ops._layer(handle, x, ids, rw, weights)),
        ("outputs: out + _new_context", lambda: (ops._new((shape.num_tokens, shape.hidden_size),
                                                          shape.activation_dtype, shape.device),
                                                 ops._new_context(ws, config, shape))),
        ("ops._views + _context_views", lambda: (ops._views(x, ids, rw, *weights, out),
                                                 ops._context_views(context))),
        ("ops._call(_C.forward) on ready views", lambda: ops._call(
            _C.forward, core, x.device, *views, *cviews, swiglu_limit=None)),
    ]
    if raw is not None:
        pieces.append(("the op's Python body (no dispatcher)",
                       lambda: raw(x, ids, rw, *weights, handle)))
    with torch.cuda.device(x.device):
        core.native.set_stream(torch.cuda.current_stream(x.device).cuda_stream)
        pieces.append(("_C.forward alone (C++: launches)", native_only))
        for name, fn in pieces:
            h, wall = host_us(fn, n)
            print(f"{case:26s} {name:48s} host {h:8.1f} us  wall {wall:8.1f} us", flush=True)
    impl = None
    bl.release_memory()
