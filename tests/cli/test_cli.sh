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

# 5. Help.
if "$mok" --help | grep -q "usage:"; then pass "--help"; else fail "--help"; fi

rm -f /tmp/mok_cli_err.$$
echo "cli: $fails failed"
[ $fails -eq 0 ]
