"""MoK's ops layer (Mixture-of-Kittens' `mok/ops.py`) as torch.library custom ops on mok's pieces:
mok's compatibility layer for MoK ("Kittens") code that calls `mok.ops.<name>`.

Same names and schemas as MoK's bf16 ops (`torch.ops.mok.<name>`, `mok.ops.<name>`), each with a
fake implementation; where mok's work splits differently, the op composes mok's own layer:

  all_gather_top_experts   one rank: copies the ids into the buffer; several ranks: mok's error
                           (the op has no group: functional.build_schedule gathers through the
                           workspace's group)
  barrier_all              one rank: nothing to wait for (as in MoK); several ranks: mok's error
                           (functional's calls order the ranks through the workspace's group)
  schedule                 mok's schedule table in MoK's terms (mok/_schedule_terms.py: mok's
                           order, 128-row padding, at least the worst-case length)
  dispatch_mlp_swiglu_combine_fwd_bf16
                           one rank: every slot t * k + j is computed by mok's layer as a token of
                           its own (the routed experts, router weight 1, so the slot's output is
                           F_e(x_t) rounded once to bf16) and stored in combine_buffer[t * k + j];
                           the shared expert by a second mok layer call. The expert of each slot
                           is read off the schedule (its segment), so any MoK-format schedule
                           works. Context tensors: mok's layout (see below)
  dispatch_mlp_swiglu_combine_bwd_bf16
                           the same two layer backwards: per-slot d_x rows into d_x_routed_buffer,
                           per-slot router-weight gradients into d_router_weight_buffer, all six
                           weight gradients, d_x_shared
  fwd_epilogue             out = y_shared + sum over used j (increasing) of w[t, j] *
                           combine[t * k + j], in fp32, rounded once to bf16
  bwd_epilogue             d_x = d_x_shared + sum over j of d_x_routed_buffer[t * k + j], fp32,
                           rounded once

What differs from MoK, and why:
  - The peer-pointer and multicast-pointer arguments are accepted and not dereferenced: mok's
    layer addresses its own buffers. Expert parallelism through these ops is not supported (their
    length must be 1): use mok.functional, which runs expert parallelism on the workspace's group.
  - `num_comm_sms`, `macrobatch_size`, `minibatch_size` are accepted and checked as MoK checks
    them, and mok's automatic ring sizing is used (they never change a result).
  - The context tensors (`x_routed`, `gate_routed`, `up_routed`, `hidden_routed`) are mok's layout
    for these calls (CPU: one row per slot t * k + j, no x rows; CUDA: the first ring pass in the
    schedule's order), not MoK's [macrobatch_size, ...]: pass them to the backward op unchanged,
    as MoK's functional code does. `y_routed` and `d_x_routed` have one row per schedule row
    (zero on padding rows).
  - Intermediate gradients mok fuses away (`d_gate_*`, `d_up_*`, `d_hidden_*`, `d_y_routed`) come
    back as empty [0, ...] tensors: mok does not produce them.
  - `swiglu_limit` (clamped SwiGLU, MoK's semantics) is carried to mok's layer ops; mok refuses 0,
    inf and NaN, which MoK lets through.
  - `mxfp8_quantize` is MoK's, bit for bit (mok/_fp8.py). The MXFP8 layer ops
    (`dispatch_mlp_swiglu_combine_{fwd,bwd}_mxfp8`) are composed the same way of mok's FP8 layer,
    MoK's MX weights converted to mok's blocks: mok/_mx_calls.py.

What the dispatch ops trust of a schedule (the four tensors MoK code may build or edit itself:
schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert). The rows that count
are those before num_tokens; each lies in the segment of one local expert, the segments being
tokens_per_expert's lengths in order. A row is used when its peer_rank is 0 (this rank; -1 marks
padding) and its peer_token_idx names a slot t * topk + j in [0, T * topk); the peer_token_idx of
padding rows and every row from num_tokens on are never read (MoK leaves them unspecified).
  - Shapes and dtypes (int32: peer_rank, peer_token_idx [rows], num_tokens [1], tokens_per_expert
    [num_local_experts]) are checked on every device.
  - On CPU tensors the values are checked before anything runs, and a schedule that breaks a rule
    raises mok's error naming the entry: num_tokens in [0, rows], tokens_per_expert >= 0 and
    summing to num_tokens, peer_rank -1 or 0, a used row's peer_token_idx in [0, T * topk) and
    named by no other used row.
  - On CUDA tensors the values stay on the device (reading them would synchronize) and are
    trusted, behind guards that keep every access in bounds whatever they hold: a row whose
    peer_rank is not 0, whose peer_token_idx is outside [0, T * topk) or that lies past the last
    segment computes nothing (its y_routed / d_x_routed row is 0), negative segment lengths count
    as 0, and a slot that several rows name is computed once, for the largest of their experts.
    A slot no used row names gets zeros in combine_buffer and d_x_routed_buffer. So a schedule
    edited by hand computes the layer of the routing it describes: never an out-of-bounds access,
    a hang, or an error at a later call.
"""

