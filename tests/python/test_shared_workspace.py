"""Layers sharing one workspace (DESIGN.md section 3, "Who owns what").

The forward context is tensors the caller owns (MoKForwardContext; autograd saves them for
mok.moe / mok.nn.MoE), and the workspace holds scratch only. So any number of layers run through
one workspace: forward every layer, then backward every layer in reverse order, as a model does,
and every gradient has the bits of running that layer alone. Backward reads the context it is
given and never recomputes the forward (call_counts: no recompute); recompute_forward_context
(activation checkpointing) gives a context from which backward computes the same bits.

A backward given another layer's context is refused by mok.functional (the context records what
it was computed from: test_bad_inputs.py); autograd pairs them for mok.moe and mok.nn.MoE.

Every test runs on the CPU backend and, where there is a GPU, on the CUDA backend.
"""

import pytest
import torch
from conftest import DEVICES, make_layer
from test_layer import GRAD_NAMES

import mok
from mok import _workspace, functional

DEFAULT = functional.MoKConfig()
# A ring of 256 rows: on CUDA the routed rows of these layers need several passes (the context
# keeps the first; backward replays the others).
SMALL_RING = functional.MoKConfig(minibatch_size=128, macrobatch_size=256)

# The workspace's fixed shape (T, H, k) and each layer's (I, E, S, config): three layers of one
# shape and config, one of that shape under another config, one of another shape.
T, H, K = 53, 128, 3
LAYERS = [(64, 6, 64, DEFAULT), (64, 6, 64, DEFAULT), (64, 6, 64, SMALL_RING),
          (64, 6, 64, DEFAULT), (128, 5, 0, DEFAULT)]


def _layers(gen, device):
    return [make_layer(gen, T, H, I, E, K, S).to(device) for I, E, S, _ in LAYERS]


def _workspace_for(device, *, cached):
    if cached:
        return functional.get_workspace(DEFAULT, None, device=device, num_local_tokens=T,
                                        hidden_size=H, topk=K)
    return functional.create_workspace(DEFAULT, None, device=device, num_local_tokens=T,
                                       hidden_size=H, topk=K)


class Layer:
    """One layer's data and config through a workspace, by mok.functional."""

    def __init__(self, ws, config, data):
        self.ws, self.config, self.data = ws, config, data
        self.schedule = functional.build_schedule(ws, config, data.topk_experts,
                                                  num_local_experts=data.weights[0].shape[0])

    def _mok_order(self):
        g, u, d, sg, su, sd = self.data.weights
        return sg, su, sd, g, u, d

    def forward(self):
        return functional.forward(self.config, self.ws, self.schedule, self.data.x,
                                  self.data.topk_weights, *self._mok_order())

    def recompute(self):
        g, u, _, sg, su, _ = self.data.weights
        return functional.recompute_forward_context(self.config, self.ws, self.schedule,
                                                    self.data.x, sg, su, g, u)

    def backward(self, ctx, main_grads=None):
        return functional.backward(self.config, self.ws, self.schedule, ctx, self.data.d_out,
                                   self.data.x, self.data.topk_weights, *self._mok_order(),
                                   main_grads=main_grads)


def _alone(data, config, device):
    """The layer alone, through a workspace of its own: (out, grads, workspace bytes)."""
    ws = _workspace_for(device, cached=False)
    layer = Layer(ws, config, data)
    out, ctx = layer.forward()
    grads = layer.backward(ctx)
    assert ws.call_counts == (1, 0, 1)
    return out, grads, ws.bytes


def _assert_same(got, want, what):
    for name, a, b in zip(GRAD_NAMES, got, want):
        if b is None:
            assert a is None, f"{what}: {name}: expected None"
        else:
            assert torch.equal(a, b), f"{what}: {name} differs from the layer run alone"


def _delta(after, before):
    return tuple(a - b for a, b in zip(after, before))


