"""mok's functional layer, with MoK's names and argument order.

    config = functional.MoKConfig()
    workspace = functional.get_workspace(config, None, device=x.device, num_local_tokens=T,
                                         hidden_size=H, topk=k)
    schedule = functional.build_schedule(workspace, config, topk_experts,
                                         num_local_experts=E)
    out, ctx = functional.forward(config, workspace, schedule, x, router_weights,
                                  w_shared_gate, w_shared_up, w_shared_down,
                                  w_routed_gate, w_routed_up, w_routed_down)
    (d_x, d_router_weights, d_w_routed_gate, d_w_routed_up, d_w_routed_down,
     d_w_shared_gate, d_w_shared_up, d_w_shared_down) = functional.backward(
        config, workspace, schedule, ctx, d_out, x, router_weights,
        w_shared_gate, w_shared_up, w_shared_down, w_routed_gate, w_routed_up, w_routed_down)

Expert parallelism: `group` a torch.distributed group of W ranks (gloo) with CPU tensors runs
every call across the group's processes (mok/_host_ep.py): each rank holds its own tokens (the
same number on every rank) and experts [r*E/W, (r+1)*E/W) (weights [E/W, ...]), every rank calls
the same functions in the same order, and each call's results are bitwise those of one process
holding every expert. On CUDA tensors the group runs over PyTorch's symmetric memory, the
device moving the rows (written, and tested as ranks on threads of one GPU; not yet run on several
GPUs).

Differences from MoK, all additive: `group=None` means one device (CPU or one GPU); the shared
expert's weights may be None (its gradients and context tensors are then None); any number of
tokens; `-1` slots; bf16 or, on the CPU backend, float64 everywhere (the exact mode). MXFP8 weight
tuples (MoK's: forward (fp8, sc), backward (fp8, sc, fp8_t, sc_t) for gate and up and (fp8_t, sc_t)
for down) run mok's FP8 layer on the MX weights converted to its 128x128 blocks, at one rank or
across a group as above; the context stays bf16 tensors (mok/_mx_calls.py). `swiglu_limit` (clamped
SwiGLU, MoK's semantics: silu(min(g, L)) * clamp(u, -L, L)) must be None or a finite positive
number: MoK also accepts 0 (which zeroes the layer) and lets inf and NaN through; mok raises for
them.

The forward context is MoK's MoKForwardContext: tensors the caller owns (autograd saves them), so
one workspace serves any number of layers of its shape, and backward never recomputes the forward
behind the caller's back. recompute_forward_context (activation checkpointing) returns the same
context bit for bit. A context forward or recompute_forward_context returns records what it was
computed from (its `origin`: the tensors' identity and version, the swiglu_limit, the schedule);
backward refuses a context that does not belong to its own arguments, naming the argument.
"""

import dataclasses
import math
import threading
import weakref

import torch
import torch.distributed as dist

from mok import (_checks, _host_ep, _layer_ops, _layer_tensors, _mx_calls, _native,
                 _schedule_terms, _workspace)
from mok._config import FORWARD_PATHS, MoKConfig  # noqa: F401  (mok.functional's names)

Workspace = _workspace.Workspace
MoKWorkspace = Workspace


