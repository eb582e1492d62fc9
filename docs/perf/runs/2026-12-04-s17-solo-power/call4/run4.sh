#!/usr/bin/env bash
# Session 17, call 4: the solo measurement again (a third round), and the minibatch of 16384 rows
# alone at the power limit.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for c in "mixtral-8x7b 4096" "qwen3-30b-a3b 4096" "dsv3-ep8slice 4096" "mixtral-8x7b 16384" "qwen3-30b-a3b 16384"; do
  set -- $c; n=$1-mb$2
  timeout 150 $B/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 --minibatch $2 --json $O/solo-$n.json > $O/solo-$n.log 2>&1
  echo "$n rc $? ($((SECONDS - start)) s)"
done
kill $SMI
python3 bench/solo_power.py $O/smi.csv $O/solo-*.log --json $O/solo_power.json | tee $O/solo_power.txt
grep -h -E "W [18] queued|x the dense|sustained|minibatch" $O/solo-*.log
tar czf $OUT/logs.tgz -C $O .
