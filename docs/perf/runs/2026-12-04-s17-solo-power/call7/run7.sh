#!/usr/bin/env bash
# Session 17, call 7: bench_virtual_ranks after the back-to-back helper's refactor, a short check.
set -u
B=build-dev
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > /tmp/smi.csv 2>&1 &
SMI=$!
timeout 100 $B/bench_virtual_ranks --case qwen3-30b-a3b --ranks 1 --reps 10 --dense --solo 2 > /tmp/q.log 2>&1; echo "rc $?"
kill $SMI
cat /tmp/q.log
python3 bench/solo_power.py /tmp/smi.csv /tmp/q.log
cp /tmp/q.log $OUT/
