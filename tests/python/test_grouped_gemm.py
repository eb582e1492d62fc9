"""mok.ops.grouped_*: the grouped GEMM forms from PyTorch (issue 5).

Everywhere: output shapes from meta tensors (the fake implementations) and the error for CPU
tensors. On a GPU with mok's CUDA backend: each form against an fp32 evaluation of the same bf16
numbers, random group sizes with empty groups and a packed layout, outputs poisoned first; the
wgrad's bits repeat.
"""
import pytest
import torch
from conftest import requires_cuda

from mok import ops

U = 2.0 ** -8  # bf16 unit roundoff


def groups(counts, device, pad=1):
    """starts [G + 1] / rows [G] int32 for segments of `counts` rows, each padded to `pad` rows."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + (c + pad - 1) // pad * pad)
    return (torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device), starts)


def test_fake_shapes_on_meta_tensors():
    m = torch.device("meta")
    bf = torch.bfloat16
    x = torch.empty(300, 128, dtype=bf, device=m)
    wg = torch.empty(3, 192, 128, dtype=bf, device=m)
    starts = torch.empty(4, dtype=torch.int32, device=m)
    rows = torch.empty(3, dtype=torch.int32, device=m)
    h, g, u = ops.grouped_gate_up(x, wg, wg, starts, rows, True)
    assert h.shape == g.shape == u.shape == (300, 192)
    h, g, u = ops.grouped_gate_up(x, wg, wg, starts, rows, False)
    assert h.shape == (300, 192) and g.shape == u.shape == (0,)
    assert ops.grouped_rows_times_weight_t(x, wg, starts, rows, None).shape == (300, 192)
    w_kn = torch.empty(3, 128, 64, dtype=bf, device=m)
    assert ops.grouped_rows_times_weight(x, w_kn, starts, rows).shape == (300, 64)
    b = torch.empty(300, 64, dtype=bf, device=m)
    out = ops.grouped_weight_grad(x, b, starts, rows, True)
    assert out.shape == (3, 128, 64) and out.dtype == torch.float32
    assert ops.grouped_weight_grad(x, b, starts, rows, False).dtype == bf


def test_cpu_tensors_are_refused_naming_the_argument():
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    w = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    starts, rows, _ = groups([8], "cpu")
    with pytest.raises(ValueError, match=r"x\.device"):
        ops.grouped_gate_up(x, w, w, starts, rows, False)
    with pytest.raises(ValueError, match=r"a\.device"):
        ops.grouped_rows_times_weight(x, w, starts, rows)
    with pytest.raises(ValueError, match=r"a\.device"):
        ops.grouped_weight_grad(x, x, starts, rows, False)


needs_gpu = requires_cuda


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def layouts():
    # (counts, padding): empty groups, sizes not a multiple of the tile, one group holding most
    # rows; padded to 128 rows as the layer does, and packed as torch._grouped_mm's offsets.
    return [([0, 1, 130, 77, 0, 300], 128), ([5, 0, 1000, 3, 64], 1)]


@needs_gpu
@pytest.mark.parametrize("counts,pad", layouts())
def test_forms_match_fp32(counts, pad, gen):
    dev = torch.device("cuda")
    starts, rows, host_starts = groups(counts, dev, pad)
    R = host_starts[-1]
    G, H, I = len(counts), 256, 192
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16).to(dev)
    x = r(R, H)
    wg, wu = r(G, I, H, scale=H ** -0.5), r(G, I, H, scale=H ** -0.5)
    wd = r(G, H, I, scale=I ** -0.5)
    h, g, u = ops.grouped_gate_up(x, wg, wu, starts, rows, True)
    y = ops.grouped_rows_times_weight_t(h, wd, starts, rows, None)
    dh = ops.grouped_rows_times_weight(y, wd, starts, rows)
    dw = ops.grouped_weight_grad(y, h, starts, rows, True)
    torch.cuda.synchronize()
    for e, c in enumerate(counts):
        s = slice(host_starts[e], host_starts[e] + c)
        xe = x[s].float()
        ge = (xe @ wg[e].float().t()).bfloat16().float()
        ue = (xe @ wu[e].float().t()).bfloat16().float()
        he = torch.nn.functional.silu(ge) * ue
        if c:
            assert rel_err(g[s], ge) <= U and rel_err(u[s], ue) <= U
            assert rel_err(h[s], he) <= 2 * U
            assert rel_err(y[s], h[s].float() @ wd[e].float().t()) <= U
            assert rel_err(dh[s], y[s].float() @ wd[e].float()) <= U
            assert rel_err(dw[e], y[s].float().t() @ h[s].float()) <= 1e-5
        else:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
    again = ops.grouped_weight_grad(y, h, starts, rows, True)
    assert torch.equal(again, dw)  # fixed reduction order: the same bits
