#!/usr/bin/env bash
# The speed helper's second GPU round (one H200): fused-kernel tests, throughput with a
# per-step breakdown, 03 vs 05 interleaved, a step profile of final, and Hugging Face
# continuous batching on a small subset. Writes to $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"
END=$((SECONDS + ${BUDGET_S:-300}))
step() { local limit=$1; shift; local left=$((END - SECONDS)); [ $left -lt 20 ] && { echo "=== SKIP (no time): $*" | tee -a "$LOG"; return; }
  [ $limit -gt $left ] && limit=$left; echo "=== [$SECONDS s] $* (limit $limit s)" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" 2>&1 | grep -v "^USDT" | tee -a "$LOG" | tail -n 40; }
Q=(--shape qwen3-0.6b --device cuda --dtype bfloat16)
step 60 python3 -c "from benchmarks.run import model_for_shape; print(model_for_shape('qwen3-0.6b', 'cuda'))"
step 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py
step 60 python3 -m benchmarks.run --engine final --workload nanovllm "${Q[@]}" --breakdown --out "$OUT/nanovllm_qwen3-0.6b_final_h200.json"
step 40 python3 -m benchmarks.run --engine 03 --engine 05 --engine 05 --engine 03 --workload nanovllm --max-output-len 128 "${Q[@]}" --out "$OUT/ladder_03_05_short_h200.json"
step 30 python3 -m benchmarks.profile_steps --engine final --variant fused --shape qwen3-0.6b --out "$OUT/profile_final_h200.json"
step 60 python3 -m benchmarks.run --engine final --engine hf --workload nanovllm --num-seqs 32 --max-input-len 256 --max-output-len 128 "${Q[@]}" --out "$OUT/hf_vs_final_qwen3-0.6b_h200.json"
echo "=== done at $SECONDS s" | tee -a "$LOG"
