#!/usr/bin/env bash
# Session 23, call 4: call 3's noslot again with the down tile's values kept live (XOR-folded, one
# store that never happens): call 3's noslot build had lost the down GEMM's wgmma (ptxas removes
# HGMMA whose accumulators nothing reads; 13 against 16 in the megakernel). Builds from s23/hack2:
# base, noslot (-DHACK_NOSLOT: the combine rows packed, not gathered, not stored), noctx
# (-DHACK_NOSLOT -DHACK_NOGU: and g, u not stored). qwen3-30b-a3b, all three.
set -u
O=/tmp/o4; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
bld() {  # dir flags
  cmake -S $root/s23/hack2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$2" > $O/conf_$(basename $1).log 2>&1 &&
  cmake --build $1 -j 5 --target bench_virtual_ranks > $O/build_$(basename $1).log 2>&1
  echo "$1 rc $? ($((SECONDS - start)) s)" >> $O/builds.log
}
bld /tmp/bbase "" &
bld /tmp/bnoslot "-DHACK_NOSLOT" &
bld /tmp/bnoctx "-DHACK_NOSLOT -DHACK_NOGU" &
wait; cat $O/builds.log
for b in base noslot noctx; do echo "$b HGMMA $(find /tmp/b$b -name "*.a" | xargs -n1 cuobjdump -sass 2>/dev/null | grep -c HGMMA)"; done
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cv in "qwen3-30b-a3b noslot" "qwen3-30b-a3b base" "qwen3-30b-a3b noctx"; do
  set -- $cv
  [ $((SECONDS - start)) -lt 200 ] || { echo "no time for solo $1 $2"; continue; }
  timeout 60 /tmp/b$2/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-$2.json > $O/solo-$1-$2.log 2>&1
  echo "solo $1 $2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "solo |x the dense" $f; done
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
