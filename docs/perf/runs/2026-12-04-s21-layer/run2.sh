#!/usr/bin/env bash
# Session 21, call 2 (uncommitted tests and bench items on 5c4be47): CMake build of the GEMM and
# layer test binaries and the GEMM bench; mok_gemm_tests and mok_layer_tests whole; then
# mok_gemm_bench on qwen3-30b-a3b and dsv3-ep8slice (the new dgrad-swiglu items beside the others).
set -u
O=/tmp/o2; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=ON \
  -DMOK_BUILD_PYTHON=OFF > $O/build.log 2>&1 && \
  cmake --build build-gpu -j 16 --target mok_gemm_tests mok_layer_tests mok_gemm_bench >> $O/build.log 2>&1
echo "build rc $? ($((SECONDS - start)) s)"; tail -3 $O/build.log
for t in mok_gemm_tests mok_layer_tests; do
  timeout 200 build-gpu/tests/cpp/$t > $O/$t.log 2>&1
  echo "$t rc $? : $(grep -E '^\[  (PASSED|FAILED)' $O/$t.log | tr '\n' ' ') ($((SECONDS - start)) s)"
  grep -E "^\[  FAILED|SKIPPED \]" $O/$t.log | head -5
done
grep -h "limit\|half_narrow" $O/mok_gemm_tests.log $O/mok_layer_tests.log | grep "mok \]" | head -8
left=$((580 - (SECONDS - start)))
b=$(find build-gpu -name mok_gemm_bench -type f | head -1)
timeout $left $b $O/gemm.jsonl 20 5 qwen3-30b-a3b,dsv3-ep8slice > $O/gemm_bench.log 2>&1
echo "gemm bench rc $? ($((SECONDS - start)) s)"
grep -E "dgrad|gemm2" $O/gemm_bench.log | head -60
tar czf $OUT/logs.tgz -C $O .
