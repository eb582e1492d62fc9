"""Poisoned outputs for tests: every output tensor mok allocates for its C++ core to write
(mok._native.new_output) comes filled with NaN (integers with -1), so an element a kernel forgets
to write shows up as NaN or -1 instead of whatever the allocator held.

pytest tests get it from conftest.py's autouse fixture; a script (e.g. a torchrun worker) calls
`install()` once after importing mok.
"""

import contextlib

import torch

import mok._native


def poisoned_output(shape, dtype, device):
    fill = float("nan") if dtype.is_floating_point else -1
    return torch.full(shape, fill, dtype=dtype, device=device)


def install():
    """Poisons mok's outputs from now on, in this process."""
    mok._native.new_output = poisoned_output


@contextlib.contextmanager
def poisoned_outputs(enabled=True):
    """Poisons mok's outputs inside the block (or, with enabled=False, makes sure they are not)."""
    was = mok._native.new_output
    mok._native.new_output = poisoned_output if enabled else torch.empty
    try:
        yield
    finally:
        mok._native.new_output = was
