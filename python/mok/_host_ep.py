"""Expert parallelism across processes on the CPU backend.

A workspace made with a torch.distributed group of W ranks (gloo, CPU tensors) runs mok's calls
as expert parallelism: rank r holds its own T tokens and the experts [r*E/W, (r+1)*E/W). The
maths is mok's C++ core (include/mok/host_ep.hpp, the CPU reference); this file moves the rows:

  every call   all-gather a fixed-size header (the call, the shapes, the dtype, the config and
               this rank's own argument error, if any): every rank compares them and raises the
               same error, naming the field and each rank's value, before any data moves
  forward      all-gather x and topk_experts -> this rank's experts compute their rows
               -> all-to-all of the combine rows -> the home reduction over j (fixed order)
  recompute    all-gather x and topk_experts -> the context rows (nothing goes back)
  backward     all-gather x, topk_experts, topk_weights, d_out -> this rank's experts' backward
               (dx rows, d_w entries, the local experts' weight gradients) -> all-to-all of both
               -> the home reductions
  schedule     all-gather topk_experts: every rank checks every rank's ids

The FP8 layer (mok/_fp8_layer.py) runs the same exchange with its expert halves (the twelve
quantized views of this rank's experts beside the bf16 weights); the header carries the
precision, so ranks calling different layers raise.

Every output and gradient is bitwise that of one process holding every expert, over the tokens
of all ranks in rank order (the shared expert's weight gradients: those of this rank's own
tokens, as a data-parallel replica's). Every wait is bounded by the group's timeout
(init_process_group / new_group `timeout=`): a rank that never calls makes the others raise
mok.TimeoutError, naming the call and what it waited for. After a timeout the group's
connections are closed (gloo): make a new group.
"""

import builtins

import torch
import torch.distributed as dist

from mok import _checks, _layer_tensors, _native
from mok._native import lib, view_of, views
from mok._config import FORWARD_PATHS, PRECISIONS  # the header's precision field: an index

# NOTES: torch.distributed.nn.functional's functions take `group=group.WORLD` as default
# arguments, evaluated at its import; torch._dynamo imports it (through torch.distributed.fsdp),
# and the first call of any custom op imports torch._dynamo: mok's first call, after the script's
# init_process_group. Those defaults then held the default group past destroy_process_group(),
# and with it gloo's worker threads into interpreter exit, where one releasing the last
# collective's tensors takes the GIL during finalization and the process aborts (std::terminate).
# Imported here, at `import mok`, before init_process_group, the defaults are None.
if torch.distributed.is_available() and not torch.distributed.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401


class TimeoutError(RuntimeError, builtins.TimeoutError):  # noqa: A001 (mok.TimeoutError)
    """A bounded wait of mok gave up: a rank of the EP group did not arrive in time."""


_CALLS = ("build_schedule", "forward", "recompute_forward_context", "backward",
          "backward_main_grad")
_DTYPES = (None, torch.bfloat16, torch.float64)
# The header's fields, in order, with the names a mismatch is reported by.
_FIELDS = ("num_tokens (x.shape[0])", "hidden_size (x.shape[1])",
           "intermediate_size (routed_gate_weights.shape[1])",
           "num_local_experts (routed_gate_weights.shape[0])", "topk (topk_experts.shape[1])",
           "shared_intermediate_size (shared_gate_weights.shape[0])", "activation dtype (x.dtype)",
           "config.fwd_num_comm_sms", "config.bwd_num_comm_sms", "config.minibatch_size",
           "config.macrobatch_size", "config.schedule_capacity_multiplier",
           "config.forward_path", "config.fused_stage_rows", "precision")
