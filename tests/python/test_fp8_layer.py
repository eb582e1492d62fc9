"""The FP8 layer from Python (mok.moe / mok.nn.MoE with precision="fp8", CPU and CUDA): against
the f64 layer of the unquantized bf16 values within MoK's MXFP8 bounds (errors printed beside the
bf16 layer's), CUDA against the CPU, bitwise run to run, the weights quantized again after an
optimizer step (a stale quantization fails the test), also inside a captured CUDA graph and a
compiled graph, the quantization reused while the weights are unchanged, once a step under
gradient accumulation with is_first_microbatch, and bad arguments named.
The C++ tests (tests/cpp/test_fp8_layer.cpp, test_fp8_layer_gpu.cpp) check the layer bitwise
against its definition and the GPU layer against it."""

import copy
import importlib.util
import pathlib

import pytest
import torch

import mok
from conftest import DEVICES, SEED, make_layer, requires_cuda
from mok import _fp8_layer, _workspace


def grads_of(data, precision, swiglu_limit=None):
    """(out, d_x, d_topk_weights, d_gate, d_up, d_down, d_shared...) of one call (autograd)."""
    leaves = data.requiring_grad()
    x, tw, *weights = leaves
    out = mok.moe(x, data.topk_experts, tw, *weights, precision=precision,
                  swiglu_limit=swiglu_limit)
    out.backward(data.d_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves if t is not None]


def errors(got, ref):
    got, ref = got.double(), ref.double()
    diff = (got - ref).abs()
    cosine = float((got * ref).sum() / (got.norm() * ref.norm()))
    return float(diff.max()), float(diff.sum() / ref.abs().sum()), cosine


NAMES = ("out", "d_x", "d_topk_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
         "d_shared_gate", "d_shared_up", "d_shared_down")


@pytest.mark.parametrize("S", [0, 128])
def test_within_moks_mxfp8_bounds_of_the_f64_layer(gen, S):
    data = make_layer(gen, 150, 256, 128, 6, 2, S)
    fp8 = grads_of(data, "fp8")
    bf16 = grads_of(data, "bf16")
    d64 = type(data)(data.x.double(), data.topk_experts, data.topk_weights.double(),
                     tuple(w.double() if w is not None else None for w in data.weights),
                     data.d_out.double())
    exact = grads_of(d64, "bf16")
    for name, f, b, e in zip(NAMES, fp8, bf16, exact):
        fe, be = errors(f, e), errors(b, e)
        print(f"{name:16s} fp8 abs max {fe[0]:.3e} rel {fe[1]:.3e} cos {fe[2]:.6f} | "
              f"bf16 abs max {be[0]:.3e} rel {be[1]:.3e} cos {be[2]:.6f}")
        if name in ("out", "d_x"):  # MoK's bounds on the layer's outputs
            assert fe[0] <= 1.0, name
        assert fe[1] <= 0.1, name   # rel sum|diff| / sum|ref|
        assert fe[2] >= 0.996, name  # MoK's gradient cosine
        # FP8 is less accurate than bf16 (the test would pass a bf16 layer by mistake otherwise)
        if not name.startswith("d_shared"):
            assert fe[1] > 2 * be[1], name


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weight_grads_precision(gen, device):
    """precision="fp8-bf16-wgrad": the FP8 layer's forward and input gradients bit for bit, its
    routed weight gradients bf16 products of the bf16 rows (C++ BackwardOptions::fp8_weight_grads
    false: their bits are tested against the layer's definition in tests/cpp), closer to the f64
    layer than the e4m3 ones and within MoK's bounds; bitwise run to run; and mok.nn.MoE takes it
    (quantize_weights included)."""
    data = make_layer(gen, 150, 256, 128, 6, 2, 128).to(device)
    fp8 = grads_of(data, "fp8")
    hp = grads_of(data, "fp8-bf16-wgrad")
    again = grads_of(data, "fp8-bf16-wgrad")
    d64 = type(data)(data.x.double(), data.topk_experts, data.topk_weights.double(),
                     tuple(w.double() if w is not None else None for w in data.weights),
                     data.d_out.double()).to("cpu")
    exact = grads_of(d64, "bf16")
    for name, f, h, a, e in zip(NAMES, fp8, hp, again, exact):
        assert torch.equal(h, a), f"{name}: two runs differ"
        if name not in ("d_routed_gate", "d_routed_up", "d_routed_down"):
            assert torch.equal(h, f), f"{name}: differs from precision='fp8'"
            continue
        fe, he = errors(f.cpu(), e), errors(h.cpu(), e)
        print(f"{name:16s} e4m3 wgrad rel {fe[1]:.3e} cos {fe[2]:.6f} | bf16 wgrad rel "
              f"{he[1]:.3e} cos {he[2]:.6f}")
        assert he[1] < fe[1], name
        assert he[1] <= 0.1 and he[2] >= 0.996, name
    if device == "cuda":  # its C++ workspace lacks the token-axis copies (fp8_token_axis)
        fp8_cores = {key[-1]: core.native.bytes
                     for key, core in _workspace.automatic()._cores.items()
                     if key[9] and key[7].type == "cuda" and key[:6] == (150, 256, 128, 6, 2, 128)}
        assert set(fp8_cores) == {True, False}, fp8_cores
        assert fp8_cores[False] < fp8_cores[True], fp8_cores
    m = mok.nn.MoE(128, 128, 4, 2, precision="fp8-bf16-wgrad", device=device)
    out, _ = m(torch.randn(32, 128, generator=gen).bfloat16().to(device))
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad.float()).all() for p in m.parameters() if p.grad is not None)
    m.quantize_weights()
    assert "precision='fp8-bf16-wgrad'" in repr(m)


