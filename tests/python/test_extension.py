"""The extension mok._C beside torch: its C++ runtime stays its own.

torch loads its own libstdc++ and CUDA runtime. An extension that links either statically (a
compiler wrapper, a manylinux toolchain, CUDA::cudart_static) and exports their symbols gets its
calls into them bound to torch's copies by the dynamic linker: halves of two runtimes meet in one
call, which crashed or corrupted state (iostream formatting printed empty numbers). mok._C now
exports PyInit__C and nothing else (src/python/exports.map). These tests check both the cause
(the dynamic symbol table) and the symptom (a message formatted by C++ iostreams, in a process
that imported torch first).
"""

import os
import pathlib
import struct
import subprocess
import sys
import textwrap
from typing import NamedTuple

import torch  # noqa: F401  (first, as the crash needs)

import mok
from mok import _C

TOPK_MESSAGE = "mok: invalid topk: expected at most num_experts = 4, got 5"


def _validate_topk_5_of_4():
    _C.validate_problem(num_tokens=8, hidden_size=64, intermediate_size=64, num_experts=4, topk=5,
                        shared_intermediate_size=0, ep_size=1, ep_rank=0,
                        activation_dtype="bfloat16")


def test_message_numbers_formatted_in_this_process():
    try:
        _validate_topk_5_of_4()
    except ValueError as e:
        assert str(e) == TOPK_MESSAGE
    else:
        raise AssertionError("validate_problem accepted topk = 5 with 4 experts")


def _python_with_this_mok(code, timeout=300):
    """Runs `code` in a fresh interpreter that imports the mok this test imported."""
    env = dict(os.environ)
    package_parent = str(pathlib.Path(mok.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_message_numbers_formatted_after_importing_torch_first():
    """A fresh process: torch, then mok._C (nothing of mok loaded before torch), then a
    validation error whose numbers C++ iostreams format."""
    result = _python_with_this_mok("""
        import sys
        import torch
        assert "mok" not in sys.modules
        from mok import _C
        try:
            _C.validate_problem(num_tokens=8, hidden_size=64, intermediate_size=64,
                                num_experts=4, topk=5, shared_intermediate_size=0, ep_size=1,
                                ep_rank=0, activation_dtype="bfloat16")
        except ValueError as e:
            print("MESSAGE:" + str(e))
        try:
            _C.validate_problem(num_tokens=8, hidden_size=48, intermediate_size=64,
                                num_experts=4, topk=2, shared_intermediate_size=0, ep_size=1,
                                ep_rank=0, activation_dtype="bfloat16")
        except ValueError as e:
            print("MESSAGE:" + str(e))
        """)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    messages = [line[len("MESSAGE:"):] for line in result.stdout.splitlines()
                if line.startswith("MESSAGE:")]
    assert messages == [TOPK_MESSAGE, "mok: invalid hidden_size: expected a multiple of 64 for "
                                      "bfloat16, got 48"], result.stdout + result.stderr


# A minimal ELF64 reader: the dynamic symbol table (.dynsym) of a shared object.
SHT_DYNSYM = 11
SHN_UNDEF = 0
STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE = 1, 2, 10
STV_DEFAULT, STV_PROTECTED = 0, 3


class Symbol(NamedTuple):
    name: str
    bind: int
    type: int
    visibility: int
    section: int

    @property
    def exported(self):
        """Defined here and visible to other objects (what the dynamic linker can bind to)."""
        return (self.section != SHN_UNDEF and self.bind in (STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE)
                and self.visibility in (STV_DEFAULT, STV_PROTECTED))


def dynamic_symbols(path):
    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b"\x7fELF", f"{path}: not an ELF file"
    assert data[4] == 2, f"{path}: not ELF64 (EI_CLASS = {data[4]})"
    endian = {1: "<", 2: ">"}[data[5]]
    e_shoff, = struct.unpack_from(endian + "Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from(endian + "HH", data, 0x3A)
    section = struct.Struct(endian + "IIQQQQIIQQ")  # Elf64_Shdr

    def header(i):
        return section.unpack_from(data, e_shoff + i * e_shentsize)

    if e_shnum == 0:  # extended numbering: the count is section 0's sh_size
        e_shnum = header(0)[5]
    sections = [header(i) for i in range(e_shnum)]
    dynsyms = [s for s in sections if s[1] == SHT_DYNSYM]
    assert len(dynsyms) == 1, f"{path}: {len(dynsyms)} .dynsym sections"
    _, _, _, _, offset, size, link, _, _, entsize = dynsyms[0]
    strtab = sections[link]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    sym = struct.Struct(endian + "IBBHQQ")  # Elf64_Sym
    entsize = entsize or sym.size
    assert entsize == sym.size
    symbols = []
    for at in range(offset, offset + size, entsize):
        st_name, st_info, st_other, st_shndx, _, _ = sym.unpack_from(data, at)
        name = names[st_name:names.index(b"\0", st_name)].decode()
        symbols.append(Symbol(name, st_info >> 4, st_info & 0xF, st_other & 0x3, st_shndx))
    return symbols


def test_elf_reader_finds_exports_and_imports():
    """The reader itself: torch's libc10 exports many c10 symbols; the extension imports Python's
    C API (undefined symbols, not exports)."""
    c10 = pathlib.Path(torch.__file__).parent / "lib" / "libc10.so"
    exported = [s for s in dynamic_symbols(c10) if s.exported]
    assert sum(s.name.startswith("_ZN3c10") for s in exported) > 100
    imports = [s for s in dynamic_symbols(_C.__file__) if s.section == SHN_UNDEF and s.name]
    assert any(s.name.startswith("Py") for s in imports)


def test_extension_exports_only_its_init_function():
    exported = sorted(s.name for s in dynamic_symbols(_C.__file__) if s.exported)
    assert exported == ["PyInit__C"], (
        f"{_C.__file__} exports {len(exported)} symbols; only PyInit__C may be (a statically "
        f"linked runtime would collide with torch's): {exported[:20]}")
