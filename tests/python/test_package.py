"""The package itself: version, and an extension that does not depend on torch's C++ ABI."""

import pathlib
import re
import shutil
import subprocess

import pytest

import mok

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_version_is_the_cpp_version():
    header = (ROOT / "include" / "mok" / "version.hpp").read_text()
    assert mok.__version__ == re.search(r'kVersion = "([^"]+)"', header).group(1)


def test_cpu_backend_is_available():
    assert mok.backend_available("cpu")


def test_extension_does_not_link_torch():
    if shutil.which("ldd") is None:
        pytest.skip("ldd not found")
    libs = subprocess.run(["ldd", mok._C.__file__], capture_output=True, text=True).stdout
    assert "libtorch" not in libs and "libc10" not in libs, libs
