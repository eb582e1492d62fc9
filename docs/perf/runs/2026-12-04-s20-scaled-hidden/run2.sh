#!/usr/bin/env bash
# Session 20, call 2 (branch s20-scaled-hidden): CMake build, every C++ test binary, memcheck over
# the dgrad epilogue's tests, then the backward's A/B: this tree (A) against main (B, s20/base)
# installed side by side (pip --target), bench_layer.py forward and forward+backward, ABAB.
set -u
O=/tmp/o2; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH MOK_COMMIT=${1:?commit}
root=$PWD; start=$SECONDS
unset PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $O/machine.log 2>&1
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=ON \
  -DMOK_BUILD_PYTHON=OFF > $O/build.log 2>&1 && cmake --build build-gpu -j 16 >> $O/build.log 2>&1
echo "build rc $? ($((SECONDS - start)) s)"
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
( for side in A B; do
    src=$root; [ $side = B ] && src=$root/s20/base
    (cd $src && CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install . --no-build-isolation --no-deps \
       --target /tmp/pkg$side -C build-dir=/tmp/pipbuild$side > $O/pip$side.log 2>&1)
    echo "pip $side rc $?" >> $O/pip_rc.log
  done ) &
PIP=$!
for t in mok_tests mok_layer_tests mok_schedule_tests mok_gemm_tests mok_ptx_tests; do
  timeout 200 build-gpu/tests/cpp/$t > $O/$t.log 2>&1
  echo "$t rc $? : $(grep -E '^\[  (PASSED|FAILED)' $O/$t.log | tr '\n' ' ') ($((SECONDS - start)) s)"
  grep -E "^\[  FAILED|SKIPPED \]" $O/$t.log | head -5
done
grep -h "scaled\|row scale and dot" $O/mok_gemm_tests.log | head -6
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/tests/cpp/mok_gemm_tests \
  --gtest_filter='*SwigluBackwardRowScaleAndDotSmallOdd*:*SwigluOptionsNeed*' > $O/memcheck_dgrad.log 2>&1
echo "memcheck rc $? : $(grep 'ERROR SUMMARY' $O/memcheck_dgrad.log) ($((SECONDS - start)) s)"
wait $PIP; cat $O/pip_rc.log; echo "pips done ($((SECONDS - start)) s)"
cases=qwen3-30b-a3b,dsv3-ep8slice,dsv3-ep1,mixtral-8x7b
for round in 1 2; do
  for side in A B; do
    left=$((590 - (SECONDS - start)))
    [ $left -lt 60 ] && { echo "no time for $side$round"; continue; }
    PYTHONPATH=/tmp/pkg$side timeout $left python3 bench/bench_layer.py --cases $cases --impls mok \
      --routings uniform --out $O/layer_$side$round.json > $O/bench_$side$round.log 2>&1
    echo "bench $side$round rc $? ($((SECONDS - start)) s)"
    grep -E "ms " $O/bench_$side$round.log | grep -v Warning | cut -c1-110
  done
done
tar czf $OUT/logs.tgz -C $O .
