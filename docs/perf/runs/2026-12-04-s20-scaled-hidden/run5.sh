#!/usr/bin/env bash
# Session 20, call 5: the forward's layout question. Three packages side by side: A = this tree
# (main at 4eb652f: rows_scaled_hidden after rows_d_up), L = s20/last (ab3dfa5: the same buffer last
# in the layer region), B = s20/base (45e0260, before the change); bench_layer.py, rotating.
set -u
export PATH=/usr/local/cuda/bin:$PATH
S=$OUT/summary.log; start=$SECONDS
python3 -m pip uninstall -y mok > /dev/null 2>&1
for side in A L B; do
  src=$PWD; [ $side = L ] && src=$PWD/s20/last; [ $side = B ] && src=$PWD/s20/base
  (cd $src && CMAKE_BUILD_PARALLEL_LEVEL=6 python3 -m pip install . --no-build-isolation --no-deps \
     --target /tmp/pkg$side -C build-dir=/tmp/pipbuild$side > /tmp/pip$side.log 2>&1; echo "pip $side rc $?" >> $S) &
done
wait; echo "pips ($((SECONDS - start)) s)" >> $S
mkdir -p /tmp/o5
for order in "A L B" "L B A" "B A L"; do
  for side in $order; do
    [ $((SECONDS - start)) -gt 245 ] && { echo "skip $side: time" >> $S; continue; }
    t=$SECONDS
    PYTHONPATH=/tmp/pkg$side timeout 40 python3 bench/bench_layer.py --cases dsv3-ep8slice,qwen3-30b-a3b \
      --impls mok --routings uniform --out /tmp/o5/layer_$side.$t.json > /tmp/o5/bench_$side.$t.log 2>&1
    echo "$side rc $? ($((SECONDS - start)) s)" >> $S
    grep -E " ms " /tmp/o5/bench_$side.$t.log | cut -c1-75 | sed "s/^/$side /" >> $S
  done
done
tar czf $OUT/logs.tgz -C /tmp/o5 . 2>/dev/null
cat $S
