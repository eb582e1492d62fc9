"""Memory of four mok.nn.MoE layers of DeepSeek-V3's per-rank shape on one GPU (PERF.md case
dsv3-ep8slice: T 4096, H 7168, I 2048, 32 local experts, k 8, shared expert 2048; bf16).

The layers share one workspace, and one C++ workspace (scratch) serves all four: its device
memory is taken once, not per layer. Each layer's forward context is tensors autograd keeps until
that layer's backward. Measured: torch's peak allocation, the device's free memory
(torch.cuda.mem_get_info, which also sees mok's own cudaMalloc), the workspace's bytes, each
layer's context bytes. With MOK_MEMORY_JSON=path the numbers are written there as JSON.

Slow (about 10-30 s on an H200, most of it initialising 12 GB of weights): marked `slow`, run by
the suite; deselect with -m "not slow".
"""

import json
import os
import time

import pytest
import torch
from conftest import HAVE_GPU, NO_GPU_REASON, requires_cuda

import mok

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)

CASE = "dsv3-ep8slice"
T, H, I, E, K, S = 4096, 7168, 2048, 32, 8, 2048
LAYERS = 4
MiB = 1 << 20


@requires_cuda
@pytest.mark.slow
def test_four_dsv3_layers_share_one_workspace(gen):
    start = time.perf_counter()
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    dev = torch.device("cuda")
    modules = [mok.nn.MoE(H, I, E, K, shared_intermediate_size=S, device=dev)
               for _ in range(LAYERS)]
    ws = modules[0]._workspace
    assert all(m._workspace is ws for m in modules)
    cuda_gen = torch.Generator(device=dev).manual_seed(int(torch.randint(1 << 30, (1,),
                                                                         generator=gen)))
    xs = [torch.randn(T, H, device=dev, generator=cuda_gen).to(torch.bfloat16)
          for _ in modules]
    d_outs = [torch.randn(T, H, device=dev, generator=cuda_gen).to(torch.bfloat16)
              for _ in modules]
    weight_bytes = sum(p.nbytes for p in modules[0].parameters())

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    reserved_before = torch.cuda.memory_reserved()
    allocated_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    shape_key = (T, H, I, E, K, S)
    existing = [key for key in ws._cores if key[:6] == shape_key and key[7].type == "cuda"]
    assert not existing, "this test needs a fresh C++ workspace for its shape"

    outs = [m(x)[0] for m, x in zip(modules, xs)]
    torch.cuda.synchronize()
    allocated_forward = torch.cuda.memory_allocated()
    for i in reversed(range(LAYERS)):
        outs[i].backward(d_outs[i])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free_after, _ = torch.cuda.mem_get_info()
    reserved_after = torch.cuda.memory_reserved()

    # One C++ workspace for the four layers' shape, counted once. NOTES: its own counts, not the
    # workspace's sum: creating it may evict another shape's (a small LRU), whose counts leave the
    # sum.
    cores = [c for key, c in ws._cores.items() if key[:6] == shape_key and key[7].type == "cuda"]
    assert len(cores) == 1, f"{len(cores)} C++ workspaces for one layer shape"
    counts = cores[0].native.call_counts
    workspace_bytes = cores[0].native.bytes
    assert counts == (LAYERS, 0, LAYERS), f"(forward, recompute, backward) calls: {counts}"

    # Each layer's context, from the tensors a forward returns.
    with torch.no_grad():
        ids, w, _ = modules[0].route(xs[0])
        weights = (modules[0].routed_gate_weights, modules[0].routed_up_weights,
                   modules[0].routed_down_weights, modules[0].shared_gate_weights,
                   modules[0].shared_up_weights, modules[0].shared_down_weights)
        _, *context = mok.ops.forward(xs[0], ids, w, *weights, ws.handle)
        context_shapes = [list(t.shape) for t in context]
        context_bytes = sum(t.nbytes for t in context)
        del context

    # Device memory that is not torch's (mok's cudaMalloc, module code): one workspace, not four.
    device_growth = (free_before - free_after)
    non_torch_growth = device_growth - (reserved_after - reserved_before)
    forward_growth = allocated_forward - allocated_before
    result = {
        "case": CASE, "layers": LAYERS,
        "shape": dict(num_tokens=T, hidden_size=H, intermediate_size=I, num_experts=E, topk=K,
                      shared_intermediate_size=S, dtype="bfloat16"),
        "device": torch.cuda.get_device_name(dev),
        "workspace_cores": len(cores), "workspace_bytes": workspace_bytes,
        "workspace_bytes_all_shapes": ws.bytes,
        "context_bytes_per_layer": context_bytes, "context_shapes": context_shapes,
        "weight_bytes_per_layer": weight_bytes,
        "allocated_before_bytes": allocated_before,
        "allocated_after_forward_above_start_bytes": forward_growth,
        "peak_allocated_bytes": peak, "peak_allocated_above_start_bytes": peak - allocated_before,
        "device_used_growth_bytes": device_growth, "non_torch_growth_bytes": non_torch_growth,
        "device_total_bytes": total,
        "call_counts": dict(zip(("forward", "recompute", "backward"), counts)),
        "seconds": round(time.perf_counter() - start, 2),
    }
    path = os.environ.get("MOK_MEMORY_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))

    # Autograd holds each layer's context (and the router's fp32 copy of x, the output) until its
    # backward: at least the four contexts, at most those plus a few [T, H] tensors per layer.
    assert forward_growth >= LAYERS * context_bytes, result
    assert forward_growth <= LAYERS * (context_bytes + 4 * T * H * 2) + 64 * MiB, result
    # mok's own device memory grew by at most one workspace (plus module code and handles).
    assert non_torch_growth <= workspace_bytes + 512 * MiB, result
