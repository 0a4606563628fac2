#!/usr/bin/env bash
# The GPU checks and measurements recorded in benchmarks/results/, on one CUDA GPU (an
# H200 here). Usage:
#   OUT=dir ENGINES="final 05 04 03 02" bash benchmarks/h200_suite.sh [tests] [kernels] [latency] [throughput]
# Each step has a time limit so that one slow step cannot eat the rest.
set -u
OUT=${OUT:-benchmarks/results}
ENGINES=${ENGINES:-final 05 04 03 02}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
step() { local limit=$1; shift; echo "=== $*"; timeout "$limit" "$@" 2>&1 | tail -n 40; }

for part in ${*:-tests kernels latency throughput}; do
  case $part in
    tests)
      step 300 python -m pytest -q tests/test_kernels.py tests/test_gpu.py -p no:cacheprovider -k "${TESTS_K:-not nothing}" \
        | tee "$OUT/gpu_tests_h200.log" ;;
    kernels)
      step 120 python benchmarks/kernel_bench.py --out "$OUT/kernel_bench_h200.json" ;;
    latency)
      step 120 python -m benchmarks.decode_latency --engine 06 --shape qwen3-0.6b --out "$OUT/decode_latency_h200.json" ;;
    throughput)
      for e in $ENGINES; do
        extra=()
        [ "$e" = 02 ] && extra=(--option max_model_len=2048)  # a contiguous cache must fit 256 rows
        step 150 python -m benchmarks.run --engine "$e" --workload nanovllm --shape qwen3-0.6b --device cuda \
          --dtype bfloat16 "${extra[@]}" --out "$OUT/nanovllm_qwen3-0.6b_${e}_h200.json"
      done ;;
  esac
done
