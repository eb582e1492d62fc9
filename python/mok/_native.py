"""The bottom of mok's Python package: the extension handle and the bridge from torch tensors to it.

Every other module reaches mok's C++ core (the extension `mok._C`, src/python/binding.cpp) through
`lib` here, turns tensors into the extension's views with `view_of` / `views`, and allocates the
outputs it hands to C++ with `new_output`. This module imports no other mok module; the package's
modules form layers above it (mok/__init__.py lists them; tests/python/test_imports.py checks that
no module imports one above it).
"""

import torch

from mok import _C as lib  # noqa: N812  (the one handle on the extension)


def dtype_name(dtype):
    """A torch dtype as mok names it (and as the extension reads it): "bfloat16", "int64", ..."""
    return str(dtype).removeprefix("torch.")


def view_of(t):
    """The view tuple the extension takes (src/python/binding.cpp), or None for an absent tensor:
    (data_ptr, dtype, shape, strides, device type, device index, math bit). The math bit is
    "negated" or "conjugated" for a tensor with torch's negation or conjugation bit set (a lazy
    view whose memory holds the values before that operation), else "": the extension refuses
    such a view, naming the argument, rather than read its memory as the tensor's values. (mok's
    custom ops never see one: PyTorch's dispatcher resolves the bit of an op's inputs first.)"""
    if t is None:
        return None
    d = t.device
    bit = "negated" if t.is_neg() else "conjugated" if t.is_conj() else ""
    return (t.data_ptr(), dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), d.type,
            d.index if d.index is not None else 0, bit)


def views(*tensors):
    return [view_of(t) for t in tensors]


def new_output(shape, dtype, device):
    """An uninitialized tensor for an output mok's C++ core writes. NOTES: the tests fill these
    with NaN (integers with -1) by replacing this function (tests/python/poison.py), so an element
    a kernel forgets shows up: allocate every such output here, through the module attribute."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch(fn, device, *args):
    """fn(*args, stream): an extension entry point that enqueues on a cudaStream_t, on `device`'s
    current PyTorch stream (no waiting)."""
    with torch.cuda.device(device):
        fn(*args, torch.cuda.current_stream(device).cuda_stream)
