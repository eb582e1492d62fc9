"""Expert parallelism across processes on the CPU backend (gloo): torchrun runs
host_ep_worker.py in W = 2 and 4 processes on this machine, and every rank checks its results
bit for bit against one process holding every expert (host_ep_worker.py says what each suite
covers). A suite that hangs is killed after SUITE_TIMEOUT seconds and fails."""

import os

import pytest
from conftest import SEED, passed_ranks, torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ep_worker.py")
SUITE_TIMEOUT = 240


def run_suite(nproc, suite, *extra):
    out = torchrun(WORKER, nproc, ["--suite", suite, "--seed", str(SEED), *extra],
                   SUITE_TIMEOUT, f"the {suite} suite")
    return passed_ranks(out, nproc, f"host EP {suite}"), out[-8000:]


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
