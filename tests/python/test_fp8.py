"""mok.ops.mxfp8_quantize (torch.ops.mok.mxfp8_quantize) against a reference written from MoK's
own (MoK's tests/utils.py, run_mxfp8_quantize_reference: amax per 1x32 block, scale exponent
ceil(log2(amax / 448)), x / 2^e to float8_e4m3fn, the E8M0 bytes in the tcgen05 layout), with
tolerance zero as MoK's tests compare, on CPU and CUDA, 2-D and 3-D, normal-only, transposed-only
and both; blocks MoK's tests never draw (all zero, tiny, huge, inf, NaN) against the same reference
extended by the rules of MoK's kernel that mok follows; the fake implementation; bad inputs.
"""

import pytest
import torch

import mok
from conftest import DEVICES

E4M3_NAN = 0x7F


def mx_reference(x):
    """One orientation of MoK's quantizer: x [E, R, C] (bf16) -> (data [E, R, C] as uint8 bytes,
    scales uint8 [E * R // 128, C // 128, 32, 16]).

    MoK's reference computes exponent = ceil(log2(amax / 448)) clamped from below at -127 and
    q = float8_e4m3fn(x / 2^exponent); MoK's kernel, which mok follows, differs where that
    reference never goes: the exponent is clamped to [-39, 127] (the kernel's max(., 1e-12) and
    its saturating E8M0 conversion), NaN is left out of amax (__hmax), an exponent of 127 multiplies
    by 0 (the kernel's reciprocal (254 - byte) << 23), and every NaN is stored as 0x7F (the
    conversion instruction's NaN; torch keeps the sign)."""
    E, R, C = x.shape
    xf = x.float().reshape(E * R, C // 32, 32)
    a = xf.abs()
    amax = torch.where(a.isnan(), torch.zeros_like(a), a).amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / 448.0)).clamp(min=-39, max=127)
    inverse = torch.where(exponent == 127, torch.zeros_like(exponent), torch.exp2(-exponent))
    q = (xf * inverse.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(q.view(torch.float8_e4m3fn).float().isnan(),
                    torch.full_like(q, E4M3_NAN), q).reshape(E, R, C)
    byte = (exponent + 127).to(torch.uint8)  # [E * R, C // 32]
    # tcgen05's scale-factor layout: row r, block j at [r // 128, j // 4, r % 32, (r % 128) // 32,
    # j % 4], the last two merged into 16.
    sc = byte.reshape(E * R // 128, 4, 32, C // 128, 4).permute(0, 3, 2, 1, 4)
    return q, sc.reshape(E * R // 128, C // 128, 32, 16).contiguous()


def reference(x, normal, transposed):
    three = x.dim() == 3
    x3 = x if three else x.unsqueeze(0)
    out = [None] * 4
    if normal:
        q, sc = mx_reference(x3)
        out[0], out[1] = (q if three else q[0]), sc
    if transposed:
        q, sc = mx_reference(x3.transpose(-2, -1).contiguous())
        out[2], out[3] = (q if three else q[0]), sc
    return out


def bits(t):
    return None if t is None else t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bitwise(got, want):
    for name, g, w in zip(("x_fp8", "x_sc", "x_fp8_t", "x_sc_t"), got, want):
        if w is None:
            assert g is None, f"{name} should be None"
            continue
        assert g.dtype == (torch.float8_e4m3fn if "fp8" in name else torch.uint8), name
        g = bits(g).cpu()
        assert g.shape == w.shape, f"{name}: {tuple(g.shape)} vs {tuple(w.shape)}"
        bad = (g != w).nonzero()
        assert len(bad) == 0, f"{name}: {len(bad)} of {g.numel()} bytes differ, the first at " \
                              f"{tuple(bad[0].tolist())}: {g[tuple(bad[0])]} vs {w[tuple(bad[0])]}"


SHAPES = [(256, 384), (3, 128, 256), (1, 384, 128)]
LAYOUTS = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("normal,transposed", LAYOUTS, ids=["both", "normal", "transposed"])
def test_mxfp8_quantize_is_moks_bit_for_bit(gen, device, shape, normal, transposed):
    x = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16)  # as MoK's tests draw it
    want = reference(x, normal, transposed)
    got = mok.ops.mxfp8_quantize(x.to(device), normal, transposed)
    assert_bitwise(got, want)
    again = torch.ops.mok.mxfp8_quantize(x.to(device), normal, transposed)
    assert_bitwise(again, want)


def edge_source(gen):
    """[2, 128, 256]: 1x32 blocks (along N; the transposed ones cut across them) of every kind MoK's
    tests never draw."""
    x = torch.randn((2, 128, 256), generator=gen)
    blocks = x.view(2, 128, 8, 32)
    blocks[0, :4, 0] = 0.0                                  # all zero: 2^-39
    blocks[0, 4:8, 1] = -0.0
    blocks[0, 8:16, 2] *= 2.0**-70                          # tiny: below the clamp
    blocks[0, 16, 2] = torch.randn(32, generator=gen) * 2.0**-133  # bf16 subnormals
    blocks[0, 17:20, 4] *= 2.0**120                         # huge
    blocks[0, 20, 5, 7] = 3.3895313892515355e38             # bf16's largest
    blocks[0, 21, 5, 3] = 448.0 * 2.0**10                   # amax exactly 448 * 2^k
    blocks[0, 22, 5, 3] = 450.0 * 2.0**10                   # one bf16 step above
    blocks[1, 0, 0, 5] = float("inf")                       # inf: 2^127, values 0
    blocks[1, 1, 1, 6] = float("-inf")
    blocks[1, 2, 2, 7] = float("nan")                       # NaN among values: left out of amax
    blocks[1, 3, 3] = float("nan")                          # NaN only
    blocks[1, 4, 4, 0] = float("nan")
    blocks[1, 4, 4, 1] = float("inf")
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_quantize_edge_blocks_follow_moks_kernel(gen, device):
    x = edge_source(gen)
    want = reference(x, True, True)
    assert_bitwise(mok.ops.mxfp8_quantize(x.to(device), True, True), want)
    q, sc = want[0], want[1]

    def exponent(r, j):  # of flattened row r, 1x32 block j (N = 256)
        return int(sc[r // 128, j // 4, r % 32, (r % 128) // 32 * 4 + j % 4]) - 127

    # The rules, spelled out on the reference (which the op matched bit for bit above).
    assert all(exponent(r, 0) == -39 for r in range(4))     # zero blocks: the clamp
    assert all(exponent(r, 1) == -39 for r in range(4, 8))
    assert all(exponent(r, 2) == -39 for r in range(8, 17))  # tiny blocks: the clamp
    assert exponent(21, 5) == 10 and exponent(22, 5) == 11   # 448 * 2^10 -> 2^10; above -> 2^11
    assert exponent(20, 5) == 120 and exponent(128, 0) == 127  # bf16's largest; inf
    inf_block = q[1, 0].view(8, 32)[0]
    assert inf_block[5] == E4M3_NAN                          # inf: NaN, the other values 0
    assert ((torch.cat([inf_block[:5], inf_block[6:]]) & 0x7F) == 0).all()
    assert (q[1, 3].view(8, 32)[3] == E4M3_NAN).all()  # NaN only
    assert q[1, 2].view(8, 32)[2, 7] == E4M3_NAN


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_quantize_fake_and_compile(gen, device):
    x = torch.randn((2, 128, 256), generator=gen).to(torch.bfloat16).to(device)
    torch.library.opcheck(torch.ops.mok.mxfp8_quantize.default, (x, True, False))
    torch.library.opcheck(torch.ops.mok.mxfp8_quantize.default, (x[0], False, True))
    eager = mok.ops.mxfp8_quantize(x, True, True)
    compiled = torch.compile(lambda t: mok.ops.mxfp8_quantize(t, True, True), fullgraph=True)(x)
    assert_bitwise(compiled, [bits(t).cpu() for t in eager])


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_quantize_bad_inputs_name_the_argument(device):
    good = torch.zeros((128, 256), dtype=torch.bfloat16, device=device)
    op = mok.ops.mxfp8_quantize
    with pytest.raises(TypeError, match=r"invalid x_bf16\.dtype: expected bfloat16, got float32"):
        op(good.float(), True, True)
    with pytest.raises(ValueError, match=r"invalid x_bf16\.shape\[0\]: expected a positive "
                                         r"multiple of 128 \(MoK's rule\), got 100"):
        op(good[:100], True, True)
    with pytest.raises(ValueError, match=r"invalid x_bf16\.shape\[2\]: .* got 64"):
        op(torch.zeros((2, 128, 64), dtype=torch.bfloat16, device=device), True, False)
    with pytest.raises(ValueError, match=r"invalid x_bf16\.shape: expected \[M, N\] or "
                                         r"\[E, M, N\], got \[256\]"):
        op(good.flatten()[:256], True, True)
    with pytest.raises(ValueError, match=r"invalid return_normal, return_transposed: expected at "
                                         r"least one True"):
        op(good, False, False)
    with pytest.raises(ValueError, match=r"invalid x_bf16\.strides"):
        op(torch.zeros((256, 128), dtype=torch.bfloat16, device=device).t(), True, True)
    # The process goes on: the next good call works.
    got = op(good, True, True)
    assert (bits(got[0]) == 0).all() and (got[1] == 127 - 39).all()
