#!/usr/bin/env bash
# Session 24, call 2: the README's path (pip install), then bench_layer.py's standard suite whole
# (mok, mok-1pass, mok-2pass, mok-fused, torch) and its small suite, for docs/perf/layer.json and
# layer_small.json at the current library code (85a3bf9 / d191a1a's).
set -u
O=/tmp/o2; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH MOK_COMMIT=${1:?commit}
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $O/machine.log 2>&1
python3 -c "import torch, nanobind; print(torch.__version__, nanobind.__version__)" >> $O/machine.log 2>&1
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
python3 -m pip install . --no-build-isolation > $O/pip.log 2>&1; echo "pip rc $? ($((SECONDS - start)) s)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 > $O/smi.csv 2>&1 &
SMI=$!
timeout 330 python3 bench/bench_layer.py --impls mok,mok-1pass,mok-2pass,mok-fused,torch --out $O/layer.json > $O/bench.log 2>&1
echo "bench_layer rc $? ($((SECONDS - start)) s)"
left=$((585 - (SECONDS - start)))
timeout $left python3 bench/bench_layer.py --suite small --out $O/layer_small.json > $O/small.log 2>&1
echo "small rc $? ($((SECONDS - start)) s)"
kill $SMI; gzip -f $O/smi.csv
grep -v Warning $O/bench.log | tail -24
grep -v Warning $O/small.log | tail -14
tar czf $OUT/logs.tgz -C $O .
