"""A verify step against a decode step on one GPU, profiled: where a verify step's extra time goes.

    python -m benchmarks.verify_profile --shape qwen3-0.6b --batch 1 --k 4 \\
        --out benchmarks/results/verify_profile_qwen3-0.6b_h100.json

Two engines without overlap scheduling, so that each engine step launches one model step and
completes it: plain decoding, and speculation with the benchmark-only replay proposer at
acceptance 1 (engine/proposers.py's ReplayProposer: every step verifies 1 + k tokens a sequence).
Per engine and kind of step (decode, verify):

    step_ms         the median unprofiled step time (llm.stats), over --repeat generates
    profile         one generate under torch.profiler (benchmarks/profiling.py): per step the
                    host time before the GPU's first activity, the GPU's busy time, its idle
                    gaps by the pair of activities around them (the gap before a CUDA graph's
                    first kernel is the graph's launch), the kernels taking the most GPU time
    replay_host_us  the host time of one replay() of the step's CUDA graph, the GPU idle before it
    replay_back_to_back_us  per replay, replays queued back to back (the GPU time, launches hidden)

`python -m benchmarks.spec_decode` times the same two kinds of step in whole runs."""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.profiling import profile_generate
from benchmarks.run import command_line, device_name, model_for_shape, versions, write_json
from benchmarks.spec_decode import fixed_point
from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine.proposers import ReplayProposer


def profiled(llm: LLM, prompts, params, tokens: int, kind: str) -> dict:
    """One generate under torch.profiler (profiling.profile_generate), the steps that feed
    `tokens` tokens summarised as `kind` (other steps, such as the prompt's, as "other")."""
    report = profile_generate(
        llm, prompts, params, kind_of=lambda row: kind if row["num_tokens"] == tokens else "other"
    )
    if report["profiled_steps"] != report["num_steps"]:  # a call that ran no step shifts kinds
        raise RuntimeError(
            f"{report['profiled_steps']} profiled steps against {report['num_steps']} engine steps"
        )
    return {key: report[key][kind] for key in ("summary", "top_kernels", "top_gaps")}


def replay_times(llm: LLM, kind: str, batch: int, replays: int = 50) -> dict:
    """Host microseconds of one replay of the (kind, batch) graph from an idle GPU (median), and
    the microseconds per replay of `replays` queued back to back."""
    graph = llm.engine.model_runner.cuda_graphs.graphs[(kind, batch)]
    host = []
    for _ in range(replays):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return {
        "replay_host_us": statistics.median(host) * 1e6,
        "replay_back_to_back_us": (time.perf_counter() - start) / replays * 1e6,
    }


def measure(llm: LLM, prompts, params, kind: str, tokens: int, batch: int, repeat: int) -> dict:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    before = len(llm.stats)
    for _ in range(repeat):
        llm.generate(prompts, params, use_tqdm=False)
    times = [s["seconds"] * 1e3 for s in list(llm.stats)[before:] if s["num_tokens"] == tokens]
    out = {"step_ms": statistics.median(times), "steps": len(times)}
    out["profile"] = profiled(llm, prompts, params, tokens, kind)
    if llm.engine.model_runner.cuda_graphs is None:  # eager (CPU): no graph to replay
        return out
    return out | replay_times(llm, kind, batch)


def compare(path: str, prompts, params, options: dict, k: int, repeat: int) -> dict:
    """{"decode": ..., "verify": ...}: `measure` of plain decoding, and of speculation with k
    proposals a step, every one accepted (the replay proposer on plain decoding's output)."""
    batch = len(prompts)
    with LLM(path, **options) as llm:
        runs = [
            o["prompt_token_ids"] + o["token_ids"]
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        decode = measure(llm, prompts, params, "decode", batch, batch, repeat)
    spec = {"method": "ngram", "num_speculative_tokens": k}
    with LLM(path, speculative_config=spec, **options) as llm:
        vocab = llm.engine.model_config.vocab_size
        runs = fixed_point(llm, prompts, params, runs, vocab)
        llm.engine.speculator.proposer = ReplayProposer(runs, 1.0, vocab, seed=0)
        verify = measure(llm, prompts, params, "verify", batch * (k + 1), batch, repeat)
    return {"decode": decode, "verify": verify}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b", help="benchmarks/run.py SHAPES")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5, help="timed generates per engine")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.verify_profile needs a CUDA GPU (it profiles CUDA-graph replays)")
    path = str(model_for_shape(args.shape, "cuda"))
    g = torch.Generator().manual_seed(args.batch)
    prompts = [
        torch.randint(0, 10000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(
        device="cuda",
        max_num_seqs=args.batch,
        overlap_scheduling=False,
        max_model_len=args.prompt_len + args.max_tokens + args.k + 64,
    )
    steps = compare(path, prompts, params, options, args.k, args.repeat)
    decode, verify = steps["decode"], steps["verify"]
    for name, m in (("decode", decode), ("verify", verify)):
        p = m["profile"]["summary"]
        print(
            f"{name}: step {m['step_ms']:.3f} ms; profiled: GPU busy {p['mean_gpu_ms']:.3f} ms, "
            f"before its first activity {p['mean_before_ms']:.3f} ms, {p['mean_kernels']:.0f} "
            f"activities; graph replay() {m['replay_host_us']:.0f} us on the host, "
            f"{m['replay_back_to_back_us']:.0f} us back to back",
            flush=True,
        )
        for gap in m["profile"]["top_gaps"][:4]:
            print(f"    idle {gap['ms_per_step'] * 1e3:6.1f} us a step  {gap['between']}")
    print(f"verify / decode step: {verify['step_ms'] / decode['step_ms']:.3f}")
    record = {
        "benchmark": "verify_profile",
        "shape": args.shape,
        "batch": args.batch,
        "k": args.k,
        "device_name": device_name("cuda"),
        "decode": decode,
        "verify": verify,
        "verify_over_decode": verify["step_ms"] / decode["step_ms"],
        "command": command_line("benchmarks.verify_profile", sys.argv[1:]),
        "versions": versions(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.out:
        write_json([record], Path(args.out))


if __name__ == "__main__":
    main()
