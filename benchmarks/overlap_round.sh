#!/usr/bin/env bash
# One call on a two-GPU H200 machine (nvidia-h200-x2) for issue 9 after overlap scheduling:
# GPU 0 re-measures the stage ladder and the final engine on one workload (with per-step
# breakdowns), GPU 1 runs the final engine's GPU tests, its throughput variants, batch-1
# latency and the Llama-3.2-1B shape; then both GPUs run the tensor-parallel scenarios.
#   OUT=dir bash benchmarks/overlap_round.sh
# Every step has its own time limit; logs and JSON go to $OUT.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTEST=(python3 -m pytest -q -o "addopts=--import-mode=importlib -p no:cacheprovider" -rA)
step() { local limit=$1; shift; echo "=== $* ($(date +%T))"; timeout -k 5 "$limit" "$@" 2>&1 | tail -n 30; }
RUN=(python3 -m benchmarks.run --device cuda --dtype bfloat16)
TEMP_ONLY=(--sampling top_k=0 --sampling top_p=1.0)  # nano-vllm's sampling: temperature only
SMALL=(--num-seqs 32 --max-input-len 256 --max-output-len 256)  # a workload stage 01 and 02 get through

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# random weights, one shape per GPU, before anything reads them
CUDA_VISIBLE_DEVICES=0 step 120 python3 -c "from benchmarks.run import model_for_shape; print(model_for_shape('qwen3-0.6b', 'cuda'))" &
CUDA_VISIBLE_DEVICES=1 step 120 python3 -c "from benchmarks.run import model_for_shape; print(model_for_shape('llama-3.2-1b', 'cuda'))" &
wait

gpu0() {  # the ladder and final, one workload, one process per group, with breakdowns
  export CUDA_VISIBLE_DEVICES=0
  step 300 "${RUN[@]}" --engine 03 --engine 04 --engine 05 --engine 06 --engine 07 --workload nanovllm --shape qwen3-0.6b \
    --breakdown --out "$OUT/ladder_nanovllm_qwen3-0.6b_h200.json"
  step 90 "${RUN[@]}" --engine final "${TEMP_ONLY[@]}" --workload nanovllm --shape qwen3-0.6b --breakdown \
    --out "$OUT/ladder_nanovllm_qwen3-0.6b_final_temperature_h200.json"
  step 150 "${RUN[@]}" --engine 01 --engine 02 --engine 03 --workload nanovllm "${SMALL[@]}" --shape qwen3-0.6b --breakdown \
    --out "$OUT/ladder_small_qwen3-0.6b_h200.json"
  step 60 "${RUN[@]}" --engine final "${TEMP_ONLY[@]}" --workload nanovllm "${SMALL[@]}" --shape qwen3-0.6b --breakdown \
    --out "$OUT/ladder_small_qwen3-0.6b_final_temperature_h200.json"
}
gpu1() {  # the final engine: GPU tests, throughput (checkpoint sampling, overlap off), latency, Llama
  export CUDA_VISIBLE_DEVICES=1
  step 150 "${PYTEST[@]}" tests/test_gpu.py tests/test_fused_kernels.py -k "final or fused" -x
  step 90 "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-0.6b --breakdown \
    --out "$OUT/nanovllm_qwen3-0.6b_final_h200.json"
  step 60 "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-0.6b --option overlap_scheduling=false \
    --out "$OUT/nanovllm_qwen3-0.6b_final_no_overlap_h200.json"
  step 90 python3 -m benchmarks.decode_latency --engine final --shape qwen3-0.6b --batches 1 64 256 \
    --out "$OUT/decode_latency_final_h200.json"
  step 90 "${RUN[@]}" --engine final --workload nanovllm --shape llama-3.2-1b --breakdown \
    --out "$OUT/nanovllm_llama-3.2-1b_final_h200.json"
  step 60 "${RUN[@]}" --engine final "${TEMP_ONLY[@]}" --workload nanovllm --shape llama-3.2-1b \
    --out "$OUT/nanovllm_llama-3.2-1b_final_temperature_h200.json"
}
gpu0 > "$OUT/round_gpu0.log" 2>&1 &
gpu1 > "$OUT/round_gpu1.log" 2>&1 &
wait
cat "$OUT/round_gpu0.log" "$OUT/round_gpu1.log"
# both GPUs: shutdown, a dead worker, TP=2 == TP=1, now with the next step's tokens broadcast from rank 0
echo "=== tensor-parallel scenarios ($(date +%T))"
timeout -k 5 150 "${PYTEST[@]}" -s tests/test_gpu_tp.py -k final 2>&1 | tee "$OUT/tp_gpu_tests_final_h200x2.log" | tail -n 15
echo "=== done $(date +%T)"
