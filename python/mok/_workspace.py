"""Workspaces on the Python side: handles for the ops, and the C++ workspaces behind them.

mok's C++ Workspace is sized from the whole Problem (T, H, I, E, k, S), the Config and the
precision, and holds scratch only: the forward context is tensors the caller owns (mok.ops returns
them), so one C++ workspace serves every layer of its shape. MoK's Python API creates a workspace
from (T, H, k) only, before the weights are seen, so a Python Workspace creates its C++ workspaces
lazily, one per layer shape and config it meets (a small LRU), sized from shapes only, never from
routing data. A C++ workspace that a CUDA graph captured is never dropped: the graph's replays
use its memory.

The ops (mok.ops) take a workspace as an int handle, so that torch.compile sees a constant. A
handle names a Python workspace and the config its calls use (`Workspace.handle_for(config)`);
handle 0 is the automatic workspace (default MoKConfig, any shape and device).
"""

import atexit
import collections
import itertools
import os
import threading
import weakref

import torch
import torch.distributed as dist

from mok import _checks, _native
from mok._config import MoKConfig

_MAX_CORES = 8  # C++ workspaces kept per Python workspace (distinct layer shapes and configs)
_handles = itertools.count(1)
_registry: "dict[int, tuple[weakref.ref, object]]" = {}  # handle -> (workspace, config)
_registry_lock = threading.Lock()
_automatic = None
_by_config: "dict[object, Workspace]" = {}
_shared_lock = threading.Lock()


class _Core:
    """One C++ workspace. `lock` serializes the host side of the calls that use it (their
    enqueue; the CPU backend's whole call); it orders nothing on the device: calls on several
    CUDA streams are ordered there by the C++ workspace itself. `captured`: a call ran while a
    CUDA graph was being captured, so the graph holds its memory and the LRU must keep it."""

    def __init__(self, native):
        self.native = native
        self.lock = threading.Lock()
        self.captured = False
        self.symmetric = None  # CUDA team across processes: (region, bases, handle)

    def run(self, fn, device, *args, **kwargs):
        """fn(native workspace, *args, **kwargs): an extension entry point, for CUDA on the
        device's current PyTorch stream (no waiting)."""
        with self.lock:
            if device.type != "cuda":
                return fn(self.native, *args, **kwargs)
            with torch.cuda.device(device):
                self.native.set_stream(torch.cuda.current_stream(device).cuda_stream)
                return fn(self.native, *args, **kwargs)


