#!/usr/bin/env bash
# Session 24, call 1: patches/engine-dense-bench.patch applied (s24/eng): mok's dense GEMM engine
# beside cuBLAS's 8192^3 at the power limit; qwen3-30b-a3b with the automatic consumer schedule,
# then with MOK_GEMM_CONSUMERS=cooperative and ping_pong (the layer and the dense engine both).
set -u
O=/tmp/o1; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $O/machine.log 2>&1
cmake -S $root/s24/eng -B /tmp/beng -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
  -DMOK_BUILD_PYTHON=OFF > $O/conf.log 2>&1 &&
cmake --build /tmp/beng -j 16 --target bench_virtual_ranks > $O/build.log 2>&1
echo "build rc $? ($((SECONDS - start)) s)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $O/smi.csv 2>&1 &
SMI=$!
for sched in automatic cooperative ping_pong automatic; do
  [ $((SECONDS - start)) -lt 420 ] || { echo "no time for $sched"; continue; }
  MOK_GEMM_CONSUMERS=$sched timeout 70 /tmp/beng/bench_virtual_ranks --case qwen3-30b-a3b --ranks 1 --reps 30 \
    --dense --solo 6 --json $O/solo-$sched-$SECONDS.json > $O/solo-$sched-$SECONDS.log 2>&1
  echo "solo $sched rc $? ($((SECONDS - start)) s)"
done
kill $SMI
for f in $O/solo-*.log; do echo "## $f"; grep -E "solo |dense bf16|x the dense" $f; python3 $root/s24/eng/bench/solo_power.py $O/smi.csv $f > ${f%.log}.power.txt 2>&1; cat ${f%.log}.power.txt | head -20; done
gzip -f $O/smi.csv
tar czf $OUT/logs.tgz -C $O .
