"""MoK's MXFP8 calling forms on mok's FP8 layer (mok/_mx_calls.py): mok.functional.forward with
MoK's MX tuples (fp8, sc), backward with (fp8, sc, fp8_t, sc_t) for gate and up and (fp8_t, sc_t)
for down, recompute_forward_context, main_grads, and MoK's ops
dispatch_mlp_swiglu_combine_{fwd,bwd}_mxfp8 (also under torch.compile(fullgraph=True)), the tuples
made by mok.ops.mxfp8_quantize as MoK's tests make them.

Every output and gradient is checked (a) bitwise against the FP8 layer's ops
(_fp8_layer.forward_fp8 / backward_fp8) called directly with the converted blocks, the orientation
each weight is converted in spelled out here (gate and up from their normal pair, down in
backward from its transposed pair, swapped), and (b) against an independent float64 layer
(written here, per expert, autograd for the gradients) of the MX weights' dequantized values and
of the unquantized bf16 values, with MoK's MXFP8 tolerances (abs max 1.0 and sum|diff| /
sum|ref| 0.1 on the outputs, gradient cosine >= 0.996); mok's own errors are printed beside.
Shapes: H and I multiples of 128, odd T, skewed routing with unused slots, the shared expert on
and off, swiglu_limit. Outputs mok allocates are poisoned (conftest). The CUDA variants run at
MoK's shapes scaled to one GPU and skip without one."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda, uniform

import mok
import mok.functional as functional
import mok.ops
from mok import _fp8_layer, _mx_calls

# MoK's MXFP8 tolerances (MoK's tests: the layer against its bf16 reference).
ABS_MAX = 1.0
REL_SUM = 0.1
COSINE = 0.996

RESULTS = ("out", "d_x", "d_router_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
           "d_shared_gate", "d_shared_up", "d_shared_down")


@dataclasses.dataclass
class Data:
    x: torch.Tensor
    ids: torch.Tensor  # int64 [T, k], -1: unused slot
    router_weights: torch.Tensor
    weights: tuple  # bf16: routed gate, up, down, shared gate, up, down (None without shared)
    d_out: torch.Tensor

    @property
    def E(self):
        return self.weights[0].shape[0]

    def to(self, device):
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Data(move(self.x), move(self.ids), move(self.router_weights),
                    tuple(move(w) for w in self.weights), move(self.d_out))


def make_data(gen, T, H, I, E, k, S, *, skew=8.0, unused=0.15):
    """Skewed routing: expert 0 drawn `skew` times as often as each other one (k distinct
    experts per token), a share of slots unused (-1)."""
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).bfloat16()
    p = torch.ones(E, dtype=torch.float64)
    p[0] = skew
    ids = torch.stack([torch.multinomial(p, k, replacement=False, generator=gen)
                       for _ in range(T)])
    ids[torch.rand(T, k, generator=gen) < unused] = -1
    w = torch.rand(T, k, generator=gen, dtype=torch.float64) + 0.1
    w = (w / w.sum(1, keepdim=True)).float()
    bf = torch.bfloat16
    routed = (uniform(gen, (E, I, H), H**-0.5, bf), uniform(gen, (E, I, H), H**-0.5, bf),
              uniform(gen, (E, H, I), I**-0.5, bf))
    shared = ((uniform(gen, (S, H), H**-0.5, bf), uniform(gen, (S, H), H**-0.5, bf),
               uniform(gen, (H, S), S**-0.5, bf)) if S else (None, None, None))
    d_out = torch.randn(T, H, generator=gen, dtype=torch.float64).bfloat16()
    return Data(x, ids.contiguous(), w.contiguous(), (*routed, *shared), d_out)


def mx_tuples(data):
    """MoK's weight quantization: (fp8, sc, fp8_t, sc_t) of each routed weight."""
    return [mok.ops.mxfp8_quantize(w, True, True) for w in data.weights[:3]]


