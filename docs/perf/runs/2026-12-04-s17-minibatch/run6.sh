#!/usr/bin/env bash
# Session 17, call 6: minibatch 16384 against 4096 for the megakernel: ncu's DRAM bytes of one
# launch, and each path alone at the power limit.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
for c in qwen3-30b-a3b dsv3-ep8slice mixtral-8x7b; do
  for mb in 4096 16384; do
    timeout 100 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_elapsed.avg.per_second --clock-control none --cache-control none --kernel-name regex:fused_forward --launch-skip 6 --launch-count 1 --csv $B/bench_virtual_ranks --case $c --ranks 1 --reps 3 --minibatch $mb > $O/ncu-$c-mb$mb.csv 2>&1
    echo "ncu $c mb $mb rc $? ($((SECONDS - start)) s)"; grep -E '"(dram__bytes|gpu__time)' $O/ncu-$c-mb$mb.csv | awk -F'","' '{print $(NF-2), $NF}'
  done
done
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for c in "qwen3-30b-a3b 16384" "qwen3-30b-a3b 4096" "dsv3-ep8slice 16384" "dsv3-ep8slice 4096"; do
  set -- $c; n=$1-mb$2
  timeout 150 $B/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 --minibatch $2 --json $O/solo-$n.json > $O/solo-$n.log 2>&1
  echo "$n rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "W 1 queued" $f; python3 bench/solo_power.py $O/smi.csv $f | grep "unfused/fused"; done | tee $O/solo_power.txt
tar czf $OUT/logs.tgz -C $O .
