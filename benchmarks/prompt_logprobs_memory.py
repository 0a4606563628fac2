"""What scoring a prompt costs (SamplingParams.prompt_logprobs): one prompt of max_model_len - 1
tokens, generated once without and once with prompt_logprobs, on one engine; the device's peak
memory over each run (torch.cuda.max_memory_allocated; on a CPU, the profiler's peak of torch's
allocations) next to the bytes of the prompt x vocabulary float32 logits that scoring it at once
would hold, and each run's time.

    python -m benchmarks.prompt_logprobs_memory --shape qwen3-0.6b --max-model-len 8192 \
        --out benchmarks/results/prompt_logprobs_memory_qwen3-0.6b_h200.json
    python -m benchmarks.prompt_logprobs_memory --shape tiny --device cpu --max-model-len 512   # a check that it runs

Random weights of the shape (tools/tiny_model.py), nothing downloaded."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_during(fn, device: str) -> tuple[int, float]:
    """(peak bytes allocated above what was allocated before, seconds) of fn()."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, start = torch.cuda.memory_allocated(), time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, time.perf_counter() - start
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="also the rows of logits scored at once"
    )
    parser.add_argument("--top", type=int, default=5, help="prompt_logprobs' k")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from nanovllm_final import LLM, SamplingParams
    from tools.tiny_model import cached_model

    shape = args.shape
    path = cached_model(
        f"scoring-{shape}",
        arch=None if shape != "tiny" else "qwen3",
        shape=shape,
        **({"max_position_embeddings": args.max_model_len} if shape == "tiny" else {}),
    )
    n = args.max_model_len - 1
    with LLM(
        str(path),
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_model_len,
    ) as llm:
        vocab = llm.model_config.vocab_size
        runs = {}
        for seed, (name, k) in enumerate(
            (("warm-up", None), ("plain", None), ("prompt_logprobs", args.top))
        ):
            # a prompt of its own per run: no prefix-cache hit makes one run's prefill shorter
            prompt = torch.randint(
                3, min(vocab, 500), (n,), generator=torch.Generator().manual_seed(seed)
            ).tolist()
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
            out = {}
            peak, seconds = peak_during(
                lambda: out.update(llm.generate([prompt], params, use_tqdm=False)[0]), args.device
            )
            if name != "warm-up":
                runs[name] = {"peak_bytes": peak, "seconds": round(seconds, 4)}
        assert len(out["prompt_logprobs"]) == n
    full = n * vocab * 4
    record = {
        "what": "peak memory of one max_model_len - 1 prompt, without and with prompt_logprobs",
        "shape": shape,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompt_tokens": n,
        "vocab_size": vocab,
        "prompt_logprobs": args.top,
        "rows_at_once": args.max_num_seqs,
        "full_logits_bytes": full,
        "runs": runs,
        "extra_peak_bytes": runs["prompt_logprobs"]["peak_bytes"] - runs["plain"]["peak_bytes"],
    }
    print(f"{shape}, {n} prompt tokens, vocab {vocab}, on {record['device']}")
    print(f"{'run':<16}{'peak MiB':>10}{'seconds':>10}")
    for name, run in runs.items():
        print(f"{name:<16}{run['peak_bytes'] / 2**20:>10.1f}{run['seconds']:>10.3f}")
    print(
        f"prompt x vocab float32 logits: {full / 2**20:.1f} MiB; scoring added {record['extra_peak_bytes'] / 2**20:.1f} MiB"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
