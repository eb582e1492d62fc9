"""Argument checks shared by the real and the fake (meta) implementations of mok's ops.

They run on tensor metadata only (dtype, shape, strides, device), so they also run while
torch.compile traces with fake tensors, and never read data (no host synchronization). Messages
follow mok's C++ format, ``mok: invalid <argument>: expected <what>, got <what>``: a dtype problem
raises TypeError, every other problem (shape, strides, device, a value) ValueError. The C++ core
repeats its own checks behind these (and owns the data-dependent one, expert ids in [-1, E)).
"""

import math
import numbers
from dataclasses import dataclass

import torch

from mok import _native
from mok._native import dtype_name  # the extension's dtype names are also the messages'

# Activation dtypes: bf16 (every backend) and float64 (the CPU backend's exact mode).
ACTIVATION_DTYPES = (torch.bfloat16, torch.float64)


def fail(argument, expected, actual, error=ValueError):
    raise error(f"mok: invalid {argument}: expected {expected}, got {actual}")


INT64_MAX = 2**63 - 1  # the C++ core's sizes are int64


def check_int(name, value, *, minimum, maximum=INT64_MAX):
    """An int (or an integer type with __index__, not a bool) in [minimum, maximum]; returns it
    as an int. A bool is refused: True is not a size."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(name, "an int", f"{type(value).__name__} {value!r}", TypeError)
    value = int(value)
    if value < minimum:
        fail(name, "a positive int" if minimum == 1 else f"an int >= {minimum}", value)
    if value > maximum:
        fail(name, f"an int in [{minimum}, {maximum}]", value)
    return value


def check_real(name, value, *, minimum=0.0, inclusive=False):
    """A finite real number (int or float, not a bool) above `minimum` (or at least it, with
    `inclusive`); returns it as a float."""
    relation = f">= {minimum}" if inclusive else f"> {minimum}"
    expected = f"a finite number {relation}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, expected, f"{type(value).__name__} {value!r}", TypeError)
    real = float(value)
    if not (math.isfinite(real) and (real >= minimum if inclusive else real > minimum)):
        fail(name, expected, repr(value))
    return real


def check_swiglu_limit(value):
    """MoK's swiglu_limit: None, or a finite positive real number (int or float; not bool);
    returns it as a float. mok refuses 0, inf and NaN, which MoK's own check lets through."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail("swiglu_limit", "None or a finite positive number", repr(value), TypeError)
    limit = float(value)
    if not (math.isfinite(limit) and limit > 0):
        fail("swiglu_limit", "None or a finite positive number", repr(value))
    return limit


def device_name(device):
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    return str(device)


def shape_text(shape):
    return "[" + ", ".join(str(s) for s in shape) + "]"


def autocast_bf16(device_type, name="autocast dtype"):
    """Whether torch.autocast is on for `device_type`. Its dtype must be bf16, what mok's layer
    computes in: another raises mok's error naming `name`."""
    if not torch.is_autocast_enabled(device_type):
        return False
    dtype = torch.get_autocast_dtype(device_type)
    if dtype != torch.bfloat16:
        fail(name, "torch.bfloat16 (mok's layer computes in bf16)", str(dtype), TypeError)
    return True


def router_dtype(activation_dtype):
    """The dtype of router weights (and their gradient) for an activation dtype."""
    return torch.float64 if activation_dtype == torch.float64 else torch.float32


def require_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__, TypeError)


def check_tensor(name, t, dtype, shape, device):
    """dtype, then device, then shape, then strides: the order of mok's C++ checks."""
    require_tensor(name, t)
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        fail(f"{name}.dtype", " or ".join(dtype_name(d) for d in dtypes), dtype_name(t.dtype),
             TypeError)
    if t.device != device:
        fail(f"{name}.device", device_name(device), device_name(t.device))
    if t.dim() != len(shape) or any(a != b for a, b in zip(t.shape, shape)):
        fail(f"{name}.shape", shape_text(shape), shape_text(t.shape))
    if not t.is_contiguous():
        fail(f"{name}.strides", "row-major contiguous strides", shape_text(t.stride()))


def row_strided(t, cuda):
    """Whether `t` [E, R, C] is a row-strided view mok reads in place (src/core/validate.cpp):
    unit column stride, rows that do not overlap (row stride >= C, expert stride >= R * row
    stride); on CUDA also the row stride a multiple of 8 that divides the expert stride (the
    tensor maps' geometry). E.g. the gate and up halves of one [E, 2I, H] tensor."""
    E, R, C = t.shape
    expert, row, col = t.stride()
    ok = (col == 1 or C == 1) and (row >= C or R == 1) and (expert >= R * row or E == 1)
    if cuda:
        ok = ok and row > 0 and row % 8 == 0 and (E == 1 or expert % row == 0)
    return ok


