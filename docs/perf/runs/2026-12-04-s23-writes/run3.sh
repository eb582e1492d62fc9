#!/usr/bin/env bash
# Session 23, call 3: which of the forward's writes cost what call 2's noctx build saved. Builds
# of bench_virtual_ranks from s23/hack2 (one macro each; without one it is main): nogu (g and u
# not stored), noslot (the combine rows not stored), gul2 (g and u stored, as many instructions,
# into the buffers' first 512 rows: L2-resident, next to no HBM writes), slotl2 (the combine rows
# likewise into the first 512 slots). Each forward path alone on qwen3-30b-a3b (all five) and
# dsv3-ep8slice (base, slotl2).
set -u
O=/tmp/o3; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
bld() {  # dir flags
  cmake -S $root/s23/hack2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$2" > $O/conf_$(basename $1).log 2>&1 &&
  cmake --build $1 -j 3 --target bench_virtual_ranks > $O/build_$(basename $1).log 2>&1
  echo "$1 rc $? ($((SECONDS - start)) s)" >> $O/builds.log
}
bld /tmp/bbase "" &
bld /tmp/bnogu "-DHACK_NOGU" &
bld /tmp/bnoslot "-DHACK_NOSLOT" &
bld /tmp/bgul2 "-DHACK_GUL2" &
bld /tmp/bslotl2 "-DHACK_SLOTL2" &
wait; cat $O/builds.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cv in "qwen3-30b-a3b base" "qwen3-30b-a3b nogu" "qwen3-30b-a3b noslot" "qwen3-30b-a3b gul2" "qwen3-30b-a3b slotl2" \
          "dsv3-ep8slice slotl2" "dsv3-ep8slice base"; do
  set -- $cv
  [ $((SECONDS - start)) -lt 430 ] || { echo "no time for solo $1 $2"; continue; }
  timeout 60 /tmp/b$2/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-$2.json > $O/solo-$1-$2.log 2>&1
  echo "solo $1 $2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "solo |x the dense" $f; done
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
