#!/usr/bin/env bash
# Session 20, call 1 (branch s19-direct): the README's path (pip install . --no-build-isolation),
# the whole pytest suite against the installed package, then the direct/dispatched A/B.
set -u
O=/tmp/o1; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH MOK_COMMIT=${1:?commit}
root=$PWD; start=$SECONDS
unset PYTHONPATH
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
python3 -m pip install . --no-build-isolation > $O/pip.log 2>&1; echo "pip rc $? ($((SECONDS - start)) s)"
cd $O
timeout 420 python3 -m pytest $root/tests/python -v -rs -p no:cacheprovider --durations=20 --junitxml=$O/pytest.xml > $O/pytest.log 2>&1
echo "pytest rc $? ($((SECONDS - start)) s)"; grep -E "^(FAILED|ERROR)|passed|failed" $O/pytest.log | tail -8
grep -E "SKIPPED" $O/pytest.log | head -8
cd $root
left=$((590 - (SECONDS - start)))
timeout $left python3 s20/host_ab.py > $O/host_ab.log 2>&1; echo "host_ab rc $? ($((SECONDS - start)) s)"
grep -v Warning $O/host_ab.log | cut -c1-200
tar czf $OUT/logs.tgz -C $O .
