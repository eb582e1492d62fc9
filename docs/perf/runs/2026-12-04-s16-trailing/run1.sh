#!/usr/bin/env bash
# Session 16, call 1: trailing stores, tests then an A/B against the direct epilogue.
set -u
O=$OUT; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
res() { if grep -qE '^\[  PASSED  \] [1-9]' "$1" && ! grep -q '^\[  FAILED  \]' "$1"; then echo "PASS $1"; else echo "FAIL $1"; tail -30 "$1"; fi; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $O/gpu.txt
step fused; timeout 120 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused.log 2>&1; res $O/fused.log
step layer; timeout 200 $B/tests/cpp/mok_layer_tests --gtest_filter='-LayerGpuFused.*' > $O/layer.log 2>&1; res $O/layer.log
step gemm; timeout 200 $B/tests/cpp/mok_gemm_tests > $O/gemm.log 2>&1; res $O/gemm.log
for t in -1 0 3; do step "fused t$t"; MOK_GEMM_TRAIL_BLOCKS=$t timeout 100 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused-t$t.log 2>&1; res $O/fused-t$t.log; done
for t in -1 3; do step "gemm t$t"; MOK_GEMM_TRAIL_BLOCKS=$t timeout 150 $B/tests/cpp/mok_gemm_tests > $O/gemm-t$t.log 2>&1; res $O/gemm-t$t.log; done
step bench
for c in qwen3-30b-a3b dsv3-ep8slice mixtral-8x7b dsv3-ep1; do
  for t in 2 -1; do
    MOK_GEMM_TRAIL_BLOCKS=$t timeout 100 $B/bench_virtual_ranks --case $c --ranks 1 --reps 30 --dense --json $O/vr-$c-t$t.json > $O/vr-$c-t$t.log 2>&1; echo "$c t$t rc $?"
    grep -E ' W 1 |x the dense' $O/vr-$c-t$t.log
  done
done
for t in 2 -1; do
  MOK_GEMM_TRAIL_BLOCKS=$t timeout 100 $B/bench_virtual_ranks --case dsv3-ep8slice --ranks 8 --json $O/vr-w8-t$t.json > $O/vr-w8-t$t.log 2>&1; echo "w8 t$t rc $?"; grep -E ' W 8 ' $O/vr-w8-t$t.log
done
step memcheck; timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.OneMultiTileForward' > $O/memcheck.log 2>&1; echo "memcheck rc $?"; tail -2 $O/memcheck.log
step racecheck; timeout 150 compute-sanitizer --tool racecheck $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.OneMultiTileForward' > $O/racecheck.log 2>&1; grep "RACECHECK SUMMARY" $O/racecheck.log
step done
tar czf /tmp/logs.tgz -C $O . && mv /tmp/logs.tgz $O/logs.tgz
