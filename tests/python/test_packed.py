"""mok.moe_packed: gate and up packed in one [E, 2I, H] tensor (concatenated or interleaved rows,
Hugging Face's gate_up_proj), read in place as row-strided views. Against mok.moe on dense copies
of the halves: the same arithmetic, so the same bits (outputs, every gradient); the weight
gradient comes back packed. Outputs are poisoned (conftest.py), so an element the strided path
forgets to write shows up as NaN."""

import pytest
import torch
from conftest import DEVICES, make_layer

import mok
from mok import _fp8_layer, _layer_ops, _native


def split(gate_up, interleaved):
    I = gate_up.shape[1] // 2
    return (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else (gate_up[:, :I], gate_up[:, I:])


def pack(gate, up, interleaved):
    E, I, H = gate.shape
    if interleaved:
        return torch.stack((gate, up), dim=2).reshape(E, 2 * I, H)
    return torch.cat((gate, up), dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_packed_is_bitwise_the_dense_layer(gen, monkeypatch, device, interleaved, dtype,
                                          routing):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is the CPU backend's exact mode")
    T, H, I, E, k = 37, 128, 64, 5, 3  # odd T; I < H
    d = make_layer(gen, T, H, I, E, k, 0, dtype=dtype, routing=routing).to(device)
    gate, up, down = d.weights[:3]
    gate_up = pack(gate, up, interleaved).requires_grad_()
    x, w, down_p = (t.clone().requires_grad_() for t in (d.x, d.topk_weights, down))
    # What the C++ core is handed: every view the layer ops pass it (data pointer, shape, strides).
    handed = []

    def recording_views(*tensors):
        out = _native.views(*tensors)
        handed.extend((v[0], v[2], v[3]) for v in out if v is not None)
        return out

    monkeypatch.setattr(_layer_ops, "views", recording_views)
    out = mok.moe_packed(x, d.topk_experts, w, gate_up, down_p, interleaved=interleaved)
    out.backward(d.d_out)
    monkeypatch.undo()

    leaves = [t.clone().requires_grad_() for t in (d.x, d.topk_weights, gate, up, down)]
    ref = mok.moe(leaves[0], d.topk_experts, leaves[1], *leaves[2:])
    ref.backward(d.d_out)
    assert torch.equal(out, ref)
    assert torch.equal(x.grad, leaves[0].grad)
    assert torch.equal(w.grad, leaves[1].grad)
    assert torch.equal(gate_up.grad, pack(leaves[2].grad, leaves[3].grad, interleaved))
    assert torch.equal(down_p.grad, leaves[4].grad)
    # The halves the core read are the packed tensor's own memory (nothing copied): gate at its
    # start, up I rows (interleaved: one row) in, each row-strided; the gradient's halves likewise.
    size = gate_up.element_size()
    row_stride = 2 * H if interleaved else H
    up_offset = (H if interleaved else I * H) * size
    for base, what in ((gate_up.data_ptr(), "gate_up"), (gate_up.grad.data_ptr(), "its gradient")):
        for ptr, half in ((base, "gate"), (base + up_offset, "up")):
            assert (ptr, (E, I, H), (2 * I * H, row_stride, 1)) in handed, \
                f"the {half} half of {what} was not handed over in place: {handed}"


def test_packed_refusals(gen):
    d = make_layer(gen, 5, 64, 64, 3, 2, 0)
    gate, up, down = d.weights[:3]
    with pytest.raises(ValueError, match=r"mok: invalid gate_up_weights.shape: expected "
                       r"\[num_experts, 2 \* intermediate_size, hidden_size\], got \[3, 127, 64\]"):
        mok.moe_packed(d.x, d.topk_experts, d.topk_weights, torch.zeros(3, 127, 64,
                       dtype=torch.bfloat16), down)
    with pytest.raises(TypeError, match="mok: invalid interleaved: expected a bool"):
        mok.moe_packed(d.x, d.topk_experts, d.topk_weights, pack(gate, up, False), down,
                       interleaved=1)
    # A transposed packed tensor: its halves have no unit column stride.
    transposed = pack(gate, up, False).transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=r"mok: invalid routed_gate_weights.strides: expected "
                       r"row-major contiguous strides, or row-strided ones"):
        mok.moe_packed(d.x, d.topk_experts, d.topk_weights, transposed, down)
    # The next good call works.
    mok.moe_packed(d.x, d.topk_experts, d.topk_weights, pack(gate, up, True), down,
                   interleaved=True)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8-bf16-wgrad"])
def test_packed_compiles(gen, precision):
    """Under torch.compile (the ops' fake implementations, then their bodies), bitwise eager; the
    FP8 form quantizes the halves inside the graph (mok::quantize_weights)."""
    size = 64 if precision == "bf16" else 128  # the FP8 layer's H and I: multiples of 128
    T, H, I, E, k = 9, size, size, 4, 2
    d = make_layer(gen, T, H, I, E, k, 0)
    gate, up, down = d.weights[:3]
    gate_up = pack(gate, up, False).requires_grad_()

    def step(x, w, gu, dn):
        out = mok.moe_packed(x, d.topk_experts, w, gu, dn, precision=precision)
        return out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = [d.x.clone().requires_grad_(), d.topk_weights.clone().requires_grad_(), gate_up,
            down.clone().requires_grad_()]
    loss = compiled(*args)
    grads = torch.autograd.grad(loss, args)
    eager_args = [a.detach().clone().requires_grad_() for a in args]
    eager_loss = step(*eager_args)
    eager_grads = torch.autograd.grad(eager_loss, eager_args)
    assert torch.equal(loss, eager_loss)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_fp8_is_bitwise_the_dense_fp8_layer(gen, device, interleaved):
    """precision="fp8": the FP8 layer over the halves (views), the same bits as mok.moe's FP8
    layer on dense copies of them; the halves' quantizations are cached with the packed tensor
    (its views are new tensors each call) and made again after an in-place change."""
    T, H, I, E, k = 37, 128, 128, 5, 3
    d = make_layer(gen, T, H, I, E, k, 0).to(device)
    gate, up, down = d.weights[:3]
    gate_up = pack(gate, up, interleaved).requires_grad_()
    x, w, down_p = (t.clone().requires_grad_() for t in (d.x, d.topk_weights, down))
    out = mok.moe_packed(x, d.topk_experts, w, gate_up, down_p, interleaved=interleaved,
                         precision="fp8")
    out.backward(d.d_out)
    leaves = [t.clone().requires_grad_() for t in (d.x, d.topk_weights, gate, up, down)]
    ref = mok.moe(leaves[0], d.topk_experts, leaves[1], *leaves[2:], precision="fp8")
    ref.backward(d.d_out)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(x.grad.view(torch.uint8), leaves[0].grad.view(torch.uint8))
    assert torch.equal(w.grad, leaves[1].grad)
    assert torch.equal(gate_up.grad.view(torch.uint8),
                       pack(leaves[2].grad, leaves[3].grad, interleaved).view(torch.uint8))
    assert torch.equal(down_p.grad.view(torch.uint8), leaves[4].grad.view(torch.uint8))
    halves = _fp8_layer.quantized_halves(gate_up, interleaved)
    assert _fp8_layer.quantized_halves(gate_up, interleaved) is halves  # reused
    with torch.no_grad():
        gate_up.mul_(0.5)  # in place: a new version of the packed tensor
    again = _fp8_layer.quantized_halves(gate_up, interleaved)
    assert again is not halves
    assert not torch.equal(again[0][1], halves[0][1])  # the gate half's scales halved
