"""MoK's MX quantizer as a torch.library custom op: ``mok.ops.mxfp8_quantize`` and
``torch.ops.mok.mxfp8_quantize``, MoK's name, schema and semantics (include/mok/fp8.hpp and
src/core/fp8.hpp have the maths; the kernel is src/cuda/kernels/mxfp8_quantize.cu, the CPU
reference src/reference/fp8_quant.cpp, the same bits).

  mxfp8_quantize(x_bf16 [M, N] or [E, M, N], return_normal, return_transposed)
      -> (x_fp8, x_sc, x_fp8_t, x_sc_t)
         x_fp8    float8_e4m3fn, x's shape                 (None unless return_normal)
         x_sc     uint8 [E * M // 128, N // 128, 32, 16]    E8M0 scales of 1x32 blocks along N
         x_fp8_t  float8_e4m3fn [N, M] or [E, N, M]         (None unless return_transposed)
         x_sc_t   uint8 [E * N // 128, M // 128, 32, 16]    the same of x^T

M and N multiples of 128; bf16, contiguous. The scales are MoK's: 2^ceil(log2(amax / 448)) per
block, clamped to [2^-39, 2^127] as MoK's kernel clamps (an all-zero block gets 2^-39; MoK's Python
reference clamps at 2^-127 instead, the one place the two differ); NaN is left out of amax, and an
infinite amax gives 2^127 with the block's finite values 0 and its non-finite ones NaN (0x7F).
CPU tensors run the CPU reference; CUDA tensors one launch on PyTorch's current stream.
"""

import torch

from mok import _checks, _native


def _check(x_bf16, return_normal, return_transposed):
    """The arguments (metadata only: the fake implementation runs this too); (E, M, N)."""
    _checks.require_tensor("x_bf16", x_bf16)
    for name, flag in (("return_normal", return_normal),
                       ("return_transposed", return_transposed)):
        if not isinstance(flag, bool):
            _checks.fail(name, "a bool", f"{type(flag).__name__} {flag!r}", TypeError)
    if not (return_normal or return_transposed):
        _checks.fail("return_normal, return_transposed", "at least one True (MoK's rule)",
                     "both False")
    if x_bf16.dtype != torch.bfloat16:
        _checks.fail("x_bf16.dtype", "bfloat16", _checks.dtype_name(x_bf16.dtype), TypeError)
    if x_bf16.dim() not in (2, 3):
        _checks.fail("x_bf16.shape", "[M, N] or [E, M, N]", _checks.shape_text(x_bf16.shape))
    E = x_bf16.shape[0] if x_bf16.dim() == 3 else 1
    M, N = x_bf16.shape[-2], x_bf16.shape[-1]
    if E <= 0:
        _checks.fail("x_bf16.shape[0]", "a positive count of experts", E)
    for axis, size in ((x_bf16.dim() - 2, M), (x_bf16.dim() - 1, N)):
        if size <= 0 or size % 128:
            _checks.fail(f"x_bf16.shape[{axis}]", "a positive multiple of 128 (MoK's rule)", size)
    if not x_bf16.is_contiguous():
        _checks.fail("x_bf16.strides", "row-major contiguous strides",
                     _checks.shape_text(x_bf16.stride()))
    return E, M, N


def _output_shapes(x_bf16, E, M, N):
    lead = tuple(x_bf16.shape[:-2])
    return lead + (M, N), (E * M // 128, N // 128, 32, 16), lead + (N, M), \
        (E * N // 128, M // 128, 32, 16)


@torch.library.custom_op(
    "mok::mxfp8_quantize", mutates_args=(),
    schema="(Tensor x_bf16, bool return_normal, bool return_transposed) -> "
           "(Tensor?, Tensor?, Tensor?, Tensor?)")
def mxfp8_quantize(x_bf16, return_normal, return_transposed):
    """MoK's mxfp8_quantize: (x_fp8, x_sc, x_fp8_t, x_sc_t), the pair not asked for None (the
    module docstring has the layouts and the rules)."""
    E, M, N = _check(x_bf16, return_normal, return_transposed)
    shape, sc_shape, shape_t, sc_t_shape = _output_shapes(x_bf16, E, M, N)
    dev = x_bf16.device
    new = _native.new_output
    x_fp8 = new(shape, torch.float8_e4m3fn, dev) if return_normal else None
    x_sc = new(sc_shape, torch.uint8, dev) if return_normal else None
    x_fp8_t = new(shape_t, torch.float8_e4m3fn, dev) if return_transposed else None
    x_sc_t = new(sc_t_shape, torch.uint8, dev) if return_transposed else None
    views = _native.views(x_bf16, x_fp8, x_sc, x_fp8_t, x_sc_t)
    if dev.type == "cuda":
        _native.launch(_native.lib.mxfp8_quantize, dev, *views)
    else:
        _native.lib.mxfp8_quantize(*views, 0)
    return x_fp8, x_sc, x_fp8_t, x_sc_t


@mxfp8_quantize.register_fake
def _(x_bf16, return_normal, return_transposed):
    E, M, N = _check(x_bf16, return_normal, return_transposed)
    shape, sc_shape, shape_t, sc_t_shape = _output_shapes(x_bf16, E, M, N)
    new = x_bf16.new_empty
    return (new(shape, dtype=torch.float8_e4m3fn) if return_normal else None,
            new(sc_shape, dtype=torch.uint8) if return_normal else None,
            new(shape_t, dtype=torch.float8_e4m3fn) if return_transposed else None,
            new(sc_t_shape, dtype=torch.uint8) if return_transposed else None)