@dataclasses.dataclass(frozen=True, eq=False)
class MoKSchedule:
    """This rank's routing, validated, and its schedule table in MoK's terms.

    MoK's fields (mok/_schedule_terms.py says how they are computed):

      peer_rank          int32 [rows]: the rank each table row came from; -1 marks padding
      peer_token_idx     int32 [rows]: its slot t * k + j on that rank; -1 on padding rows
      num_tokens         int32 [1]: rows in use, padding included (the segments' total)
      tokens_per_expert  int32 [num_local_experts]: each local expert's segment, padding included
      top_experts        int32 [num_local_tokens, topk]: this rank's ids (-1: unused slot)

    Where mok's table differs from MoK's: segments are padded to mok's 128-row GEMM tile (MoK:
    256); within an expert the rows are in source rank, then t, then j order (MoK interleaves the
    source ranks; at one rank the orders agree); the table has the worst-case length, W * T * k +
    num_local_experts * 127 rows, whatever schedule_capacity says (nothing can overflow it); and
    mok's own fields: `topk_experts` (the int64 ids the layer reads), `rows_per_expert` (the
    unpadded rows per local expert).

    On CUDA the layer builds its table on the device inside each call, so these fields are only
    computed when read (a few small kernels, no host synchronization): forward and backward never
    wait for them. With expert parallelism on CUDA, reading one is a collective on the
    workspace's group (an all-gather of the ids on the device): every rank must read it, in the
    same order as its other collectives."""

    topk_experts: torch.Tensor  # int64 [num_local_tokens, topk]; -1 marks an unused slot
    num_experts: int
    num_local_experts: int
    first_local_expert: int
    workspace_handle: int
    _counts: "torch.Tensor | None" = dataclasses.field(default=None, repr=False)
    _group: object = dataclasses.field(default=None, repr=False)  # CUDA expert parallelism
    _ep_size: int = dataclasses.field(default=1, repr=False)
    _ids_all: "torch.Tensor | None" = dataclasses.field(default=None, repr=False)
    _terms: "tuple | None" = dataclasses.field(default=None, repr=False)
    _top_experts: "torch.Tensor | None" = dataclasses.field(default=None, repr=False)

    def _all_ids(self):
        """Every rank's ids, [W * T, k] in rank order."""
        if self._ids_all is not None:
            return self._ids_all
        ids = self.topk_experts
        if self._group is not None or self._ep_size > 1:
            gathered = ids.new_empty((self._ep_size * ids.shape[0], ids.shape[1]))
            dist.all_gather_into_tensor(gathered, ids.contiguous(), group=self._group)
            ids = gathered
        object.__setattr__(self, "_ids_all", ids)
        return ids

    def _schedule_terms(self):
        if self._terms is None:
            T, k = self.topk_experts.shape
            W = self._ep_size
            rows = _schedule_terms.capacity_rows(W, T, k, self.num_local_experts)
            ids = self._all_ids().reshape(W, T, k)
            rank = self.first_local_expert // self.num_local_experts
            object.__setattr__(self, "_terms", _schedule_terms.terms(
                ids, self.num_local_experts, rank, rows))
        return self._terms

    @property
    def rows_per_expert(self):
        """int32 [num_local_experts]: routed rows per local expert (from every rank's tokens),
        without padding."""
        if self._counts is None:
            object.__setattr__(self, "_counts", _layer_ops.build_schedule(
                self._all_ids(), self.num_experts, self.num_local_experts,
                self.first_local_expert))
        return self._counts

    @property
    def peer_rank(self):
        return self._schedule_terms()[0]

    @property
    def peer_token_idx(self):
        return self._schedule_terms()[1]

    @property
    def num_tokens(self):
        return self._schedule_terms()[2]

    @property
    def tokens_per_expert(self):
        """int32 [num_local_experts]: MoK's meaning, each expert's segment padded to the 128-row
        tile (mok's unpadded counts: rows_per_expert)."""
        return self._schedule_terms()[3]

    @property
    def top_experts(self):
        """MoK's field: this rank's ids as int32 (`topk_experts` holds the int64 ids)."""
        if self._top_experts is None:
            object.__setattr__(self, "_top_experts", self.topk_experts.to(torch.int32))
        return self._top_experts


