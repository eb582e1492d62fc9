"""Expert parallelism across processes on the CPU backend (gloo): torchrun runs
host_ep_worker.py in W = 2 and 4 processes on this machine, and every rank checks its results
bit for bit against one process holding every expert (host_ep_worker.py says what each suite
covers). A suite that hangs is killed after SUITE_TIMEOUT seconds and fails."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import SEED

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ep_worker.py")
SUITE_TIMEOUT = 240


def run_suite(nproc, suite, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", WORKER, "--suite", suite, "--seed", str(SEED), *extra]
    # Its own session, so that a hung suite is killed with every process it started.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SUITE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"seed {SEED}: the {suite} suite ({nproc} processes) did not finish in "
                    f"{SUITE_TIMEOUT} s:\n{out[-6000:]}")
    report = out[-8000:]
    assert proc.returncode == 0, f"seed {SEED}: torchrun exit status {proc.returncode}:\n{report}"
    # NOTES: searched anywhere in the output: the ranks' lines may interleave on one line.
    ranks = [r for r in range(nproc) if f"[rank {r}] host EP {suite}: passed" in out]
    return ranks, report


@pytest.mark.parametrize("nproc", [2, 4])
def test_layer_bitwise_the_one_process_layer(nproc):
    ranks, report = run_suite(nproc, "layer")
    assert ranks == list(range(nproc)), report


def test_mismatches_and_a_rank_that_never_calls():
    ranks, report = run_suite(2, "errors", "--timeout", "3")
    assert ranks == [0, 1], report


def test_a_rank_that_dies():
    ranks, report = run_suite(2, "dead", "--timeout", "20")
    assert ranks == [0], report  # rank 1 is the one that died
