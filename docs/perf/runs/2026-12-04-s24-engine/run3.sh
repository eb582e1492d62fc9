#!/usr/bin/env bash
# Session 24, call 3: each forward path alone at the power limit (bench_virtual_ranks --dense
# --solo 6, nvidia-smi every 20 ms) on PERF.md's four cases and dsv3-ep8slice over 8 virtual
# ranks, for docs/perf/layer_fused.json at the current library code.
set -u
O=/tmp/o3; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
cmake -S . -B /tmp/b3 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
  -DMOK_BUILD_PYTHON=OFF > $O/conf.log 2>&1 && cmake --build /tmp/b3 -j 16 --target bench_virtual_ranks > $O/build.log 2>&1
echo "build rc $? ($((SECONDS - start)) s)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cw in "qwen3-30b-a3b 1" "dsv3-ep8slice 1" "dsv3-ep8slice 8" "mixtral-8x7b 1" "dsv3-ep1 1"; do
  set -- $cw
  [ $((SECONDS - start)) -lt 480 ] || { echo "no time for $1 W$2"; continue; }
  timeout 90 /tmp/b3/bench_virtual_ranks --case $1 --ranks $2 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-W$2.json > $O/solo-$1-W$2.log 2>&1
  echo "$1 W$2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
python3 bench/solo_power.py $O/smi.csv $O/solo-*.log --json $O/solo_power.json > $O/solo_power.txt 2>&1
grep -E "unfused/fused time|dense engine" $O/solo_power.txt
grep -h -E "queued|x the dense" $O/solo-*.log
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
