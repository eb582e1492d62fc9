#!/usr/bin/env bash
# Short: a wheel built off the device (cp312, sm_90a, from this tree), then the GPU checks of the FP8 cache fix.
set -uo pipefail
root=$(pwd); t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install --no-deps --no-index --force-reinstall .whl/mok-*.whl > $OUT/pip.log 2>&1; echo "pip rc=$? at $(el)s" | tee -a $OUT/steps.txt
cd /tmp && unset PYTHONPATH
timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $root/docs/perf/runs/2026-12-07-d753b00-h100/stale_gpu.py --suite fsdp --seed 11 --device cuda > $OUT/stale_gpu.log 2>&1; echo "stale_gpu rc=$? (expected 1) at $(el)s" | tee -a $OUT/steps.txt
timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $root/tests/python/fsdp_worker.py --suite fsdp --seed 11 --device cuda > $OUT/fixed_gpu.log 2>&1; echo "fixed_gpu rc=$? at $(el)s" | tee -a $OUT/steps.txt
left=$(( 140 - $(el) ))
timeout $left python3 -m pytest -q -rs -p no:cacheprovider $root/tests/python/test_training_setups.py $root/tests/python/test_fp8_layer.py $root/tests/python/test_hf_integration.py -k '(cuda or gpu) and (checkpointing or autocast or another_tensor or once_per or wrappers or requantizes)' > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $(el)s" | tee -a $OUT/steps.txt
tail -3 $OUT/pytest.log; grep -E '^(FAILED|ERROR)' $OUT/pytest.log | head; grep -E '^\[rank|output: not bit' $OUT/stale_gpu.log | head -4; grep -E '^\[rank' $OUT/fixed_gpu.log