def check_weight_tensor(name, t, dtype, shape, device, *, strided):
    """A routed weight (or weight gradient) [E, R, C]: check_tensor's checks, where `strided`
    also accepts a row-strided view (row_strided), in mok's C++ wording."""
    if not strided or not isinstance(t, torch.Tensor) or t.dim() != 3 or t.is_contiguous():
        check_tensor(name, t, dtype, shape, device)
        return
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        fail(f"{name}.dtype", " or ".join(dtype_name(d) for d in dtypes), dtype_name(t.dtype),
             TypeError)
    if t.device != device:
        fail(f"{name}.device", device_name(device), device_name(t.device))
    if any(a != b for a, b in zip(t.shape, shape)):
        fail(f"{name}.shape", shape_text(shape), shape_text(t.shape))
    cuda = device.type == "cuda"
    if not row_strided(t, cuda):
        R, C = shape[1], shape[2]
        fail(f"{name}.strides", "row-major contiguous strides, or row-strided ones: [expert, row, "
             f"1] with row >= {C} and expert >= {R} * row"
             + (", row a multiple of 8 that divides expert (CUDA)" if cuda else ""),
             shape_text(t.stride()))


def check_packed_gate_up(gate_up):
    """Packed gate/up weights [E, 2I, H] (mok.moe_packed): a tensor of three dimensions with an
    even middle one (dtype, device and strides are checked on its halves)."""
    require_tensor("gate_up_weights", gate_up)
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        fail("gate_up_weights.shape", "[num_experts, 2 * intermediate_size, hidden_size]",
             shape_text(gate_up.shape))


@dataclass(frozen=True)
class LayerShape:
    """The problem one call describes (its sizes, dtypes and device), read off its tensors."""

    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int  # local experts (the CPU backend holds them all)
    topk: int
    shared_intermediate_size: int
    activation_dtype: torch.dtype
    device: torch.device

    @property
    def has_shared_expert(self):
        return self.shared_intermediate_size > 0


def _static(value, stand_in):
    """A plain int for mok's C++ validation; `stand_in` for a symbolic size (checked at run
    time)."""
    return int(value) if not isinstance(value, torch.SymInt) else stand_in


def check_layer(x, topk_experts, topk_weights, gate, up, down, shared_gate, shared_up,
                shared_down, *, with_topk_weights=True, with_down=True, ep_size=1):
    """Checks one layer call's inputs and weights; returns its LayerShape. Without
    `with_topk_weights` / `with_down` (recompute_forward_context), topk_weights and the down
    weights are not read (pass None). `ep_size`: the ranks of the expert-parallel group (the
    weights hold E / ep_size experts; topk is bounded by E)."""
    require_tensor("x", x)
    if x.dtype not in ACTIVATION_DTYPES:
        fail("x.dtype", "bfloat16 (or float64 on the cpu backend)", dtype_name(x.dtype), TypeError)
    if x.dim() != 2:
        fail("x.shape", "[num_tokens, hidden_size]", shape_text(x.shape))
    act, device = x.dtype, x.device
    T, H = x.shape
    check_tensor("x", x, act, (T, H), device)

    require_tensor("topk_experts", topk_experts)
    if topk_experts.dim() != 2:
        fail("topk_experts.shape", f"[{T}, topk]", shape_text(topk_experts.shape))
    k = topk_experts.shape[1]
    check_tensor("topk_experts", topk_experts, torch.int64, (T, k), device)
    if with_topk_weights:
        check_tensor("topk_weights", topk_weights, router_dtype(act), (T, k), device)

    require_tensor("routed_gate_weights", gate)
    if gate.dim() != 3:
        fail("routed_gate_weights.shape", f"[num_experts, intermediate_size, {H}]",
             shape_text(gate.shape))
    E, I = gate.shape[0], gate.shape[1]
    # Row-strided routed weights are read in place (e.g. the halves of a packed [E, 2I, H] gate/up
    # tensor); the CUDA backend's down projection reads W_down densely, and one tensor-map
    # geometry serves gate and up there.
    check_weight_tensor("routed_gate_weights", gate, act, (E, I, H), device, strided=True)
    check_weight_tensor("routed_up_weights", up, act, (E, I, H), device, strided=True)
    if device.type == "cuda" and (gate.stride(1) != up.stride(1)
                                  or (E > 1 and gate.stride(0) != up.stride(0))):
        fail("routed_up_weights.strides", f"the strides of routed_gate_weights, "
             f"{shape_text(gate.stride())} (the CUDA backend reads both through one geometry)",
             shape_text(up.stride()))
    if with_down:
        check_weight_tensor("routed_down_weights", down, act, (E, H, I), device,
                            strided=device.type == "cpu")

    shared = {"shared_gate_weights": shared_gate, "shared_up_weights": shared_up}
    if with_down:
        shared["shared_down_weights"] = shared_down
    given = [n for n, t in shared.items() if t is not None]
    if given and len(given) != len(shared):
        missing = next(n for n, t in shared.items() if t is None)
        fail(missing, f"a tensor ({given[0]} is given: the shared expert needs all "
             f"{'three' if with_down else 'of gate and up'})", "None")
    S = 0
    if given:
        require_tensor("shared_gate_weights", shared_gate)
        if shared_gate.dim() != 2:
            fail("shared_gate_weights.shape", f"[shared_intermediate_size, {H}]",
                 shape_text(shared_gate.shape))
        S = shared_gate.shape[0]
        check_tensor("shared_gate_weights", shared_gate, act, (S, H), device)
        check_tensor("shared_up_weights", shared_up, act, (S, H), device)
        if with_down:
            check_tensor("shared_down_weights", shared_down, act, (H, S), device)

    # Sizes, alignment (bf16: H, I, S multiples of 64) and topk <= num_experts: mok's own rules.
    _native.lib.validate_problem(
        num_tokens=_static(T, 1), hidden_size=_static(H, 64), intermediate_size=_static(I, 64),
        num_experts=_static(E, _static(k, 1)) * ep_size, topk=_static(k, 1),
        shared_intermediate_size=_static(S, 64 if given else 0), ep_size=ep_size, ep_rank=0,
        activation_dtype=dtype_name(act))
    return LayerShape(T, H, I, E, k, S, act, device)


