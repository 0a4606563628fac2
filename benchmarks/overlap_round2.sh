#!/usr/bin/env bash
# The second call of issue 9's overlap round (nvidia-h200-x2): what the first call's time
# limit cut off (stage 07 and stages 02/03 on the small workload, the GPU tests, the
# tensor-parallel scenarios), the final engine with the softmax-free temperature-only
# sampler, and the Qwen3-8B shape on one GPU. At most 8 files come back from a device
# call, so the records are packed into $OUT/round2.tgz.
#   OUT=dir bash benchmarks/overlap_round2.sh
set -u
OUT=${OUT:-benchmarks/results}
W=/tmp/round2; mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTEST=(python3 -m pytest -q -o "addopts=--import-mode=importlib -p no:cacheprovider" -rA)
step() { local limit=$1; shift; echo "=== $* ($(date +%T))"; timeout -k 5 "$limit" "$@" 2>&1 | tail -n 30; }
RUN=(python3 -m benchmarks.run --device cuda --dtype bfloat16)
TEMP_ONLY=(--sampling top_k=0 --sampling top_p=1.0)
SMALL=(--num-seqs 32 --max-input-len 256 --max-output-len 256)

CUDA_VISIBLE_DEVICES=1 step 120 python3 -c "from benchmarks.run import model_for_shape; print(model_for_shape('qwen3-0.6b', 'cuda'))"
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  step 90 "${RUN[@]}" --engine final "${TEMP_ONLY[@]}" --workload nanovllm --shape qwen3-0.6b --breakdown \
    --out "$W/ladder_nanovllm_qwen3-0.6b_final_temperature_h200.json"
  step 240 "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-8b --out "$W/nanovllm_qwen3-8b_final_h200.json"
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  step 150 "${PYTEST[@]}" tests/test_gpu.py tests/test_fused_kernels.py -k "final or fused"
  step 90 "${RUN[@]}" --engine 07 --workload nanovllm --shape qwen3-0.6b --breakdown --out "$W/ladder_nanovllm_qwen3-0.6b_07_h200.json"
  step 150 "${RUN[@]}" --engine 02 --engine 03 --workload nanovllm "${SMALL[@]}" --shape qwen3-0.6b --breakdown \
    --out "$W/ladder_small_qwen3-0.6b_02_03_h200.json"
}
gpu0 > "$W/round2_gpu0.log" 2>&1 &
gpu1 > "$W/round2_gpu1.log" 2>&1 &
wait
cat "$W/round2_gpu0.log" "$W/round2_gpu1.log"
echo "=== tensor-parallel scenarios ($(date +%T))"
timeout -k 5 150 "${PYTEST[@]}" -s tests/test_gpu_tp.py -k final > "$W/tp_gpu_tests_final_h200x2.log" 2>&1
tail -n 15 "$W/tp_gpu_tests_final_h200x2.log"
tar czf "$OUT/round2.tgz" -C "$W" .
echo "=== done $(date +%T)"
