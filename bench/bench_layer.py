#!/usr/bin/env python3
"""The layer suites: forward and forward+backward of every case, for each implementation available
in this process, in the same run.

    python3 bench/bench_layer.py [--suite standard|small] [--cases a,b] [--impls torch,mok]
                                 [--routings uniform,skewed] [--reps 20] [--warmup-s 2] [--quick]
                                 [--out FILE]

Suites (--suite):
  standard  PERF.md's cases (the default), uniform and skewed routing, four implementations: torch,
            mok (the default MoKConfig), mok-1pass (a ring that holds the worst-case schedule
            table, so one ring pass always) and mok-2pass (a ring of half that table, so two ring
            passes, both with rows). Writes docs/perf/layer.json.
  small     small layers (T 1024-4096, H 1024-2048, I 512-768, E 32-128, k 2-8, no shared expert),
            uniform routing, torch and mok. Writes docs/perf/layer_small.json. With --quick it
            takes about a minute on an H200.

Method (PERF.md): CUDA events around each call, warm-up first (5 calls, then --warmup-s seconds of
calls back to back, so every implementation is timed at the clock the power limit sustains), median
of --reps runs, three input sets rotated (so the L2 holds no earlier inputs), correctness of each
implementation checked on a sample of tokens against an fp32 evaluation before it is timed; the SM
clock and power over each timing are recorded beside it. Writes PERF.md's schema; mok's records
also carry its config (ring sizes and passes). Ends with each mok implementation's time over
torch's, case by case.
"""
import argparse
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_clocks import ClockSampler  # noqa: E402
from timing import median_ms  # noqa: E402
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

# Per suite: its cases, and what runs when --impls, --routings, --out are not given.
SUITES = {
    "standard": dict(cases=CASES, impls="mok,mok-1pass,mok-2pass,torch", routings="uniform,skewed",
                     out="docs/perf/layer.json"),
    "small": dict(cases=SMALL_CASES, impls="mok,torch", routings="uniform",
                  out="docs/perf/layer_small.json"),
}
QUICK = dict(reps=20, warmup_s=1.0)  # --quick: PERF.md's 20 runs, 1 s of warm-up per timing
BF16_TFLOPS, HBM_TBPS = 790.0, 4.22  # PERF.md ceilings, replaced by ceilings.json when present
DEVICE = "cuda"  # where inputs are made (a check of this script's logic on a CPU sets "cpu")


def routing(T, E, k, skewed, gen):
    logits = torch.randn(T, E, device=gen.device, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    if skewed:  # expert 0 takes every other row: half of all rows (PERF.md)
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


def make_inputs(case, skewed, seed, weights):
    """Fresh activations and routing per set; the weights (many times the L2) are shared."""
    T, H, I, E, k, S = SHAPES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen).to(torch.bfloat16)
    ids, w = routing(T, E, k, skewed, gen)
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
    name = "torch"

    prepared = {}  # the baseline's weight layouts, made once per weight set (outside the timing)

    def setup(self, inp):
        key = id(inp["w_gate"])
        if key not in TorchImpl.prepared:
            TorchImpl.prepared.clear()
            TorchImpl.prepared[key] = prepare_weights(inp["w_gate"], inp["w_up"], inp["w_down"])
        gate_up, down = TorchImpl.prepared[key]
        self.leaves = [inp["x"], gate_up, down] + (list(inp["shared"]) if inp["shared"] else [])
        self.leaves = [t.detach().requires_grad_(True) for t in self.leaves]
        self.w = inp["w"].detach().requires_grad_(True)
        self.inp = inp

    def forward(self):
        x, gate_up, down, *shared = self.leaves
        return torch_moe(x, self.inp["ids"], self.w, gate_up, down, tuple(shared) if shared else None)

    def backward(self, out):
        for leaf in self.leaves + [self.w]:
            leaf.grad = None  # as after optimizer.zero_grad(): no accumulation into old grads
        out.backward(self.inp["d_out"])


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
        mf.backward(self.config, self.ws, self.schedule, self.ctx, inp["d_out"], inp["x"],
                    inp["w"], sg, su, sd, inp["w_gate"], inp["w_up"], inp["w_down"])


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
}


