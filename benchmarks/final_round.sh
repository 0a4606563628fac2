#!/usr/bin/env bash
# One call on a two-GPU H200 machine (nvidia-h200-x2) that checks and measures the merged
# final engine: single-GPU jobs run side by side on GPU 0 and GPU 1, then the two-GPU
# tensor-parallel scenarios. Every step has its own time limit; logs and JSON go to $OUT.
#   OUT=dir bash benchmarks/final_round.sh
# The server bench needs fastapi, uvicorn and pydantic; a machine without them (and without
# internet) gets them as wheels in .whl/, downloaded beforehand with `pip download --no-deps
# --python-version 3.12 ... -d .whl fastapi starlette pydantic pydantic-core annotated-types
# typing-inspection uvicorn opentelemetry-api typing-extensions` (versions: pyproject's `serve` extra).
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTEST=(python3 -m pytest -q -o "addopts=--import-mode=importlib -p no:cacheprovider" -rA)
step() { local limit=$1; shift; echo "=== $* ($(date +%T))"; timeout -k 5 "$limit" "$@" 2>&1 | tail -n 25; }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step 120 python3 -m tools.tiny_model .models/qwen3-0.6b --arch qwen3 --shape qwen3-0.6b --if-missing

gpu0() {  # throughput, batch-1 latency, the server
  export CUDA_VISIBLE_DEVICES=0
  step 150 python3 -m benchmarks.run --engine final --workload nanovllm --shape qwen3-0.6b --device cuda \
    --dtype bfloat16 --out "$OUT/nanovllm_qwen3-0.6b_final_h200.json"
  step 90 python3 -m benchmarks.decode_latency --engine final --shape qwen3-0.6b --batches 1 8 64 256 \
    --out "$OUT/decode_latency_final_h200.json"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/site step 150 python3 -m benchmarks.serve_bench --shape qwen3-0.6b --num-seqs 256 --concurrency 64 \
    --out "$OUT/serve_qwen3-0.6b_h200.json"
}
gpu1() {  # GPU tests of the final engine, then HF transformers vs final on the same requests
  export CUDA_VISIBLE_DEVICES=1
  step 150 "${PYTEST[@]}" tests/test_gpu.py tests/test_fused_kernels.py -k "final or fused" -x
  step 180 python3 -m benchmarks.run --engine final --engine hf --workload nanovllm --num-seqs 64 --max-input-len 512 \
    --max-output-len 256 --shape qwen3-0.6b --device cuda --dtype bfloat16 --out "$OUT/hf_vs_final_qwen3-0.6b_h200.json"
}
gpu0 > "$OUT/round_gpu0.log" 2>&1 &
gpu1 > "$OUT/round_gpu1.log" 2>&1 &
wait
cat "$OUT/round_gpu0.log" "$OUT/round_gpu1.log"
# both GPUs: tensor-parallel shutdown, dead worker, TP=2 == TP=1 (final engine)
echo "=== tensor-parallel scenarios ($(date +%T))"
timeout -k 5 240 "${PYTEST[@]}" -s tests/test_gpu_tp.py -k final 2>&1 | tee "$OUT/tp_gpu_tests_final_h200x2.log"
echo "=== done $(date +%T)"
