"""CUDA tensors: mok's CUDA backend against the fp64 reference and against itself (bitwise), under
CUDA graphs, with bad inputs. Skipped, with a reason that says so, on machines without a CUDA GPU
(conftest.NO_GPU_REASON): scripts/gpu-suite fails a GPU run on such a skip.

Also on CUDA, in other files: torch.compile (test_autograd.py), layers sharing a workspace, main
grads and recompute_forward_context (test_shared_workspace.py), bad forward contexts
(test_errors.py), memory of four DeepSeek-V3-sized layers (test_gpu_memory.py).
"""

import re

import pytest
import torch
from conftest import (GRAD_TOLERANCE, HAVE_GPU, NO_GPU_REASON, OUT_TOLERANCE,
                      LayerData, make_layer, requires_cuda)
from test_extension import _python_with_this_mok
from test_layer import GRAD_NAMES, check_against_reference

import mok

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)


def run_moe_cuda(data, workspace=None):
    """mok.moe forward + backward on CUDA copies of `data`: (out, grads in mok's order)."""
    x, w, *weights = [t.detach().cuda().requires_grad_(True) if t is not None else None
                      for t in (data.x, data.topk_weights, *data.weights)]
    out = mok.moe(x, data.topk_experts.cuda(), w, *weights, workspace=workspace)
    out.backward(data.d_out.cuda())
    grads = [x.grad, w.grad, *[t.grad if t is not None else None for t in weights]]
    return out.detach().cpu(), [g.cpu() if g is not None else None for g in grads]


def assert_bitwise(got, want, what=""):
    out, grads = got
    assert torch.equal(out, want[0]), f"{what} out"
    for name, a, b in zip(GRAD_NAMES, grads, want[1]):
        assert (a is None and b is None) or torch.equal(a, b), f"{what} {name}"


@requires_cuda
@pytest.mark.parametrize("shape", [(1, 64, 64, 1, 1, 0, "random"),
                                   (33, 64, 128, 4, 2, 64, "random"),
                                   (257, 128, 64, 8, 3, 0, "one_expert"),
                                   (4, 64, 64, 4, 2, 64, "none")],
                         ids=lambda s: "T{}-H{}-I{}-E{}-k{}-S{}-{}".format(*s))
def test_cuda_layer_matches_fp64_reference(gen, shape):
    data = make_layer(gen, *shape[:6], routing=shape[6])
    out, grads = run_moe_cuda(data)
    check_against_reference(data, out, grads, OUT_TOLERANCE, GRAD_TOLERANCE)


@requires_cuda
def test_cuda_layer_is_bitwise_reproducible(gen):
    data = make_layer(gen, 100, 64, 64, 6, 2, 64)
    assert_bitwise(run_moe_cuda(data), run_moe_cuda(data))


@requires_cuda
def test_cuda_workspaces_of_different_expert_counts_interleave(gen):
    """Layers of different shapes (here 8, then 2, local experts) each get a C++ workspace; calls
    alternate between them in any order. (Anything a workspace configures process-wide, such as a
    kernel's shared-memory limit, must suit every live workspace, not the last one created.)"""
    wide = make_layer(gen, 64, 128, 64, 8, 2, 64)
    narrow = make_layer(gen, 64, 128, 64, 2, 2, 0)
    first = run_moe_cuda(wide)
    run_moe_cuda(narrow)
    assert_bitwise(run_moe_cuda(wide), first, "8 experts after a 2-expert workspace:")


# --- CUDA graphs ------------------------------------------------------------------------------

def _router_step(params, x, bias, drop, d_out, d_w_sink, k):
    """One training step: a softmax router (on x detached, so that x.grad is the layer's d_x),
    mok.moe, backward of <out, d_out> into every .grad. `bias` [T, E] steers the routing, `drop`
    [T, k] turns slots into -1; d_w_sink receives d(topk_weights). Returns (out, ids, w)."""
    router, *weights = params
    logits = x.detach().float() @ router.t() + bias
    chosen, ids = logits.softmax(dim=-1).topk(k, dim=-1)
    w = chosen / chosen.sum(dim=-1, keepdim=True)
    ids = ids.masked_fill(drop, -1)
    w.register_hook(lambda g: d_w_sink.copy_(g))
    out = mok.moe(x, ids, w, *weights)
    (out.float() * d_out.float()).sum().backward()
    return out, ids, w


