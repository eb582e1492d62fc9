#!/usr/bin/env bash
# Session 18, call 4: each forward path alone on qwen3-30b-a3b and dsv3-ep8slice at fba1f6c (the
# token-order dispatches, the megakernel's 16384-row default stage), for the results.
set -u
O=/tmp/o4; rm -rf $O; mkdir -p $O; B=build-dev
start=$SECONDS
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
unset MOK_FUSED_STAGE_ROWS
for c in qwen3-30b-a3b dsv3-ep8slice; do
  timeout 60 $B/bench_virtual_ranks --case $c --ranks 1 --reps 30 --dense --solo 6 --json $O/solo-$c-W1.json > $O/solo-$c-W1.log 2>&1
  echo "$c rc $? ($((SECONDS - start)) s)"
done
kill $SMI
python3 bench/solo_power.py $O/smi.csv $O/solo-*.log --json $O/solo_power.json > $O/solo_power.txt 2>&1
grep -E "unfused/fused time" $O/solo_power.txt
grep -h -E "W 1 queued|x the dense" $O/solo-*.log
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