def mx_dequantized(fp8, sc):
    """The values an MX weight holds: fp8 [E, N, K] times its 1x32 blocks' E8M0 scales (MoK's
    scale layout [E * N / 128, K / 128, 32, 16] decoded: row r, block j at [r // 128, j // 4,
    r % 32, (r % 128) // 32 * 4 + j % 4])."""
    E, N, K = fp8.shape
    byte = sc.reshape(E * N // 128, K // 128, 32, 4, 4).permute(0, 3, 2, 1, 4)
    exponent = byte.reshape(E * N, K // 32).double() - 127
    return (fp8.double().reshape(E * N, K // 32, 32) * torch.exp2(exponent).unsqueeze(-1)
            ).reshape(E, N, K)


def swiglu(g, u, limit, taken=None):
    """MoK's clamped SwiGLU (no clamp when limit is None). `taken`: the tested layer's own
    pre-activations (g, u) of these rows, whose side of the clamp's kink the reference then takes
    (see branches_of)."""
    if limit is None:
        return F.silu(g) * u
    if taken is None:
        # torch.where, not clamp: the gradient passes at the limits in every torch version
        # (torch.clamp's is 0 there from 2.14 on), as in mok's layer
        u = torch.where(u > limit, limit, torch.where(u < -limit, -limit, u))
        return F.silu(torch.where(g > limit, limit, g)) * u
    tg, tu = (t.double() for t in taken)
    g = torch.where(tg > limit, torch.full_like(g, limit), g)
    u = torch.where(tu.abs() > limit, limit * tu.sign(), u)
    return F.silu(g) * u


def check_same_side(name, ref, taken, operand_size, limit):
    """Where the layer's pre-activation lies on the other side of the clamp's limit than the
    float64 one, the two may differ only by FP8 rounding: |ref - limit| <= 2^-2 * (|x| @ |W|^T)
    (x's e4m3 rounding 2^-4, the weight's MX rounding and its conversion to 128x128 blocks 2^-4
    each, relative, per product: (1 + 2^-4)^3 - 1 < 2^-2) + 2^-6 * limit (the context's bf16)."""
    other_side = (taken > limit) != (ref > limit)
    slack = 2.0**-2 * operand_size + 2.0**-6 * limit
    assert ((ref - limit).abs() <= slack)[other_side].all(), (
        f"{name}: the layer's pre-activation is on the other side of the limit {limit} than the "
        "float64 one by more than FP8 rounding")


def branches_of(data, ctx):
    """The tested layer's pre-activations, from its context on the CPU backend (routed rows one per
    slot t * k + j): ((gate_routed, up_routed), (gate_shared, up_shared))."""
    assert ctx.gate_routed.device.type == "cpu"
    shared = (ctx.gate_shared, ctx.up_shared) if ctx.gate_shared is not None else None
    return (ctx.gate_routed, ctx.up_routed), shared


def f64_layer(data, weights, limit, branches=None):
    """(out, d_x, d_router_weights, d_gate, d_up, d_down, d_shared...) of the layer in float64 at
    `weights` (routed gate, up, down, shared gate, up, down): per expert, autograd for the
    gradients of <out, d_out>. Shares no code with mok.

    With swiglu_limit the gradient jumps at the clamp's kink (silu's slope on one side, 0 on the
    other), and FP8 rounding (about 5%) moves the few pre-activations near it across: each such
    crossing adds a whole gradient row's error, a heavy tail that put the gate gradient's cosine
    below MoK's 0.996 on 2 of 150 draws at 3x these tests' tokens (2026-12-05, CPU). `branches`
    (branches_of: the tested layer's own pre-activations) makes the reference take the layer's side
    of the kink, after checking that the two sides differ only where FP8 rounding explains it."""
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None
              for t in (data.x, data.router_weights, *weights)]
    x, w, gate, up, down, sg, su, sd = leaves
    routed_taken, shared_taken = branches if branches is not None else (None, None)
    k = data.ids.shape[1]

    def act(name, xe, wg, wu, taken):
        g, u = xe @ wg.T, xe @ wu.T
        if taken is not None and limit is not None:
            with torch.no_grad():
                check_same_side(f"{name} gate", g, taken[0].double(), xe.abs() @ wg.abs().T, limit)
                check_same_side(f"{name} |up|", u.abs(), taken[1].double().abs(),
                                xe.abs() @ wu.abs().T, limit)
        return swiglu(g, u, limit, taken)

    out = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        t, j = (data.ids == e).nonzero(as_tuple=True)
        if len(t):
            xe = x[t]
            slots = (t * k + j).to(routed_taken[0].device) if routed_taken is not None else None
            taken = None if slots is None else (routed_taken[0][slots], routed_taken[1][slots])
            y = act(f"expert {e}", xe, gate[e], up[e], taken) @ down[e].T
            out = out.index_add(0, t, w[t, j].unsqueeze(1) * y)
    if sg is not None:
        out = out + act("shared", x, sg, su, shared_taken) @ sd.T
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad((out * data.d_out.double()).sum(), present))
    return [out.detach()] + [next(grads) if t is not None else None for t in leaves]


def errors(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten, poisoned output?)"
    diff = (got - ref).abs()
    rel = float(diff.sum() / ref.abs().sum().clamp(min=1e-300))
    cosine = float((got * ref).sum() / (got.norm() * ref.norm()).clamp(min=1e-300))
    return float(diff.max()), rel, cosine


def check_moks_bounds(results, refs, what):
    """MoK's MXFP8 bounds on every result (abs max and rel sum on the outputs out and d_x, as
    MoK's tests apply them; rel sum and cosine on every gradient); mok's errors printed."""
    for name, got, ref in zip(RESULTS, results, refs):
        if ref is None:
            assert got is None, name
            continue
        abs_max, rel, cos = errors(got, ref)
        print(f"{what}: {name:16s} abs max {abs_max:.3e} (MoK {ABS_MAX}) rel {rel:.3e} "
              f"(MoK {REL_SUM}) cos {cos:.6f} (MoK {COSINE})")
        if name in ("out", "d_x"):
            assert abs_max <= ABS_MAX, f"{what} {name}: abs max {abs_max}"
        assert rel <= REL_SUM, f"{what} {name}: rel {rel}"
        assert cos >= COSINE, f"{what} {name}: cosine {cos}"


def bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float8_e4m3fn) else t


def assert_bitwise(name, got, want):
    if want is None:
        assert got is None, name
        return
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(bits(got), bits(want)), f"{name}: not bitwise equal"


def setup(data):
    T, H = data.x.shape
    k = data.ids.shape[1]
    config = functional.MoKConfig()
    ws = functional.create_workspace(config, None, device=data.x.device, num_local_tokens=T,
                                     hidden_size=H, topk=k)
    schedule = functional.build_schedule(ws, config, data.ids, num_local_experts=data.E)
    return config, ws, schedule


