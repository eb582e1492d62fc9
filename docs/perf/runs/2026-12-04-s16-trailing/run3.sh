#!/usr/bin/env bash
# Session 16, call 3 (5478ee3): the GEMM forms with trailing stores against the direct timing and
# main's binary (aa09019), then scripts/gpu-fused's bench mode (the megakernel is main's code).
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH MOK_COMMIT=5478ee3
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $O/gpu.txt
for round in 1 2; do
  for v in t2 base t-1; do
    bin=$B/mok_gemm_bench; t=${v#t}
    [ $v = base ] && { bin=base-bin/mok_gemm_bench; t=2; }
    step "gemm bench $v round $round"
    MOK_GEMM_TRAIL_BLOCKS=$t timeout 200 $bin $O/gemm-$v-r$round.jsonl 20 2 > $O/gemm-$v-r$round.log 2>&1; echo "rc $?"
  done
done
step gpu-fused
mkdir -p build-gpu && cp $B/bench_virtual_ranks build-gpu/
scripts/gpu-fused $O/fused bench 2>&1 | tail -40
step done
tar czf $OUT/logs.tgz -C $O .
