#!/usr/bin/env bash
# Session 23, call 2: what the forward's context and combine writes cost, and whether streaming
# stores help. Three bench_virtual_ranks builds: base (s23/base = main), cs (s23/hack -DHACK_CS:
# g, u and the down forward's combine rows stored with st.global.cs, evict-first), noctx
# (s23/hack -DHACK_NOCTX: g, u and the combine rows not stored at all; the bench's bitwise check
# reported, not enforced). Each forward path alone on qwen3-30b-a3b and dsv3-ep8slice.
set -u
O=/tmp/o2; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
bld() {  # dir src flags
  cmake -S $2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$3" > $O/conf_$(basename $1).log 2>&1 &&
  cmake --build $1 -j 5 --target bench_virtual_ranks > $O/build_$(basename $1).log 2>&1
  echo "$1 rc $? ($((SECONDS - start)) s)" >> $O/builds.log
}
bld /tmp/bbase $root/s23/base "" &
bld /tmp/bcs $root/s23/hack "-DHACK_CS" &
bld /tmp/bnoctx $root/s23/hack "-DHACK_NOCTX" &
wait; cat $O/builds.log
declare -A B=([base]=/tmp/bbase [cs]=/tmp/bcs [noctx]=/tmp/bnoctx)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cv in "qwen3-30b-a3b cs" "qwen3-30b-a3b base" "qwen3-30b-a3b noctx" "dsv3-ep8slice noctx" "dsv3-ep8slice base" "dsv3-ep8slice cs"; do
  set -- $cv
  [ $((SECONDS - start)) -lt 500 ] || { echo "no time for solo $1 $2"; continue; }
  timeout 60 ${B[$2]}/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-$2.json > $O/solo-$1-$2.log 2>&1
  echo "solo $1 $2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "W 1 queued|x the dense|solo " $f; done
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
