#!/usr/bin/env python3
"""The layer suites: forward and forward+backward of every case, for each implementation available
in this process, in the same run.

    python3 bench/bench_layer.py [--suite standard|small|fp8] [--cases a,b] [--impls torch,mok]
                                 [--routings uniform,skewed,skewed-distinct]
                                 [--timing solo,interleaved]
                                 [--reps 20] [--warmup-s 2] [--quick] [--out FILE]

Suites (--suite):
  standard  PERF.md's cases (the default), uniform and skewed routing, four implementations: torch,
            mok (the default MoKConfig), mok-1pass (a ring that holds the worst-case schedule
            table, so one ring pass always) and mok-2pass (a ring of half that table, so two ring
            passes, both with rows). Writes docs/perf/layer.json.
  small     small layers (T 1024-4096, H 1024-2048, I 512-768, E 32-128, k 2-8, no shared expert),
            uniform routing, torch and mok. Writes docs/perf/layer_small.json. With --quick it
            takes about a minute on an H200.
  fp8       PERF.md's cases, uniform and skewed, mok's FP8 layer (issue 43) beside mok bf16, torch
            and the FP8 peer: mok-fp8 (weights quantized once, outside the timing: mok's
            quantization cache holds them, as a training step's calls after its first find them),
            mok-fp8-quant (the same with the once-per-step weight quantization,
            mok._fp8_layer.requantize, inside every timed call), mok-fp8-bf16-wgrad (precision
            "fp8-bf16-wgrad": bf16 weight gradients), torchao-fp8 (torchao's FP8 rowwise
            MoE training recipe on torch._scaled_grouped_mm, where torchao imports) or torch-fp8
            (the same recipe written in bench/torch_fp8_moe.py). Every implementation is first
            checked against the f64 layer of the bf16 values, output and every gradient
            (bench/f64_layer.py: MoK's MXFP8 bounds, the errors recorded), and its memory per layer
            measured; then timed each alone (suite "layer-fp8") and all interleaved call by call
            (suite "layer-fp8-interleaved"). Writes docs/perf/layer_fp8.json; ends with the FP8
            speedups over mok bf16 against issue 43's bars (bench/fp8_bars.py).

Method (PERF.md): CUDA events around each call, warm-up first (5 calls, then --warmup-s seconds of
calls back to back, so every implementation is timed at the clock the power limit sustains), median
of --reps runs, three input sets rotated (so the L2 holds no earlier inputs), correctness of each
implementation checked before it is timed (on a sample of tokens against an fp32 evaluation, or in
the fp8 suite against the f64 layer); the SM clock and power over each timing are recorded beside
it. Writes PERF.md's schema; mok's records also carry its config (ring sizes and passes). Ends with
each implementation's time over torch's, case by case.

--timing solo: each implementation alone (its calls back to back: at the power limit a path's time
is its energy); interleaved: the implementations of a case take turns call by call (one clock for
all, closer to a ratio of cycles), each turn timed with its own events, the order rotated every
round. Where no GPU is present (a check of this script's logic) the times are wall-clock times.
"""
import argparse
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fp8_bars  # noqa: E402
import timing  # noqa: E402
from f64_layer import BOUNDS, f64_errors, within_bounds  # noqa: E402
from gpu_clocks import ClockSampler  # noqa: E402
from timing import event_ms, median_ms, synchronize  # noqa: E402
from torch_fp8_moe import fp8_grouped_mm, fp8_moe, torchao_grouped_mm  # noqa: E402
from torch_moe import prepare_weights, torch_moe  # noqa: E402

CASES = {  # PERF.md's standard suite. name: (T, H, I, E, k, S)
    "dsv3-ep8slice": (4096, 7168, 2048, 32, 8, 2048),
    "dsv3-ep1": (4096, 7168, 2048, 256, 8, 2048),
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8, 0),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2, 0),
}


def _small(T, H, I, E, k):
    return f"T{T}-H{H}-I{I}-E{E}-k{k}", (T, H, I, E, k, 0)


# Small layers, no shared expert: ten points of T {1024, 2048, 4096} x H {1024, 2048} x I {512, 768}
# x E {32, 64, 128} x k {2, 6, 8} that take every value of each, from 32 rows per expert (most
# padding, T2048-...-E128-k2) to 32768 rows in all (T4096-H2048-I768-E128-k8).
SMALL_CASES = dict(_small(*c) for c in (
    (1024, 1024, 512, 128, 8),
    (1024, 1024, 512, 32, 2),
    (1024, 2048, 768, 64, 8),
    (2048, 1024, 512, 64, 6),
    (2048, 2048, 768, 128, 2),
    (2048, 2048, 512, 32, 8),
    (4096, 1024, 768, 128, 6),
    (4096, 1024, 512, 64, 2),
    (4096, 2048, 768, 128, 8),
    (4096, 2048, 512, 32, 6),
))
SHAPES = {**CASES, **SMALL_CASES}

