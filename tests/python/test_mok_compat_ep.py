"""MoK users' calls at several ranks: MoK's public functional API under torchrun with W = 2 and 4
CPU processes over gloo (the CPU form of mok's expert parallelism), written the way MoK's own
distributed tests call it. mok_compat_ep_worker.py says what each suite checks: on every rank, the
schedule's MoK fields against a table derived from every rank's ids, the output, context and every
gradient against the independent fp64 reference with MoK's tolerances, and the bits of one
process holding every expert over all ranks' tokens. A suite that hangs is killed after
SUITE_TIMEOUT seconds and fails; the group's own timeout (TIMEOUT) bounds every wait inside it."""

import os

import pytest
from conftest import SEED, passed_ranks, torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mok_compat_ep_worker.py")
SUITE_TIMEOUT = 150
TIMEOUT = 30  # the gloo group's, s


def run_suite(nproc, suite):
    out = torchrun(WORKER, nproc, ["--suite", suite, "--seed", str(SEED), "--timeout",
                                   str(TIMEOUT)], SUITE_TIMEOUT, f"the MoK-compat {suite} suite")
    return passed_ranks(out, nproc, f"mok compat EP {suite}"), out[-8000:]


@pytest.mark.parametrize("nproc", [2, 4])
def test_functional_at_several_ranks_matches_the_reference_and_one_process(nproc):
    """MoK's shapes and routings on WORLD and on EP subgroups: schedule fields, output, context,
    gradients and main grads on every rank (layer suite)."""
    ranks, report = run_suite(nproc, "layer")
    assert ranks == list(range(nproc)), report


@pytest.mark.parametrize("nproc", [2, 4])
def test_workspace_cache_validation_and_clear_at_several_ranks(nproc):
    """MoKWorkspace's fields, get_workspace's cache, validate_workspace_args, validate_inputs,
    MoK's failure cases raised on every rank, clear_workspace_cache as a barrier (api suite)."""
    ranks, report = run_suite(nproc, "api")
    assert ranks == list(range(nproc)), report
