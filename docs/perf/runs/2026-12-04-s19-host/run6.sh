#!/usr/bin/env bash
# Session 19, call 6: the host time of a forward piece by piece (s19/host_split.py), after the README's
# pip install.
set -u
O=/tmp/o6; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
python3 -m pip install . --no-build-isolation > $O/pip.log 2>&1; echo "pip rc $? ($((SECONDS - start)) s)"
timeout 150 python3 s19/host_split.py > $O/split.log 2>&1; echo "split rc $? ($((SECONDS - start)) s)"
grep -v Warning $O/split.log | tail -30
tar czf $OUT/logs.tgz -C $O .