def _stamp(t):
    """What a context records of a tensor: a weak reference to it, its data pointer and its
    version (which tensor, and whether it changed in place since). Host metadata only (no
    synchronization; fine during CUDA graph capture; a few microseconds a call). None for an
    absent tensor."""
    return (weakref.ref(t), t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else None


def _metadata(t):
    return t.dtype, t.shape, t.stride(), t.device


def _no_origin():
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class ContextOrigin:
    """What a forward context was computed from (MoKForwardContext.origin): the call that made
    it, its schedule (a weak reference), its swiglu_limit, a stamp of each tensor argument it
    read ((name, stamp) pairs, in backward's argument names) and of each context tensor it
    returned. backward refuses a context whose origin does not match its own arguments."""

    call: str  # "forward" or "recompute_forward_context"
    schedule: weakref.ref
    swiglu_limit: "float | None"
    inputs: tuple
    fields: tuple
    weights: str = "bf16"  # or "mxfp8": MoK's MX tuples (mok/_mx_calls.py)

    def __reduce__(self):
        # A pickled context comes back with other memory: nothing recorded holds for it.
        return _no_origin, ()


@dataclasses.dataclass(frozen=True, eq=False)
class MoKForwardContext:
    """What backward reads of the forward, in tensors the caller owns (MoK's fields).

    x_routed [R_x, H] and gate_routed, up_routed, hidden_routed [R, I]: the routed rows of the
    first ring pass in the schedule's order on CUDA (R = R_x = the rows of one pass); on the CPU
    backend one row per slot t*k + j (R = T*k) and no x rows. gate_shared, up_shared,
    hidden_shared [T, S]: the shared expert's (None without one). Rows the forward did not fill
    (padding, slots of other ranks' experts) hold unspecified values and are never read.

    `origin` (mok's, keyword-only): what forward or recompute_forward_context computed the
    context from (ContextOrigin); backward refuses the context for other arguments, a changed
    tensor, another schedule or swiglu_limit, or a field holding another tensor than the one
    returned (dataclasses.replace keeps the origin). A context built by hand, e.g. from tensors
    an activation-offloading hook gave back, has origin None: its pairing is the caller's."""

    x_routed: torch.Tensor
    gate_shared: "torch.Tensor | None"
    gate_routed: torch.Tensor
    up_shared: "torch.Tensor | None"
    up_routed: torch.Tensor
    hidden_shared: "torch.Tensor | None"
    hidden_routed: torch.Tensor
    origin: "ContextOrigin | None" = dataclasses.field(default=None, repr=False, kw_only=True)

    @classmethod
    def _from_ops(cls, tensors, has_shared):
        x_routed, gate_routed, up_routed, hidden_routed, gate_s, up_s, hidden_s = tensors
        if not has_shared:
            gate_s = up_s = hidden_s = None
        return cls(x_routed=x_routed, gate_shared=gate_s, gate_routed=gate_routed,
                   up_shared=up_s, up_routed=up_routed, hidden_shared=hidden_s,
                   hidden_routed=hidden_routed)

    def _ops_args(self):
        return (self.x_routed, self.gate_routed, self.up_routed, self.hidden_routed,
                self.gate_shared, self.up_shared, self.hidden_shared)


_cache: "dict[tuple, Workspace]" = {}
_cache_lock = threading.Lock()


def _normalize_device(device):
    if device is None:
        _checks.fail("device", "a torch.device", "None")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        _checks.fail("device", "a torch.device (or its name)", repr(device),
                     TypeError if isinstance(e, TypeError) else ValueError)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available()
                              else 0)
    if device.type not in ("cpu", "cuda"):
        _checks.fail("device", "cpu or cuda", str(device))
    return device


def _workspace_args(config, group, device, num_local_tokens, hidden_size, topk):
    if not isinstance(config, MoKConfig):
        _checks.fail("config", "a MoKConfig", type(config).__name__, TypeError)
    device = _normalize_device(device)
    for name, value in (("num_local_tokens", num_local_tokens), ("hidden_size", hidden_size),
                        ("topk", topk)):
        _checks.check_int(name, value, minimum=1, maximum=_native.lib.max_size)
    rank, size = _workspace.group_rank_size(group)
    if size != 1:
        _workspace.check_group(group, device, rank)
    if device.type == "cuda":
        _native.lib.require_backend("cuda")  # mok's error while the CUDA backend cannot run
    return device, rank, size


def validate_workspace_args(config, group, *, device, num_local_tokens, hidden_size, topk):
    """MoK's check of get_workspace's / create_workspace's arguments, with mok's rules: any
    positive num_local_tokens and hidden_size (MoK: T >= 512 and T, H multiples of 256; mok's
    alignment rules are checked per layer, when the weights are seen), any topk >= 1, group None
    (one device) or a process group of any size. Raises what get_workspace would; returns None."""
    _workspace_args(config, group, device, num_local_tokens, hidden_size, topk)


