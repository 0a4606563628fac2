"""The host's side of a constrained decode step, against a simulated device: the final engine's
real scheduler, inputs, grammar matchers, mask fill and completion, with the model's forward pass
and the draw replaced by a device thread that takes `--forward-ms` and `--sample-ms` per step, in
order, while the host goes on (as a GPU does under overlap scheduling).

    python -m benchmarks.structured_host --batch 256 --forward-ms 2.5 \
        --out benchmarks/results/structured_host_cpu.json

Every row free, then every row under the JSON schema of structured_bench (LONG: no row ends
early), then so again with the masks filled on the engine's thread (`fill_here`). Each mode
reports the median decode step of the full batch (llm.stats) and the engine thread's CPU time a
step (`time.thread_time`), each the least of `--repeat` runs. A step lasts max(device, host):
when the engine thread's work (scheduling, inputs, completion, and for constrained rows the
matchers' advance and, with `fill_here`, the mask's fill) outlasts the simulated forward pass,
the step grows. The CPU time is the steadier measure on a machine shared with other work, whose
load moves the step times by more than the grammar costs. The draw's tokens are allowed ones,
picked at random on the device thread; its own host work (the mask's upload, kernel launches) is
not simulated."""

import argparse
import contextlib
import json
import os
import queue
import statistics
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch

from benchmarks.run import model_for_shape, versions
from benchmarks.structured_bench import LONG
from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine import structured
from nanovllm_final.engine.sampling import SampledTokens


class Device:
    """A device thread: runs what is queued, in order, each taking its time."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def queue(self, seconds: float, work=None) -> threading.Event:
        done = threading.Event()
        self.jobs.put((seconds, work, done))
        return done

    def _run(self) -> None:
        while True:
            seconds, work, done = self.jobs.get()
            end = time.perf_counter() + seconds
            try:
                if work is not None:
                    work()
                time.sleep(max(0.0, end - time.perf_counter()))
            finally:
                done.set()  # a draw that raised leaves no tokens: the engine's step fails, nothing hangs


class Pending:
    """A simulated draw's tokens, ready when the device has run it."""

    def __init__(
        self, device: Device, seconds: float, num_rows: int, grammar, rng: np.random.Generator
    ):
        self.token_ids = torch.zeros(num_rows, dtype=torch.long)
        self.ids: list[int] = []
        self.done = device.queue(seconds, lambda: self._draw(num_rows, grammar, rng))

    def _draw(self, num_rows: int, grammar, rng: np.random.Generator) -> None:
        ids = np.zeros(num_rows, np.int64)
        if (
            grammar is not None
        ):  # a random allowed token in each constrained row: a random set bit of a random word
            rows, bitmask = grammar.rows, grammar.bitmask  # (c,), (c, words) int32
            word = np.where(bitmask != 0, rng.random(bitmask.shape), -1.0).argmax(axis=1)  # (c,)
            bits = np.unpackbits(
                bitmask[np.arange(len(rows)), word].view(np.uint8).reshape(-1, 4),
                axis=1,
                bitorder="little",
            )  # (c, 32)
            ids[rows] = 32 * word + np.where(bits == 1, rng.random(bits.shape), -1.0).argmax(axis=1)
        self.ids = ids.tolist()

    def result(self) -> SampledTokens:
        self.done.wait()
        return SampledTokens(self.ids, None)


def simulate(llm: LLM, forward_s: float, sample_s: float) -> None:
    """The runner's forward pass and draw replaced by the simulated device's."""
    runner, device, rng = llm.engine.model_runner, Device(), np.random.default_rng(0)

    def execute(step, carried=None):
        device.queue(forward_s)
        runner.prompt_scores = None
        return torch.empty(len(step.sample_rows), 1) if len(step.sample_rows) else None

    runner.execute = execute
    runner.sample = lambda logits, batch: Pending(device, sample_s, len(logits), batch.grammar, rng)


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(step ms: the median decode step of the full batch, the engine's thread's CPU ms a step: what
    other processes on the machine disturb least) of a generate after a warm-up one."""
    llm.generate(prompts, params, use_tqdm=False)
    before, cpu = len(llm.stats), time.thread_time()
    llm.generate(prompts, params, use_tqdm=False)
    cpu, stats = time.thread_time() - cpu, list(llm.stats)[before:]
    decode = [s["seconds"] for s in stats if not s["is_prefill"] and s["num_seqs"] == len(prompts)]
    return statistics.median(decode) * 1e3, cpu / len(stats) * 1e3


@contextlib.contextmanager
def fill_here():
    """The masks filled on the engine's thread, before the host completes the step before (the draw
    still waits for the next step's inputs): what the mask worker takes off that thread."""

    def now(self, *args):
        done = Future()
        done.set_result(self.bitmask(*args))
        return done

    later, structured.Grammars.fill_later = structured.Grammars.fill_later, now
    try:
        yield
    finally:
        structured.Grammars.fill_later = later


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--forward-ms", type=float, default=2.5, help="the simulated forward pass of a decode step"
    )
    parser.add_argument("--sample-ms", type=float, default=0.05, help="the simulated draw")
    parser.add_argument(
        "--fill-threads",
        type=int,
        default=None,
        help="xgrammar's threads filling a mask, whatever "
        "the vocabulary (default: the engine's choice; more than the rows' work pays for slow it down)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of both modes, alternating: the fastest of each"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.fill_threads is not None:
        structured.FILL_THREADS, structured.POOL_VOCAB = args.fill_threads, 0
    structured.Grammars.fill_on_worker = (
        True  # the placement whose fill this compares: draws held back
    )
    path = model_for_shape("tiny-qwen3", "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (32,), generator=g).tolist() for _ in range(args.batch)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        structured_outputs={"json": LONG},
    )
    with LLM(
        path,
        device="cpu",
        max_num_seqs=args.batch,
        max_model_len=48 + args.max_tokens,
        overlap_scheduling=True,
    ) as llm:
        simulate(llm, args.forward_ms / 1e3, args.sample_ms / 1e3)
        runs = []
        for _ in range(args.repeat):
            run = {
                mode: measure(llm, prompts, p)
                for mode, p in (("free", free), ("constrained", constrained))
            }
            with fill_here():
                run["constrained_fill_here"] = measure(llm, prompts, constrained)
            runs.append(run)
    row = {}
    for mode in runs[0]:  # the fastest of the runs: the least disturbed by other processes
        row[f"{mode}_ms"] = round(min(run[mode][0] for run in runs), 3)
        row[f"{mode}_engine_thread_cpu_ms"] = round(min(run[mode][1] for run in runs), 3)
    row |= {
        "ratio": round(row["constrained_ms"] / row["free_ms"], 3),
        "ratio_fill_here": round(row["constrained_fill_here_ms"] / row["free_ms"], 3),
    }
    threads = "the engine's choice" if args.fill_threads is None else args.fill_threads
    print(
        f"simulated device {args.forward_ms} + {args.sample_ms} ms, batch {args.batch}, fill threads {threads}: "
        f"step (engine thread's CPU) ms",
        flush=True,
    )
    for mode in runs[0]:
        print(
            f"  {mode:22} {row[f'{mode}_ms']:6.2f} ({row[f'{mode}_engine_thread_cpu_ms']:.2f})",
            flush=True,
        )
    if args.out:
        record = {
            "benchmark": "structured_host",
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "forward_ms": args.forward_ms,
            "sample_ms": args.sample_ms,
            "fill_threads": args.fill_threads,
            "repeat": args.repeat,
            "cpu_count": os.cpu_count(),
            **row,
            "versions": versions(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
