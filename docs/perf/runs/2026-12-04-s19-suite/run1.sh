#!/usr/bin/env bash
# Session 19, call 1: the GPU suite (quick, pip install + pytest) on the review's changes, then
# bench_dispatch (the dispatch kernels in both orders, forward x and backward d_out).
set -u
O=/tmp/o1; rm -rf $O; mkdir -p $O/suite
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
MOK_SUITE_QUICK=1 MOK_BENCH=0 MOK_COMMIT=${1:?commit} timeout 500 scripts/gpu-suite $O/suite > $O/suite/run.log 2>&1 || true
tail -1 $O/suite/run.log; echo "suite done ($((SECONDS - start)) s)"
grep -hE "^\[  (PASSED|FAILED) |tests ran" $O/suite/mok_layer_tests.log $O/suite/mok_schedule_tests.log | head -8
tail -1 $O/suite/pytest.log
timeout 70 build-gpu/bench_dispatch --reps 40 --commit $1 --json $O/dispatch.json > $O/dispatch.log 2>&1; echo "bench_dispatch rc $? ($((SECONDS - start)) s)"
cat $O/dispatch.log
tar czf $OUT/logs.tgz -C $O .
