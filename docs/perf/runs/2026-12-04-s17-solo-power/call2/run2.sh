#!/usr/bin/env bash
# Session 17, call 2: each path alone (--solo) beside nvidia-smi's clock and power, and ncu's DRAM
# bytes of the megakernel with and without the pull's lead.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
date +%s.%N > $O/date.txt; date >> $O/date.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
step solo
for c in qwen3-30b-a3b mixtral-8x7b dsv3-ep8slice; do
  timeout 150 $B/bench_virtual_ranks --case $c --ranks 1 --reps 30 --dense --solo 4 --json $O/solo-$c.json > $O/solo-$c.log 2>&1
  echo "$c rc $? ($((SECONDS - start)) s)"; cat $O/solo-$c.log
done
kill $SMI
step ncu
for v in 0 1 2; do
  MOK_FUSED_PULL_LEAD=$v timeout 200 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second --clock-control none --cache-control none --kernel-name regex:fused_forward --launch-skip 6 --launch-count 2 --csv $B/bench_virtual_ranks --case qwen3-30b-a3b --ranks 1 --reps 3 > $O/ncu-qwen3-lead$v.csv 2>&1
  echo "ncu lead $v rc $? ($((SECONDS - start)) s)"; grep -E "dram__bytes|gpu__time|cycles_elapsed" $O/ncu-qwen3-lead$v.csv | cut -c1-20,180-400 | head -12
done
step done
tar czf $OUT/logs.tgz -C $O .
