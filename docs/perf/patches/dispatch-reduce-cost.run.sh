#!/usr/bin/env bash
# Prepared in session 24, not run (the device stopped being lent): one call, about 310 s after the
# machine starts. What the launches' dispatch of x and their home reduction cost alone at the
# power limit. Before the call: copy main to s24/hack (git archive HEAD | tar x -C s24/hack) and
# apply docs/perf/patches/dispatch-reduce-cost.patch there (hack builds, not for main):
# nodisp (-DHACK_NODISPATCH: the launches' x dispatch runs only on a process's first 256 calls,
# so the ring keeps real rows), noreduce (-DHACK_NOREDUCE: the home reduction likewise); both
# skip bench_virtual_ranks' bitwise check. Run from the repository root: bash <this file>.
set -u
O=/tmp/o4; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
bld() {  # src dir flags
  cmake -S $1 -B $2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$3" "-DCMAKE_CXX_FLAGS=$3" > $O/conf_$(basename $2).log 2>&1 &&
  cmake --build $2 -j 5 --target bench_virtual_ranks > $O/build_$(basename $2).log 2>&1
  echo "$2 rc $? ($((SECONDS - start)) s)" >> $O/builds.log
}
bld $root /tmp/bbase "" &
bld $root/s24/hack /tmp/bnodisp "-DHACK_NODISPATCH" &
bld $root/s24/hack /tmp/bnoreduce "-DHACK_NOREDUCE" &
wait; cat $O/builds.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cv in "qwen3-30b-a3b nodisp" "qwen3-30b-a3b base" "qwen3-30b-a3b noreduce" "dsv3-ep1 nodisp" "dsv3-ep1 base"; do
  set -- $cv
  [ $((SECONDS - start)) -lt 250 ] || { echo "no time for $1 $2"; continue; }
  timeout 70 /tmp/b$2/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-$2.json > $O/solo-$1-$2.log 2>&1
  echo "solo $1 $2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "solo |queued" $f; done
python3 bench/solo_power.py $O/smi.csv $O/solo-*.log > $O/solo_power.txt 2>&1; grep -E "^qwen3|^dsv3" $O/solo_power.txt
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
