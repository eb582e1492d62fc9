#!/usr/bin/env bash
# Session 17, call 1: the pull's lead and the down lag (env knobs), tests and a first sweep.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
res() { if grep -qE '^\[  PASSED  \] [1-9]' "$1" && ! grep -q '^\[  FAILED  \]' "$1"; then echo "PASS $1"; else echo "FAIL $1"; tail -30 "$1"; fi; }
step fused-default; timeout 150 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused-default.log 2>&1; res $O/fused-default.log
step fused-lead1-lag2; MOK_FUSED_PULL_LEAD=1 MOK_FUSED_LAG=2 timeout 150 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused-l1g2.log 2>&1; res $O/fused-l1g2.log
step bench
run() { # name case mb lead lag
  MOK_FUSED_PULL_LEAD=$4 MOK_FUSED_LAG=$5 timeout 100 $B/bench_virtual_ranks --case $2 --ranks 1 --reps 30 --queued --minibatch $3 --json $O/vr-$2-$1.json > $O/vr-$2-$1.log 2>&1
  echo "$2 $1 (mb $3 lead $4 lag $5) rc $? ($((SECONDS - start)) s)"; grep -E ' W 1 ' $O/vr-$2-$1.log
}
for c in qwen3-30b-a3b dsv3-ep8slice; do
  run base $c 4096 0 1
  run lead1 $c 4096 1 1
  run mb2k-lead1 $c 2048 1 1
  run mb1k-lead1-lag2 $c 1024 1 2
  run mb1k-lag2 $c 1024 0 2
  run base2 $c 4096 0 1
done
step done
tar czf $OUT/logs.tgz -C $O .