import torch

from mok import _checks, _layer_ops, _layer_tensors, _native, _schedule_terms, _workspace
from mok import _fake  # noqa: F401  (the layer ops' fake implementations, which ours run on)
from mok._fp8 import mxfp8_quantize  # noqa: F401  (MoK's MX quantizer, mok.ops.mxfp8_quantize)


def one_rank(name, pointers):
    if not isinstance(pointers, (list, tuple)) or any(
            not isinstance(p, int) or p <= 0 for p in pointers):
        _checks.fail(name, "a list of positive ints (peer addresses)", repr(pointers), TypeError)
    if len(pointers) != 1:
        _checks.fail(f"len({name})", "1 (mok runs MoK's ops on one rank; expert parallelism "
                     "through mok.functional on the workspace's group)", len(pointers))


def ring_knobs(num_comm_sms, macrobatch_size, minibatch_size):
    if num_comm_sms <= 0 or num_comm_sms % 2:
        _checks.fail("num_comm_sms", "a positive even int (MoK's rule)", num_comm_sms)
    if minibatch_size <= 0 or minibatch_size % 256:
        _checks.fail("minibatch_size", "a positive multiple of 256 (MoK's rule)", minibatch_size)
    if macrobatch_size <= 0 or macrobatch_size % minibatch_size:
        _checks.fail("macrobatch_size", f"a positive multiple of minibatch_size = "
                     f"{minibatch_size} (MoK's rule)", macrobatch_size)


def slot_experts(peer_rank, peer_token_idx, num_tokens, tokens_per_expert, slots):
    """int64 [slots, 1]: each slot's local expert (-1: not routed here), read off the schedule:
    a row's expert is the segment it lies in; with each row's slot (`slots` for a row that
    computes nothing) and whether it is used. Fixed-size device operations, no host sync; every
    index stays in bounds whatever the schedule holds (the module docstring says what a row
    needs to be used)."""
    rows = peer_rank.shape[0]
    device = peer_rank.device
    segment_end = torch.cumsum(tokens_per_expert.to(torch.int64).clamp(min=0), 0)
    row = torch.arange(rows, device=device)
    expert = torch.searchsorted(segment_end, row, right=True)
    idx = peer_token_idx.to(torch.int64)
    used = (peer_rank == 0) & (row < num_tokens.to(torch.int64)) & \
        (expert < tokens_per_expert.shape[0]) & (idx >= 0) & (idx < slots)
    slot = torch.where(used, idx, torch.full_like(row, slots))
    ids = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
    # amax: a slot several rows name gets the largest of their experts, the same whatever order
    # the device scatters in.
    ids.scatter_reduce_(0, slot, torch.where(used, expert, torch.full_like(expert, -1)),
                        reduce="amax")
    return ids[:slots].reshape(slots, 1), slot, used


