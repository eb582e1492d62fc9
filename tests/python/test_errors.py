"""Bad input: one test per check, each asserting on the message (argument, expected, actual)."""

import dataclasses
import re

import pytest
import torch
from conftest import DEVICES, make_layer

import mok
from mok import functional

T, H, I, E, K, S = 6, 64, 64, 4, 2, 64


@pytest.fixture
def data(gen):
    return make_layer(gen, T, H, I, E, K, S)


def call(data, **replace):
    """mok.moe with some arguments replaced."""
    args = dict(zip(("x", "topk_experts", "topk_weights", "routed_gate_weights",
                     "routed_up_weights", "routed_down_weights", "shared_gate_weights",
                     "shared_up_weights", "shared_down_weights"), data.args()))
    args.update(replace)
    return mok.moe(*args.values())


def raises(error, message):
    return pytest.raises(error, match=re.escape(message))


def test_activation_dtype(data):
    with raises(TypeError, "mok: invalid x.dtype: expected bfloat16 (or float64 on the cpu "
                           "backend), got float32"):
        call(data, x=data.x.float())


def test_weight_dtype(data):
    with raises(TypeError, "mok: invalid routed_gate_weights.dtype: expected bfloat16, got "
                           "float32"):
        call(data, routed_gate_weights=data.weights[0].float())


def test_router_weights_dtype(data):
    with raises(TypeError, "mok: invalid topk_weights.dtype: expected float32, got bfloat16"):
        call(data, topk_weights=data.topk_weights.to(torch.bfloat16))


def test_expert_ids_dtype(data):
    with raises(TypeError, "mok: invalid topk_experts.dtype: expected int64, got int32"):
        call(data, topk_experts=data.topk_experts.int())


def test_device_mismatch(data):
    up = torch.empty(data.weights[1].shape, dtype=torch.bfloat16, device="meta")
    with raises(ValueError, "mok: invalid routed_up_weights.device: expected cpu, got meta"):
        call(data, routed_up_weights=up)


def test_weight_shape(data):
    with raises(ValueError, f"mok: invalid routed_up_weights.shape: expected [{E}, {I}, {H}], "
                            f"got [{E}, {I}, {2 * H}]"):
        call(data, routed_up_weights=torch.zeros(E, I, 2 * H, dtype=torch.bfloat16))


def test_router_weights_shape(data):
    with raises(ValueError, f"mok: invalid topk_weights.shape: expected [{T}, {K}], "
                            f"got [{T}, {K + 1}]"):
        call(data, topk_weights=torch.ones(T, K + 1))


def test_non_contiguous_weights(data):
    down = data.weights[2].transpose(1, 2)  # same shape (H == I), wrong strides
    with raises(ValueError, f"mok: invalid routed_down_weights.strides: expected row-major "
                            f"contiguous strides, or row-strided ones: [expert, row, 1] with row "
                            f">= {I} and expert >= {H} * row, got [{H * I}, 1, {I}]"):
        call(data, routed_down_weights=down)