def _capturing(device):
    """Whether this call is being captured into a CUDA graph (its workspace then outlives it)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _layout_key(shape, config, fp8=False, token_axis=True):
    return (shape.num_tokens, shape.hidden_size, shape.intermediate_size, shape.num_experts,
            shape.topk, shape.shared_intermediate_size, shape.activation_dtype, shape.device,
            config, fp8, fp8 and token_axis)


# MoK's MoKWorkspace buffer fields that mok does not have as Python tensors (see __getattr__).
_MOK_BUFFER_FIELDS = frozenset(
    f"{b}{suffix}" for b in ("x_buffer", "combine_buffer", "d_y_buffer", "d_x_routed_buffer",
                             "router_weight_buffer", "d_router_weight_buffer",
                             "all_gather_top_experts_buffer", "barrier_buffer")
    for suffix in ("", "_handle", "_ptrs", "_multicast_ptr")) | {"barrier_target"}


class Workspace:
    """mok's workspace (MoK's MoKWorkspace): group and the fixed shapes it serves, and scratch.

    Create it with mok.functional.get_workspace / create_workspace. Fields left None (the automatic
    workspace and mok.nn.MoE's) follow the tensors of each call. Layers that share a workspace
    may call it from several threads and on several CUDA streams: each C++ workspace orders the
    calls on its scratch on the device (a call on another stream waits for the one before it,
    without a host synchronization), so they never race on it.
    """

    def __init__(self, config, *, group=None, ep_rank=0, ep_size=1, device=None,
                 num_local_tokens=None, hidden_size=None, topk=None):
        self.config = config  # the config of `handle`; calls may pass another (handle_for)
        # NOTES: held weakly. torch.distributed keeps every group mok accepts until
        # destroy_process_group(); a strong reference from mok's cached workspaces (get_workspace,
        # mok.nn.MoE's) kept a destroyed gloo group's worker threads running into interpreter
        # exit, where one releasing its last collective's tensors aborts the process.
        self._group = None if group is None else weakref.ref(group)
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.device = device
        self.num_local_tokens = num_local_tokens
        self.hidden_size = hidden_size
        self.topk = topk
        self._cores = collections.OrderedDict()
        self._cores_lock = threading.Lock()
        self._dropped_counts = (0, 0, 0)  # call_counts of the C++ workspaces the LRU dropped
        self._retired = []  # C++ workspaces the LRU dropped, not yet freed (core())
        self._handles = {}
        self.handle = self.handle_for(config)

    # MoK's scalar fields. `schedule_capacity` has mok's meaning: the routed rows the table holds
    # whatever the routing, every slot of every rank (W * T * k; the table adds each local
    # expert's padding to that, MoKSchedule says how much). MoK sizes it from
    # config.schedule_capacity_multiplier; mok's table cannot overflow, so the multiplier sizes
    # nothing.
    @property
    def group(self):
        """The process group (None: one device, or the group is gone: destroyed, unpickled)."""
        return None if self._group is None else self._group()

    @property
    def group_name(self):
        """The group's name ("" for group=None: one device)."""
        return getattr(self.group, "group_name", "") if self.group is not None else ""

    @property
    def schedule_capacity(self):
        if self.num_local_tokens is None or self.topk is None:
            return None
        return self.ep_size * self.num_local_tokens * self.topk

    def __getattr__(self, name):
        # Only reached for names the class lacks: MoK's symmetric buffers and peer pointers.
        if name in _MOK_BUFFER_FIELDS:
            raise AttributeError(
                f"mok: invalid workspace.{name}: expected one of mok's workspace fields (mok keeps "
                f"its buffers in the C++ workspace of each layer shape, not as MoK's tensors and "
                f"peer pointers), got a MoK buffer field")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def handle_for(self, config):
        """The op handle that runs this workspace's calls with `config`."""
        with _registry_lock:
            handle = self._handles.get(config)
            if handle is None:
                handle = self._handles[config] = next(_handles)
                _registry[handle] = (weakref.ref(self, _forget(handle)), config)
            return handle

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in (
            "device", "num_local_tokens", "hidden_size", "topk", "ep_size", "ep_rank"))
        return f"Workspace(handle={self.handle}, {fields}, layers={len(self._cores)})"

    # A copied or unpickled workspace is a new, empty one with the same settings (a copy keeps
    # the process group; an unpickled one has none: process groups do not pickle).
    def __reduce__(self):
        return (_rebuild, (self.config, self.ep_rank, self.ep_size, self.device,
                           self.num_local_tokens, self.hidden_size, self.topk))

    def __deepcopy__(self, memo):
        return _rebuild(self.config, self.ep_rank, self.ep_size, self.device,
                        self.num_local_tokens, self.hidden_size, self.topk, self.group)

    @property
    def bytes(self):
        """Memory (device memory on CUDA) held by the C++ workspaces created so far."""
        return sum(c.native.bytes for c in list(self._cores.values()))

    @property
    def call_counts(self):
        """(forward, recompute_forward_context, backward) calls run through this workspace."""
        with self._cores_lock:
            counts = [self._dropped_counts] + [c.native.call_counts for c in self._cores.values()]
        return tuple(sum(c[i] for c in counts) for i in range(3))

    def check_x(self, x):
        """x against this workspace's device and (T, H), before anything else of a call is
        checked: an x that does not fit the workspace is named as x, not as the first tensor
        that disagrees with it. Metadata only."""
        if not isinstance(x, torch.Tensor):
            return  # the call's own checks name it
        if self.device is not None and x.device != self.device:
            _checks.fail("x.device", f"{_checks.device_name(self.device)} (the workspace's device)",
                         _checks.device_name(x.device))
        if x.dim() != 2:
            return
        for i, field, want in ((0, "num_local_tokens", self.num_local_tokens),
                               (1, "hidden_size", self.hidden_size)):
            if want is not None and x.shape[i] != want:
                _checks.fail(f"x.shape[{i}]", f"{want} (the workspace's {field})", x.shape[i])

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

    def context_rows(self, shape, config):
        """(x_rows, routed_rows) of the forward context for `shape` and `config` (no workspace
        is created: fake implementations call this too)."""
        # NOTES: meta tensors (shape inference) take the layout of the backend a real call would
        # run on where no device says which: CUDA when it is available.
        backend = shape.device.type if shape.device.type in ("cpu", "cuda") else "auto"
        return _native.lib.context_rows(**_native_args(shape, config, self.ep_size, self.ep_rank),
                               backend=backend,
                               activation_dtype=_checks.dtype_name(shape.activation_dtype))

    def core(self, shape, config, fp8=False, token_axis=True):
        """The C++ workspace for `shape` and `config` (`fp8`: the FP8 layer's, which on CUDA holds
        its scratch beside the bf16 layer's; the CPU needs none: one workspace serves both;
        `token_axis` False: that scratch without the token-axis copies, which only e4m3 weight
        gradients read: WorkspaceOptions::fp8_token_axis, for precision 'fp8-bf16-wgrad'),
        created on its first call, which must run
        outside CUDA graph capture: creating it allocates and zeroes device memory with
        synchronous CUDA calls, so a first call during capture raises mok's error asking for one
        eager call (a warm-up) first. Beyond _MAX_CORES the least recently used are retired,
        except those a CUDA graph captured (kept for good: a graph's replays use them). A retired
        one is freed (cudaFree synchronizes the device) only at the next creation of a C++
        workspace, a call that makes synchronous CUDA calls anyway and never runs during capture,
        and only once no call is running on it."""
        fp8 = fp8 and shape.device.type == "cuda"
        key = _layout_key(shape, config, fp8, token_axis)
        capturing = _capturing(shape.device)
        with self._cores_lock:
            core = self._cores.get(key)
            if core is not None:
                self._cores.move_to_end(key)
                core.captured = core.captured or capturing
                return core
            if capturing:
                _checks.fail(
                    "the first call of a layer of this shape and config",
                    "a call outside CUDA graph capture (it creates the layer's C++ workspace, "
                    "allocating and zeroing device memory synchronously): run one step eagerly, "
                    "a warm-up, before capturing", "a first call during capture")
            self._free_retired()
            d = shape.device
            symmetric = None
            extra = {}
            if d.type == "cuda" and self.ep_size > 1:
                symmetric = _symmetric_region(self, shape, config)
                extra = dict(symmetric_bases=symmetric[1], barrier_timeout_ms=barrier_timeout_ms)
            native = _native.lib.Workspace(
                **_native_args(shape, config, self.ep_size, self.ep_rank), backend=d.type,
                activation_dtype=_checks.dtype_name(shape.activation_dtype),
                num_threads=torch.get_num_threads(),
                device_index=d.index if d.index is not None else 0, fp8=fp8,
                fp8_token_axis=bool(token_axis), **extra)
            if symmetric is not None:
                # Every rank's team exists (its flags zeroed) before any rank's first signal.
                group_barrier(self.group, d)
            core = self._cores[key] = _Core(native)
            core.symmetric = symmetric  # keeps the symmetric memory mapped while the core lives
            droppable = [k for k, c in self._cores.items() if not c.captured and k != key]
            for k in droppable[:max(0, len(self._cores) - _MAX_CORES)]:  # oldest first
                dropped = self._cores.pop(k)
                self._dropped_counts = tuple(
                    a + b for a, b in zip(self._dropped_counts, dropped.native.call_counts))
                self._retired.append(dropped)
            return core

    def _free_retired(self):
        """Frees the retired C++ workspaces no call is running on (their last reference)."""
        self._retired = [c for c in self._retired if c.lock.locked()]

    def _release_at_exit(self):
        """Frees the C++ workspaces no call is running on, but a CUDA team's (its symmetric
        memory is the process group's to tear down). A later call would make them again."""
        with self._cores_lock:
            for key, core in list(self._cores.items()):
                if core.symmetric is None and not core.lock.locked():
                    del self._cores[key]
            self._retired = [c for c in self._retired
                             if c.symmetric is not None or c.lock.locked()]


