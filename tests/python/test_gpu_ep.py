"""Expert parallelism across processes on CUDA: torchrun runs gpu_ep_worker.py with one process
per GPU (W = 2, and W = 4 and 8 where the machine has them), each checking its results bit for
bit against one process running the whole layer, a CUDA-graph step, the FP8 layer likewise, and a
rank that never calls (gpu_ep_worker.py says what). Needs at least two GPUs: with fewer it skips,
saying so. NOTES: several processes on one GPU cannot share PyTorch symmetric memory: its
rendezvous refuses "allocations from overlapping devices from different ranks"
(CUDASymmetricMemory.cu; reported in yifuwang/symm-mem-recipes#5 and vllm-project/vllm#25070). One
GPU is covered by the one-process external-team tests (ExternalRanksGiveTheSingleGpuBits of
LayerGpuExpertParallel and Fp8LayerGpuExpertParallel), which run the same device code."""

import os

import pytest
import torch
from conftest import SEED, passed_ranks, torchrun

import mok

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_ep_worker.py")
SUITE_TIMEOUT = 300


@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_gpu_ep_bitwise_the_whole_layer(nproc):
    if not mok.backend_available("cuda"):
        pytest.skip("no CUDA GPU: the CUDA expert-parallel suite needs one GPU per rank")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"{torch.cuda.device_count()} CUDA GPU(s) here: the {nproc}-rank suite needs "
                    f"{nproc} GPUs (one per rank)")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    out = torchrun(WORKER, nproc, ["--seed", str(SEED)], SUITE_TIMEOUT, "the GPU EP suite", env)
    assert passed_ranks(out, nproc, "GPU EP") == list(range(nproc)), out[-8000:]
