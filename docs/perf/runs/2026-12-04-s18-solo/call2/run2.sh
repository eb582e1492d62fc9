#!/usr/bin/env bash
# Session 18, call 2: each forward path alone (--solo 6) beside nvidia-smi's clock and power, on
# the token-order dispatches: every PERF.md case and W 8 at the default megakernel stage (the
# minibatch, 4096 rows), then four cases with a 16384-row stage (MOK_FUSED_STAGE_ROWS).
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for c in "qwen3-30b-a3b 1 0" "dsv3-ep8slice 1 0" "mixtral-8x7b 1 0" "dsv3-ep1 1 0" "dsv3-ep8slice 8 0" \
         "qwen3-30b-a3b 1 16384" "dsv3-ep8slice 1 16384" "mixtral-8x7b 1 16384" "dsv3-ep1 1 16384"; do
  set -- $c; n=$1-W$2-stage$3
  [ $((SECONDS - start)) -lt 530 ] || { echo "no time for $n"; continue; }
  if [ "$3" = 0 ]; then unset MOK_FUSED_STAGE_ROWS; else export MOK_FUSED_STAGE_ROWS=$3; fi
  timeout 70 $B/bench_virtual_ranks --case $1 --ranks $2 --reps 30 --dense --solo 6 --json $O/solo-$n.json > $O/solo-$n.log 2>&1
  echo "$n rc $? ($((SECONDS - start)) s)"
done
kill $SMI
python3 bench/solo_power.py $O/smi.csv $O/solo-*-stage0.log --json $O/solo_power.json > /dev/null 2>&1
for f in $O/solo-*.log; do echo "## $(basename $f)"; python3 bench/solo_power.py $O/smi.csv $f; done > $O/solo_power.txt 2>&1
grep -E "^##|unfused/fused time" $O/solo_power.txt
grep -h -E "W [18] queued" $O/solo-*.log
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
