#!/usr/bin/env bash
# Session 16, call 2: trailing stores in 8 parts (one K loop in the megakernel); tests, then A/B
# against the direct epilogue (MOK_GEMM_TRAIL_BLOCKS=-1) and main's binary (base-bin).
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
res() { if grep -qE '^\[  PASSED  \] [1-9]' "$1" && ! grep -q '^\[  FAILED  \]' "$1"; then echo "PASS $1"; else echo "FAIL $1"; tail -30 "$1"; fi; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $O/gpu.txt
step fused; timeout 120 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused.log 2>&1; res $O/fused.log
step layer; timeout 200 $B/tests/cpp/mok_layer_tests --gtest_filter='-LayerGpuFused.*' > $O/layer.log 2>&1; res $O/layer.log
step gemm; timeout 200 $B/tests/cpp/mok_gemm_tests > $O/gemm.log 2>&1; res $O/gemm.log
for t in -1 0 3; do step "fused t$t"; MOK_GEMM_TRAIL_BLOCKS=$t timeout 100 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused-t$t.log 2>&1; res $O/fused-t$t.log; done
step "gemm t-1"; MOK_GEMM_TRAIL_BLOCKS=-1 timeout 150 $B/tests/cpp/mok_gemm_tests > $O/gemm-t-1.log 2>&1; res $O/gemm-t-1.log
step bench
for c in qwen3-30b-a3b dsv3-ep8slice mixtral-8x7b dsv3-ep1; do
  for v in t2 t-1 base; do
    bin=$B/bench_virtual_ranks; t=${v#t}
    [ $v = base ] && { bin=base-bin/bench_virtual_ranks; t=2; }
    MOK_GEMM_TRAIL_BLOCKS=$t timeout 100 $bin --case $c --ranks 1 --reps 30 --dense --json $O/vr-$c-$v.json > $O/vr-$c-$v.log 2>&1; echo "$c $v rc $?"
    grep -E ' W 1 |x the dense' $O/vr-$c-$v.log
  done
done
for v in t2 base; do
  bin=$B/bench_virtual_ranks; [ $v = base ] && bin=base-bin/bench_virtual_ranks
  timeout 100 $bin --case dsv3-ep8slice --ranks 8 --json $O/vr-w8-$v.json > $O/vr-w8-$v.log 2>&1; echo "w8 $v rc $?"; grep -E ' W 8 ' $O/vr-w8-$v.log
done
step trace
timeout 100 $B/bench_virtual_ranks --case qwen3-30b-a3b --ranks 1 --reps 30 --trace --trace-out $O/trace --json $O/vr-qwen3-trace.json > $O/vr-qwen3-trace.log 2>&1; echo "trace rc $?"
step memcheck; timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.OneMultiTileForward' > $O/memcheck.log 2>&1; echo "memcheck rc $?"; tail -2 $O/memcheck.log
step racecheck; timeout 150 compute-sanitizer --tool racecheck $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.OneMultiTileForward' > $O/racecheck.log 2>&1; grep "RACECHECK SUMMARY" $O/racecheck.log
step done
tar czf $OUT/logs.tgz -C $O .
