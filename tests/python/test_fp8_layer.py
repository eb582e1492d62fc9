"""The FP8 layer from Python (mok.moe / mok.nn.MoE with precision="fp8", CPU): against the f64
layer of the unquantized bf16 values within MoK's MXFP8 bounds (errors printed beside the bf16
layer's), bitwise run to run, the weights quantized again after an optimizer step (a stale
quantization fails the test), the quantization reused while the weights are unchanged, and bad
arguments named. The C++ tests (tests/cpp/test_fp8_layer.cpp) check the layer bitwise against its
definition."""

import copy
import importlib.util
import pathlib

import pytest
import torch

import mok
from conftest import make_layer
from mok import _fp8_layer


def grads_of(data, precision):
    """(out, d_x, d_topk_weights, d_gate, d_up, d_down, d_shared...) of one call (autograd)."""
    leaves = data.requiring_grad()
    x, tw, *weights = leaves
    out = mok.moe(x, data.topk_experts, tw, *weights, precision=precision)
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


def test_bad_arguments_name_the_argument(gen):
    data = make_layer(gen, 8, 128, 128, 2, 2, 0)
    with pytest.raises(ValueError, match="invalid precision: expected 'bf16' or 'fp8', got 'fp16'"):
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


def test_cuda_tensors_say_the_fp8_layer_is_not_yet_on_the_cuda_backend(gen):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine: GPU tests not run")
    data = make_layer(gen, 8, 128, 128, 2, 2, 0).to("cuda")
    with pytest.raises(ValueError, match="not yet on the CUDA backend"):
        mok.moe(*data.args(), precision="fp8")


def test_training_follows_the_bf16_loss_curve():
    """examples/train_tiny_moe.py --precision fp8 (a short run): the loss falls and mok's FP8
    student's windowed losses stay within 1% of the bf16 PyTorch student's."""
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_tiny_moe.py"
    spec = importlib.util.spec_from_file_location("train_tiny_moe", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--device", "cpu", "--precision", "fp8", "--dim", "128",
                           "--intermediate", "128", "--steps", "75", "--batch", "64",
                           "--experts", "4", "--shared", "0"])
    print(f"largest relative difference of the windowed losses: {result['worst']:.3%}")
    assert result["fell"] < 0.5, result["fell"]
    assert result["worst"] <= example.FP8_CURVE_TOLERANCE, result["worst"]
