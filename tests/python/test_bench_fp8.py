"""The FP8 benchmark's own logic on the CPU (bench/bench_layer.py --suite fp8 and what it uses):
the torch._scaled_grouped_mm recipe of bench/torch_fp8_moe.py through its CPU emulation, the f64
layer of bench/f64_layer.py, the FP8 layer implementations of bench_layer.py end to end on tiny
shapes, and the bar tables of bench/fp8_bars.py, bench/merge_results.py and bench/bench_gemm.py
fed synthetic results. Nothing here is timed; the GPU run is scripts/gpu-fp8-bench."""
import json
import math
import pathlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import GRAD_TOLERANCE, OUT_TOLERANCE, SEED, rel_error

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import bench_layer as bl  # noqa: E402
import f64_layer  # noqa: E402
import fp8_bars  # noqa: E402
import torch_fp8_moe as t8  # noqa: E402
from torch_moe import prepare_weights, torch_moe  # noqa: E402

MOK_BOUNDS = f64_layer.BOUNDS


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """bench_layer's data on CPU tensors, timed by wall clock, whatever machine runs the tests;
    the shapes a test adds go with it."""
    monkeypatch.setattr(bl, "DEVICE", "cpu")
    monkeypatch.setattr(bl.timing, "WALL_CLOCK", True)
    monkeypatch.setattr(bl, "SHAPES", dict(bl.SHAPES))


def seed_from(gen):
    return int(torch.randint(1 << 30, (1,), generator=gen))