def _check_schedule_values(peer_rank, peer_token_idx, num_tokens, tokens_per_expert, slots):
    """A schedule on the CPU, value by value (reading it costs no synchronization there): the
    rules the module docstring gives, each broken one named by its entry."""
    rows = peer_rank.shape[0]
    n = int(num_tokens[0])
    if not 0 <= n <= rows:
        _checks.fail("num_tokens[0]", f"in [0, {rows}] (the schedule's rows)", n)
    negative = (tokens_per_expert < 0).nonzero()
    if len(negative):
        e = int(negative[0, 0])
        _checks.fail(f"tokens_per_expert[{e}]", "a row count >= 0", int(tokens_per_expert[e]))
    total = int(tokens_per_expert.sum())
    if total != n:
        _checks.fail("tokens_per_expert", f"segments summing to num_tokens = {n}",
                     f"segments summing to {total}")
    rank = peer_rank[:n]
    other = ((rank != 0) & (rank != -1)).nonzero()
    if len(other):
        r = int(other[0, 0])
        _checks.fail(f"schedule_peer_rank[{r}]", "-1 (padding) or 0 (this rank: mok runs MoK's "
                     "ops on one rank)", int(rank[r]))
    used = rank == 0
    idx = peer_token_idx[:n]
    outside = (used & ((idx < 0) | (idx >= slots))).nonzero()
    if len(outside):
        r = int(outside[0, 0])
        _checks.fail(f"schedule_peer_token_idx[{r}]", f"a slot t * topk + j in [0, {slots})",
                     int(idx[r]))
    used_rows = used.nonzero()[:, 0]
    named, order = torch.sort(idx[used_rows], stable=True)
    twice = (named[1:] == named[:-1]).nonzero()
    if len(twice):
        i = int(twice[0, 0])
        first, again = int(used_rows[order[i]]), int(used_rows[order[i + 1]])
        _checks.fail(f"schedule_peer_token_idx[{again}]", "a slot no other row names",
                     f"slot {int(named[i])}, which row {first} names too")


def no_routed_slots(x):
    """(topk_experts, topk_weights) [T, 1] of a layer call that routes no slot (ids -1, weights
    0): the shared expert alone, through mok's layer (the fused ops' shared halves)."""
    T = x.shape[0]
    return (torch.full((T, 1), -1, dtype=torch.int64, device=x.device),
            torch.zeros((T, 1), dtype=_checks.router_dtype(x.dtype), device=x.device))


def _shared_only(x, gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit):
    """The layer with no routed slot: out = S(x) (mok's layer; the routed weights give shapes)."""
    ids, w = no_routed_slots(x)
    return _layer_ops.forward(x, ids, w, gate, up, down, shared_gate, shared_up, shared_down, 0,
                              swiglu_limit=swiglu_limit)


def check_schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert, num_local_experts,
                   device, slots, fake):
    """The schedule's tensors; on the CPU (real tensors) their values too."""
    _checks.require_tensor("schedule_peer_rank", peer_rank)
    rows = peer_rank.shape[0] if peer_rank.dim() == 1 else -1
    _checks.check_tensor("schedule_peer_rank", peer_rank, torch.int32, (rows,), device)
    _checks.check_tensor("schedule_peer_token_idx", peer_token_idx, torch.int32, (rows,), device)
    _checks.check_tensor("num_tokens", num_tokens, torch.int32, (1,), device)
    _checks.check_tensor("tokens_per_expert", tokens_per_expert, torch.int32,
                         (num_local_experts,), device)
    if not fake and device.type == "cpu":
        _check_schedule_values(peer_rank, peer_token_idx, num_tokens, tokens_per_expert, slots)


def rows_of(name, t):
    """(T, H) of a [T, H] tensor argument."""
    _checks.require_tensor(name, t)
    if t.dim() != 2:
        _checks.fail(f"{name}.shape", "[num_local_tokens, hidden_size]",
                     _checks.shape_text(t.shape))
    return t.shape


