#!/usr/bin/env bash
# The GPU checks and measurements recorded in benchmarks/results/, on one CUDA GPU (an
# H200 here). Usage:
#   OUT=dir ENGINES="final 05 04 03 02" bash benchmarks/h200_suite.sh [tests] [kernels] [latency] [throughput] \
#       [final-kernels] [profile] [hf] [8b]
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
    final-kernels)
      step 120 python benchmarks/final_kernels_bench.py --out "$OUT/final_kernels_h200.json" ;;
    profile)
      step 150 python -m benchmarks.profile_steps --engine final --shape qwen3-0.6b --out "$OUT/profile_final_h200.json" ;;
    hf)  # transformers' continuous batching is ~30x slower: a subset of the same requests
      step 240 python -m benchmarks.run --engine final --engine hf --workload nanovllm --num-seqs 64 --max-input-len 512 \
        --max-output-len 256 --shape qwen3-0.6b --device cuda --dtype bfloat16 --out "$OUT/hf_vs_final_qwen3-0.6b_h200.json" ;;
    8b)
      step 300 python -m benchmarks.run --engine final --workload nanovllm --shape qwen3-8b --device cuda --dtype bfloat16 \
        --out "$OUT/nanovllm_qwen3-8b_final_h200.json" ;;
    throughput)
      for e in $ENGINES; do
        extra=()
        [ "$e" = 02 ] && extra=(--option max_model_len=2048)  # a contiguous cache must fit 256 rows
        step 150 python -m benchmarks.run --engine "$e" --workload nanovllm --shape qwen3-0.6b --device cuda \
          --dtype bfloat16 "${extra[@]}" --out "$OUT/nanovllm_qwen3-0.6b_${e}_h200.json"
      done ;;
  esac
done