def test_overlapping_row_strided_weights(data):
    # Rows that overlap (row stride < H): a row-strided view mok would misread.
    gate = data.weights[0]
    overlapping = gate.as_strided(gate.shape, (I * H, H // 2, 1))
    with raises(ValueError, f"mok: invalid routed_gate_weights.strides: expected row-major "
                            f"contiguous strides, or row-strided ones: [expert, row, 1] with row "
                            f">= {H} and expert >= {I} * row, got [{I * H}, {H // 2}, 1]"):
        call(data, routed_gate_weights=overlapping)


def test_non_contiguous_activations(data):
    x = torch.zeros(H, T, dtype=torch.bfloat16).t()
    with raises(ValueError, "mok: invalid x.strides: expected row-major contiguous strides"):
        call(data, x=x)


@pytest.mark.parametrize("bad", [E, -2])
def test_expert_id_out_of_range(data, bad):
    ids = data.topk_experts.clone()
    ids[2, 1] = bad
    with raises(ValueError, f"mok: invalid topk_experts[2, 1]: expected an expert id in "
                            f"[-1, {E}), got {bad}"):
        call(data, topk_experts=ids)


def test_expert_id_out_of_range_in_build_schedule(data):
    ids = data.topk_experts.clone()
    ids[5, 0] = 99
    config = functional.MoKConfig()
    ws = functional.get_workspace(config, None, device="cpu", num_local_tokens=T,
                                  hidden_size=H, topk=K)
    with raises(ValueError, f"mok: invalid topk_experts[5, 0]: expected an expert id in "
                            f"[-1, {E}), got 99"):
        functional.build_schedule(ws, config, ids, num_local_experts=E)


def test_bf16_alignment(gen):
    d = make_layer(gen, T, 48, I, E, K, 0)
    with raises(ValueError, "mok: invalid hidden_size: expected a multiple of 64 for bfloat16, "
                            "got 48"):
        call(d)


def test_topk_above_num_experts(gen):
    d = make_layer(gen, T, H, I, 2, 2, 0)
    ids = torch.zeros(T, 3, dtype=torch.int64)
    with raises(ValueError, "mok: invalid topk: expected at most num_experts = 2, got 3"):
        call(d, topk_experts=ids, topk_weights=torch.ones(T, 3))


def test_partial_shared_expert(data):
    with raises(ValueError, "mok: invalid shared_up_weights: expected a tensor "
                            "(shared_gate_weights is given: the shared expert needs all three), "
                            "got None"):
        call(data, shared_up_weights=None)


def test_d_out_dtype(data):
    _, *context = torch.ops.mok.forward(*data.args(), 0)
    with raises(TypeError, "mok: invalid d_out.dtype: expected bfloat16, got float32"):
        torch.ops.mok.backward(data.d_out.float(), *data.args(), *context, 0)


def test_main_grad_dtype(data):
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=T,
                                     hidden_size=H, topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    main = tuple(torch.zeros(w.shape) for w in (sg, g, su, u, sd, d))
    main = (main[0], main[1].to(torch.bfloat16), *main[2:])
    _, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd, g, u,
                                d)
    with raises(TypeError, "mok: invalid main_routed_gate.dtype: expected float32, got bfloat16"):
        functional.backward(config, ws, schedule, ctx, data.d_out, data.x, data.topk_weights,
                            sg, su, sd, g, u, d, main_grads=main)


def test_workspace_shape_mismatch(data):
    config = functional.MoKConfig()
    ws = functional.get_workspace(config, None, device="cpu", num_local_tokens=T + 1,
                                  hidden_size=H, topk=K)
    with raises(ValueError, f"mok: invalid x.shape[0]: expected {T + 1} (the workspace's "
                            f"num_local_tokens), got {T}"):
        mok.moe(*data.args(), workspace=ws)
    with raises(ValueError, f"mok: invalid top_experts.shape[0]: expected {T + 1} (the "
                            f"workspace's num_local_tokens), got {T}"):
        functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    ws = functional.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                                  topk=K + 1)
    with raises(ValueError, f"mok: invalid top_experts.shape[1]: expected {K + 1} (the "
                            f"workspace's topk), got {K}"):
        functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)


def test_workspace_without_sizes_takes_the_calls(data):
    # A workspace made with its sizes left None (the automatic one's form) follows each call's
    # tensors: build_schedule once compared the ids' shape with [None, None] and refused every one.
    config = functional.MoKConfig()
    ws = functional.Workspace(config)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    want = functional.build_schedule(
        functional.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                                 topk=K), config, data.topk_experts, num_local_experts=E)
    assert torch.equal(schedule.rows_per_expert, want.rows_per_expert)


def test_config_values():
    with raises(ValueError, "mok: invalid config.macrobatch_size: expected a multiple of "
                            "config.minibatch_size = 4096, got 5000"):
        functional.MoKConfig(macrobatch_size=5000)
    with raises(ValueError, "mok: invalid config.fwd_num_comm_sms: expected at least 1, got 0"):
        functional.MoKConfig(fwd_num_comm_sms=0)
    with raises(TypeError, "mok: invalid config.minibatch_size: expected an int, got float"):
        functional.MoKConfig(minibatch_size=4096.0)
    with pytest.raises(AttributeError):  # frozen
        functional.MoKConfig().minibatch_size = 1


def test_config_forward_path_and_stage_rows(data):
    """mok's own knobs: forward_path "launches" or "fused", fused_stage_rows 0 or a positive
    multiple of 128, both keyword-only; each bad value names its field, and a good config works
    afterwards."""
    with raises(ValueError, "mok: invalid config.forward_path: expected 'launches' or 'fused', "
                            "got 'megakernel'"):
        functional.MoKConfig(forward_path="megakernel")
    with raises(TypeError, "mok: invalid config.forward_path: expected a str, got int"):
        functional.MoKConfig(forward_path=1)
    for bad in (100, -128):
        with raises(ValueError, "mok: invalid config.fused_stage_rows: expected 0 (automatic) or a "
                                f"positive multiple of 128 rows, got {bad}"):
            functional.MoKConfig(fused_stage_rows=bad)
    for bad in ("128", True, 128.0):
        with raises(TypeError, "mok: invalid config.fused_stage_rows: expected an int, got "
                               f"{type(bad).__name__}"):
            functional.MoKConfig(fused_stage_rows=bad)
    with pytest.raises(TypeError):  # mok's additions follow MoK's six fields, keyword-only
        functional.MoKConfig(40, 28, 4096, 0, 0.5, 2048, "fused")
    config = functional.MoKConfig(forward_path="fused", fused_stage_rows=256)
    ws = functional.create_workspace(config, None, device="cpu", num_local_tokens=T,
                                     hidden_size=H, topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    out, _ = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd, g, u,
                                d)
    assert torch.equal(out, call(data))


