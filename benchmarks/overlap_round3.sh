#!/usr/bin/env bash
# The third call of issue 9's overlap round (nvidia-h200-x2): the two tensor-parallel
# failure scenarios the second call's time limit cut off, then side by side the
# shared-prefix workload (stages 03, 04 and final: the prefix cache on a GPU) and the
# OpenAI server under 64 streaming clients, now with overlap scheduling. The server needs
# the wheels of pyproject's `serve` extra in .whl/ (see final_round.sh).
#   OUT=dir bash benchmarks/overlap_round3.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTEST=(python3 -m pytest -q -o "addopts=--import-mode=importlib -p no:cacheprovider" -rA)
step() { local limit=$1; shift; echo "=== $* ($(date +%T))"; timeout -k 5 "$limit" "$@" 2>&1 | tail -n 30; }

CUDA_VISIBLE_DEVICES=1 python3 -c "from benchmarks.run import model_for_shape; print(model_for_shape('qwen3-0.6b', 'cuda'))" > /dev/null 2>&1 &
timeout -k 5 120 "${PYTEST[@]}" -s tests/test_gpu_tp.py -k "final and (killed or exception)" > "$OUT/tp_gpu_failures_final_h200x2.log" 2>&1
tail -n 6 "$OUT/tp_gpu_failures_final_h200x2.log"
wait
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  step 150 python3 -m benchmarks.run --device cuda --dtype bfloat16 --engine 03 --engine 04 --engine final \
    --workload shared-prefix --shape qwen3-0.6b --out "$OUT/shared-prefix_qwen3-0.6b_h200.json"
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/site step 150 python3 -m benchmarks.serve_bench --shape qwen3-0.6b --num-seqs 256 --concurrency 64 \
    --out "$OUT/serve_qwen3-0.6b_h200.json"
}
gpu0 > "$OUT/round3_gpu0.log" 2>&1 &
gpu1 > "$OUT/round3_gpu1.log" 2>&1 &
wait
cat "$OUT/round3_gpu0.log" "$OUT/round3_gpu1.log"
echo "=== done $(date +%T)"