_ERROR_TYPES = (ValueError, TypeError, RuntimeError)
_MESSAGE_BYTES = 1024


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _Exchange:
    """The collectives of one call of rank `ep_rank` over the workspace's group, each wait turned
    into mok's error naming the call and what it waited for."""

    def __init__(self, ws, call):
        if ws.group is None:  # unpickled, or its group destroyed (workspaces hold it weakly)
            _checks.fail("workspace", "a workspace with its process group (get_workspace or "
                         "create_workspace in this process)", f"a workspace of {ws.ep_size} "
                         "ranks without a group (unpickled, or the group destroyed?)")
        self.group, self.rank, self.size, self.call = ws.group, ws.ep_rank, ws.ep_size, call

    def _where(self):
        return f"{self.call} on rank {self.rank} of an EP group of {self.size} ranks"

    def _run(self, what, fn):
        try:
            return fn()
        except RuntimeError as e:  # gloo's errors (DistBackendError is a RuntimeError)
            text = _first_line(e)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise TimeoutError(
                    f"mok: {self._where()} gave up waiting for {what} from the other ranks "
                    f"(the group's timeout): a rank did not call {self.call}, or died; the "
                    f"group is unusable after this ({text})") from e
            raise RuntimeError(f"mok: {self._where()} failed while exchanging {what}: "
                               f"{text}") from e

    def all_gather(self, t, what):
        """Every rank's `t` (the same shape on each), concatenated in rank order."""
        t = t.contiguous()
        out = _native.new_output((self.size * t.shape[0], *t.shape[1:]), t.dtype, t.device)
        self._run(what, lambda: dist.all_gather(list(out.chunk(self.size)), t, group=self.group))
        return out

    def all_to_all(self, send, send_counts, receive_counts, what):
        """Rows [sum(send_counts), ...] out, rank q getting send_counts[q] of them in rank order;
        rows [sum(receive_counts), ...] in, from each rank in rank order."""
        received = _native.new_output((sum(receive_counts), *send.shape[1:]), send.dtype,
                                      send.device)
        self._run(what, lambda: dist.all_to_all_single(
            received, send, output_split_sizes=list(receive_counts),
            input_split_sizes=list(send_counts), group=self.group))
        return received

    def agree(self, config, check, precision="bf16"):
        """Runs this rank's argument checks (`check() -> (LayerShape or None, topk)`), exchanges
        the header, and raises on every rank when any rank's checks failed or the ranks disagree
        on a shape, the dtype, the config or the precision. Returns the shape."""
        shape, error = None, None
        try:
            shape = check()
        except _ERROR_TYPES as e:
            error = e
        header = self.all_gather(_header(self.call, shape, config, error, precision),
                                 "the call's header")
        header = header.reshape(self.size, -1)
        if error is not None:
            raise error
        calls = [_CALLS[int(h[0])] for h in header]
        if any(c != self.call for c in calls):
            raise RuntimeError("mok: the ranks of the EP group called different ops: " +
                               ", ".join(f"{c} on rank {r}" for r, c in enumerate(calls)))
        for q in range(self.size):
            message = _error_of(header[q])
            if message is not None:
                kind, text = message
                raise kind(f"mok: rank {q} of the EP group rejected its {self.call} call, so "
                           f"every rank does: {text}")
        values = header[:, 2:2 + len(_FIELDS)]
        for i, name in enumerate(_FIELDS):
            column = values[:, i]
            if bool((column != column[0]).any()):
                seen = ", ".join(f"{_field_text(i, int(v))} on rank {r}"
                                 for r, v in enumerate(column))
                _checks.fail(name, "the same value on every rank of the EP group", seen)
        return shape


def _field_text(i, value):
    name = _FIELDS[i]
    if name.startswith("activation dtype"):
        return _checks.dtype_name(_DTYPES[value]) if 0 < value < len(_DTYPES) else "unknown"
    if name == "config.forward_path":
        return repr(FORWARD_PATHS[value]) if 0 <= value < len(FORWARD_PATHS) else "unknown"
    if name == "precision":
        return repr(PRECISIONS[value]) if 0 <= value < len(PRECISIONS) else "unknown"
    if name == "config.schedule_capacity_multiplier":
        return str(torch.tensor([value], dtype=torch.int64).view(torch.float64).item())
    return str(value)