# Per suite: its cases, what runs when --impls, --routings, --timing, --out are not given, the
# suite its records name (PERF.md's schema; interleaved timings: "<name>-interleaved") and whether
# every implementation is checked against the f64 layer (FP8 implementations always are).
SUITES = {
    "standard": dict(cases=CASES, impls="mok,mok-1pass,mok-2pass,torch", routings="uniform,skewed",
                     timing="solo", out="docs/perf/layer.json", name="layer", f64=False),
    "small": dict(cases=SMALL_CASES, impls="mok,torch", routings="uniform", timing="solo",
                  out="docs/perf/layer_small.json", name="layer", f64=False),
    "fp8": dict(cases=CASES,
                impls="mok,mok-fp8,mok-fp8-quant,mok-fp8-bf16-wgrad,torch,torchao-fp8",
                routings="uniform,skewed", timing="solo,interleaved",
                out="docs/perf/layer_fp8.json", name="layer-fp8", f64=True),
}
QUICK = dict(reps=20, warmup_s=1.0)  # --quick: PERF.md's 20 runs, 1 s of warm-up per timing
BF16_TFLOPS, HBM_TBPS = 790.0, 4.22  # PERF.md ceilings, replaced by ceilings.json when present
FP8_TFLOPS = 1377.0  # PERF.md: e4m3 rowwise 8192^3 (torch._scaled_mm); ceilings.json's when present
DEVICE = "cuda"  # where inputs are made (a check of this script's logic on a CPU sets "cpu")


ROUTINGS = ("uniform", "skewed", "skewed-distinct")


