"""One rank of the data-parallel wrapping tests, run by torchrun:

    torchrun --standalone --nproc-per-node W tests/python/fsdp_worker.py --suite S --seed N \
        [--device cuda]

tests/python/test_training_setups.py launches it for W = 2 on CPU tensors (gloo) and W = 1 on
the GPU (NCCL; one GPU: FSDP2 holds every weight whole, but through its own all-gather and
reduce-scatter, and the CUDA layer's FP8 weights must follow each step). mok.nn.MoE is
replicated or sharded the way a data-parallel training job wraps it, each rank with its own
tokens; the reference is the same module in one process, unwrapped, over every rank's tokens.
Suites:

  fsdp  FSDP2: fully_shard of a module with float32 parameters (dtype=torch.float32: the master
        weights) and MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32), softmax and
        sigmoid routers, precision "bf16" and "fp8", reshard_after_forward True and False, three
        SGD steps; FP8 also with gradient accumulation over 2 and 3 micro-batches, the weights
        quantized at the first only (is_first_microbatch, counted). Each call: the rank's
        output bit for bit the reference's (the same weights rounded to bf16, the module under
        torch.autocast(dtype=bf16)); each step, every gradient, after FSDP's reduce-scatter,
        against the mean of the reference's per-rank gradients (rounded to bf16, as FSDP's bf16
        parameters round them; summed over micro-batches) within float32 rounding of that sum;
        the step changes the weights, so a stale FP8 quantization of the last step's weights
        would fail the next step's output.
  hf    (Transformers installed) a tiny Qwen3-MoE model on mok's experts under FSDP2, per layer
        and at the root: each step's logits bit for bit a freshly wrapped copy's, bf16 and FP8.
        On the CPU FSDP2's buffers move every step, so this suite shows the integration works;
        a stale FP8 quantization shows up on a GPU (NOTES, 2026-12-07).
  ddp   DistributedDataParallel over a bf16 module: outputs bit for bit the reference's, the
        all-reduced gradients against the mean of the reference's per-rank gradients within bf16
        rounding of that mean (DDP averages bf16 gradients in bf16).

Each rank prints "[rank R] SUITE: passed" when every check held, and exits 1 otherwise.
"""

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mok  # noqa: E402

H, I, S, E, K, T = 128, 128, 128, 8, 2, 37  # FP8 needs H and I multiples of 128; T odd


class Checks:
    def __init__(self, rank):
        self.rank, self.failures, self.count = rank, [], 0

    def that(self, what, ok, detail=""):
        self.count += 1
        if not ok:
            self.failures.append(f"{what}: {detail}")

    def bits(self, what, got, want):
        ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        diff = ((got.float() - want.float()).abs().max().item()
                if got.shape == want.shape else "shape")
        self.that(what, ok, f"not bit for bit ({got.dtype} {tuple(got.shape)} against "
                  f"{want.dtype} {tuple(want.shape)}, max |diff| {diff})")

    def near(self, what, got, want, bound):
        """Every element: |got - want| <= bound (a tensor of per-element bounds)."""
        excess = ((got.double() - want.double()).abs() - bound.double()).max().item()
        self.that(what, excess <= 0, f"exceeds its bound by {excess:.3g} (max |want| "
                  f"{want.abs().max().item():.3g})")


DEVICE = "cpu"  # --device


class QuantizationCounter:
    """Counts mok's FP8 weight quantizations (calls of _fp8_layer.quantize_weights)."""

    def __init__(self):
        from mok import _fp8_layer
        self.calls, original = 0, _fp8_layer.quantize_weights

        def counting(w):
            self.calls += 1
            return original(w)

        _fp8_layer.quantize_weights = counting


def make_module(router, precision, dtype, seed):
    torch.manual_seed(seed)
    module = mok.nn.MoE(H, I, E, K, shared_intermediate_size=S, router=router, dtype=dtype,
                        precision=precision)
    return module.to(DEVICE)


def tokens(seed, step, rank):
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    return torch.randn(T, H, generator=g).to(device=DEVICE, dtype=torch.bfloat16)


def loss_of(out, stats):
    return out.float().square().mean() + 0.01 * stats.load_balancing_loss


def full(p):
    """A parameter's (or gradient's) whole tensor: FSDP's are DTensor shards."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def reference_grads(module, xs, autocast):
    """Per rank's tokens: (output, {name: gradient}) of the unwrapped module."""
    results = []
    for x in xs:
        module.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out, stats = module(x)
        loss_of(out, stats).backward()
        results.append((out.detach(), {n: p.grad.detach().clone()
                                       for n, p in module.named_parameters()}))
    return results