def _fwd(x_buffer, x_buffer_ptrs, combine_buffer, combine_buffer_ptrs, w_shared_gate,
         w_routed_gate, w_shared_up, w_routed_up, w_shared_down, w_routed_down,
         schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert, topk,
         swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size, *, fake):
    one_rank("x_buffer_ptrs", x_buffer_ptrs)
    one_rank("combine_buffer_ptrs", combine_buffer_ptrs)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    ring_knobs(num_comm_sms, macrobatch_size, minibatch_size)
    topk = _checks.check_int("topk", topk, minimum=1)
    T, H = rows_of("x_buffer", x_buffer)
    _checks.check_tensor("combine_buffer", combine_buffer, x_buffer.dtype, (T * topk, H),
                         x_buffer.device)
    _checks.require_tensor("w_routed_gate", w_routed_gate)
    check_schedule(schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert,
                   w_routed_gate.shape[0], x_buffer.device, T * topk, fake)
    ids, slot, used = slot_experts(schedule_peer_rank, schedule_peer_token_idx, num_tokens,
                                   tokens_per_expert, T * topk)
    x_slots = x_buffer.repeat_interleave(topk, dim=0)
    ones = torch.ones((T * topk, 1), dtype=_checks.router_dtype(x_buffer.dtype),
                      device=x_buffer.device)
    y_slots, x_routed, gate_routed, up_routed, hidden_routed, *_ = _layer_ops.forward(
        x_slots, ids, ones, w_routed_gate, w_routed_up, w_routed_down, None, None, None, 0,
        swiglu_limit=limit)
    (y_shared, _, _, _, _, gate_shared, up_shared, hidden_shared) = _shared_only(
        x_buffer, w_routed_gate, w_routed_up, w_routed_down, w_shared_gate, w_shared_up,
        w_shared_down, limit)
    combine_buffer.copy_(y_slots)
    y_routed = torch.where(used.unsqueeze(1), y_slots[slot.clamp(max=T * topk - 1)],
                           torch.zeros((), dtype=y_slots.dtype, device=y_slots.device))
    return (x_routed, gate_shared, gate_routed, up_shared, up_routed, hidden_shared,
            hidden_routed, y_shared, y_routed)


@torch.library.custom_op("mok::dispatch_mlp_swiglu_combine_fwd_bf16",
                         mutates_args=("combine_buffer",))
def dispatch_mlp_swiglu_combine_fwd_bf16(
        x_buffer: torch.Tensor, x_buffer_ptrs: list[int], combine_buffer: torch.Tensor,
        combine_buffer_ptrs: list[int], w_shared_gate: torch.Tensor, w_routed_gate: torch.Tensor,
        w_shared_up: torch.Tensor, w_routed_up: torch.Tensor, w_shared_down: torch.Tensor,
        w_routed_down: torch.Tensor, schedule_peer_rank: torch.Tensor,
        schedule_peer_token_idx: torch.Tensor, num_tokens: torch.Tensor,
        tokens_per_expert: torch.Tensor, topk: int, swiglu_limit: float | None,
        num_comm_sms: int, macrobatch_size: int, minibatch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoK's fused forward: (x_routed, gate_shared, gate_routed, up_shared, up_routed,
    hidden_shared, hidden_routed, y_shared, y_routed); combine_buffer[t * k + j] gets slot
    (t, j)'s expert output (module docstring: how mok computes it, and the layouts)."""
    return _fwd(x_buffer, x_buffer_ptrs, combine_buffer, combine_buffer_ptrs, w_shared_gate,
               w_routed_gate, w_shared_up, w_routed_up, w_shared_down, w_routed_down,
               schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert, topk,
               swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size, fake=False)


@dispatch_mlp_swiglu_combine_fwd_bf16.register_fake
def _fwd_fake(*args):
    # The same composition on fake tensors: mok's layer ops have fake implementations.
    return _fwd(*args, fake=True)