def routing(T, E, k, kind, gen):
    """Top-k of random logits; `kind` one of ROUTINGS.

    skewed: expert 0 takes every other slot, half of all rows (PERF.md); from k = 3 every token
    holds expert 0 in several slots (at k = 2 those whose second choice was expert 0), which a
    top-k router never gives (and which repeats FP8 roundings, docs/architecture.md).
    skewed-distinct: the k // 2 first experts (expert 0 at k = 1 and 2) are in every token's
    top-k, as distinct experts: half of all rows on k // 2 experts (all rows at k = 1).
    """
    if kind not in ROUTINGS:
        raise ValueError(f"unknown routing {kind!r}; known: {', '.join(ROUTINGS)}")
    logits = torch.randn(T, E, device=gen.device, generator=gen)
    probs = torch.softmax(logits, -1)
    if kind == "skewed-distinct":
        hot = max(k // 2, 1)
        ids = torch.topk(logits + (torch.arange(E, device=logits.device) < hot) * 1e4, k, dim=-1)[1]
        w = probs.gather(1, ids)
    else:
        w, ids = torch.topk(probs, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    if kind == "skewed":  # expert 0 takes every other row: half of all rows (PERF.md)
        flat = ids.reshape(-1).clone()
        flat[0::2] = 0
        ids = flat.view(T, k)
    return ids.to(torch.int64), w.float()


def make_weights(case, seed):
    T, H, I, E, k, S = SHAPES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s, scale: (torch.randn(*s, device=DEVICE, generator=gen) * scale).to(torch.bfloat16)
    w = dict(w_gate=r(E, I, H, scale=H ** -0.5), w_up=r(E, I, H, scale=H ** -0.5),
             w_down=r(E, H, I, scale=I ** -0.5))
    w["shared"] = (r(S, H, scale=H ** -0.5), r(S, H, scale=H ** -0.5), r(H, S, scale=S ** -0.5)) if S else None
    return w


def make_inputs(case, routing_kind, seed, weights):
    """Fresh activations and routing per set; the weights (many times the L2) are shared."""
    T, H, I, E, k, S = SHAPES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen).to(torch.bfloat16)
    ids, w = routing(T, E, k, routing_kind, gen)
    return dict(weights, x=r(T, H), ids=ids, w=w, d_out=r(T, H))


def fp32_reference_tokens(inp, tokens):
    """out[t] for a few tokens, in fp32 from the bf16 values (an independent evaluation)."""
    x = inp["x"][tokens].float()
    out = torch.zeros_like(x)
    if inp["shared"] is not None:
        sg, su, sd = (t.float() for t in inp["shared"])
        out += (F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()
    for i, t in enumerate(tokens.tolist()):
        for j in range(inp["ids"].shape[1]):
            e = int(inp["ids"][t, j])
            g = inp["w_gate"][e].float() @ x[i]
            u = inp["w_up"][e].float() @ x[i]
            out[i] += inp["w"][t, j] * (inp["w_down"][e].float() @ (F.silu(g) * u))
    return out


class TorchImpl:
    """The PyTorch baseline (bench/torch_moe.py), autograd for the backward."""
    name = "torch"

    prepared = {}  # the baseline's weight layouts, made once per weight set (outside the timing)
    keep_grads = False  # keep the gradients of the last backward for grads() (the checks)

    def setup(self, inp):
        # NOTES: the entry holds the weight it was made from and is matched by identity: an id()
        # alone can be a freed tensor's, reused by the next weight set (a CPU test of another
        # shape once found the old layouts under it).
        held = TorchImpl.prepared.get("weights")
        if held is None or held[0] is not inp["w_gate"]:
            TorchImpl.prepared.clear()
            TorchImpl.prepared["weights"] = (inp["w_gate"], prepare_weights(
                inp["w_gate"], inp["w_up"], inp["w_down"]))
        gate_up, down = TorchImpl.prepared["weights"][1]
        self.leaves = [inp["x"], gate_up, down] + (list(inp["shared"]) if inp["shared"] else [])
        self.leaves = [t.detach().requires_grad_(True) for t in self.leaves]
        self.w = inp["w"].detach().requires_grad_(True)
        self.inp = inp

    def layer(self, *args):
        return torch_moe(*args)

    def forward(self):
        x, gate_up, down, *shared = self.leaves
        return self.layer(x, self.inp["ids"], self.w, gate_up, down,
                          tuple(shared) if shared else None)

    def backward(self, out):
        for leaf in self.leaves + [self.w]:
            leaf.grad = None  # as after optimizer.zero_grad(): no accumulation into old grads
        out.backward(self.inp["d_out"])
        if not self.keep_grads:
            # NOTES: freed now rather than at this object's next call (three input sets rotate, and
            # the interleaved timing holds every implementation's): three sets of dsv3-ep1's
            # weight gradients alone are 67 GB. Inside the timed region either way.
            for leaf in self.leaves + [self.w]:
                leaf.grad = None

    def grads(self):
        """The last backward's gradients (keep_grads), in mok's layouts."""
        x, gate_up, down, *shared = self.leaves
        d_gu = gate_up.grad  # [E, H, 2I]
        i = d_gu.shape[2] // 2
        grads = {"x": x.grad, "topk_weights": self.w.grad, "gate": d_gu[:, :, :i].transpose(1, 2),
                 "up": d_gu[:, :, i:].transpose(1, 2), "down": down.grad.transpose(1, 2)}
        if shared:
            grads.update(shared_gate=shared[0].grad, shared_up=shared[1].grad,
                         shared_down=shared[2].grad)
        return grads

    def memory_extra(self):
        return {}

    def record_extra(self):
        return {}


class TorchFp8Impl(TorchImpl):
    """PyTorch's FP8 MoE training recipe (torchao's Float8 rowwise on torch._scaled_grouped_mm) in
    the baseline's layer with expert groups padded to 16 rows (bench/torch_fp8_moe.py): `source`
    "torchao" runs torchao's own function (an ImportError where torchao does not import: the
    measurement fails and says so), "recipe" the same recipe written on torch's ops."""

    def __init__(self, source):
        self.source = source
        if source == "torchao":
            self.grouped_mm, self.version = torchao_grouped_mm()
        else:
            self.grouped_mm, self.version = fp8_grouped_mm, None

    def layer(self, *args):
        return fp8_moe(*args, grouped_mm=self.grouped_mm)

    def record_extra(self):
        return {"torchao": self.version} if self.version else {}


# The smallest minibatch the config accepts (src/core/config.cpp: a multiple of the 128-row GEMM
# tile), so that a ring size rounded up to whole minibatches grows by less than one tile.
MINIBATCH_ROWS = 128

# The ring passes each variant of mok's config must give, at every input set (None: any).
MOK_PASSES = {"default": None, "1pass": 1, "2pass": 2}


def round_up(v, m):
    return -(-v // m) * m


def mok_config(variant, T, k, E):
    """mok's MoKConfig for `variant` at EP=1.

    default: MoKConfig(): the automatic ring (macrobatch_size 0): 131072 routed rows plus each
             local expert's padding, so one pass on every PERF.md case (qwen3-30b-a3b's worst
             case, 147328 rows, is exactly that).
    1pass:   a ring of the worst-case schedule table (schedule_capacity_rows: T*k rows plus a
             partial tile of padding per expert), so one pass whatever the routing.
    2pass:   a ring of half the worst-case table, so two passes.
    NOTES: half of T*k would give three passes, not two: the table holds each expert's rows padded
    to the 128-row GEMM tile, so it is longer than T*k, and the layer runs the passes of the worst
    case (ceil(capacity / macrobatch_size): the workspace plan's max_passes). Half the
    worst case gives exactly two; both carry rows whenever the table is longer than the ring,
    which mok_config_record reads from mok's host twin of the schedule for every input set."""
    import mok.functional as mf
    from mok import _C

    if variant == "default":
        return mf.MoKConfig()
    capacity = _C.schedule_capacity_rows(T, k, E, 1)
    rows = {"1pass": capacity, "2pass": -(-capacity // 2)}[variant]
    return mf.MoKConfig(minibatch_size=MINIBATCH_ROWS,
                        macrobatch_size=round_up(rows, MINIBATCH_ROWS))


def mok_config_record(config, sets):
    """What a mok record says of its config: minibatch and macrobatch (rows), the passes the layer
    runs (sized for the worst case, no host sync: ceil(capacity / macrobatch_size)) and, per input
    set, the rows of its schedule table and the passes that hold rows (the RingPlan of mok's host
    twin of the schedule: total_rows, num_passes)."""
    from mok import _C, ops

    T, k = sets[0]["ids"].shape
    E = sets[0]["w_gate"].shape[0]
    capacity = _C.schedule_capacity_rows(T, k, E, 1)
    table_rows, ring_passes = [], []
    for s in sets:
        plan = ops.schedule_table([s["ids"].cpu()], E, 0, config.minibatch_size,
                                  config.macrobatch_size)[4]
        table_rows.append(int(plan[0]))
        ring_passes.append(int(plan[1]))
    ring = int(plan[2])  # the ring's rows (the automatic macrobatch resolved)
    return {"minibatch_size": config.minibatch_size, "macrobatch_size": config.macrobatch_size,
            "ring_rows": ring, "max_passes": -(-capacity // ring), "table_rows": table_rows,
            "ring_passes": ring_passes}


class MokImpl:
    """mok's functional API (MoK's argument order): build_schedule, forward, backward, with the
    config of `variant` (mok_config) and `path` as its forward_path ("launches" or "fused": the
    forward megakernel), `minibatch` its minibatch_size (None: the variant's), the megakernel's
    stage of pulls and tiles. NOTES: the path is a MoKConfig field, so every call (and the C++
    workspace the first one makes) runs it; when it was an environment variable the C++ layer
    read at its creation, "fused" rows once timed the launches (docs/perf/NOTES.md, 2026-12-03)."""
    name = "mok"
    keep_grads = False

    def __init__(self, variant="default", path="launches", minibatch=None):
        self.variant = variant
        self.path = path
        self.minibatch = minibatch

    def setup(self, inp):
        import mok.functional as mf
        T, H = inp["x"].shape
        k = inp["ids"].shape[1]
        E = inp["w_gate"].shape[0]
        self.mf = mf
        self.config = dataclasses.replace(mok_config(self.variant, T, k, E),
                                          forward_path=self.path)
        if self.minibatch is not None:
            self.config = dataclasses.replace(self.config, minibatch_size=self.minibatch)
        self.ws = mf.get_workspace(self.config, None, device=inp["x"].device,
                                   num_local_tokens=T, hidden_size=H, topk=k)
        self.inp = inp
        self.E = E
        sg, su, sd = inp["shared"] if inp["shared"] is not None else (None, None, None)
        self.shared = (sg, su, sd)

    def forward(self):
        mf, inp = self.mf, self.inp
        sg, su, sd = self.shared
        self.schedule = mf.build_schedule(self.ws, self.config, inp["ids"],
                                          num_local_experts=self.E)
        out, self.ctx = mf.forward(self.config, self.ws, self.schedule, inp["x"], inp["w"], sg,
                                   su, sd, inp["w_gate"], inp["w_up"], inp["w_down"])
        return out

    def backward(self, out):
        mf, inp = self.mf, self.inp
        sg, su, sd = self.shared
        grads = mf.backward(self.config, self.ws, self.schedule, self.ctx, inp["d_out"], inp["x"],
                            inp["w"], sg, su, sd, inp["w_gate"], inp["w_up"], inp["w_down"])
        self.last_grads = grads if self.keep_grads else None

    def grads(self):
        return mok_grads(self.last_grads, self.shared[0] is not None)

    def memory_extra(self):
        """mok's C++ workspace (scratch, cudaMalloc'd outside torch's allocator) and the last
        forward's context (tensors the caller holds until the backward)."""
        return {"workspace_bytes": self.ws.bytes,
                "context_bytes": sum(getattr(self.ctx, n).nbytes for n in CONTEXT_FIELDS
                                     if getattr(self.ctx, n) is not None)}

    def record_extra(self):
        return {}


def mok_grads(grads, has_shared):
    """mok's gradient tuple (d_x, d_topk_weights, routed gate, up, down, shared gate, up, down) as
    the checks name them."""
    d_x, d_w, dg, du, dd, dsg, dsu, dsd = grads
    out = {"x": d_x, "topk_weights": d_w, "gate": dg, "up": du, "down": dd}
    if has_shared:
        out.update(shared_gate=dsg, shared_up=dsu, shared_down=dsd)
    return out


class MokFp8Impl:
    """mok's FP8 layer (issue 43) through the ops mok.moe(..., precision="fp8") calls
    (mok._fp8_layer.forward_fp8 / backward_fp8, entered as mok's functional API enters the bf16
    ones, so both pay the same dispatch), on the default MoKConfig's workspace.

    The routed weights are quantized through mok's cache (mok._fp8_layer.quantized: keyed by the
    weight tensor, checked against its version): with `quantize_each_call` False once at set-up,
    outside the timing (every call finds them: a training step's calls after its first); with it
    True, mok._fp8_layer.requantize(gate, up, down) at the start of every timed call, the
    once-per-step quantization a training step pays. `fp8_weight_grads` False: precision
    "fp8-bf16-wgrad" (bf16 weight gradients from the bf16 rows)."""
    keep_grads = False

    def __init__(self, quantize_each_call, fp8_weight_grads=True):
        self.quantize_each_call = quantize_each_call
        self.fp8_weight_grads = fp8_weight_grads
        self.pending = None  # (FP8 weights, context) from a forward, for its backward

    def setup(self, inp):
        import mok.functional as mf
        from mok import _fp8_layer, _layer_ops
        T, H = inp["x"].shape
        k = inp["ids"].shape[1]
        self.fp8, self.call = _fp8_layer, _layer_ops.call
        self.config = mf.MoKConfig()
        self.ws = mf.get_workspace(self.config, None, device=inp["x"].device,
                                   num_local_tokens=T, hidden_size=H, topk=k)
        self.inp = inp
        self.weights = (inp["w_gate"], inp["w_up"], inp["w_down"])
        self.shared = inp["shared"] if inp["shared"] is not None else (None, None, None)
        if not self.quantize_each_call:
            self.quantized_weights()  # into the cache now, outside the timing

    def quantized_weights(self):
        if self.quantize_each_call:
            self.fp8.requantize(*self.weights)
        return [t for w in self.weights for t in self.fp8.quantized(w)]

    def forward(self):
        inp = self.inp
        fp8 = self.quantized_weights()
        out, *context = self.call(self.fp8.forward_fp8, inp["x"], inp["ids"], inp["w"],
                                  *self.weights, *self.shared, *fp8, self.ws.handle, None,
                                  self.fp8_weight_grads)
        # Held for a backward only where one may follow (grad mode: the forward+backward timing
        # and the checks), so that the forward-only timing does not keep stale FP8 copies alive.
        self.pending = (fp8, context) if torch.is_grad_enabled() else None
        return out

    def backward(self, out):
        inp = self.inp
        fp8, context = self.pending
        self.pending = None
        grads = self.call(self.fp8.backward_fp8, inp["d_out"], inp["x"], inp["ids"], inp["w"],
                          *self.weights, *self.shared, *fp8, *context, self.ws.handle, None,
                          self.fp8_weight_grads)
        self.last_grads = grads if self.keep_grads else None

    def grads(self):
        return mok_grads(self.last_grads, self.shared[0] is not None)

    def memory_extra(self):
        """As MokImpl's, and the FP8 weight copies (both orientations and their scales)."""
        fp8, context = self.pending
        return {"workspace_bytes": self.ws.bytes,
                "context_bytes": sum(t.nbytes for t in context),
                "fp8_weight_bytes": sum(t.nbytes for t in fp8)}

    def record_extra(self):
        return {}


# --impls name: (factory, the name in the results). Names in the results (PERF.md's schema): mok's
# path here is the unfused one of issue 6 (separate launches); the fused megakernels will be
# recorded as "mok".
IMPLS = {
    "mok": (MokImpl, "mok-unfused"),
    "mok-1pass": (lambda: MokImpl("1pass"), "mok-unfused-1pass"),
    "mok-2pass": (lambda: MokImpl("2pass"), "mok-unfused-2pass"),
    # The forward megakernel (off by default until it beats the launches: issue 16).
    "mok-fused": (lambda: MokImpl(path="fused"), "mok-fused"),
    "mok-fused-mb1024": (lambda: MokImpl(path="fused", minibatch=1024), "mok-fused-mb1024"),
    "mok-fused-2pass": (lambda: MokImpl("2pass", path="fused"), "mok-fused-2pass"),
    "torch": (TorchImpl, "torch"),
    # The FP8 layer (issue 43) and its peers (suite fp8).
    "mok-fp8": (lambda: MokFp8Impl(quantize_each_call=False), "mok-fp8"),
    "mok-fp8-quant": (lambda: MokFp8Impl(quantize_each_call=True), "mok-fp8-quant"),
    "mok-fp8-bf16-wgrad": (lambda: MokFp8Impl(quantize_each_call=False, fp8_weight_grads=False),
                           "mok-fp8-bf16-wgrad"),
    "torchao-fp8": (lambda: TorchFp8Impl("torchao"), "torchao-fp8"),
    "torch-fp8": (lambda: TorchFp8Impl("recipe"), "torch-fp8"),
}
FP8_IMPLS = ("mok-fp8", "mok-fp8-quant", "mok-fp8-bf16-wgrad", "torchao-fp8",
             "torch-fp8")
FP8_PEERS = ("torchao-fp8", "torch-fp8")
# MoK's bounds are mok's correctness gate before timing. FP8 peers are timed wherever their
# distance from the f64 layer is FP8 rounding rather than a wrong layer: within 2.5x MoK's bounds
# (a wrong layout or scale gives rel_l1 near 1 and cosine near 0); whether they meet MoK's own
# bounds is recorded beside their errors (NOTES: the rowwise recipe's router-weight gradient came
# out at cosine 0.9960 on a small CPU case, mok's FP8 layer at 0.9968).
PEER_BOUNDS = {"rel_l1": 0.25, "cosine": 0.99}


def floors_ms(case):
    T, H, I, E, k, S = SHAPES[case]
    flops = 2 * T * k * 3 * H * I + 2 * T * 3 * H * S
    bytes_ = (E * 3 * I * H + 3 * S * H + 2 * T * H) * 2
    return flops, max(flops / (BF16_TFLOPS * 1e9), bytes_ / (HBM_TBPS * 1e9))


def floor_fp8_ms(case):
    """The FP8 layer's forward floor: the routed FLOPs at the FP8 rate and the shared expert's at
    the bf16 rate, or the bytes with the routed weights read once in e4m3 (one byte each)."""
    T, H, I, E, k, S = SHAPES[case]
    flops_ms = (2 * T * k * 3 * H * I / (FP8_TFLOPS * 1e9)
                + 2 * T * 3 * H * S / (BF16_TFLOPS * 1e9))
    bytes_ = E * 3 * I * H + (3 * S * H + 2 * T * H) * 2
    return max(flops_ms, bytes_ / (HBM_TBPS * 1e9))


CONTEXT_FIELDS = ("x_routed", "gate_routed", "up_routed", "hidden_routed", "gate_shared",
                  "up_shared", "hidden_shared")


def forward_bits(impl):
    """One forward of a MokImpl: its whole output and every context tensor, routed ones at the
    rows of the first ring pass that hold a token's row (the others, padding and rows past the
    table, are never written: the context is torch.empty)."""
    with torch.no_grad():
        bits = {"out": impl.forward().clone()}
    rows = impl.ctx.x_routed.shape[0]
    real = impl.schedule.peer_token_idx[:rows] >= 0
    for name in CONTEXT_FIELDS:
        t = getattr(impl.ctx, name)
        if t is None:
            continue
        bits[name] = (t[:real.shape[0]][real] if name.endswith("_routed") else t).clone()
    return bits


def release_memory():
    """Frees what one implementation held before the next: mok's cached workspaces (their C++
    scratch is cudaMalloc'd outside torch's allocator and, with several ring passes, holds the
    weight gradients' fp32 carries) and its cached FP8 weight copies, then torch's cached
    blocks."""
    if "mok.functional" in sys.modules:
        sys.modules["mok.functional"].clear_workspace_cache()
    if "mok._fp8_layer" in sys.modules:
        sys.modules["mok._fp8_layer"]._CACHE.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def f64_check(impl, inp, bounds=BOUNDS):
    """One forward+backward of `impl` on `inp`, its output and gradients against the f64 layer
    (bench/f64_layer.py). Returns (errors, the names outside `bounds`)."""
    impl.keep_grads = True
    try:
        out = impl.forward()
        impl.backward(out)
        errors = f64_errors(inp, out, impl.grads())
    finally:
        impl.keep_grads = False
        impl.last_grads = None
        for leaf in getattr(impl, "leaves", []) + ([impl.w] if hasattr(impl, "w") else []):
            leaf.grad = None
    return errors, within_bounds(errors, bounds)


def memory_record(impl):
    """Memory per layer around one forward+backward: what torch's allocator holds after the
    forward above what it held before (output and whatever the backward needs), its peak above
    the start through the backward (torch.cuda.max_memory_allocated), and what the
    implementation says of itself (mok: its workspace, outside torch's allocator, and its forward
    context; FP8: the weight copies). No GPU: the implementation's own numbers only."""
    cuda = DEVICE == "cuda"
    if cuda:
        synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out = impl.forward()
    if cuda:
        synchronize()
        held = torch.cuda.memory_allocated() - before
    extra = impl.memory_extra()
    impl.backward(out)
    del out
    rec = dict(extra)
    if cuda:
        synchronize()
        rec.update(forward_held_bytes=held,
                   fwdbwd_peak_bytes=torch.cuda.max_memory_allocated() - before)
    return rec


def record(case, routing_name, pass_, result_name, ms, fl, floor, clk, suite, **extra):
    return {"suite": suite, "case": case, "routing": routing_name, "pass": pass_,
            "impl": result_name, "median_ms": round(ms, 4), "tflops": round(fl / (ms * 1e9), 1),
            "floor_ms": round(floor, 3), "clocks": clk, **extra}


def print_timing(case, routing_name, impl_name, pass_, ms, fl, fm, clk, how=""):
    clock = (f"  SM {clk['sm_mhz_median']:.0f} MHz (min {clk['sm_mhz_min']}) "
             f"{clk['power_w_mean']:.0f} W {','.join(clk['reasons'])}" if clk else "")
    print(f"{case:24s} {routing_name:7s} {impl_name:13s} {pass_:6s}{how} {ms:9.3f} ms "
          f"{fl / (ms * 1e9):7.1f} TFLOP/s  floor {fm:7.3f} ms{clock}", flush=True)


def rotation(impl_name, sets):
    """One set-up implementation per input set (the timings rotate through them)."""
    factory = IMPLS[impl_name][0]
    rot = [factory() for _ in sets]
    for r, s in zip(rot, sets):
        r.setup(s)
    return rot


def step_fns(rot):
    """(forward, forward+backward) callables that rotate through `rot`'s input sets."""
    state = {"i": 0}

    def fwd():
        r = rot[state["i"] % len(rot)]
        state["i"] += 1
        with torch.no_grad():
            r.forward()

    def fwdbwd():
        r = rot[state["i"] % len(rot)]
        state["i"] += 1
        r.backward(r.forward())
    return fwd, fwdbwd


def measure(case, routing_name, impl_name, sets, args, timed=True):
    """Checks one implementation on the first input set, then (`timed`) times it alone over the
    three; returns its records, or a sentence saying why it was not timed."""
    flops, floor = floors_ms(case)
    factory, result_name = IMPLS[impl_name]
    impl = factory()
    # Correctness before timing, on the first input set.
    impl.setup(sets[0])
    config = None
    if isinstance(impl, MokImpl):
        config = mok_config_record(impl.config, sets)
        want = MOK_PASSES[impl.variant]
        if want is not None and (config["max_passes"] != want
                                 or any(p != want for p in config["ring_passes"])):
            return f"config {config} does not give {want} ring pass(es) at every input set"
    checked = {}
    if args.f64:
        # The output and every gradient against the f64 layer (MoK's MXFP8 bounds), then the
        # memory per layer.
        bounds = PEER_BOUNDS if impl_name in FP8_PEERS else BOUNDS
        errors, outside = f64_check(impl, sets[0], bounds)
        mok_bounds = not within_bounds(errors)
        worst = max(e["rel_l1"] for e in errors.values())
        print(f"{case:24s} {routing_name:7s} {impl_name:13s} f64 check: largest rel_l1 "
              f"{worst:.3e}, smallest cosine {min(e['cosine'] for e in errors.values()):.6f}"
              + ("" if mok_bounds else f" (outside MoK's bounds {BOUNDS})"), flush=True)
        if outside:
            return (f"WRONG: outside {bounds} against the f64 layer: "
                    + "; ".join(f"{n} {errors[n]}" for n in outside))
        checked = {"f64_errors": errors, "f64_within_mok_bounds": mok_bounds,
                   "out_rel_err": errors["out"]["rel_l1"], "memory": memory_record(impl)}
    else:
        with torch.no_grad():
            out = impl.forward()
        tokens = torch.tensor([0, 1, out.shape[0] // 2, out.shape[0] - 1], device=out.device)
        ref = fp32_reference_tokens(sets[0], tokens)
        err = ((out[tokens].float() - ref).norm() / ref.norm()).item()
        del out
        if not err < 4 * 2 ** -8:  # NaN fails too
            return f"WRONG output (rel err {err})"
        checked = {"out_rel_err": err}
    if isinstance(impl, MokImpl) and impl.path != "launches":
        # The megakernel's whole output and forward context are the launches', bit for bit,
        # before it is timed.
        fused = forward_bits(impl)
        release_memory()
        ref_impl = MokImpl(impl.variant, "launches", impl.minibatch)
        ref_impl.setup(sets[0])
        differ = [name for name, t in forward_bits(ref_impl).items()
                  if not torch.equal(t, fused[name])]
        del ref_impl, fused
        release_memory()
        if differ:
            return (f"WRONG: the fused forward's {', '.join(differ)} differ bitwise from the "
                    "launches'")
    extra = impl.record_extra()
    del impl
    if not timed:
        return []
    fwd, fwdbwd = step_fns(rotation(impl_name, sets))

    # The SM clock and power over each timing (NOTES: a sustained loop runs the same kernels
    # slower than a single call; this says whether the clock is why).
    with ClockSampler() as clk_f:
        t_f = median_ms(fwd, args.reps, warmup_s=args.warmup_s)
    with ClockSampler() as clk_fb:
        t_fb = median_ms(fwdbwd, args.reps, warmup_s=args.warmup_s)
    records = []
    fp8_floor = floor_fp8_ms(case) if impl_name in FP8_IMPLS else None
    for pass_, ms, fl, fm, clk in (("fwd", t_f, flops, floor, clk_f.summary()),
                                   ("fwdbwd", t_fb, 3 * flops, 3 * floor, clk_fb.summary())):
        more = dict(extra, config=config, timing="solo",
                    **(checked if pass_ == "fwd" else {"out_rel_err": None}))
        if fp8_floor is not None:
            more["floor_fp8_ms"] = round(fp8_floor * (1 if pass_ == "fwd" else 3), 3)
        records.append(record(case, routing_name, pass_, result_name, ms, fl, fm, clk,
                              args.suite_name, **more))
        print_timing(case, routing_name, impl_name, pass_, ms, fl, fm, clk)
    return records


def measure_interleaved(case, routing_name, impl_names, sets, args):
    """The implementations (each checked already) take turns call by call, the order rotated
    every round, each call between its own events; per implementation the median of --reps calls
    and the median of its per-round ratio to the first implementation's call of that round (the
    one clock both ran at). Returns the records, or a sentence saying why none were timed."""
    flops, floor = floors_ms(case)
    rots = {n: rotation(n, sets) for n in impl_names}
    fns = {n: step_fns(rot) for n, rot in rots.items()}
    records = []
    for p, (pass_, fl, fm) in enumerate((("fwd", flops, floor), ("fwdbwd", 3 * flops,
                                                                    3 * floor))):
        for n in impl_names:  # each one's first calls (allocations, caches) before any timing
            for _ in range(3):
                fns[n][p]()
        synchronize()
        start = time.perf_counter()
        while time.perf_counter() - start < args.warmup_s:
            for n in impl_names:
                fns[n][p]()
            synchronize()
        times = {n: [] for n in impl_names}
        with ClockSampler() as clk:
            for rep in range(args.reps):
                shift = rep % len(impl_names)
                for n in impl_names[shift:] + impl_names[:shift]:
                    times[n].append(event_ms(fns[n][p]))
        base = impl_names[0]
        for n in impl_names:
            ms = statistics.median(times[n])
            ratio = statistics.median(b / t for b, t in zip(times[base], times[n]))
            records.append(record(case, routing_name, pass_, IMPLS[n][1], ms, fl, fm,
                                  clk.summary(), args.suite_name + "-interleaved",
                                  timing="interleaved", base=IMPLS[base][1],
                                  base_over_this_median=round(ratio, 4)))
            print_timing(case, routing_name, n, pass_, ms, fl, fm, None, " (interleaved)")
    return records


def summary_lines(results):
    """Each implementation's time over torch's in the same run, per case, routing and pass: below
    1 mok is faster. Then, per implementation, the cells where it is slower."""
    torch_ms = {}
    for r in results:
        if r["impl"] == "torch":
            torch_ms[(r["suite"], r["case"], r["routing"], r["pass"])] = r["median_ms"]
    others = [n for n in dict.fromkeys(r["impl"] for r in results) if n != "torch"]
    if not torch_ms or not others:
        return []
    ms = {(r["suite"], r["case"], r["routing"], r["pass"], r["impl"]): r["median_ms"]
          for r in results}
    width = max(len(n) for n in others) + 2
    lines = ["", "time over torch's, same run (< 1: faster than torch, !: slower; ms in brackets)",
             f"{'case':24s} {'routing':7s} {'pass':6s} {'torch ms':>9s}"
             + "".join(f"{n:>{width + 10}s}" for n in others)]
    slower = {n: [] for n in others}
    several = len({k[0] for k in torch_ms}) > 1
    for key, t in torch_ms.items():
        cells = ""
        for n in others:
            m = ms.get(key + (n,))
            if m is None:
                cells += f"{'-':>{width + 10}s}"
                continue
            cells += f"{m / t:>{width - 1}.2f}{'!' if m > t else ' '} ({m:7.3f})"
            if m > t:
                slower[n].append(f"{' '.join(key[1:])} {m / t:.2f}")
        label = f"{key[1]} ({key[0]})" if several else key[1]
        lines.append(f"{label:24s} {key[2]:7s} {key[3]:6s} {t:9.3f}{cells}")
    for n in others:
        timed = sum(1 for key in torch_ms if key + (n,) in ms)
        verdict = ("at least as fast as torch in every one" if not slower[n]
                   else f"SLOWER than torch in {len(slower[n])}: " + "; ".join(slower[n]))
        lines.append(f"{n}: {timed} of {len(torch_ms)} cells timed; {verdict}")
    fp8 = fp8_bars.layer_lines(results, "layer-fp8") + fp8_bars.interleaved_lines(
        results, "layer-fp8-interleaved")
    return lines + ([""] + fp8 if fp8 else [])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, default="standard")
    ap.add_argument("--cases", help="comma-separated case names (default: every case of the suite; "
                    f"known: {', '.join(SHAPES)})")
    ap.add_argument("--impls", help=f"comma-separated, of {', '.join(IMPLS)} (default: the suite's: "
                    + "; ".join(f"{s}: {d['impls']}" for s, d in SUITES.items()) + ")")
    ap.add_argument("--routings", help=f"comma-separated, of {', '.join(ROUTINGS)} (default: the "
                    "suite's: "
                    + "; ".join(f"{s}: {d['routings']}" for s, d in SUITES.items()) + ")")
    ap.add_argument("--timing", help="comma-separated, of solo, interleaved (default: the "
                    "suite's: " + "; ".join(f"{s}: {d['timing']}" for s, d in SUITES.items())
                    + ")")
    ap.add_argument("--reps", type=int, help="timed runs per median (default 20)")
    ap.add_argument("--warmup-s", type=float,
                    help="seconds of back-to-back calls before each timing (sustained clock; default 2)")
    ap.add_argument("--quick", action="store_true",
                    help=f"--reps {QUICK['reps']} --warmup-s {QUICK['warmup_s']:g} unless given")
    ap.add_argument("--out", help="results file (default: the suite's: "
                    + "; ".join(f"{s}: {d['out']}" for s, d in SUITES.items()) + ")")
    args = ap.parse_args(argv)
    suite = SUITES[args.suite]
    args.cases = args.cases.split(",") if args.cases else list(suite["cases"])
    args.impls = (args.impls or suite["impls"]).split(",")
    args.routings = (args.routings or suite["routings"]).split(",")
    args.timing = (args.timing or suite["timing"]).split(",")
    if args.reps is None:
        args.reps = QUICK["reps"] if args.quick else 20
    if args.warmup_s is None:
        args.warmup_s = QUICK["warmup_s"] if args.quick else 2.0
    args.out = args.out or suite["out"]
    args.suite_name = suite["name"]
    # FP8 implementations are checked against the f64 layer (the fp32 token check's bound is
    # bf16's), and so is everything timed beside them.
    args.f64 = suite["f64"] or any(n in FP8_IMPLS for n in args.impls)
    for what, names, known in (("case", args.cases, SHAPES), ("impl", args.impls, IMPLS),
                               ("routing", args.routings, ROUTINGS),
                               ("timing", args.timing, ("solo", "interleaved"))):
        for n in names:
            if n not in known:
                ap.error(f"unknown {what} {n!r}; known: {', '.join(known)}")
    if args.reps < 1 or args.warmup_s < 0:
        ap.error("--reps must be at least 1 and --warmup-s at least 0")
    return args


def device_name():
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def main(argv=None):
    global BF16_TFLOPS, HBM_TBPS, FP8_TFLOPS
    args = parse_args(argv)
    timing.WALL_CLOCK = DEVICE != "cuda"  # a check of this script's logic on CPU tensors
    ceil = pathlib.Path("docs/perf/ceilings.json")
    if ceil.exists():
        c = json.loads(ceil.read_text())["ceilings"]
        BF16_TFLOPS, HBM_TBPS = c["bf16_tflops"], c["hbm_tbps"]
        FP8_TFLOPS = c.get("fp8_tflops", FP8_TFLOPS)
    results = []
    failures = 0
    started = time.perf_counter()

    def write(cases):
        doc = {"gpu": device_name(), "commit": os.environ.get("MOK_COMMIT", "unknown"),
               "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "reps": args.reps, "warmup_s": args.warmup_s, "cases": cases}
        if DEVICE != "cuda":
            doc["device"] = DEVICE  # merge_results.py leaves a CPU run out of results.json
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    for case in args.cases:
        for routing_name in args.routings:
            weights = make_weights(case, 7)
            sets = [make_inputs(case, routing_name, seed, weights) for seed in range(3)]
            checked = []  # the implementations that passed their check: the interleaved set
            for impl_name in args.impls:
                try:
                    outcome = measure(case, routing_name, impl_name, sets, args,
                                      timed="solo" in args.timing)
                except Exception as e:  # noqa: BLE001 - reported and counted; the next ones still run
                    outcome = f"FAILED: {type(e).__name__}: {e}"
                release_memory()  # before the next implementation
                if isinstance(outcome, str):
                    print(f"{case} {routing_name} {impl_name}: {outcome}; not timed", flush=True)
                    failures += 1
                    continue
                checked.append(impl_name)
                results.extend(outcome)
                write(results)  # after every measurement: a run cut short keeps what it measured
            if "interleaved" in args.timing and len(checked) > 1:
                try:
                    outcome = measure_interleaved(case, routing_name, checked, sets, args)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory with all of them held
                    outcome = f"FAILED: {type(e).__name__}: {e}"
                release_memory()
                if isinstance(outcome, str):
                    print(f"{case} {routing_name} interleaved: {outcome}; not timed", flush=True)
                    failures += 1
                else:
                    results.extend(outcome)
                    write(results)
            del sets, weights
            TorchImpl.prepared.clear()
            release_memory()
    write(results)
    for line in summary_lines(results):
        print(line)
    if failures:
        print(f"{failures} measurement(s) not timed (see above)")
    print(f"bench_layer: {len(results)} records in {time.perf_counter() - started:.0f} s "
          f"-> {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
