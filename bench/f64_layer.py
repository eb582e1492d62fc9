"""The f64 layer of the bf16 values, and how far a layer's output and gradients sit from it: the
check bench/bench_layer.py makes of every implementation of the FP8 suite before timing it.

The reference runs one expert at a time (the f64 weights of dsv3-ep1 alone would be 90 GB) and
compares each expert's weight gradients as they come out, so it holds one expert's f64 tensors at
a time beside the f64 output, d_x and router-weight gradient. Each comparison accumulates
sum|got - ref|, sum|ref|, the dot product and both squared norms, and the largest |got - ref|:

    rel_l1 = sum|got - ref| / sum|ref|      cosine = <got, ref> / (|got| |ref|)      abs_max

MoK's MXFP8 bounds (issue 43): rel_l1 below 0.1 and cosine at least 0.996 on the output and every
gradient (its abs-max bound of 1.0 is recorded, not applied: the weight gradients' magnitudes grow
with the token count, docs/perf/NOTES.md).
"""
import torch
import torch.nn.functional as F

BOUNDS = {"rel_l1": 0.1, "cosine": 0.996}


class Distance:
    """Sums for rel_l1, cosine and abs_max over pieces compared one after another (device
    tensors: no host synchronization until result())."""

    def __init__(self):
        self.sums = None

    def add(self, got, ref):
        got, ref = got.double(), ref.double()
        d = got - ref
        part = torch.stack([d.abs().sum(), ref.abs().sum(), (got * ref).sum(), (got * got).sum(),
                            (ref * ref).sum(), d.abs().max() if d.numel() else d.new_zeros(())])
        if self.sums is None:
            self.sums = part
        else:
            self.sums = torch.cat([self.sums[:5] + part[:5], torch.maximum(self.sums[5:],
                                                                             part[5:])])

    def result(self):
        l1, ref_l1, dot, gg, rr, abs_max = self.sums.tolist()
        if ref_l1 == 0:  # an all-zero reference: only all zeros match it
            return {"rel_l1": l1, "cosine": 1.0 if gg == 0 else 0.0, "abs_max": abs_max}
        cos = dot / (gg * rr) ** 0.5 if gg > 0 else 0.0
        return {"rel_l1": l1 / ref_l1, "cosine": cos, "abs_max": abs_max}


def _swiglu_backward(g, u, d_a):
    """(d_g, d_u) of a = silu(g) * u."""
    sig = torch.sigmoid(g)
    return d_a * u * sig * (1 + g * (1 - sig)), d_a * g * sig


def f64_errors(inp, out, grads):
    """Distances of `out` and `grads` from the f64 layer of inp's bf16 values (bench_layer's
    input dict: x, ids, w, w_gate [E, I, H], w_up, w_down [E, H, I], shared, d_out).

    grads: x, topk_weights, gate, up, down and, with a shared expert, shared_gate, shared_up,
    shared_down, in the layouts of the inputs (mok's). Returns {name: {rel_l1, cosine,
    abs_max}} with names out, d_x, d_topk_weights, d_gate, ... (the gradients')."""
    x = inp["x"].double()
    dy = inp["d_out"].double()
    ids, w = inp["ids"], inp["w"].double()
    T, k = ids.shape
    E = inp["w_gate"].shape[0]
    ref_out = torch.zeros_like(x)
    d_x = torch.zeros_like(x)
    d_w = torch.zeros_like(w)
    dist = {n: Distance() for n in ("gate", "up", "down")}
    errors = {}
    if inp["shared"] is not None:
        sg, su, sd = (t.double() for t in inp["shared"])
        g, u = x @ sg.t(), x @ su.t()
        a = F.silu(g) * u
        ref_out += a @ sd.t()
        d_g, d_u = _swiglu_backward(g, u, dy @ sd)
        d_x += d_g @ sg + d_u @ su
        for name, ref in (("shared_gate", d_g.t() @ x), ("shared_up", d_u.t() @ x),
                          ("shared_down", dy.t() @ a)):
            dist[name] = Distance()
            dist[name].add(grads[name], ref)
        del g, u, a, d_g, d_u
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:  # no rows: the exact gradients are zeros
            for name, weight in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
                dist[name].add(grads[name][e], torch.zeros_like(inp[weight][e],
                                                                dtype=torch.float64))
            continue
        slots = order[start:start + c]
        start += c
        tok, j = slots // k, slots % k
        wg, wu, wd = (inp[n][e].double() for n in ("w_gate", "w_up", "w_down"))
        xe = x[tok]
        g, u = xe @ wg.t(), xe @ wu.t()
        a = F.silu(g) * u
        ye = a @ wd.t()
        we = w[tok, j].unsqueeze(1)
        ref_out.index_add_(0, tok, we * ye)
        dye = dy[tok]
        d_w[tok, j] = (dye * ye).sum(1)
        d_ye = we * dye
        d_g, d_u = _swiglu_backward(g, u, d_ye @ wd)
        d_x.index_add_(0, tok, d_g @ wg + d_u @ wu)
        dist["gate"].add(grads["gate"][e], d_g.t() @ xe)
        dist["up"].add(grads["up"][e], d_u.t() @ xe)
        dist["down"].add(grads["down"][e], d_ye.t() @ a)
        del xe, g, u, a, ye, dye, d_ye, d_g, d_u
    for name, got, ref in (("out", out, ref_out), ("d_x", grads["x"], d_x),
                           ("d_topk_weights", grads["topk_weights"], d_w)):
        errors[name] = Distance()
        errors[name].add(got, ref)
    errors = {n: d.result() for n, d in errors.items()}
    errors.update({f"d_{n}": d.result() for n, d in dist.items()})
    return errors


def within_bounds(errors, bounds=BOUNDS):
    """The names whose distance breaks `bounds` (MoK's by default; empty: all within); NaN breaks
    them."""
    return [n for n, e in errors.items()
            if not (e["rel_l1"] < bounds["rel_l1"] and e["cosine"] >= bounds["cosine"])]
