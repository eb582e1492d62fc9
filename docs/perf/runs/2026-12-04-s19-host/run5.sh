#!/usr/bin/env bash
# Session 19, call 5: the host time of a layer call (s19/host_profile.py), after the README's
# pip install.
set -u
O=/tmp/o5; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
python3 -m pip install . --no-build-isolation > $O/pip.log 2>&1; echo "pip rc $? ($((SECONDS - start)) s)"
timeout 150 python3 s19/host_profile.py > $O/host.log 2>&1; echo "host rc $? ($((SECONDS - start)) s)"
grep -v Warning $O/host.log | cut -c1-150 | head -150
tar czf $OUT/logs.tgz -C $O .