def floors_ms(case):
    T, H, I, E, k, S = SHAPES[case]
    flops = 2 * T * k * 3 * H * I + 2 * T * 3 * H * S
    bytes_ = (E * 3 * I * H + 3 * S * H + 2 * T * H) * 2
    return flops, max(flops / (BF16_TFLOPS * 1e9), bytes_ / (HBM_TBPS * 1e9))


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
    weight gradients' fp32 carries), then torch's cached blocks."""
    if "mok.functional" in sys.modules:
        sys.modules["mok.functional"].clear_workspace_cache()
    gc.collect()
    torch.cuda.empty_cache()


def measure(case, routing_name, impl_name, sets, args):
    """Checks one implementation on the first input set, then times it over the three; returns
    its records, or a sentence saying why it was not timed."""
    flops, floor = floors_ms(case)
    factory, result_name = IMPLS[impl_name]
    impl = factory()
    # Correctness before timing, on a sample of tokens of the first input set.
    impl.setup(sets[0])
    config = None
    if isinstance(impl, MokImpl):
        config = mok_config_record(impl.config, sets)
        want = MOK_PASSES[impl.variant]
        if want is not None and (config["max_passes"] != want
                                 or any(p != want for p in config["ring_passes"])):
            return f"config {config} does not give {want} ring pass(es) at every input set"
    with torch.no_grad():
        out = impl.forward()
    tokens = torch.tensor([0, 1, out.shape[0] // 2, out.shape[0] - 1], device=out.device)
    ref = fp32_reference_tokens(sets[0], tokens)
    err = ((out[tokens].float() - ref).norm() / ref.norm()).item()
    del out
    if not err < 4 * 2 ** -8:  # NaN fails too
        return f"WRONG output (rel err {err})"
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
        impl = factory()
        impl.setup(sets[0])
    rot = [factory() for _ in sets]
    for r, s in zip(rot, sets):
        r.setup(s)
    state = {"i": 0}

    def fwd():
        r = rot[state["i"] % 3]
        state["i"] += 1
        with torch.no_grad():
            r.forward()

    def fwdbwd():
        r = rot[state["i"] % 3]
        state["i"] += 1
        r.backward(r.forward())

    # The SM clock and power over each timing (NOTES: a sustained loop runs the same kernels
    # slower than a single call; this says whether the clock is why).
    with ClockSampler() as clk_f:
        t_f = median_ms(fwd, args.reps, warmup_s=args.warmup_s)
    with ClockSampler() as clk_fb:
        t_fb = median_ms(fwdbwd, args.reps, warmup_s=args.warmup_s)
    records = []
    for pass_, ms, fl, fm, clk in (("fwd", t_f, flops, floor, clk_f.summary()),
                                   ("fwdbwd", t_fb, 3 * flops, 3 * floor, clk_fb.summary())):
        records.append({"suite": "layer", "case": case, "routing": routing_name, "pass": pass_,
                        "impl": result_name, "median_ms": round(ms, 4),
                        "tflops": round(fl / (ms * 1e9), 1), "floor_ms": round(fm, 3),
                        "out_rel_err": err if pass_ == "fwd" else None, "clocks": clk,
                        "config": config})
        clock = (f"  SM {clk['sm_mhz_median']:.0f} MHz (min {clk['sm_mhz_min']}) "
                 f"{clk['power_w_mean']:.0f} W {','.join(clk['reasons'])}" if clk else "")
        print(f"{case:24s} {routing_name:7s} {impl_name:9s} {pass_:6s} {ms:9.3f} ms "
              f"{fl / (ms * 1e9):7.1f} TFLOP/s  floor {fm:7.3f} ms{clock}", flush=True)
    return records


def summary_lines(results):
    """Each implementation's time over torch's in the same run, per case, routing and pass: below
    1 mok is faster. Then, per implementation, the cells where it is slower."""
    torch_ms = {}
    for r in results:
        if r["impl"] == "torch":
            torch_ms[(r["case"], r["routing"], r["pass"])] = r["median_ms"]
    others = [n for n in dict.fromkeys(r["impl"] for r in results) if n != "torch"]
    if not torch_ms or not others:
        return []
    ms = {(r["case"], r["routing"], r["pass"], r["impl"]): r["median_ms"] for r in results}
    width = max(len(n) for n in others) + 2
    lines = ["", "time over torch's, same run (< 1: faster than torch, !: slower; ms in brackets)",
             f"{'case':24s} {'routing':7s} {'pass':6s} {'torch ms':>9s}"
             + "".join(f"{n:>{width + 10}s}" for n in others)]
    slower = {n: [] for n in others}
    for key, t in torch_ms.items():
        cells = ""
        for n in others:
            m = ms.get(key + (n,))
            if m is None:
                cells += f"{'-':>{width + 10}s}"
                continue
            cells += f"{m / t:>{width - 1}.2f}{'!' if m > t else ' '} ({m:7.3f})"
            if m > t:
                slower[n].append(f"{' '.join(key)} {m / t:.2f}")
        lines.append(f"{key[0]:24s} {key[1]:7s} {key[2]:6s} {t:9.3f}{cells}")
    for n in others:
        timed = sum(1 for key in torch_ms if key + (n,) in ms)
        verdict = ("at least as fast as torch in every one" if not slower[n]
                   else f"SLOWER than torch in {len(slower[n])}: " + "; ".join(slower[n]))
        lines.append(f"{n}: {timed} of {len(torch_ms)} cells timed; {verdict}")
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, default="standard")
    ap.add_argument("--cases", help="comma-separated case names (default: every case of the suite; "
                    f"known: {', '.join(SHAPES)})")
    ap.add_argument("--impls", help=f"comma-separated, of {', '.join(IMPLS)} (default: the suite's: "
                    + "; ".join(f"{s}: {d['impls']}" for s, d in SUITES.items()) + ")")
    ap.add_argument("--routings", help="comma-separated, of uniform, skewed (default: the suite's: "
                    + "; ".join(f"{s}: {d['routings']}" for s, d in SUITES.items()) + ")")
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
    if args.reps is None:
        args.reps = QUICK["reps"] if args.quick else 20
    if args.warmup_s is None:
        args.warmup_s = QUICK["warmup_s"] if args.quick else 2.0
    args.out = args.out or suite["out"]
    for what, names, known in (("case", args.cases, SHAPES), ("impl", args.impls, IMPLS),
                               ("routing", args.routings, ("uniform", "skewed"))):
        for n in names:
            if n not in known:
                ap.error(f"unknown {what} {n!r}; known: {', '.join(known)}")
    if args.reps < 1 or args.warmup_s < 0:
        ap.error("--reps must be at least 1 and --warmup-s at least 0")
    return args


def main():
    global BF16_TFLOPS, HBM_TBPS
    args = parse_args()
    ceil = pathlib.Path("docs/perf/ceilings.json")
    if ceil.exists():
        c = json.loads(ceil.read_text())["ceilings"]
        BF16_TFLOPS, HBM_TBPS = c["bf16_tflops"], c["hbm_tbps"]
    results = []
    failures = 0

    def write(cases):
        doc = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("MOK_COMMIT", "unknown"),
               "date": datetime.date.today().isoformat(), "cases": cases}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    for case in args.cases:
        for routing_name in args.routings:
            weights = make_weights(case, 7)
            sets = [make_inputs(case, routing_name == "skewed", seed, weights) for seed in range(3)]
            for impl_name in args.impls:
                try:
                    outcome = measure(case, routing_name, impl_name, sets, args)
                except Exception as e:  # noqa: BLE001 - reported and counted; the next ones still run
                    outcome = f"FAILED: {type(e).__name__}: {e}"
                release_memory()  # before the next implementation
                if isinstance(outcome, str):
                    print(f"{case} {routing_name} {impl_name}: {outcome}; not timed", flush=True)
                    failures += 1
                    continue
                results.extend(outcome)
                write(results)  # after every measurement: a run cut short keeps what it measured
            del sets, weights
            TorchImpl.prepared.clear()
            release_memory()
    write(results)
    for line in summary_lines(results):
        print(line)
    if failures:
        print(f"{failures} measurement(s) not timed (see above)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