@requires_cuda
def test_cuda_graph_training_step_replays_new_inputs(gen):
    """torch.cuda.graph captures a whole step (router + mok.moe forward + backward into .grad);
    replays with new x, new routings (spread, skewed onto one expert, with -1 slots) and new
    d_out copied into the static tensors give eager's bits, and the fp64 reference's values."""
    T, H, I, E, k, S = 96, 128, 64, 8, 2, 64
    dev = torch.device("cuda")
    base = make_layer(gen, T, H, I, E, k, S)
    router = torch.randn(E, H, generator=gen) * H**-0.5
    values = [router] + list(base.weights)

    def fresh_params():
        return [v.detach().clone().to(dev).requires_grad_(True) for v in values]

    def draw(kind):
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        bias = torch.zeros(T, E)
        drop = torch.zeros(T, k, dtype=torch.bool)
        if kind == "skewed":  # every token's first choice is expert 3
            bias[:, 3] = 30.0
        if kind == "dropped":  # a third of the slots -1, token 0 entirely
            drop = torch.rand(T, k, generator=gen) < 0.3
            drop[0] = True
        d_out = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        return [t.to(dev) for t in (x, bias, drop, d_out)]

    def eager(inputs):
        params = fresh_params()
        x = inputs[0].clone().requires_grad_(True)
        sink = torch.zeros(T, k, device=dev)
        out, ids, w = _router_step(params, x, *inputs[1:], sink, k)
        return [out, ids, w, sink, x.grad] + [p.grad for p in params]

    params = fresh_params()
    static_x = torch.zeros(T, H, dtype=torch.bfloat16, device=dev, requires_grad=True)
    static_in = [torch.zeros(T, E, device=dev), torch.zeros(T, k, dtype=torch.bool, device=dev),
                 torch.zeros(T, H, dtype=torch.bfloat16, device=dev)]
    sink = torch.zeros(T, k, device=dev)
    leaves = params + [static_x]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph asks
        for _ in range(2):
            for t in leaves:
                t.grad = None
            _router_step(params, static_x, *static_in, sink, k)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_ids, static_w = _router_step(params, static_x, *static_in, sink, k)
    static_results = [static_out, static_ids, static_w, sink, static_x.grad] + \
        [p.grad for p in params]

    names = ["out", "topk_experts", "topk_weights", "d_topk_weights", "d_x", "d_router"] + \
        list(GRAD_NAMES[2:])
    for kind in ("spread", "skewed", "dropped", "spread"):
        inputs = draw(kind)
        with torch.no_grad():
            static_x.copy_(inputs[0])
            for s, v in zip(static_in, inputs[1:]):
                s.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = eager(inputs)
        for name, a, b in zip(names, static_results, want):
            assert torch.equal(a, b), f"{kind}: {name} of the replay differs from eager"
        ids = static_ids.cpu()
        if kind == "skewed":
            assert (ids[:, 0] == 3).all()
        if kind == "dropped":
            assert (ids[0] == -1).all() and (ids == -1).any(dim=1).sum() > 1
        data = LayerData(inputs[0].cpu(), ids, static_w.detach().cpu(), base.weights,
                         inputs[3].cpu())
        grads = [static_x.grad, sink, *[p.grad for p in params[1:]]]
        check_against_reference(data, static_out, grads, OUT_TOLERANCE, GRAD_TOLERANCE)


