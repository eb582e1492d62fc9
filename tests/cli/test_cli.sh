#!/usr/bin/env bash
# The `mok` command as a user meets it: exit codes, messages, the JSON of `mok run`.
# usage: test_cli.sh path/to/mok
set -u
mok="$1"
fails=0
pass() { echo "ok   - $1"; }
fail() { echo "FAIL - $1"; fails=$((fails + 1)); }

# 1. The tiny preset on the CPU backend prints the documented JSON and passes its check.
out=$("$mok" run --preset tiny --backend cpu --json 2>/tmp/mok_cli_err.$$)
rc=$?
if [ $rc -eq 0 ] && python3 - "$out" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
for key in ("backend", "preset", "shape", "fwd_ms", "bwd_ms", "check"):
    assert key in j, key
assert set(j["shape"]) >= {"T", "H", "I", "E", "k", "S"}, j["shape"]
c = j["check"]
assert c["passed"] is True, c
assert 0 < c["out_rel_err"] < 4 * 2**-8 and 0 < c["grad_rel_err_max"] < 6 * 2**-8, c
assert j["backend"] == "cpu" and j["preset"] == "tiny"
assert j["fwd_ms"] > 0 and j["bwd_ms"] > 0
PY
then pass "run --preset tiny --backend cpu --json"; else fail "run --json (rc=$rc): $out $(cat /tmp/mok_cli_err.$$)"; fi

