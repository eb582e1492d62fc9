#!/usr/bin/env bash
# Session 21, call 3: the SwiGLU-backward epilogue's g and u fetched into L2 during the K loop
# (uncommitted, on bdac873). Builds of libmok_gemm + mok_gemm_bench: base (s21/base: bdac873's
# kernels, this bench source), L3, L6 (the default), L12 (MOK_EPILOGUE_LEAD_BLOCKS); mok_gemm_tests
# and mok_layer_tests at L6; then the dgrad passes of mok_gemm_bench, variants rotating, 2 rounds.
set -u
O=/tmp/o3; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
conf() {  # dir src extra-cuda-flags
  cmake -S $2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=${4:-OFF} \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$3" > $O/conf_$(basename $1).log 2>&1
}
conf /tmp/bbase $root/s21/base "" && (cmake --build /tmp/bbase -j 4 --target mok_gemm_bench > $O/build_base.log 2>&1; echo "base rc $?" >> $O/builds.log) &
conf /tmp/bL3 $root "-DMOK_EPILOGUE_LEAD_BLOCKS=3" && (cmake --build /tmp/bL3 -j 4 --target mok_gemm_bench > $O/build_L3.log 2>&1; echo "L3 rc $?" >> $O/builds.log) &
conf /tmp/bL12 $root "-DMOK_EPILOGUE_LEAD_BLOCKS=12" && (cmake --build /tmp/bL12 -j 4 --target mok_gemm_bench > $O/build_L12.log 2>&1; echo "L12 rc $?" >> $O/builds.log) &
conf build-gpu $root "" ON && cmake --build build-gpu -j 6 --target mok_gemm_tests mok_layer_tests mok_gemm_bench > $O/build_L6.log 2>&1
echo "L6 rc $?" >> $O/builds.log
wait; cat $O/builds.log; echo "builds ($((SECONDS - start)) s)"
for t in mok_gemm_tests mok_layer_tests; do
  timeout 150 build-gpu/tests/cpp/$t > $O/$t.log 2>&1
  echo "$t rc $? : $(grep -E '^\[  (PASSED|FAILED)' $O/$t.log | tr '\n' ' ') ($((SECONDS - start)) s)"
  grep -E "^\[  FAILED|SKIPPED \]" $O/$t.log | head -5
done
declare -A B=([base]=/tmp/bbase [L3]=/tmp/bL3 [L6]=build-gpu [L12]=/tmp/bL12)
for round in 1 2; do
  for v in base L3 L6 L12; do
    [ $round = 2 ] && [ $v = base ] && continue  # round 2 ends with base (below)
    left=$((570 - (SECONDS - start))); [ $left -lt 40 ] && { echo "skip $v$round"; continue; }
    timeout $left ${B[$v]}/mok_gemm_bench $O/gemm_$v$round.jsonl 20 5 qwen3-30b-a3b,dsv3-ep8slice \
      dgrad,dgrad-swiglu,dgrad-swiglu-wh > $O/bench_$v$round.log 2>&1
    echo "bench $v$round rc $? ($((SECONDS - start)) s)"
  done
  if [ $round = 2 ]; then
    left=$((570 - (SECONDS - start)))
    [ $left -ge 40 ] && timeout $left /tmp/bbase/mok_gemm_bench $O/gemm_base2.jsonl 20 5 \
      qwen3-30b-a3b,dsv3-ep8slice dgrad,dgrad-swiglu,dgrad-swiglu-wh > $O/bench_base2.log 2>&1
    echo "bench base2 ($((SECONDS - start)) s)"
  fi
done
tar czf $OUT/logs.tgz -C $O .
