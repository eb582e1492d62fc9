#!/usr/bin/env bash
# Session 22, call 1: quad_gather through stmatrix (docs/perf/patches/quad-gather-stmatrix.patch,
# applied on branch s22-stm over 5fc5139) against main (s22/base, git archive of 5fc5139).
# Builds: build-stm (tests, gemm bench, bench_virtual_ranks), build-base (benches); gemm and layer
# tests on stm; gemm bench gemm1,gemm2 A/B (base stm stm base); each forward path alone (solo).
set -u
O=/tmp/o1; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
conf() {  # dir src tests
  cmake -S $2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=$3 \
    -DMOK_BUILD_PYTHON=OFF > $O/conf_$(basename $1).log 2>&1
}
(conf build-base $root/s22/base OFF && cmake --build build-base -j 8 --target mok_gemm_bench bench_virtual_ranks > $O/build_base.log 2>&1; echo "base rc $? ($((SECONDS - start)) s)" >> $O/builds.log) &
conf build-stm $root ON && cmake --build build-stm -j 8 --target mok_gemm_tests mok_layer_tests mok_gemm_bench bench_virtual_ranks > $O/build_stm.log 2>&1
echo "stm rc $? ($((SECONDS - start)) s)" >> $O/builds.log
wait; cat $O/builds.log
grep -E "error|warning" $O/build_stm.log | head -5
for t in mok_gemm_tests mok_layer_tests; do
  timeout 150 build-stm/tests/cpp/$t > $O/$t.log 2>&1
  echo "$t rc $? : $(grep -E '^\[  (PASSED|FAILED)' $O/$t.log | tr '\n' ' ') ($((SECONDS - start)) s)"
  grep -E "^\[  FAILED|SKIPPED \]" $O/$t.log | head -5
done
declare -A B=([base]=build-base [stm]=build-stm)
n=0
for v in base stm stm base; do
  n=$((n + 1)); left=$((330 - (SECONDS - start))); [ $left -lt 30 ] && { echo "skip gemm $v$n"; continue; }
  timeout $left ${B[$v]}/mok_gemm_bench $O/gemm_$v$n.jsonl 20 5 qwen3-30b-a3b,dsv3-ep8slice \
    gemm1,gemm2 > $O/bench_$v$n.log 2>&1
  echo "gemm $v$n rc $? ($((SECONDS - start)) s)"
done
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for v in stm base; do
  [ $((SECONDS - start)) -lt 505 ] || { echo "no time for solo $v"; continue; }
  timeout 60 ${B[$v]}/bench_virtual_ranks --case qwen3-30b-a3b --ranks 1 --reps 30 --dense --solo 6 \
    --json $O/solo-$v.json > $O/solo-$v.log 2>&1
  echo "solo $v rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "W 1 queued|x the dense|solo " $f; done
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