def suite_fsdp(check, rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The mesh named: FSDP2's default is the GPU's wherever one is, even for a gloo job.
    mesh = init_device_mesh(DEVICE, (world,))
    counter = QuantizationCounter()
    # micro > 1: gradient accumulation, FP8 weights quantized at the first micro-batch only
    # (is_first_microbatch); the reference quantizes at every call.
    for router, precision, reshard, micro in (
            ("softmax", "bf16", True, 1), ("sigmoid", "bf16", False, 1),
            ("softmax", "fp8", True, 1), ("sigmoid", "fp8", False, 1),
            ("softmax", "fp8", True, 2), ("sigmoid", "fp8", False, 3)):
        tag = f"fsdp {router} {precision} reshard_after_forward={reshard} micro-batches={micro}"
        module = make_module(router, precision, torch.float32, seed)
        # reshard_after_forward=False: the unsharded weights stay between the steps' calls
        # (on a GPU at the same address every step, with their version counters at 0).
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        reference = make_module(router, precision, torch.float32, seed)
        before = None
        for step in range(3):
            # The reference: FSDP's weights as its bf16 parameters hold them.
            with torch.no_grad():
                weights = {n: full(p).to(torch.bfloat16) for n, p in module.named_parameters()}
                for n, q in reference.named_parameters():
                    q.copy_(weights[n])
            if before is not None:
                changed = all(not torch.equal(weights[n], before[n]) for n in before)
                check.that(f"{tag} step {step}: the step changed every weight", changed)
            before = weights
            per_rank = {n: [] for n in weights}  # every micro-batch's, every rank's gradient
            for mb in range(micro):
                xs = [tokens(seed, step * 3 + mb, r) for r in range(world)]
                want = reference_grads(reference, xs, autocast=True)
                flag = None if micro == 1 else mb == 0
                quantized = counter.calls
                out, stats = module(xs[rank], is_first_microbatch=flag)
                if precision == "fp8":
                    made, expected = counter.calls - quantized, 3 if mb == 0 or micro == 1 else 0
                    check.that(f"{tag} step {step} micro-batch {mb}: weights quantized",
                               made == expected, f"{made} quantizations, expected {expected}")
                check.bits(f"{tag} step {step} micro-batch {mb}: output", out, want[rank][0])
                loss_of(out, stats).backward()
                for n in per_rank:
                    per_rank[n] += [w[1][n].to(torch.bfloat16).float() for w in want]
            for n, p in module.named_parameters():
                got = full(p.grad)
                mean = sum(per_rank[n]) / world
                # float32 sums and FSDP's pre- and post-division: a few roundings of 2^-24
                # relative to the magnitudes summed, each micro-batch's and their sum's.
                bound = (8 * micro * 2.0**-24 * sum(g.abs() for g in per_rank[n]) / world
                         + 2.0**-126)
                check.near(f"{tag} step {step}: {n}.grad", got, mean, bound)
            opt.step()
            opt.zero_grad(set_to_none=True)


def suite_ddp(check, rank, world, seed):
    from torch.nn.parallel import DistributedDataParallel
    for router in ("softmax", "sigmoid"):
        tag = f"ddp {router}"
        module = make_module(router, "bf16", torch.bfloat16, seed)
        reference = make_module(router, "bf16", torch.bfloat16, seed)
        ddp = DistributedDataParallel(module, device_ids=[0] if DEVICE == "cuda" else None)
        xs = [tokens(seed, 0, r) for r in range(world)]
        want = reference_grads(reference, xs, autocast=False)
        out, stats = ddp(xs[rank])
        check.bits(f"{tag}: output", out, want[rank][0])
        loss_of(out, stats).backward()
        for n, p in module.named_parameters():
            per_rank = [w[1][n].double() for w in want]
            mean = sum(per_rank) / world
            # The mean of bf16 (fp32 router) gradients in their dtype: two roundings.
            u = 2.0**-8 if p.dtype == torch.bfloat16 else 2.0**-24
            bound = 2 * u * sum(g.abs() for g in per_rank) / world + 2.0**-126
            check.near(f"{tag}: {n}.grad", p.grad, mean, bound)


def suite_hf(check, rank, world, seed):
    """A Transformers model on mok's experts, FSDP2 per decoder layer and at the root (fp32
    masters, bf16 params), as a fine-tuning job shards it; three SGD steps. Each step's logits
    bit for bit those of a model wrapped afresh around the same weights (its first call: nothing
    cached), in bf16 and FP8, reshard_after_forward True and False."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import mok.integrations.transformers as mok_hf
    mesh = init_device_mesh(DEVICE, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=H, intermediate_size=I,
                            moe_intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, num_experts=E,
                            num_experts_per_tok=K)

    def wrap(model, reshard):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)

    try:
        for precision in ("bf16", "fp8"):
            mok_hf.configure(precision=precision)
            for reshard in (True, False):
                tag = f"hf {precision} reshard_after_forward={reshard}"
                torch.manual_seed(seed)
                base = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                        experts_implementation="mok")
                model = wrap(copy.deepcopy(base).to(DEVICE), reshard)
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                for step in range(3):
                    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
                    ids = torch.randint(0, 128, (2, T), generator=g).to(DEVICE)
                    fresh = copy.deepcopy(base).to(DEVICE)
                    with torch.no_grad():
                        weights = {n: full(p) for n, p in model.named_parameters()}
                        for n, q in fresh.named_parameters():
                            q.copy_(weights[n])
                    want = wrap(fresh, reshard)(ids).logits.detach()
                    out = model(ids, labels=ids)
                    check.bits(f"{tag} step {step}: logits", out.logits.detach(), want)
                    out.loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    finally:
        mok_hf.configure(precision="bf16")


SUITES = {"fsdp": suite_fsdp, "ddp": suite_ddp, "hf": suite_hf}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check = Checks(rank)
    try:
        SUITES[args.suite](check, rank, world, args.seed)
    except Exception:  # noqa: BLE001 - reported as this rank's failure
        check.failures.append(traceback.format_exc())
    dist.barrier()
    dist.destroy_process_group()
    if check.failures or check.count == 0:
        print(f"[rank {rank}] {args.suite}: FAILED ({len(check.failures)} of {check.count} "
              f"checks, seed {args.seed}):\n" + "\n".join(check.failures), flush=True)
        sys.exit(1)
    print(f"[rank {rank}] {args.suite}: passed ({check.count} checks)", flush=True)


if __name__ == "__main__":
    main()