def functional_mx(data, mx, limit):
    """MoK's call sequence with MX tuples: (out, ctx, 8 gradients)."""
    (g, gs, gt, gts), (u, us, ut, uts), (d, ds, dt, dts) = mx
    sg, su, sd = data.weights[3:]
    config, ws, schedule = setup(data)
    out, ctx = functional.forward(config, ws, schedule, data.x, data.router_weights, sg, su, sd,
                                  (g, gs), (u, us), (d, ds), limit)
    grads = functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                data.router_weights, sg, su, sd, (g, gs, gt, gts),
                                (u, us, ut, uts), (dt, dts), swiglu_limit=limit)
    return out, ctx, grads


def blocks_of(fp8, sc):
    """mok's blocks of an MX weight, (data, scales, data_t, scales_t), by the conversion op."""
    both, scales, scales_t, _count = mok.ops.mx_weights_to_blocks(fp8, sc)
    E, N, K = fp8.shape
    return both[0].view(E, N, K), scales, both[1].view(E, K, N), scales_t


def direct_fp8_layer(data, mx, limit):
    """The FP8 layer's ops on the converted blocks, the bf16 weights as the master weights:
    forward with every weight's normal pair; backward with gate's and up's normal pairs and the
    transposed pair of down converted as a weight [E, I, H] and its orientations swapped."""
    (g, gs, _, _), (u, us, _, _), (d, ds, dt, dts) = mx
    gate, up, down = blocks_of(g, gs), blocks_of(u, us), blocks_of(d, ds)
    down_t = blocks_of(dt, dts)
    # The C++ guarantee the swap rests on: a conversion's data_t is its data transposed.
    assert torch.equal(bits(down_t[2]), bits(down_t[0]).transpose(1, 2))
    down_swapped = (down_t[2], down_t[3], down_t[0], down_t[1])
    ids, w, weights = data.ids, data.router_weights, data.weights
    out, *context = _fp8_layer.forward_fp8(data.x, ids, w, *weights, *gate, *up, *down, 0,
                                           swiglu_limit=limit)
    grads = _fp8_layer.backward_fp8(data.d_out, data.x, ids, w, *weights, *gate, *up,
                                    *down_swapped, *context, 0, swiglu_limit=limit)
    grads = list(grads)
    if weights[3] is None:
        grads[5:] = [None, None, None]
    return out, context, grads


SHAPES = [pytest.param((77, 256, 128, 4, 3, 0), id="no-shared"),
          pytest.param((77, 256, 128, 4, 3, 128), id="shared"),
          pytest.param((97, 128, 256, 6, 2, 256), id="wide-I")]


# A clamped SwiGLU's limit (MoK's swiglu_limit) that binds on a few of these inputs' pre-
# activations (g and u have a standard deviation of about 0.6 here; the test checks that some are
# clamped). The references take the layer's side of the clamp's kink (f64_layer's `branches`).
LIMIT = 2.0


@pytest.mark.parametrize("limit", [None, LIMIT], ids=["swiglu", "swiglu_limit"])
@pytest.mark.parametrize("shape", SHAPES)
def test_functional_mx_forms_are_the_fp8_layer_on_the_converted_blocks(gen, shape, limit):
    T, H, I, E, k, S = shape
    data = make_data(gen, T, H, I, E, k, S)
    mx = mx_tuples(data)
    out, ctx, grads = functional_mx(data, mx, limit)
    if limit is not None:  # the context keeps g and u unclamped: the limit binds on some
        used = data.ids.reshape(-1) >= 0
        g, u = ctx.gate_routed[used].float(), ctx.up_routed[used].float()
        clamped = int((g > limit).sum() + (u.abs() > limit).sum())
        print(f"routed pre-activations the limit clamps: {clamped} of {g.numel() + u.numel()}")
        assert clamped > 0
    # (a) bitwise: the FP8 layer's ops on the blocks, each weight in the orientation said above.
    want_out, want_ctx, want_grads = direct_fp8_layer(data, mx, limit)
    assert_bitwise("out", out, want_out)
    # The context's routed rows (CPU: one per slot t * k + j; unused slots' rows are never
    # written nor read) and its shared ones.
    used = data.ids.reshape(-1) >= 0
    for name, got, want in zip(("x_routed", "gate_routed", "up_routed", "hidden_routed"),
                               ctx._ops_args(), want_ctx):
        assert got.shape == want.shape, name
        if got.shape[0]:
            assert_bitwise(f"context.{name}", got[used], want[used])
    for name, got, want in zip(("gate_shared", "up_shared", "hidden_shared"),
                               ctx._ops_args()[4:], want_ctx[4:]):
        assert_bitwise(f"context.{name}", got, want if S else None)
    assert len(grads) == 8
    for name, got, want in zip(RESULTS[1:], grads, want_grads):
        assert_bitwise(name, got, want)
    assert grads[2].dtype == torch.bfloat16 and grads[4].shape == (E, H, I)
    # (b) MoK's bounds against the float64 layer of the MX weights' values and of the bf16 ones.
    dequantized = [mx_dequantized(fp8, sc) for fp8, sc, _, _ in mx]
    results = [out, *grads]
    taken = branches_of(data, ctx)
    check_moks_bounds(results, f64_layer(data, (*dequantized, *data.weights[3:]), limit, taken),
                      "vs the f64 layer of the MX values")
    check_moks_bounds(results, f64_layer(data, data.weights, limit, taken),
                      "vs the f64 layer of the bf16 values")
    counts = [int(mok.ops.mx_weights_to_blocks(fp8, sc)[3]) for fp8, sc, _, _ in mx]
    print(f"values the conversion to 128x128 blocks changed (gate, up, down): {counts} of "
          f"{[w.numel() for w in data.weights[:3]]}")