def create_workspace(config, group, *, device, num_local_tokens, hidden_size, topk):
    """A new workspace owned by the caller (not cached)."""
    device, rank, size = _workspace_args(config, group, device, num_local_tokens, hidden_size,
                                         topk)
    return Workspace(config, group=group, ep_rank=rank, ep_size=size, device=device,
                     num_local_tokens=num_local_tokens, hidden_size=hidden_size, topk=topk)


def get_workspace(config, group, *, device, num_local_tokens, hidden_size, topk):
    """The cached workspace for (group, device, num_local_tokens, hidden_size, topk, capacity
    factor), created on first use: MoK's cache key, the capacity factor being
    max(2, ceil(W * config.schedule_capacity_multiplier)). Every layer of those shapes and that
    factor shares it, whatever the rest of its config (calls pass their own; the C++ scratch is
    kept per layer shape and config)."""
    device, rank, size = _workspace_args(config, group, device, num_local_tokens, hidden_size,
                                         topk)
    key = (_workspace.group_key(group), device, num_local_tokens, hidden_size, topk,
           _capacity_factor(config, size))
    with _cache_lock:
        ws = _cache.get(key)
        if ws is None:
            ws = _cache[key] = Workspace(config, group=group, ep_rank=rank, ep_size=size,
                                         device=device, num_local_tokens=num_local_tokens,
                                         hidden_size=hidden_size, topk=topk)
        return ws


def _capacity_factor(config, ep_size):
    """MoK's cache keys include its schedule capacity factor; so do mok's (two configs that MoK
    would give two workspaces get two), though the factor sizes nothing in mok."""
    return max(2, math.ceil(ep_size * config.schedule_capacity_multiplier))


def clear_workspace_cache():
    """Drops the cached workspaces, as MoK does: first a barrier on the group of each one that has
    a group of several ranks (every rank must call this, with the same cached workspaces created
    in the same order), and the device synchronized for CUDA ones, so that no rank frees memory a
    peer may still read. Their memory goes when nothing else refers to them."""
    with _cache_lock:
        cached = list(_cache.values())
        _cache.clear()
    for ws in cached:
        if ws.ep_size > 1:
            _workspace.group_barrier(ws.group, ws.device)
        if ws.device is not None and ws.device.type == "cuda":
            torch.cuda.synchronize(ws.device)


def validate_inputs(config, workspace, schedule, x, router_weights=None, grad_output=None):
    """MoK's check of a call's inputs against its workspace and schedule: x (and grad_output)
    [num_local_tokens, hidden_size] bf16 (or float64 on the CPU backend), router_weights
    [num_local_tokens, topk] float32 (float64 with float64 x), contiguous, on the workspace's
    device; a schedule built with this workspace. Raises mok's errors (a dtype: TypeError,
    anything else: ValueError; MoK raises ValueError for both); returns None."""
    _common(config, workspace, _NO_SCHEDULE, None)
    _require("schedule", schedule, MoKSchedule)
    if schedule.workspace_handle != workspace.handle:
        _checks.fail("schedule", "a schedule built with this workspace",
                     "one from another workspace")
    _checks.require_tensor("x", x)
    if x.dtype not in _checks.ACTIVATION_DTYPES:
        _checks.fail("x.dtype", "bfloat16 (or float64 on the cpu backend)",
                     _checks.dtype_name(x.dtype), TypeError)
    device = workspace.device if workspace.device is not None else x.device
    T = workspace.num_local_tokens if workspace.num_local_tokens is not None else x.shape[0]
    H = workspace.hidden_size if workspace.hidden_size is not None else x.shape[-1]
    k = workspace.topk if workspace.topk is not None else schedule.topk_experts.shape[1]
    _checks.check_tensor("x", x, x.dtype, (T, H), device)
    if grad_output is not None:
        _checks.check_tensor("grad_output", grad_output, x.dtype, (T, H), device)
    if router_weights is not None:
        _checks.check_tensor("router_weights", router_weights, _checks.router_dtype(x.dtype),
                             (T, k), device)
    _checks.check_tensor("schedule.topk_experts", schedule.topk_experts, torch.int64, (T, k),
                         device)


