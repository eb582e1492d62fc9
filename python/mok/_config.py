"""MoKConfig: MoK's tuning knobs and mok's own, validated as the C++ Config validates them."""

import dataclasses
import math

from mok import _checks, _native

FORWARD_PATHS = ("launches", "fused")  # MoKConfig.forward_path's values
# The layer's precisions (mok.moe's `precision`): the bf16 layer; the FP8 layer; the FP8 layer
# with its three routed weight gradients computed as the bf16 layer's, bf16 products of the bf16
# rows (C++: BackwardOptions::fp8_weight_grads false), no token-axis quantization: the forward
# and the input gradients are FP8 either way. The order is also that of the precision field in
# mok/_host_ep.py's call header.
PRECISIONS = ("bf16", "fp8", "fp8-bf16-wgrad")
# The largest value of each int knob's C++ type (include/mok/config.hpp): int, else int64.
_CXX_INT_BOUNDS = {"fwd_num_comm_sms": 2**31 - 1, "bwd_num_comm_sms": 2**31 - 1,
                   "minibatch_size": 2**63 - 1, "macrobatch_size": 2**63 - 1,
                   "fused_stage_rows": 2**63 - 1, "all_gather_top_experts_chunk_bytes": 2**63 - 1}


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """MoK's tuning knobs, and mok's own (forward_path, fused_stage_rows). None of them changes
    the result.

    The defaults are MoK's but one: `macrobatch_size` 0 (automatic) sizes the ring for 131072
    routed rows plus each local expert's padding to the 128-row GEMM tile, so a rank that receives
    up to 131072 rows runs in one pass whatever the routing. Any other value is the ring's rows,
    as in MoK (a multiple of `minibatch_size`)."""

    fwd_num_comm_sms: int = 40
    bwd_num_comm_sms: int = 28
    minibatch_size: int = 4096
    macrobatch_size: int = 0
    schedule_capacity_multiplier: float = 0.5
    # MoK's chunk of its multicast all-gather of the routing. Accepted and checked as MoK checks
    # it (a positive multiple of 16 bytes), and unused: mok exchanges the ids inside its schedule
    # build (CUDA) or over the group's all-gather (CPU), which need no chunking knob.
    all_gather_top_experts_chunk_bytes: int = 2048
    # mok's own knobs, keyword-only (MoK has no such fields). Like MoK's, they choose how the work
    # runs and never change a result (both paths give the same bits).
    # forward_path: how the CUDA backend runs a forward ring pass: "launches" (a sequence of
    # launches: pull, gate/up with SwiGLU, down with the combine in its epilogue; the default) or
    # "fused" (one forward megakernel launch per pass; refused on a CUDA team across processes
    # until a multi-GPU run has tested it). The CPU backend computes the same function either way.
    forward_path: str = dataclasses.field(default="launches", kw_only=True)
    # fused_stage_rows: the rows of one stage of the forward megakernel (only the fused path reads
    # it): 0 (automatic: the larger of minibatch_size and 16384), else a positive multiple of 128.
    fused_stage_rows: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in (int, "int"):
                ok = isinstance(value, int) and not isinstance(value, bool)
                expected = "an int"
            elif field.type in (str, "str"):
                ok = isinstance(value, str)
                expected = "a str"
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                expected = "a number"
            if not ok:
                _checks.fail(f"config.{field.name}", expected, type(value).__name__, TypeError)
            bound = _CXX_INT_BOUNDS.get(field.name)
            if bound is not None and not -bound - 1 <= value <= bound:
                kind = "int" if bound < 2**32 else "int64"
                _checks.fail(f"config.{field.name}", f"an int in [{-bound - 1}, {bound}] (the C++ "
                             f"Config's {kind})", value)
        try:
            multiplier = float(self.schedule_capacity_multiplier)
        except OverflowError:
            multiplier = math.inf
        if not math.isfinite(multiplier):
            _checks.fail("config.schedule_capacity_multiplier", "a finite positive number",
                         self.schedule_capacity_multiplier)
        if self.forward_path not in FORWARD_PATHS:
            _checks.fail("config.forward_path", " or ".join(repr(p) for p in FORWARD_PATHS),
                         repr(self.forward_path))
        chunk = self.all_gather_top_experts_chunk_bytes
        if chunk <= 0 or chunk % 16:
            _checks.fail("config.all_gather_top_experts_chunk_bytes",
                         "a positive multiple of 16 (MoK's rule; mok does not use it)", chunk)
        _native.lib.validate_config(
            self.fwd_num_comm_sms, self.bwd_num_comm_sms, self.minibatch_size,
            self.macrobatch_size, multiplier,
            forward_path=self.forward_path, fused_stage_rows=self.fused_stage_rows)
