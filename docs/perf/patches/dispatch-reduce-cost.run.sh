#!/usr/bin/env bash
# Prepared in session 24, extended in session 25 (HACK_RDL2); not run yet (the device was not lent
# in either session): one call, about 420 s after the machine starts. What the launches' dispatch
# of x, their home reduction, and the HBM reads of x_routed and h cost alone at the power limit.
# Before the call: copy main to s25/hack (git archive HEAD | tar x -C s25/hack) and apply
# docs/perf/patches/dispatch-reduce-cost.patch there with patch -p1 (hack builds, not for main):
#   nodisp   (-DHACK_NODISPATCH) the launches' x dispatch runs only on a process's first 256 calls,
#            so the ring keeps real rows;
#   noreduce (-DHACK_NOREDUCE) the home reduction likewise;
#   rdl2     (-DHACK_RDL2) the gate/up GEMM reads its rows from x_routed's first 512 rows and the
#            down GEMM its rows from h's first 512 (both paths): the same MMAs on real data, the
#            A operands from L2 instead of HBM. Bounds what a fused kernel that kept x_routed and
#            h in L2 between their write and their read could save (NOTES, session 25).
# All three skip bench_virtual_ranks' bitwise check; the dense engine check still runs (the
# dense product is not wrapped). Remove s25/ before any pip install. Run from the repository
# root: bash <this file>.
set -u
O=/tmp/o4; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
bld() {  # src dir flags
  cmake -S $1 -B $2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$3" "-DCMAKE_CXX_FLAGS=$3" > $O/conf_$(basename $2).log 2>&1 &&
  cmake --build $2 -j 4 --target bench_virtual_ranks > $O/build_$(basename $2).log 2>&1
  echo "$2 rc $? ($((SECONDS - start)) s)" >> $O/builds.log
}
bld $root /tmp/bbase "" &
bld $root/s25/hack /tmp/bnodisp "-DHACK_NODISPATCH" &
bld $root/s25/hack /tmp/bnoreduce "-DHACK_NOREDUCE" &
bld $root/s25/hack /tmp/brdl2 "-DHACK_RDL2" &
wait; cat $O/builds.log
# rdl2 must keep every wgmma (a hack that changes what ptxas can prove may delete some: NOTES,
# session 23); its numbers mean nothing otherwise.
for b in base rdl2; do cuobjdump -sass /tmp/b$b/bench_virtual_ranks 2>/dev/null | grep -c HGMMA > $O/hgmma_$b.txt; done
cmp -s $O/hgmma_base.txt $O/hgmma_rdl2.txt && echo "HGMMA $(cat $O/hgmma_base.txt) in both" ||
  echo "HGMMA differ: base $(cat $O/hgmma_base.txt), rdl2 $(cat $O/hgmma_rdl2.txt): rdl2 invalid"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cv in "qwen3-30b-a3b rdl2" "qwen3-30b-a3b base" "qwen3-30b-a3b nodisp" "qwen3-30b-a3b noreduce" \
          "dsv3-ep8slice rdl2" "dsv3-ep8slice base"; do
  set -- $cv
  [ $((SECONDS - start)) -lt 480 ] || { echo "no time for $1 $2"; continue; }
  timeout 70 /tmp/b$2/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-$2.json > $O/solo-$1-$2.log 2>&1
  echo "solo $1 $2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "solo |queued|mok dense" $f; done
python3 bench/solo_power.py $O/smi.csv $O/solo-*.log > $O/solo_power.txt 2>&1; grep -E "^qwen3|^dsv3" $O/solo_power.txt
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
