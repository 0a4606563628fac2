"""What an fp8 KV cache costs in quality, and what it buys in blocks: kv_cache_dtype="auto"
(the model's dtype) against "fp8", on the same prompts, greedy.

    python -m benchmarks.kv_cache_quality --out benchmarks/results/kv_cache_quality_cpu.json
    python -m benchmarks.kv_cache_quality --device cuda --random-shape qwen3-0.6b --random-layers 0 \
        --out benchmarks/results/kv_cache_quality_h200.json

Models: the course model (models/course-llama, English stories, English prompts) and a
random-weight model of a real checkpoint's shape (tools/tiny_model; `--random-layers N` keeps
its first N layers so that it runs on a CPU, 0 keeps them all), on seeded random token ids.

Per model and fp8 variant, against "auto":
* greedy agreement: per prompt, the share of the `--max-tokens` positions before the first
  token that differs; and the share of prompts whose completions are equal.
* mean |delta logprob| of the chosen tokens, teacher-forced: for every position j of
  auto's completion, the prompt plus its first j tokens is one request of max_tokens=1 with
  `logprobs`; the logprob of auto's token j under each cache (auto computed the same way).
  A token outside fp8's top `--top-logprobs` is counted in `missing`, not in the mean.
* blocks per GiB of KV cache (the runner's block size in bytes) for auto, bfloat16 and fp8.

Variants: "fp8, scale 1.0" (the engine's: one fixed scale 1.0 per layer and kv head, vLLM's
default without calibration); "fp8, calibrated": per layer and kv head amax / 448 of the K
and V that the auto engine computes on separate calibration prompts (forward hooks on the
Attention layers), set into the fp8 engine's scales before it runs; "fp8, oracle": the same
amax / 448, but of auto's own K/V on the measured prompts and completions (the best case of
a per-head amax scale: only what fp8's rounding adds upstream can pass it). The amax comes from a fresh eager
engine, so that no K/V comes from its prefix cache or a CUDA-graph replay, unseen."""

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import device_name, versions  # noqa: E402
from nanovllm_final import LLM, SamplingParams  # noqa: E402
from nanovllm_final.layers.attention_torch import FP8_MAX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COURSE_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "Tell me a story about a brave fox named Rusty.",
    "One day, a little girl named Mia found a",
    "The storm came in the night, and",
    "Sam wanted to bake a cake for his mother, so",
    "In a big forest, a tiny rabbit",
    "Lily had a red ball. She",
    "The old dog sat by the door and",
]
COURSE_CALIBRATION = [
    "Once upon a time, a boy named Leo lived near a river.",
    "Tell me a story about a kind bear.",
    "The wind was cold, and the birds flew home.",
    "Anna and her friend shared their apples at the park.",
]


