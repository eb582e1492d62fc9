#!/usr/bin/env bash
# Session 22, call 2: the down forward's epilogue ceiling. Builds of mok_gemm_bench from s22/base
# (main) and s22/hack (docs/perf/runs/2026-12-04-s22-hold/call2/hack.diff against main): nostore (-DHACK_NOSTORE: the kRowsWT epilogue packs bf16 but stores
# nothing), st3 (-DHACK_ROWSWT_STAGES=3: the kRowsWT ring at 3 stages, as a 64 KiB staging tile
# would leave it), nostore+st3. gemm2 only, three cases, rotating A B C D D C B A.
set -u
O=/tmp/o2; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD; start=$SECONDS
conf() {  # dir src flags
  cmake -S $2 -B $1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=$3" > $O/conf_$(basename $1).log 2>&1
}
bld() { conf $1 $2 "$3" && cmake --build $1 -j 4 --target mok_gemm_bench > $O/build_$(basename $1).log 2>&1; echo "$1 rc $? ($((SECONDS - start)) s)" >> $O/builds.log; }
bld /tmp/bbase $root/s22/base "" &
bld /tmp/bnost $root/s22/hack (docs/perf/runs/2026-12-04-s22-hold/call2/hack.diff against main) "-DHACK_NOSTORE" &
bld /tmp/bst3 $root/s22/hack (docs/perf/runs/2026-12-04-s22-hold/call2/hack.diff against main) "-DHACK_ROWSWT_STAGES=3" &
bld /tmp/bboth $root/s22/hack (docs/perf/runs/2026-12-04-s22-hold/call2/hack.diff against main) "-DHACK_NOSTORE -DHACK_ROWSWT_STAGES=3" &
wait; cat $O/builds.log
declare -A B=([base]=/tmp/bbase [nost]=/tmp/bnost [st3]=/tmp/bst3 [both]=/tmp/bboth)
n=0
for v in base nost st3 both both st3 nost base; do
  n=$((n + 1)); left=$((560 - (SECONDS - start))); [ $left -lt 30 ] && { echo "skip $v$n"; continue; }
  timeout $left ${B[$v]}/mok_gemm_bench $O/gemm_$v$n.jsonl 20 5 qwen3-30b-a3b,dsv3-ep8slice,mixtral-8x7b \
    gemm2 > $O/bench_$v$n.log 2>&1
  echo "gemm $v$n rc $? ($((SECONDS - start)) s)"
done
tar czf $OUT/logs.tgz -C $O .
