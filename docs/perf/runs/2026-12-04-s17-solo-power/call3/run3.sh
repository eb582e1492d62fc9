#!/usr/bin/env bash
# Session 17, call 3: each forward path alone (--solo 6, unfused first for uniform routing, fused
# first for skewed) beside nvidia-smi's clock, power and temperature; every PERF.md case and W 8.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
nvidia-smi -q -d POWER,CLOCK > $O/gpu.txt 2>&1
for c in qwen3-30b-a3b dsv3-ep8slice mixtral-8x7b dsv3-ep1 "dsv3-ep8slice 8"; do
  set -- $c; W=${2:-1}; n=$1-W$W
  timeout 150 $B/bench_virtual_ranks --case $1 --ranks $W --reps 30 --dense --solo 6 --json $O/solo-$n.json > $O/solo-$n.log 2>&1
  echo "$n rc $? ($((SECONDS - start)) s)"
done
kill $SMI
python3 bench/solo_power.py $O/smi.csv $O/solo-*.log --json $O/solo_power.json | tee $O/solo_power.txt
grep -h -E "W [18] queued|x the dense|sustained" $O/solo-*.log
tar czf $OUT/logs.tgz -C $O .
