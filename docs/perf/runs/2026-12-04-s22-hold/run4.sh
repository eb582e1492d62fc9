#!/usr/bin/env bash
# Session 22, call 4: the quick GPU suite at the held-rows commit (branch s22-hold).
O=/tmp/o4; rm -rf $O; mkdir -p $O/suite
export PATH=/usr/local/cuda/bin:$PATH
MOK_SUITE_QUICK=1 MOK_BENCH=0 MOK_COMMIT=${1:?commit} timeout 575 scripts/gpu-suite $O/suite > $O/suite/run.log 2>&1
echo "suite rc $?"
tail -25 $O/suite/run.log
tar czf $OUT/logs.tgz -C $O .
