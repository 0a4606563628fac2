import time

from ..config import EngineConfig, ModelConfig
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


class LLMEngine:
    """The engine loop: schedule, run the model once, append the sampled tokens."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.model_runner = ModelRunner(config, model_config)
        # the runner sized the block pool; the scheduler hands it out
        self.block_manager = BlockManager(
            self.model_runner.num_kvcache_blocks, config.kvcache_block_size
        )
        self.scheduler = Scheduler(config, model_config.eos_token_ids, self.block_manager)
        self.stats: list[dict] = []  # one record per step, for notebooks and benchmarks

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> list[Sequence]:
        """One model forward; returns the sequences that finished in it."""
        start = time.perf_counter()
        hits_before = self.block_manager.num_hit_tokens
        seqs = self.scheduler.schedule()  # decodes and prompt chunks mix
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        is_prefill = any(seq.num_cached_tokens < len(seq) - 1 for seq in seqs)  # not only decodes
        chunked = sum(
            1 for seq in seqs if seq.num_cached_tokens + seq.num_scheduled_tokens < len(seq)
        )
        hit_tokens = self.block_manager.num_hit_tokens - hits_before  # blocks admission reused
        token_ids = self.model_runner.run(seqs)
        finished = self.scheduler.postprocess(seqs, token_ids)
        bm = self.block_manager
        self.stats.append(
            {
                "step": len(self.stats),
                "num_seqs": len(seqs),
                "num_tokens": num_tokens,  # tokens run through the model
                "is_prefill": is_prefill,
                "seconds": time.perf_counter() - start,
                # slots held by blocks in use vs slots holding real K/V
                "kv_slots_reserved": (bm.num_blocks - bm.num_free_blocks) * bm.block_size,
                "kv_slots_used": sum(seq.num_cached_tokens for seq in self.scheduler.running),
                "kv_slots_allocated": bm.num_blocks * bm.block_size,
                # the block pool and the queues
                "blocks_used": bm.num_blocks - bm.num_free_blocks,
                "blocks_free": bm.num_free_blocks,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_tokens": hit_tokens,
                "prefix_hit_blocks": hit_tokens // bm.block_size,
                "chunked_prefills": chunked,  # sequences that fed only part of their prompt
            }
        )
        return finished

    def shutdown(self) -> None:
        self.model_runner.shutdown()