@pytest.mark.parametrize("device", DEVICES)
def test_layers_share_one_workspace(gen, device):
    """get_workspace's workspace, five layers: forward all, backward all in reverse order. Every
    output and gradient is bitwise the layer's alone; one forward and one backward per layer, no
    recompute; the C++ scratch is one per (shape, config), whatever the number of layers."""
    datas = _layers(gen, device)
    alone = [_alone(d, cfg, device) for d, (*_, cfg) in zip(datas, LAYERS)]
    ws = _workspace_for(device, cached=True)
    assert ws is _workspace_for(device, cached=True)
    before = ws.call_counts
    layers = [Layer(ws, cfg, d) for d, (*_, cfg) in zip(datas, LAYERS)]
    results = [layer.forward() for layer in layers]
    assert _delta(ws.call_counts, before) == (len(layers), 0, 0)
    grads = [None] * len(layers)
    for i in reversed(range(len(layers))):
        grads[i] = layers[i].backward(results[i][1])
    assert _delta(ws.call_counts, before) == (len(layers), 0, len(layers))
    for i, ((out, ctx), g, (out_alone, grads_alone, _)) in enumerate(zip(results, grads, alone)):
        assert torch.equal(out, out_alone), f"layer {i}: out"
        _assert_same(g, grads_alone, f"layer {i}")
        # The context belongs to the caller, on the layer's device, shared tensors absent
        # without a shared expert.
        assert ctx.gate_routed.device == out.device
        assert (ctx.gate_shared is None) == (LAYERS[i][2] == 0)
    # One C++ workspace per (layer shape, config): layers 0, 1, 3 share one.
    distinct = {0: alone[0][2], 2: alone[2][2], 4: alone[4][2]}
    assert ws.bytes == sum(distinct.values())


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_forward_context_gives_the_same_gradients(gen, device):
    """Activation checkpointing: forward every layer and drop the contexts; then, layer by layer
    in reverse order, recompute_forward_context and backward. Bitwise the gradients from the
    saved contexts; where the CPU backend fills context rows (every used slot), the same bits."""
    datas = _layers(gen, device)
    ws = _workspace_for(device, cached=True)
    layers = [Layer(ws, cfg, d) for d, (*_, cfg) in zip(datas, LAYERS)]
    saved = [layer.forward() for layer in layers]
    saved_grads = [layer.backward(ctx) for layer, (_, ctx) in zip(layers, saved)]

    before = ws.call_counts
    outs = [layer.forward()[0] for layer in layers]  # contexts dropped at once
    for i in reversed(range(len(layers))):
        ctx = layers[i].recompute()
        assert isinstance(ctx, functional.MoKForwardContext)
        _assert_same(layers[i].backward(ctx), saved_grads[i], f"layer {i} (recomputed)")
        assert torch.equal(outs[i], saved[i][0])
        if device == "cpu":
            _assert_same_filled_rows(ctx, saved[i][1], datas[i].topk_experts)
    n = len(layers)
    assert _delta(ws.call_counts, before) == (n, n, n)