def _require(name, value, kind):
    if not isinstance(value, kind):
        _checks.fail(name, f"a {kind.__name__}", type(value).__name__, TypeError)


_NO_SCHEDULE = object()  # build_schedule's calls of _common: no schedule yet


def _common(config, workspace, schedule, swiglu_limit, x=None):
    """Checks the call's config, workspace, schedule (build_schedule passes _NO_SCHEDULE) and x
    against the workspace; returns the op handle (the workspace with this config)."""
    _require("config", config, MoKConfig)
    _require("workspace", workspace, Workspace)
    if schedule is not _NO_SCHEDULE:
        _require("schedule", schedule, MoKSchedule)
        if schedule.workspace_handle != workspace.handle:
            _checks.fail("schedule", "a schedule built with this workspace",
                         "one from another workspace")
    _checks.check_swiglu_limit(swiglu_limit)
    if x is not None:
        _checks.require_tensor("x", x)
        workspace.check_x(x)
    return workspace.handle_for(config)


def _check_experts(schedule, routed_gate):
    if isinstance(routed_gate, torch.Tensor) and routed_gate.dim() == 3 \
            and routed_gate.shape[0] != schedule.num_local_experts:
        _checks.fail("routed_gate_weights.shape[0]",
                     f"{schedule.num_local_experts} (the schedule's num_local_experts)",
                     routed_gate.shape[0])


