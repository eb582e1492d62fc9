"""mok: a Mixture-of-Experts training layer for NVIDIA Hopper GPUs, with a CPU reference backend.

    mok.functional  MoK's functional API (config, workspace, schedule, forward, backward)
    mok.ops         the kernels as torch.library custom ops (torch.compile-ready)
    mok.moe         the layer as one differentiable function
    mok.nn.MoE      a drop-in module with a PyTorch router
    mok.reference   the same layer in plain PyTorch (a baseline)

CPU tensors run mok's CPU reference backend (bf16, or float64 as an exact mode); CUDA tensors run
the CUDA backend. With a gloo torch.distributed group and CPU tensors, the CPU backend runs expert
parallelism across processes (mok.TimeoutError: a rank of the group did not arrive in time).
"""

from mok import _C

__version__ = _C.__version__

from mok import functional, nn, ops, reference  # noqa: E402
from mok._host_ep import TimeoutError  # noqa: E402,A001
from mok.nn import MoE, MoEStats, moe  # noqa: E402


def backend_available(backend: str) -> bool:
    """Whether this build and machine can run `backend` ("cpu" or "cuda")."""
    return _C.backend_available(backend)


__all__ = ["MoE", "MoEStats", "TimeoutError", "backend_available", "functional", "moe", "nn",
           "ops", "reference", "__version__"]