@requires_cuda
def test_cuda_graph_keeps_its_workspace_past_the_lru(gen):
    """A captured forward keeps its C++ workspace for good: after more layer shapes than the
    workspace's LRU keeps have run through the same workspace, the captured one is still there
    (a dropped one would leave the graph's replays in freed memory), and a replay, its output
    poisoned first, still gives the captured step's bits."""
    from mok import _workspace, functional
    T, H, k, S = 64, 128, 2, 64
    dev = torch.device("cuda")
    ws = functional.create_workspace(functional.MoKConfig(), None, device=dev,
                                     num_local_tokens=T, hidden_size=H, topk=k)

    def inputs(I, E):
        d = make_layer(gen, T, H, I, E, k, S)
        return [d.x.to(dev), d.topk_experts.to(dev), d.topk_weights.to(dev),
                *[t.to(dev) for t in d.weights]]

    static = inputs(64, 8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up outside the capture
        for _ in range(2):
            mok.moe(*static, workspace=ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = mok.moe(*static, workspace=ws)
    graph.replay()
    torch.cuda.synchronize()
    want = out.clone()
    captured = [key for key, core in ws._cores.items() if core.captured]
    assert len(captured) == 1, "the captured call's workspace is not marked"
    with torch.no_grad():
        for i in range(2 * _workspace._MAX_CORES):  # other layer shapes, eagerly
            mok.moe(*inputs(128 + 64 * i, 8), workspace=ws)
    assert captured[0] in ws._cores, "the captured workspace was dropped"
    assert len(ws._cores) == _workspace._MAX_CORES
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), "a replay after the LRU turned over differs"


@requires_cuda
def test_cuda_first_call_inside_graph_capture_asks_for_a_warm_up(gen):
    """A layer shape's first call inside torch.cuda.graph would create its C++ workspace with
    synchronous CUDA calls: mok's error says to warm up first, the process and its CUDA context
    survive, and after one eager call the same step captures and replays to eager's bits."""
    from mok import functional
    T, H, I, E, k, S = 64, 128, 64, 8, 2, 64
    dev = torch.device("cuda")
    data = make_layer(gen, T, H, I, E, k, S).to(dev)
    ws = functional.create_workspace(functional.MoKConfig(), None, device=dev,
                                     num_local_tokens=T, hidden_size=H, topk=k)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=re.escape("run one step eagerly, a warm-up, before "
                                                   "capturing, got a first call during capture")):
        with torch.cuda.graph(graph), torch.no_grad():
            mok.moe(*data.args(), workspace=ws)
    torch.cuda.synchronize()
    assert not ws._cores, "a C++ workspace was created during capture"
    with torch.no_grad():
        want = mok.moe(*data.args(), workspace=ws)  # the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = mok.moe(*data.args(), workspace=ws)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@requires_cuda
def test_cuda_lru_frees_no_memory_during_capture(gen):
    """The LRU retires the C++ workspaces it drops instead of freeing them (cudaFree synchronizes
    the device, which is illegal during capture): calls captured after an eviction free nothing,
    the capture succeeds and its replays give eager's bits; the retired ones are freed at the
    next creation of a C++ workspace, outside capture."""
    import gc
    import weakref

    from mok import _workspace, functional
    T, H, k, S = 64, 128, 2, 64
    dev = torch.device("cuda")
    ws = functional.create_workspace(functional.MoKConfig(), None, device=dev,
                                     num_local_tokens=T, hidden_size=H, topk=k)

    def inputs(I, E):
        d = make_layer(gen, T, H, I, E, k, S)
        return [d.x.to(dev), d.topk_experts.to(dev), d.topk_weights.to(dev),
                *[t.to(dev) for t in d.weights]]

    first = inputs(64, 8)
    with torch.no_grad():
        want_first = mok.moe(*first, workspace=ws)  # warm-up; evicted below
        others = [inputs(128 + 64 * i, 8) for i in range(_workspace._MAX_CORES + 1)]
        wants = [mok.moe(*o, workspace=ws) for o in others]
    torch.cuda.synchronize()
    assert ws._retired, "the LRU dropped nothing"
    retired = [weakref.ref(c) for c in ws._retired]
    graph = torch.cuda.CUDAGraph()
    # "global": a cudaFree (or any other call that synchronizes) during the capture invalidates it
    # and raises here. The device's free memory is no witness: the driver moves it on its own
    # (6 MiB more free across this capture on an H100 at ae379f7).
    with torch.cuda.graph(graph, capture_error_mode="global"), torch.no_grad():
        outs = [mok.moe(*o, workspace=ws) for o in others[-2:]]  # shapes whose workspaces exist
    gc.collect()
    assert all(r() is not None for r in retired), "a retired workspace was freed during capture"
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for o, w in zip(outs, wants[-2:]):
        assert torch.equal(o, w), "a replay differs from eager"
    with torch.no_grad():  # the evicted shape again: a creation, outside capture
        again = mok.moe(*first, workspace=ws)
    gc.collect()
    assert all(r() is None for r in retired), "the retired workspaces outlived the next creation"
    assert torch.equal(again, want_first)