def build_schedule(workspace, config, top_experts=None, *, num_local_experts, topk_experts=None):
    """Validates the routing (every id in [-1, num_experts)) and returns this rank's schedule.

    `top_experts`: int64 or int32 [num_local_tokens, topk] (MoK's name; `topk_experts`, mok's
    earlier name, is accepted as a keyword alias). `num_local_experts`: the experts of each rank.
    On CPU tensors every id is checked here; on CUDA by the layer on the device (raised at the
    latest by the next call), without host synchronization."""
    if topk_experts is not None:
        if top_experts is not None:
            _checks.fail("topk_experts", "None when top_experts is given (it is its alias)",
                         "both", TypeError)
        top_experts = topk_experts
    if top_experts is None:
        _checks.fail("top_experts", "a torch.Tensor", "None", TypeError)
    _common(config, workspace, _NO_SCHEDULE, None)
    _checks.require_tensor("top_experts", top_experts)
    # Bounded before anything is sized from it: mok's bound on the experts of all ranks.
    num_local_experts = _checks.check_int(
        "num_local_experts", num_local_experts, minimum=1,
        maximum=_native.lib.max_experts // workspace.ep_size)
    if top_experts.dim() == 2:
        if workspace.device is not None and top_experts.device != workspace.device:
            _checks.fail("top_experts.device",
                         f"{_checks.device_name(workspace.device)} (the workspace's device)",
                         _checks.device_name(top_experts.device))
        # A workspace made without sizes (Workspace(config)) takes those of each call.
        for axis, field, want in ((0, "num_local_tokens", workspace.num_local_tokens),
                                  (1, "topk", workspace.topk)):
            if want is not None and top_experts.shape[axis] != want:
                _checks.fail(f"top_experts.shape[{axis}]", f"{want} (the workspace's {field})",
                             top_experts.shape[axis])
    ids = top_experts
    if ids.dtype == torch.int32:  # MoK accepts int32 ids; mok's core reads int64
        ids = ids.to(torch.int64)
    # A negated view's memory is not its values: the schedule keeps the values (a copy).
    ids = ids.resolve_neg()
    num_experts = num_local_experts * workspace.ep_size
    first = num_local_experts * workspace.ep_rank
    given = {"_top_experts": top_experts} if top_experts.dtype == torch.int32 else {}
    if workspace.ep_size > 1 and ids.device.type == "cuda":
        # The device exchanges the ids inside each call; the table in MoK's terms needs every
        # rank's ids, so reading it is a collective (MoKSchedule's fields).
        _checks.check_schedule_inputs(ids, num_experts, num_local_experts, first)
        return MoKSchedule(ids, num_experts, num_local_experts, first, workspace.handle,
                           _group=workspace.group, _ep_size=workspace.ep_size, **given)
    if workspace.ep_size > 1:  # every rank checks every rank's ids; rows from all ranks
        counts, ids_all = _host_ep.build_schedule(workspace, config, ids, num_experts,
                                                  num_local_experts, first)
        return MoKSchedule(ids, num_experts, num_local_experts, first, workspace.handle,
                           counts, _ep_size=workspace.ep_size, _ids_all=ids_all, **given)
    schedule = MoKSchedule(ids, num_experts, num_local_experts, first, workspace.handle, **given)
    if ids.device.type == "cpu":
        schedule.rows_per_expert  # validates every id now (the CPU backend's contract)
    else:
        _checks.check_schedule_inputs(ids, num_experts, num_local_experts, first)
    return schedule


def _origin(call, schedule, swiglu_limit, inputs, ctx, weights="bf16"):
    """The ContextOrigin of the context `ctx` that `call` returned (`weights`: "bf16" tensors or
    "mxfp8" tuples); None while torch.compile traces (fake tensors have no data pointer), so that
    such a context is not checked."""
    if torch.compiler.is_compiling():
        return None
    return ContextOrigin(call, weakref.ref(schedule), swiglu_limit,
                         tuple((name, _stamp(t)) for name, t in inputs.items()),
                         tuple((name, _stamp(t))
                               for name, t in zip(_layer_tensors.CONTEXT_NAMES, ctx._ops_args())),
                         weights)


def _check_origin(forward_context, schedule, swiglu_limit, inputs, weights="bf16"):
    """backward's arguments against what its context was computed from (ContextOrigin). An
    argument whose metadata (dtype, shape, strides, device) differs from the recorded one, or that
    is absent on one side, is left to the op's checks, which name the exact defect. NOTES: skipped
    while torch.compile traces (a fake tensor has no data pointer, and reading one would break
    fullgraph); a context made while tracing records nothing either."""
    origin = forward_context.origin
    if origin is None or torch.compiler.is_compiling():
        return
    if origin.weights != weights:  # the bf16 layer's context and the FP8 layer's
        _checks.fail("forward_context", f"the context of a forward with {weights} weights",
                     f"the context of a {origin.call} with {origin.weights} weights")
    if origin.swiglu_limit != swiglu_limit:
        _checks.fail("swiglu_limit", f"{origin.swiglu_limit} (the swiglu_limit of the "
                     f"{origin.call} that made the forward context)", swiglu_limit)
    if origin.schedule() is not schedule:
        _checks.fail("schedule", f"the schedule of the {origin.call} that made the forward "
                     "context", "another schedule")
    for name, recorded in origin.inputs:
        _check_stamp(name, recorded, inputs[name],
                     f"the {name} of the {origin.call} that made the forward context")
    context = forward_context._ops_args()
    returned = {stamp[1]: name for name, stamp in origin.fields if stamp is not None}
    for (name, recorded), t in zip(origin.fields, context):
        other = returned.get(t.data_ptr()) if isinstance(t, torch.Tensor) else None
        what = f"{other}'s tensor" if other not in (None, name) else None
        _check_stamp(f"forward_context.{name}", recorded, t,
                     f"the tensor {origin.call} returned as {name}", another=what)


def _check_stamp(name, recorded, t, expected, another=None):
    """`t` against a recorded stamp: the same memory, unchanged since. A tensor of other memory
    whose metadata differs from the recorded one's (while that one lives) is left to the op's
    checks, which name the exact defect (a shape, a dtype, ...)."""
    if recorded is None or not isinstance(t, torch.Tensor):
        return
    ref, pointer, version = recorded
    now = t.data_ptr()
    if now != pointer:
        original = ref()
        if original is not None and _metadata(original) != _metadata(t):
            return
        _checks.fail(name, expected, another or
                     f"another tensor (data at {now:#x}, not {pointer:#x})")
    if t._version != version:
        _checks.fail(name, f"{expected}, unchanged since", f"the same tensor changed in place "
                     f"since (version {version} then, {t._version} now)")


def _main_grads(main_grads):
    """backward's `main_grads`, checked as a tuple of 6 (MoK's order: shared gate, routed gate,
    shared up, routed up, shared down, routed down) that backward may write in place."""
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != 6:
        got = (f"a {type(main_grads).__name__} of {len(main_grads)}"
               if isinstance(main_grads, (tuple, list)) else repr(type(main_grads).__name__))
        _checks.fail("main_grads", "a tuple of 6 tensors (shared gate, routed gate, shared up, "
                     "routed up, shared down, routed down)", got)
    for name, g in zip(("main_shared_gate", "main_routed_gate", "main_shared_up",
                        "main_routed_up", "main_shared_down", "main_routed_down"), main_grads):
        if isinstance(g, torch.Tensor) and (g.is_neg() or g.is_conj()):  # written in place
            _checks.fail(name, "a tensor whose memory holds its values (backward adds into it: "
                         "a view with torch's negation or conjugation bit cannot take that)",
                         "a negated view" if g.is_neg() else "a conjugated view")
    return tuple(main_grads)


def _mx_context(call, context, shared_gate_weights, schedule, limit, inputs):
    """The MoKForwardContext of `call` with MX tuples (mok/_mx_calls.py), its origin recorded."""
    ctx = MoKForwardContext._from_ops(context, shared_gate_weights is not None)
    return dataclasses.replace(ctx, origin=_origin(call, schedule, limit, inputs, ctx,
                                                   weights="mxfp8"))


def forward(config, workspace, schedule, x, router_weights, shared_gate_weights,
            shared_up_weights, shared_down_weights, routed_gate_weights, routed_up_weights,
            routed_down_weights, swiglu_limit=None):
    """out = shared(x) + sum_j router_weights[:, j] * expert_{topk_experts[:, j]}(x).

    Returns (out, forward_context): a MoKForwardContext of tensors the caller owns, which records
    what it was computed from (its origin)."""
    handle = _common(config, workspace, schedule, swiglu_limit, x)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    if _mx_calls.is_mx(routed_gate_weights, routed_up_weights, routed_down_weights):
        out, context, inputs = _mx_calls.forward(
            schedule, handle, x, router_weights,
            (shared_gate_weights, shared_up_weights, shared_down_weights),
            (routed_gate_weights, routed_up_weights, routed_down_weights), limit)
        return out, _mx_context("forward", context, shared_gate_weights, schedule, limit, inputs)
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    _check_experts(schedule, routed_gate_weights)
    out, *context = _layer_ops.call(_layer_ops.forward, x, schedule.topk_experts,
                                    router_weights, *weights, handle, limit)
    ctx = MoKForwardContext._from_ops(context, shared_gate_weights is not None)
    origin = _origin("forward", schedule, limit, {
        "x": x, "schedule.topk_experts": schedule.topk_experts, "router_weights": router_weights,
        "routed_gate_weights": routed_gate_weights, "routed_up_weights": routed_up_weights,
        "routed_down_weights": routed_down_weights, "shared_gate_weights": shared_gate_weights,
        "shared_up_weights": shared_up_weights, "shared_down_weights": shared_down_weights}, ctx)
    return out, dataclasses.replace(ctx, origin=origin)


def recompute_forward_context(config, workspace, schedule, x, shared_gate_weights,
                              shared_up_weights, routed_gate_weights, routed_up_weights,
                              swiglu_limit=None):
    """The forward context again, bit for bit (activation checkpointing): gate/up only, no down
    projection and no router weights, as MoK's signature says."""
    handle = _common(config, workspace, schedule, swiglu_limit, x)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    if _mx_calls.is_mx(routed_gate_weights, routed_up_weights):
        context, inputs = _mx_calls.recompute_forward_context(
            schedule, handle, x, (shared_gate_weights, shared_up_weights),
            (routed_gate_weights, routed_up_weights), limit)
        return _mx_context("recompute_forward_context", context, shared_gate_weights, schedule,
                           limit, inputs)
    _check_experts(schedule, routed_gate_weights)
    context = _layer_ops.call(_layer_ops.recompute_forward_context, x, schedule.topk_experts,
                              routed_gate_weights, routed_up_weights, shared_gate_weights,
                              shared_up_weights, handle, limit)
    ctx = MoKForwardContext._from_ops(context, shared_gate_weights is not None)
    origin = _origin("recompute_forward_context", schedule, limit, {
        "x": x, "schedule.topk_experts": schedule.topk_experts,
        "routed_gate_weights": routed_gate_weights, "routed_up_weights": routed_up_weights,
        "shared_gate_weights": shared_gate_weights, "shared_up_weights": shared_up_weights}, ctx)
    return dataclasses.replace(ctx, origin=origin)


def backward(config, workspace, schedule, forward_context, grad_output, x, router_weights,
             shared_gate_weights, shared_up_weights, shared_down_weights, routed_gate_weights,
             routed_up_weights, routed_down_weights, swiglu_limit=None, main_grads=None):
    """All gradients, in MoK's order:

        (d_x, d_router_weights, d_w_routed_gate, d_w_routed_up, d_w_routed_down,
         d_w_shared_gate, d_w_shared_up, d_w_shared_down)

    from `forward_context` (what forward or recompute_forward_context returned for these inputs
    and weights, unchanged since, with this schedule and swiglu_limit: its origin says, and a
    mismatch raises mok's error naming the argument). The shared ones are None without a shared
    expert. `main_grads` (MoK's order:
    shared gate, routed gate, shared up, routed up, shared down, routed down; fp32, shared ones
    None when absent) are accumulated into in place and returned in the weight-gradient places."""
    handle = _common(config, workspace, schedule, swiglu_limit, x)
    _require("forward_context", forward_context, MoKForwardContext)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    if _mx_calls.is_mx(routed_gate_weights, routed_up_weights, routed_down_weights):
        shared = (shared_gate_weights, shared_up_weights, shared_down_weights)
        tuples = _mx_calls.backward_tuples(
            schedule, x, (routed_gate_weights, routed_up_weights, routed_down_weights))
        _check_origin(forward_context, schedule, limit, _mx_calls.origin_inputs(
            x, schedule, router_weights, *tuples[:2], shared), weights="mxfp8")
        return _mx_calls.backward(schedule, handle, forward_context._ops_args(), grad_output, x,
                                  router_weights, shared, tuples, limit,
                                  None if main_grads is None else _main_grads(main_grads))
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights, shared_gate_weights,
               shared_up_weights, shared_down_weights)
    _check_experts(schedule, routed_gate_weights)
    _check_origin(forward_context, schedule, limit, {
        "x": x, "schedule.topk_experts": schedule.topk_experts, "router_weights": router_weights,
        "routed_gate_weights": routed_gate_weights, "routed_up_weights": routed_up_weights,
        "routed_down_weights": routed_down_weights, "shared_gate_weights": shared_gate_weights,
        "shared_up_weights": shared_up_weights, "shared_down_weights": shared_down_weights})
    context = forward_context._ops_args()
    has_shared = shared_gate_weights is not None
    if main_grads is None:
        d_x, d_w, dg, du, dd, dsg, dsu, dsd = _layer_ops.call(
            _layer_ops.backward, grad_output, x, schedule.topk_experts, router_weights, *weights,
            *context, handle, limit)
        if not has_shared:
            dsg = dsu = dsd = None
        return d_x, d_w, dg, du, dd, dsg, dsu, dsd
    msg, mrg, msu, mru, msd, mrd = _main_grads(main_grads)
    d_x, d_w = _layer_ops.backward_main_grad(grad_output, x, schedule.topk_experts,
                                             router_weights, *weights, mrg, mru, mrd, msg, msu,
                                             msd, *context, handle, limit)
    return d_x, d_w, mrg, mru, mrd, msg, msu, msd