def _header(call, shape, config, error, precision="bf16"):
    """int64 [2 + len(_FIELDS) + 2 + _MESSAGE_BYTES]: call, has-error, fields, the error's type
    and its message in UTF-8 bytes (one per entry)."""
    fields = [-1] * 7
    if shape is not None:
        fields = [shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                  shape.num_experts, shape.topk, shape.shared_intermediate_size,
                  _DTYPES.index(shape.activation_dtype) if shape.activation_dtype else 0]
    multiplier = torch.tensor([float(config.schedule_capacity_multiplier)], dtype=torch.float64)
    fields += [config.fwd_num_comm_sms, config.bwd_num_comm_sms, config.minibatch_size,
               config.macrobatch_size, int(multiplier.view(torch.int64).item()),
               FORWARD_PATHS.index(config.forward_path), config.fused_stage_rows,
               PRECISIONS.index(precision)]
    text = b"" if error is None else str(error).encode()[:_MESSAGE_BYTES]
    kind = 0 if error is None else 1 + next(i for i, t in enumerate(_ERROR_TYPES)
                                            if isinstance(error, t))
    head = torch.zeros(2 + len(_FIELDS) + 2 + _MESSAGE_BYTES, dtype=torch.int64)
    head[0] = _CALLS.index(call)
    head[1] = error is not None
    head[2:2 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
    at = 2 + len(_FIELDS)
    head[at] = kind
    head[at + 1] = len(text)
    head[at + 2:at + 2 + len(text)] = torch.tensor(list(text), dtype=torch.int64)
    return head


def _error_of(head):
    """(exception type, message) a rank's header carries, or None."""
    if not int(head[1]):
        return None
    at = 2 + len(_FIELDS)
    kind, n = int(head[at]), int(head[at + 1])
    text = bytes(head[at + 2:at + 2 + n].tolist()).decode(errors="replace")
    return _ERROR_TYPES[kind - 1], text


class _Shape:
    """The header's fields of a call that has no layer shape (build_schedule)."""

    def __init__(self, num_tokens, num_experts, topk):
        self.num_tokens, self.num_experts, self.topk = num_tokens, num_experts, topk
        self.hidden_size = self.intermediate_size = self.shared_intermediate_size = 0
        self.activation_dtype = None


def build_schedule(ws, config, topk_experts, num_experts, num_local_experts, first):
    """Every rank's ids checked on every rank; returns the rows per local expert over all ranks
    (int32 [num_local_experts]) and every rank's ids ([W * T, k], in rank order)."""
    ex = _Exchange(ws, "build_schedule")

    def check():  # metadata only: the ids are checked once gathered, the same on every rank
        _checks.require_tensor("topk_experts", topk_experts)
        _checks.check_schedule_args(topk_experts, num_experts, num_local_experts, first)
        return _Shape(topk_experts.shape[0], num_local_experts, topk_experts.shape[1])

    ex.agree(config, check)
    ids_all = ex.all_gather(topk_experts, "every rank's topk_experts")
    lib.check_expert_ids_all_ranks(view_of(ids_all), num_experts, ws.ep_size)
    return (_layer_tensors.count_rows(ids_all, num_experts, num_local_experts, first),
            ids_all)


def _precision(fp8_weights, fp8_weight_grads):
    if fp8_weights is None:
        return "bf16"
    return "fp8" if fp8_weight_grads else "fp8-bf16-wgrad"


def forward(ws, config, x, topk_experts, topk_weights, weights, swiglu_limit=None,
            fp8_weights=None, fp8_weight_grads=True):
    """`fp8_weights` (the twelve views of mok/_fp8_layer.py's quantize_weights of this rank's
    gate, up and down): the FP8 layer's expert half; `fp8_weight_grads` only names the precision
    in the header, so that ranks calling with different precisions raise."""
    ex = _Exchange(ws, "forward")

    def check():
        ws.check_x(x)
        shape = _checks.check_layer(x, topk_experts, topk_weights, *weights,
                                    ep_size=ws.ep_size)
        ws.check_shape(shape)
        return shape

    shape = ex.agree(config, check, _precision(fp8_weights, fp8_weight_grads))
    core = ws.core(shape, config)
    out = _native.new_output((shape.num_tokens, shape.hidden_size), shape.activation_dtype,
                             shape.device)
    context = _layer_tensors.new_context(ws, config, shape)
    ctx_views = _layer_tensors.context_views(context)
    with core.lock:
        x_all = ex.all_gather(x, "every rank's x")
        ids_all = ex.all_gather(topk_experts, "every rank's topk_experts")
        send, receive = lib.host_ep_counts(core.native, view_of(ids_all))
        combine_send = _native.new_output((sum(send), shape.hidden_size), shape.activation_dtype,
                                          x.device)
        lib.host_ep_expert_forward(core.native, *views(x_all, ids_all, *weights, combine_send),
                                   *ctx_views, swiglu_limit=swiglu_limit,
                                   fp8_weights=_fp8_views(fp8_weights))
        received = ex.all_to_all(combine_send, send, receive, "the combine rows")
        lib.host_ep_home_forward(core.native, *views(x, topk_experts, topk_weights, *weights,
                                                     received, out), *ctx_views,
                                 swiglu_limit=swiglu_limit)
    return (out, *context)


def recompute_forward_context(ws, config, x, topk_experts, weights, swiglu_limit=None,
                              fp8_weights=None):
    """`fp8_weights`: the FP8 layer's (the gate's and up's eight views; down's four None)."""
    ex = _Exchange(ws, "recompute_forward_context")

    def check():
        ws.check_x(x)
        shape = _checks.check_layer(x, topk_experts, None, *weights, with_topk_weights=False,
                                    with_down=False, ep_size=ws.ep_size)
        ws.check_shape(shape)
        return shape

    shape = ex.agree(config, check, _precision(fp8_weights, True))
    core = ws.core(shape, config)
    context = _layer_tensors.new_context(ws, config, shape)
    ctx_views = _layer_tensors.context_views(context)
    with core.lock:
        x_all = ex.all_gather(x, "every rank's x")
        ids_all = ex.all_gather(topk_experts, "every rank's topk_experts")
        lib.host_ep_expert_forward(core.native, *views(x_all, ids_all, *weights, None),
                                   *ctx_views, swiglu_limit=swiglu_limit,
                                   fp8_weights=_fp8_views(fp8_weights))
        lib.host_ep_home_forward(core.native, *views(x, topk_experts, None, *weights, None, None),
                                 *ctx_views, swiglu_limit=swiglu_limit)
    return context


def backward(ws, config, d_out, x, topk_experts, topk_weights, weights, context, main=None,
             swiglu_limit=None, fp8_weights=None, fp8_weight_grads=True):
    """All gradients (main None), or (d_x, d_topk_weights) with the weight gradients added into
    the six fp32 `main` buffers (routed gate, up, down, shared gate, up, down). `fp8_weights`:
    the FP8 layer's expert half (forward's), with e4m3 routed weight gradients or, with
    `fp8_weight_grads` False, bf16 ones."""
    ex = _Exchange(ws, "backward" if main is None else "backward_main_grad")

    def check():
        ws.check_x(x)
        shape = _checks.check_layer(x, topk_experts, topk_weights, *weights,
                                    ep_size=ws.ep_size)
        ws.check_shape(shape)
        _checks.check_d_out(d_out, shape)
        if main is not None:
            _checks.check_main_grads(shape, main)
        _layer_tensors.check_context(context, _layer_tensors.context_shapes(ws, config, shape),
                                     shape)
        return shape

    shape = ex.agree(config, check, _precision(fp8_weights, fp8_weight_grads))
    core = ws.core(shape, config)
    act, H = shape.activation_dtype, shape.hidden_size
    if main is None:
        d_x, d_w, routed, shared = _layer_tensors.grad_buffers(shape, act)
        grads = (d_x, d_w, *routed, *shared)
    else:
        d_x, d_w = _layer_tensors.grad_buffers(shape, None)
        grads = (d_x, d_w, *main)
    ctx_views = _layer_tensors.context_views(context)
    with core.lock:
        x_all = ex.all_gather(x, "every rank's x")
        ids_all = ex.all_gather(topk_experts, "every rank's topk_experts")
        w_all = ex.all_gather(topk_weights, "every rank's topk_weights")
        d_out_all = ex.all_gather(d_out, "every rank's d_out")
        send, receive = lib.host_ep_counts(core.native, view_of(ids_all))
        dx_send = _native.new_output((sum(send), H), act, x.device)
        dw_send = _native.new_output((sum(send),), _checks.router_dtype(act), x.device)
        accumulate = main is not None
        lib.host_ep_expert_backward(core.native, *views(x_all, ids_all, w_all, *weights),
                                    *ctx_views, *views(d_out_all, dx_send, dw_send, *grads),
                                    accumulate_weight_grads=accumulate, swiglu_limit=swiglu_limit,
                                    fp8_weights=_fp8_views(fp8_weights),
                                    fp8_weight_grads=fp8_weight_grads)
        dx_received = ex.all_to_all(dx_send, send, receive, "the dx rows")
        dw_received = ex.all_to_all(dw_send, send, receive, "the router-weight gradients")
        lib.host_ep_home_backward(core.native, *views(x, topk_experts, topk_weights, *weights),
                                  *ctx_views, *views(d_out, dx_received, dw_received, *grads),
                                  accumulate_weight_grads=accumulate, swiglu_limit=swiglu_limit)
    return grads


def _fp8_views(fp8_weights):
    return None if fp8_weights is None else tuple(views(*fp8_weights))
