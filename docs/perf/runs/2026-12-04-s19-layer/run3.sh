#!/usr/bin/env bash
# Session 19, call 3: the README's path (pip install), then profile_layer.py (host time and the
# kernels of one call: the forward and backward dispatches among them) for qwen3-30b-a3b and
# dsv3-ep8slice, mok and mok-fused; then bench_layer.py's small suite (mok against torch).
set -u
O=/tmp/o3; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH MOK_COMMIT=${1:?commit}
start=$SECONDS
python3 -m pip uninstall -y mok > $O/pip_uninstall.log 2>&1
python3 -m pip install . --no-build-isolation > $O/pip.log 2>&1; echo "pip rc $? ($((SECONDS - start)) s)"
timeout 200 python3 bench/profile_layer.py --cases qwen3-30b-a3b,dsv3-ep8slice --impls mok,mok-fused,torch --out $O/profile > $O/profile.log 2>&1
echo "profile rc $? ($((SECONDS - start)) s)"
grep -v Warning $O/profile.log | head -150
timeout 200 python3 bench/bench_layer.py --suite small --out $O/layer_small.json > $O/small.log 2>&1
echo "small rc $? ($((SECONDS - start)) s)"; grep -v Warning $O/small.log | tail -16
tar czf $OUT/logs.tgz -C $O .
