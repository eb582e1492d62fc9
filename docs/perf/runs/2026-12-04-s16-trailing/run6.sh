#!/usr/bin/env bash
# Session 16, call 6: trailing stores v2 (two K blocks in flight under each part, one call site,
# bounds from the pack) on the launches; GEMM tests, LayerGpuFused, then the GEMM bench against
# main's binary (aa09019), alternating twice.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
res() { if grep -qE '^\[  PASSED  \] [1-9]' "$1" && ! grep -q '^\[  FAILED  \]' "$1"; then echo "PASS $1"; else echo "FAIL $1"; tail -30 "$1"; fi; }
step gemm; timeout 200 $B/tests/cpp/mok_gemm_tests > $O/gemm.log 2>&1; res $O/gemm.log
step "gemm t-1"; MOK_GEMM_TRAIL_BLOCKS=-1 timeout 200 $B/tests/cpp/mok_gemm_tests > $O/gemm-t-1.log 2>&1; res $O/gemm-t-1.log
step fused; timeout 120 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused.log 2>&1; res $O/fused.log
for round in 1 2; do
  for v in v2 base; do
    bin=$B/mok_gemm_bench; [ $v = base ] && bin=base-bin/mok_gemm_bench
    step "gemm bench $v round $round"
    timeout 200 $bin $O/gemm-$v-r$round.jsonl 20 2 > $O/gemm-$v-r$round.log 2>&1; echo "rc $?"
  done
done
step done
tar czf $OUT/logs.tgz -C $O .
