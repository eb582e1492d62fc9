#!/usr/bin/env bash
# Session 21, call 6: ncu on qwen3-30b-a3b's down dgrad with the SwiGLU backward and bf16(w h)
# (cooperative, main at 161d1d0, -lineinfo): speed of light, memory, warp states, stall samples
# per source line.
set -u
O=/tmp/o6; rm -rf $O; mkdir -p $O
export PATH=/usr/local/cuda/bin:$PATH
start=$SECONDS
cmake -S . -B /tmp/bn -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
  -DMOK_BUILD_PYTHON=OFF "-DCMAKE_CUDA_FLAGS=-lineinfo" > $O/conf.log 2>&1 && \
  cmake --build /tmp/bn -j 16 --target mok_gemm_bench > $O/build.log 2>&1
echo "build rc $? ($((SECONDS - start)) s)"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 150 $NCU --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SourceCounters --kernel-name-base mangled -k regex:SwigluBackwardILb1ELb1ELb0ELb1E -c 1 -o $O/dgrad \
  /tmp/bn/mok_gemm_bench $O/g.jsonl 1 1 qwen3-30b-a3b dgrad-swiglu-wh > $O/ncu.log 2>&1
echo "ncu rc $? ($((SECONDS - start)) s)"; tail -3 $O/ncu.log
$NCU -i $O/dgrad.ncu-rep --page details > $O/details.txt 2>&1
$NCU -i $O/dgrad.ncu-rep --page source --csv --print-source cuda,sass > $O/source.csv 2>&1
echo "export ($((SECONDS - start)) s)"; grep -E "Duration|DRAM Through|Memory Through|Compute \(SM\)|L2 Cache Through|SM Frequency" $O/details.txt | head
gzip -f $O/source.csv; rm -f $O/dgrad.ncu-rep
tar czf $OUT/logs.tgz -C $O .
