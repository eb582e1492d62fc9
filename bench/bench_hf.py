#!/usr/bin/env python3
"""Hugging Face models with their experts on mok against Transformers' own implementations.

    python3 bench/bench_hf.py [--models qwen3-30b-a3b,dsv3]
                              [--impls mok,grouped_mm,eager,liger,mok-fp8,mok-fp8-bf16-wgrad]
                              [--tokens 8192] [--layers 2] [--reps 10] [--warmup-s 2]
                              [--kernels 15] [--out docs/perf/hf.json]

Models (random init from a config, bf16, on the GPU; few layers): a Qwen3-30B-A3B-shaped model
(H 2048, I 768, 128 experts, top-8) and a DeepSeek-V3-shaped one (H 7168, I 2048, 256 experts,
top-8, one shared expert, MLA). For each, two measurements per implementation:

  moe_blocks  forward+backward of every MoE block alone (router, experts, shared expert) on
              hidden states [tokens, H], summed, the gradients set to None before each call
              (records without "grads" were timed with them accumulating across calls): what
              experts_implementation changes;
  train_step  forward+backward of the whole model's next-token loss and an AdamW step.

Memory: one DeepSeek-V3-shaped layer (256 experts of 7168 x 2048) with its gradients and AdamW
states does not fit an 80 GB card (on an H100 grouped_mm's MoE block ran out of memory at 8,192
tokens, 1893819): run dsv3 on an H200, or --models qwen3-30b-a3b elsewhere.

Implementations: "mok" (mok.integrations.transformers), "mok-fp8" and "mok-fp8-bf16-wgrad" (the
same with configure(precision="fp8") or "fp8-bf16-wgrad": mok's FP8 layer, timed only when named;
each weight quantized once per version, so the timed calls include the re-quantization after every
optimizer step of train_step), "grouped_mm" (Transformers' default),
"eager" (its per-expert loop; skipped with --no-eager, and on dsv3 unless --impls names it:
minutes a call at 256 experts), and "liger" where Liger-Kernel is importable:
apply_liger_kernel_to_qwen3_moe() patches the Qwen3-MoE model (its
norms, RoPE, loss) and the experts run "grouped_mm" under it; Qwen3-MoE only. Every
implementation is timed in this process, after the same warm-up, as the median of --reps CUDA-
event timings (bench/timing.py); before timing, mok's MoE-block output is checked against
grouped_mm's on the same inputs (MOK_TOLERANCE: a relative L2 distance of 0.05 in bf16, 0.1 in
FP8, MoK's MXFP8 bound). Writes JSON in the style of the other bench/
scripts (gpu, commit from MOK_COMMIT, date, records) and prints each implementation's time over
grouped_mm's.
"""
import argparse
import datetime
import gc
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402

MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936)),
    "dsv3": ("deepseek_v3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
        topk_group=4, first_k_dense_replace=0, num_attention_heads=128,
        num_key_value_heads=128, vocab_size=129280)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--impls", default=None,
                   help="default mok,grouped_mm,eager,liger; eager only on qwen3-30b-a3b unless "
                   "named here (dsv3's 256-expert loop did not finish in 330 s on an H200)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x seq)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: 2 for qwen3-30b-a3b, 1 for dsv3, whose one "
                   "layer's experts, gradients and AdamW state take about 90 GB)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--no-eager", action="store_true")
    p.add_argument("--kernels", type=int, default=0,
                   help="also profile one call of the MoE blocks and record its N most expensive "
                   "kernels (torch.profiler; default 0: none)")
    p.add_argument("--out", default="docs/perf/hf.json")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.eager_everywhere = args.impls is not None and "eager" in args.impls.split(",")
    impls = args.impls or "mok,grouped_mm,eager,liger"
    args.impls = [i for i in impls.split(",") if not (args.no_eager and i == "eager")]
    return args


DEFAULT_LAYERS = {"qwen3-30b-a3b": 2, "dsv3": 1}
# mok's implementations: the precision each configures (mok.integrations.transformers.configure).
MOK_PRECISIONS = {"mok": "bf16", "mok-fp8": "fp8", "mok-fp8-bf16-wgrad": "fp8-bf16-wgrad"}
# The relative L2 distance of mok's MoE-block output from grouped_mm's that the check allows:
# routing ties flip a few tokens' experts in bf16 (loose, not bitwise); FP8 adds e4m3's rounding of
# x, h and the weights (0.1: MoK's MXFP8 bound on the layer's output).
MOK_TOLERANCE = {"bf16": 0.05, "fp8": 0.1, "fp8-bf16-wgrad": 0.1}