# 2. Bad arguments: exit status 2 and one line on stderr naming the value.
expect_usage() {  # expect_usage "needle" args...
  local needle="$1"; shift
  local err rc
  err=$("$mok" "$@" 2>&1 >/dev/null); rc=$?
  if [ $rc -eq 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && printf '%s' "$err" | grep -q -- "$needle"; then
    pass "mok $* -> 2: $err"
  else
    fail "mok $* (rc=$rc, wanted 2 and '$needle'): $err"
  fi
}
expect_usage "topk" run --experts 4 --topk 5
expect_usage "hidden_size" run --hidden 100
expect_usage "num_tokens" run --tokens 0
expect_usage "--tokens" run --tokens abc
expect_usage "--backend" run --backend tpu
expect_usage "--preset" run --preset nope
expect_usage "unknown option" run --frobnicate 3
expect_usage "unknown command" fly
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # A GPU: the CUDA backend runs the step and passes the same check.
  out=$("$mok" run --backend cuda --routing skewed --tokens 300 --json 2>&1)
  if printf '%s' "$out" | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j["backend"]=="cuda" and j["check"]["passed"] is True, j' 2>/dev/null; then
    pass "run --backend cuda --json"
  else
    fail "run --backend cuda: $out"
  fi
  # The FP8 layer on the GPU: within the bounds against the CPU FP8 layer and MoK's against f64,
  # compared in full and on a sample; with bf16 weight gradients (fp8-bf16-wgrad) the CPU FP8
  # layer computes them likewise.
  for precision in fp8 fp8-bf16-wgrad; do
    for check in full sampled; do
      out=$("$mok" run --backend cuda --precision $precision --routing skewed --tokens 300 --check $check --json 2>&1)
      if printf '%s' "$out" | python3 -c 'import json,sys; j=json.load(sys.stdin); c=j["check"]; r=c["fp8_reference"]; assert j["backend"]=="cuda" and j["precision"]==sys.argv[1] and c["passed"] is True and r["bitwise"] is False and r["passed"] is True and j["quant_ms"] > 0, j' "$precision" 2>/dev/null; then
        pass "run --backend cuda --precision $precision --check $check --json"
      else
        fail "run --backend cuda --precision $precision --check $check: $out"
      fi
    done
    # The megakernel has no FP8 form: refused with the option's name.
    expect_usage "forward_path" run --backend cuda --precision $precision --forward fused
  done
  # The forward megakernel: the same check.
  out=$("$mok" run --backend cuda --forward fused --tokens 300 --json 2>&1)
  if printf '%s' "$out" | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j["backend"]=="cuda" and j["check"]["passed"] is True, j' 2>/dev/null; then
    pass "run --backend cuda --forward fused --json"
  else
    fail "run --backend cuda --forward fused: $out"
  fi
else
  expect_usage "CUDA backend is not available" run --backend cuda
fi

# 3. Other routings and odd token counts pass their checks.
for args in "--routing skewed --tokens 33" "--routing one-expert --topk 1 --shared 0" "--tokens 1 --threads 1"; do
  # shellcheck disable=SC2086
  if "$mok" run --backend cpu $args >/dev/null 2>&1; then pass "run $args"; else fail "run $args"; fi
done

# 4. The workspace plan: every buffer with its bytes, sized from the shape and config only. The
#    automatic ring holds 131072 + 32 * 127 rows; the rank's worst case, 8 * 4096 * 8 + 32 * 127.
plan=$("$mok" run --preset dsv3-ep8slice --ep-size 8 --plan 2>&1)
if [ $? -eq 0 ] && printf '%s' "$plan" | grep -q "schedule_table" && printf '%s' "$plan" | grep -q "pass_x" &&
  printf '%s' "$plan" | grep -q "layer region" && printf '%s' "$plan" | grep -q "2 ring passes at most, 1 fp32 carry slots" &&
  printf '%s' "$plan" | grep -q "FP8 weights      352407552 bytes"; then
  pass "run --plan"
else
  fail "run --plan: $plan"
fi
expect_usage "minibatch_size" run --minibatch 100 --plan
expect_usage "--forward: expected launches or fused, got 'unfused'" run --forward unfused
expect_usage "fused_stage_rows" run --stage-rows 100 --plan

# 4b. Clamped SwiGLU: the option reaches the layer and the JSON, and the run passes its check (at 7
#     the tiny preset's g, u ~ N(0, 1) are hardly ever clamped: the clamp's numerics are tested in
#     tests/cpp/test_swiglu_limit.cpp); bad limits are usage errors naming the value.
out=$("$mok" run --backend cpu --swiglu-limit 7 --json 2>&1)
if [ $? -eq 0 ] && printf '%s' "$out" | grep -q '"swiglu_limit": 7'; then
  pass "run --swiglu-limit 7"
else
  fail "run --swiglu-limit 7: $out"
fi
for bad in 0 -1 nan inf abc; do
  expect_usage "--swiglu-limit: expected a finite positive number, got '$bad'" run --swiglu-limit "$bad"
done

# 4c. The FP8 layer (--precision fp8) on the CPU backend: bitwise the CPU FP8 layer (it is that
#     layer: the check runs it again, or in a sampled check repeats its arithmetic on the sampled
#     rows and columns), and within MoK's MXFP8 bounds of the f64 layer of the bf16 values, with
#     errors of FP8's size (bf16 gives about 0.003: a run that fell back to bf16 fails here).
#     fp8-bf16-wgrad likewise: its routed weight gradients come from FP8 dg, du and h, so their
#     error is still FP8's, and the CPU FP8 layer computes them as the run did (bitwise).
for precision in fp8 fp8-bf16-wgrad; do for args in "" \
  "--routing skewed --tokens 131 --shared 0 --check sampled" \
  "--routing one-expert --topk 1 --swiglu-limit 5 --check sampled" "--tokens 1 --threads 1"; do
  # shellcheck disable=SC2086
  out=$("$mok" run --backend cpu --precision $precision --json $args 2>&1)
  rc=$?
  if [ $rc -eq 0 ] && python3 - "$out" "$precision" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
assert j["precision"] == sys.argv[2] and j["quant_ms"] > 0 and j["fwd_ms"] > 0, j
c = j["check"]
assert c["passed"] is True, c
assert c["mxfp8_bounds"] == {"abs_max": 1.0, "rel_sum": 0.1, "cosine": 0.996}, c
names = [e["name"] for e in c["entries"]]
assert names[:6] == ["out", "d_x", "d_topk_weights", "d_routed_gate_weights",
                     "d_routed_up_weights", "d_routed_down_weights"], names
for e in c["entries"]:
    assert e["passed"] is True and e["rel_sum"] <= 0.1 and e["cosine"] >= 0.996, e
    if e["name"] in ("out", "d_x"):
        assert e["abs_max"] <= 1.0, e
    if e["name"].startswith("d_routed") or e["name"] == "out":
        assert e["rel_sum"] > 0.01, e  # the routed GEMMs ran in FP8
r = c["fp8_reference"]
assert r["bitwise"] is True and r["passed"] is True and r["sampled"] == c["sampled"], r
ref = {e["name"]: e for e in r["entries"]}
assert set(names[:6]) <= set(ref), ref
for e in r["entries"]:
    assert e["differing"] == 0 and e["rel_sum"] == 0 and e["compared"] > 0, e
PY
  then pass "run --precision $precision $args"; else fail "run --precision $precision $args (rc=$rc): $out"; fi
done; done
# fp8-bf16-wgrad is fp8 but for the three routed weight gradients: on the same inputs (one seed)
# every other output and gradient has fp8's error against the f64 layer to the bit, and those three
# have another (so the option reached the layer; the bitwise check above, that it reached the CPU
# FP8 layer the run is compared with too).
for args in "" "--routing skewed --tokens 131 --check sampled"; do
  # shellcheck disable=SC2086
  fp8=$("$mok" run --backend cpu --precision fp8 --json $args 2>&1)
  # shellcheck disable=SC2086
  wgrad=$("$mok" run --backend cpu --precision fp8-bf16-wgrad --json $args 2>&1)
  if python3 - "$fp8" "$wgrad" <<'PY'
import json, sys
fp8, wgrad = (json.loads(a)["check"]["entries"] for a in sys.argv[1:3])
assert [e["name"] for e in fp8] == [e["name"] for e in wgrad], (fp8, wgrad)
routed = ("d_routed_gate_weights", "d_routed_up_weights", "d_routed_down_weights")
for a, b in zip(fp8, wgrad):
    same = (a["rel_err"], a["abs_max"], a["rel_sum"], a["cosine"]) == \
           (b["rel_err"], b["abs_max"], b["rel_sum"], b["cosine"])
    assert same != (a["name"] in routed), (a, b)
PY
  then pass "run --precision fp8-bf16-wgrad $args: fp8 but for the routed weight gradients"
  else fail "run --precision fp8-bf16-wgrad $args against fp8: $fp8 $wgrad"; fi
done
# The text names the precision and both references, and prints both errors on each line, beside
# the bounds.
for precision in fp8 fp8-bf16-wgrad; do
  out=$("$mok" run --backend cpu --precision $precision 2>&1)
  if [ $? -eq 0 ] && printf '%s' "$out" | grep -q "seed 1, precision $precision$" &&
    printf '%s' "$out" | grep -q "check against the CPU FP8 layer (bitwise" &&
    printf '%s' "$out" | grep -q "f64 layer of the unquantized bf16 values (MoK's MXFP8 bounds: abs max <= 1 on out and d_x, sum|diff|/sum|ref| <= 0.1, cosine >= 0.996)" &&
    printf '%s' "$out" | grep -Eq "^  out +\| identical +\| [0-9.e+-]+  [0-9.e+-]+  0\.99[0-9]+  ok$" &&
    printf '%s' "$out" | grep -Eq "^  d_routed_down_weights +\| identical +\| - +[0-9.e+-]+  0\.99[0-9]+  ok$" &&
    printf '%s' "$out" | grep -q "quantize " && printf '%s' "$out" | grep -q "check passed"; then
    pass "run --precision $precision (text)"
  else
    fail "run --precision $precision (text): $out"
  fi
done
expect_usage "--precision: expected bf16, fp8 or fp8-bf16-wgrad, got 'fp16'" run --precision fp16
expect_usage "--precision: expected bf16, fp8 or fp8-bf16-wgrad, got 'fp8-bf16'" run --precision fp8-bf16
expect_usage "--check: expected auto, full or sampled, got 'some'" run --check some
expect_usage "hidden_size: expected a multiple of 128 for --precision fp8, got 192" run --precision fp8 --hidden 192
expect_usage "intermediate_size: expected a multiple of 128 for --precision fp8, got 64" run --precision fp8 --intermediate 64
expect_usage "hidden_size: expected a multiple of 128 for --precision fp8, got 320" run --plan --precision fp8 --hidden 320
expect_usage "intermediate_size: expected a multiple of 128 for --precision fp8-bf16-wgrad, got 64" run --precision fp8-bf16-wgrad --intermediate 64
expect_usage "hidden_size: expected a multiple of 128 for --precision fp8-bf16-wgrad, got 320" run --plan --precision fp8-bf16-wgrad --hidden 320
# bf16 has no such rule.
if "$mok" run --backend cpu --hidden 192 >/dev/null 2>&1; then pass "run --hidden 192 (bf16)"; else fail "run --hidden 192 (bf16)"; fi

# 4d. The FP8 layer's memory: the bf16 plan, the FP8 scratch buffer by buffer (plan::Fp8Plan, from
#     the ring's R rows), the quantized weights, the forward context (the bf16 layer's), checked
#     against the shapes docs/architecture.md gives them.
plan=$("$mok" run --preset dsv3-ep8slice --ep-size 8 --plan --precision fp8 2>&1)
json=$("$mok" run --preset dsv3-ep8slice --ep-size 8 --plan --precision fp8 --json 2>&1)
if [ $? -eq 0 ] && python3 - "$plan" "$json" <<'PY'
import json, re, sys
text, j = sys.argv[1], json.loads(sys.argv[2])
R = int(re.search(r"a ring of (\d+) rows", text).group(1))
H, I, T, S = 7168, 2048, 4096, 2048
f32 = 4
want = {"rows_a": R * max(H, I), "rows_a_scales": max(H, I) // 128 * R * f32,
        "rows_b": R * I, "rows_b_scales": I // 128 * R * f32,
        "rows_c": R * I, "rows_c_scales": I // 128 * R * f32,
        "t_x": H * R, "t_x_scales": R // 128 * H * f32, "t_dy": H * R,
        "t_dy_scales": R // 128 * H * f32}
for t in ("t_dg", "t_du", "t_h"):
    want[t], want[t + "_scales"] = I * R, R // 128 * I * f32
got = {b["name"]: b["bytes"] for b in j["fp8_buffers"]}
assert got == want, (got, want)
assert j["fp8_scratch_bytes"] == sum(want.values()), j["fp8_scratch_bytes"]  # all 256-aligned
assert j["workspace_bytes"] == j["total_bytes"] + j["fp8_scratch_bytes"]
w = j["fp8_weights"]
assert w["gate"] == w["up"] == w["down"] and sum(w.values()) == j["fp8_weight_bytes"] == 352407552
assert j["forward_context_bytes"] == 2 * (R * H + 3 * R * I + 3 * T * S), j["forward_context_bytes"]
assert j["per_layer_bytes"] == j["fp8_weight_bytes"] + j["forward_context_bytes"]
for name in want:
    assert re.search(r"^  fp8 +%s +.* %d +[0-9.]+$" % (name, want[name]), text, re.M), name
for line in ("fp8 scratch      %d bytes" % j["fp8_scratch_bytes"],
             "workspace        %d bytes" % j["workspace_bytes"],
             "FP8 weights      352407552 bytes", "forward context  %d bytes" % j["forward_context_bytes"],
             "schedule_table", "pass_x", "layer region"):
    assert line in text, line
PY
then
  pass "run --plan --precision fp8"
else
  fail "run --plan --precision fp8: $plan $json"
fi
# fp8-bf16-wgrad's plan is fp8's without the five token-axis copies (WorkspaceOptions::
# fp8_token_axis false): the same bf16 plan, weights and context, every other FP8 buffer where fp8
# has it, the scratch and the workspace smaller by the copies' bytes; the header and "precision"
# name it.
wplan=$("$mok" run --preset dsv3-ep8slice --ep-size 8 --plan --precision fp8-bf16-wgrad 2>&1)
rc=$?
wjson=$("$mok" run --preset dsv3-ep8slice --ep-size 8 --plan --precision fp8-bf16-wgrad --json 2>&1)
rc=$((rc | $?))
if [ $rc -eq 0 ] && python3 - "$plan" "$json" "$wplan" "$wjson" <<'PY'
import json, sys
plan, j, wplan, wj = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
assert j.pop("precision") == "fp8" and wj.pop("precision") == "fp8-bf16-wgrad", (j, wj)
token_axis = [b for b in j["fp8_buffers"] if b["name"].startswith("t_")]
copies = sum(b["bytes"] for b in token_axis)
assert len(token_axis) == 10 and copies > 0, token_axis
assert wj.pop("fp8_buffers") == [b for b in j.pop("fp8_buffers") if not b["name"].startswith("t_")]
for key in ("fp8_scratch_bytes", "workspace_bytes"):
    assert j.pop(key) - wj.pop(key) == copies, key
assert j == wj, (j, wj)
head, rest = plan.split("\n", 1)
whead, wrest = wplan.split("\n", 1)
assert head.endswith(", precision fp8") and whead == head + "-bf16-wgrad", (head, whead)
lines = [l for l in rest.split("\n") if not l.startswith("  fp8        t_")]
assert len(lines) == len(rest.split("\n")) - 10
for l, w in zip(lines, wrest.split("\n")):
    assert l == w or l.startswith(("  fp8 scratch", "  workspace")), (l, w)
PY
then
  pass "run --plan --precision fp8-bf16-wgrad"
else
  fail "run --plan --precision fp8-bf16-wgrad: $wplan $wjson"
fi

# 5. Help.
if "$mok" --help | grep -q "usage:"; then pass "--help"; else fail "--help"; fi

rm -f /tmp/mok_cli_err.$$
echo "cli: $fails failed"
[ $fails -eq 0 ]
