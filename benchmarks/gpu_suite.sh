#!/usr/bin/env bash
# The GPU checks and measurements recorded in benchmarks/results/, as named parts. Each part
# writes its JSON record (or its log) under $OUT with the name benchmarks/results/README.md
# lists; run the parts you need:
#
#   bash benchmarks/gpu_suite.sh [options] PART...
#
# options (each also read from the environment variable in brackets):
#   --out DIR          where records and logs go (OUT; default benchmarks/results)
#   --engines "..."    engines of the ladder parts (ENGINES; default "03 04 05 06 07 final")
#   --shapes "..."     model shapes of throughput and tp (SHAPES; default qwen3-0.6b)
#   --tp "..."         tensor-parallel sizes of the tp part (TP_SIZES; default "1 2")
#   --tag NAME         the machine in the file names (TAG; default h200, tp parts h200x2)
#   --limit S          seconds a step may take before it is stopped (LIMIT; default 300)
#
# parts (one GPU unless named; the records' names use the tag):
#   tests          GPU kernel tests and tests/test_gpu.py for every engine -> gpu_tests_TAG.log
#   final-tests    the final engine's GPU tests: CUDA graphs, fp8 cache, fused, MoE and attention kernels, test_gpu.py,
#                  the sampler's top_candidates on CUDA, the kernels' tuning
#                  -> gpu_tests_final_TAG.log
#   tune           python -m nanovllm_final.tune: this GPU's kernel tiles -> nanovllm_final/kernels/configs/<GPU>.json
#                  (in the tree, to commit), its log -> kernel_tune_TAG.log
#   tp-tests       tests/test_gpu_tp.py, stage 07 and final (2 GPUs) -> tp_gpu_tests_{07,final}_TAGx2.log
#   kernels        attention kernels against torch -> kernel_bench_TAG.json
#   final-kernels  final's fused kernels, prefill attention tile choices -> final_kernels_TAG.json
#   sampler        the sampler's top-k candidates pass, PyTorch ops against the fused kernels
#                  -> sampler_candidates_TAG.json; its draws as the engine calls them -> sampler_draws_TAG.json
#   gemv           the dense projections of a decode step at one and two rows: the matrix-vector kernels' tiles
#                  against cuBLAS -> gemv_tiles_TAG.json
#   decode-attention  final's paged decode attention on the workload's context mix, bf16 and fp8 caches
#                  -> decode_attention_qwen3-0.6b_TAG.json, decode_attention_fp8-kv_qwen3-0.6b_TAG.json; the kernel as a
#                  decode step calls it (new K/V stored, RoPE applied) per tile choice -> decode_tiles_qwen3-0.6b_TAG.json,
#                  decode_tiles_fp8-kv_qwen3-0.6b_TAG.json, decode_tiles_llama-3.2-1b_TAG.json, and with every block
#                  at a random place -> variants/decode_tiles_shuffled-blocks_llama-3.2-1b_TAG.json
#   fp8-attention  attention over an fp8 cache: e4m3 tensor-core products (P·V in e4m3 or V widened, q's scale
#                  per head or per tensor) against widening the tiles: errors, decode and prefill times
#                  -> fp8_attention_TAG.json
#   latency        decode-step latency with and without CUDA graphs, 06 and final
#                  -> decode_latency_qwen3-0.6b_{06,final}_TAG.json; the final engine's graph steps with
#                  the dense matrix-vector path up to 0, 2 and 4 rows -> dense_gemv_decode_latency_qwen3-0.6b_TAG.json
#   throughput     nano-vllm's workload for each engine and shape, temperature only
#                  -> nanovllm_SHAPE_ENGINE_TAG.json
#   checkpoint     the checkpoint's sampling defaults: stage 06 then final in one process, final with an fp8 KV
#                  cache, final with overlap on and off -> nanovllm-checkpoint-sampling_qwen3-0.6b_06_final_TAG.json,
#                  nanovllm-checkpoint-sampling-fp8-kv_qwen3-0.6b_final_TAG.json,
#                  nanovllm-checkpoint-sampling_qwen3-0.6b_final_TAG.json, variants/..._no_overlap_TAG.json
#   fp8-pair       the fp8 cache's workload with e4m3 tensor-core attention and with widened tiles, in turns (0 1 0 1)
#                  -> variants/nanovllm-checkpoint-sampling-fp8-kv_fp8-products-vs-widening_qwen3-0.6b_final_TAG.json
#   breakdown      per-step breakdowns (--breakdown) of 06, 03 and of final on Llama-3.2-1B -> variants/
#   small          the smaller workload stages 01 and 02 get through -> small-nanovllm_qwen3-0.6b_*_TAG.json
#   short          03/04/05 interleaved in one process, 128 output tokens -> variants/nanovllm-short_*_TAG.json
#   shared-prefix  03, 04 and final on prompts sharing a prefix -> shared-prefix_qwen3-0.6b_03_04_final_TAG.json
#   hf             final and Hugging Face transformers' continuous batching on 64 requests -> hf_vs_final_qwen3-0.6b_TAG.json
#   serve          the OpenAI server under 1, 16, 64, 128 and 256 streaming clients (max_num_seqs = clients), then
#                  the offline engine on the same requests, each run at most 240 s (about two minutes each on an H200:
#                  two engines start, the server's and the offline one) -> serve_qwen3-0.6b_c{1,16,64,128,256}_TAG.json
#   kv-quality     kv_cache_dtype fp8 against auto: agreement, logprobs, blocks -> kv_cache_quality_TAG.json
#   moe            one Qwen3-30B-A3B MoE layer fused vs the expert loop; the 30B-A3B shape's workload and batch-1
#                  decode (its ~61 GB of random weights go to .models: make it a link to /dev/shm on a small disk)
#                  -> moe_layer_qwen3-30b-a3b_TAG.json, nanovllm_qwen3-30b-a3b_final_TAG.json, decode_latency_qwen3-30b-a3b_final_TAG.json
#   tp-message     host cost of the per-step message to each worker -> tp_message_cost_TAGx2.json
#   tp             stage 07 at each TP size on each shape (2 GPUs) -> tp_SHAPE_tpN_TAGx2.json, tp_speedup_TAGx2.json
#
# Random weights of each shape are drawn once into .models/SHAPE (tools.tiny_model). The serve
# part needs pyproject's `serve` extra. NVLink multicast stays off: it can take a shared
# host's GPUs out of service.
set -u
OUT=${OUT:-benchmarks/results}
ENGINES=${ENGINES:-03 04 05 06 07 final}
SHAPES=${SHAPES:-qwen3-0.6b}
TP_SIZES=${TP_SIZES:-1 2}
TAG=${TAG:-h200}
LIMIT=${LIMIT:-300}
parts=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --engines) ENGINES=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --tp) TP_SIZES=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --limit) LIMIT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    *) parts+=("$1"); shift ;;
  esac
