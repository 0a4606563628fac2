#!/usr/bin/env bash
# speed helper, device call 1: tests, kernel bench, step profiles, throughput, ladder 03-05, Qwen3-8B.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"
END=$((SECONDS + 575))
step() { local limit=$1; shift; local left=$((END - SECONDS)); [ $left -lt 20 ] && { echo "=== SKIP (no time): $*" | tee -a "$LOG"; return; }
  [ $limit -gt $left ] && limit=$left; echo "=== [$SECONDS s] $* (limit $limit s)" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" 2>&1 | grep -v "^USDT" | tee -a "$LOG" | tail -n 60; }
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee -a "$LOG"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$LOG"
step 90 python3 -c "from benchmarks.run import model_for_shape; print(model_for_shape('qwen3-0.6b', 'cuda'))"
step 100 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_gpu.py -k "fused or varlen or final or dispatch or rms or rotary or silu"
step 80 python3 benchmarks/final_kernels_bench.py --out "$OUT/final_kernels_h200.json"
step 100 python3 -m benchmarks.profile_steps --engine final --shape qwen3-0.6b --out "$OUT/profile_final_h200.json"
step 110 python3 -m benchmarks.run --engine 06 --engine final --workload nanovllm --shape qwen3-0.6b --device cuda --dtype bfloat16 --breakdown --out "$OUT/nanovllm_qwen3-0.6b_06_final_h200.json"
step 200 python3 -m benchmarks.run --engine final --workload nanovllm --shape qwen3-8b --device cuda --dtype bfloat16 --out "$OUT/nanovllm_qwen3-8b_final_h200.json"
step 80 python3 -m benchmarks.run --engine 03 --engine 04 --engine 05 --engine 05 --engine 04 --engine 03 --workload nanovllm --max-output-len 128 --shape qwen3-0.6b --device cuda --dtype bfloat16 --out "$OUT/ladder_03_05_short_h200.json"
echo "=== done at $SECONDS s" | tee -a "$LOG"
