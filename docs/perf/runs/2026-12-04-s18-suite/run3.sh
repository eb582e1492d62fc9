#!/usr/bin/env bash
# Session 18, call 3: the GPU suite (quick, pytest included) with the megakernel's 16384-row
# default stage, then each path alone on dsv3-ep8slice over 8 virtual ranks and on qwen3, the
# default stage against MOK_FUSED_STAGE_ROWS=4096 (the stage before), while time is left.
set -u
O=/tmp/o3; rm -rf $O; mkdir -p $O/suite
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
MOK_SUITE_QUICK=1 MOK_BENCH=0 MOK_COMMIT=${1:?commit} timeout 480 scripts/gpu-suite $O/suite > $O/suite/run.log 2>&1 || true
tail -1 $O/suite/run.log; echo "suite done ($((SECONDS - start)) s)"
grep -hE "^\[  (PASSED|FAILED) |tests ran|Stage" $O/suite/mok_layer_tests.log | head -8
tail -1 $O/suite/pytest.log
B=build-gpu
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for c in "dsv3-ep8slice 8 0" "dsv3-ep8slice 8 4096" "qwen3-30b-a3b 1 0" "qwen3-30b-a3b 1 4096"; do
  set -- $c; n=$1-W$2-stage$3
  [ $((SECONDS - start)) -lt 525 ] || { echo "no time for $n"; continue; }
  if [ "$3" = 0 ]; then unset MOK_FUSED_STAGE_ROWS; else export MOK_FUSED_STAGE_ROWS=$3; fi
  timeout 60 $B/bench_virtual_ranks --case $1 --ranks $2 --reps 30 --dense --solo 6 --json $O/solo-$n.json > $O/solo-$n.log 2>&1
  echo "$n rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $(basename $f)"; python3 bench/solo_power.py $O/smi.csv $f; done > $O/solo_power.txt 2>&1
grep -E "^##|unfused/fused time" $O/solo_power.txt
grep -h -E "W [18] queued" $O/solo-*.log
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
