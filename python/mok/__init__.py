"""mok: a Mixture-of-Experts training layer for NVIDIA Hopper GPUs, with a CPU reference backend.

    mok.functional  MoK's functional API (config, workspace, schedule, forward, backward)
    mok.ops         the kernels as torch.library custom ops (torch.compile-ready)
    mok.moe         the layer as one differentiable function (mok.moe_packed: gate and up packed
                    in one [E, 2I, H] tensor, as Hugging Face stores them)
    mok.nn.MoE      a drop-in module with a PyTorch router
    mok.reference   the same layer in plain PyTorch (a baseline)
    mok.integrations.transformers   experts_implementation="mok" in Hugging Face Transformers

CPU tensors run mok's CPU reference backend (bf16, or float64 as an exact mode); CUDA tensors run
the CUDA backend. With a gloo torch.distributed group and CPU tensors, the CPU backend runs expert
parallelism across processes (mok.TimeoutError: a rank of the group did not arrive in time).

The package's modules, bottom up: each imports only modules on the lines above it, at its top,
and uses no other module's private names (tests/python/test_imports.py checks all three).

    _C, reference, _schedule_terms   the extension (src/python/binding.cpp); plain-torch modules
    _versions        the oldest torch and Transformers mok runs on (checked before anything else)
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
    _fake            the layer ops' fake implementations
    nn               mok.moe, mok.moe_packed and mok.nn.MoE
    _kittens_compat  MoK's ops layer (mok.ops.schedule, dispatch_mlp_swiglu_combine_*, ...)
    _mx_calls        MoK's MXFP8 calls on mok's FP8 layer (MX weight tuples, the *_mxfp8 ops)
    functional       MoK's functional API
    ops              the public ops
    integrations, integrations.transformers   Hugging Face's experts_implementation="mok"
                                               (imported by the user, never by mok itself)
"""

import torch as _torch

from mok import _versions
from mok._versions import TORCH_MINIMUM, TRANSFORMERS_MINIMUM  # noqa: F401

_versions.check_version("torch", _torch.__version__, TORCH_MINIMUM)

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