def _bwd(d_y_buffer, d_y_buffer_ptrs, d_x_routed_buffer, d_x_routed_buffer_ptrs,
         router_weight_buffer, router_weight_buffer_ptrs, d_router_weight_buffer,
         d_router_weight_buffer_ptrs, w_shared_gate, w_routed_gate, w_shared_up, w_routed_up,
         w_shared_down, w_routed_down, x_routed, gate_shared, gate_routed, up_shared, up_routed,
         hidden_shared, hidden_routed, x, x_ptrs, schedule_peer_rank, schedule_peer_token_idx,
         num_tokens, tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size,
         minibatch_size, *, fake):
    for name, ptrs in (("d_y_buffer_ptrs", d_y_buffer_ptrs),
                       ("d_x_routed_buffer_ptrs", d_x_routed_buffer_ptrs),
                       ("router_weight_buffer_ptrs", router_weight_buffer_ptrs),
                       ("d_router_weight_buffer_ptrs", d_router_weight_buffer_ptrs),
                       ("x_ptrs", x_ptrs)):
        one_rank(name, ptrs)
    limit = _checks.check_swiglu_limit(swiglu_limit)
    ring_knobs(num_comm_sms, macrobatch_size, minibatch_size)
    topk = _checks.check_int("topk", topk, minimum=1)
    T, H = rows_of("x", x)
    slots = T * topk
    dev = x.device
    _checks.check_tensor("d_x_routed_buffer", d_x_routed_buffer, x.dtype, (slots, H), dev)
    _checks.check_tensor("router_weight_buffer", router_weight_buffer,
                         _checks.router_dtype(x.dtype), (T, topk), dev)
    _checks.check_tensor("d_router_weight_buffer", d_router_weight_buffer,
                         _checks.router_dtype(x.dtype), (T, topk), dev)
    _checks.require_tensor("w_routed_gate", w_routed_gate)
    check_schedule(schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert,
                   w_routed_gate.shape[0], dev, slots, fake)
    ids, slot, used = slot_experts(schedule_peer_rank, schedule_peer_token_idx, num_tokens,
                                   tokens_per_expert, slots)
    x_slots = x.repeat_interleave(topk, dim=0)
    d_y_slots = d_y_buffer.repeat_interleave(topk, dim=0)
    w_slots = router_weight_buffer.reshape(slots, 1)
    d_x_slots, d_w_slots, d_gate, d_up, d_down, *_ = _layer_ops.backward(
        d_y_slots, x_slots, ids, w_slots, w_routed_gate, w_routed_up, w_routed_down, None, None,
        None, x_routed, gate_routed, up_routed, hidden_routed, None, None, None, 0,
        swiglu_limit=limit)
    # The shared expert alone: its routed context rows are never read (no slot is routed), so
    # they are left unwritten.
    ids_none, w_none = no_routed_slots(x)
    ws, config = _workspace.resolve(0)
    shape = _checks.LayerShape(T, H, w_routed_gate.shape[1], w_routed_gate.shape[0], 1,
                               w_shared_gate.shape[0], x.dtype, dev)
    unread = [x.new_empty(s) for s in _layer_tensors.context_shapes(ws, config, shape)[:4]]
    d_x_shared, _, _, _, _, d_shared_gate, d_shared_up, d_shared_down = _layer_ops.backward(
        d_y_buffer, x, ids_none, w_none, w_routed_gate, w_routed_up, w_routed_down,
        w_shared_gate, w_shared_up, w_shared_down, *unread, gate_shared, up_shared,
        hidden_shared, 0, swiglu_limit=limit)
    if not fake:
        d_x_routed_buffer.copy_(d_x_slots)
        d_router_weight_buffer.copy_(d_w_slots.reshape(T, topk))
    d_x_routed = torch.where(used.unsqueeze(1), d_x_slots[slot.clamp(max=slots - 1)],
                             torch.zeros((), dtype=x.dtype, device=dev))
    I = w_routed_gate.shape[1]
    not_produced = [x.new_empty((0, n)) for n in (I, I, I, I, I, I, H)]
    d_gs, d_gr, d_us, d_ur, d_hs, d_hr, d_yr = not_produced
    return (d_x_shared, d_x_routed, d_gs, d_gr, d_us, d_ur, d_hs, d_hr, d_yr, d_shared_gate,
            d_gate, d_shared_up, d_up, d_shared_down, d_down)


@torch.library.custom_op(
    "mok::dispatch_mlp_swiglu_combine_bwd_bf16",
    mutates_args=("d_x_routed_buffer", "d_router_weight_buffer", "x_routed", "gate_routed",
                  "up_routed", "hidden_routed"))
