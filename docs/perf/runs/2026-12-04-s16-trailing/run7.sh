#!/usr/bin/env bash
# Session 16, call 7: is the GEMM power-bound? Trailing stores v2 against main's binary under ncu,
# the SM clock locked at base (ncu's default) and free (--clock-control none), qwen3's down GEMM
# (RowsWT) and dgrad (RowsW), bf16 rows, no scale, no scatter; 3 launches each.
set -u
O=/tmp/o; mkdir -p $O; B=build-dev
export PATH=/usr/local/cuda/bin:$PATH
for form in 1 2; do
  k="regex:FormILNS0_8FormKindE${form}ELb0EEENS0_8epilogue8RowsBf16ILb0ELb0EEE"
  for cc in base none; do
    for v in v2 base; do
      bin=$B/mok_gemm_bench; [ $v = base ] && bin=base-bin/mok_gemm_bench
      timeout 100 ncu --kernel-name-base mangled --kernel-name "$k" --launch-skip 3 --launch-count 3 \
        --clock-control $cc --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum \
        --csv --page raw $bin $O/x.jsonl 1 1 qwen3-30b-a3b > $O/ncu-f$form-$cc-$v.csv 2> $O/ncu-f$form-$cc-$v.err
      echo "form $form clock $cc $v rc $?: $(grep -c '"' $O/ncu-f$form-$cc-$v.csv) lines"
    done
  done
done
tar czf $OUT/logs.tgz -C $O .
