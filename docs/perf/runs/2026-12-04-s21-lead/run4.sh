#!/usr/bin/env bash
# Session 21, call 4: the quick GPU suite at 1a1eca3 (branch s21-lead).
O=/tmp/o4; rm -rf $O; mkdir -p $O/suite
export PATH=/usr/local/cuda/bin:$PATH
MOK_SUITE_QUICK=1 MOK_BENCH=0 MOK_COMMIT=${1:?commit} timeout 575 scripts/gpu-suite $O/suite > $O/suite/run.log 2>&1
echo "suite rc $?"
tail -25 $O/suite/run.log
tar czf $OUT/logs.tgz -C $O .
