#!/usr/bin/env bash
# Session 17, call 8: the forward dispatch in token order: tests, then A/B against the row order
# in one binary (MOK_PULL_ORDER=rows), each path alone and in pairs.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
start=$SECONDS
res() { if grep -qE '^\[  PASSED  \] [1-9]' "$1" && ! grep -q '^\[  FAILED  \]' "$1"; then echo "PASS $1"; else echo "FAIL $1"; grep -E "FAILED|Failure|error" "$1" | head -20; fi; }
timeout 150 $B/tests/cpp/mok_layer_tests > $O/layer.log 2>&1; res $O/layer.log; grep -E "TokenOrder|tests from .* ran" $O/layer.log | head -4
echo "tests done ($((SECONDS - start)) s)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for c in qwen3-30b-a3b dsv3-ep8slice; do
  for order in tokens rows; do
    MOK_PULL_ORDER=$order timeout 100 $B/bench_virtual_ranks --case $c --ranks 1 --reps 20 --dense --solo 4 --json $O/vr-$c-$order.json > $O/vr-$c-$order.log 2>&1
    echo "$c $order rc $? ($((SECONDS - start)) s)"; grep -E "W 1 queued|solo" $O/vr-$c-$order.log
  done
done
kill $SMI
for f in $O/vr-*.log; do echo "## $f"; python3 bench/solo_power.py $O/smi.csv $f | grep -E "W1 .*(unfused|fused) "; done | tee $O/solo_power.txt
tar czf $OUT/logs.tgz -C $O .