def check_d_out(d_out, shape: LayerShape):
    check_tensor("d_out", d_out, shape.activation_dtype, (shape.num_tokens, shape.hidden_size),
                 shape.device)


def check_main_grads(shape: LayerShape, grads):
    """fp32 (float64 in the exact mode) weight-gradient buffers that backward accumulates into."""
    wide = router_dtype(shape.activation_dtype)
    E, I, H, S = (shape.num_experts, shape.intermediate_size, shape.hidden_size,
                  shape.shared_intermediate_size)
    expected = {"main_routed_gate": (E, I, H), "main_routed_up": (E, I, H),
                "main_routed_down": (E, H, I), "main_shared_gate": (S, H),
                "main_shared_up": (S, H), "main_shared_down": (H, S)}
    for (name, shp), g in zip(expected.items(), grads):
        if name.startswith("main_shared") and not shape.has_shared_expert:
            if g is not None:
                fail(name, "None (the layer has no shared expert)",
                     f"a tensor {shape_text(g.shape)}")
            continue
        check_tensor(name, g, wide, shp, shape.device)


def check_aligned(name, t):
    """A CUDA tensor's data at a multiple of 16 bytes (the kernels move 16-byte vectors), in mok's
    C++ wording. Real tensors only (fake ones have no address)."""
    if t is None or t.device.type != "cuda":
        return
    address = t.data_ptr()
    if address % 16:
        fail(name, "a view whose data starts at a multiple of 16 bytes",
             f"address {address:#x} ({address % 16} bytes past a 16-byte boundary)")


def check_schedule_args(topk_experts, num_experts, num_local_experts, first_local_expert):
    """build_schedule's arguments, metadata only (the fake implementation runs it too)."""
    require_tensor("topk_experts", topk_experts)
    if topk_experts.dim() != 2:
        fail("topk_experts.shape", "[num_local_tokens, topk]", shape_text(topk_experts.shape))
    check_tensor("topk_experts", topk_experts, torch.int64, tuple(topk_experts.shape),
                 topk_experts.device)
    # Bounded before anything is sized from them (mok's bound on the experts, include/mok/
    # problem.hpp: kMaxExperts).
    num_experts = check_int("num_experts", num_experts, minimum=1,
                            maximum=_native.lib.max_experts)
    num_local_experts = check_int("num_local_experts", num_local_experts, minimum=1,
                                  maximum=num_experts)
    first_local_expert = check_int("first_local_expert", first_local_expert, minimum=0)
    if num_experts % num_local_experts != 0:
        fail("num_local_experts", f"a positive divisor of num_experts = {num_experts}",
             num_local_experts)
    if first_local_expert + num_local_experts > num_experts:  # check_int refused < 0
        fail("first_local_expert", f"in [0, {num_experts - num_local_experts}]",
             first_local_expert)
    if topk_experts.shape[1] > num_experts:
        fail("topk_experts.shape[1]", f"at most num_experts = {num_experts}",
             topk_experts.shape[1])


def check_schedule_inputs(topk_experts, num_experts, num_local_experts, first_local_expert):
    """The checks of build_schedule that need no device data: shapes, dtype, expert ranges; on
    the CPU every id too. Ids on the GPU are checked by the layer on the device (no host
    synchronization), raised at the latest by the next call."""
    check_schedule_args(topk_experts, num_experts, num_local_experts, first_local_expert)
    if topk_experts.device.type == "cpu":
        _native.lib.check_expert_ids(_native.view_of(topk_experts), num_experts)
    else:
        _native.lib.require_backend("cuda")  # mok's error where the CUDA backend cannot run