@atexit.register
def _release_all_at_exit():
    """Every live workspace's C++ workspaces, freed before the interpreter's teardown.
    NOTES: shared workspaces are module globals (automatic(), for_config(), get_workspace()'s
    cache, Transformers' configure()). With Transformers imported, the interpreter freed them only
    after the extension's teardown, which reported them as leaked (`nanobind: leaked 1 instances`,
    on every exit of a script that ran a model on mok; 2026-12-07)."""
    with _registry_lock:
        live = [ref() for ref, _config in _registry.values()]
    for ws in {id(w): w for w in live if w is not None}.values():
        ws._release_at_exit()


# Every device-side wait of a CUDA team across processes for a peer gives up after this long; the
# next call then raises mok's error naming the rank and the flag (MOK_BARRIER_TIMEOUT_MS).
barrier_timeout_ms = int(os.environ.get("MOK_BARRIER_TIMEOUT_MS", "10000"))


def _symmetric_region(ws, shape, config):
    """This rank's symmetric region for a CUDA team across processes, from PyTorch symmetric
    memory on the workspace's group: (tensor, every rank's base address, handle). A collective:
    every rank of the group creates its C++ workspace for this shape and config in the same call.
    NOTES: no NVLink multicast is asked for or used (only the peers' unicast addresses)."""
    from torch.distributed import _symmetric_memory as symm_mem  # a PyTorch with CUDA EP only

    nbytes = _native.lib.symmetric_workspace_bytes(
        **_native_args(shape, config, ws.ep_size, ws.ep_rank))
    region = symm_mem.empty(nbytes, dtype=torch.uint8, device=shape.device)
    group_name = ws.group.group_name if ws.group is not None else dist.group.WORLD.group_name
    handle = symm_mem.rendezvous(region, group_name)
    bases = [int(p) for p in handle.buffer_ptrs]
    if len(bases) != ws.ep_size or handle.rank != ws.ep_rank:
        _checks.fail("group", f"a symmetric-memory group of {ws.ep_size} ranks with this process "
                     f"at rank {ws.ep_rank}", f"{len(bases)} ranks, this process at {handle.rank}")
    return region, bases, handle