def dispatch_mlp_swiglu_combine_bwd_bf16(
        d_y_buffer: torch.Tensor, d_y_buffer_ptrs: list[int], d_x_routed_buffer: torch.Tensor,
        d_x_routed_buffer_ptrs: list[int], router_weight_buffer: torch.Tensor,
        router_weight_buffer_ptrs: list[int], d_router_weight_buffer: torch.Tensor,
        d_router_weight_buffer_ptrs: list[int], w_shared_gate: torch.Tensor,
        w_routed_gate: torch.Tensor, w_shared_up: torch.Tensor, w_routed_up: torch.Tensor,
        w_shared_down: torch.Tensor, w_routed_down: torch.Tensor, x_routed: torch.Tensor,
        gate_shared: torch.Tensor, gate_routed: torch.Tensor, up_shared: torch.Tensor,
        up_routed: torch.Tensor, hidden_shared: torch.Tensor, hidden_routed: torch.Tensor,
        x: torch.Tensor, x_ptrs: list[int], schedule_peer_rank: torch.Tensor,
        schedule_peer_token_idx: torch.Tensor, num_tokens: torch.Tensor,
        tokens_per_expert: torch.Tensor, topk: int, swiglu_limit: float | None,
        num_comm_sms: int, macrobatch_size: int, minibatch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoK's fused backward: (d_x_shared, d_x_routed, d_gate_shared, d_gate_routed, d_up_shared,
    d_up_routed, d_hidden_shared, d_hidden_routed, d_y_routed, d_w_shared_gate, d_w_routed_gate,
    d_w_shared_up, d_w_routed_up, d_w_shared_down, d_w_routed_down); d_x_routed_buffer and
    d_router_weight_buffer get each slot's d_x row and router-weight gradient. The context
    tensors are read, never written (MoK declares them mutated)."""
    return _bwd(d_y_buffer, d_y_buffer_ptrs, d_x_routed_buffer, d_x_routed_buffer_ptrs,
                router_weight_buffer, router_weight_buffer_ptrs, d_router_weight_buffer,
                d_router_weight_buffer_ptrs, w_shared_gate, w_routed_gate, w_shared_up,
                w_routed_up, w_shared_down, w_routed_down, x_routed, gate_shared, gate_routed,
                up_shared, up_routed, hidden_shared, hidden_routed, x, x_ptrs,
                schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert,
                topk, swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size, fake=False)


@dispatch_mlp_swiglu_combine_bwd_bf16.register_fake
def _bwd_fake(*args):
    return _bwd(*args, fake=True)


@torch.library.custom_op("mok::fwd_epilogue", mutates_args=())
def fwd_epilogue(y_shared: torch.Tensor, combine_buffer: torch.Tensor,
                 topk_weights: torch.Tensor, top_experts: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """out[t] = y_shared[t] + sum over j (increasing; slots with top_experts[t, j] < 0 skipped
    when top_experts is given) of topk_weights[t, j] * combine_buffer[t * k + j], in fp32,
    rounded once to y_shared's dtype."""
    return _fwd_epilogue(y_shared, combine_buffer, topk_weights, top_experts)


def _fwd_epilogue_checks(y_shared, combine_buffer, topk_weights, top_experts):
    _checks.require_tensor("y_shared", y_shared)
    if y_shared.dim() != 2 or y_shared.dtype not in _checks.ACTIVATION_DTYPES:
        _checks.fail("y_shared", "a bf16 (or float64) [num_local_tokens, hidden_size] tensor",
                     f"{_checks.dtype_name(y_shared.dtype)} {_checks.shape_text(y_shared.shape)}")
    T, H = y_shared.shape
    _checks.require_tensor("topk_weights", topk_weights)
    if topk_weights.dim() != 2:
        _checks.fail("topk_weights.shape", f"[{T}, topk]", _checks.shape_text(topk_weights.shape))
    k = topk_weights.shape[1]
    dev = y_shared.device
    _checks.check_tensor("y_shared", y_shared, y_shared.dtype, (T, H), dev)
    _checks.check_tensor("topk_weights", topk_weights, _checks.router_dtype(y_shared.dtype),
                         (T, k), dev)
    _checks.check_tensor("combine_buffer", combine_buffer, y_shared.dtype, (T * k, H), dev)
    if top_experts is not None:
        _checks.check_tensor("top_experts", top_experts, (torch.int32, torch.int64), (T, k), dev)
    return T, H, k


def _fwd_epilogue(y_shared, combine_buffer, topk_weights, top_experts):
    T, H, k = _fwd_epilogue_checks(y_shared, combine_buffer, topk_weights, top_experts)
    wide = torch.float64 if y_shared.dtype == torch.float64 else torch.float32
    rows = combine_buffer.reshape(T, k, H)
    acc = y_shared.to(wide)
    for j in range(k):
        term = topk_weights[:, j:j + 1].to(wide) * rows[:, j].to(wide)
        if top_experts is not None:
            term = torch.where(top_experts[:, j:j + 1] >= 0, term,
                               torch.zeros((), dtype=wide, device=term.device))
        acc = acc + term
    return acc.to(y_shared.dtype)