def test_unsupported_mok_features(data):
    config = functional.MoKConfig()
    ws = functional.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                                  topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    # MXFP8 tuples run the FP8 layer (mok/_mx_calls.py): H and I multiples of 128 (here H = 64).
    with raises(ValueError, "mok: invalid hidden_size: expected a multiple of 128 with MXFP8 "
                            "weights, got 64"):
        functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd, (g, g),
                           (u, u), (d, d))


def test_workspace_device_names_the_argument():
    with raises(ValueError, "mok: invalid device: expected a torch.device (or its name), got "
                            "'gpu0'"):
        functional.get_workspace(functional.MoKConfig(), None, device="gpu0",
                                 num_local_tokens=T, hidden_size=H, topk=K)
    with raises(TypeError, "mok: invalid device: expected a torch.device (or its name), got 3.5"):
        functional.create_workspace(functional.MoKConfig(), None, device=3.5,
                                    num_local_tokens=T, hidden_size=H, topk=K)


def test_cuda_workspace_without_cuda_backend():
    """Where the CUDA backend cannot run, asking for it raises mok's own error (no fallback)."""
    if mok.backend_available("cuda"):
        pytest.skip("the CUDA backend is available here: nothing to refuse")
    with raises(RuntimeError, "mok: the CUDA backend is not available ("):
        functional.get_workspace(functional.MoKConfig(), None, device="cuda", num_local_tokens=T,
                                 hidden_size=H, topk=K)


def test_cuda_without_backend_raises_mok_error():
    """Where the CUDA backend cannot run (every CPU-only build, so every CPU run of this suite),
    each entry point a call on CUDA tensors reaches raises mok's own error: the C++ workspace of a
    CUDA layer (created at its first call), require_backend (build_schedule's check of CUDA ids)
    and get_workspace / create_workspace for a CUDA device. The same calls with CUDA tensors, the
    backend stood in for: test_gpu.py::test_cuda_without_backend_raises_mok_error."""
    if mok.backend_available("cuda"):
        pytest.skip("the CUDA backend is available here: nothing to refuse")
    from mok import _native

    message = "mok: the CUDA backend is not available ("
    with raises(RuntimeError, message):
        _native.lib.Workspace(
            num_tokens=T, hidden_size=H, intermediate_size=I, num_experts=E, topk=K,
            shared_intermediate_size=S, ep_size=1, ep_rank=0, fwd_num_comm_sms=40,
            bwd_num_comm_sms=28, minibatch_size=4096, macrobatch_size=0,
            schedule_capacity_multiplier=0.5, backend="cuda", activation_dtype="bfloat16",
            num_threads=1, device_index=0)
    with raises(RuntimeError, message):
        _native.lib.require_backend("cuda")
    for make in (functional.get_workspace, functional.create_workspace):
        with raises(RuntimeError, message):
            make(functional.MoKConfig(), None, device="cuda", num_local_tokens=T, hidden_size=H,
                 topk=K)
    _native.lib.require_backend("cpu")  # and the CPU backend is there


def test_error_while_compiling(data):
    """The fake implementations check too: torch.compile reports the bad call while tracing."""
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: mok.moe(*a), fullgraph=True)
    args = list(data.args())
    args[2] = args[2].double()
    with pytest.raises(Exception, match=re.escape(
            "mok: invalid topk_weights.dtype: expected float32, got float64")):
        fn(*args)


def test_nn_module_arguments():
    with raises(ValueError, "mok: invalid router: expected 'softmax' or 'sigmoid', got 'relu'"):
        mok.nn.MoE(64, 64, 4, 2, router="relu")
    with raises(ValueError, "mok: invalid topk: expected in [1, num_experts = 4], got 5"):
        mok.nn.MoE(64, 64, 4, 5)


# The forward context: tensors the caller owns, checked against the shapes the workspace gives
# before backward reads them. Each defect is named `forward_context.<field>`.
CONTEXT_FIELDS = ("x_routed", "gate_routed", "up_routed", "hidden_routed", "gate_shared",
                  "up_shared", "hidden_shared")