@pytest.mark.parametrize("limit", [None, LIMIT], ids=["swiglu", "swiglu_limit"])
def test_functional_mx_forms_are_bitwise_run_to_run(gen, limit):
    data = make_data(gen, 51, 128, 128, 3, 2, 128)
    mx = mx_tuples(data)
    a = functional_mx(data, mx, limit)
    b = functional_mx(data, [tuple(t.clone() for t in w) for w in mx], limit)  # converted again
    assert_bitwise("out", a[0], b[0])
    for name, x, y in zip(RESULTS[1:], a[2], b[2]):
        assert_bitwise(name, x, y)


@pytest.mark.parametrize("S", [0, 128], ids=["no-shared", "shared"])
def test_recompute_forward_context_is_forwards_context(gen, S):
    """recompute_forward_context with MX tuples (gate and up (fp8, sc)): forward's context bit for
    bit (the rows forward writes), and backward from it gives the same gradients."""
    data = make_data(gen, 61, 256, 128, 4, 3, S)
    mx = mx_tuples(data)
    (g, gs, gt, gts), (u, us, ut, uts), (d, ds, dt, dts) = mx
    sg, su, sd = data.weights[3:]
    config, ws, schedule = setup(data)
    limit = LIMIT
    out, ctx = functional.forward(config, ws, schedule, data.x, data.router_weights, sg, su, sd,
                                  (g, gs), (u, us), (d, ds), limit)
    again = functional.recompute_forward_context(config, ws, schedule, data.x, sg, su, (g, gs),
                                                 (u, us), limit)
    used = data.ids.reshape(-1) >= 0
    for name in ("gate_routed", "up_routed", "hidden_routed"):
        assert_bitwise(name, getattr(again, name)[used], getattr(ctx, name)[used])
    for name in ("gate_shared", "up_shared", "hidden_shared"):
        assert_bitwise(name, getattr(again, name), getattr(ctx, name))
    assert again.origin.call == "recompute_forward_context"

    def grads(context):
        return functional.backward(config, ws, schedule, context, data.d_out, data.x,
                                   data.router_weights, sg, su, sd, (g, gs, gt, gts),
                                   (u, us, ut, uts), (dt, dts), swiglu_limit=limit)

    for name, x, y in zip(RESULTS[1:], grads(again), grads(ctx)):
        assert_bitwise(name, x, y)
    with pytest.raises(ValueError, match=r"invalid swiglu_limit: expected 2.0 \(the swiglu_limit "
                                         r"of the recompute_forward_context"):
        functional.backward(config, ws, schedule, again, data.d_out, data.x,
                            data.router_weights, sg, su, sd, (g, gs, gt, gts), (u, us, ut, uts),
                            (dt, dts))


def test_main_grads_are_the_gradients_in_fp32(gen):
    """backward(main_grads=...) with MX tuples adds the weight gradients into fp32 main grads,
    unrounded: into zeros, each is the fp32 value the bf16 gradient is rounded from (bitwise
    equal once rounded), and a second backward doubles it exactly; MoK's return structure (the
    main grads in the gradients' places)."""
    data = make_data(gen, 53, 256, 128, 4, 3, 128)
    mx = mx_tuples(data)
    (g, gs, gt, gts), (u, us, ut, uts), (d, ds, dt, dts) = mx
    sg, su, sd = data.weights[3:]
    _, _, grads = functional_mx(data, mx, None)
    config, ws, schedule = setup(data)
    out, ctx = functional.forward(config, ws, schedule, data.x, data.router_weights, sg, su, sd,
                                  (g, gs), (u, us), (d, ds))
    order = (5, 2, 6, 3, 7, 4)  # MoK's main_grads order in the gradients' places
    main = tuple(torch.zeros(grads[i].shape) for i in order)

    def backward():
        return functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                   data.router_weights, sg, su, sd, (g, gs, gt, gts),
                                   (u, us, ut, uts), (dt, dts), main_grads=main)

    got = backward()
    assert_bitwise("d_x", got[0], grads[0])
    assert_bitwise("d_router_weights", got[1], grads[1])
    for i, m in zip(order, main):
        assert got[i] is m and m.dtype == torch.float32
        assert_bitwise(RESULTS[i + 1], m.bfloat16(), grads[i])
    once = [m.clone() for m in main]
    backward()
    for i, m, m1 in zip(order, main, once):
        assert torch.equal(m, 2 * m1), RESULTS[i + 1]
    with pytest.raises(ValueError, match=r"invalid main_routed_gate.shape"):
        functional.backward(config, ws, schedule, ctx, data.d_out, data.x, data.router_weights,
                            sg, su, sd, (g, gs, gt, gts), (u, us, ut, uts), (dt, dts),
                            main_grads=(main[0], main[1][:1], *main[2:]))
    # The op's fake implementation (torch.compile's view of it).
    blocks = [t for fp8, sc in ((g, gs), (u, us), (dt, dts)) for t in blocks_of(fp8, sc)]
    blocks[8:] = blocks[10], blocks[11], blocks[8], blocks[9]  # down from its transposed pair
    torch.library.opcheck(torch.ops.mok.backward_main_grad_fp8.default,
                          (data.d_out, data.x, data.ids, data.router_weights, *data.weights,
                           *blocks, main[1], main[3], main[5], main[0], main[2], main[4],
                           *ctx._ops_args(), ws.handle_for(config), None),
                          test_utils=("test_faketensor",))


