"""Host cost of the message that rank 0 sends each tensor-parallel worker every step.

    python -m benchmarks.tp_message_cost --out benchmarks/results/tp_message_cost_cpu.json

Stage 07 used to send the scheduled `Sequence` objects themselves (`("run", (seqs,))`):
their token lists grow with every generated token, and each worker rebuilt the step's
input lists from them, as rank 0 does. Now rank 0 builds the step's arrays once
(`ModelRunner.prepare`) and sends only those (`("execute", (step,))`).

Two steps of nano-vllm's workload (256 sequences, prompts of 100-1024 tokens,
max_tokens 100-1024, block size 16): a decode step where every sequence has generated
half of its tokens, and a prefill step of the first 16 prompts. For each, the median
over `--repeat` runs of: the message's size; rank 0's host work per step (build the
inputs, pickle the message); a worker's (unpickle, and before: build the inputs again).
Pure host work, no model, no processes: the numbers are the same with gloo or NCCL."""

import argparse
import importlib
import json
import pickle
import platform
import statistics
import time
from types import SimpleNamespace

from benchmarks.run import device_name, git_commit, resolve_engine, versions
from benchmarks.workloads import make_workload

BLOCK_SIZE = 16  # EngineConfig.kvcache_block_size's default


def decode_batch(st, prompts, params) -> list:
    """Every sequence halfway through its output, one token to feed."""
    seqs, next_block = [], 0
    for prompt, p in zip(prompts, params):
        seq = st.Sequence(prompt, st.SamplingParams(**p))
        seq.token_ids.extend(range(p["max_tokens"] // 2))  # generated so far
        seq.num_cached_tokens = len(seq) - 1
        seq.num_scheduled_tokens = 1
        blocks = -(-len(seq) // BLOCK_SIZE)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    return seqs


def prefill_batch(st, prompts, params) -> list:
    """Whole prompts, nothing cached."""
    seqs, next_block = [], 0
    for prompt, p in zip(prompts, params):
        seq = st.Sequence(prompt, st.SamplingParams(**p))
        seq.num_scheduled_tokens = len(seq)
        blocks = -(-len(seq) // BLOCK_SIZE)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    return seqs


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(runner_cls, seqs: list, repeat: int) -> dict:
    runner = SimpleNamespace(block_size=BLOCK_SIZE)  # prepare() reads only the block size
    prepare = lambda: runner_cls.prepare(runner, seqs)
    old_message = pickle.dumps(("run", (seqs,)))
    step = prepare()
    new_message = pickle.dumps(("execute", (step,)))
    old_worker = lambda: runner_cls.prepare(runner, pickle.loads(old_message)[1][0])
    return {
        "num_seqs": len(seqs),
        "num_tokens": int(len(step.input_ids)),
        "context_tokens": sum(len(s) for s in seqs),
        "before": {
            "message_bytes": len(old_message),
            "rank0_us": median_us(lambda: (prepare(), pickle.dumps(("run", (seqs,)))), repeat),
            "worker_us": median_us(old_worker, repeat),
        },
        "after": {
            "message_bytes": len(new_message),
            "rank0_us": median_us(lambda: pickle.dumps(("execute", (prepare(),))), repeat),
            "worker_us": median_us(lambda: pickle.loads(new_message), repeat),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="07_tensor_parallel")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    engine, st = resolve_engine(args.engine)
    runner_cls = importlib.import_module(f"{st.__name__}.engine.model_runner").ModelRunner
    st = SimpleNamespace(
        Sequence=importlib.import_module(f"{st.__name__}.engine.sequence").Sequence,
        SamplingParams=st.SamplingParams,
    )
    prompts, params = make_workload("nanovllm", vocab_size=151936)
    record = {
        "benchmark": "tp_message_cost",
        "engine": engine,
        "block_size": BLOCK_SIZE,
        "repeat": args.repeat,
        "decode": measure(runner_cls, decode_batch(st, prompts, params), args.repeat),
        "prefill": measure(runner_cls, prefill_batch(st, prompts[:16], params[:16]), args.repeat),
        "cpu": device_name("cpu"),
        "hostname": platform.node(),
        "versions": versions(),
        **git_commit(),
    }
    for name in ("decode", "prefill"):
        r = record[name]
        print(
            f"{name}: {r['num_seqs']} seqs, {r['num_tokens']} tokens fed, {r['context_tokens']} in context"
        )
        for when in ("before", "after"):
            m = r[when]
            print(
                f"  {when:6s} message {m['message_bytes'] / 1024:8.1f} KiB   rank 0 {m['rank0_us'] / 1e3:7.2f} ms"
                f"   worker {m['worker_us'] / 1e3:7.2f} ms"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
