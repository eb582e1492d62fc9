#!/usr/bin/env python3
"""The layer suite of PERF.md: forward, backward and forward+backward of every standard case,
uniform and skewed routing, for each implementation available in this process, in the same run.

    python3 bench/bench_layer.py [--cases a,b] [--impls torch,mok] [--reps 20] [--out docs/perf/layer.json]

Method (PERF.md): CUDA events around each call, warm-up first (5 calls, then --warmup-s seconds of
calls back to back, so every implementation is timed at the clock the power limit sustains), median
of --reps runs, three input sets rotated (so the L2 holds no earlier inputs), correctness of each
implementation checked on a sample of tokens against an fp32 evaluation before it is timed; the SM
clock and power over each timing are recorded beside it. Writes PERF.md's schema.
"""
import argparse
import datetime
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

CASES = {  # name: (T, H, I, E, k, S)
    "dsv3-ep8slice": (4096, 7168, 2048, 32, 8, 2048),
    "dsv3-ep1": (4096, 7168, 2048, 256, 8, 2048),
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8, 0),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2, 0),
}
BF16_TFLOPS, HBM_TBPS = 790.0, 4.22  # PERF.md ceilings, replaced by ceilings.json when present


def routing(T, E, k, skewed, gen):
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    if skewed:  # expert 0 takes every other row: half of all rows (PERF.md)
        flat = ids.reshape(-1).clone()
        flat[0::2] = 0
        ids = flat.view(T, k)
    return ids.to(torch.int64), w.float()