@fwd_epilogue.register_fake
def _fwd_epilogue_fake(y_shared, combine_buffer, topk_weights, top_experts=None):
    _fwd_epilogue_checks(y_shared, combine_buffer, topk_weights, top_experts)
    return y_shared.new_empty(y_shared.shape)


def _bwd_epilogue_checks(d_x_shared, d_x_routed_buffer):
    _checks.require_tensor("d_x_shared", d_x_shared)
    if d_x_shared.dim() != 2 or d_x_shared.dtype not in _checks.ACTIVATION_DTYPES:
        _checks.fail("d_x_shared", "a bf16 (or float64) [num_local_tokens, hidden_size] tensor",
                     f"{_checks.dtype_name(d_x_shared.dtype)} "
                     f"{_checks.shape_text(d_x_shared.shape)}")
    T, H = d_x_shared.shape
    _checks.require_tensor("d_x_routed_buffer", d_x_routed_buffer)
    rows = d_x_routed_buffer.shape[0] if d_x_routed_buffer.dim() == 2 else 0
    if T == 0 or rows == 0 or rows % T:
        _checks.fail("d_x_routed_buffer.shape", f"[{T} * topk, {H}]",
                     _checks.shape_text(d_x_routed_buffer.shape))
    _checks.check_tensor("d_x_routed_buffer", d_x_routed_buffer, d_x_shared.dtype, (rows, H),
                         d_x_shared.device)
    return T, H, rows // T


@torch.library.custom_op("mok::bwd_epilogue", mutates_args=())
def bwd_epilogue(d_x_shared: torch.Tensor, d_x_routed_buffer: torch.Tensor) -> torch.Tensor:
    """d_x[t] = d_x_shared[t] + sum over j (increasing) of d_x_routed_buffer[t * k + j], in fp32,
    rounded once."""
    T, H, k = _bwd_epilogue_checks(d_x_shared, d_x_routed_buffer)
    wide = torch.float64 if d_x_shared.dtype == torch.float64 else torch.float32
    rows = d_x_routed_buffer.reshape(T, k, H)
    acc = d_x_shared.to(wide)
    for j in range(k):
        acc = acc + rows[:, j].to(wide)
    return acc.to(d_x_shared.dtype)


@bwd_epilogue.register_fake
def _bwd_epilogue_fake(d_x_shared, d_x_routed_buffer):
    _bwd_epilogue_checks(d_x_shared, d_x_routed_buffer)
    return d_x_shared.new_empty(d_x_shared.shape)


@torch.library.custom_op("mok::all_gather_top_experts",
                         mutates_args=("all_gather_top_experts_buffer",))
def all_gather_top_experts(top_experts: torch.Tensor, all_gather_top_experts_buffer: torch.Tensor,
                           all_gather_top_experts_buffer_multicast_ptr: int, rank: int,
                           chunk_bytes: int) -> None:
    """Every rank's ids into the buffer [ep_size, T, k]; one rank (mok's error for several: this
    op has no group; mok.functional.build_schedule gathers through the workspace's group)."""
    _all_gather_checks(top_experts, all_gather_top_experts_buffer, rank, chunk_bytes)
    all_gather_top_experts_buffer[0].copy_(top_experts)


def _all_gather_checks(top_experts, buffer, rank, chunk_bytes):
    _checks.require_tensor("top_experts", top_experts)
    if top_experts.dim() != 2:
        _checks.fail("top_experts.shape", "[num_local_tokens, topk]",
                     _checks.shape_text(top_experts.shape))
    T, k = top_experts.shape
    _checks.check_tensor("top_experts", top_experts, torch.int32, (T, k), top_experts.device)
    _checks.require_tensor("all_gather_top_experts_buffer", buffer)
    W = buffer.shape[0] if buffer.dim() == 3 else -1
    _checks.check_tensor("all_gather_top_experts_buffer", buffer, torch.int32, (W, T, k),
                         top_experts.device)
    if W != 1:
        _checks.fail("all_gather_top_experts_buffer.shape[0]", "1 (mok runs MoK's ops on one "
                     "rank; mok.functional.build_schedule gathers every rank's ids through the "
                     "workspace's group)", W)
    if rank != 0:
        _checks.fail("rank", "0 (one rank)", rank)
    if chunk_bytes <= 0 or chunk_bytes % 16:
        _checks.fail("chunk_bytes", "a positive multiple of 16 (MoK's rule; unused)", chunk_bytes)


