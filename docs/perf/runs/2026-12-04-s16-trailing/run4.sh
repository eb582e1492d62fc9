#!/usr/bin/env bash
# Session 16, call 4: ncu of qwen3's down GEMM (RowsWT cooperative, no scale, no scatter), main's
# binary (aa09019) against trailing stores (5478ee3) at trail 2 and -1.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
k='regex:FormILNS0_8FormKindE1ELb0EEENS0_8epilogue8RowsBf16ILb0ELb0EEE'
for v in base t2 t-1 base2; do
  bin=$B/mok_gemm_bench; t=${v#t}
  case $v in base*) bin=base-bin/mok_gemm_bench; t=2;; esac
  echo "== $v"
  MOK_GEMM_TRAIL_BLOCKS=$t timeout 150 ncu --kernel-name-base mangled --kernel-name "$k" --launch-skip 3 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum,smsp__pcsamp_warps_issue_stalled_wait.sum \
    --csv --page details $bin $O/x-$v.jsonl 1 1 qwen3-30b-a3b > $O/ncu-$v.csv 2> $O/ncu-$v.err
  echo "rc $?"; grep -E '"Duration"|"Executed Instructions"|Warp Cycles Per Issued|"Issued Warp|No Eligible' $O/ncu-$v.csv | cut -c1-200 | head -12
done
MOK_GEMM_TRAIL_BLOCKS=2 timeout 150 ncu --kernel-name-base mangled --kernel-name "$k" --launch-skip 3 --launch-count 1 \
  --section SourceCounters --section WarpStateStats -o $O/t2 $B/mok_gemm_bench $O/y.jsonl 1 1 qwen3-30b-a3b > $O/rep-t2.log 2>&1
timeout 150 ncu --kernel-name-base mangled --kernel-name "$k" --launch-skip 3 --launch-count 1 \
  --section SourceCounters --section WarpStateStats -o $O/base base-bin/mok_gemm_bench $O/y.jsonl 1 1 qwen3-30b-a3b > $O/rep-base.log 2>&1
for v in t2 base; do
  ncu --import $O/$v.ncu-rep --page source --csv --print-source sass > $O/src-$v.csv 2> $O/src-$v.err; echo "src $v rc $? $(wc -l < $O/src-$v.csv)"
done
tar czf $OUT/logs.tgz -C $O .
