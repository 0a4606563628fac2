#!/usr/bin/env bash
# The GPU checks and measurements recorded in benchmarks/results/, in one run on one
# CUDA GPU (an H200 here). Usage: OUT=/some/dir bash benchmarks/h200_suite.sh [ENGINES...]
# Each step has a time limit so one slow step cannot eat the rest.
set -u
OUT=${OUT:-benchmarks/results}
ENGINES=${*:-03 04 05 06}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
step() { local limit=$1; shift; echo "=== $*"; timeout "$limit" "$@" 2>&1 | tail -n 40; }

step 240 python -m pytest -q -x tests/test_kernels.py tests/test_gpu.py -p no:cacheprovider
step 120 python benchmarks/kernel_bench.py --out "$OUT/kernel_bench_h200.json"
step 120 python -m benchmarks.decode_latency --engine 06 --shape qwen3-0.6b --out "$OUT/decode_latency_h200.json"
for e in $ENGINES; do
  step 200 python -m benchmarks.run --engine "$e" --workload nanovllm --shape qwen3-0.6b --device cuda \
    --dtype bfloat16 --out "$OUT/nanovllm_qwen3-0.6b_${e}_h200.json"
done