def _assert_same_filled_rows(got, want, topk_experts):
    """CPU backend: one routed row per slot t*k + j, filled for used slots; shared rows all."""
    used = (topk_experts.reshape(-1) >= 0).nonzero().squeeze(1)
    assert got.x_routed.shape == want.x_routed.shape
    for field in ("gate_routed", "up_routed", "hidden_routed"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape and torch.equal(a[used], b[used]), field
    for field in ("gate_shared", "up_shared", "hidden_shared"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None and b is None) or torch.equal(a, b), field


@pytest.mark.parametrize("device", DEVICES)
def test_main_grads_with_a_shared_workspace(gen, device):
    """MoK's main_grads (fp32 buffers the weight gradients are added into), layers through one
    workspace, backward in reverse order. From zero buffers: the fp32 sums, rounded to bf16, are
    the bf16 gradients' bits; from random buffers: each buffer plus the sum, bitwise; d_x and
    d_router_weights are the bits of the plain backward."""
    datas = _layers(gen, device)
    ws = _workspace_for(device, cached=True)
    layers = [Layer(ws, cfg, d) for d, (*_, cfg) in zip(datas, LAYERS)]
    contexts = [layer.forward()[1] for layer in layers]
    plain = [layer.backward(ctx) for layer, ctx in zip(layers, contexts)]

    def buffers(layer, fill):
        g, u, d, sg, su, sd = layer.data.weights  # MoK's order below
        return tuple(fill(w) if w is not None else None for w in (sg, g, su, u, sd, d))

    before = ws.call_counts
    for i in reversed(range(len(layers))):
        layer, ctx = layers[i], contexts[i]
        zero = buffers(layer, lambda w: torch.zeros(w.shape, device=device))
        got = layer.backward(ctx, main_grads=zero)
        assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
        assert torch.equal(got[0], plain[i][0]) and torch.equal(got[1], plain[i][1]), i
        for name, g, p in zip(GRAD_NAMES[2:], got[2:], plain[i][2:]):
            if p is None:
                assert g is None, name
                continue
            assert g.dtype == torch.float32, name
            assert torch.equal(g.to(torch.bfloat16), p), f"layer {i}: {name}"
        start = buffers(layer, lambda w: torch.randn(w.shape, generator=gen).to(device))
        main = tuple(t.clone() if t is not None else None for t in start)
        again = layer.backward(ctx, main_grads=main)
        mok_order = dict(zip((5, 2, 6, 3, 7, 4), range(6)))  # grads index -> main_grads index
        for gi, mi in mok_order.items():
            if start[mi] is None:
                continue
            assert again[gi] is main[mi], "main grads are updated in place and returned"
            assert torch.equal(again[gi], start[mi] + got[gi]), f"layer {i}: {GRAD_NAMES[gi]}"
    assert _delta(ws.call_counts, before) == (0, 0, 2 * len(layers))


def _module_run(module, x, d_out):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, _ = module(x)
    return out, x


@pytest.mark.parametrize("device", DEVICES)
def test_nn_modules_share_one_workspace(gen, device):
    """mok.nn.MoE modules of one config share one workspace (and, per shape, one C++ scratch):
    forward four modules, backward in reverse order; every gradient, the router's included, is
    bitwise the module's alone."""
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    shape = dict(hidden_size=128, intermediate_size=64, num_experts=6, topk=2,
                 shared_intermediate_size=64, device=device)
    modules = [mok.nn.MoE(**shape, router=r) for r in ("softmax", "sigmoid", "softmax",
                                                          "sigmoid")]
    other = mok.nn.MoE(128, 128, 4, 2, device=device)  # another shape, same (default) config
    ws = modules[0]._workspace
    assert all(m._workspace is ws for m in modules + [other])
    assert ws is _workspace.for_config(None) is _workspace.for_config(functional.MoKConfig())
    T = 37
    xs = [torch.randn(T, 128, generator=gen).to(torch.bfloat16).to(device) for _ in modules]
    d_outs = [torch.randn(T, 128, generator=gen).to(torch.bfloat16).to(device) for _ in modules]

    alone = []
    for m, x, d in zip(modules, xs, d_outs):
        out, leaf = _module_run(m, x, d)
        out.backward(d)
        alone.append((out.detach(), leaf.grad, [p.grad.clone() for p in m.parameters()]))
        m.zero_grad(set_to_none=True)

    before = ws.call_counts
    runs = [_module_run(m, x, d) for m, x, d in zip(modules, xs, d_outs)]
    assert _delta(ws.call_counts, before) == (len(modules), 0, 0)
    for i in reversed(range(len(modules))):
        runs[i][0].backward(d_outs[i])
    assert _delta(ws.call_counts, before) == (len(modules), 0, len(modules))
    for i, (m, (out, leaf), (out_alone, dx_alone, grads_alone)) in enumerate(
            zip(modules, runs, alone)):
        assert torch.equal(out, out_alone), f"module {i}: out"
        assert torch.equal(leaf.grad, dx_alone), f"module {i}: d_x"
        for (name, p), g in zip(m.named_parameters(), grads_alone):
            assert torch.equal(p.grad, g), f"module {i}: {name}"
    # The four modules of one shape use one C++ workspace: its bytes are counted once.
    key = (T, 128, 64, 6, 2, 64)
    assert sum(1 for k in ws._cores if k[:6] == key and k[7].type == device) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_call_counts_count_every_call(gen, device):
    """call_counts counts every call run through the workspace, also past the number of C++
    workspaces it keeps (one per layer shape and config, the least recently used dropped)."""
    ws = _workspace_for(device, cached=False)
    shapes = [(64 * (i + 1), K + i % 2) for i in range(10)]  # (I, E): ten layer shapes
    for n, (I, E) in enumerate(shapes, start=1):
        layer = Layer(ws, DEFAULT, make_layer(gen, T, H, I, E, K, 0).to(device))
        _, ctx = layer.forward()
        layer.backward(ctx)
        assert ws.call_counts == (n, 0, n), f"after {n} layer shapes"


def test_captured_workspaces_are_never_dropped(gen, monkeypatch):
    """A C++ workspace used while a CUDA graph was being captured stays for good (the graph's
    replays use its memory); the least recently used of the others are still dropped beyond
    _MAX_CORES. The capture is simulated (_capturing), so this runs on the CPU backend; the GPU
    form with a real capture is test_gpu.py::test_cuda_graph_keeps_its_workspace_past_the_lru."""
    ws = _workspace_for("cpu", cached=False)

    def run(I, E, captured):
        layer = Layer(ws, DEFAULT, make_layer(gen, T, H, I, E, K, 0))
        if captured:  # a first call is refused during capture: one eager call first
            monkeypatch.setattr(_workspace, "_capturing", lambda device: False)
            layer.forward()
        monkeypatch.setattr(_workspace, "_capturing", lambda device: captured)
        _, ctx = layer.forward()
        layer.backward(ctx)
        return next(reversed(ws._cores))  # the key of the core this layer used

    first = run(64, K, captured=True)
    second = run(128, K, captured=False)
    pinned = ws._cores[first]
    for i in range(2, 2 + 2 * _workspace._MAX_CORES):  # many more shapes than the LRU keeps
        run(64 * (i + 1), K + i % 2, captured=False)
        assert len(ws._cores) == min(i + 1, _workspace._MAX_CORES), f"after {i + 1} layer shapes"
    assert ws._cores.get(first) is pinned, "the captured workspace was dropped"
    assert second not in ws._cores, "an uncaptured workspace was kept past the LRU"
    # Using a kept workspace again, outside a capture, does not unpin it.
    again = run(64, K, captured=False)
    assert again == first and ws._cores[first].captured


def _run_layer(ws, gen, I, E, data=None):
    layer = Layer(ws, DEFAULT, data or make_layer(gen, T, H, I, E, K, 0))
    out, ctx = layer.forward()
    return out, layer.backward(ctx)


def test_first_call_during_capture_asks_for_a_warm_up(gen, monkeypatch):
    """Creating a layer shape's C++ workspace makes synchronous CUDA calls: its first call during
    CUDA graph capture raises mok's error saying to warm up first (simulated capture here; the
    real one: test_gpu.py::test_cuda_first_call_inside_graph_capture_asks_for_a_warm_up). An
    eager call then works, and a call of the warmed-up shape during capture too."""
    ws = _workspace_for("cpu", cached=False)
    data = make_layer(gen, T, H, 64, K, K, 0)
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    with pytest.raises(ValueError, match="mok: invalid the first call of a layer of this shape "
                       "and config: expected a call outside CUDA graph capture .* run one step "
                       "eagerly, a warm-up, before capturing, got a first call during capture"):
        _run_layer(ws, gen, 64, K, data)
    assert not ws._cores
    monkeypatch.setattr(_workspace, "_capturing", lambda device: False)
    want = _run_layer(ws, gen, 64, K, data)
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    got = _run_layer(ws, gen, 64, K, data)
    assert torch.equal(got[0], want[0])
    assert all(c.captured for c in ws._cores.values())


def test_lru_frees_only_at_the_next_creation(gen, monkeypatch):
    """A C++ workspace the LRU drops is retired, not freed: freeing synchronizes the device
    (illegal during capture). It is freed at the next creation of a C++ workspace (a call that
    makes synchronous CUDA calls anyway, never during capture), not by the calls in between."""
    import gc
    import weakref

    ws = _workspace_for("cpu", cached=False)
    for i in range(_workspace._MAX_CORES):
        _run_layer(ws, gen, 64 * (i + 1), K)
    first = weakref.ref(next(iter(ws._cores.values())))
    _run_layer(ws, gen, 64 * (_workspace._MAX_CORES + 1), K)  # drops the first: retired
    gc.collect()
    assert first() is not None and first() in ws._retired and len(ws._cores) == _MAX_CORES()
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)  # calls during capture
    for _ in range(3):  # of an existing shape: nothing freed
        _run_layer(ws, gen, 64 * 3, K)
    gc.collect()
    assert first() is not None
    monkeypatch.setattr(_workspace, "_capturing", lambda device: False)
    _run_layer(ws, gen, 64 * (_workspace._MAX_CORES + 2), K)  # a creation: frees the retired
    gc.collect()
    assert first() is None
    assert len(ws._retired) == 1  # the one this creation dropped (a captured one is kept)


def _MAX_CORES():
    return _workspace._MAX_CORES

