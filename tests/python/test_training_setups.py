"""mok.nn.MoE in the setups a training job wraps it in: activation checkpointing, torch.autocast
over float32 master weights, DistributedDataParallel and FSDP2 (fully_shard with bf16 mixed
precision). The data-parallel ones run tests/python/fsdp_worker.py under torchrun (2 CPU
processes, gloo; and 1 GPU process, NCCL); the others run here, on every backend (CUDA skipped
visibly without a GPU).
"""

import os

import pytest
import torch
from conftest import (DEVICES, SEED, TRANSFORMERS_SKIP_REASON, passed_ranks, requires_cuda,
                      torchrun)
from torch.utils.checkpoint import checkpoint

import mok

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_worker.py")


def make(device, dtype=torch.bfloat16, precision="bf16", router="sigmoid", seed=SEED):
    torch.manual_seed(seed)
    return mok.nn.MoE(128, 128, 8, 2, shared_intermediate_size=128, router=router,
                      device=device, dtype=dtype, precision=precision)


def tokens(device, dtype=torch.bfloat16, seed=SEED):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(3, 37, 128, generator=g).to(device=device, dtype=dtype)  # 111 tokens


def step(layer, x, call=None, autocast=False):
    """Output, the load-balancing loss, and the gradients of x and every parameter. `autocast`:
    the forward under torch.autocast(dtype=bf16), the backward outside it (as PyTorch says)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out, stats = (call or layer)(x)
    (out.float().square().mean() + 0.01 * stats.load_balancing_loss).backward()
    return ([out.detach(), stats.load_balancing_loss.detach(), x.grad]
            + [p.grad for p in layer.parameters()])


def assert_bits(got, want, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and torch.equal(g, w), \
            f"seed {SEED}: {what}: item {i} differs (max |diff| " \
            f"{(g.double() - w.double()).abs().max().item():.3g})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_checkpointing_recomputes_bit_for_bit(device, precision):
    """Non-reentrant checkpointing (PyTorch's recommended form) reruns the layer in the backward:
    every gradient, the load-balancing loss's included, bit for bit the plain call's."""
    layer, x = make(device, precision=precision), tokens(device)
    plain = step(layer, x)
    assert_bits(step(layer, x, lambda v: checkpoint(layer, v, use_reentrant=False)), plain,
                "checkpoint(use_reentrant=False)")


@pytest.mark.parametrize("device", DEVICES)
def test_reentrant_checkpointing_keeps_the_output_gradients(device):
    """The reentrant form returns MoEStats (not a tensor) as computed under no_grad: the output's
    gradients are the plain call's bit for bit, the load-balancing loss carries none (PyTorch's
    behaviour for any non-tensor output; the module docstring says to use the other form)."""
    layer, x = make(device), tokens(device)
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    out.float().square().mean().backward()
    want = [x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out, stats = checkpoint(layer, x, use_reentrant=True)
    assert not stats.load_balancing_loss.requires_grad
    out.float().square().mean().backward()
    got = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p)
                      for p in layer.parameters()]
    assert_bits(got, want, "checkpoint(use_reentrant=True)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_autocast_over_float32_weights_is_the_bf16_module(device, precision):
    """float32 parameters under torch.autocast(dtype=bf16), float32 x: the output and every
    gradient are those of the bf16 module holding the same weights rounded to bf16 (the router's
    in fp32 as they are), given x rounded to bf16; the gradients reach the float32 parameters as
    float32, the bf16 gradients widened."""
    master = make(device, dtype=torch.float32, precision=precision)
    rounded = make(device, precision=precision)
    with torch.no_grad():
        for p, q in zip(master.parameters(), rounded.parameters(), strict=True):
            q.copy_(p)  # the router stays fp32, the experts round to bf16
    x32 = tokens(device, torch.float32)
    got = step(master, x32, autocast=True)
    want = step(rounded, x32.to(torch.bfloat16))
    assert got[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in got[3:])
    want = want[:2] + [want[2].float()] + [w.float() for w in want[3:]]
    assert_bits(got, want, "autocast over float32 weights")


def test_float32_weights_need_autocast_or_fsdp():
    layer = make("cpu", dtype=torch.float32)
    with pytest.raises(TypeError) as e:
        layer(tokens("cpu"))
    assert str(e.value) == (
        "mok: invalid routed_gate_weights.dtype: expected bfloat16 at the call (float32 "
        "parameters are computed in bf16 under torch.autocast(dtype=torch.bfloat16) or FSDP's "
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16)), got float32")
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(TypeError) as e:
        layer(tokens("cpu"))
    assert str(e.value) == ("mok: invalid autocast dtype: expected torch.bfloat16 (mok's layer "
                            "computes in bf16), got torch.float16")


@pytest.mark.parametrize("suite", ["fsdp", "ddp"])
def test_data_parallel_wrappers(suite):
    out = torchrun(WORKER, 2, ["--suite", suite, "--seed", str(SEED)], 300, f"{suite} suite")
    assert passed_ranks(out, 2, suite) == [0, 1], out[-6000:]


@pytest.mark.skipif(TRANSFORMERS_SKIP_REASON is not None,
                    reason=f"{TRANSFORMERS_SKIP_REASON}: FSDP2 of a Transformers model not run")
@pytest.mark.parametrize("device", DEVICES)
def test_fsdp_of_a_transformers_model(device):
    nproc = 2 if device == "cpu" else 1
    out = torchrun(WORKER, nproc, ["--suite", "hf", "--seed", str(SEED), "--device", device],
                   300, f"FSDP2 of a Transformers model ({device})")
    assert passed_ranks(out, nproc, "hf") == list(range(nproc)), out[-6000:]


@requires_cuda
@pytest.mark.parametrize("suite", ["fsdp", "ddp"])
def test_gpu_data_parallel_wrappers(suite):
    """One GPU, NCCL, one rank: the wrappers' own gathers and reductions around the CUDA layer."""
    out = torchrun(WORKER, 1, ["--suite", suite, "--seed", str(SEED), "--device", "cuda"], 300,
                   f"{suite} suite on the GPU")
    assert passed_ranks(out, 1, suite) == [0], out[-6000:]
