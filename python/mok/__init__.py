"""mok: a Mixture-of-Experts training layer for NVIDIA Hopper GPUs, with a CPU reference backend.

    mok.functional  MoK's functional API (config, workspace, schedule, forward, backward)
    mok.ops         the kernels as torch.library custom ops (torch.compile-ready)
    mok.moe         the layer as one differentiable function (mok.moe_packed: gate and up packed
                    in one [E, 2I, H] tensor, as Hugging Face stores them)
    mok.nn.MoE      a drop-in module with a PyTorch router
    mok.reference   the same layer in plain PyTorch (a baseline)

CPU tensors run mok's CPU reference backend (bf16, or float64 as an exact mode); CUDA tensors run
the CUDA backend. With a gloo torch.distributed group and CPU tensors, the CPU backend runs expert
parallelism across processes (mok.TimeoutError: a rank of the group did not arrive in time).

The package's modules, bottom up: each imports only modules listed above it, at its top, and
uses no other module's private names (tests/python/test_imports.py checks both).

    _C, reference, _schedule_terms   the extension (src/python/binding.cpp); plain-torch modules
    _native          the one handle on the extension; tensors as its views; output allocation
    _checks          argument checks (mok's error messages)
    _config          MoKConfig
    _grouped_gemm    the grouped GEMM forms as custom ops
    _fp8             MoK's mxfp8_quantize as a custom op
    _workspace       workspaces: handles, the C++ workspaces of each layer shape, groups
    _layer_tensors   a layer call's context, outputs and gradient buffers
    _host_ep         expert parallelism across processes on the CPU backend
    _layer_ops       the layer's custom ops and their autograd
    _fp8_layer       the FP8 layer's ops, its autograd and the weights' quantization cache
    _fake            their fake implementations
    functional, nn   MoK's functional API; mok.moe and mok.nn.MoE
    _kittens_compat  MoK's ops layer (mok.ops.schedule, dispatch_mlp_swiglu_combine_*, ...)
    ops              the public ops
"""

import re as _re

import torch as _torch

# The oldest PyTorch mok runs on: the Python suite passes on the CPU with torch 2.9, 2.10, 2.11
# and 2.15 (2026-12-07). Older ones fail at import (2.4, 2.6: torch.library cannot read the ops'
# annotations) or in parts (2.8: torch.compile hides mok's refusal of an unchecked module).
TORCH_MINIMUM = (2, 9)
# The oldest Transformers mok.integrations.transformers runs on (checked when that module is
# imported). Before 5.7.0 from_pretrained and set_experts_implementation accept only Transformers'
# own names ("eager", "grouped_mm", "batched_mm", "deepgemm"), not one registered in the
# ExpertsInterface: refused with 5.0.0, 5.5.4, 5.6.0 and 5.6.2 on the CPU (2026-12-07); before 5.0
# there is no ExpertsInterface.
TRANSFORMERS_MINIMUM = (5, 7)


def _check_version(package, version, minimum):
    """ImportError naming `version` (`package`'s __version__) when it is older than `minimum`, a
    (major, minor) pair."""
    found = _re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(int(n) for n in found.groups()) < minimum:
        raise ImportError(f"mok: invalid {package} version: expected {minimum[0]}.{minimum[1]} "
                          f"or newer, got {version}")


def _check_torch(version):
    """ImportError naming `version` (torch.__version__) when it is older than TORCH_MINIMUM."""
    _check_version("torch", version, TORCH_MINIMUM)


_check_torch(_torch.__version__)

from mok import _native  # noqa: E402

__version__ = _native.lib.__version__

from mok import functional, nn, ops, reference  # noqa: E402
from mok._host_ep import TimeoutError  # noqa: E402,A001
from mok.nn import MoE, MoEStats, moe, moe_packed  # noqa: E402


def backend_available(backend: str) -> bool:
    """Whether this build and machine can run `backend` ("cpu" or "cuda")."""
    return _native.lib.backend_available(backend)


__all__ = ["MoE", "MoEStats", "TimeoutError", "backend_available", "functional", "moe",
           "moe_packed", "nn", "ops", "reference", "__version__"]
