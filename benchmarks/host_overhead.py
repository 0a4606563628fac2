"""The host's share of an engine step, without a model: each stage's real scheduler, block
manager, input preparation and stats, with the model and the sampler replaced by stubs
that return zeros at once (CPU tensors).

    python -m benchmarks.host_overhead --engine 03 --engine 04 --engine 05

Runs the nanovllm workload (256 sequences by default) through `engine.step()` and prints
the mean host milliseconds per prefill and per decode step. On a GPU these milliseconds are
spent while the GPU waits (the engines of stages 03-07 synchronise every step), so they add
to the step time of an eager engine one for one."""

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
    config = sys.modules[f"{pkg}.config"].EngineConfig.from_options("stub", device="cpu", kvcache_block_size=block_size)
    runner = object.__new__(runner_mod.ModelRunner)
    runner.config, runner.block_size, runner.device = config, block_size, torch.device("cpu")
    runner.model, runner.sampler, runner.graphs, runner.workers = StubModel(), stub_sampler, {}, None
    runner.num_kvcache_blocks = num_blocks
    engine = object.__new__(engine_mod.LLMEngine)
    engine.model_runner, engine.workers, engine.stats = runner, None, []
    engine.block_manager = sys.modules[f"{pkg}.engine.block_manager"].BlockManager(num_blocks, block_size)
    engine.scheduler = sys.modules[f"{pkg}.engine.scheduler"].Scheduler(config, [], engine.block_manager)
    return engine


def measure(name: str, num_seqs: int, max_output_len: int, num_blocks: int) -> dict:
    label, module = resolve_engine(name)
    __import__(f"{module.__name__}.engine.llm_engine")
    seq_mod = sys.modules[f"{module.__name__}.engine.sequence"]
    prompts, params = workloads.make_workload("nanovllm", vocab_size=151936, num_seqs=num_seqs, max_output_len=max_output_len)
    engine = build_engine(module, num_blocks, 16)
    for ids, p in zip(prompts, params):
        engine.add(seq_mod.Sequence(ids, module.SamplingParams(**p)))
    start = time.perf_counter()
    while not engine.is_finished():
        engine.step()
    seconds = time.perf_counter() - start
    kinds = {"prefill": [s["seconds"] for s in engine.stats if s["is_prefill"]],
             "decode": [s["seconds"] for s in engine.stats if not s["is_prefill"]]}
    return {"engine": label, "steps": len(engine.stats), "seconds": seconds,
            **{f"{k}_steps": len(v) for k, v in kinds.items()},
            **{f"{k}_ms_mean": statistics.fmean(v) * 1e3 for k, v in kinds.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=10689, help="the H200 run's pool (0.6B shape)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        for name in args.engine:
            row = measure(name, args.num_seqs, args.max_output_len, args.num_blocks)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