# ---------------------------------------------------------------------------------------------
# MoK's ops
# ---------------------------------------------------------------------------------------------

class OneRankBuffers:
    """What MoK's functional code hands its ops at one rank (MoKWorkspace's buffers)."""

    def __init__(self, data):
        T, H = data.x.shape
        k = data.ids.shape[1]
        dev = data.x.device
        self.x_buffer = data.x.clone()
        self.combine_buffer = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16,
                                         device=dev)
        self.d_y_buffer = data.d_out.clone()
        self.d_x_routed_buffer = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16,
                                            device=dev)
        self.router_weight_buffer = data.router_weights.clone()
        self.d_router_weight_buffer = torch.full((T, k), float("nan"), device=dev)
        self._ptrs = {name: [t.data_ptr()] for name, t in vars(self).items()}

    def ptrs(self, name):
        return self._ptrs[name]


def moks_schedule(data, ops=torch.ops.mok):
    T, k = data.ids.shape
    topk_all = data.ids.to(torch.int32).unsqueeze(0)
    return ops.schedule(topk_all, data.E, T * k, 0)


def ops_forward(b, data, mx, schedule, limit, ops=torch.ops.mok):
    """MoK's MXFP8 forward sequence at one rank: the fused op, then fwd_epilogue."""
    (g, gs, _, _), (u, us, _, _), (d, ds, _, _) = mx
    sg, su, sd = data.weights[3:]
    k = data.ids.shape[1]
    outs = ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(
        b.x_buffer, b.ptrs("x_buffer"), b.combine_buffer, b.ptrs("combine_buffer"), sg, g, gs,
        su, u, us, sd, d, ds, *schedule, k, limit, 40, 131072, 4096)
    out = ops.fwd_epilogue(outs[11], b.combine_buffer, b.router_weight_buffer,
                           data.ids.to(torch.int32))
    return out, outs


def ops_backward(b, data, mx, schedule, outs, limit, ops=torch.ops.mok):
    """MoK's MXFP8 backward sequence: the context places of the forward op passed unchanged."""
    (g, gs, gt, gts), (u, us, ut, uts), (_, _, dt, dts) = mx
    sg, su, sd = data.weights[3:]
    k = data.ids.shape[1]
    (x_fp8_t, x_sc_t, gate_shared, gate_fp8, gate_sc, up_shared, up_fp8, up_sc, hidden_shared,
     hidden_fp8_t, hidden_sc_t, _, _) = outs
    grads = ops.dispatch_mlp_swiglu_combine_bwd_mxfp8(
        b.d_y_buffer, b.ptrs("d_y_buffer"), b.d_x_routed_buffer, b.ptrs("d_x_routed_buffer"),
        b.router_weight_buffer, b.ptrs("router_weight_buffer"), b.d_router_weight_buffer,
        b.ptrs("d_router_weight_buffer"), sg, gt, gts, su, ut, uts, sd, dt, dts, x_fp8_t,
        x_sc_t, gate_shared, gate_fp8, gate_sc, up_shared, up_fp8, up_sc, hidden_shared,
        hidden_fp8_t, hidden_sc_t, b.x_buffer, b.ptrs("x_buffer"), g, gs, u, us, *schedule, k,
        limit, 28, 131072, 4096)
    d_x = ops.bwd_epilogue(grads[0], b.d_x_routed_buffer)
    d_sg, d_g, d_su, d_u, d_sd, d_d = grads[12:]
    return grads, (d_x, b.d_router_weight_buffer, d_g, d_u, d_d, d_sg, d_su, d_sd)


@pytest.mark.parametrize("limit", [None, LIMIT], ids=["swiglu", "swiglu_limit"])
def test_ops_mx_forms_match_the_functional_mx_forms(gen, limit):
    """MoK's op sequence with MX weights at one rank against mok.functional with the same tuples:
    every routed row goes through the same FP8 layer (each slot a token of its own, in the same
    row order per expert, so the same token-axis blocks): the per-slot router-weight gradients and
    the weight gradients are the same bits; out and d_x are rounded in another order (the
    epilogues), so within a few bf16 steps; MoK's bounds against the f64 layer."""
    data = make_data(gen, 45, 256, 128, 4, 3, 128)
    mx = mx_tuples(data)
    out_f, ctx_f, grads_f = functional_mx(data, mx, limit)
    b = OneRankBuffers(data)
    schedule = moks_schedule(data)
    out, outs = ops_forward(b, data, mx, schedule, limit, ops=mok.ops)  # mok.ops: the same ops
    raw, grads = ops_backward(b, data, mx, schedule, outs, limit)
    for name, got, want in zip(RESULTS[2:], grads[1:], grads_f[1:]):
        assert_bitwise(name, got, want)
    for name, got, want in (("out", out, out_f), ("d_x", grads[0], grads_f[0])):
        bound = 4 * 2.0**-8 * float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= bound, name
    # The ops' weight gradients are the functional forms' bits: the same sides of the kink.
    check_moks_bounds([out, *grads], f64_layer(data, data.weights, limit,
                                               branches_of(data, ctx_f)),
                      "ops vs the f64 layer of the bf16 values")
    # MoK's places: 13 forward outputs, 18 backward ones; what mok does not produce is empty.
    assert len(outs) == 13 and len(raw) == 18
    assert outs[1].dtype == torch.uint8 and outs[1].shape[0] == 0
    assert raw[3].dtype == torch.float8_e4m3fn and raw[3].shape == (0, 128)
    assert raw[10].dtype == torch.float8_e4m3fn and raw[11].shape == (0, 2, 32, 16)
    # combine_buffer: each used slot's unweighted expert output (unused slots zero).
    used = (data.ids >= 0).reshape(-1)
    assert torch.isfinite(b.combine_buffer.float()).all()
    assert (b.combine_buffer[~used] == 0).all()


