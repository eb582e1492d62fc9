#!/usr/bin/env bash
# Session 23, call 1: the unclamped SwiGLU forward gathers its bf16 pairs through a warp's
# shared-memory slot (stmatrix; branch s23-swiglu-stmatrix, uncommitted) against main (s23/base).
# Builds, gemm + layer tests on the change, gemm bench A/B (gemm1, gemm2 as control), each forward path alone on qwen3 and dsv3-ep8slice.
set -u
O=/tmp/o3; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
conf() {  # dir src tests
  cmake -S $2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=$3 \
    -DMOK_BUILD_PYTHON=OFF > $O/conf_$(basename $1).log 2>&1
}
(conf build-base $root/s23/base OFF && cmake --build build-base -j 8 --target mok_gemm_bench bench_virtual_ranks > $O/build_base.log 2>&1; echo "base rc $? ($((SECONDS - start)) s)" >> $O/builds.log) &
conf build-new $root ON && cmake --build build-new -j 8 --target mok_gemm_tests mok_layer_tests mok_gemm_bench bench_virtual_ranks > $O/build_new.log 2>&1
echo "new rc $? ($((SECONDS - start)) s)" >> $O/builds.log
wait; cat $O/builds.log
grep -E "error|warning" $O/build_new.log | head -5
for t in mok_gemm_tests mok_layer_tests; do
  timeout 150 build-new/tests/cpp/$t > $O/$t.log 2>&1
  echo "$t rc $? : $(grep -E '^\[  (PASSED|FAILED)' $O/$t.log | tr '\n' ' ') ($((SECONDS - start)) s)"
  grep -E "^\[  FAILED|SKIPPED \]" $O/$t.log | head -8
done
declare -A B=([base]=build-base [new]=build-new)
n=0
for v in base new new base; do
  n=$((n + 1)); left=$((330 - (SECONDS - start))); [ $left -lt 30 ] && { echo "skip gemm $v$n"; continue; }
  timeout $left ${B[$v]}/mok_gemm_bench $O/gemm_$v$n.jsonl 20 5 qwen3-30b-a3b,dsv3-ep8slice \
    gemm1,gemm2 > $O/bench_$v$n.log 2>&1
  echo "gemm $v$n rc $? ($((SECONDS - start)) s)"
done
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for cv in "qwen3-30b-a3b new" "qwen3-30b-a3b base" "dsv3-ep8slice new" "dsv3-ep8slice base"; do
  set -- $cv
  [ $((SECONDS - start)) -lt 515 ] || { echo "no time for solo $1 $2"; continue; }
  timeout 60 ${B[$2]}/bench_virtual_ranks --case $1 --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$1-$2.json > $O/solo-$1-$2.log 2>&1
  echo "solo $1 $2 rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "W 1 queued|x the dense|solo " $f; done
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