def test_bitwise_run_to_run(gen):
    data = make_layer(gen, 77, 128, 256, 4, 3, 64)
    a, b = grads_of(data, "fp8"), grads_of(data, "fp8")
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y), name


def test_module_requantizes_after_an_optimizer_step(gen):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    m = mok.nn.MoE(128, 128, 4, 2, shared_intermediate_size=64, precision="fp8")
    x = torch.randn(96, 128, generator=gen).bfloat16()
    before = {n: _fp8_layer.quantized(getattr(m, n))[0].view(torch.uint8).clone()
              for n in ("routed_gate_weights", "routed_up_weights", "routed_down_weights")}
    out, _ = m(x)
    out.float().square().mean().backward()
    torch.optim.SGD(m.parameters(), lr=50.0).step()  # large enough to move every weight block
    after, _ = m(x)
    # A fresh copy (new tensors: nothing cached) computes what the stepped module must.
    fresh, _ = copy.deepcopy(m)(x)
    assert torch.equal(after.view(torch.uint8), fresh.view(torch.uint8))
    # The step did change the quantized weights (else this test could not see a stale one).
    for n, q in before.items():
        assert not torch.equal(q, _fp8_layer.quantized(getattr(m, n))[0].view(torch.uint8)), n
    # A change PyTorch's version counter does not see (through .data) needs quantize_weights().
    m.routed_up_weights.data.mul_(0.5)
    m.quantize_weights()
    again, _ = m(x)
    fresh, _ = copy.deepcopy(m)(x)
    assert torch.equal(again.view(torch.uint8), fresh.view(torch.uint8))


