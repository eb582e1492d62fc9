#!/usr/bin/env bash
# Session 21, call 5: the epilogue lead swept on qwen3-30b-a3b's down dgrad (main at 1a1eca3):
# builds of libmok_gemm + mok_gemm_bench with MOK_EPILOGUE_LEAD_BLOCKS = -1 (never: off), 1, 2, 3
# (the default), 4; the dgrad passes of mok_gemm_bench, variants rotating, 3 rounds.
set -u
O=/tmp/o5; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
for v in off L1 L2 L3 L4; do
  n=${v#L}; [ $v = off ] && n=-1
  (cmake -S . -B /tmp/b$v -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
     -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=-DMOK_EPILOGUE_LEAD_BLOCKS=$n" > $O/conf_$v.log 2>&1 && \
   cmake --build /tmp/b$v -j 3 --target mok_gemm_bench > $O/build_$v.log 2>&1; echo "$v rc $?" >> $O/builds.log) &
done
wait; cat $O/builds.log; echo "builds ($((SECONDS - start)) s)"
round=0
for order in "off L1 L2 L3 L4" "L4 L3 L2 L1 off" "L2 off L4 L1 L3"; do
  round=$((round + 1))
  for v in $order; do
    left=$((280 - (SECONDS - start))); [ $left -lt 15 ] && { echo "skip $v$round"; continue; }
    timeout $left /tmp/b$v/mok_gemm_bench $O/gemm_$v$round.jsonl 20 5 qwen3-30b-a3b \
      dgrad,dgrad-swiglu,dgrad-swiglu-wh > $O/bench_$v$round.log 2>&1
    echo "bench $v$round rc $? ($((SECONDS - start)) s)"
  done
done
tar czf $OUT/logs.tgz -C $O .