def make_weights(case, seed):
    T, H, I, E, k, S = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale: (torch.randn(*s, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    w = dict(w_gate=r(E, I, H, scale=H ** -0.5), w_up=r(E, I, H, scale=H ** -0.5),
             w_down=r(E, H, I, scale=I ** -0.5))
    w["shared"] = (r(S, H, scale=H ** -0.5), r(S, H, scale=H ** -0.5), r(H, S, scale=S ** -0.5)) if S else None
    return w


def make_inputs(case, skewed, seed, weights):
    """Fresh activations and routing per set; the weights (many times the L2) are shared."""
    T, H, I, E, k, S = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)
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


class MokImpl:
    """mok's functional API (MoK's argument order): build_schedule, forward, backward."""
    name = "mok"

    def setup(self, inp):
        import mok.functional as mf
        T, H = inp["x"].shape
        k = inp["ids"].shape[1]
        E = inp["w_gate"].shape[0]
        self.mf = mf
        self.config = mf.MoKConfig()
        self.ws = mf.get_workspace(self.config, None, device=inp["x"].device, num_local_tokens=T,
                                   hidden_size=H, topk=k)
        self.inp = inp
        self.E = E
        sg, su, sd = inp["shared"] if inp["shared"] is not None else (None, None, None)
        self.shared = (sg, su, sd)

    def forward(self):
        mf, inp = self.mf, self.inp
        sg, su, sd = self.shared
        self.schedule = mf.build_schedule(self.ws, self.config, inp["ids"], num_local_experts=self.E)
        out, self.ctx = mf.forward(self.config, self.ws, self.schedule, inp["x"], inp["w"], sg, su, sd,
                                   inp["w_gate"], inp["w_up"], inp["w_down"])
        return out

    def backward(self, out):
        mf, inp = self.mf, self.inp
        sg, su, sd = self.shared
        mf.backward(self.config, self.ws, self.schedule, self.ctx, inp["d_out"], inp["x"], inp["w"],
                    sg, su, sd, inp["w_gate"], inp["w_up"], inp["w_down"])


def floors_ms(case):
    T, H, I, E, k, S = CASES[case]
    flops = 2 * T * k * 3 * H * I + 2 * T * 3 * H * S
    bytes_ = (E * 3 * I * H + 3 * S * H + 2 * T * H) * 2
    return flops, max(flops / (BF16_TFLOPS * 1e9), bytes_ / (HBM_TBPS * 1e9))


# Names in the results (PERF.md's schema): mok's path here is the unfused one of issue 6 (separate
# launches); the fused megakernels will be recorded as "mok".
RESULT_NAMES = {"mok": "mok-unfused", "torch": "torch"}


def main():
    global BF16_TFLOPS, HBM_TBPS
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--impls", default="mok,torch")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=2.0,
                    help="seconds of back-to-back calls before each timing (sustained clock)")
    ap.add_argument("--out", default="docs/perf/layer.json")
    args = ap.parse_args()
    ceil = pathlib.Path("docs/perf/ceilings.json")
    if ceil.exists():
        c = json.loads(ceil.read_text())["ceilings"]
        BF16_TFLOPS, HBM_TBPS = c["bf16_tflops"], c["hbm_tbps"]
    impls = {"torch": TorchImpl, "mok": MokImpl}
    results = []
    failures = 0

    def write(cases):
        doc = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("MOK_COMMIT", "unknown"),
               "date": datetime.date.today().isoformat(), "cases": cases}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    for case in args.cases.split(","):
        flops, floor = floors_ms(case)
        for skewed in (False, True):
            routing_name = "skewed" if skewed else "uniform"
            weights = make_weights(case, 7)
            sets = [make_inputs(case, skewed, seed, weights) for seed in range(3)]
            for impl_name in args.impls.split(","):
                impl = impls[impl_name]()
                # Correctness before timing, on a sample of tokens of the first input set.
                impl.setup(sets[0])
                with torch.no_grad():
                    out = impl.forward()
                tokens = torch.tensor([0, 1, out.shape[0] // 2, out.shape[0] - 1], device="cuda")
                ref = fp32_reference_tokens(sets[0], tokens)
                err = ((out[tokens].float() - ref).norm() / ref.norm()).item()
                del out
                if not err < 4 * 2 ** -8:  # NaN fails too
                    print(f"{case} {routing_name} {impl_name}: WRONG output (rel err {err}); not timed",
                          flush=True)
                    failures += 1
                    continue
                rot = [impls[impl_name]() for _ in sets]
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

                # The SM clock and power over each timing (NOTES: a sustained loop runs the same
                # kernels slower than a single call; this says whether the clock is why).
                with ClockSampler() as clk_f:
                    t_f = median_ms(fwd, args.reps, warmup_s=args.warmup_s)
                with ClockSampler() as clk_fb:
                    t_fb = median_ms(fwdbwd, args.reps, warmup_s=args.warmup_s)
                for pass_, ms, fl, fm, clk in (("fwd", t_f, flops, floor, clk_f.summary()),
                                               ("fwdbwd", t_fb, 3 * flops, 3 * floor, clk_fb.summary())):
                    results.append({"suite": "layer", "case": case, "routing": routing_name, "pass": pass_,
                                    "impl": RESULT_NAMES[impl_name], "median_ms": round(ms, 4),
                                    "tflops": round(fl / (ms * 1e9), 1), "floor_ms": round(fm, 3),
                                    "out_rel_err": err if pass_ == "fwd" else None, "clocks": clk})
                    clock = (f"  SM {clk['sm_mhz_median']:.0f} MHz (min {clk['sm_mhz_min']}) "
                             f"{clk['power_w_mean']:.0f} W {','.join(clk['reasons'])}" if clk else "")
                    print(f"{case:15s} {routing_name:7s} {impl_name:6s} {pass_:6s} {ms:9.3f} ms "
                          f"{fl / (ms * 1e9):7.1f} TFLOP/s  floor {fm:7.3f} ms{clock}", flush=True)
                rot = impl = None  # free their buffers before the next implementation
                write(results)  # after every measurement: a run cut short keeps what it measured
            del sets, weights
            TorchImpl.prepared.clear()
            torch.cuda.empty_cache()
    write(results)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
