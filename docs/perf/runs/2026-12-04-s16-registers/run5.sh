#!/usr/bin/env bash
# Session 16, call 5: the megakernel with Producer 56 / Consumers 224 registers (no Producer
# spills) against main's binary (aa09019), same call, alternating.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }
res() { if grep -qE '^\[  PASSED  \] [1-9]' "$1" && ! grep -q '^\[  FAILED  \]' "$1"; then echo "PASS $1"; else echo "FAIL $1"; tail -30 "$1"; fi; }
step fused; timeout 120 $B/tests/cpp/mok_layer_tests --gtest_filter='LayerGpuFused.*' > $O/fused.log 2>&1; res $O/fused.log
step bench
for round in 1 2; do
for c in qwen3-30b-a3b dsv3-ep8slice mixtral-8x7b dsv3-ep1; do
  for v in new base; do
    bin=$B/bench_virtual_ranks; [ $v = base ] && bin=base-bin/bench_virtual_ranks
    timeout 100 $bin --case $c --ranks 1 --reps 30 --dense --json $O/vr-$c-$v-r$round.json > $O/vr-$c-$v-r$round.log 2>&1; echo "$c $v r$round rc $?"
    grep -E ' W 1 |x the dense' $O/vr-$c-$v-r$round.log
  done
done
done
step trace
for v in new base; do
  bin=$B/bench_virtual_ranks; [ $v = base ] && bin=base-bin/bench_virtual_ranks
  timeout 100 $bin --case qwen3-30b-a3b --ranks 1 --reps 30 --trace --trace-out $O/trace-$v --json $O/tr-$v.json > $O/tr-$v.log 2>&1; echo "trace $v rc $?"
done
step done
tar czf $OUT/logs.tgz -C $O .