@requires_cuda
def test_cuda_layers_sharing_a_workspace_on_two_streams(gen):
    """Two mok.nn.MoE layers of one shape and config share one C++ workspace (its scratch). Run on
    two CUDA streams at once, forward and backward, iteration after iteration, their outputs and
    every gradient are bitwise those of running both on one stream: the workspace orders its
    calls on the device, so the two streams never race on its scratch."""
    dev = torch.device("cuda")
    T, H, I, E, k, S = 4096, 512, 256, 16, 4, 256
    iterations = 24
    layers = [mok.nn.MoE(H, I, E, k, shared_intermediate_size=S, device=dev) for _ in range(2)]
    assert layers[0]._workspace is layers[1]._workspace
    xs = [[torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev) for _ in layers]
          for _ in range(iterations)]
    d_outs = [[torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev) for _ in layers]
              for _ in range(iterations)]

    def step(layer, x, d_out):
        layer.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_(True)
        out, _ = layer(x)
        out.backward(d_out)
        return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]

    one_stream = [[step(layer, xs[i][j], d_outs[i][j]) for j, layer in enumerate(layers)]
                  for i in range(iterations)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    two_streams = [[None, None] for _ in range(iterations)]
    for i in range(iterations):  # enqueued alternately: the two streams' calls overlap
        for j, layer in enumerate(layers):
            with torch.cuda.stream(streams[j]):
                two_streams[i][j] = step(layer, xs[i][j], d_outs[i][j])
    torch.cuda.synchronize()
    names = ["out", "d_x"] + [n for n, _ in layers[0].named_parameters()]
    for i in range(iterations):
        for j in range(2):
            for name, a, b in zip(names, two_streams[i][j], one_stream[i][j]):
                assert torch.equal(a, b), f"iteration {i}, layer {j}: {name} differs on two streams"


# --- bad inputs -------------------------------------------------------------------------------

def misaligned(shape, dtype, offset_elements=1):
    """A contiguous CUDA view of `shape` whose data starts `offset_elements` past an allocation
    (2 bytes for bf16: not the 16-byte alignment mok's vector accesses need)."""
    n = 1
    for s in shape:
        n *= s
    base = torch.empty(n + offset_elements, dtype=dtype, device="cuda")
    return base[offset_elements:].view(shape)


def misaligned_copy(t, offset_elements=1):
    out = misaligned(tuple(t.shape), t.dtype, offset_elements)
    out.copy_(t)
    return out


ALIGN_MESSAGE = "expected a view whose data starts at a multiple of 16 bytes, got address "


@pytest.fixture
def cuda_layer(gen):
    """A layer on CUDA and its correct results (out, grads on the CPU) through mok.moe."""
    data = make_layer(gen, 40, 128, 64, 4, 2, 64)
    return data, data.to("cuda"), run_moe_cuda(data)


def _moe(args, **replace):
    names = ("x", "topk_experts", "topk_weights", "routed_gate_weights", "routed_up_weights",
             "routed_down_weights", "shared_gate_weights", "shared_up_weights",
             "shared_down_weights")
    kwargs = dict(zip(names, args))
    kwargs.update(replace)
    return mok.moe(*kwargs.values())


@requires_cuda
def test_cuda_bad_inputs_are_named_and_the_process_survives(cuda_layer):
    """Each bad call raises mok's error naming the argument (TypeError for a dtype, ValueError
    otherwise); the next correct call gives the correct bits."""
    data, cuda, good = cuda_layer
    args = cuda.args()
    bf16 = torch.bfloat16
    _, *context = mok.ops.forward(*args, 0)
    weights = [w for w in cuda.weights]
    main = [torch.zeros(w.shape, device="cuda") for w in weights]
    cases = [
        ("x dtype", TypeError, "mok: invalid x.dtype: expected bfloat16",
         lambda: _moe(args, x=cuda.x.float())),
        ("weight dtype", TypeError,
         "mok: invalid routed_up_weights.dtype: expected bfloat16, got float16",
         lambda: _moe(args, routed_up_weights=weights[1].half())),
        ("ids dtype", TypeError, "mok: invalid topk_experts.dtype: expected int64, got int32",
         lambda: _moe(args, topk_experts=cuda.topk_experts.int())),
        ("router weights on the cpu", ValueError,
         "mok: invalid topk_weights.device: expected cuda:0, got cpu",
         lambda: _moe(args, topk_weights=data.topk_weights)),
        ("misaligned x", ValueError, "mok: invalid x: " + ALIGN_MESSAGE,
         lambda: _moe(args, x=misaligned_copy(cuda.x))),
        ("misaligned weight", ValueError, "mok: invalid routed_down_weights: " + ALIGN_MESSAGE,
         lambda: _moe(args, routed_down_weights=misaligned_copy(weights[2]))),
        ("misaligned shared weight", ValueError,
         "mok: invalid shared_gate_weights: " + ALIGN_MESSAGE,
         lambda: _moe(args, shared_gate_weights=misaligned_copy(weights[3]))),
        ("misaligned d_out", ValueError, "mok: invalid d_out: " + ALIGN_MESSAGE,
         lambda: mok.ops.backward(misaligned_copy(cuda.d_out), *args, *context, 0)),
        ("misaligned d_out through autograd", ValueError, "mok: invalid d_out: " + ALIGN_MESSAGE,
         lambda: _moe([a.detach().requires_grad_(a.is_floating_point()) if a is not None
                       else None for a in args]).backward(misaligned_copy(cuda.d_out))),
        ("d_out dtype", TypeError, "mok: invalid d_out.dtype: expected bfloat16, got float32",
         lambda: mok.ops.backward(cuda.d_out.float(), *args, *context, 0)),
        ("misaligned context", ValueError,
         "mok: invalid forward_context.hidden_routed: " + ALIGN_MESSAGE,
         lambda: mok.ops.backward(cuda.d_out, *args, *context[:3],
                                  misaligned_copy(context[3]), *context[4:], 0)),
        ("misaligned shared context", ValueError,
         "mok: invalid forward_context.up_shared: " + ALIGN_MESSAGE,
         lambda: mok.ops.backward(cuda.d_out, *args, *context[:5],
                                  misaligned_copy(context[5]), context[6], 0)),
        ("misaligned main grad", ValueError, "mok: invalid main_routed_gate: " + ALIGN_MESSAGE,
         lambda: mok.ops.backward_main_grad(cuda.d_out, *args, misaligned_copy(main[0]),
                                            *main[1:], *context, 0)),
        ("main grad dtype", TypeError,
         "mok: invalid main_shared_down.dtype: expected float32, got bfloat16",
         lambda: mok.ops.backward_main_grad(cuda.d_out, *args, *main[:5], main[5].to(bf16),
                                            *context, 0)),
    ]
    failed = []
    for what, error, message, call in cases:
        try:
            with pytest.raises(error, match="^" + re.escape(message)):
                call()
                torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001  (collect every case, report them together)
            failed.append(f"{what}: {type(e).__name__}: {e}")
        torch.cuda.synchronize()  # no sticky CUDA error: the process goes on
        assert_bitwise(run_moe_cuda(data), good, f"after {what}:")
    assert not failed, "\n".join(failed)


@requires_cuda
@pytest.mark.parametrize("bad", [4, 1 << 40, -2])
def test_cuda_bad_expert_id_is_reported_by_the_next_call(cuda_layer, bad):
    """Ids are checked on the device, without waiting for it: the bad call treats the slot as
    unused and returns; the next call on the workspace raises, naming token and slot; the call
    after that gives the correct bits."""
    data, cuda, good = cuda_layer
    ids = cuda.topk_experts.clone()
    ids[17, 1] = bad
    with torch.no_grad():
        _moe(cuda.args(), topk_experts=ids)
    torch.cuda.synchronize()
    message = (f"mok: invalid topk_experts[17, 1] of rank 0: expected an expert id in [-1, 4), "
               f"got {bad} (found on the device")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        with torch.no_grad():
            _moe(cuda.args())
    assert_bitwise(run_moe_cuda(data), good, "after the bad id:")


@requires_cuda
def test_cuda_misaligned_routing_survives(gen):
    """topk_experts / topk_weights views 8 and 4 bytes past an allocation: mok either names the
    argument or computes the right result; it never corrupts the CUDA context. In a fresh
    process, so that a sticky CUDA error cannot take the rest of the suite with it."""
    seed = int(torch.randint(1 << 62, (1,), generator=gen))  # the test's data, drawn there
    result = _python_with_this_mok(f"""
        import sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import torch, mok
        from conftest import make_layer
        from test_gpu import misaligned_copy, run_moe_cuda, assert_bitwise
        data = make_layer(torch.Generator().manual_seed({seed}), 40, 128, 64, 4, 2, 64)
        good = run_moe_cuda(data)
        cuda = data.to("cuda")
        for name, index in (("topk_experts", 1), ("topk_weights", 2)):
            args = list(cuda.args())
            args[index] = misaligned_copy(args[index])
            try:
                out = mok.moe(*args)
                torch.cuda.synchronize()
                ok = torch.equal(out.cpu(), good[0])
                print(f"RESULT {{name}}: computed, {{'correct' if ok else 'WRONG'}}")
            except (TypeError, ValueError) as e:
                print(f"RESULT {{name}}: error: {{e}}")
            assert_bitwise(run_moe_cuda(data), good, name)
        print("SURVIVED")
        """)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "SURVIVED" in result.stdout, output
    for line in result.stdout.splitlines():
        if line.startswith("RESULT"):
            assert "WRONG" not in line, output
            if "error" in line:
                name = line.split()[1].rstrip(":")
                assert f"mok: invalid {name}" in line, output


@requires_cuda
def test_cuda_after_torch_initialized_cuda(gen):
    """A fresh process where torch loads its CUDA runtime and creates the context first, then
    mok._C (with its own, static, runtime) runs a layer: the right result, no crash."""
    seed = int(torch.randint(1 << 62, (1,), generator=gen))  # the test's data, drawn there
    result = _python_with_this_mok(f"""
        import torch
        torch.cuda.init()
        torch.zeros(1, device="cuda")
        import mok
        T, H, I, E, k = 64, 128, 64, 4, 2
        g = torch.Generator().manual_seed({seed})
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.full((T, k), 0.5)
        ws = [(torch.rand(E, I, H, generator=g) - 0.5).to(torch.bfloat16) / 8,
              (torch.rand(E, I, H, generator=g) - 0.5).to(torch.bfloat16) / 8,
              (torch.rand(E, H, I, generator=g) - 0.5).to(torch.bfloat16) / 8]
        cpu = mok.moe(x, ids, w, *ws)
        gpu = mok.moe(x.cuda(), ids.cuda(), w.cuda(), *[t.cuda() for t in ws]).cpu()
        err = ((gpu.double() - cpu.double()).norm() / cpu.double().norm()).item()
        print(f"ERR {{err}}")
        """)
    assert result.returncode == 0, result.stdout + result.stderr
    err = float(re.search(r"ERR (\S+)", result.stdout).group(1))
    assert err <= 2 * OUT_TOLERANCE, result.stdout


class _NoCudaBackend:
    """mok's extension as a build without the CUDA backend shows it: creating a CUDA workspace or
    asking for the CUDA backend raises its error; everything else is the real extension's."""

    MESSAGE = ("mok: the CUDA backend is not available (this build has no CUDA support); use the "
               "cpu backend (Backend::cpu, --backend cpu)")

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def require_backend(self, backend):
        if backend == "cuda":
            raise RuntimeError(self.MESSAGE)
        return self._lib.require_backend(backend)

    def Workspace(self, *args, backend, **kwargs):  # noqa: N802 (the extension's class)
        if backend == "cuda":
            raise RuntimeError(self.MESSAGE)
        return self._lib.Workspace(*args, backend=backend, **kwargs)


@requires_cuda
def test_cuda_without_backend_raises_mok_error(gen, monkeypatch):
    """CUDA tensors where mok's CUDA backend cannot run: every layer call reaches the backend only
    through the extension's workspace creation and require_backend, so a build without the CUDA
    backend (its extension stood in for here; the real one's refusal runs in the CPU suite,
    test_errors.py::test_cuda_without_backend_raises_mok_error) gives mok's error, never a
    fallback or a crash, and the next call with the backend works."""
    import mok._native

    data = make_layer(gen, 33, 64, 64, 4, 2, 64)
    args = [t.cuda() if t is not None else None for t in data.args()]
    ws = mok.functional.create_workspace(mok.functional.MoKConfig(), None, device="cuda",
                                         num_local_tokens=33, hidden_size=64, topk=2)
    monkeypatch.setattr(mok._native, "lib", _NoCudaBackend(mok._native.lib))
    with pytest.raises(RuntimeError, match=re.escape("mok: the CUDA backend is not available")):
        mok.moe(*args, workspace=ws)
    with pytest.raises(RuntimeError, match=re.escape("mok: the CUDA backend is not available")):
        torch.ops.mok.build_schedule(args[1], 4, 4, 0)
    with pytest.raises(RuntimeError, match=re.escape("mok: the CUDA backend is not available")):
        mok.functional.get_workspace(mok.functional.MoKConfig(), None, device="cuda",
                                     num_local_tokens=33, hidden_size=64, topk=2)
    monkeypatch.undo()
    assert torch.equal(mok.moe(*args, workspace=ws).cpu(), mok.moe(*args).cpu())
