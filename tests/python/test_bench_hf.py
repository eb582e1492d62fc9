"""bench/bench_hf.py builds its models as a user would, in a fresh interpreter: "mok" must be
registered by the bench itself (importing mok.integrations.transformers before
set_experts_implementation), which a test in this process could not see (the integration's tests
import it at module level). A tiny Qwen3-MoE-shaped model on the CPU, one MoE block forward and
backward through the bench's own helpers, for mok in bf16 and in FP8 (the bench's "mok-fp8": I a
multiple of 128, the precision configured by the bench). Skipped visibly without Transformers
(or with one older than mok's integration needs)."""

import pathlib
import subprocess
import sys

import pytest
from conftest import TRANSFORMERS_SKIP_REASON

ROOT = pathlib.Path(__file__).resolve().parents[2]

CODE = """
import sys, torch
sys.path.insert(0, {bench!r})
import bench_hf
model = bench_hf.build("qwen3-30b-a3b", {impl!r}, 1, device="cpu", hidden_size=128,
                       intermediate_size=128, moe_intermediate_size={inter}, num_experts=8,
                       num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, vocab_size=128)
blocks = bench_hf.moe_blocks(model)
assert len(blocks) == 1, len(blocks)
experts = [c for c in blocks[0].children() if hasattr(c, "gate_up_proj")][0]
assert experts.config._experts_implementation == "mok", experts.config._experts_implementation
x = torch.randn(1, 37, 128, dtype=torch.bfloat16, requires_grad=True)
out = bench_hf.block_call(blocks[0], x)
out.float().square().sum().backward()
assert torch.isfinite(x.grad.float()).all() and experts.gate_up_proj.grad is not None
import mok.integrations.transformers as mok_hf
assert mok_hf._settings.precision == {precision!r}, mok_hf._settings.precision
print("ok")
"""


@pytest.mark.skipif(TRANSFORMERS_SKIP_REASON is not None,
                    reason=f"{TRANSFORMERS_SKIP_REASON}: bench_hf.py's model build not run")
@pytest.mark.parametrize("impl,inter,precision", [("mok", 64, "bf16"), ("mok-fp8", 128, "fp8")])
def test_bench_hf_builds_a_mok_model_in_a_fresh_process(impl, inter, precision):
    code = CODE.format(bench=str(ROOT / "bench"), impl=impl, inter=inter, precision=precision)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
