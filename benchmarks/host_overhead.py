"""The host's share of an engine step, without a model: each stage's real scheduler, block
manager, input preparation and stats, with the model and the sampler replaced by stubs
that return zeros at once (CPU tensors).

    python -m benchmarks.host_overhead --engine 03 --engine 04 --engine 05
    python -m benchmarks.host_overhead --engine final --out benchmarks/results/host_overhead_final_cpu.json
    python -m benchmarks.host_overhead --engine final --num-blocks 65536 --passes 2 \
        --out benchmarks/results/host_overhead_prefix-hits_final_cpu.json
    python -m benchmarks.host_overhead --engine final --speculative 4 --num-seqs 1 --repeat 5 \
        --out benchmarks/results/host_overhead_verify_final_cpu.json

Runs the nanovllm workload (256 sequences by default) through `engine.step()` and prints
the mean host milliseconds per prefill and per decode step. On a GPU these milliseconds are
spent while the GPU waits (the engines of stages 03-07 synchronise every step), so they add
to the step time of an eager engine one for one.

The final engine overlaps them with the device's work instead (overlap scheduling), so they
bound its step time from below: a step takes at least its host milliseconds. It runs as an
LLM on a tiny random-weight model whose runner's `execute` and sampler are stubs (logits of
64 zeros, token 0 for every row), so what is timed is the rest of generate: scheduling, the
step's input arrays, the sampling batch, resolving tokens, stop checks, outputs. With
`--passes 2` the second generate finds every prompt's full blocks in the prefix cache, freed but
not yet handed out again: what admitting prompts with cache hits costs on a large pool.

`--speculative K` runs greedy requests through two such engines in turn, both without overlap
scheduling (speculation completes each verify step before scheduling the next): plain decoding,
and speculative decoding whose proposer proposes the stubs' token, so every proposal is accepted.
It reports the host's median time of a decode step against a verify step of K proposals: the part
of a verify step's cost over a decode step's that is the host's, not the device's."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import workloads  # noqa: E402
from benchmarks.run import resolve_engine  # noqa: E402


class StubModel:
    def __call__(self, input_ids, positions):
        return torch.zeros(len(input_ids), 1)  # (tokens, 1)

    def compute_logits(self, hidden):
        return torch.zeros(len(hidden), 1)


def stub_sampler(logits, temperatures):
    return torch.zeros(len(logits), dtype=torch.long)


def build_engine(module, num_blocks: int, block_size: int):
    """The stage's LLMEngine with its real scheduler and block manager and a model runner whose
    model, sampler and KV cache are stubs."""
    pkg = module.__name__
    engine_mod = sys.modules[f"{pkg}.engine.llm_engine"]
    runner_mod = sys.modules[f"{pkg}.engine.model_runner"]
    config = sys.modules[f"{pkg}.config"].EngineConfig.from_options(
        "stub", device="cpu", kvcache_block_size=block_size
    )
    runner = object.__new__(runner_mod.ModelRunner)
    runner.config, runner.block_size, runner.device = config, block_size, torch.device("cpu")
    runner.model, runner.sampler, runner.graphs, runner.workers = (
        StubModel(),
        stub_sampler,
        {},
        None,
    )
    runner.num_kvcache_blocks = num_blocks
    engine = object.__new__(engine_mod.LLMEngine)
    engine.model_runner, engine.workers, engine.stats = runner, None, []
    engine.block_manager = sys.modules[f"{pkg}.engine.block_manager"].BlockManager(
        num_blocks, block_size
    )
    engine.scheduler = sys.modules[f"{pkg}.engine.scheduler"].Scheduler(
        config, [], engine.block_manager
    )
    return engine


def stub_llm(module, num_seqs: int, num_blocks: int, **options):
    """The final engine's LLM on a tiny random-weight model, its runner's `execute` and sampler
    stubbed: logits of 64 zeros, token 0 for every row."""
    from tools.tiny_model import cached_model

    path = cached_model("tiny-qwen3-4k", arch="qwen3", shape="tiny", max_position_embeddings=4096)
    llm = module.LLM(
        str(path),
        device="cpu",
        max_num_seqs=num_seqs,
        max_model_len=4096,
        num_kvcache_blocks=num_blocks,
        **options,
    )
    runner = llm._engine().model_runner
    runner.execute = lambda step, carried=None: torch.zeros(
        len(step.sample_rows), 64
    )  # (rows, vocab) logits
    runner.sampler = lambda logits, temperatures, **kwargs: torch.zeros(
        len(logits), dtype=torch.long
    )
    return llm


def nanovllm_workload(num_seqs: int, max_output_len: int):
    return workloads.make_workload(
        "nanovllm",
        vocab_size=512,
        max_token_id=500,
        num_seqs=num_seqs,
        max_output_len=max_output_len,
    )


def measure_final(
    module, num_seqs: int, max_output_len: int, num_blocks: int, passes: int = 1
) -> list[dict]:
    """The final engine's generate over the workload with the device's work stubbed out, `passes`
    times on one engine: from the second pass on, every prompt's full blocks are prefix-cache
    hits on blocks that were freed (each hit takes its block out of the free list)."""
    prompts, params = nanovllm_workload(num_seqs, max_output_len)
    llm = stub_llm(module, num_seqs, num_blocks)
    rows = []
    for i in range(passes):
        llm.stats.clear()
        hits = llm._engine().block_manager.num_hit_tokens
        start = time.perf_counter()
        llm.generate(prompts, [module.SamplingParams(**p) for p in params], use_tqdm=False)
        seconds = time.perf_counter() - start
        kinds = {
            "prefill": [s["seconds"] for s in llm.stats if s["is_prefill"]],
            "decode": [s["seconds"] for s in llm.stats if not s["is_prefill"]],
        }
        rows.append(
            {
                "engine": "final",
                "pass": i + 1,
                "num_blocks": num_blocks,
                "steps": len(llm.stats),
                "seconds": seconds,
                "prefix_hit_tokens": llm._engine().block_manager.num_hit_tokens - hits,
                **{f"{k}_steps": len(v) for k, v in kinds.items()},
                **{f"{k}_ms_mean": statistics.fmean(v) * 1e3 for k, v in kinds.items() if v},
                **{f"{k}_ms_median": statistics.median(v) * 1e3 for k, v in kinds.items() if v},
            }
        )
    llm.shutdown()
    return rows


class ZeroProposer:
    """Proposes token 0, the stub sampler's and the zero logits' argmax: every proposal is
    accepted."""

    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        return [[0] * k for k in ks]


def measure_verify(module, num_seqs: int, max_output_len: int, num_blocks: int, k: int) -> dict:
    """Greedy requests through two stubbed engines in turn, without overlap scheduling (as
    speculation runs): plain decoding, and speculative decoding of k proposals a step with every
    proposal accepted. The host's median time of a decode step (num_seqs tokens) against a verify
    step (num_seqs x (k + 1) tokens, k + 1 emitted per sequence)."""
    prompts, params = nanovllm_workload(num_seqs, max_output_len)
    greedy = [
        module.SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=True)
        for p in params
    ]
    spec = {"method": "ngram", "num_speculative_tokens": k}
    engines = {
        "decode": (stub_llm(module, num_seqs, num_blocks, overlap_scheduling=False), num_seqs),
        "verify": (
            stub_llm(module, num_seqs, num_blocks, speculative_config=spec),
            num_seqs * (k + 1),
        ),
    }
    engines["verify"][0]._engine().speculator.proposer = ZeroProposer()
    row = {"engine": "final", "num_seqs": num_seqs, "speculative_tokens": k}
    for kind, (llm, tokens) in engines.items():
        llm.stats.clear()
        start = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        row[f"{kind}_seconds"] = time.perf_counter() - start
        times = [s["seconds"] for s in llm.stats if s["num_tokens"] == tokens]
        row[f"{kind}_steps"] = len(times)
        row[f"{kind}_ms_median"] = statistics.median(times) * 1e3
        llm.shutdown()
    row["verify_over_decode"] = row["verify_ms_median"] / row["decode_ms_median"]
    return row


def measure(
    name: str, num_seqs: int, max_output_len: int, num_blocks: int, passes: int = 1
) -> list[dict]:
    label, module = resolve_engine(name)
    if label == "final":
        return measure_final(module, num_seqs, max_output_len, num_blocks, passes)
    __import__(f"{module.__name__}.engine.llm_engine")
    seq_mod = sys.modules[f"{module.__name__}.engine.sequence"]
    prompts, params = workloads.make_workload(
        "nanovllm", vocab_size=151936, num_seqs=num_seqs, max_output_len=max_output_len
    )
    engine = build_engine(module, num_blocks, 16)
    for ids, p in zip(prompts, params):
        engine.add(seq_mod.Sequence(ids, module.SamplingParams(**p)))
    start = time.perf_counter()
    while not engine.is_finished():
        engine.step()
    seconds = time.perf_counter() - start
    kinds = {
        "prefill": [s["seconds"] for s in engine.stats if s["is_prefill"]],
        "decode": [s["seconds"] for s in engine.stats if not s["is_prefill"]],
    }
    return [
        {
            "engine": label,
            "steps": len(engine.stats),
            "seconds": seconds,
            **{f"{k}_steps": len(v) for k, v in kinds.items()},
            **{f"{k}_ms_mean": statistics.fmean(v) * 1e3 for k, v in kinds.items() if v},
            **{f"{k}_ms_median": statistics.median(v) * 1e3 for k, v in kinds.items() if v},
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=10689,
        help="the KV pool (default: the blocks the 0.6B shape's H200 run uses; "
        "its whole pool is 65536)",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="final engine: generate this many times on one engine "
        "(the later passes hit the prefix cache)",
    )
    parser.add_argument(
        "--speculative",
        type=int,
        metavar="K",
        help="final engine: a verify step of K proposals (every one accepted) against a decode "
        "step, both greedy without overlap scheduling",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.speculative is not None and args.engine != ["final"]:
        parser.error("--speculative measures the final engine alone: --engine final")
    if args.speculative is not None and args.speculative < 1:
        parser.error(f"--speculative K needs K >= 1 proposals a step, got {args.speculative}")
    rows = []
    for _ in range(args.repeat):
        for name in args.engine:
            sizes = (args.num_seqs, args.max_output_len, args.num_blocks)
            if args.speculative is not None:
                new = [measure_verify(resolve_engine(name)[1], *sizes, args.speculative)]
            else:
                new = measure(name, *sizes, args.passes)
            for row in new:
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
