#!/usr/bin/env bash
# Session 18, call 1: the GPU suite (quick, pytest included) on the token-order dispatches with
# the schedule's inverse, then each forward path alone (qwen3 at the default stage and at a
# 16384-row megakernel stage, dsv3-ep8slice) while time is left.
set -u
O=/tmp/o; mkdir -p $O/suite
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
MOK_SUITE_QUICK=1 MOK_BENCH=0 MOK_COMMIT=${1:?commit} timeout 470 scripts/gpu-suite $O/suite > $O/suite/run.log 2>&1 || true
tail -1 $O/suite/run.log; echo "suite done ($((SECONDS - start)) s)"
B=build-gpu
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for c in "qwen3-30b-a3b 0" "qwen3-30b-a3b 16384" "dsv3-ep8slice 0"; do
  [ $((SECONDS - start)) -lt 515 ] || { echo "no time for $c"; continue; }
  set -- $c; n=$1-stage$2
  if [ "$2" = 0 ]; then unset MOK_FUSED_STAGE_ROWS; else export MOK_FUSED_STAGE_ROWS=$2; fi
  timeout 60 $B/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 --json $O/solo-$n.json > $O/solo-$n.log 2>&1
  echo "$n rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "W 1 queued|x the dense" $f; python3 bench/solo_power.py $O/smi.csv $f | grep -E "unfused/fused|dense"; done | tee $O/solo_power.txt
tar czf $OUT/logs.tgz -C $O .
