"""PyTorch's FP8 MoE training recipe on Hopper, for benchmarks: the peer of mok's FP8 layer.

torchao's MoE training (`torchao.prototype.moe_training`, Float8 rowwise recipe) replaces each
`torch._grouped_mm` of an MoE layer by an autograd function that quantizes both operands to e4m3
on the fly and multiplies them with `torch._scaled_grouped_mm`. This file holds that recipe
written on torch's ops (impl "torch-fp8" in bench/bench_layer.py), the layer both run in
(fp8_moe: the PyTorch baseline of bench/torch_moe.py with each expert's rows padded to 16, as
torchtitan pads them for FP8), and the loader of torchao's own function (impl "torchao-fp8").

The recipe, GEMM by GEMM (out = A B per group of rows, A [M, K] bf16, B [E, K, N] bf16):
  forward  A per row (amax along K), B per expert and output column (amax along K);
  dgrad    dA = dOut B^T: dOut per row (amax along N), B per expert and K row (amax along N);
  wgrad    dB[e] = A[rows of e]^T dOut[rows of e]: A and dOut per group and column (amax over
           the group's rows), multiplied in the grouped form whose groups run along the
           contraction (2-D x 2-D with offsets).
Every scale is 448 / amax rounded DOWN to a power of two (so the scaled block never exceeds e4m3's
448 and the reciprocal is exact), the cast saturates, and torch._scaled_grouped_mm gets the
reciprocal scales, bf16 output, fast accumulation. Weights are quantized in every call (dynamic
scaling: there is no cache of quantized weights in the recipe).

NOTES: torchao fuses each quantization into one Triton kernel; here they are eager torch ops
(amax, multiply, clamp, cast: an fp32 temporary each), so "torch-fp8" spends more time quantizing
than "torchao-fp8" does. It is the recipe's maths and its GEMMs, the fallback where torchao will
not import, and the CPU-testable model of what torchao computes.

On the CPU, torch._scaled_grouped_mm does not exist: scaled_grouped_mm emulates it (dequantize,
then an fp32 matmul per group) after running torch's own argument checks on meta tensors, so the
layouts and scale shapes the CPU tests accept are the ones the GPU accepts.
"""
import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12  # amax floor (torchao's): an all-zero row gets a finite scale
ALIGN = 16  # rows per group: torch._scaled_grouped_mm's FP8 groups (torchao's assertion)
CHUNK = 1 << 28  # elements per fp32 temporary of a cast (1 GiB): dsv3-ep1's gate/up is 7.5 G


# ---- quantization -------------------------------------------------------------------------------