def wide_range(gen, *shape, spread=6):
    """Gaussian values times 2^U(-spread, spread) per row of the last dimension and per column:
    data on which a scale taken along the wrong axis under- or overflows e4m3."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    rows = torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=gen)
    cols = torch.randint(-spread, spread + 1, (shape[-1],), generator=gen)
    return x * torch.exp2((rows + cols).double())


def distance(got, ref):
    d = f64_layer.Distance()
    d.add(got, ref)
    return d.result()


# ---- quantization -------------------------------------------------------------------------------

def test_rowwise_quantization_is_e4m3_with_power_of_two_scales(gen):
    x = wide_range(gen, 64, 256).to(torch.bfloat16)
    x[3] = 0  # an all-zero row gets a finite scale
    q, inv = t8.quantize_along(x, -1)
    assert q.dtype == torch.float8_e4m3fn and inv.shape == (64, 1)
    scale = inv.reciprocal()
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale), "scales: powers of two"
    amax = x.float().abs().amax(-1, keepdim=True)
    top = (amax * scale)[amax > 0]
    # Rounded down to a power of two: the largest scaled value lies in (224, 448].
    assert bool((top > 224).all()) and bool((top <= 448).all()), top
    scaled = x.float() * scale
    err = (q.float() - scaled).abs()
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value) for normals, steps of 2^-9 below
    # 2^-6.
    bound = torch.maximum(scaled.abs() * 2.0**-4, torch.full_like(scaled, 2.0**-10))
    assert bool((err <= bound).all()), (err / bound).max()
    assert not q.float().isnan().any()


def test_the_cast_in_slices_is_the_whole_cast(monkeypatch, gen):
    w = wide_range(gen, 5, 48, 32).to(torch.bfloat16).transpose(-2, -1)  # a column-major view
    whole, inv = t8.quantize_along(w, -2)
    monkeypatch.setattr(t8, "CHUNK", 1000)  # slices of 1 expert (1536 elements each)
    sliced, inv2 = t8.quantize_along(w, -2)
    assert torch.equal(inv, inv2) and whole.stride() == w.stride() == sliced.stride()
    assert torch.equal(whole.view(torch.uint8), sliced.view(torch.uint8))


def test_group_column_quantization_takes_each_groups_amax(gen):
    C, align = 48, t8.ALIGN
    sizes = [32, 0, 16, 48]  # an empty group too
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    M = int(ends[-1]) + 2 * align  # rows past the last group: poisoned, never read
    x = wide_range(gen, M, C).to(torch.bfloat16)
    x[int(ends[-1]):] = float("nan")
    q, inv = t8.quantize_group_columns(x, ends)
    assert q.shape == (M, C) and q.stride() == (1, M), "column-major"
    assert inv.shape == (len(sizes) * C,)
    start = 0
    for g, n in enumerate(sizes):
        rows = x[start:start + n].float()
        amax = rows.abs().amax(0) if n else torch.zeros(C)
        want = t8.pow2_scale(amax)
        assert torch.equal(inv[g * C:(g + 1) * C], want.reciprocal()), g
        if n:
            assert torch.allclose(q[start:start + n].float() / want, rows, rtol=2.0**-4,
                                  atol=2.0**-10 / float(want.min()))
        start += n
    with pytest.raises(ValueError, match="multiple of 16"):
        t8.quantize_group_columns(x[:M - 1], ends)


# ---- the emulated GEMM and the recipe's autograd function ---------------------------------------

def test_emulation_refuses_what_torch_refuses(gen):
    a = torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(2, 48, 64, generator=gen).to(torch.float8_e4m3fn)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    good = t8.emulated_scaled_grouped_mm(a, b.transpose(-2, -1), torch.ones(32), torch.ones(2, 48),
                                         offs)
    assert good.shape == (32, 48) and good.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="column major"):  # torch's own check (meta tensors)
        t8.emulated_scaled_grouped_mm(a, b.transpose(-2, -1).contiguous(), torch.ones(32),
                                      torch.ones(2, 48), offs)
    with pytest.raises(RuntimeError, match="scale_b"):
        t8.emulated_scaled_grouped_mm(a, b.transpose(-2, -1), torch.ones(32), torch.ones(2, 64),
                                      offs)
    # Groups along the contraction must be 16-row multiples (what the layer pads them to).
    with pytest.raises(ValueError, match="multiples of 16"):
        t8.emulated_scaled_grouped_mm(a.t().contiguous(), a.t().contiguous().t(),
                                      torch.ones(2 * 64), torch.ones(2 * 64),
                                      torch.tensor([8, 32], dtype=torch.int32))


def test_fp8_grouped_mm_matches_f64_within_fp8_bounds(gen):
    """out, dA and dB of the recipe against the f64 products, on wide-range data (a scale along
    the wrong axis would flush the small entries and leave the bounds far behind)."""
    K, N, E = 256, 128, 4
    sizes = [64, 0, 32, 112]
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    used = int(ends[-1])
    M = used + 16
    A = wide_range(gen, M, K).to(torch.bfloat16)
    A[used:] = float("nan")  # rows past the groups (the layer's unused tail): never read
    B = (torch.randn(E, N, K, generator=gen, dtype=torch.float64) * K ** -0.5
         * torch.exp2(torch.randint(-4, 5, (E, N, 1), generator=gen).double())).to(torch.bfloat16)
    B_t = B.transpose(-2, -1)  # [E, K, N] column-major, as prepare_weights lays weights out
    dy = wide_range(gen, M, N).to(torch.bfloat16)
    dy[used:] = 0
    a = A.detach().requires_grad_(True)
    b = B_t.detach().requires_grad_(True)
    out = t8.fp8_grouped_mm(a, b, ends)
    out.backward(dy)
    A64, B64, dy64 = A.double(), B_t.double(), dy.double()
    ref = torch.zeros(used, N, dtype=torch.float64)
    d_a = torch.zeros(used, K, dtype=torch.float64)
    d_b = torch.zeros(E, K, N, dtype=torch.float64)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        ref[rows] = A64[rows] @ B64[g]
        d_a[rows] = dy64[rows] @ B64[g].t()
        d_b[g] = A64[rows].t() @ dy64[rows]
        start += n
    for name, got, want in (("out", out[:used], ref), ("d_a", a.grad[:used], d_a),
                            ("d_b", b.grad, d_b)):
        e = distance(got, want)
        print(name, e)
        assert e["rel_l1"] < MOK_BOUNDS["rel_l1"] and e["cosine"] >= MOK_BOUNDS["cosine"], (name, e)
    assert torch.equal(b.grad[1], torch.zeros(K, N, dtype=torch.bfloat16)), "an empty group: 0"
    assert out[used:].isnan().all(), "the emulation poisons the rows past the groups"


# ---- the layer ----------------------------------------------------------------------------------

def test_padded_routing_puts_every_slot_in_its_experts_aligned_group(gen):
    T, k, E = 37, 3, 6
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[ids == 2] = 0  # expert 2 gets no rows
    src, order, pos, offs = t8.padded_routing(ids, E)
    assert src.numel() % t8.ALIGN == 0 and offs.dtype == torch.int32
    ends = [0] + offs.tolist()
    assert all((b - a) % t8.ALIGN == 0 for a, b in zip(ends, ends[1:]))
    assert ends[3] == ends[2], "expert 2's group is empty"
    flat = ids.reshape(-1)
    for s, p in zip(order.tolist(), pos.tolist()):
        e = int(flat[s])
        assert ends[e] <= p < ends[e + 1] and int(src[p]) == s // k
    assert sorted(pos.tolist()) == sorted(set(pos.tolist())), "one row per slot"
    mask = torch.ones(src.numel(), dtype=torch.bool)
    mask[pos] = False
    assert bool((src[mask] == T).all()), "padding and the tail read the zero row"


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_routings(gen, k):
    """uniform and skewed-distinct are top-k routings (k distinct experts a token); skewed puts
    expert 0 in every other slot (half of all rows; a token holds it twice or more from k = 3);
    skewed-distinct puts half of the rows (all at k = 1) on the k // 2 first experts."""
    T, E = 96, 16
    hot = max(k // 2, 1)
    for kind in bl.ROUTINGS:
        g = torch.Generator().manual_seed(seed_from(gen))
        ids, w = bl.routing(T, E, k, kind, g)
        print(kind, k, ids[:2].tolist())
        assert ids.shape == (T, k) and ids.dtype == torch.int64 and w.shape == (T, k)
        assert bool(((ids >= 0) & (ids < E)).all())
        assert torch.allclose(w.sum(-1), torch.ones(T)) and bool((w > 0).all())
        distinct = all(len(set(row)) == k for row in ids.tolist())
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        if kind == "skewed":
            assert int(counts[0]) >= (T * k + 1) // 2
            if k != 2:  # at k = 2 only the tokens whose second choice was expert 0 repeat it
                assert distinct == (k == 1), "duplicate (token, expert) pairs from k = 3 on"
        else:
            assert distinct
        if kind == "skewed-distinct":
            assert counts[:hot].tolist() == [T] * hot
    with pytest.raises(ValueError, match="unknown routing 'hot'; known: uniform, skewed"):
        bl.routing(T, E, 2, "hot", torch.Generator())


def _layer_inputs(gen, T, H, I, E, k, S, routing="uniform"):
    bl.SHAPES["test-fp8"] = (T, H, I, E, k, S)
    seed = seed_from(gen)
    weights = bl.make_weights("test-fp8", seed)
    return bl.make_inputs("test-fp8", routing, seed, weights)


@pytest.mark.parametrize("shared", [0, 128])
def test_padded_layer_in_bf16_is_the_baseline(gen, shared):
    """fp8_moe's permutation and padding, with bf16 GEMMs standing in for the recipe: the
    PyTorch baseline's output and gradients (the padding adds zero rows only)."""
    inp = _layer_inputs(gen, 80, 256, 128, 5, 2, shared, "skewed")
    gate_up, down = prepare_weights(inp["w_gate"], inp["w_up"], inp["w_down"])

    def run(fn):
        leaves = [t.detach().requires_grad_(True) for t in
                  [inp["x"], inp["w"], gate_up, down] + list(inp["shared"] or [])]
        x, w, gu, dn, *sh = leaves
        out = fn(x, inp["ids"], w, gu, dn, tuple(sh) if sh else None)
        out.backward(inp["d_out"])
        return [out] + [t.grad for t in leaves]

    base = run(torch_moe)
    padded = run(lambda *a: t8.fp8_moe(*a, grouped_mm=lambda a, b, offs: torch._grouped_mm(
        a, b, offs=offs)))
    # The two paths sum in other orders and round their bf16 intermediates apart: the bf16
    # bounds of conftest.py on the relative Frobenius error (measured: at most 1e-4 over 120
    # draws, 2026-12-07). An elementwise rtol 2^-7 + atol 1e-3 failed 2 of those 120 draws: a
    # weight gradient's element summed from 80 rows can cancel to far below their magnitudes.
    # A leaked padding row or another token's row would move a tensor by about 1/sqrt(80), 0.11
    # (reasoning, not measured).
    for i, (p, b) in enumerate(zip(padded, base)):
        bound = OUT_TOLERANCE if i == 0 else GRAD_TOLERANCE
        assert rel_error(p, b) <= bound, (i, SEED)


@pytest.mark.parametrize("routing", bl.ROUTINGS)
def test_fp8_recipe_layer_within_fp8_bounds_of_the_f64_layer(gen, routing):
    inp = _layer_inputs(gen, 128, 512, 256, 8, 4, 128, routing)
    impl = bl.TorchFp8Impl("recipe")
    impl.setup(inp)
    errors, outside = bl.f64_check(impl, inp)
    print(errors)
    assert set(errors) == {"out", "d_x", "d_topk_weights", "d_gate", "d_up", "d_down",
                           "d_shared_gate", "d_shared_up", "d_shared_down"}
    assert not outside, errors
    # FP8, not bf16: the recipe's distance is e4m3's, well above a bf16 layer's.
    assert errors["out"]["rel_l1"] > 0.01


def test_torchao_wiring(monkeypatch, gen):
    """torchao-fp8 calls torchao's function with the layer's padded groups, bf16 out and torchao's
    own padding off (a stand-in module records the call and runs the recipe)."""
    calls = []

    def fake(A, B_t, offs, out_dtype=torch.bfloat16, float8_dtype=torch.float8_e4m3fn,
             pad_token_groups_for_grouped_mm=True):
        calls.append((out_dtype, pad_token_groups_for_grouped_mm, A.shape[0] % 16))
        return t8.fp8_grouped_mm(A, B_t, offs)

    ao = types.ModuleType("torchao")
    ao.__version__ = "0.0-test"
    for name in ("torchao.prototype", "torchao.prototype.moe_training"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torchao.prototype.moe_training"]._to_fp8_rowwise_then_scaled_grouped_mm = fake
    monkeypatch.setitem(sys.modules, "torchao", ao)
    inp = _layer_inputs(gen, 64, 256, 128, 4, 2, 0)
    impl = bl.IMPLS["torchao-fp8"][0]()
    impl.setup(inp)
    errors, outside = bl.f64_check(impl, inp, bl.PEER_BOUNDS)
    assert not outside and impl.record_extra() == {"torchao": "0.0-test"}
    assert len(calls) == 2 and all(c == (torch.bfloat16, False, 0) for c in calls), calls


def test_without_torchao_the_peer_fails_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(ImportError):
        bl.IMPLS["torchao-fp8"][0]()


# ---- the f64 layer ------------------------------------------------------------------------------

def _dense_f64_layer(inp):
    """The layer token by token in f64 through autograd: an independent reference."""
    x = inp["x"].double().requires_grad_(True)
    w = inp["w"].double().requires_grad_(True)
    ws = [inp[n].double().requires_grad_(True) for n in ("w_gate", "w_up", "w_down")]
    sh = [t.double().requires_grad_(True) for t in inp["shared"]] if inp["shared"] else []
    rows = []
    for t in range(x.shape[0]):
        v = x[t]
        o = (sh[2] @ (F.silu(sh[0] @ v) * (sh[1] @ v))) if sh else torch.zeros_like(v)
        for j in range(inp["ids"].shape[1]):
            e = int(inp["ids"][t, j])
            o = o + w[t, j] * (ws[2][e] @ (F.silu(ws[0][e] @ v) * (ws[1][e] @ v)))
        rows.append(o)
    out = torch.stack(rows)
    out.backward(inp["d_out"].double())
    grads = {"x": x.grad, "topk_weights": w.grad, "gate": ws[0].grad, "up": ws[1].grad,
             "down": ws[2].grad}
    if sh:
        grads.update(shared_gate=sh[0].grad, shared_up=sh[1].grad, shared_down=sh[2].grad)
    return out.detach(), grads


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_f64_layer_is_the_layer(gen, routing):
    inp = _layer_inputs(gen, 24, 32, 16, 5, 3, 8, routing)
    inp["ids"][inp["ids"] == 4] = 1  # expert 4 gets no rows (its exact gradients are zeros)
    out, grads = _dense_f64_layer(inp)
    errors = f64_layer.f64_errors(inp, out, grads)
    assert len(errors) == 9
    for name, e in errors.items():
        assert e["rel_l1"] < 1e-12 and abs(e["cosine"] - 1) < 1e-12, (name, e)
    # A gradient off by 3% in one expert is seen, and only in that gradient.
    grads["down"] = grads["down"].clone()
    grads["down"][1] *= 1.03
    errors = f64_layer.f64_errors(inp, out, grads)
    share = grads["down"][1].abs().sum() / 1.03 / (grads["down"].abs().sum() - grads["down"][
        1].abs().sum() * 0.03 / 1.03)
    assert errors["d_down"]["rel_l1"] == pytest.approx(0.03 * float(share), rel=1e-6)
    assert f64_layer.within_bounds(errors) == []
    grads["up"] = -grads["up"]
    assert f64_layer.within_bounds(f64_layer.f64_errors(inp, out, grads)) == ["d_up"]
    grads["x"] = grads["x"] * float("nan")
    assert "d_x" in f64_layer.within_bounds(f64_layer.f64_errors(inp, out, grads))


# ---- bench_layer's FP8 implementations end to end -----------------------------------------------

def test_prequantized_weights_are_quantized_once_and_quant_every_call(quantizations, gen):
    inp = _layer_inputs(gen, 64, 256, 128, 4, 2, 0)
    for quant, want_setup, want_calls in ((False, 3, 0), (True, 0, 3 * 4)):
        bl.release_memory()
        quantizations.calls = 0
        impl = bl.MokFp8Impl(quantize_each_call=quant)
        impl.setup(inp)
        assert quantizations.calls == want_setup, (quant, quantizations.calls)
        for _ in range(2):
            with torch.no_grad():
                impl.forward()
            impl.backward(impl.forward())
        assert quantizations.calls == want_setup + want_calls, (quant, quantizations.calls)
        assert impl.pending is None, "nothing held after a backward"


def test_a_wrong_layer_is_not_timed(monkeypatch, gen):
    class Wrong(bl.MokFp8Impl):
        def grads(self):
            g = super().grads()
            g["down"] = g["down"] * 1.5
            return g
    monkeypatch.setitem(bl.IMPLS, "wrong", (lambda: Wrong(False), "wrong"))
    inp = _layer_inputs(gen, 64, 256, 128, 4, 2, 0)
    args = bl.parse_args(["--impls", "mok-fp8", "--reps", "1", "--warmup-s", "0"])
    outcome = bl.measure("test-fp8", "uniform", "wrong", [inp], args)
    assert isinstance(outcome, str) and outcome.startswith("WRONG") and "d_down" in outcome


@pytest.mark.slow
def test_fp8_suite_end_to_end_on_cpu(tmp_path, gen, capsys):
    """bench_layer --suite fp8 on a tiny case: every implementation checked against the f64 layer
    and timed alone and interleaved (wall clock here), its errors and memory recorded, and the
    summary's FP8 tables printed."""
    bl.SHAPES["tiny-fp8"] = (64, 128, 128, 4, 2, 128)
    out = tmp_path / "layer_fp8.json"
    # torch-fp8 (slow through the emulation) has its own tests above.
    impls = ["mok", "mok-fp8", "mok-fp8-quant", "torch"]
    rc = bl.main(["--suite", "fp8", "--cases", "tiny-fp8", "--impls", ",".join(impls),
                  "--routings", "uniform", "--reps", "2", "--warmup-s", "0", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["gpu"] == "cpu"
    names = {"mok": "mok-unfused"}
    recs = {(r["suite"], r["pass"], r["impl"]): r for r in doc["cases"]}
    for suite in ("layer-fp8", "layer-fp8-interleaved"):
        for pss in ("fwd", "fwdbwd"):
            for impl in impls:
                r = recs.get((suite, pss, names.get(impl, impl)))
                assert r is not None, (suite, pss, impl, rc, capsys.readouterr().out[-3000:])
                timing = "interleaved" if suite.endswith("interleaved") else "solo"
                assert r["median_ms"] > 0 and r["timing"] == timing
    fwd = recs[("layer-fp8", "fwd", "mok-fp8")]
    assert set(fwd["f64_errors"]) >= {"out", "d_x", "d_topk_weights", "d_gate", "d_up", "d_down"}
    assert fwd["f64_within_mok_bounds"] is True
    E, blocks = 4, 1  # gate, up, down [E, 128, 128]: one 128 x 128 block each
    data, scales = 2 * E * 3 * 128 * 128, 2 * E * 3 * blocks * 4  # both orientations
    assert fwd["memory"]["fp8_weight_bytes"] == data + scales
    assert "floor_fp8_ms" in fwd and "floor_fp8_ms" not in recs[("layer-fp8", "fwd", "torch")]
    inter = recs[("layer-fp8-interleaved", "fwdbwd", "mok-fp8")]
    assert inter["base"] == "mok-unfused" and inter["base_over_this_median"] > 0
    printed = capsys.readouterr().out
    assert "## FP8 layer against mok bf16, each path alone" in printed
    assert "## FP8 layer against mok bf16, interleaved" in printed
    assert "Distance from the f64 layer" in printed and "Memory per layer" in printed
    assert rc == 0, printed[-3000:]


# ---- the bars, fed synthetic results ------------------------------------------------------------

def _layer_doc(suite="layer-fp8", commit="abc1234", fp8_speedup=None, quant_speedup=None,
               peer="torchao-fp8", peer_over=1.2, wgrad_speedup=None):
    """Synthetic FP8 suite results: bf16 10 ms forward+backward, 4 ms forward in every case
    (`wgrad_speedup`: mok-fp8-bf16-wgrad's too, that speedup in every case)."""
    fp8_speedup = fp8_speedup or {"dsv3-ep8slice": 1.5, "dsv3-ep1": 1.55, "qwen3-30b-a3b": 1.35,
                                  "mixtral-8x7b": 1.6}
    quant_speedup = quant_speedup or {"dsv3-ep8slice": 1.3, "dsv3-ep1": 0.95,
                                      "qwen3-30b-a3b": 1.25, "mixtral-8x7b": 1.45}
    cases = []
    err = {"out": {"rel_l1": 0.05, "cosine": 0.998, "abs_max": 0.1}}
    peer_err = {"out": {"rel_l1": 0.06, "cosine": 0.997, "abs_max": 0.1}}
    for case in fp8_bars.CASE_ORDER:
        for routing in ("uniform", "skewed"):
            for pss, base in (("fwd", 4.0), ("fwdbwd", 10.0)):
                def rec(impl, ms, **more):
                    cases.append({"suite": suite, "case": case, "routing": routing, "pass": pss,
                                  "impl": impl, "median_ms": ms, "commit": commit,
                                  "date": "2026-12-06", **more})
                mem = {"memory": {"forward_held_bytes": 3 << 30, "fwdbwd_peak_bytes": 5 << 30}}
                rec("mok-unfused", base, **(mem if pss == "fwd" else {}))
                rec("torch", base * 1.5)
                fp8_ms = base / fp8_speedup[case]
                rec("mok-fp8", fp8_ms, **({"f64_errors": err} if pss == "fwd" else {}))
                rec("mok-fp8-quant", base / quant_speedup[case])
                if wgrad_speedup is not None:
                    rec("mok-fp8-bf16-wgrad", base / wgrad_speedup)
                rec(peer, fp8_ms * peer_over, **({"f64_errors": peer_err} if pss == "fwd" else {}))
    return {"gpu": "NVIDIA H200", "commit": commit, "date": "2026-12-06", "cases": cases}


def test_layer_bars_say_pass_and_fail():
    rows = {(r["case"], r["routing"], r["pass"]): r for r in fp8_bars.layer_rows(
        _layer_doc()["cases"])}
    r = rows[("dsv3-ep8slice", "uniform", "fwdbwd")]
    assert r["fp8_speedup"] == pytest.approx(1.5) and r["fp8_bar"] == 1.4
    assert r["fp8_verdict"] == "pass" and r["quant_verdict"] == "pass"
    assert r["peer"] == "torchao-fp8" and r["fp8_over_peer"] == pytest.approx(1.2)
    ep1 = rows[("dsv3-ep1", "uniform", "fwdbwd")]
    assert ep1["fp8_verdict"] == "FAIL" and ep1["quant_verdict"] == "FAIL"  # 1.55 < 1.6, 0.95 < 1
    assert rows[("dsv3-ep1", "uniform", "fwd")]["fp8_verdict"] == "-"  # bars: fwdbwd only
    lines = fp8_bars.layer_lines(_layer_doc()["cases"])
    text = "\n".join(lines)
    assert "| dsv3-ep1 | uniform | fwdbwd | 10.000 | 6.452 | 1.55x | 1.60 | FAIL |" in text
    assert ("- uniform (the issue's bars): 6 of 8 bars met; missed: dsv3-ep1 fp8 1.55x < 1.60x; "
            "dsv3-ep1 fp8+quant 0.95x < 1.00x; mok-fp8 faster than the peer in 8 of 8") in text
    assert "| dsv3-ep8slice | uniform | mok-unfused | 3072 | 5120 |" in text
    assert "0.0500 / 0.99800" in text and "| pass |" in text  # mok-fp8's error below the peer's


def test_layer_table_shows_the_bf16_weight_gradient_recipe_without_a_bar():
    doc = _layer_doc(wgrad_speedup=1.25)
    rows = {(r["case"], r["routing"], r["pass"]): r for r in fp8_bars.layer_rows(doc["cases"])}
    r = rows[("qwen3-30b-a3b", "uniform", "fwdbwd")]
    assert r["wgrad_ms"] == pytest.approx(8.0) and r["wgrad_speedup"] == pytest.approx(1.25)
    assert r["wgrad_over_peer"] == pytest.approx(10 / 1.35 * 1.2 / 8.0)
    text = "\n".join(fp8_bars.layer_lines(doc["cases"]))
    # mixtral-8x7b: the quantizing path's columns, then the bf16-wgrad ones, then the peer's.
    assert ("| 6.897 | 1.45x | 1.40 | pass | 8.000 | 1.25x | 7.500 | 1.20 | 1.09 | 0.94 | "
            "abc1234 |") in text
    # No bar of its own: the bar count is that of the runs without it.
    assert "6 of 8 bars met" in text
    without = "\n".join(fp8_bars.layer_lines(_layer_doc()["cases"]))
    assert "| 1.45x | 1.40 | pass | - | -x | " in without


def test_layer_bars_fall_back_to_the_torch_recipe_and_count_missing_paths():
    doc = _layer_doc(peer="torch-fp8", peer_over=0.9)
    doc["cases"] = [c for c in doc["cases"] if not (c["impl"] == "mok-fp8-quant"
                                                    and c["case"] == "qwen3-30b-a3b")]
    text = "\n".join(fp8_bars.layer_lines(doc["cases"]))
    assert "Peer: torch-fp8" in text
    assert "qwen3-30b-a3b fp8+quant not measured" in text
    assert "mok-fp8 faster than the peer in 0 of 8" in text


def test_layer_rows_take_one_run():
    old = _layer_doc(commit="old0000")
    for c in old["cases"]:
        c["date"] = "2026-12-01"
        c["median_ms"] *= 100
    rows = fp8_bars.layer_rows(old["cases"] + _layer_doc()["cases"])
    assert {r["commit"] for r in rows} == {"abc1234"}
    assert all(r["bf16_ms"] in (4.0, 10.0) for r in rows)


def test_layer_rows_take_each_row_from_its_most_complete_run():
    """A later run of the skewed routing alone keeps the earlier run's uniform rows, and a later
    rerun of a few paths of a row (bf16, FP8 and the peer) does not displace its complete row;
    every comparison in a row stays within one run."""
    old = [c for c in _layer_doc(commit="old0000")["cases"] if c["routing"] == "uniform"]
    new = [dict(c, date="2026-12-07") for c in _layer_doc(commit="new0000")["cases"]
           if c["routing"] == "skewed"
           or (c["case"] == "mixtral-8x7b"
               and c["impl"] in ("mok-unfused", "mok-fp8", "torchao-fp8"))]
    for c in new:
        c["median_ms"] *= 2
    rows = {(r["case"], r["routing"], r["pass"]): r for r in fp8_bars.layer_rows(old + new)}
    assert len(rows) == 16
    for (case, routing, _), r in rows.items():
        assert r["commit"] == ("old0000" if routing == "uniform" else "new0000"), (case, routing)
        assert r["quant_ms"] is not None and r["peer_ms"] is not None
        assert r["bf16_ms"] in ((4.0, 10.0) if routing == "uniform" else (8.0, 20.0))
    # A newer run with as many paths wins the row.
    later = [dict(c, date="2026-12-08", commit="later00") for c in old
             if c["case"] == "qwen3-30b-a3b"]
    rows = {(r["case"], r["routing"]): r["commit"] for r in fp8_bars.layer_rows(old + later)}
    assert rows[("qwen3-30b-a3b", "uniform")] == "later00"
    assert rows[("mixtral-8x7b", "uniform")] == "old0000"
    # Every row has its peer: no supplement. Without the peer in the row's own run, the newer
    # run's bf16, FP8 and peer stand beside it, as one run, errors included.
    assert fp8_bars.peer_lines(old + new) == []
    no_peer = [c for c in old if not (c["case"] == "mixtral-8x7b" and c["impl"] == "torchao-fp8")]
    text = "\n".join(fp8_bars.layer_lines(no_peer + new))
    assert ("| mixtral-8x7b | uniform | fwdbwd | 20.000 | 12.500 | torchao-fp8 | 15.000 | 1.20 | "
            "0.0500 / 0.99800 | 0.0600 / 0.99700 | new0000 |") in text
    assert "| mixtral-8x7b | uniform | fwdbwd | 10.000 | 6.250 | 1.60x |" in text  # old0000's row


def _gemm_records(suite):
    recs = []
    for case in ("dsv3-ep8slice", "qwen3-30b-a3b"):
        for pss, bf16, fp8 in (("gemm1", 1.0, 0.6), ("gemm2", 0.5, 0.33), ("dgrad", 0.5, 0.36),
                               ("wgrad", 0.5, 0.34)):
            for impl, ms in (("mok", bf16), ("mok-fp8", fp8), ("torch-fp8", fp8 * 1.1)):
                recs.append({"suite": suite, "case": case, "routing": "uniform", "pass": pss,
                             "impl": impl, "median_ms": ms, "tflops": 1150.0 * 0.6 / ms})
    return recs


def test_gemm_bars():
    rows = {(r["case"], r["pass"]): r for r in fp8_bars.gemm_rows(_gemm_records("gemm-solo"),
                                                                  "gemm-solo")}
    assert rows[("dsv3-ep8slice", "gemm1")]["verdict"] == "pass"  # 1.67x >= 1.6
    assert rows[("dsv3-ep8slice", "gemm1")]["tflops_verdict"] == "pass"  # 1150 >= 1100
    assert rows[("qwen3-30b-a3b", "gemm1")]["tflops_bar"] is None
    assert rows[("dsv3-ep8slice", "gemm2")]["verdict"] == "FAIL"  # 1.52x < 1.6
    assert rows[("dsv3-ep8slice", "dgrad")]["verdict"] == "FAIL"  # 1.39x < 1.5
    assert rows[("dsv3-ep8slice", "wgrad")]["verdict"] == "pass"  # 1.47x >= 1.4
    assert rows[("dsv3-ep8slice", "wgrad")]["peer_verdict"] == "pass"
    text = "\n".join(fp8_bars.gemm_lines(_gemm_records("gemm-solo") + _gemm_records("gemm")))
    assert "each form alone" in text and "interleaved round by round" in text
    assert "dsv3-ep8slice gemm2 1.52x < 1.6x" in text


def test_merge_results_renders_the_fp8_tables_and_plot(tmp_path, monkeypatch):
    import merge_results as mr
    monkeypatch.setattr(mr, "PERF", tmp_path)
    (tmp_path / "layer_fp8.json").write_text(json.dumps(_layer_doc()))
    inter = _layer_doc(suite="layer-fp8-interleaved")
    (tmp_path / "gemm.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-06",
         "cases": _gemm_records("gemm") + _gemm_records("gemm-solo")}))
    doc = _layer_doc()
    doc["cases"] += inter["cases"]
    (tmp_path / "layer_fp8.json").write_text(json.dumps(doc))
    assert mr.main() == 0
    readme = (tmp_path / "README.md").read_text()
    assert "## FP8 layer against mok bf16, each path alone at the power limit" in readme
    assert "## FP8 layer against mok bf16, interleaved call by call" in readme
    assert "## FP8 GEMM forms against bf16, each form alone" in readme
    assert "| FAIL |" in readme and "| pass |" in readme
    results = json.loads((tmp_path / "results.json").read_text())
    impls = {c["impl"] for c in results["cases"]}
    assert {"mok-fp8", "mok-fp8-quant", "torchao-fp8"} <= impls
    if mr.plt is not None:
        assert (tmp_path / mr.PLOT_FP8).stat().st_size > 1000
        assert f"]({mr.PLOT_FP8})" in readme


def test_run_summary_prints_each_check(tmp_path):
    import subprocess
    run = {"preset": "qwen3-30b-a3b", "routing": "uniform", "precision": "fp8", "fwd_ms": 1.5,
           "bwd_ms": 4.0, "check": {"passed": True, "out_rel_err": 0.001,
                                     "grad_rel_err_max": 0.002},
           "check_f64": {"passed": True, "out_rel_err": 0.05, "grad_rel_err_max": 0.07}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    r = subprocess.run([sys.executable, str(BENCH / "run_summary.py"), str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "fp8" in r.stdout and "check_f64 passed  out 5.00e-02" in r.stdout
    run["check_f64"]["passed"] = False
    path.write_text(json.dumps(run))
    r = subprocess.run([sys.executable, str(BENCH / "run_summary.py"), str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "check_f64 FAILED" in r.stdout


def test_constants_match_the_issue():
    assert fp8_bars.LAYER_BARS == {"dsv3-ep8slice": (1.4, 1.25), "qwen3-30b-a3b": (1.3, 1.2),
                                   "mixtral-8x7b": (1.5, 1.4), "dsv3-ep1": (1.6, 1.0)}
    assert set(fp8_bars.CASE_ORDER) == set(bl.CASES)
    assert math.isclose(MOK_BOUNDS["cosine"], 0.996) and MOK_BOUNDS["rel_l1"] == 0.1


def test_bench_gemm_merges_solo_runs_and_tables_the_fp8_forms(tmp_path):
    """bench_gemm.py with --baselines-from (no GPU): the interleaved mok rows and a solo run's
    rows (suite gemm-solo) beside torch's, and README-gemm.md's FP8 tables with the bars."""
    import subprocess
    inter = _gemm_records("gemm")
    old = {"gpu": "NVIDIA H200", "torch": "2.11.0", "date": "2026-12-06",
           "cases": [dict(r, floor_ms=0.1) if r["impl"] == "torch-fp8" and r["pass"] == "gemm1"
                     else r for r in inter if r["impl"] == "torch-fp8"]
           + [{"suite": "gemm", "case": "dense-8192", "routing": "none", "pass": "mm",
               "impl": "cublas-fp8-dense", "median_ms": 0.8, "tflops": 1377.0}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    mok = tmp_path / "mok.jsonl"
    mok.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "suite"}) + "\n"
                           for r in inter if r["impl"] != "torch-fp8"))
    solo = tmp_path / "solo.jsonl"
    solo.write_text("".join(json.dumps(dict(r, median_ms=r["median_ms"] * 0.98)) + "\n"
                            for r in _gemm_records("x") if r["impl"] == "mok-fp8"))
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, str(BENCH / "bench_gemm.py"), str(mok), str(out),
                        "--baselines-from", str(tmp_path / "old.json"), "--commit", "abc1234",
                        "--solo", str(solo)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "gemm.json").read_text())
    suites = {(c.get("suite"), c["impl"]) for c in doc["cases"]}
    assert ("gemm-solo", "mok-fp8") in suites and ("gemm", "torch-fp8") in suites
    readme = (out / "README-gemm.md").read_text()
    assert "## FP8 GEMM forms against bf16, the forms interleaved round by round" in readme
    assert "## FP8 GEMM forms against bf16, each form alone" in readme
    assert "| dsv3-ep8slice | uniform | gemm1 | 1.0000 | 0.6000 | 1.67x | 1.60 | pass |" in readme


def test_bench_gemm_fp8_forms_are_valid_calls(gen):
    """bench_gemm.py's torch-fp8 forms through the emulation of torch._scaled_grouped_mm (torch's
    own argument checks first): every form is a call the GPU accepts, and its product is right."""
    import bench_gemm

    class EmulatedTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def _scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None,
                               use_fast_accum=False):
            return t8.emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)

    counts = [40, 7, 0, 33]  # skewed-like: groups the 2-D x 2-D form must pad
    e, h, i = len(counts), 256, 128
    rows = sum(counts)
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    x, hid, dy = r(rows, h), r(rows, i), r(rows, h)
    w13, wd = r(e, 2 * i, h) * h ** -0.5, r(e, h, i) * i ** -0.5
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    forms = bench_gemm.fp8_forms(EmulatedTorch(), x, hid, dy, w13, wd, offs, counts[0], counts)
    assert set(forms) == {"gemm1", "gemm2", "dgrad", "wgrad"}
    for name, (flops, fn, check) in forms.items():
        err = check(fn())
        print(name, err)
        assert err < 0.06, (name, err)  # e4m3 on both operands: a few percent, not a wrong call


def test_gpu_fp8_bench_says_it_needs_a_gpu(tmp_path):
    """scripts/gpu-fp8-bench on a machine without a GPU: fails at its first step, says why, and
    leaves its summary line."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: the script would run the benchmarks")
    script = BENCH.parent / "scripts" / "gpu-fp8-bench"
    r = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "FAIL: machine" in r.stdout
    assert (tmp_path / "out" / "summary.txt").read_text().startswith("gpu-fp8-bench FAIL (machine)")
