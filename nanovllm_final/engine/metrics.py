"""What the engine measures: one record per step (`stats`), and a summary (`summary`)."""

import time

import numpy as np

from .block_manager import BlockManager
from .request import Request
from .scheduler import Scheduler
from .step_input import StepInput


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    a = np.asarray(values)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


class EngineMetrics:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager):
        self.scheduler, self.bm = scheduler, block_manager
        self.reset()

    def reset(self) -> None:
        """Forget what was measured so far (e.g. after a warm-up)."""
        self.hits_at_reset, self.admitted_at_reset = (
            self.bm.num_hit_tokens,
            self.bm.num_admitted_tokens,
        )
        self.preemptions_at_reset = self.scheduler.total_preemptions
        self.stats: list[dict] = []  # one record per step, for notebooks and benchmarks
        self.start_time: float | None = None  # first request's arrival
        self.last_time: float | None = None
        self.num_requests = 0  # finished (or aborted)
        self.prompt_tokens = self.generation_tokens = 0
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.peak_blocks_used = 0

    def on_arrival(self) -> None:
        self.start_time = self.start_time or time.perf_counter()

    def on_finish(self, request: Request) -> None:
        m = request.metrics()
        self.num_requests += 1
        self.prompt_tokens += m.prompt_tokens
        self.generation_tokens += sum(seq.num_completion_tokens for seq in request.seqs)
        if m.ttft_s is not None:
            self.ttfts.append(m.ttft_s)
        if m.tpot_s is not None:
            self.tpots.append(m.tpot_s)
        self.last_time = time.perf_counter()

    def step_record(self, step: StepInput, num_seqs: int, hit_tokens: int) -> dict:
        """A step's record, as the scheduler and the cache stand when it is launched."""
        bm, sched = self.bm, self.scheduler
        used = bm.num_blocks - bm.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        return {
            "num_seqs": num_seqs,
            "num_tokens": step.num_tokens,  # tokens run through the model
            "is_prefill": not step.is_decode,  # the step carries prompt tokens
            # slots held by blocks in use vs slots holding real K/V
            "kv_slots_reserved": used * bm.block_size,
            "kv_slots_used": sum(seq.num_cached_tokens for seq in sched.running),
            "kv_slots_allocated": bm.num_blocks * bm.block_size,
            "blocks_used": used,
            "blocks_free": bm.num_free_blocks,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "preemptions": sched.num_preemptions,
            "prefix_hit_tokens": hit_tokens,  # what admission found in the prefix cache
            "prefix_hit_blocks": hit_tokens // bm.block_size,
            # sequences that fed only part of their prompt (a verifying one samples 1 + its proposals rows)
            "chunked_prefills": num_seqs - len(step.sample_rows) + step.num_proposed,
        }

    def on_step(self, record: dict, seconds: float) -> None:
        """The step completed, `seconds` after the step before it did (or after its launch)."""
        self.stats.append({"step": len(self.stats), **record, "seconds": seconds})

    def summary(self) -> dict:
        """Requests, tokens, throughput, latency percentiles, prefix-cache hit rate, KV usage, preemptions."""
        bm = self.bm
        hits, admitted = (
            bm.num_hit_tokens - self.hits_at_reset,
            bm.num_admitted_tokens - self.admitted_at_reset,
        )
        elapsed = (self.last_time - self.start_time) if self.start_time and self.last_time else 0.0
        return {
            "requests": self.num_requests,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "elapsed_s": elapsed,  # first arrival to last finish
            "generation_throughput_tok_s": self.generation_tokens / elapsed if elapsed else 0.0,
            "ttft_s": percentiles(self.ttfts),
            "tpot_s": percentiles(self.tpots),
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / admitted if admitted else 0.0,
            "kv_usage": (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks,
            "kv_usage_peak": self.peak_blocks_used / bm.num_blocks,
            "preemptions": self.scheduler.total_preemptions - self.preemptions_at_reset,
            "steps": len(self.stats),
        }
