"""CUDA tensors: mok's CUDA backend against the same fp64 reference, or mok's own error where that
backend cannot run. Skipped (and listed as skipped) on machines without a CUDA GPU."""

import re

import pytest
import torch
from conftest import GRAD_TOLERANCE, OUT_TOLERANCE, make_layer
from test_layer import GRAD_NAMES, check_against_reference

import mok

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU on this machine: GPU tests not run")

needs_cuda_backend = pytest.mark.skipif(
    torch.cuda.is_available() and not mok.backend_available("cuda"),
    reason="a GPU is here but mok's CUDA backend is not available in this build")


def run_moe_cuda(data):
    x, w, *weights = [t.detach().cuda().requires_grad_(True) if t is not None else None
                      for t in (data.x, data.topk_weights, *data.weights)]
    out = mok.moe(x, data.topk_experts.cuda(), w, *weights)
    out.backward(data.d_out.cuda())
    grads = [x.grad, w.grad, *[t.grad if t is not None else None for t in weights]]
    return out.detach().cpu(), [g.cpu() if g is not None else None for g in grads]


@needs_cuda_backend
@pytest.mark.parametrize("shape", [(1, 64, 64, 1, 1, 0, "random"),
                                   (33, 64, 128, 4, 2, 64, "random"),
                                   (257, 128, 64, 8, 3, 0, "one_expert")],
                         ids=lambda s: "T{}-H{}-I{}-E{}-k{}-S{}-{}".format(*s))
def test_cuda_layer_matches_fp64_reference(gen, shape):
    data = make_layer(gen, *shape[:6], routing=shape[6])
    out, grads = run_moe_cuda(data)
    check_against_reference(data, out, grads, OUT_TOLERANCE, GRAD_TOLERANCE)


@needs_cuda_backend
def test_cuda_layer_is_bitwise_reproducible(gen):
    data = make_layer(gen, 100, 64, 64, 6, 2, 64)
    first_out, first_grads = run_moe_cuda(data)
    out, grads = run_moe_cuda(data)
    assert torch.equal(out, first_out)
    for name, a, b in zip(GRAD_NAMES, grads, first_grads):
        assert torch.equal(a, b), name


@needs_cuda_backend
def test_cuda_bad_expert_id_is_reported_by_the_next_call(gen):
    """Ids are checked on the device, without waiting for it: the error comes at the latest with
    the next call on the workspace."""
    data = make_layer(gen, 8, 64, 64, 4, 2, 0)
    args = [t.cuda() if t is not None else None for t in data.args()]
    bad = args[1].clone()
    bad[3, 1] = 7
    with pytest.raises(ValueError, match=re.escape("expected an expert id in [-1, 4), got 7")):
        mok.moe(args[0], bad, *args[2:])
        torch.cuda.synchronize()
        mok.moe(*args)


def test_cuda_without_backend_raises_mok_error(gen):
    if mok.backend_available("cuda"):
        pytest.skip("mok's CUDA backend is available here: nothing to refuse")
    data = make_layer(gen, 33, 64, 64, 4, 2, 64)
    args = [t.cuda() if t is not None else None for t in data.args()]
    with pytest.raises(RuntimeError, match=re.escape("mok: the CUDA backend is not available")):
        mok.moe(*args)
    with pytest.raises(RuntimeError, match=re.escape("mok: the CUDA backend is not available")):
        torch.ops.mok.build_schedule(args[1], 4, 4, 0)
