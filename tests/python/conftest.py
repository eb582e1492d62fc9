"""Shared fixtures: a fresh random seed each run (printed at the start and the end of the run and
in every failed test's report; MOK_TEST_SEED=N replays it, for the tests' generators and torch's
global ones), poisoned outputs, and random layer data drawn the way mok's C++ tests draw it (well
scaled: unit-variance activations, weights uniform in +-1/sqrt(fan_in), router weights positive
and summing to 1).

GPU tests skip visibly without a GPU, always with a reason that says so (NO_GPU_REASON or
NO_CUDA_BACKEND_REASON): scripts/gpu-suite fails a GPU run on any such skip."""

import importlib.metadata
import os
import signal
import subprocess
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch
from poison import poisoned_outputs

import mok

SEED = int(os.environ.get("MOK_TEST_SEED", int.from_bytes(os.urandom(4), "little")))

# bf16 stores round with relative error at most u = 2^-8. As in src/synthetic/check.hpp, the bound
# on the relative Frobenius error is u times the number of bf16 stores on the longest path: 4 for
# the output (g/u, h, y, out), at most 5 for a gradient (plus one for fp32 accumulation): 6.
BF16_U = 2.0**-8
OUT_TOLERANCE = 4 * BF16_U
GRAD_TOLERANCE = 6 * BF16_U
# float64 mode: no rounding to bf16; only the order of fp64 sums differs from the reference. The
# first-order bound n * 2^-53 with reductions of at most n = 10^4 terms here.
F64_TOLERANCE = 1e4 * 2.0**-53


# The reasons GPU tests give when they cannot run. scripts/gpu-suite greps for "GPU" / "CUDA" in
# skip reasons: keep these words in them.
NO_GPU_REASON = "no CUDA GPU on this machine: GPU tests not run"
NO_CUDA_BACKEND_REASON = "a GPU is here but mok's CUDA backend is not available in this build"
HAVE_GPU = torch.cuda.is_available()
CUDA_READY = HAVE_GPU and mok.backend_available("cuda")
CUDA_SKIP_REASON = NO_GPU_REASON if not HAVE_GPU else NO_CUDA_BACKEND_REASON
# Marks a test that needs the GPU and mok's CUDA backend (skips with CUDA_SKIP_REASON otherwise).
requires_cuda = pytest.mark.skipif(not CUDA_READY, reason=CUDA_SKIP_REASON)
# Device parameter for tests that run on every backend: cpu always, cuda where it can run.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _transformers_skip_reason():
    """Why mok's Transformers integration cannot be tested here, or None. Read from the package's
    metadata: importing Transformers here would slow every test file."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "transformers is not installed (pip install .[transformers])"
    try:
        mok._versions.check_version("transformers", version, mok.TRANSFORMERS_MINIMUM)
    except ImportError as e:
        return str(e)
    return None


TRANSFORMERS_SKIP_REASON = _transformers_skip_reason()
if TRANSFORMERS_SKIP_REASON and HAVE_GPU:  # scripts/gpu-suite fails a GPU machine's GPU skips
    TRANSFORMERS_SKIP_REASON += " (on a GPU machine: its CUDA tests not run)"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long test the suite runs (deselect with -m 'not "
                            "slow')")


def pytest_report_header(config):
    gpu = (f"GPU: {torch.cuda.get_device_name()}, mok CUDA backend "
           f"{'available' if CUDA_READY else 'NOT available'}" if HAVE_GPU else "GPU: none")
    return [f"mok test seed: {SEED} (MOK_TEST_SEED={SEED} replays this run)", f"mok {gpu}"]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"mok test seed: {SEED} (MOK_TEST_SEED={SEED} replays this run)")


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every output mok allocates comes filled with NaN (integers with -1): poison.py."""
    with poisoned_outputs():
        yield


def seed_of(nodeid):
    """A test's own seed: the run's (SEED) and the test's id."""
    return SEED ^ zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def seeded_global_generators(request):
    """torch's global generators (CPU and CUDA) seeded from the test's seed, so that what a test
    draws from them (mok.nn.MoE's initialization, torch.randn without a generator) is replayed
    by MOK_TEST_SEED as well."""
    torch.manual_seed(seed_of(request.node.nodeid))


@pytest.fixture
def gen(request):
    """A generator seeded from the run's seed and the test's id."""
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))


