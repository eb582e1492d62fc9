"""The package itself: version, and an extension that does not depend on torch's C++ ABI."""

import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import mok

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_version_is_the_cpp_version():
    header = (ROOT / "include" / "mok" / "version.hpp").read_text()
    assert mok.__version__ == re.search(r'kVersion = "([^"]+)"', header).group(1)


def test_cpu_backend_is_available():
    assert mok.backend_available("cpu")


def test_every_op_documents_itself():
    # help(mok.ops.X) shows the op's own docstring, not torch's CustomOpDef class text.
    import mok.ops

    generic = type(mok.ops.forward).__doc__
    for name in mok.ops.__all__:
        doc = getattr(mok.ops, name).__doc__
        assert doc and doc != generic and len(doc.split()) >= 5, (name, doc)


def test_extension_does_not_link_torch():
    if shutil.which("ldd") is None:
        pytest.skip("ldd not found")
    libs = subprocess.run(["ldd", mok._C.__file__], capture_output=True, text=True).stdout
    assert "libtorch" not in libs and "libc10" not in libs, libs


def test_tests_poison_mok_outputs():
    """conftest.py's autouse fixture (poison.py) fills every output mok allocates with NaN
    (integers with -1): an element a kernel forgets shows up. Production code has no switch for
    it: outside the fixture, outputs are torch.empty."""
    from poison import poisoned_outputs

    import mok._native

    assert mok._native.new_output((3,), torch.float32, torch.device("cpu")).isnan().all()
    assert (mok._native.new_output((3,), torch.int32, torch.device("cpu")) == -1).all()
    with poisoned_outputs(enabled=False):
        assert mok._native.new_output is torch.empty