def _functional_layer(data, device):
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device=device, num_local_tokens=T,
                                     hidden_size=H, topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d, sg, su, sd = data.weights
    _, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, sg, su, sd, g,
                                u, d)

    def backward(ctx, **kwargs):
        return functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                   data.topk_weights, sg, su, sd, g, u, d, **kwargs)
    return ctx, backward


def _other_device(device):
    return "meta" if device == "cpu" else "cpu"


def _defects(t, device):
    """(what, bad tensor, error type, message tail) for one context tensor `t`."""
    rows, cols = t.shape
    other = _other_device(device)
    wrong_cols = torch.empty(rows, cols + 64, dtype=t.dtype, device=t.device)
    return [
        ("shape", wrong_cols, ValueError,
         f".shape: expected [{rows}, {cols}], got [{rows}, {cols + 64}]"),
        ("rows", torch.empty(rows + 1, cols, dtype=t.dtype, device=t.device), ValueError,
         f".shape: expected [{rows}, {cols}], got [{rows + 1}, {cols}]"),
        ("dtype", t.float(), TypeError, ".dtype: expected bfloat16, got float32"),
        ("device", torch.empty(t.shape, dtype=t.dtype, device=other), ValueError,
         f".device: expected {'cpu' if device == 'cpu' else 'cuda:0'}, got {other}"),
        ("None", None, TypeError, ": expected a torch.Tensor, got NoneType"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("field", CONTEXT_FIELDS)
def test_bad_forward_context_is_named(gen, device, field):
    """Wrong shape, dtype, device or a missing tensor in any field of the context: mok's error
    names forward_context.<field>, through functional.backward, its main-grads path and the op."""
    data = make_layer(gen, T, H, I, E, K, S).to(device)
    ctx, backward = _functional_layer(data, device)
    t = getattr(ctx, field)
    if t.shape[0] == 0:  # the CPU backend keeps no x rows: [0, H]
        t = torch.empty(1, t.shape[1], dtype=t.dtype, device=t.device)[:0]
    for what, bad, error, tail in _defects(t, device):
        broken = dataclasses.replace(ctx, **{field: bad})
        message = f"mok: invalid forward_context.{field}{tail}"
        with raises(error, message):
            backward(broken)
        main = tuple(torch.zeros(w.shape, device=device) for w in
                     (data.weights[3], data.weights[0], data.weights[4], data.weights[1],
                      data.weights[5], data.weights[2]))
        with raises(error, message):
            backward(broken, main_grads=main)
        ops_context = list(broken._ops_args())
        with raises(error, message):
            torch.ops.mok.backward(data.d_out, *data.args(), *ops_context, 0)
    # The context is untouched by the failed calls: backward from it still works.
    backward(ctx)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_forward_context(gen, device):
    data = make_layer(gen, T, H, I, E, K, S).to(device)
    ctx, backward = _functional_layer(data, device)
    g = ctx.gate_routed
    strided = torch.empty(g.shape[0], 2 * g.shape[1], dtype=g.dtype, device=g.device)[:, ::2]
    with raises(ValueError, f"mok: invalid forward_context.gate_routed.strides: expected "
                            f"row-major contiguous strides, got [{2 * g.shape[1]}, 2]"):
        backward(dataclasses.replace(ctx, gate_routed=strided))


@pytest.mark.parametrize("device", DEVICES)
def test_shared_context_without_shared_expert(gen, device):
    """A layer without a shared expert takes None (or empty tensors) for the shared context; a
    real tensor there is an error naming the field."""
    data = make_layer(gen, T, H, I, E, K, 0).to(device)
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device=device, num_local_tokens=T,
                                     hidden_size=H, topk=K)
    schedule = functional.build_schedule(ws, config, data.topk_experts, num_local_experts=E)
    g, u, d = data.weights[:3]
    _, ctx = functional.forward(config, ws, schedule, data.x, data.topk_weights, None, None, None,
                                g, u, d)
    assert ctx.gate_shared is None and ctx.up_shared is None and ctx.hidden_shared is None
    extra = torch.empty(T, 64, dtype=torch.bfloat16, device=device)
    with raises(ValueError, "mok: invalid forward_context.up_shared: expected None or an empty "
                            f"tensor (the layer has no shared expert), got a tensor [{T}, 64]"):
        functional.backward(config, ws, schedule, dataclasses.replace(ctx, up_shared=extra),
                            data.d_out, data.x, data.topk_weights, None, None, None, g, u, d)


def test_forward_context_is_frozen(data):
    _, *context = torch.ops.mok.forward(*data.args(), 0)
    ctx = functional.MoKForwardContext._from_ops(context, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.gate_routed = None