@dataclass
class QuantizationCount:
    calls: int = 0


@pytest.fixture
def quantizations(monkeypatch):
    """Counts mok's FP8 weight quantizations (calls of _fp8_layer.quantize_weights, through which
    every path quantizes a bf16 weight) during the test: `quantizations.calls`."""
    from mok import _fp8_layer
    count, original = QuantizationCount(), _fp8_layer.quantize_weights

    def counting(w):
        count.calls += 1
        return original(w)

    monkeypatch.setattr(_fp8_layer, "quantize_weights", counting)
    return count


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says the seed that replays it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("mok seed", f"MOK_TEST_SEED={SEED} replays this test (its own "
                                f"seed: {seed_of(item.nodeid)})"))


@dataclass
class LayerData:
    x: torch.Tensor
    topk_experts: torch.Tensor
    topk_weights: torch.Tensor
    weights: tuple  # routed gate, up, down, shared gate, up, down (None when absent)
    d_out: torch.Tensor

    @property
    def has_shared(self):
        return self.weights[3] is not None

    def args(self):
        return (self.x, self.topk_experts, self.topk_weights, *self.weights)

    def requiring_grad(self):
        """Copies of the float inputs that require grad, for autograd through mok.moe."""
        leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
                  for t in (self.x, self.topk_weights, *self.weights)]
        return leaves

    def to(self, device):
        """The same data on `device`."""
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return LayerData(move(self.x), move(self.topk_experts), move(self.topk_weights),
                         tuple(move(w) for w in self.weights), move(self.d_out))


def uniform(gen, shape, bound, dtype):
    return ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound).to(dtype)


def make_layer(gen, T, H, I, E, k, S, *, dtype=torch.bfloat16, routing="random",
               unused_fraction=0.2):
    """routing: "random" (distinct experts per token, some slots -1), "one_expert" (every slot on
    one expert), "none" (every slot -1)."""
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
    if routing == "random":
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        ids[torch.rand(T, k, generator=gen) < unused_fraction] = -1
    elif routing == "one_expert":
        ids = torch.full((T, k), int(torch.randint(E, (1,), generator=gen)))
    elif routing == "none":
        ids = torch.full((T, k), -1)
    else:
        raise ValueError(routing)
    w = torch.rand(T, k, generator=gen, dtype=torch.float64) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).to(torch.float64 if dtype == torch.float64
                                            else torch.float32)
    routed = (uniform(gen, (E, I, H), H**-0.5, dtype), uniform(gen, (E, I, H), H**-0.5, dtype),
              uniform(gen, (E, H, I), I**-0.5, dtype))
    if S > 0:
        shared = (uniform(gen, (S, H), H**-0.5, dtype), uniform(gen, (S, H), H**-0.5, dtype),
                  uniform(gen, (H, S), S**-0.5, dtype))
    else:
        shared = (None, None, None)
    d_out = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
    return LayerData(x, ids.to(torch.int64).contiguous(), w.contiguous(), (*routed, *shared), d_out)


def rel_error(got, ref, scale=None):
    """Relative Frobenius error ||got - ref|| / ||scale|| (scale: ref unless given); a zero scale
    demands an exact result."""
    got, ref = got.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten, poisoned output?)"
    den = (ref if scale is None else scale.to("cpu", torch.float64)).norm()
    if den == 0:
        return float("inf") if bool((got != ref).any()) else 0.0
    return float((got - ref).norm() / den)


def torchrun(worker, nproc, args, timeout, what, env=None):
    """Runs `worker` under torchrun in `nproc` processes (its own process group, so that a hung run is
    killed with every process it started); its output, or a test failure naming `what` when it
    does not finish in `timeout` s or exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", worker, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"seed {SEED}: {what} ({nproc} processes) did not finish in {timeout} s:\n"
                    f"{out[-6000:]}")
    assert proc.returncode == 0, \
        f"seed {SEED}: torchrun exit status {proc.returncode}:\n{out[-8000:]}"
    return out


def passed_ranks(out, nproc, label):
    """The ranks whose "[rank R] LABEL: passed" line is in torchrun's output. NOTES: searched
    anywhere: the ranks' lines may interleave on one line."""
    return [r for r in range(nproc) if f"[rank {r}] {label}: passed" in out]
