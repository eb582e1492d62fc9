"""Workspaces on the Python side: handles for the ops, and the C++ workspaces behind them.

mok's C++ Workspace is sized from the whole Problem (T, H, I, E, k, S) and the precision. MoK's
Python API creates a workspace from (T, H, k) only, before the weights are seen, so a Python
Workspace creates its C++ workspaces lazily, one per layer shape it meets (a small LRU), sized from
shapes only, never from routing data.

The ops (mok.ops) take a workspace as an int handle, so that torch.compile sees a constant:
handle 0 is the automatic workspace (default MoKConfig, any shape and device), other handles are
Workspace objects, registered here while they live.

The forward context lives in the C++ workspace. A workspace may serve several layers (MoK's
get_workspace shares one across layers of equal shape), so every forward gets a token (a number,
returned as a one-element CPU tensor that travels with the autograd graph) and each C++ workspace
remembers the token of the context it holds, and the tensors (data pointers and shapes) it was
built from; backward rebuilds the context from its own inputs (recompute_forward_context) when
either differs. That rebuild gives the same bits as the
original forward: the CPU backend is deterministic.
"""

import collections
import itertools
import threading
import weakref

import torch

from mok import _C, _checks

_MAX_CORES = 8  # C++ workspaces kept per Python workspace (distinct layer shapes)
_handles = itertools.count(1)
_tokens = itertools.count(1)
_registry: "dict[int, weakref.ref[Workspace]]" = {}
_automatic = None
_automatic_lock = threading.Lock()


def new_token():
    """A number no other forward context has had."""
    return next(_tokens)


def tensors_key(*tensors):
    """Which tensors a context was built from (their values are the token's business)."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors)


class _Core:
    """One C++ workspace and the forward context it holds: its token (None: no valid context)
    and the tensors_key of its inputs."""

    def __init__(self, native):
        self.native = native
        self.context_token = None
        self.context_tensors = None
        self.lock = threading.Lock()


class Workspace:
    """mok's workspace (MoK's MoKWorkspace): config, group and the fixed shapes it serves.

    Create it with mok.functional.get_workspace / create_workspace. Fields left None (the automatic
    workspace and nn.MoE's own) follow the tensors of each call.
    """

    def __init__(self, config, *, group=None, ep_rank=0, ep_size=1, device=None,
                 num_local_tokens=None, hidden_size=None, topk=None):
        self.config = config
        self.group = group
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.device = device
        self.num_local_tokens = num_local_tokens
        self.hidden_size = hidden_size
        self.topk = topk
        self._cores = collections.OrderedDict()
        self._cores_lock = threading.Lock()
        self.handle = next(_handles)
        _registry[self.handle] = weakref.ref(self, _forget(self.handle))

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in (
            "device", "num_local_tokens", "hidden_size", "topk", "ep_size", "ep_rank"))
        return f"Workspace(handle={self.handle}, {fields}, layers={len(self._cores)})"

    # A copied or unpickled workspace is a new, empty one with the same settings.
    def __reduce__(self):
        return (_rebuild, (self.config, self.ep_rank, self.ep_size, self.device,
                           self.num_local_tokens, self.hidden_size, self.topk))

    def __deepcopy__(self, memo):
        return _rebuild(self.config, self.ep_rank, self.ep_size, self.device,
                        self.num_local_tokens, self.hidden_size, self.topk)

    @property
    def bytes(self):
        """Host memory held by the C++ workspaces created so far."""
        return sum(c.native.bytes for c in self._cores.values())

    def check_shape(self, shape):
        """The call's tensors against the shapes this workspace was created for."""
        if self.device is not None and shape.device != self.device:
            _checks.fail("x.device", f"{_checks.device_name(self.device)} (the workspace's device)",
                         _checks.device_name(shape.device))
        fixed = (("x.shape[0]", "num_local_tokens", self.num_local_tokens, shape.num_tokens),
                 ("x.shape[1]", "hidden_size", self.hidden_size, shape.hidden_size),
                 ("topk_experts.shape[1]", "topk", self.topk, shape.topk))
        for arg, field, want, got in fixed:
            if want is not None and want != got:
                _checks.fail(arg, f"{want} (the workspace's {field})", got)

    def core(self, shape):
        """The C++ workspace for `shape`, created on first use."""
        key = (shape.num_tokens, shape.hidden_size, shape.intermediate_size, shape.num_experts,
               shape.topk, shape.shared_intermediate_size, shape.activation_dtype, shape.device)
        with self._cores_lock:
            core = self._cores.get(key)
            if core is not None:
                self._cores.move_to_end(key)
                return core
            c, d = self.config, shape.device
            native = _C.Workspace(
                num_tokens=shape.num_tokens, hidden_size=shape.hidden_size,
                intermediate_size=shape.intermediate_size,
                num_experts=shape.num_experts * self.ep_size, topk=shape.topk,
                shared_intermediate_size=shape.shared_intermediate_size, ep_size=self.ep_size,
                ep_rank=self.ep_rank, fwd_num_comm_sms=c.fwd_num_comm_sms,
                bwd_num_comm_sms=c.bwd_num_comm_sms, minibatch_size=c.minibatch_size,
                macrobatch_size=c.macrobatch_size,
                schedule_capacity_multiplier=c.schedule_capacity_multiplier,
                backend=d.type, activation_dtype=_checks.dtype_name(shape.activation_dtype),
                num_threads=torch.get_num_threads(),
                device_index=d.index if d.index is not None else 0)
            core = self._cores[key] = _Core(native)
            while len(self._cores) > _MAX_CORES:
                self._cores.popitem(last=False)
            return core


def _rebuild(config, ep_rank, ep_size, device, num_local_tokens, hidden_size, topk):
    return Workspace(config, ep_rank=ep_rank, ep_size=ep_size, device=device,
                     num_local_tokens=num_local_tokens, hidden_size=hidden_size, topk=topk)


def _forget(handle):
    return lambda _ref: _registry.pop(handle, None)


def automatic():
    """Handle 0: default MoKConfig, one device, any shape."""
    global _automatic
    with _automatic_lock:
        if _automatic is None:
            from mok.functional import MoKConfig

            _automatic = Workspace(MoKConfig())
        return _automatic


def resolve(handle):
    if handle == 0:
        return automatic()
    ref = _registry.get(handle)
    ws = ref() if ref is not None else None
    if ws is None:
        _checks.fail("workspace", "the handle of a live mok workspace (or 0: automatic)", handle)
    return ws
