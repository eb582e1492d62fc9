"""mok.nn.MoE: routers, statistics, training against pure PyTorch, and the example."""

import copy
import importlib.util
import pathlib
import pickle

import pytest
import torch
from conftest import F64_TOLERANCE, SEED, rel_error
from moe_reference import layer as reference_layer

import mok

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_tiny_moe.py"


def _seed(gen):
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_output_is_the_layer_of_its_routing(gen, router):
    """The module's output is the independent reference layer applied to the module's routing."""
    _seed(gen)
    m = mok.nn.MoE(6, 5, 4, 2, shared_intermediate_size=3, router=router, dtype=torch.float64)
    x = torch.randn(2, 7, 6, generator=gen, dtype=torch.float64)
    out, stats = m(x)
    assert out.shape == x.shape
    ids, w, _ = m.route(x.reshape(-1, 6))
    ref = reference_layer(x.reshape(-1, 6), ids, w, m.routed_gate_weights, m.routed_up_weights,
                          m.routed_down_weights, m.shared_gate_weights, m.shared_up_weights,
                          m.shared_down_weights)
    assert rel_error(out.reshape(-1, 6), ref) <= F64_TOLERANCE
    assert float(stats.tokens_per_expert.sum()) == 14 * 2


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_float64_training_matches_pure_pytorch(gen, router):
    """Same init, same batches, Adam: mok's experts and mok.reference's give the same losses and
    parameters up to float64 rounding, step after step (router included)."""
    _seed(gen)
    a = mok.nn.MoE(8, 6, 5, 2, shared_intermediate_size=4, router=router, dtype=torch.float64)
    b = mok.nn.MoE(8, 6, 5, 2, shared_intermediate_size=4, router=router, dtype=torch.float64,
                   backend="torch")
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (a, b)]
    target = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    for step in range(20):
        x = torch.randn(33, 8, generator=gen, dtype=torch.float64)
        losses = []
        for m, opt in zip((a, b), opts):
            out, stats = m(x)
            loss = ((out - x @ target) ** 2).mean() + 1e-2 * stats.load_balancing_loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if router == "sigmoid":
                m.update_balancing_bias(stats.tokens_per_expert)
            losses.append(loss.detach())
        assert rel_error(losses[0], losses[1]) <= F64_TOLERANCE, f"step {step}, seed {SEED}"
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert rel_error(p, q) <= 100 * F64_TOLERANCE, name


def test_router_gradient_flows_through_router_weights(gen):
    _seed(gen)
    m = mok.nn.MoE(64, 64, 4, 2)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    out, _ = m(x)
    out.float().square().sum().backward()
    assert m.router_weight.grad is not None and m.router_weight.grad.abs().sum() > 0
    for p in (m.routed_gate_weights, m.routed_up_weights, m.routed_down_weights):
        assert p.grad is not None and p.grad.dtype == torch.bfloat16


def test_sigmoid_bias_selects_but_never_weights(gen):
    _seed(gen)
    m = mok.nn.MoE(8, 6, 4, 2, router="sigmoid", route_scale=2.5, dtype=torch.float64)
    x = torch.randn(10, 8, generator=gen, dtype=torch.float64)
    m.router_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0], dtype=torch.float64))
    ids, w, stats = m.route(x)
    assert (ids == 2).any(dim=1).all(), "a large bias must select its expert for every token"
    scores = torch.sigmoid(x @ m.router_weight.T)
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(w, chosen / chosen.sum(dim=1, keepdim=True) * 2.5)
    assert not m.router_bias.requires_grad
    # Balancing: each bias moves by the rate, down for experts above the mean load, up below it.
    load = stats.tokens_per_expert.double()
    before = m.router_bias.clone()
    m.update_balancing_bias(stats.tokens_per_expert, rate=0.5)
    assert torch.equal(m.router_bias - before, 0.5 * torch.sign(load.mean() - load))
    assert m.router_bias[2] - before[2] == -0.5  # expert 2 has every token: the most loaded


def test_load_balancing_loss_reaches_the_router(gen):
    _seed(gen)
    m = mok.nn.MoE(64, 64, 8, 2)
    _, stats = m(torch.randn(30, 64, generator=gen).to(torch.bfloat16))
    assert stats.tokens_per_expert.shape == (8,)
    assert float(stats.tokens_per_expert.sum()) == 60
    stats.load_balancing_loss.backward()
    assert m.router_weight.grad.abs().sum() > 0


def test_copies_compute_the_same(gen):
    """A deep copy and a pickled round trip of a module compute its bits (whatever workspace
    they end up with: the context is autograd's, never the workspace's)."""
    _seed(gen)
    m = mok.nn.MoE(64, 64, 4, 2, shared_intermediate_size=64)
    copies = [copy.deepcopy(m), pickle.loads(pickle.dumps(m))]
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    d_out = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    runs = []
    for module in [m] + copies:
        out, _ = module(x)
        out.backward(d_out)
        runs.append((out.detach(), [p.grad for p in module.parameters()]))
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0])
        for a, b in zip(grads, runs[0][1]):
            assert torch.equal(a, b)


def test_example_trains_and_matches_pure_pytorch():
    """examples/train_tiny_moe.py: the loss falls and mok's curve matches pure PyTorch's."""
    spec = importlib.util.spec_from_file_location("train_tiny_moe", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--device", "cpu", "--seed", str(SEED % 10000)])
    assert result["fell"] < 0.5, result["fell"]
    assert result["worst"] <= example.CURVE_TOLERANCE, result["worst"]
    assert result["ok"]