def test_a_weight_written_through_another_tensor_is_quantized_again(gen):
    """FSDP2's unsharded parameters: a parameter over another tensor's memory (its all-gather
    buffer), rewritten through that tensor every step at the same address with the parameter's
    version counter unmoved (seen on a GPU, NOTES 2026-12-07). Its quantization is made again on
    every call, never reused stale; through mok.moe and mok.moe_packed too."""
    E, N, K = 2, 128, 256
    buffer = torch.randn(E * N * K, generator=gen).bfloat16()
    w = torch.nn.Parameter(buffer.view(E, N, K))
    assert _fp8_layer.storage_shared(w)
    q1 = _fp8_layer.quantized(w)
    state = (w._version, w.data_ptr())
    buffer.data.copy_(torch.randn(E * N * K, generator=gen).bfloat16())  # unseen by the counter
    assert (w._version, w.data_ptr()) == state
    q2 = _fp8_layer.quantized(w)
    want = _fp8_layer.quantize_weights(w.detach().clone())
    for got, expected in zip(q2, want):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                           expected.view(torch.uint8) if expected.dtype != torch.float32
                           else expected)
    assert not torch.equal(q1[0].view(torch.uint8), q2[0].view(torch.uint8))
    # The layer over such weights, packed and not: each call computes what fresh copies give.
    T, k = 37, 2
    x = torch.randn(T, 128, generator=gen).bfloat16()
    ids = torch.randint(0, 4, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    flat = torch.randn(4 * 256 * 128 + 4 * 128 * 128, generator=gen).bfloat16()
    gate_up = torch.nn.Parameter(flat[:4 * 256 * 128].view(4, 256, 128))
    down = torch.nn.Parameter(flat[4 * 256 * 128:].view(4, 128, 128))
    gate, up = gate_up[:, :128], gate_up[:, 128:]
    for _ in range(2):
        packed = mok.moe_packed(x, ids, weights, gate_up, down, precision="fp8")
        plain = mok.moe(x, ids, weights, gate, up, down, precision="fp8")
        fresh = mok.moe(x, ids, weights, gate.detach().clone(), up.detach().clone(),
                        down.detach().clone(), precision="fp8")
        assert torch.equal(packed.view(torch.uint8), fresh.view(torch.uint8))
        assert torch.equal(plain.view(torch.uint8), fresh.view(torch.uint8))
        flat.data.mul_(-0.5)  # the next call's weights, unseen by their counters


def test_module_weights_are_quantized_once_per_version(gen):
    """Where nothing else holds a weight's memory, two calls with the same weights share one
    quantization (mok.nn.MoE's parameters; mok.moe_packed's packed tensor, whose halves mok
    views itself): the aliasing check above does not cost the cache its hits."""
    m = mok.nn.MoE(128, 128, 4, 2, precision="fp8")
    x = torch.randn(37, 128, generator=gen).bfloat16()
    names = ("routed_gate_weights", "routed_up_weights", "routed_down_weights")
    m(x)
    first = [_fp8_layer._CACHE[getattr(m, n)]["whole"][1] for n in names]
    m(x)
    assert all(_fp8_layer._CACHE[getattr(m, n)]["whole"][1] is q for n, q in zip(names, first))
    gate_up = torch.randn(4, 256, 128, generator=gen).bfloat16()
    down = torch.randn(4, 128, 128, generator=gen).bfloat16()
    ids = torch.randint(0, 4, (37, 2), generator=gen)
    weights = torch.rand(37, 2, generator=gen)
    mok.moe_packed(x, ids, weights, gate_up, down, precision="fp8")
    halves = _fp8_layer._CACHE[gate_up][("halves", False)][1]
    mok.moe_packed(x, ids, weights, gate_up, down, precision="fp8")
    assert _fp8_layer._CACHE[gate_up][("halves", False)][1] is halves


def test_quantization_is_reused_while_the_weights_are_unchanged(gen):
    w = torch.randn(2, 128, 256, generator=gen).bfloat16()
    q1 = _fp8_layer.quantized(w)
    assert _fp8_layer.quantized(w) is q1
    w.add_(1.0)  # in place: a new version
    q2 = _fp8_layer.quantized(w)
    assert q2 is not q1 and not torch.equal(q1[0].view(torch.uint8), q2[0].view(torch.uint8))
    # The quantization itself: scales powers of two, the transposed copy the same bytes.
    data, scales, data_t, scales_t = q2
    assert torch.equal(data.view(torch.uint8).transpose(1, 2), data_t.view(torch.uint8))
    assert torch.equal(scales.transpose(1, 2), scales_t)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    deq = data.float() * scales.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert float(((deq - w.float()).abs() / w.float().abs().clamp(min=1e-3)).max()) <= 2**-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", "fp8-bf16-wgrad"])
def test_is_first_microbatch_quantizes_once_a_step(gen, device, precision, quantizations):
    """Gradient accumulation over weights another tensor's memory holds (FSDP2's unsharded
    parameters, here a `.data` kept alive): by default every micro-batch quantizes the three
    routed weights again; with is_first_microbatch=True, then False, the step's first micro-batch
    does and the others reuse it. Outputs and accumulated gradients are bit for bit the
    default's. After weights change, True quantizes them afresh (a fresh module's bits); False
    keeps what True made (the caller's promise), so a change it is not told of goes unseen."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    m = mok.nn.MoE(128, 256, 4, 2, shared_intermediate_size=64, precision=precision).to(device)
    ref = copy.deepcopy(m)
    routed = (m.routed_gate_weights, m.routed_up_weights, m.routed_down_weights)
    aliases = [p.data for p in routed]  # unseen writes possible: quantized on every call
    assert all(_fp8_layer.storage_shared(p) for p in routed)
    xs = [torch.randn(T, 128, generator=gen).bfloat16().to(device) for T in (37, 64, 5)]
    counter = quantizations

    def accumulate(model, flags):
        model.zero_grad(set_to_none=True)
        outs = []
        for x, flag in zip(xs, flags):
            out, stats = model(x, is_first_microbatch=flag)
            (out.float().square().mean() + 0.01 * stats.load_balancing_loss).backward()
            outs.append(out.detach())
        return outs, [p.grad.clone() for p in model.parameters()]

    want_outs, want_grads = accumulate(ref, [None] * 3)
    before = counter.calls
    outs, grads = accumulate(m, [None] * 3)
    assert counter.calls - before == 9, "by default each micro-batch quantizes the 3 weights"
    before = counter.calls
    kept_outs, kept_grads = accumulate(m, [True, False, False])
    assert counter.calls - before == 3, "is_first_microbatch: one quantization a weight a step"
    for i, (a, b, c) in enumerate(zip(want_outs, outs, kept_outs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"micro-batch {i}"
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), f"micro-batch {i}"
    for (name, _p), a, b, c in zip(m.named_parameters(), want_grads, grads, kept_grads):
        assert torch.equal(a, b) and torch.equal(a, c), name
    # The routed weights change where no counter sees it (FSDP2's all-gather after a step).
    with torch.no_grad():
        for alias in aliases:
            alias.mul_(-0.75)
    stale, _ = m(xs[0], is_first_microbatch=False)
    assert torch.equal(stale.view(torch.uint8), kept_outs[0].view(torch.uint8))
    fresh, _ = copy.deepcopy(m)(xs[0])
    assert not torch.equal(fresh.view(torch.uint8), stale.view(torch.uint8))
    for flag in (True, False, None):
        out, _ = m(xs[0], is_first_microbatch=flag)
        assert torch.equal(out.view(torch.uint8), fresh.view(torch.uint8)), flag


def test_is_first_microbatch_under_autocast(gen, quantizations):
    """Autocast over fp32 master weights hands the layer new bf16 copies every call, which the
    cache cannot reuse: 3 quantizations a call by default, 3 a step with is_first_microbatch,
    the same bits."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    m = mok.nn.MoE(128, 128, 4, 2, dtype=torch.float32, precision="fp8")
    xs = [torch.randn(T, 128, generator=gen) for T in (19, 8)]
    outs = {}
    for flags in ((None, None), (True, False)):
        before = quantizations.calls
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[flags] = [m(x, is_first_microbatch=f)[0] for x, f in zip(xs, flags)]
        assert quantizations.calls - before == (6 if flags[0] is None else 3), flags
    for a, b in zip(*outs.values()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_is_first_microbatch_errors_name_it(gen):
    m = mok.nn.MoE(128, 128, 4, 2, precision="fp8")
    x = torch.randn(9, 128, generator=gen).bfloat16()
    with pytest.raises(TypeError, match="invalid is_first_microbatch: expected None, True or "
                       "False, got int"):
        m(x, is_first_microbatch=1)
    with pytest.raises(ValueError, match=r"invalid is_first_microbatch: expected True at an "
                       r"earlier call .*, got False"):
        m(x, is_first_microbatch=False)
    m(x, is_first_microbatch=True)
    m(x, is_first_microbatch=False)
    m.release_kept_weights()  # frees them: False needs a True first again
    with pytest.raises(ValueError, match=r"invalid is_first_microbatch: expected True at an "
                       r"earlier call .*none are kept\), got False"):
        m(x, is_first_microbatch=False)
    m(x, is_first_microbatch=True)
    m.routed_down_weights = torch.nn.Parameter(torch.randn(4, 128, 256).bfloat16())
    with pytest.raises(ValueError, match=r"invalid is_first_microbatch: expected True again "
                       r"after routed_down_weights changed \(its quantization kept for \[4, "
                       r"128, 128\] bfloat16 on cpu, the call's \[4, 128, 256\] bfloat16 on "
                       r"cpu\), got False"):
        m(x, is_first_microbatch=False)
    compiled = torch.compile(mok.nn.MoE(128, 128, 4, 2, precision="fp8"), fullgraph=True)
    with pytest.raises(Exception, match="invalid is_first_microbatch: expected None inside "
                       "torch.compile"):
        compiled(x, is_first_microbatch=True)
    # bf16 has nothing to quantize: the argument is checked, and changes nothing.
    b = mok.nn.MoE(128, 128, 4, 2)
    assert torch.equal(b(x, is_first_microbatch=False)[0].view(torch.uint8),
                       b(x)[0].view(torch.uint8))
    with pytest.raises(TypeError, match="is_first_microbatch"):
        b(x, is_first_microbatch="yes")


def test_bad_arguments_name_the_argument(gen):
    data = make_layer(gen, 8, 128, 128, 2, 2, 0)
    with pytest.raises(ValueError, match="invalid precision: expected 'bf16', 'fp8' or "
                       "'fp8-bf16-wgrad', got 'fp16'"):
        mok.moe(*data.args(), precision="fp16")
    with pytest.raises(TypeError, match="invalid precision"):
        mok.moe(*data.args(), precision=8)
    with pytest.raises(ValueError, match="invalid precision"):
        mok.nn.MoE(128, 128, 2, 1, precision="int8")
    with pytest.raises(ValueError, match="invalid hidden_size: expected a multiple of 128"):
        mok.nn.MoE(192, 128, 2, 1, precision="fp8")
    with pytest.raises(ValueError, match="backend='torch'"):
        mok.nn.MoE(128, 128, 2, 1, precision="fp8", backend="torch")
    with pytest.raises(TypeError, match="invalid dtype"):
        mok.nn.MoE(128, 128, 2, 1, precision="fp8", dtype=torch.float64)
    odd = make_layer(gen, 8, 128, 192, 2, 2, 0)
    with pytest.raises(ValueError, match="intermediate_size: expected a multiple of 128"):
        mok.moe(*odd.args(), precision="fp8")
    d64 = make_layer(gen, 8, 128, 128, 2, 2, 0, dtype=torch.float64)
    with pytest.raises(TypeError, match="routed_gate_weights.dtype: expected bfloat16"):
        mok.moe(*d64.args(), precision="fp8")
    # And the next good call works.
    assert torch.isfinite(mok.moe(*data.args(), precision="fp8").float()).all()


@requires_cuda
@pytest.mark.parametrize("S", [0, 128])
def test_cuda_matches_the_cpu_fp8_layer_and_repeats_bitwise(gen, S):
    """The CUDA FP8 layer against the CPU's: they differ only where wgmma's fp32 sum of a K
    block's e4m3 products and the reference's exact one fall on two sides of a bf16 rounding
    (then an operand quantized from it may round to the neighbouring e4m3 value): scattered
    flips, so each tensor agrees within 2^-5 relative (either is about 5% from the f64 layer).
    Within MoK's bounds of the f64 layer too, and bitwise run to run."""
    data = make_layer(gen, 150, 256, 128, 6, 2, S)
    cpu = grads_of(data, "fp8")
    cuda = grads_of(data.to("cuda"), "fp8")
    again = grads_of(data.to("cuda"), "fp8")
    d64 = type(data)(data.x.double(), data.topk_experts, data.topk_weights.double(),
                     tuple(w.double() if w is not None else None for w in data.weights),
                     data.d_out.double())
    exact = grads_of(d64, "bf16")
    for name, c, g, a, e in zip(NAMES, cpu, cuda, again, exact):
        assert torch.equal(g, a), f"{name}: two runs differ"
        g = g.cpu()
        rel_cpu = errors(g, c)[1]
        ge = errors(g, e)
        print(f"{name:16s} cuda vs cpu fp8 rel {rel_cpu:.3e} | vs f64 abs max {ge[0]:.3e} "
              f"rel {ge[1]:.3e} cos {ge[2]:.6f}")
        assert rel_cpu <= 2**-5, name
        if name in ("out", "d_x"):
            assert ge[0] <= 1.0, name
        assert ge[1] <= 0.1, name
        assert ge[2] >= 0.996, name


@requires_cuda
def test_cuda_clamped_swiglu_matches_the_cpu_fp8_layer(gen):
    """swiglu_limit on the CUDA FP8 layer, at a limit that binds (the clamped outputs differ from
    the unclamped ones): each tensor within 2^-5 of the CPU FP8 layer's, as above (a pre-
    activation the two round to sides of the kink moves one row of a weight gradient: a small
    share of the tensor's sum), and bitwise run to run. Against the f64 layer: test_mx_calls.py,
    whose references take the tested layer's side of the kink."""
    data = make_layer(gen, 150, 256, 128, 6, 2, 128)
    limit = 1.0  # g, u have a standard deviation of about 0.6 here
    cpu = grads_of(data, "fp8", limit)
    assert not torch.equal(cpu[0], grads_of(data, "fp8")[0]), "the limit binds on none"
    cuda = grads_of(data.to("cuda"), "fp8", limit)
    again = grads_of(data.to("cuda"), "fp8", limit)
    for name, c, g, a in zip(NAMES, cpu, cuda, again):
        assert torch.equal(g, a), f"{name}: two runs differ"
        rel_cpu = errors(g.cpu(), c)[1]
        print(f"{name:16s} cuda vs cpu fp8 rel {rel_cpu:.3e}")
        assert rel_cpu <= 2**-5, name


@requires_cuda
def test_cuda_module_requantizes_after_an_optimizer_step(gen):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    m = mok.nn.MoE(128, 128, 4, 2, shared_intermediate_size=64, precision="fp8").cuda()
    x = torch.randn(96, 128, generator=gen).bfloat16().cuda()
    before = _fp8_layer.quantized(m.routed_down_weights)[0].view(torch.uint8).clone()
    out, _ = m(x)
    out.float().square().mean().backward()
    torch.optim.SGD(m.parameters(), lr=50.0).step()
    after, _ = m(x)
    fresh, _ = copy.deepcopy(m)(x)  # new tensors: nothing cached
    assert torch.equal(after.view(torch.uint8), fresh.view(torch.uint8))
    assert not torch.equal(before, _fp8_layer.quantized(m.routed_down_weights)[0].view(
        torch.uint8))


@requires_cuda
def test_cuda_graph_captures_a_training_step_with_the_optimizer_inside(gen):
    """forward, backward and the optimizer step of an FP8 module in one CUDA graph: each replay
    quantizes the weights as the previous replay's step left them, so replays give an eager
    copy's bits step by step (a stale quantization would not)."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    m = mok.nn.MoE(128, 256, 4, 2, shared_intermediate_size=64, precision="fp8").cuda()
    opt = torch.optim.SGD(m.parameters(), lr=5.0)
    xs = [torch.randn(64, 128, generator=gen).bfloat16().cuda() for _ in range(4)]
    static_x = xs[0].clone()

    def step(model, optimizer, x):
        optimizer.zero_grad(set_to_none=False)
        out, _ = model(x)
        out.float().square().mean().backward()
        optimizer.step()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: creates the workspace, the grads, the quantized weights
            step(m, opt, static_x)
    torch.cuda.current_stream().wait_stream(side)
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(m, opt, static_x)
    for i, x in enumerate(xs):
        static_x.copy_(x)
        graph.replay()
        want = step(ref, ref_opt, x)
        assert torch.equal(static_out.view(torch.uint8), want.view(torch.uint8)), f"step {i}"
        for (name, a), b in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), \
                f"step {i}: {name}"


@requires_cuda
def test_cuda_graph_of_accumulated_micro_batches_with_is_first_microbatch(gen):
    """Two micro-batches (is_first_microbatch True, then False) and the optimizer step in one
    CUDA graph: each replay quantizes the stepped weights once, at the first micro-batch, and
    the second reuses it: every replay gives the bits of an eager copy that quantizes per call."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    m = mok.nn.MoE(128, 256, 4, 2, shared_intermediate_size=64, precision="fp8").cuda()
    opt = torch.optim.SGD(m.parameters(), lr=5.0)
    batches = [[torch.randn(48, 128, generator=gen).bfloat16().cuda() for _ in range(2)]
               for _ in range(3)]
    static = [x.clone() for x in batches[0]]

    def step(model, optimizer, xs, flags):
        optimizer.zero_grad(set_to_none=False)
        outs = []
        for x, flag in zip(xs, flags):
            out, _ = model(x, is_first_microbatch=flag)
            out.float().square().mean().backward()
            outs.append(out)
        optimizer.step()
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: the workspace, the grads, the optimizer's state
            step(m, opt, static, (True, False))
    torch.cuda.current_stream().wait_stream(side)
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outs = step(m, opt, static, (True, False))
    for i, xs in enumerate(batches):
        for s, x in zip(static, xs):
            s.copy_(x)
        graph.replay()
        want = step(ref, ref_opt, xs, (None, None))
        for j, (a, b) in enumerate(zip(static_outs, want)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"step {i} batch {j}"


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_quantizes_in_the_graph(gen, device):
    """torch.compile(fullgraph=True) of an FP8 step: the weights' quantization is an op of the
    graph (mok::quantize_weights), so the compiled step gives eager's bits, also after the
    weights changed in place."""
    torch._dynamo.reset()
    data = make_layer(gen, 45, 128, 128, 4, 2, 64).to(device)
    d_out = data.d_out.float()

    def step(x, w, gate, up, down, sgate, sup, sdown):
        out = mok.moe(x, data.topk_experts, w, gate, up, down, sgate, sup, sdown,
                      precision="fp8")
        return out, (out.float() * d_out).sum()

    def run(fn, leaves):
        out, loss = fn(*leaves)
        loss.backward()
        return out, [t.grad for t in leaves if t is not None]

    compiled = torch.compile(step, fullgraph=True)
    leaves = data.requiring_grad()
    for _ in range(2):
        eager_out, eager_grads = run(step, [t.detach().clone().requires_grad_() for t in leaves])
        out, grads = run(compiled, leaves)
        assert torch.equal(out.view(torch.uint8), eager_out.view(torch.uint8))
        for i, (a, b) in enumerate(zip(grads, eager_grads)):
            assert torch.equal(a, b), f"gradient {i} differs from eager"
        with torch.no_grad():  # an in-place change: the next compiled run must see it
            leaves[3].mul_(0.5)
            for t in leaves:
                t.grad = None


@pytest.mark.parametrize("precision", ["fp8", "fp8-bf16-wgrad"])
def test_training_follows_the_bf16_loss_curve(precision):
    """examples/train_tiny_moe.py --precision fp8 or fp8-bf16-wgrad (a short run): the loss falls
    and mok's FP8 student's windowed losses stay within 1% of the bf16 PyTorch student's."""
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_tiny_moe.py"
    spec = importlib.util.spec_from_file_location("train_tiny_moe", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--device", "cpu", "--precision", precision, "--dim", "128",
                           "--intermediate", "128", "--steps", "75", "--batch", "64",
                           "--experts", "4", "--shared", "0", "--seed", str(SEED % 10000)])
    print(f"largest relative difference of the windowed losses: {result['worst']:.3%}")
    assert result["fell"] < 0.5, result["fell"]
    assert result["worst"] <= example.FP8_CURVE_TOLERANCE, result["worst"]