def random_prompts(n: int, seed: int, low: int = 3, high: int = 500) -> list[list[int]]:
    """Seeded random token ids (of the factory's tokenizer), 16 to 48 of them."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def amax_scales(
    llm: LLM, prompts: list, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per Attention layer, (k_scale, v_scale) = amax over the K/V it computes on `prompts`
    (prefill and greedy decode), per kv head, / 448. `llm` must compute them all: eager, and
    no prompt's first block in its prefix cache."""
    layers = llm.engine.model_runner.attention_layers
    amax = [[torch.zeros(layer.num_kv_heads), torch.zeros(layer.num_kv_heads)] for layer in layers]

    def record(i):
        def hook(module, args):  # Attention.forward(positions, q, k, v, rotary, q_norm, k_norm)
            positions, q, k, v, rotary, *norms = (
                args  # k, v: (tokens, kv_heads, head_dim), k before RoPE
            )
            _, k = rotary(positions, q.clone(), k.clone(), *norms)  # the K the cache stores
            for j, x in enumerate((k, v)):
                amax[i][j] = torch.maximum(
                    amax[i][j], x.detach().abs().float().amax(dim=(0, 2)).cpu()
                )

        return hook

    handles = [layer.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        llm.generate(
            prompts,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        for h in handles:
            h.remove()
    return [(k.clamp(min=1e-12) / FP8_MAX, v.clamp(min=1e-12) / FP8_MAX) for k, v in amax]


def release(device: str) -> None:
    """Hand a closed engine's memory back, so that the next engine sizes its cache from it."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def greedy(llm: LLM, prompts: list, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def forced_logprobs(
    llm: LLM, prompt_ids: list[list[int]], completions: list[list[int]], top: int
) -> list[list[float | None]]:
    """Per prompt and position j: the logprob of completions[i][j] after the prompt and its first
    j tokens (None: outside the top `top`)."""
    requests = [p + c[:j] for p, c in zip(prompt_ids, completions) for j in range(len(c))]
    outs = llm.generate(
        requests, SamplingParams(temperature=0.0, max_tokens=1, logprobs=top), use_tqdm=False
    )
    flat, k = [], 0
    for c in completions:
        row = []
        for target in c:
            lp = outs[k]["logprobs"][0]
            row.append(
                lp["logprob"] if lp["token_id"] == target else lp["top_logprobs"].get(target)
            )
            k += 1
        flat.append(row)
    return flat


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix = []
    for r, g in zip(ref, got):
        first = next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix.append(first / len(r))
    return {
        "prefix_agreement": statistics.mean(prefix),
        "exact_match_share": sum(r == g for r, g in zip(ref, got)) / len(ref),
        "prefix_agreement_per_prompt": prefix,
    }


def measure_model(name: str, path: Path, prompts: list, calibration: list, args) -> dict:
    options = dict(
        device=args.device,
        max_model_len=args.max_model_len,
        kvcache_block_size=16,
        attention_backend=args.attention_backend,
    )
    started = time.perf_counter()
    with LLM(str(path), kv_cache_dtype="auto", **options) as llm:
        prompt_ids = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in prompts]
        runner = llm.engine.model_runner
        dtype, auto_bytes = (
            str(runner.dtype).removeprefix("torch."),
            runner.kv_block_bytes(llm.model_config),
        )
        ref = greedy(llm, prompt_ids, args.max_tokens)
        ref_lp = forced_logprobs(llm, prompt_ids, ref, args.top_logprobs)
        text = [llm.tokenizer.decode(t) for t in ref[:2]]
    release(args.device)
    # a fresh engine, eager: the hooks see every token's K/V (none comes from the prefix cache or a graph replay)
    with LLM(str(path), kv_cache_dtype="auto", **(options | {"enforce_eager": True})) as llm:
        scales = {
            "fp8, calibrated": amax_scales(llm, calibration, args.max_tokens),
            "fp8, oracle": amax_scales(llm, prompt_ids, args.max_tokens),
        }
    release(args.device)
    record = {
        "model": name,
        "path": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "dtype": dtype,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "auto_samples": text,
        "variants": {},
    }
    block_bytes = {"auto": auto_bytes, "bfloat16": auto_bytes // runner.kv_dtype.itemsize * 2}
    for variant in ("fp8, scale 1.0", *scales):
        with LLM(str(path), kv_cache_dtype="fp8", **options) as llm:
            runner = llm.engine.model_runner
            block_bytes["fp8"] = runner.kv_block_bytes(llm.model_config)
            if variant in scales:
                for layer, (k, v) in zip(runner.attention_layers, scales[variant]):
                    layer.k_scale.copy_(k)
                    layer.v_scale.copy_(v)
            got = greedy(llm, prompt_ids, args.max_tokens)
            got_lp = forced_logprobs(llm, prompt_ids, ref, args.top_logprobs)
        release(args.device)
        deltas = [
            abs(a - b)
            for ra, rb in zip(ref_lp, got_lp)
            for a, b in zip(ra, rb)
            if a is not None and b is not None
        ]
        missing = sum(b is None for rb in got_lp for b in rb)
        record["variants"][variant] = agreement(ref, got) | {
            # None where no reference token stayed in this variant's top logprobs (see missing)
            "mean_abs_delta_logprob": statistics.mean(deltas) if deltas else None,
            "max_abs_delta_logprob": max(deltas, default=None),
            "missing": missing,
            "positions": sum(map(len, ref)),
        }
    record["kv_block_bytes"] = block_bytes
    record["blocks_per_gib"] = {k: (1 << 30) // v for k, v in block_bytes.items()}
    record["amax_range"] = {  # over layers and kv heads, of the K/V each variant's scales came from
        variant: {
            "k": [
                FP8_MAX * min(float(k.min()) for k, _ in s),
                FP8_MAX * max(float(k.max()) for k, _ in s),
            ],
            "v": [
                FP8_MAX * min(float(v.min()) for _, v in s),
                FP8_MAX * max(float(v.max()) for _, v in s),
            ],
        }
        for variant, s in scales.items()
    }
    record["seconds"] = time.perf_counter() - started
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--course-model", default=str(ROOT / "models" / "course-llama"), help="'' to skip it"
    )
    parser.add_argument(
        "--random-shape", default="qwen3-0.6b", help="tools/tiny_model shape ('' to skip it)"
    )
    parser.add_argument(
        "--random-layers", type=int, default=4, help="keep this many layers of the shape (0: all)"
    )
    parser.add_argument("--num-random-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "kv_cache_quality_cpu.json")
    )
    args = parser.parse_args()
    records = []
    if args.course_model:
        records.append(
            measure_model(
                "course-llama", Path(args.course_model), COURSE_PROMPTS, COURSE_CALIBRATION, args
            )
        )
    if args.random_shape:
        from tools.tiny_model import cached_model

        overrides = {"num_hidden_layers": args.random_layers} if args.random_layers else {}
        name = args.random_shape + (f"-{args.random_layers}layers" if args.random_layers else "")
        path = cached_model(f"kvq-{name}", shape=args.random_shape, device=args.device, **overrides)
        records.append(
            measure_model(
                f"{name} (random weights)",
                path,
                random_prompts(args.num_random_prompts, 0),
                random_prompts(4, 1),
                args,
            )
        )
    result = {
        "benchmark": "kv_cache_quality",
        "device": device_name(args.device),
        "versions": versions(),
        "command": " ".join(["python", "-m", "benchmarks.kv_cache_quality", *sys.argv[1:]]),
        "models": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'model':<32} {'variant':<15} {'prefix agr':>10} {'exact':>6} {'|dlogp|':>8} {'max':>7} {'miss':>5}  blocks/GiB auto, bf16, fp8"
    )
    for r in records:
        for variant, v in r["variants"].items():
            b = r["blocks_per_gib"]
            print(
                f"{r['model']:<32} {variant:<15} {v['prefix_agreement']:>10.3f} {v['exact_match_share']:>6.2f} "
                f"{v['mean_abs_delta_logprob'] or float('nan'):>8.4f} {v['max_abs_delta_logprob'] or float('nan'):>7.3f} "
                f"{v['missing']:>5}  "
                f"{b['auto']} ({r['dtype']}), {b['bfloat16']}, {b['fp8']}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