done
[ ${#parts[@]} -gt 0 ] || { echo "name at least one part (see --help)" >&2; exit 2; }
mkdir -p "$OUT/variants"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rA)
RUN=("$PY" -m benchmarks.run --device cuda --dtype bfloat16)
TEMP_ONLY=(--sampling top_k=0 --sampling top_p=1.0)  # nano-vllm's sampling: temperature only
SMALL=(--num-seqs 32 --max-input-len 256 --max-output-len 256)
status=0
step() { echo "=== $*"; timeout -k 10 "$LIMIT" "$@"; local rc=$?; [ $rc -ne 0 ] && { echo "=== exit $rc"; status=1; }; return 0; }
logged() { local log=$1; shift; step "$@" > "$log" 2>&1; tail -n 30 "$log"; }  # a step whose output is the record

for part in "${parts[@]}"; do
  case $part in
    tests)
      logged "$OUT/gpu_tests_$TAG.log" "${PYTEST[@]}" tests/test_kernels.py tests/test_gpu.py ;;
    final-tests)
      logged "$OUT/gpu_tests_final_$TAG.log" "${PYTEST[@]}" -n 4 tests/test_final_cuda_graphs.py tests/test_kv_fp8.py tests/test_fused_kernels.py \
        tests/test_moe_kernels.py tests/test_moe.py::test_final_on_cuda_fused_experts_in_cuda_graphs tests/test_kernels.py \
        tests/test_gpu.py tests/test_final_sampling.py::test_top_candidates_are_the_top_k tests/test_step_input.py \
        tests/test_kernel_tuning.py tests/test_speculative.py::test_cuda_graphs_replay_verify_steps \
        -k "not (test_gpu and not final)" ;;
    tp-tests)
      for e in 07 final; do logged "$OUT/tp_gpu_tests_${e}_${TAG}x2.log" "${PYTEST[@]}" -s tests/test_gpu_tp.py -k "$e"; done ;;
    tune)
      LIMIT=$((LIMIT > 600 ? LIMIT : 600)) logged "$OUT/kernel_tune_$TAG.log" "$PY" -m nanovllm_final.tune ;;
    kernels)
      step "$PY" benchmarks/kernel_bench.py --out "$OUT/kernel_bench_$TAG.json" ;;
    final-kernels)
      step "$PY" benchmarks/final_kernels_bench.py --out "$OUT/final_kernels_$TAG.json" ;;
    gemv)
      step "$PY" -m benchmarks.gemv_bench --out "$OUT/gemv_tiles_$TAG.json" ;;
    fp8-attention)
      step "$PY" benchmarks/fp8_attention_bench.py --out "$OUT/fp8_attention_$TAG.json" ;;
    decode-attention)
      step "$PY" benchmarks/decode_attention_bench.py --out "$OUT/decode_attention_qwen3-0.6b_$TAG.json"
      step "$PY" benchmarks/decode_attention_bench.py --kv-cache-dtype fp8 --out "$OUT/decode_attention_fp8-kv_qwen3-0.6b_$TAG.json"
      step "$PY" benchmarks/decode_tiles_bench.py --shape qwen3-0.6b --out "$OUT/decode_tiles_qwen3-0.6b_$TAG.json"
      step "$PY" benchmarks/decode_tiles_bench.py --shape qwen3-0.6b --kv-cache-dtype fp8 --out "$OUT/decode_tiles_fp8-kv_qwen3-0.6b_$TAG.json"
      step "$PY" benchmarks/decode_tiles_bench.py --shape llama-3.2-1b --out "$OUT/decode_tiles_llama-3.2-1b_$TAG.json"
      step "$PY" benchmarks/decode_tiles_bench.py --shape llama-3.2-1b --layout shuffled \
        --out "$OUT/variants/decode_tiles_shuffled-blocks_llama-3.2-1b_$TAG.json" ;;
    latency)
      for e in 06 final; do
        step "$PY" -m benchmarks.decode_latency --engine $e --shape qwen3-0.6b --batches 1 8 64 256 \
          --out "$OUT/decode_latency_qwen3-0.6b_${e}_$TAG.json"
      done
      step "$PY" -m benchmarks.decode_latency --engine final --shape qwen3-0.6b --gemv-rows 0 2 4 --batches 1 2 4 \
        --out "$OUT/dense_gemv_decode_latency_qwen3-0.6b_$TAG.json" ;;
    throughput)
      for shape in $SHAPES; do
        for e in $ENGINES; do
          extra=()
          case $e in
            final) extra=("${TEMP_ONLY[@]}" --breakdown) ;;
            07) extra=(--breakdown) ;;
            02) extra=(--option max_model_len=2048) ;;  # a contiguous cache must fit 256 rows
          esac
          step "${RUN[@]}" --engine "$e" "${extra[@]}" --workload nanovllm --shape "$shape" --out "$OUT/nanovllm_${shape}_${e}_$TAG.json"
        done
      done ;;
    sampler)
      step "$PY" benchmarks/sampler_bench.py --out "$OUT/sampler_candidates_$TAG.json"
      step "$PY" benchmarks/sampler_draws_bench.py --out "$OUT/sampler_draws_$TAG.json" ;;
    checkpoint)
      step "${RUN[@]}" --engine 06 --engine final --workload nanovllm --shape qwen3-0.6b --breakdown \
        --out "$OUT/nanovllm-checkpoint-sampling_qwen3-0.6b_06_final_$TAG.json"
      step "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-0.6b --option kv_cache_dtype=fp8 --breakdown \
        --out "$OUT/nanovllm-checkpoint-sampling-fp8-kv_qwen3-0.6b_final_$TAG.json"
      step "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-0.6b --breakdown \
        --out "$OUT/nanovllm-checkpoint-sampling_qwen3-0.6b_final_$TAG.json"
      step "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-0.6b --option overlap_scheduling=false \
        --out "$OUT/variants/nanovllm-checkpoint-sampling_qwen3-0.6b_final_no_overlap_$TAG.json" ;;
    fp8-pair)  # the fp8 cache's attention both ways in turns: NANOVLLM_FP8_DOT=0 widens K and V (the default), 1 multiplies in e4m3
      pair=$(mktemp -d)
      for dot in 0 1 0 1; do
        NANOVLLM_FP8_DOT=$dot step "${RUN[@]}" --engine final --workload nanovllm --shape qwen3-0.6b --option kv_cache_dtype=fp8 \
          --breakdown --out "$pair/$dot-$RANDOM.json"
      done
      step "$PY" -m benchmarks.results join --out "$OUT/variants/nanovllm-checkpoint-sampling-fp8-kv_fp8-products-vs-widening_qwen3-0.6b_final_$TAG.json" \
        $(ls -tr "$pair"/*.json) ;;
    breakdown)
      step "${RUN[@]}" --engine 06 --engine 03 --workload nanovllm --shape qwen3-0.6b --breakdown \
        --out "$OUT/variants/nanovllm_qwen3-0.6b_06_03_breakdown_$TAG.json"
      step "${RUN[@]}" --engine final --workload nanovllm --shape llama-3.2-1b --breakdown \
        --out "$OUT/variants/nanovllm_llama-3.2-1b_final_breakdown_$TAG.json" ;;
    small)
      step "${RUN[@]}" --engine 02 --engine 03 --workload nanovllm "${SMALL[@]}" --shape qwen3-0.6b --breakdown \
        --out "$OUT/small-nanovllm_qwen3-0.6b_02_03_$TAG.json"
      step "${RUN[@]}" --engine final "${TEMP_ONLY[@]}" --workload nanovllm "${SMALL[@]}" --shape qwen3-0.6b --breakdown \
        --out "$OUT/small-nanovllm_qwen3-0.6b_final_$TAG.json" ;;
    short)
      step "${RUN[@]}" --engine 03 --engine 04 --engine 05 --engine 05 --engine 04 --engine 03 --workload nanovllm \
        --max-output-len 128 --shape qwen3-0.6b --out "$OUT/variants/nanovllm-short_qwen3-0.6b_03_04_05_05_04_03_$TAG.json" ;;
    shared-prefix)
      step "${RUN[@]}" --engine 03 --engine 04 --engine final --workload shared-prefix --shape qwen3-0.6b \
        --out "$OUT/shared-prefix_qwen3-0.6b_03_04_final_$TAG.json" ;;
    hf)  # transformers' continuous batching is ~20x slower: a subset of the same requests
      step "${RUN[@]}" --engine final --engine hf --workload nanovllm --num-seqs 64 --max-input-len 512 \
        --max-output-len 256 --shape qwen3-0.6b --out "$OUT/hf_vs_final_qwen3-0.6b_$TAG.json" ;;
    serve)  # c clients, max_num_seqs=c, on 4c requests of the nanovllm workload up to 64 clients (8 for one), 2c past it;
      logs=$(mktemp -d)  # the offline engine on the same requests after each; the server logs stay out of the results
      for c in 1 16 64 128 256; do
        n=$((c <= 64 ? 4 * c : 2 * c)); [ $n -lt 8 ] && n=8
        LIMIT=$((LIMIT < 240 ? LIMIT : 240)) step "$PY" -m benchmarks.serve_bench --shape qwen3-0.6b --offline \
          --start-timeout 90 --request-timeout 60 --num-seqs $n --concurrency $c \
          --engine-option max_num_seqs=$c --out "$OUT/serve_qwen3-0.6b_c${c}_$TAG.json" --server-log "$logs/server_c$c.log"
      done
      echo "=== server logs: $logs" ;;
    kv-quality)
      step "$PY" -m benchmarks.kv_cache_quality --device cuda --random-layers 0 --out "$OUT/kv_cache_quality_$TAG.json" ;;
    moe)
      step "$PY" -m benchmarks.moe_layer_bench --out "$OUT/moe_layer_qwen3-30b-a3b_$TAG.json"
      step "${RUN[@]}" --engine final "${TEMP_ONLY[@]}" --workload nanovllm --shape qwen3-30b-a3b \
        --out "$OUT/nanovllm_qwen3-30b-a3b_final_$TAG.json"
      step "$PY" -m benchmarks.decode_latency --engine final --shape qwen3-30b-a3b --batches 1 \
        --out "$OUT/decode_latency_qwen3-30b-a3b_final_$TAG.json" ;;
    tp-message)
      step "$PY" -m benchmarks.tp_message_cost --out "$OUT/tp_message_cost_${TAG}x2.json" ;;
    tp)
      for shape in $SHAPES; do
        extra=(); [ "$shape" = qwen3-8b ] && extra=(--option gpu_memory_utilization=0.8)  # headroom at TP=1
        for tp in $TP_SIZES; do
          step "${RUN[@]}" --engine 07 --workload nanovllm --shape "$shape" --option tensor_parallel_size=$tp "${extra[@]}" \
            --out "$OUT/tp_${shape}_tp${tp}_${TAG}x2.json"
        done
      done
      step "$PY" -m benchmarks.tp_speedup --tag "${TAG}x2" --results "$OUT" --out "$OUT/tp_speedup_${TAG}x2.json" ;;
    *) echo "unknown part $part (see --help)" >&2; exit 2 ;;
  esac
done
exit $status
