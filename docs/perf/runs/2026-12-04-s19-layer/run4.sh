#!/usr/bin/env bash
# Session 19, call 4: bench_layer.py's standard suite whole, every implementation in one run
# (mok, mok-1pass, mok-2pass, mok-fused, torch), for docs/perf/layer.json.
set -u
O=/tmp/o4; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH MOK_COMMIT=${1:?commit}
start=$SECONDS
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
python3 -m pip install . --no-build-isolation > $O/pip.log 2>&1; echo "pip rc $? ($((SECONDS - start)) s)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 50 > $O/smi.csv 2>&1 &
SMI=$!
timeout $((560 - (SECONDS - start))) python3 bench/bench_layer.py --impls mok,mok-1pass,mok-2pass,mok-fused,torch --out $O/layer.json > $O/bench.log 2>&1
echo "bench_layer rc $? ($((SECONDS - start)) s)"
kill $SMI; gzip -f $O/smi.csv
grep -v Warning $O/bench.log | tail -24
tar czf $OUT/logs.tgz -C $O .