def pow2_scale(amax):
    """448 / amax (amax floored at EPS), rounded down to a power of two, fp32."""
    scale = (E4M3_MAX / amax.double().clamp_min(EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def to_e4m3(t, scale):
    """e4m3(t * scale) in t's layout, saturating at +-448 (a plain cast turns larger values into
    NaN); `scale` broadcasts against t. Cast in slices along the first dimension of at most CHUNK
    elements, so the fp32 temporaries stay bounded whatever the size of t."""
    out = torch.empty_like(t, dtype=E4M3)
    step = max(1, CHUNK // max(1, t[0].numel())) if t.dim() else 1
    for i in range(0, max(1, t.shape[0] if t.dim() else 1), step):
        part = slice(i, i + step)
        s = scale[part] if scale.dim() == t.dim() and scale.shape[0] > 1 else scale
        out[part].copy_((t[part].float() * s).clamp_(-E4M3_MAX, E4M3_MAX))
    return out


def amax_along(t, dim):
    """max |t| over `dim` (kept), fp32, without a copy of |t|."""
    lo, hi = torch.aminmax(t, dim=dim, keepdim=True)
    return torch.maximum(-lo, hi).float()


def quantize_along(t, dim):
    """t's e4m3 values with one scale per slice along `dim` (amax over `dim`), and the reciprocal
    scales (fp32, `dim` kept as size 1)."""
    scale = pow2_scale(amax_along(t, dim))
    return to_e4m3(t, scale), scale.reciprocal()


def quantize_group_columns(t, offs):
    """t [M, C] per group of rows (ends `offs`, each group ALIGN-row aligned, M a multiple of
    ALIGN) and column: (e4m3 values laid out column-major, i.e. a [C, M] contiguous tensor's
    transpose, and the reciprocal scales [G * C] fp32, group major). Rows past the last group may
    hold anything (NaN too): they stay out of every amax, and their values are never read. No
    host synchronization: each ALIGN-row block lies in one group, so the amax is taken per block
    (a dense reduction) and then per group over the blocks (a scatter of M / ALIGN rows)."""
    M, C = t.shape
    G = offs.numel()
    if M % ALIGN:
        raise ValueError(f"rows {M}: a multiple of {ALIGN} expected")
    blocks = t.view(M // ALIGN, ALIGN, C)
    block_amax = amax_along(blocks, 1).squeeze(1)  # [M / ALIGN, C]
    starts = torch.arange(0, M, ALIGN, device=t.device)
    group = torch.searchsorted(offs.to(torch.int64), starts, right=True)  # G: past the groups
    amax = torch.zeros(G + 1, C, dtype=torch.float32, device=t.device)
    amax.scatter_reduce_(0, group.unsqueeze(1).expand(-1, C), block_amax, "amax")
    scale = pow2_scale(amax[:G])  # [G, C]
    block_scale = torch.cat([scale, scale.new_zeros(1, C)])[group].unsqueeze(1)
    q = to_e4m3(blocks, block_scale).view(M, C)
    return q.t().contiguous().t(), scale.reciprocal().reshape(-1)


# ---- the GEMM: torch._scaled_grouped_mm, or its CPU emulation -----------------------------------

def _meta(t):
    return t if t is None else t.to("meta")


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16):
    """What torch._scaled_grouped_mm computes, on the CPU: torch's argument checks (its meta
    implementation: layouts, dtypes, scale shapes), then per group the dequantized operands
    multiplied in fp32. Output rows past the last group (2-D x 3-D) are NaN, where the GPU leaves
    them unwritten: a caller that reads them shows up."""
    torch._scaled_grouped_mm(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), _meta(offs),
                             out_dtype=out_dtype, use_fast_accum=True)
    ends = [0] + offs.tolist()
    if any(e1 < e0 for e0, e1 in zip(ends, ends[1:])):
        raise ValueError(f"group ends must not decrease: {ends[1:]}")
    af, bf = a.float(), b.float()
    if a.dim() == 2 and b.dim() == 3:  # groups of rows of a, one b per group
        af = af * scale_a.reshape(-1, 1)
        bf = bf * scale_b.unsqueeze(1)
        out = torch.full((a.shape[0], b.shape[2]), float("nan"))
        for g, (r0, r1) in enumerate(zip(ends, ends[1:])):
            out[r0:r1] = af[r0:r1] @ bf[g]
        return out.to(out_dtype)
    if a.dim() == 2 and b.dim() == 2:  # groups along the contraction: one output per group
        M, N = a.shape[0], b.shape[1]
        if any((e1 - e0) % ALIGN for e0, e1 in zip(ends, ends[1:])):
            raise ValueError(f"FP8 groups along K must be multiples of {ALIGN} rows: {ends[1:]}")
        out = torch.zeros(len(ends) - 1, M, N)
        for g, (k0, k1) in enumerate(zip(ends, ends[1:])):
            sa = scale_a[g * M:(g + 1) * M].reshape(-1, 1)
            sb = scale_b[g * N:(g + 1) * N].reshape(1, -1)
            out[g] = (af[:, k0:k1] * sa) @ (bf[k0:k1] * sb)
        return out.to(out_dtype)
    raise ValueError(f"a {a.dim()}-D x {b.dim()}-D grouped product is not one the recipe uses")


def scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm as the recipe calls it (bf16 out, fast accumulation) on CUDA
    tensors; its emulation on CPU tensors."""
    if a.device.type == "cuda":
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    return emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs)


class Fp8GroupedMM(torch.autograd.Function):
    """out [M, N] = A [M, K] @ B_t[e] [K, N] per group of rows (ends `offs`), FP8 rowwise."""

    @staticmethod
    def forward(ctx, A, B_t, offs):
        a8, a_inv = quantize_along(A, -1)  # per row, [M, 1]
        b8, b_inv = quantize_along(B_t, -2)  # per expert and column, [E, 1, N]
        b8 = b8.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major, as B_t
        ctx.save_for_backward(A, B_t, offs)
        return scaled_grouped_mm(a8, b8, a_inv.squeeze(-1), b_inv.squeeze(-2), offs)

    @staticmethod
    def backward(ctx, d_out):
        A, B_t, offs = ctx.saved_tensors
        d_out = d_out.contiguous()
        # dgrad: dA = dOut B_t^T, the weight per expert and K row (amax along N), column-major.
        d8, d_inv = quantize_along(d_out, -1)
        bt8, bt_inv = quantize_along(B_t, -1)  # [E, K, N], scales [E, K, 1]
        bt8 = bt8.contiguous().transpose(-2, -1)  # [E, N, K] column-major
        d_a = scaled_grouped_mm(d8, bt8, d_inv.squeeze(-1), bt_inv.squeeze(-1), offs)
        # wgrad: dB_t[e]^T = dOut[rows of e]^T A[rows of e], groups along the contraction.
        go8, go_inv = quantize_group_columns(d_out, offs)  # [M, N] column-major
        a8, a_inv = quantize_group_columns(A, offs)  # [M, K] column-major
        d_b = scaled_grouped_mm(go8.t(), a8, go_inv, a_inv, offs)  # [E, N, K]
        return d_a, d_b.transpose(-2, -1), None


def fp8_grouped_mm(a, b, offs):
    """The recipe written here (impl "torch-fp8")."""
    return Fp8GroupedMM.apply(a, b, offs)


def torchao_grouped_mm():
    """torchao's own function for the same recipe (impl "torchao-fp8") as grouped_mm(a, b, offs),
    and torchao's version; raises ImportError where torchao does not import."""
    import torchao
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fn

    def grouped_mm(a, b, offs):
        # Groups are padded here (fp8_moe), so torchao's own padding stays off (its default,
        # on, is refused by its forward).
        return fn(a, b, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    return grouped_mm, torchao.__version__


# ---- the layer ----------------------------------------------------------------------------------

def padded_routing(topk_experts, num_experts, align=ALIGN):
    """The routed rows sorted by expert with each expert's group padded to `align` rows, without a
    host synchronization (the rows are sized for the worst case, T*k + E*(align - 1), rounded
    up to `align`: a row count the FP8 GEMMs' 16-byte stride rule accepts):
      src   int64 [R]: the token each row reads, T (a zero row) for padding and the unused tail;
      order int64 [T*k]: the slots (t*k + j) in expert order;
      pos   int64 [T*k]: the row of each slot of `order`;
      offs  int32 [E]: each group's end row."""
    T, k = topk_experts.shape
    flat = topk_experts.reshape(-1)
    n, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    pos = (ends - padded)[expert] + rank
    rows = (n + num_experts * (align - 1) + align - 1) // align * align
    src = torch.full((rows,), T, dtype=torch.int64, device=dev)
    src[pos] = order // k
    return src, order, pos, ends.to(torch.int32)


def fp8_moe(x, topk_experts, topk_weights, gate_up, down, shared=None,
            grouped_mm=fp8_grouped_mm):
    """torch_moe's layer (bench/torch_moe.py: same arguments, the weights as prepare_weights lays
    them out) with its two grouped GEMMs through `grouped_mm` (the FP8 recipe) on expert groups
    padded to ALIGN rows. The shared expert stays bf16, as in mok's FP8 layer."""
    T, H = x.shape
    k = topk_experts.shape[1]
    E, _, two_i = gate_up.shape
    src, order, pos, offs = padded_routing(topk_experts, E)
    xs = torch.cat([x, x.new_zeros(1, H)]).index_select(0, src)  # row T: zeros for padding
    gu = grouped_mm(xs, gate_up, offs)
    h = F.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2:]
    y = grouped_mm(h, down, offs).index_select(0, pos)
    y = y * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    out.index_add_(0, order // k, y.float())
    if shared is not None:
        sg, su, sd = shared
        out += (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    return out.to(x.dtype)