def group_barrier(group, device):
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


def group_key(group):
    """What workspaces of a group are cached by: its name (None for one device)."""
    if group is None:
        return None
    name = getattr(group, "group_name", None)
    return name if name is not None else id(group)


def group_rank_size(group):
    """(rank, size) of this process in `group`; (0, 1) for None (one device)."""
    if group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        _checks.fail("group", "None (one device) or a process group of an initialized "
                     "torch.distributed", "a group while torch.distributed is not initialized")
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def check_group(group, device, rank):
    """A group of several ranks: expert parallelism across processes. On CPU tensors over a gloo
    group (mok/_host_ep.py); on CUDA through PyTorch symmetric memory on the group, the device
    moving the rows (src/cuda/layer/layer.cu)."""
    if rank < 0:
        _checks.fail("group", "a group this process is a member of", "a group without it")
    if device.type == "cuda":
        try:
            from torch.distributed import _symmetric_memory  # noqa: F401
        except ImportError as e:
            _checks.fail("group", "a group on a PyTorch with torch.distributed._symmetric_memory "
                         "(expert parallelism across processes on CUDA)", str(e))
        return
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        _checks.fail("group", "a group with the gloo backend (expert parallelism across "
                     "processes on CPU tensors moves them with gloo)", f"backend {backend!r}")


def _native_args(shape, c, ep_size, ep_rank):
    return dict(num_tokens=shape.num_tokens, hidden_size=shape.hidden_size,
                intermediate_size=shape.intermediate_size,
                num_experts=shape.num_experts * ep_size, topk=shape.topk,
                shared_intermediate_size=shape.shared_intermediate_size, ep_size=ep_size,
                ep_rank=ep_rank, fwd_num_comm_sms=c.fwd_num_comm_sms,
                bwd_num_comm_sms=c.bwd_num_comm_sms, minibatch_size=c.minibatch_size,
                macrobatch_size=c.macrobatch_size,
                schedule_capacity_multiplier=float(c.schedule_capacity_multiplier),
                forward_path=c.forward_path, fused_stage_rows=c.fused_stage_rows)


def _rebuild(config, ep_rank, ep_size, device, num_local_tokens, hidden_size, topk, group=None):
    return Workspace(config, group=group, ep_rank=ep_rank, ep_size=ep_size, device=device,
                     num_local_tokens=num_local_tokens, hidden_size=hidden_size, topk=topk)


def _forget(handle):
    def forget(_ref):
        with _registry_lock:
            _registry.pop(handle, None)
    return forget


def automatic():
    """Handle 0: default MoKConfig, one device, any shape."""
    global _automatic
    with _shared_lock:
        if _automatic is None:
            _automatic = Workspace(MoKConfig())
        return _automatic


def for_config(config):
    """The shared workspace of one device for `config` (any shape): mok.nn.MoE modules of one
    config share it, and with it every C++ workspace of their shape."""
    if config is None or config == MoKConfig():
        return automatic()
    with _shared_lock:
        ws = _by_config.get(config)
        if ws is None:
            ws = _by_config[config] = Workspace(config)
        return ws


_by_group: "dict[tuple, Workspace]" = {}


def for_group(config, group, ep_rank, ep_size):
    """The shared workspace of an EP group for `config` (any shape): mok.nn.MoE modules with that
    group and config share it."""
    config = MoKConfig() if config is None else config
    key = (group_key(group), config)
    with _shared_lock:
        ws = _by_group.get(key)
        if ws is None:
            ws = _by_group[key] = Workspace(config, group=group, ep_rank=ep_rank, ep_size=ep_size)
        return ws


def resolve(handle):
    """(workspace, config) of an op handle."""
    if handle == 0:
        ws = automatic()
        return ws, ws.config
    entry = _registry.get(handle)
    ws = entry[0]() if entry is not None else None
    if ws is None:
        _checks.fail("workspace", "the handle of a live mok workspace (or 0: automatic)", handle)
    return ws, entry[1]
