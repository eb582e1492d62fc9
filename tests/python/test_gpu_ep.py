"""Expert parallelism across processes on CUDA: torchrun runs gpu_ep_worker.py with one process
per GPU (W = 2, and W = 4 where the machine has 4), each checking its results bit for bit
against one process running the whole layer, and a CUDA-graph step (gpu_ep_worker.py says
what). Needs at least two GPUs: with fewer it skips, saying so (PyTorch symmetric memory maps
each peer's memory from another device; one GPU is covered by the one-process external-team
test, LayerGpuExpertParallel.ExternalRanksGiveTheSingleGpuBits)."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import SEED

import mok

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_ep_worker.py")
SUITE_TIMEOUT = 300


@pytest.mark.parametrize("nproc", [2, 4])
def test_gpu_ep_bitwise_the_whole_layer(nproc):
    if not mok.backend_available("cuda"):
        pytest.skip("no CUDA GPU: the CUDA expert-parallel suite needs one GPU per rank")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"{torch.cuda.device_count()} CUDA GPU(s) here: the {nproc}-rank suite needs "
                    f"{nproc} GPUs (one per rank)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", WORKER, "--seed", str(SEED)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=SUITE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"seed {SEED}: the GPU EP suite ({nproc} processes) did not finish in "
                    f"{SUITE_TIMEOUT} s:\n{out[-6000:]}")
    report = out[-8000:]
    assert proc.returncode == 0, f"seed {SEED}: torchrun exit status {proc.returncode}:\n{report}"
    ranks = [r for r in range(nproc) if f"[rank {r}] GPU EP: passed" in out]
    assert ranks == list(range(nproc)), report