@all_gather_top_experts.register_fake
def _all_gather_fake(top_experts, buffer, multicast_ptr, rank, chunk_bytes):
    _all_gather_checks(top_experts, buffer, rank, chunk_bytes)


@torch.library.custom_op("mok::barrier_all", mutates_args=("barrier_buffer", "target"))
def barrier_all(barrier_buffer: torch.Tensor, barrier_buffer_ptrs: list[int],
                barrier_buffer_multicast_ptr: int, target: torch.Tensor) -> None:
    """One rank: nothing to wait for (as in MoK). Several: mok's error (mok.functional orders the
    ranks of a workspace's group itself)."""
    _barrier_checks(barrier_buffer, barrier_buffer_ptrs, target)


def _barrier_checks(barrier_buffer, barrier_buffer_ptrs, target):
    _checks.check_tensor("barrier_buffer", barrier_buffer, torch.int32, (1,),
                         barrier_buffer.device)
    _checks.check_tensor("target", target, torch.int32, (1,), barrier_buffer.device)
    one_rank("barrier_buffer_ptrs", barrier_buffer_ptrs)


@barrier_all.register_fake
def _barrier_fake(barrier_buffer, barrier_buffer_ptrs, multicast_ptr, target):
    _barrier_checks(barrier_buffer, barrier_buffer_ptrs, target)


def _schedule_shapes(topk_all, num_local_experts, schedule_capacity, rank):
    _checks.require_tensor("topk_all", topk_all)
    if topk_all.dim() != 3:
        _checks.fail("topk_all.shape", "[ep_size, num_local_tokens, topk]",
                     _checks.shape_text(topk_all.shape))
    W, T, k = topk_all.shape
    _checks.check_tensor("topk_all", topk_all, (torch.int32, torch.int64), (W, T, k),
                         topk_all.device)
    # Bounded before the table is sized from them: mok's bounds (Problem::validate).
    num_local_experts = _checks.check_int("num_local_experts", num_local_experts, minimum=1,
                                          maximum=_native.lib.max_experts // max(W, 1))
    schedule_capacity = _checks.check_int("schedule_capacity", schedule_capacity, minimum=T * k,
                                          maximum=_native.lib.max_size)
    rank = _checks.check_int("rank", rank, minimum=0, maximum=W - 1)
    if not any(isinstance(v, torch.SymInt) for v in (W, T, k)):  # symbolic: checked at run time
        _native.lib.schedule_capacity_rows(T, k, num_local_experts * W, W)  # the table's bounds
    rows = max(schedule_capacity, _schedule_terms.capacity_rows(W, T, k, num_local_experts))
    return W, T, k, rows


@torch.library.custom_op("mok::schedule", mutates_args=())
def schedule(topk_all: torch.Tensor, num_local_experts: int, schedule_capacity: int,
             rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert) of rank
    `rank` from every rank's ids [ep_size, T, k]: mok's table in MoK's terms (mok's order, 128-row
    padding, and max(schedule_capacity, the worst case) rows: mok/_schedule_terms.py). On CPU
    every id is checked (in [-1, num_local_experts * ep_size)); on CUDA ids outside this rank's
    experts are not scheduled here, and the layer checks every id on the device."""
    W, T, k, rows = _schedule_shapes(topk_all, num_local_experts, schedule_capacity, rank)
    if topk_all.device.type == "cpu":
        ids = topk_all.reshape(W * T, k).to(torch.int64).contiguous()  # alive during the call
        _native.lib.check_expert_ids_all_ranks(_native.view_of(ids), num_local_experts * W, W)
    return _schedule_terms.terms(topk_all, num_local_experts, rank, rows)[:4]


@schedule.register_fake
def _schedule_fake(topk_all, num_local_experts, schedule_capacity, rank):
    W, T, k, rows = _schedule_shapes(topk_all, num_local_experts, schedule_capacity, rank)
    new = lambda *s: topk_all.new_empty(s, dtype=torch.int32)  # noqa: E731
    return new(rows), new(rows), new(1), new(num_local_experts)