def test_ops_mx_forms_under_torch_compile(gen):
    data = make_data(gen, 37, 128, 128, 4, 2, 128)
    mx = mx_tuples(data)
    schedule = moks_schedule(data)

    def step(b):
        out, outs = ops_forward(b, data, mx, schedule, None)
        _, grads = ops_backward(b, data, mx, schedule, outs, None)
        return out, *grads

    eager_buffers, compiled_buffers = OneRankBuffers(data), OneRankBuffers(data)
    want = step(eager_buffers)
    got = torch.compile(step, fullgraph=True)(compiled_buffers)
    for name, g, w in zip(RESULTS, got, want):
        assert_bitwise(name, g, w)
    assert_bitwise("combine_buffer", compiled_buffers.combine_buffer, eager_buffers.combine_buffer)
    (g, gs, _, _) = mx[0]
    # NOTES: opcheck's test_schema cannot run on float8 inputs (PyTorch 2.11's schema check mode
    # multiplies them: "mul_cpu_reduced_float" not implemented for Float8_e4m3fn).
    torch.library.opcheck(torch.ops.mok.mx_weights_to_blocks.default, (g, gs),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_functional_mx_forms_under_torch_compile(gen):
    """Traced (functional's workspace lookup is a graph break, with bf16 weights too), the MX
    path's conversion is part of the graph (mok::mx_weights_to_blocks' fake implementation) and
    no conversion is cached: the same bits as eager."""
    data = make_data(gen, 29, 128, 128, 3, 2, 0)
    mx = mx_tuples(data)
    config, ws, schedule = setup(data)
    (g, gs, _, _), (u, us, _, _), (d, ds, _, _) = mx

    def fwd(x):
        return functional.forward(config, ws, schedule, x, data.router_weights, None, None, None,
                                  (g, gs), (u, us), (d, ds))

    got, ctx = torch.compile(fwd)(data.x)
    assert ctx.origin is None  # made while tracing: the MX path was traced
    assert g not in _mx_calls._CACHE
    want, _ = fwd(data.x)
    assert_bitwise("out", got, want)
    assert g in _mx_calls._CACHE


# ---------------------------------------------------------------------------------------------
# The conversion cache
# ---------------------------------------------------------------------------------------------

def test_mx_weights_over_shared_memory_are_converted_every_call(gen):
    """MX data held in memory another tensor also holds (FSDP2's unsharded parameters over its
    all-gather buffer) can change with its version counter and address unmoved: converted on
    every call, so the conversion follows a change made through the other tensor."""
    data = make_data(gen, 41, 128, 128, 3, 2, 0)
    g, gs, _gt, _gts = mx_tuples(data)[0]
    buffer = g.detach().clone().reshape(-1)
    shared = torch.nn.Parameter(buffer.view(g.shape), requires_grad=False)
    first = _mx_calls.converted(shared, gs)
    assert shared not in _mx_calls._CACHE
    state = (shared._version, shared.data_ptr())
    w2 = data.weights[0] * -1.5
    new_data, new_scales = mok.ops.mxfp8_quantize(w2, True, False)[:2]
    buffer.data.copy_(new_data.reshape(-1))  # unseen by shared's version counter
    assert (shared._version, shared.data_ptr()) == state
    got = _mx_calls.converted(shared, gs)
    want = _mx_calls.converted(new_data.clone(), gs.clone())
    for x, y in zip(got.blocks, want.blocks):
        assert torch.equal(bits(x), bits(y))
    assert not torch.equal(bits(first.blocks[0]), bits(got.blocks[0]))


def test_conversions_are_cached_per_weight_version(gen, monkeypatch):
    """Each MX weight is converted once per version: a step's forward and backward convert gate,
    up and down (normal) and down (transposed) once; the next step with the same tensors converts
    nothing; an in-place change (a new version) converts that weight again, and the layer then
    computes what it computes from fresh tensors (a stale conversion fails here)."""
    data = make_data(gen, 41, 128, 128, 3, 2, 0)
    mx = mx_tuples(data)
    made = []
    convert = _mx_calls._convert
    monkeypatch.setattr(_mx_calls, "_convert",
                        lambda *a: made.append(a[2]) or convert(*a))
    first = functional_mx(data, mx, None)
    assert made == [False, False, False, True], made
    made.clear()
    again = functional_mx(data, mx, None)
    assert made == [], made
    assert_bitwise("out", again[0], first[0])

    # In place: the gate's data (version counter bumped); the up weight's scales.
    g, gs, gt, gts = mx[0]
    w2 = data.weights[0] * -1.5
    g.copy_(mok.ops.mxfp8_quantize(w2, True, False)[0])
    gs.copy_(mok.ops.mxfp8_quantize(w2, True, False)[1])
    mx[1][1].copy_(mx[1][1] + 1)  # every E8M0 exponent up by one: up doubles
    changed = functional_mx(data, mx, None)
    assert made == [False, False], made  # gate and up again; down is unchanged
    fresh = functional_mx(data, [tuple(t.clone() for t in w) for w in mx], None)
    assert_bitwise("out", changed[0], fresh[0])
    for name, x, y in zip(RESULTS[1:], changed[2], fresh[2]):
        assert_bitwise(name, x, y)
    assert not torch.equal(bits(changed[0]), bits(first[0]))  # the change reached the layer

    # Another scales tensor with the same data, and the same tensors again.
    made.clear()
    other = mx[1][1].clone()
    assert _mx_calls.converted(mx[1][0], other) is not _mx_calls.converted(mx[1][0], mx[1][1])
    assert _mx_calls.converted(mx[1][0], mx[1][1]) is _mx_calls.converted(mx[1][0], mx[1][1])
    assert made == [False, False], made


# ---------------------------------------------------------------------------------------------
# Bad arguments
# ---------------------------------------------------------------------------------------------

def test_bad_mx_tuples_name_the_argument(gen):
    data = make_data(gen, 9, 256, 128, 2, 2, 0)  # gate [2, 128, 256], down [2, 256, 128]
    mx = mx_tuples(data)
    (g, gs, gt, gts), (u, us, ut, uts), (d, ds, dt, dts) = mx
    config, ws, schedule = setup(data)

    def fwd(gate=(g, gs), up=(u, us), down=(d, ds), x=data.x):
        return functional.forward(config, ws, schedule, x, data.router_weights, None, None, None,
                                  gate, up, down)

    out, ctx = fwd()

    def bwd(gate=(g, gs, gt, gts), up=(u, us, ut, uts), down=(dt, dts), context=ctx, **kw):
        return functional.backward(config, ws, schedule, context, data.d_out, data.x,
                                   data.router_weights, None, None, None, gate, up, down, **kw)

    cases = [
        (lambda: fwd(gate=(g, gs, gt)), ValueError,
         r"invalid len\(routed_gate_weights\): expected 2: the MXFP8 tuple \(fp8, sc\), got 3"),
        (lambda: fwd(up=data.weights[1]), TypeError,
         r"invalid routed_up_weights: expected an MXFP8 tuple \(fp8, sc\), as the other"),
        (lambda: fwd(gate=(data.weights[0], gs)), TypeError,
         r"invalid routed_gate_weights\[0\].dtype: expected float8_e4m3fn, got bfloat16"),
        (lambda: fwd(down=(d, ds.view(torch.int8))), TypeError,
         r"invalid routed_down_weights\[1\].dtype: expected uint8"),
        (lambda: fwd(down=(d.transpose(1, 2).contiguous(), ds)), ValueError,
         r"invalid routed_down_weights\[0\].shape: expected \[2, 256, 128\], got "
         r"\[2, 128, 256\]"),
        (lambda: fwd(up=(u, us.reshape(2 * 128, 8))), ValueError,  # [E * N, K / 32]: not MoK's
         r"invalid routed_up_weights\[1\].shape: expected \[2, 2, 32, 16\] \(MoK's scale "
         r"layout"),
        (lambda: fwd(gate=(g[:, :64], gs)), ValueError,
         r"invalid routed_gate_weights\[0\].shape\[1\]: expected a positive multiple of 128"),
        (lambda: fwd(gate=(g.transpose(1, 2).contiguous().transpose(1, 2), gs)), ValueError,
         r"invalid routed_gate_weights\[0\].strides"),
        (lambda: fwd(x=data.x.double()), TypeError,
         r"invalid x.dtype: expected bfloat16 with MXFP8 weights"),
        (lambda: bwd(gate=(g, gs)), ValueError,
         r"invalid len\(routed_gate_weights\): expected 4: the MXFP8 tuple \(fp8, sc, fp8_t, "
         r"sc_t\), got 2"),
        (lambda: bwd(down=(d, ds)), ValueError, r"invalid routed_down_weights\[0\].shape: "
         r"expected \[2, 128, 256\], got \[2, 256, 128\]"),
        (lambda: bwd(up=(u, us, ut, gts[:1])), ValueError,
         r"invalid routed_up_weights\[3\].shape"),
        (lambda: bwd(main_grads=(None,) * 5), ValueError,
         r"invalid main_grads: expected a tuple of 6 tensors .*, got a tuple of 5$"),
        # A context made with bf16 weights, and the other way round.
        (lambda: bwd(context=functional.forward(
            config, ws, schedule, data.x, data.router_weights, None, None, None,
            *data.weights[:3])[1]), ValueError,
         r"invalid forward_context: expected the context of a forward with mxfp8 weights, got "
         r"the context of a forward with bf16 weights"),
        (lambda: functional.backward(config, ws, schedule, ctx, data.d_out, data.x,
                                     data.router_weights, None, None, None, *data.weights[:3]),
         ValueError, r"invalid forward_context: expected the context of a forward with bf16 "
         r"weights, got the context of a forward with mxfp8 weights"),
        # A context of other MX weights.
        (lambda: bwd(gate=(g.clone(), gs, gt, gts)), ValueError,
         r"invalid routed_gate_weights\[0\]: expected the routed_gate_weights\[0\] of the "
         r"forward"),
        (lambda: functional.recompute_forward_context(config, ws, schedule, data.x, None, None,
                                                      (g, gs, gt, gts), (u, us)), ValueError,
         r"invalid len\(routed_gate_weights\): expected 2"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    # The process goes on: the next good calls work.
    again, ctx2 = fwd()
    assert_bitwise("out", again, out)
    assert all(torch.isfinite(t.float()).all() for t in bwd(context=ctx2) if t is not None)


def test_bad_mx_op_arguments_name_the_argument(gen):
    data = make_data(gen, 9, 128, 128, 2, 2, 128)
    mx = mx_tuples(data)
    (g, gs, gt, gts), (u, us, ut, uts), (d, ds, dt, dts) = mx
    sg, su, sd = data.weights[3:]
    b = OneRankBuffers(data)
    schedule = moks_schedule(data)
    fwd = torch.ops.mok.dispatch_mlp_swiglu_combine_fwd_mxfp8

    def call(**change):
        args = dict(x=b.x_buffer, x_ptrs=b.ptrs("x_buffer"), combine_buffer=b.combine_buffer,
                    combine_buffer_ptrs=b.ptrs("combine_buffer"), w_shared_gate=sg,
                    w_routed_gate=g, w_routed_gate_sc=gs, w_shared_up=su, w_routed_up=u,
                    w_routed_up_sc=us, w_shared_down=sd, w_routed_down=d, w_routed_down_sc=ds,
                    schedule_peer_rank=schedule[0], schedule_peer_token_idx=schedule[1],
                    num_tokens=schedule[2], tokens_per_expert=schedule[3], topk=2,
                    swiglu_limit=None, num_comm_sms=40, macrobatch_size=131072,
                    minibatch_size=4096)
        args.update(change)
        return fwd(**args)

    with pytest.raises(ValueError, match=r"invalid w_routed_gate_sc.shape: expected "
                                         r"\[2, 1, 32, 16\]"):
        call(w_routed_gate_sc=gts[:1])
    with pytest.raises(TypeError, match=r"invalid w_routed_down.dtype: expected float8_e4m3fn"):
        call(w_routed_down=data.weights[2])
    with pytest.raises(ValueError, match=r"invalid w_routed_down.shape: expected \[2, 128, 128\]"):
        call(w_routed_down=d[:1])
    with pytest.raises(ValueError, match=r"invalid len\(x_ptrs\)"):
        call(x_ptrs=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="swiglu_limit"):
        call(swiglu_limit=0.0)
    outs = call()  # the next good call works
    with pytest.raises(ValueError, match=r"invalid w_routed_down_T.shape: expected "
                                         r"\[2, 128, 128\]"):
        ops_backward(b, data, [mx[0], mx[1], (d, ds, dt[:1], dts)], schedule, outs, None)
    assert torch.isfinite(ops_backward(b, data, mx, schedule, outs, None)[1][0].float()).all()


# ---------------------------------------------------------------------------------------------
# On the GPU: MoK's shapes scaled to one GPU
# ---------------------------------------------------------------------------------------------

# (T, H, I, E, k, S): MoK's models' H, I, k and shared expert, odd T, 16-32 local experts (what
# one GPU holds of them at EP 8 or more).
GPU_SHAPES = {
    "kimi-k2-like": (4095, 7168, 2048, 16, 8, 2048),  # E 384, k 8
    "qwen3.5-like": (4097, 4096, 1024, 32, 10, 1024),  # E 512, k 10
    "dsv4-pro-like": (2047, 4096, 3072, 16, 6, 3072),  # k 6
}


# No swiglu_limit here: MoK's 7.0 is 12 standard deviations of these pre-activations and never
# binds (a case that cannot fail); the CUDA FP8 layer's clamp at a binding limit is
# test_fp8_layer.py's test_cuda_clamped_swiglu_matches_the_cpu_fp8_layer.
@requires_cuda
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_cuda_functional_mx_forms(gen, shape):
    limit = None
    T, H, I, E, k, S = GPU_SHAPES[shape]
    data = make_data(gen, T, H, I, E, k, S).to("cuda")
    mx = mx_tuples(data)
    out, _ctx, grads = functional_mx(data, mx, limit)
    want_out, _, want_grads = direct_fp8_layer(data, mx, limit)
    assert_bitwise("out", out, want_out)
    for name, got, want in zip(RESULTS[1:], grads, want_grads):
        assert_bitwise(name, got, want)
    check_moks_bounds([out, *grads], f64_layer(data, data.weights, limit),
                      f"{shape} vs the f64 layer of the bf16 values")


@requires_cuda
def test_cuda_ops_mx_forms(gen):
    T, H, I, E, k, S = GPU_SHAPES["qwen3.5-like"]
    data = make_data(gen, 1023, H, I, E, k, S).to("cuda")
    mx = mx_tuples(data)
    b = OneRankBuffers(data)
    schedule = moks_schedule(data)
    out, outs = ops_forward(b, data, mx, schedule, None)
    _, grads = ops_backward(b, data, mx, schedule, outs, None)
    check_moks_bounds([out, *grads], f64_layer(data, data.weights, None),
                      "ops vs the f64 layer of the bf16 values")
    out_f, _, grads_f = functional_mx(data, mx, None)
    for name, got, want in zip(RESULTS[2:], grads[1:], grads_f[1:]):
        assert_bitwise(name, got, want)