def build(model_name, impl, layers, device="cuda", **sizes_override):
    """The model of MODELS[model_name] (its sizes updated by sizes_override: the CPU test builds
    a tiny one) with `layers` layers, random init, bf16 on `device`, its experts on `impl`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, sizes = MODELS[model_name]
    sizes = {**sizes, **sizes_override}
    if impl == "liger":
        if model_type != "qwen3_moe":
            return None
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe
        apply_liger_kernel_to_qwen3_moe()
    config = AutoConfig.for_model(model_type, num_hidden_layers=layers, **sizes)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if impl in MOK_PRECISIONS:  # registers "mok" in Transformers' ExpertsInterface
        import mok.integrations.transformers as mok_hf
        mok_hf.configure(precision=MOK_PRECISIONS[impl])
        model.set_experts_implementation(mok_hf.NAME)
        mok_hf.check(model)
    else:
        model.set_experts_implementation("grouped_mm" if impl == "liger" else impl)
    return model


def moe_blocks(model):
    """The MoE blocks: the modules that hold an experts module as a child (router + experts +
    shared expert), in layer order."""
    return [m for m in model.modules()
            if any(hasattr(c, "gate_up_proj") for c in m.children())]


def block_call(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def measure(model_name, impl, args, check_against):
    layers = args.layers or DEFAULT_LAYERS[model_name]
    model = build(model_name, impl, layers)
    if model is None:
        return []
    H = model.config.hidden_size
    blocks = moe_blocks(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.tokens // args.seq, args.seq, H, device="cuda", dtype=torch.bfloat16,
                    generator=gen).requires_grad_()
    d_out = torch.randn_like(x)
    records = []
    with torch.no_grad():
        first = block_call(blocks[0], x).float()
    if check_against is not None and impl in MOK_PRECISIONS:
        err = float((first - check_against).norm() / check_against.norm())
        bound = MOK_TOLERANCE[MOK_PRECISIONS[impl]]
        if err > bound:
            raise RuntimeError(f"{impl}'s MoE block differs from grouped_mm's: {err:.3g} "
                               f"(relative L2; at most {bound})")

    params = [p for b in blocks for p in b.parameters()]

    def blocks_fwd_bwd():
        # Gradients dropped before each call, as a training step's zero_grad(set_to_none=True)
        # does: otherwise every call after the first adds into .grad, a pass over every weight
        # gradient that the blocks do not make (DeepSeek-V3's layer: 22.5 GB of bf16 gradients,
        # read twice and written once, about 14 ms on an H200 for either implementation).
        x.grad = None
        for p in params:
            p.grad = None
        for b in blocks:
            block_call(b, x).backward(d_out)

    ms = median_ms(blocks_fwd_bwd, reps=args.reps, warmup=2, warmup_s=args.warmup_s)
    record = dict(model=model_name, measure="moe_blocks", impl=impl, ms=ms, blocks=len(blocks),
                  tokens=args.tokens, grads="set_to_none")
    if args.kernels:  # where one call's GPU time goes (torch.profiler, after the timing)
        from profile_layer import kernels
        rows = kernels(blocks_fwd_bwd)
        record["gpu_busy_ms"] = sum(us for _, _, us in rows) / 1e3
        record["kernels"] = [[name, count, us / 1e3] for name, count, us in rows[:args.kernels]]
        print(f"{model_name} {impl}: MoE blocks' kernels, {record['gpu_busy_ms']:.2f} ms busy",
              flush=True)
        for name, count, us in rows[:args.kernels]:
            print(f"  {us / 1e3:8.3f} ms {count:4d}x {name}", flush=True)
    records.append(record)
    ids = torch.randint(0, model.config.vocab_size, (args.tokens // args.seq, args.seq),
                        device="cuda", generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = median_ms(step, reps=args.reps, warmup=2, warmup_s=args.warmup_s)
    records.append(dict(model=model_name, measure="train_step", impl=impl, ms=ms,
                        layers=layers, tokens=args.tokens))
    out = first if impl == "grouped_mm" else None
    del model, opt, blocks, x, d_out
    gc.collect()
    torch.cuda.empty_cache()
    return records, out


def main(argv=None):
    args = parse_args(argv)
    import transformers
    records = []

    def write():
        doc = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("MOK_COMMIT",
               "unknown"), "date": datetime.date.today().isoformat(),
               "transformers": transformers.__version__, "records": records}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    failures = 0
    # grouped_mm first (the reference output), liger last (its patch is global to the process).
    order = sorted(args.impls, key=lambda i: (i != "grouped_mm", i == "liger"))
    for model_name in args.models:
        reference = None
        for impl in order:
            if impl == "eager" and model_name == "dsv3" and not args.eager_everywhere:
                print("dsv3 eager: not timed by default (minutes a call at 256 experts); "
                      "--impls ...,eager times it", flush=True)
                continue
            try:
                result = measure(model_name, impl, args, reference)
            except ImportError as e:
                print(f"{model_name} {impl}: not importable here ({e}); not timed", flush=True)
                continue
            except Exception as e:  # noqa: BLE001 - reported and counted; the next ones still run
                print(f"{model_name} {impl}: FAILED: {type(e).__name__}: {e}", flush=True)
                failures += 1
                continue
            if not result:
                continue
            new, out = result
            reference = out if out is not None else reference
            records.extend(new)
            write()
            for r in new:
                print(f"{model_name} {r['measure']} {impl}: {r['ms']:.2f} ms", flush=True)
    write()
    for r in records:
        base = next((b for b in records if b["model"] == r["model"] and
                     b["measure"] == r["measure"] and b["impl"] == "grouped_mm"), None)
        if base is not None and r["impl"] != "grouped_mm":
            print(f"{r['model']:14s} {r['measure']:10s} {r['impl']:10s} "
                  f"{base['ms'] / r['ms']:.2f}x grouped_mm's speed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
